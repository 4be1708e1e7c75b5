#!/usr/bin/env bash
# Create (or reuse) the virtual environment in which llm-compressor, the peer that
# scripts/bench_quantize.py compares embedq against, runs.
#
# llm-compressor 0.14.0.1 pins compressed-tensors==0.19.0, transformers<=5.17 and
# torch>=2.10,<=2.14.0, which clash with the main environment (transformers 5.24), so it
# gets its own venv, cached outside the repository:
#     ${EMBEDQ_CACHE:-$HOME/.cache/embedq}/llmc-venv
# torch is the CPU build 2.13.0 (the same one embedq pins): on our machines it installs
# from a local wheel, and a loose `torch` would pull a multi-GB CUDA build.
# Idempotent (scripts/venv_lib.sh); embedq itself is not installed here.
#
# Prints the venv's python path on its last line of stdout.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv_lib.sh"

LLMC_VERSION="${EMBEDQ_LLMC_VERSION:-0.14.0.1}"
TORCH_VERSION="${EMBEDQ_LLMC_TORCH:-2.13.0}"
TRANSFORMERS_VERSION="${EMBEDQ_LLMC_TRANSFORMERS:-5.17.0}"
CPU_INDEX="https://download.pytorch.org/whl/cpu"
venv_begin setup_llmcompressor_venv "${EMBEDQ_LLMC_VENV:-$CACHE/llmc-venv}" \
    "llmc-$LLMC_VERSION-torch$TORCH_VERSION"
if venv_needs_build; then
    # The CPU torch wheel first. A local wheel (pip's find-links, e.g. /opt/wheels) named
    # torch-X+cpu satisfies the pin; elsewhere the PyTorch CPU index provides it.
    if ! "$PY" -m pip install -q "torch==${TORCH_VERSION}+cpu" >&2 2>/dev/null; then
        log "no local CPU torch wheel; trying the PyTorch CPU index"
        "$PY" -m pip install -q "torch==${TORCH_VERSION}" --index-url "$CPU_INDEX" >&2
    fi
    log "installing llmcompressor==$LLMC_VERSION, transformers==$TRANSFORMERS_VERSION"
    # torch is already satisfied; pinning it again keeps the resolver from replacing it.
    "$PY" -m pip install -q "llmcompressor==$LLMC_VERSION" "transformers==$TRANSFORMERS_VERSION" \
        "torch==$("$PY" -c 'import torch; print(torch.__version__)')" >&2
    "$PY" -c "import llmcompressor, torch; assert not torch.version.cuda, 'CUDA torch'" >&2
    venv_built
fi
echo "$PY"
