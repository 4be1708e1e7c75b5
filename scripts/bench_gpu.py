#!/usr/bin/env python
"""GPU serving benchmark of the Triton head (scripts/bench_gpu.sh runs it; run it in the
vLLM venv, with PYTHONPATH at this repository).

Section ``head``: the tied head ``logits = x @ W^T`` at M = ``--batches`` (default 1 16 64
256) activation rows, bf16, for

  * Gemma 3 270M's real table (262,144 x 640; the fixture quantized by embedq, read back
    from the overlay) and a synthetic 27B-shaped table (248,320 x 5,120, spread like real
    embeddings, quantized here with embedq's RTN), schemes ``--schemes`` (default int8,
    int8g64, q4g32);
  * paths: ``bf16`` (F.linear on the bf16 table, the baseline), ``triton``
    (PreparedTable kind "triton": the kernels over the stored layout) and ``dequant``
    (dequantize the whole table per call, then F.linear: what vLLM's open tied-head
    proposal #45535 does; reference only).

Timing: CUDA events around ``--reps`` back-to-back calls, one sample per path per round,
the paths interleaved (round-robin, starting path rotated each round), ``-n`` rounds,
medians and ratios to bf16. Targets printed beside the ratios (issue 23): int8 <= 0.6 and
Q4 g32 <= 0.35 at M = 1-16, <= 1.0 at M = 256.

Section ``engine``: vLLM ``LLM.generate`` (greedy, ignore_eos, CUDA graphs as vLLM
captures them by default) on Gemma 3 270M float / int8 / int8g64 / q4g32, batch sizes
``--engine-batches`` (default 1 64), ``--new-tokens`` tokens: output tokens/s, one
long-lived engine process per model driven in turn (interleaved), ratios to float; each
engine reports its prepared tables' kind and bytes (one resident table per tied model).

``--dry-run``: the head section on this CPU under Triton's interpreter at tiny shapes
(fp16: the interpreter has no bf16), to check the script itself; its times are of the
interpreter and mean nothing. The engine section is GPU-only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"gemma270m": (262_144, 640), "27b": (248_320, 5_120)}
DRY_SHAPES = {"gemma270m": (1_000, 128), "27b": (900, 256)}  # --dry-run stand-ins
SCHEMES = {"int8": dict(bits=8), "int8g64": dict(bits=8, group_size=64),
           "q4g32": dict(bits=4, group_size=32)}
TARGETS = {"int8": {1: 0.6, 16: 0.6, 256: 1.0}, "int8g64": {1: 0.6, 16: 0.6, 256: 1.0},
           "q4g32": {1: 0.35, 16: 0.35, 256: 1.0}}
PROMPT = [2, 651, 6037, 529, 9405, 563, 496, 3207]  # <bos> + 7 Gemma tokens


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--section", nargs="+", default=["head", "engine"], choices=["head", "engine"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 256])
    ap.add_argument("--engine-batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("-n", type=int, default=None, help="rounds, median over them (7; --dry-run 2)")
    ap.add_argument("--reps", type=int, default=None, help="calls per timed head sample (10; --dry-run 1)")
    ap.add_argument("--no-dequant", action="store_true", help="skip the dequantize-per-call path")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get(
        "EMBEDQ_CACHE", Path.home() / ".cache/embedq")) / "bench-gpu")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, Triton interpreter, tiny shapes, head section only")
    args = ap.parse_args(argv)
    args.n = args.n if args.n is not None else (2 if args.dry_run else 7)
    args.reps = args.reps if args.reps is not None else (1 if args.dry_run else 10)
    if min(args.batches + args.engine_batches) < 1 or args.n < 1 or args.reps < 1:
        ap.error("batches, -n and --reps must be positive")
    if args.dry_run:
        args.section = [s for s in args.section if s == "head"]
    return args


def _setup_env(dry: bool) -> None:
    """Before torch/triton are imported: the interpreter and the forced route for --dry-run."""
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["EMBEDQ_SERVE_KERNEL"] = "triton"


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


# -- tables ----------------------------------------------------------------------------------

def gemma_models(workdir: Path, names) -> dict[str, Path]:
    """float + quantized copies of the Gemma 3 270M fixture (quantized once, reused)."""
    import importlib.util
    import shutil
    spec = importlib.util.spec_from_file_location("make_gemma3_fixture", REPO / "scripts/make_gemma3_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = Path(mod.ensure_gemma3_270m())
    out = {"float": src}
    for name in names:
        d = workdir / f"gemma3-270m-{name}"
        if not (d / ".bench-ok").exists():
            shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(src, d)
            import embedq
            t0 = time.perf_counter()
            embedq.quantize(str(d), progress=False, **SCHEMES[name])
            print(f"   quantized {d.name} in {time.perf_counter() - t0:.0f}s", flush=True)
            (d / ".bench-ok").touch()
        out[name] = d
    return out


def synthetic_table(rows: int, cols: int, device, seed: int = 0):
    """bf16 table with per-row magnitudes spread like real embeddings (generated on device)."""
    import torch
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.empty(rows, cols, dtype=torch.bfloat16, device=device)
    step = max(1, (1 << 24) // cols)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        w[a:b] = (torch.randn(b - a, cols, generator=g, device=device) * 0.02
                  * torch.exp(0.3 * torch.randn(b - a, 1, generator=g, device=device))).to(torch.bfloat16)
    return w


def quantize_table(w, scheme_kw: dict):
    """embedq's RTN, row chunk by row chunk (on w's device), into one QuantizedTable."""
    import torch
    from embedq.format.codec import QuantizedTable
    from embedq.format.scheme import Scheme
    from embedq.quant.rtn import quantize_rtn
    s = Scheme.default(scheme_kw["bits"], group_size=scheme_kw.get("group_size"))
    rows, cols = w.shape
    step = max(1, (1 << 24) // cols)
    packed, scales = [], []
    for a in range(0, rows, step):
        q, sc, _ = quantize_rtn(w[a:a + step], s, torch.bfloat16)
        packed.append(QuantizedTable.from_codes(q, sc, None, s.bits, s.group_size).packed)
        scales.append(sc)
    return QuantizedTable(torch.cat(packed), torch.cat(scales), None, s.bits, s.group_size, (rows, cols))


def head_tables(args, device, dtype):
    """(shape name, scheme name, float table [V, H] in dtype, QuantizedTable) per combination."""
    import torch
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    gemma = None
    if "gemma270m" in args.shapes and not args.dry_run:
        import embedq
        gemma = gemma_models(args.workdir, args.schemes)
    for shape in args.shapes:
        rows, cols = shapes[shape]
        w = None
        for sname in args.schemes:
            if gemma is not None and shape == "gemma270m":
                qt = embedq.load_overlay(gemma[sname]).table_for("model.embed_tokens")
                if w is None:  # the fixture's float table (bf16 on disk)
                    from safetensors import safe_open
                    with safe_open(str(gemma["float"] / "model.safetensors"), "pt") as f:
                        w = f.get_tensor("model.embed_tokens.weight").to(device, dtype)
            else:
                if w is None:
                    w = synthetic_table(rows, cols, device, seed=1).to(dtype)
                qt = quantize_table(w, SCHEMES[sname])
            yield shape, sname, w, qt
        del w
        if device != "cpu":
            torch.cuda.empty_cache()


# -- timing ----------------------------------------------------------------------------------

def make_timer(device: str):
    import torch
    if device == "cpu":
        def timer(fn, reps):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) / reps
        return timer

    def timer(fn, reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / reps
    return timer


def interleaved(fns: dict, n: int, reps: int, timer) -> dict[str, list[float]]:
    """One sample per path per round, the starting path rotated each round."""
    names = list(fns)
    out = {k: [] for k in names}
    for k in names:  # warm-up: compilation, allocations
        timer(fns[k], 1)
    for r in range(n):
        for k in names[r % len(names):] + names[:r % len(names)]:
            out[k].append(timer(fns[k], reps))
    return out


def target_of(scheme: str, m: int) -> float | None:
    t = TARGETS.get(scheme, {})
    if m <= 16:
        return t.get(16)
    return t.get(256) if m == 256 else None


def bench_head(args) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from embedq.kernels import PreparedTable
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float16 if args.dry_run else torch.bfloat16
    timer = make_timer(device)
    rows_out = []
    for shape, sname, w, qt in head_tables(args, device, dtype):
        p = PreparedTable.from_table(qt, device=device, dtype=dtype)
        if p.kind != "triton":
            raise SystemExit(f"bench_gpu: {shape} {sname} is served by {p.describe()}, not Triton")
        V, H = qt.shape
        print(f"\n== head {shape} {V} x {H} {sname}: {p.describe()}, {p.nbytes / 2**20:.1f} MiB "
              f"(bf16 {V * H * 2 / 2**20:.1f} MiB); activations {str(dtype)[6:]}; load avg {load()}", flush=True)
        w32 = qt.dequantize(torch.float32).to(device)  # the reference decoder's table, once
        for m in args.batches:
            x = torch.randn(m, H, device=device).to(dtype)
            with torch.inference_mode():
                got = p.linear(x).float()
                ref = x.float() @ w32.t()
                rel = ((got - ref).norm() / ref.norm()).item()
                del got, ref
                fns = {"bf16": lambda x=x, w=w: F.linear(x, w), "triton": lambda x=x: p.linear(x)}
                if not args.no_dequant:
                    fns["dequant"] = lambda x=x: F.linear(x, p.dequantize_range(0, V, dtype))
                times = interleaved(fns, args.n, args.reps, timer)
            base = statistics.median(times["bf16"])
            tgt = target_of(sname, m)
            print(f"-- M={m}: median of {args.n} x {args.reps} calls; triton vs fp32 reference: "
                  f"rel. error {rel:.2e}" + (f"; target triton/bf16 <= {tgt}" if tgt else ""))
            for k, ts in times.items():
                med = statistics.median(ts)
                verdict = ""
                if k == "triton" and tgt is not None and not args.dry_run:
                    verdict = "  target met" if med / base <= tgt else "  TARGET MISSED"
                print(f"   {k:8s} {med * 1e3:9.3f} ms  {med / base:6.3f}x bf16  "
                      f"(min {min(ts) * 1e3:.3f}, max {max(ts) * 1e3:.3f}){verdict}", flush=True)
                rows_out.append(dict(section="head", shape=shape, rows=V, cols=H, scheme=sname, batch=m,
                                     path=k, median_ms=med * 1e3, ratio_vs_bf16=med / base, n=len(ts),
                                     reps=args.reps, rel_error=rel, target=tgt, dry_run=args.dry_run))
        del p, qt, w32
    return rows_out


# -- engine ----------------------------------------------------------------------------------

_ENGINE_WORKER = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=512, max_num_seqs=int(sys.argv[2]),
          gpu_memory_utilization=float(sys.argv[3]), seed=0, skip_tokenizer_init=True)
tables = {}
try:
    from embedq.backends.vllm.layers import _PREPARED
    tables = {k.split("#")[0]: [v.kind, v.nbytes] for k, v in _PREPARED.items()}
except Exception:
    pass
print("READY " + json.dumps(tables), flush=True)
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


def bench_engine(args) -> list[dict]:
    paths = gemma_models(args.workdir, args.schemes)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("EMBEDQ_SERVE_KERNEL", None)
    code = f"PROMPT = {PROMPT!r}\n" + _ENGINE_WORKER
    util = f"{min(0.2, 0.9 / len(paths)):.2f}"
    procs, results = {}, []
    print(f"\n== vLLM engine, batches {args.engine_batches}, {args.new_tokens} new tokens, "
          f"models {list(paths)}", flush=True)
    try:
        for name, d in paths.items():
            t0 = time.perf_counter()
            p = subprocess.Popen([sys.executable, "-c", code, str(d), str(max(args.engine_batches)), util],
                                 env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs[name] = p
            while True:
                line = p.stdout.readline()
                if not line:
                    raise SystemExit(f"bench_gpu: engine for {name} exited with {p.wait()}")
                if line.startswith("READY"):
                    break
            tables = json.loads(line[6:])
            print(f"   {name}: ready in {time.perf_counter() - t0:.0f}s; tables {tables}", flush=True)
            if name != "float" and not any(k == "triton" for k, _ in tables.values()):
                print(f"   WARNING: {name} is not served by the Triton kernels", flush=True)

        def run(name, batch, n):
            p = procs[name]
            p.stdin.write(f"{batch} {n}\n")
            p.stdin.flush()
            while True:
                line = p.stdout.readline()
                if not line:
                    raise SystemExit(f"bench_gpu: engine for {name} died")
                if line.startswith("DONE"):
                    return json.loads(line[5:])

        names = list(procs)
        for batch in args.engine_batches:
            firsts = {k: run(k, batch, args.new_tokens)["first"] for k in names}  # warm-up
            for k in names[1:]:
                same = sum(a == b for a, b in zip(firsts[k], firsts["float"]))
                print(f"   batch {batch}: {k}: {same}/{args.new_tokens} greedy tokens equal to float's")
            times = {k: [] for k in names}
            for r in range(args.n):
                for k in names[r % len(names):] + names[:r % len(names)]:
                    res = run(k, batch, args.new_tokens)
                    assert res["tokens"] == batch * args.new_tokens, res["tokens"]
                    times[k].append(res["s"])
            work = batch * args.new_tokens
            base = work / statistics.median(times["float"])
            print(f"-- engine batch {batch}: median of {args.n}")
            for k, ts in times.items():
                tps = work / statistics.median(ts)
                verdict = "" if k == "float" else ("  target met" if tps / base >= 1.0 else "  TARGET MISSED")
                print(f"   {k:8s} {tps:10.1f} tok/s  {tps / base:5.3f}x float{verdict}", flush=True)
                results.append(dict(section="engine", model=k, batch=batch, new_tokens=args.new_tokens,
                                    tokens_per_s=tps, ratio_vs_float=tps / base, n=len(ts)))
        return results
    finally:
        for p in procs.values():
            if p.stdin:
                p.stdin.close()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv=None) -> int:
    args = parse_args(argv)
    _setup_env(args.dry_run)
    sys.path.insert(0, str(REPO))
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device (use --dry-run to check the script on a CPU)", file=sys.stderr)
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    dev = "cpu (Triton interpreter; DRY RUN: times are not measurements)" if args.dry_run \
        else torch.cuda.get_device_name()
    print(f"torch {torch.__version__}, device {dev}, load avg {load()}", flush=True)
    results = []
    for s in args.section:
        results += {"head": bench_head, "engine": bench_engine}[s](args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
