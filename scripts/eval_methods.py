#!/usr/bin/env python
"""RTN vs ``--method mse`` vs ``--method gptq`` on the real Gemma 3 270M (docs/methods.md table).

    python scripts/eval_methods.py                        # all rows, default text (~1 h on 2 cores)
    python scripts/eval_methods.py --rows q4-g32-asym,int8-row --methods rtn,gptq
    python scripts/eval_methods.py --text /usr/share/common-licenses/GPL-3   # another domain

For every scheme row and method: quantize a private copy of the checkpoint (shards
hard-linked, never modified) in place, load it with :func:`embedq.load` and compare it
with the float model exactly as ``embedq eval`` does (:func:`embedq.quality.evaluate.compare_models`;
defaults: 12 contexts x 128 tokens of Python's ``pydoc_data/topics.py``, BOS first, float32).
The float reference is loaded once. ``gptq`` is calibrated once, on the standard-library
docstrings (:func:`embedq.quant.gptq.default_calibration_text`) — not the eval text.

Ratios ``new / RTN`` are paired over contexts: the 95% CI resamples the 12 contexts
(bootstrap, 2000 draws) and recomputes sum(KLD_new) / sum(KLD_rtn) on the same draw.

Prints a Markdown table; ``--json FILE`` writes every number (per-context KLDs too).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# name: (label, quantize kwargs, baseline row for the "x best RTN" column)
ROWS = {
    "int8-row": ("int8 per-row sym", dict(bits=8, group_size=0), "int8-row"),
    "int8-row-asym": ("int8 per-row asym", dict(bits=8, group_size=0, symmetric=False), "int8-row"),
    "int8-g128": ("int8 g128 sym", dict(bits=8, group_size=128), "int8-g128"),
    "q4-g32": ("Q4 g32 sym", dict(bits=4, group_size=32), "q4-g32-asym"),
    "q4-g32-asym": ("Q4 g32 asym", dict(bits=4, group_size=32, symmetric=False), "q4-g32-asym"),
}
METHODS = ("rtn", "mse", "gptq")
BOOT = 2000


def ratio_ci(new: list[dict], base: list[dict], samples: int = BOOT, seed: int = 0):
    """sum KLD_new / sum KLD_base with a paired bootstrap 95% CI over contexts."""
    a = torch.tensor([c["mean_kld"] * c["tokens"] for c in new], dtype=torch.float64)
    b = torch.tensor([c["mean_kld"] * c["tokens"] for c in base], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, a.numel(), (samples, a.numel()), generator=g)
    r = a[idx].sum(1) / b[idx].sum(1)
    lo, hi = torch.quantile(r, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return float(a.sum() / b.sum()), (lo, hi)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"subset of {', '.join(ROWS)}")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--text", default=None, help="UTF-8 eval text (default: pydoc_data/topics.py)")
    ap.add_argument("--contexts", type=int, default=None)
    ap.add_argument("--length", type=int, default=None)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: the Gemma 3 270M fixture)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import embedq
    from embedq.quality.evaluate import (DEFAULT_CONTEXTS, DEFAULT_LENGTH, compare_models, default_text,
                                 load_reference, load_tokenizer, read_text, text_contexts)
    from embedq.jobs.calibration import collect_calibration
    from eval_gemma3 import gemma3_checkpoint, machine, private_copy

    rows = args.rows.split(",")
    methods = args.methods.split(",")
    bad = [r for r in rows if r not in ROWS] + [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"unknown rows/methods {bad}")
    contexts, length = args.contexts or DEFAULT_CONTEXTS, args.length or DEFAULT_LENGTH
    src = args.model or gemma3_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="embedq-methods-"))
    ckpt = private_copy(src, work / "model")
    print(f"# {src} on {machine()}", file=sys.stderr)

    body, desc = read_text(args.text) if args.text else default_text()
    tok = load_tokenizer(ckpt)
    ctx = text_contexts(tok, body, contexts, length, tok.bos_token_id)
    import transformers
    ref = load_reference(ckpt, transformers.AutoModelForCausalLM, torch.float32)

    cal, cal_s = None, 0.0
    if "gptq" in methods:
        t0 = time.perf_counter()
        cal = collect_calibration(ckpt)
        cal_s = time.perf_counter() - t0
        print(f"# calibration: {cal.tokens} tokens of {cal.source}, {cal_s:.0f} s", file=sys.stderr)

    results: dict[tuple[str, str], dict] = {}
    t_all = time.perf_counter()
    for name in rows:
        label, qkw, _ = ROWS[name]
        for m in methods:
            t0 = time.perf_counter()
            rep = embedq.quantize(ckpt, force=True, progress=False, method=m,
                                  calibration=cal if m == "gptq" else None, **qkw)
            qs = time.perf_counter() - t0
            overlay = (ckpt / "embedq.safetensors").stat().st_size
            quant = embedq.load(ckpt, dtype=torch.float32).eval()
            t1 = time.perf_counter()
            st = compare_models(ref, quant, ctx)
            del quant
            gc.collect()
            r = {"row": name, "label": label, "method": m, "quantize": qkw, "overlay_bytes": overlay,
                 "quantize_seconds": round(qs, 1), "eval_seconds": round(time.perf_counter() - t1, 1),
                 "rms_error": rep.modules[0].rms_error, **st}
            results[(name, m)] = r
            print(f"# {label} {m}: KLD {st['mean_kld']:.5f} top-1 {st['same_top1']:.1f}% "
                  f"quantize {qs:.0f} s", file=sys.stderr, flush=True)
    embedq.remove(ckpt)

    for (name, m), r in results.items():
        if (name, "rtn") in results:
            r["ratio_vs_rtn"] = ratio_ci(r["per_context"], results[(name, "rtn")]["per_context"])
        base = ROWS[name][2]
        if (base, "rtn") in results:
            r["ratio_vs_best_rtn"] = ratio_ci(r["per_context"], results[(base, "rtn")]["per_context"])
            r["best_rtn"] = base

    first = next(iter(results.values()))
    print(f"Gemma 3 270M (tied, 262144 x 640 bf16), {contexts} contexts x {length} tokens of {desc}, "
          f"BOS first, {first['tokens']} scored tokens, float32; reference = the bf16 checkpoint. "
          f"gptq calibrated on {cal.source if cal else '-'} ({cal.tokens if cal else 0} tokens, "
          f"{cal_s:.0f} s).\n")
    print("| scheme | method | overlay MB | mean KLD [95% CI] | × RTN same scheme [95% CI] | "
          "× target RTN [95% CI] | same top-1 % | quantize s |")
    print("|---|---|---:|---|---|---|---:|---:|")

    def fmt(x):
        if x is None:
            return "–"
        v, (lo, hi) = x
        return f"{v:.2f} [{lo:.2f}, {hi:.2f}]"
    for (name, m), r in results.items():
        lo, hi = r["kld_ci95"]
        tgt = fmt(r.get("ratio_vs_best_rtn")) + (f" ({ROWS[r['best_rtn']][0]})" if r.get("best_rtn") else "")
        print(f"| {r['label']} | {m} | {r['overlay_bytes'] / 1e6:.1f} | {r['mean_kld']:.5f} "
              f"[{lo:.5f}, {hi:.5f}] | {fmt(r.get('ratio_vs_rtn'))} | {tgt} | {r['same_top1']:.1f} | "
              f"{r['quantize_seconds']:.0f} |")
    total = time.perf_counter() - t_all
    print(f"\n{machine()}; {total / 60:.1f} min in all.")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "model": str(src), "text": desc,
                                         "calibration": cal.source if cal else None,
                                         "calibration_seconds": cal_s,
                                         "rows": list(results.values()), "seconds": total}, indent=2))
    import shutil
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
