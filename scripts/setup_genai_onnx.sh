#!/usr/bin/env bash
# Install onnxruntime-genai (runtime + its model builder) for embedq's ONNX tests/bench.
#
# onnxruntime-genai 0.18 needs only numpy and onnxruntime>=1.31, and its builder uses
# torch/transformers/onnx/onnx_ir: all already in the main venv (torch 2.13.0 CPU). So it
# is installed with --no-deps into a plain folder, cached outside the repository,
#     ${EMBEDQ_CACHE:-$HOME/.cache/embedq}/genai-site
# that callers put on PYTHONPATH in front of the main venv. Nothing in the main venv
# changes (and torch can never be replaced by a CUDA build this way).
# Idempotent (marker file). Prints the folder on its last line of stdout.
set -euo pipefail
VERSION="${EMBEDQ_GENAI_VERSION:-0.18.0}"
CACHE="${EMBEDQ_CACHE:-$HOME/.cache/embedq}"
SITE="${EMBEDQ_GENAI_SITE:-$CACHE/genai-site}"
PY="${EMBEDQ_PYTHON:-${EMBEDQ_VENV:-$CACHE/venv}/bin/python}"
MARKER="$SITE/.embedq-genai-$VERSION.ok"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [[ ! -f "$MARKER" ]]; then
    rm -rf "$SITE"
    mkdir -p "$SITE"
    "$PY" -m pip install -q --no-deps --target "$SITE" "onnxruntime-genai==$VERSION" >&2
    # the wheel's own checks: it loads against the main venv's onnxruntime
    PYTHONPATH="$SITE" "$PY" -c "import onnxruntime_genai, onnxruntime_genai.models.builder" >&2
    touch "$MARKER"
fi
echo "$SITE"
