#!/usr/bin/env bash
# Test embedq's vLLM back end against the real vLLM 0.33.0, in its own cached venv
# (scripts/setup_vllm_venv.sh): tests/vllm, then the Triton kernel tests (tests/gpu)
# in Triton's interpreter (TRITON_INTERPRET=1; this venv ships Triton, the main one does
# not). Extra arguments go to the tests/vllm pytest. The whole-engine runs
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
fail=0
run() {  # run NAME PYTEST-ARGS...: collecting nothing is a failure
    local rc=0 start=$(date +%s)
    "$PY" -m pytest -p no:cacheprovider -q -rs --durations=10 "${@:2}" || rc=$?
    echo "test_vllm.sh: $1: rc $rc in $(( $(date +%s) - start ))s (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
    if [[ $rc -eq 5 ]]; then
        echo "test_vllm.sh: $1: pytest collected no tests: failing" >&2
        rc=1
    fi
    [[ $rc -eq 0 ]] || fail=1
}
run tests/vllm tests/vllm --ignore=tests/vllm/test_vllm_engine.py --confcutdir=tests/vllm "$@"
# the interpreter runs each kernel program in numpy (tests keep shapes small): 62 tests,
# 539 s measured at load ~20 on 2 cores (test_bench_gpu.py::test_py_dry_run the slowest, 115 s)
TRITON_INTERPRET=1 EMBEDQ_REQUIRE_TRITON=1 run tests/gpu tests/gpu
exit $fail
