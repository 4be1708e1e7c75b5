#!/usr/bin/env bash
# Install node-llama-cpp (prebuilt CPU llama.cpp, no build) for embedq's GGUF tests/bench.
#
# The pin is tests/js/llamacpp/package.json (node-llama-cpp 3.21.1, exact) with its
# package-lock.json; `npm ci` installs exactly that, outside the repository, into
#     ${EMBEDQ_CACHE:-$HOME/.cache/embedq}/llamacpp-node/<lock hash>/node_modules
# The harness (tests/js/llamacpp/generate.mjs) imports it by path, so nothing is written
# into the working tree. No install scripts run: node-llama-cpp's postinstall would build
# llama.cpp where no prebuilt binary fits, and callers ask for getLlama({build: "never"}).
# Idempotent (marker file). Needs node >= 20 and npm. Prints node-llama-cpp's entry (a file
# URL) on its last line of stdout.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$REPO/tests/js/llamacpp"
CACHE="${EMBEDQ_CACHE:-$HOME/.cache/embedq}"
HASH="$(cat "$SRC/package.json" "$SRC/package-lock.json" | sha256sum | cut -c1-16)"
DIR="$CACHE/llamacpp-node/$HASH"
MARKER="$DIR/.embedq-ok"
ENTRY="$DIR/node_modules/node-llama-cpp/dist/index.js"
export npm_config_update_notifier=false npm_config_fund=false npm_config_audit=false
# node runs the client on every call, so it is checked even when the install is cached (a
# warm cache on a machine without node fails here, in the set-up, not later in a test)
command -v node >/dev/null || { echo "[setup_llamacpp] error: node is needed (node >= 20)" >&2; exit 1; }
if [[ ! -f "$MARKER" ]]; then
    command -v npm >/dev/null || { echo "[setup_llamacpp] error: npm is needed to install" >&2; exit 1; }
    rm -rf "$DIR"  # a half-done install (no marker) is redone from scratch
    mkdir -p "$DIR"
    cp "$SRC/package.json" "$SRC/package-lock.json" "$DIR/"
    echo "[setup_llamacpp] npm ci into $DIR" >&2
    (cd "$DIR" && npm ci --ignore-scripts --no-audit --no-fund >&2)
    # the prebuilt CPU binary loads (no build, no download)
    node "$SRC/check.mjs" "file://$ENTRY" >&2
    touch "$MARKER"
fi
echo "file://$ENTRY"
