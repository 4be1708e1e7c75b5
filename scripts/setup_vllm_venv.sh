#!/usr/bin/env bash
# Create (or reuse) the virtual environment in which embedq's vLLM back end is tested.
#
# vLLM 0.33.0 pins torch==2.14.0 and transformers<5.21, which clash with the main
# environment, so it gets its own venv, cached outside the repository:
#     ${EMBEDQ_CACHE:-$HOME/.cache/embedq}/vllm-venv
# vLLM pulls torch (CUDA build) and the CUDA libraries from PyPI; pip takes what this
# machine already has on disk (/opt wheels, local indexes) when versions match. First run:
# ~2.1 GB downloaded, ~3 minutes, ~9.4 GB venv. Idempotent (scripts/venv_lib.sh).
#
# Prints the venv's python path on its last line of stdout.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv_lib.sh"

VLLM_VERSION="${EMBEDQ_VLLM_VERSION:-0.33.0}"
venv_begin setup_vllm_venv "${EMBEDQ_VLLM_VENV:-$CACHE/vllm-venv}" "vllm-$VLLM_VERSION"
if venv_needs_build; then
    log "installing vllm==$VLLM_VERSION (pulls torch and its CUDA libraries: several GB)"
    "$PY" -m pip install "vllm==$VLLM_VERSION" >&2
    venv_built
fi
venv_install_embedq
echo "$PY"
