#!/usr/bin/env bash
# Create (or reuse) a venv with optimum-onnx, for exporting text-generation-with-past
# ONNX graphs in embedq's ONNX tests and benchmark.
#
# optimum-onnx 0.1.0 pins transformers<4.58 and optimum~=2.1.0, which clash with the main
# venv (transformers 5.x), so it gets its own venv, cached outside the repository:
#     ${EMBEDQ_CACHE:-$HOME/.cache/embedq}/optimum-onnx-venv
# torch is always constrained to 2.13.0 (the CPU wheel on local disk; a loose requirement
# would download a multi-GB CUDA build). Idempotent (marker file).
# Prints the venv's python on its last line of stdout.
set -euo pipefail
VERSION="${EMBEDQ_OPTIMUM_ONNX_VERSION:-0.1.0}"
CACHE="${EMBEDQ_CACHE:-$HOME/.cache/embedq}"
VENV="${EMBEDQ_OPTIMUM_VENV:-$CACHE/optimum-onnx-venv}"
PY="$VENV/bin/python"
MARKER="$VENV/.embedq-optimum-onnx-$VERSION-r2.ok"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [[ ! -f "$MARKER" || ! -x "$PY" ]]; then
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    python3 -m venv "$VENV"
    CONSTRAINTS="$(mktemp)"
    trap 'rm -f "$CONSTRAINTS"' EXIT
    echo "torch==2.13.0" > "$CONSTRAINTS"
    "$PY" -m pip install -q -c "$CONSTRAINTS" "torch==2.13.0" "optimum-onnx==$VERSION" \
        "transformers>=4.50,<4.58" accelerate onnx onnxruntime >&2
    "$PY" -c "import torch, accelerate, optimum.exporters.onnx; assert torch.__version__.startswith('2.13.0')" >&2
    touch "$MARKER"
fi
echo "$PY"
