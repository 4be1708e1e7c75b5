"""The native quantizer's group loop alone: its vector path (AVX-512 or AVX2) against the scalar
loops of the same source (-DEQ_QUANT_SCALAR), interleaved, one thread, on a Gemma-3-270M-shaped
bf16 table (262,144 x 640), statistics on (what `embedq quantize` runs).

    PYTHONPATH=. python scripts/bench_quantize_kernel.py [--build native|avx2] [-n 5]

``--build avx2`` compiles both sides with -mno-avx512f: what an AVX2-only CPU builds (an
emulation on an AVX-512 machine: same caches and memory). Prints the CPU, the vector width that
ran, the load average before and after, best-of-n ms per side and the ratio.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import time

import torch

from embedq.kernels.build import SCALE_KIND, LazyLibrary
from embedq.quant import native

SCHEMES = [(4, 32, True), (4, 32, False), (8, 64, True), (8, 128, True), (8, 640, True)]


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", choices=["native", "avx2"], default="native")
    ap.add_argument("-n", type=int, default=5, help="repeats per side (best of n)")
    a = ap.parse_args()
    extra = ["-mno-avx512f"] if a.build == "avx2" else []

    def lib(name, flags):
        got = LazyLibrary(name, native.C_SOURCE, [*native.FLAGS, *flags], ["-lm"], setup=native._signatures).get()
        if got is None:
            raise SystemExit(f"bench_quantize_kernel: cannot build {name}")
        return got
    vec = lib(f"native_bench_{a.build}", extra)
    sca = lib(f"native_bench_{a.build}_scalar", [*extra, "-DEQ_QUANT_SCALAR"])
    torch.set_num_threads(1)
    x = torch.randn(262144, 640, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    print(f"cpu: {cpu_model()}; build {a.build}: vector width {vec.quant_vector()} (0 = scalar loops only); "
          f"1 thread; load {os.getloadavg()[0]:.2f}")
    print(f"{'scheme':<16} {'vector ms':>10} {'scalar ms':>10} {'scalar / vector':>16}")
    for bits, g, sym in SCHEMES:
        rows, cols = x.shape
        groups = cols // g
        s = torch.empty(rows, groups, dtype=torch.bfloat16)
        zp = torch.empty(rows, groups, dtype=torch.int8)
        out = torch.empty(rows, cols * bits // 8, dtype=torch.uint8)
        st = (ctypes.c_double * 3)()
        best = {"vector": float("inf"), "scalar": float("inf")}
        for _ in range(a.n):
            for name, so in (("vector", vec), ("scalar", sca)):
                t = time.perf_counter()
                so.quant_bf16(x.data_ptr(), rows * groups, g, bits, 0 if sym else 1, SCALE_KIND[torch.bfloat16],
                              s.data_ptr(), zp.data_ptr(), out.data_ptr(), st)
                best[name] = min(best[name], time.perf_counter() - t)
        label = f"int{bits} g{g} {'sym' if sym else 'asym'}"
        print(f"{label:<16} {best['vector'] * 1e3:>10.0f} {best['scalar'] * 1e3:>10.0f} "
              f"{best['scalar'] / best['vector']:>16.2f}", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
