"""Shared machinery of the serving benchmarks (scripts/bench_serve.py, bench_routes.py,
bench_q4_planes.py, profile_decode.py): CPU-family emulation, load and steal readings, the
synthetic and quantized tables, the float baselines and the peers, the memory floor, cache
eviction, interleaved timing with paired ratios, and the Gemma 3 270M copies they run on."""

from __future__ import annotations

import gc
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

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
    """Re-run the running script (``sys.argv``) with ``family``'s environment (the variables
    are read at start-up)."""
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
