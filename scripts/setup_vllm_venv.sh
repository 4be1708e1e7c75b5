#!/usr/bin/env bash
# Create (or reuse) the virtual environment in which embedq's vLLM back end is tested.
#
# vLLM 0.33.0 pins torch==2.14.0 and transformers<5.21, which clash with the main
# environment, so it gets its own venv, cached outside the repository:
#     ${EMBEDQ_CACHE:-$HOME/.cache/embedq}/vllm-venv
# Idempotent: a complete venv (marker file present, right vLLM version) is reused as is;
# only the editable embedq install is refreshed (cheap), so a moved checkout still works.
#
# Prints the venv's python path on its last line of stdout.
set -euo pipefail

VLLM_VERSION="${EMBEDQ_VLLM_VERSION:-0.33.0}"
CACHE="${EMBEDQ_CACHE:-$HOME/.cache/embedq}"
VENV="${EMBEDQ_VLLM_VENV:-$CACHE/vllm-venv}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MARKER="$VENV/.embedq-vllm-$VLLM_VERSION.ok"
PY="$VENV/bin/python"

log() { echo "[setup_vllm_venv] $*" >&2; }

# vLLM pins torch==2.14.0 and pulls it (CUDA build) and the CUDA libraries from PyPI; pip
# takes what this machine already has on disk (/opt wheels, local indexes) when versions
# match. A machine-wide pip constraint (here torch<=2.14.1) admits the pin. First run:
# ~2.1 GB downloaded, ~3 minutes, ~9.4 GB venv.
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ -f "$MARKER" && -x "$PY" ]]; then
    log "reusing $VENV (vllm $VLLM_VERSION)"
else
    mkdir -p "$CACHE"
    # A half-built venv (killed install) is rebuilt from scratch: no marker, no trust.
    if [[ -d "$VENV" ]]; then
        log "removing incomplete venv $VENV"
        rm -rf "$VENV"
    fi
    start=$(date +%s)
    log "creating $VENV"
    python3 -m venv "$VENV"
    "$PY" -m pip install --upgrade pip >&2
    log "installing vllm==$VLLM_VERSION (pulls torch and its CUDA libraries: several GB)"
    "$PY" -m pip install "vllm==$VLLM_VERSION" >&2
    touch "$MARKER"
    log "vllm installed in $(( $(date +%s) - start ))s; venv size $(du -sh "$VENV" | cut -f1)"
fi

# embedq itself, editable, with its dependencies, holding vLLM's own pins fixed: embedq's
# pyproject.toml states ranges (torch>=2.13,<3, transformers>=5.20,<6) that vLLM's torch
# and transformers satisfy, and the constraints below make pip keep them (never a CPU or
# newer torch in place of vLLM's). Checked after the install: torch must be unchanged.
TORCH_BEFORE=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')
CONSTRAINTS="$VENV/.embedq-constraints.txt"
"$PY" -m pip freeze 2>/dev/null | grep -iE '^(torch|transformers|vllm|numpy|safetensors|huggingface.hub|tokenizers)==' \
    > "$CONSTRAINTS"
STAMP="$VENV/.embedq-deps.$(sha256sum "$REPO/pyproject.toml" | cut -c1-16)"
if [[ ! -f "$STAMP" ]]; then
    log "installing embedq (editable) and its dependencies, vLLM's pins held"
    "$PY" -m pip install -q -c "$CONSTRAINTS" -e "$REPO" pytest >&2
    rm -f "$VENV"/.embedq-deps.*
    touch "$STAMP"
elif ! out=$("$PY" -m pip install -q --no-deps --no-build-isolation -e "$REPO" 2>&1); then
    echo "$out" >&2
    "$PY" -m pip install -q --no-deps -e "$REPO" >&2
fi
TORCH_AFTER=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')
if [[ "$TORCH_BEFORE" != "$TORCH_AFTER" ]]; then
    log "error: installing embedq changed vLLM's torch ($TORCH_BEFORE -> $TORCH_AFTER)"
    exit 1
fi

echo "$PY"
