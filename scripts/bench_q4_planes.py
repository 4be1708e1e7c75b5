"""A/B of the 4-bit head at M = 1: the integer planes (eq_q4planes.h) against another build of
the same source, interleaved.

    PYTHONPATH=. python scripts/bench_q4_planes.py [--ab float|vnni|vnni512] [--group 32] [--rows 262144] [--reps 40]

``--ab float`` (default): the AVX2 build against its float path (built with -DEQ_NO_Q4PLANES);
``vnni``: the AVX2 build against the avx2vnni build (vpdpwssd; needs AVX-VNNI);
``vnni512``: the avx512f build against the avx512vnni build (needs AVX512-VNNI).
Table: Gemma 3 270M's head shape (rows x 640), random weights quantized Q4 (g32 by default)
sym with bf16 scales. Activations: Gemma 3 270M's final hidden states (bf16) when the test
fixture is built (~/.cache/embedq/gemma3-270m or $EMBEDQ_CACHE), else randn. Prints the
planes each token needs, both builds' error against the reference (and whether their outputs
are bit-identical), and median ms at 1 and 2 threads with the ratio, the CPU model and the
load average. The table stays warm in the cache between calls (a kernel A/B, not a head
benchmark: scripts/bench_serve.py --cold reads it from memory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from embedq.format.codec import QuantizedTable
from embedq.format.scheme import Scheme
from embedq.kernels import PreparedTable, native_f32
from embedq.kernels.build import LazyLibrary
from embedq.quant.rtn import quantize_rtn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import cpu_model  # noqa: E402

COLS = 640
PROMPT = [2, 818, 5279, 529, 7001, 563, 496, 2268, 5053, 529, 506, 1902, 1304, 236764, 1144, 21869]


def activations() -> tuple[torch.Tensor, str]:
    fx = Path(os.environ.get("EMBEDQ_CACHE") or Path.home() / ".cache" / "embedq") / "gemma3-270m"
    if not fx.is_dir():
        return torch.randn(16, COLS, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16), "randn"
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(fx, dtype=torch.bfloat16)
    with torch.no_grad():
        hs = m.model(input_ids=torch.tensor([PROMPT])).last_hidden_state[0]
    return hs.to(torch.bfloat16), "Gemma 3 270M final hidden states"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ab", choices=("float", "vnni", "vnni512"), default="float")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--rows", type=int, default=262144)
    ap.add_argument("--reps", type=int, default=40)
    a = ap.parse_args()
    GROUP = a.group
    w = torch.randn(a.rows, COLS, generator=torch.Generator().manual_seed(0)) * 0.05
    q, s, zp = quantize_rtn(w, Scheme(bits=4, symmetric=True, group_size=GROUP), torch.bfloat16)
    qt = QuantizedTable.from_codes(q, s, zp, 4, GROUP)
    del w
    L = PreparedTable.from_table(qt).layout
    sp = L.spec
    if a.ab == "float":
        new = native_f32.VARIANTS["avx2"]
        old = LazyLibrary("head_avx2_noplanes", native_f32._source, [*new.flags, "-DEQ_NO_Q4PLANES"],
                          needs=new.needs, setup=native_f32._setup, openmp=True, label="float path")
        names = ("planes", "float path")
    elif a.ab == "vnni":
        new, old, names = native_f32.VARIANTS["avx2vnni"], native_f32.VARIANTS["avx2"], ("avx2vnni", "avx2")
    else:
        new, old = native_f32.A8_VARIANTS["avx512vnni"], native_f32.VARIANTS["avx512f"]
        names = ("avx512vnni", "avx512f")
    if new.get() is None or old.get() is None:
        raise SystemExit(new.unavailable() or old.unavailable())
    x, src = activations()
    xf = x.float().contiguous()
    planes = [new.get().head_f32_planes(xf[i].data_ptr(), COLS, GROUP, 4) for i in range(x.shape[0])]
    print(f"{cpu_model()}; {names[0]} vs {names[1]}; table {a.rows} x {COLS} Q4 g{GROUP}; activations: {src}")
    print(f"planes per token ({COLS // GROUP} groups): {planes}")

    def run(lib, xi):
        return native_f32.head(lib, L.w, L.s, L.z, sp.bits, sp.rows, sp.cols, sp.group, xi)
    ref = torch.nn.functional.linear(x[:1].float(), qt.dequantize(torch.float32))
    for dt in (torch.bfloat16, torch.float32):
        yn, yo = run(new, x[:1].to(dt)), run(old, x[:1].to(dt))
        e_new, e_old = (yn.float() - ref).abs().max().item(), (yo.float() - ref).abs().max().item()
        print(f"{str(dt)[6:]} activations: max |{names[0]} - ref| {e_new:.3g}, max |{names[1]} - ref| {e_old:.3g}"
              f"{', bit-identical' if torch.equal(yn, yo) else ''}")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        tn, to = [], []
        for r in range(a.reps):
            xi = x[r % x.shape[0]:r % x.shape[0] + 1]
            for lib, acc in ((new, tn), (old, to)) if r % 2 else ((old, to), (new, tn)):
                t = time.perf_counter()
                run(lib, xi)
                acc.append(time.perf_counter() - t)
        mn, mo = statistics.median(tn) * 1e3, statistics.median(to) * 1e3
        print(f"threads {threads}: {names[0]} {mn:.2f} ms, {names[1]} {mo:.2f} ms, ratio {mn / mo:.2f} "
              f"(load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
