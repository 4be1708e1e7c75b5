#!/bin/sh
# Toolchains of the kernel tests the CPU cannot run natively: the aarch64 test of the
# portable C kernel (tests/perf/test_aarch64.py: Debian's gcc-aarch64-linux-gnu and
# qemu-user) and the AVX-512F source on SIMDe (tests/perf/test_cpu_variants.py:
# libsimde-dev, headers only). Idempotent: does nothing when all are
# installed; otherwise installs them with apt-get (needs root or sudo). The apt lists are
# refreshed at most once a day (stamp under ${EMBEDQ_CACHE:-~/.cache/embedq}).
set -eu
if command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1 \
        && [ -f /usr/include/simde/x86/avx512.h ]; then
    echo "aarch64 toolchain: present ($(aarch64-linux-gnu-gcc -dumpversion), $(command -v qemu-aarch64))"
    exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
CACHE="${EMBEDQ_CACHE:-$HOME/.cache/embedq}"
mkdir -p "$CACHE"
STAMP="$CACHE/.apt-updated"
if [ ! -f "$STAMP" ] || [ -n "$(find "$STAMP" -mmin +1440 2>/dev/null)" ]; then
    $SUDO apt-get update -qq
    touch "$STAMP"
fi
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user libsimde-dev >/dev/null
echo "aarch64 toolchain: installed ($(aarch64-linux-gnu-gcc -dumpversion), $(command -v qemu-aarch64))"
