#!/usr/bin/env bash
# Test embedq's vLLM back end against the real vLLM 0.33.0, in its own cached venv
# (scripts/setup_vllm_venv.sh). Extra arguments go to pytest. The whole-engine runs
# (test_vllm_engine.py) need vLLM's CPU kernels: scripts/test_vllmcpu.sh runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$(scripts/setup_vllm_venv.sh | tail -n 1)"
CACHE="${EMBEDQ_CACHE:-$HOME/.cache/embedq}"
# The real Gemma 3 270M fixture is built by the main environment (it needs gguf);
# reuse it when it is already there.
MAINPY="${EMBEDQ_VENV:-$CACHE/venv}/bin/python"
if [[ -x "$MAINPY" && -f scripts/make_gemma3_fixture.py ]]; then
    "$MAINPY" scripts/make_gemma3_fixture.py >/dev/null
fi
export EMBEDQ_VLLM_TESTS=1 VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
set +e
"$PY" -m pytest tests/vllm --ignore=tests/vllm/test_vllm_engine.py --confcutdir=tests/vllm \
    -p no:cacheprovider -q "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "test_vllm.sh: pytest collected no tests: failing" >&2
    exit 1
fi
exit $rc
