#!/usr/bin/env python
"""Choose the ``--bits 8`` / ``--bits 4`` defaults by measurement (docs/methods.md, issue 22).

    python scripts/eval_defaults.py                       # all candidates, both texts (~1 h on 2 cores)
    python scripts/eval_defaults.py --rows floor,int8-g64-bf16 --texts topics
    python scripts/eval_defaults.py --second-text /usr/share/common-licenses/Apache-2.0

Every candidate table is quantized in memory by embedq's own RTN (:func:`embedq.quant.rtn.quantize_rtn`,
which the native/compiled kernels reproduce bit for bit), dequantized, and put into the
float32 Gemma 3 270M (tied: the head reads the same table); it is compared with the float32
model exactly as ``embedq eval`` does (:func:`embedq.quality.evaluate.token_stats`; 12
contexts x 128 tokens, BOS first). ``floor`` is the float model itself run in bfloat16: the
noise users already accept. The reference logits are computed once per text.

Two texts, so the choice is not tuned to one: ``topics`` (``embedq eval``'s default,
Python's ``pydoc_data/topics.py``) and ``second`` (``--second-text``, default the GPL-3 text
in ``/usr/share/common-licenses``, a different domain: legal English).

``q4-*-absmax`` rows are embedq's 4-bit mapping before issue 22 (``scale = absmax / 7``),
reproduced here; ``q4-*-signed`` is the library's (``scale = signed extreme / -8``).
Prints a Markdown table; ``--json FILE`` writes every number.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SECOND_TEXT = "/usr/share/common-licenses/GPL-3"


def _rows() -> dict:
    """name -> (label, Scheme kwargs or None for the floor, scale dtype name, 4-bit mapping)."""
    rows = {"floor": ("float model run in bf16 (the floor)", None, None, None)}
    rows["int8-row"] = ("int8 per-row sym", dict(bits=8), "bfloat16", None)
    rows["int8-row-asym"] = ("int8 per-row asym", dict(bits=8, symmetric=False), "bfloat16", None)
    for g in (128, 64):
        for sym in (True, False):
            for sd, short in (("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "f32")):
                name = f"int8-g{g}{'' if sym else '-asym'}-{short}"
                rows[name] = (f"int8 g{g} {'sym' if sym else 'asym'}, {short} scales",
                              dict(bits=8, group_size=g, symmetric=sym), sd, None)
    for mapping in ("absmax", "signed"):
        for sd, short in (("float32", "f32"), ("float16", "fp16"), ("bfloat16", "bf16")):
            what = "absmax/7" if mapping == "absmax" else "signed-max/-8"
            rows[f"q4-g32-{mapping}-{short}"] = (f"Q4 g32 {what}, {short} scales",
                                                 dict(bits=4, group_size=32), sd, mapping)
    return rows


ROWS = _rows()
# Measured in this order (the decisive rows first: a long run can be cut short).
FIRST = ["floor", "int8-g64-bf16", "int8-g64-fp16", "q4-g32-signed-f32", "q4-g32-signed-bf16",
         "q4-g32-absmax-bf16", "int8-row", "int8-g128-bf16", "int8-row-asym", "int8-g64-asym-bf16",
         "q4-g32-signed-fp16", "q4-g32-absmax-f32", "int8-g128-asym-bf16", "int8-g64-f32"]
ORDER = FIRST + [r for r in ROWS if r not in FIRST]


def absmax7(x: torch.Tensor, group: int, scale_dtype: torch.dtype):
    """embedq's symmetric 4-bit RTN before issue 22: ``scale = absmax / 7`` (rounded up)."""
    from embedq.quant.rtn import round_scale_up
    xg = x.float().reshape(x.shape[0], -1, group)
    amax = xg.abs().amax(-1)
    s = round_scale_up(torch.where(amax > 0, amax / 7, torch.ones_like(amax)), scale_dtype)
    q = torch.round(xg / s.float().unsqueeze(-1)).clamp_(-8, 7)
    return q.reshape(x.shape).to(torch.int8), s


def dequantized(table: torch.Tensor, spec, chunk: int = 16384) -> tuple[torch.Tensor, int]:
    """(float32 dequantized table, overlay bytes) of one candidate."""
    from embedq.format.codec import dequantize_codes
    from embedq.format.dtypes import dtype_from_name
    from embedq.format.scheme import Scheme
    from embedq.quant.rtn import quantize_rtn
    _, kw, sd, mapping = spec
    scheme = Scheme(**kw)
    sdt = dtype_from_name(sd)
    out = torch.empty(table.shape, dtype=torch.float32)
    for a in range(0, table.shape[0], chunk):
        x = table[a:a + chunk]
        if mapping == "absmax":
            q, s = absmax7(x, scheme.group_size, sdt)
            zp = None
        else:
            q, s, zp = quantize_rtn(x, scheme, sdt)
        out[a:a + chunk] = dequantize_codes(q, s, zp, scheme.group_size)
    return out, scheme.overlay_bytes(tuple(table.shape), sdt.itemsize)


def logits(model, ctx: torch.Tensor, batch: int) -> list[torch.Tensor]:
    """Per context: logits of every position but the last ([length - 1, vocab] float32)."""
    out = []
    with torch.inference_mode():
        for a in range(0, ctx.shape[0], batch):
            lg = model(input_ids=ctx[a:a + batch], use_cache=False).logits[:, :-1].float()
            out += list(lg.unbind(0))
    return out


def log_probs(lg: list[torch.Tensor]) -> list[torch.Tensor]:
    """Reference log-probabilities, computed in float64 and kept in float32 (1.6 GB a text
    instead of 3.2; the KLD changes by < 1e-6 nats)."""
    return [torch.cat([torch.log_softmax(x[a:a + _BLOCK].double(), -1).float()
                       for a in range(0, x.shape[0], _BLOCK)]) for x in lg]


_BLOCK = 32


def stats(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    """Mean KLD(ref || got) with a bootstrap 95% CI over contexts, and same-top-1 %."""
    from embedq.quality.evaluate import _bootstrap
    kl, same, n = [], [], []
    for r_all, q_all in zip(ref, got):
        k_sum = s_sum = 0.0
        for a in range(0, r_all.shape[0], _BLOCK):
            r = r_all[a:a + _BLOCK].double()
            q = torch.log_softmax(q_all[a:a + _BLOCK].double(), -1)
            k_sum += float((r.exp() * (r - q)).sum(-1).clamp_min(0.0).sum())
            s_sum += float((r.argmax(-1) == q.argmax(-1)).sum())
        kl.append(k_sum)
        same.append(s_sum)
        n.append(r_all.shape[0])
    pc = {k: torch.tensor(v, dtype=torch.float64) for k, v in
          (("kld", kl), ("same", same), ("n", n), ("nll_r", kl), ("nll_q", kl))}
    tot = float(pc["n"].sum())
    ci = _bootstrap(pc, 2000, 0)
    return {"tokens": int(tot), "mean_kld": sum(kl) / tot, "kld_ci95": ci["kld"],
            "same_top1": 100.0 * sum(same) / tot, "per_context_kld": [k / m for k, m in zip(kl, n)]}


def markdown(results: list[dict], texts: dict[str, str], contexts: int, length: int,
             shape: tuple[int, int]) -> str:
    """The Markdown table of ``results``; bytes relative to int8 per-row with bf16 scales."""
    from embedq.format.scheme import Scheme
    per_row = Scheme(bits=8).overlay_bytes(shape, 2)
    floor = next((r for r in results if r["row"] == "floor"), None)
    out = [f"Gemma 3 270M (tied, {shape[0]} x {shape[1]} bf16), {contexts} contexts x {length} tokens, BOS "
           "first, vs the float32 model; texts: " + "; ".join(f"{t} = {d}" for t, d in texts.items()) + "\n",
           "| candidate | bytes vs int8 per-row | " + " | ".join(
               f"{t}: mean KLD [95% CI] | × floor | same top-1 %" for t in texts) + " |",
           "|---|---:|" + "---|---:|---:|" * len(texts)]
    for r in results:
        size = "–" if r["overlay_bytes"] is None else f"{r['overlay_bytes'] / per_row:.3f}"
        cells = []
        for t in texts:
            v = r["texts"][t]
            x = "–" if floor is None else f"{v['mean_kld'] / floor['texts'][t]['mean_kld']:.2f}"
            cells.append(f"{v['mean_kld']:.5f} [{v['kld_ci95'][0]:.5f}, {v['kld_ci95'][1]:.5f}] | {x} | "
                         f"{v['same_top1']:.1f}")
        same = f" (= {ROWS[r['identical_table_to']][0]}: identical table)" if r.get("identical_table_to") else ""
        out.append(f"| {r['label']}{same} | {size} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ORDER), help=f"subset of {', '.join(ROWS)}")
    ap.add_argument("--texts", default="topics,second", help="topics, second or both")
    ap.add_argument("--second-text", default=SECOND_TEXT, help=f"the second text (default {SECOND_TEXT})")
    ap.add_argument("--contexts", type=int, default=None)
    ap.add_argument("--length", type=int, default=None)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: the Gemma 3 270M fixture)")
    ap.add_argument("--batch", type=int, default=6, help="contexts per forward pass")
    ap.add_argument("--json", type=Path, default=None, help="every number (rewritten after each row)")
    ap.add_argument("--from-json", type=Path, default=None, help="only print the table of a saved --json")
    args = ap.parse_args(argv)
    if args.from_json:
        d = json.loads(args.from_json.read_text())
        print(markdown(d["rows"], d["texts"], d["contexts"], d["length"], tuple(d["shape"])))
        return 0

    import transformers
    from embedq.quality.evaluate import (DEFAULT_CONTEXTS, DEFAULT_LENGTH, default_text, load_reference,
                                         load_tokenizer, read_text, text_contexts)
    from eval_gemma3 import gemma3_checkpoint, machine

    names = args.rows.split(",")
    bad = [r for r in names if r not in ROWS]
    if bad:
        ap.error(f"unknown rows {bad}")
    contexts, length = args.contexts or DEFAULT_CONTEXTS, args.length or DEFAULT_LENGTH
    src = args.model or gemma3_checkpoint()
    print(f"# {src} on {machine()}", file=sys.stderr)
    tok = load_tokenizer(src)
    texts = {}
    for t in args.texts.split(","):
        body, desc = default_text() if t == "topics" else read_text(args.second_text)
        texts[t] = (desc, text_contexts(tok, body, contexts, length, tok.bos_token_id))
    model = load_reference(src, transformers.AutoModelForCausalLM, torch.float32)
    emb = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight is not emb:
        sys.exit("this script measures tied tables (the head reads the embedding)")
    original = emb.data.clone()
    table = original.to(torch.bfloat16)  # the checkpoint's own values (bf16, exact in float32)
    t_all = time.perf_counter()
    refs = {t: log_probs(logits(model, c, args.batch)) for t, (_, c) in texts.items()}
    print(f"# reference logits: {time.perf_counter() - t_all:.0f} s", file=sys.stderr, flush=True)
    results, seen = [], {}
    for name in names:
        spec = ROWS[name]
        t0 = time.perf_counter()
        if spec[1] is None:  # loaded as users load it in bf16
            cand, nbytes = load_reference(src, transformers.AutoModelForCausalLM, torch.bfloat16), None
        else:
            emb.data, nbytes = dequantized(table, spec)
            cand = model
        row = {"row": name, "label": spec[0], "scheme": spec[1], "scale_dtype": spec[2], "mapping": spec[3],
               "overlay_bytes": nbytes, "texts": {}}
        # Candidates whose dequantized tables are identical (e.g. signed-max with bf16 vs
        # float32 scales on a bf16 table: m / -8 is exact in bf16) are measured once.
        same = None
        if spec[1] is not None:
            digest = hashlib.sha256(emb.data.numpy().tobytes()).hexdigest()
            same = seen.setdefault(digest, name)
            row["identical_table_to"] = same if same != name else None
        if same is not None and same != name:
            row["texts"] = next(r for r in results if r["row"] == same)["texts"]
        else:
            for t, (desc, c) in texts.items():
                row["texts"][t] = {"text": desc, **stats(refs[t], logits(cand, c, args.batch))}
        del cand
        results.append(row)
        if args.json:
            args.json.write_text(json.dumps({"machine": machine(), "model": str(src), "shape": list(table.shape),
                                             "contexts": contexts, "length": length,
                                             "texts": {t: d for t, (d, _) in texts.items()},
                                             "rows": results}, indent=2))
        msg = "; ".join(f"{t}: KLD {v['mean_kld']:.5f} top-1 {v['same_top1']:.1f}%" for t, v in row["texts"].items())
        print(f"# {spec[0]}: {msg} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    emb.data = original

    print(markdown(results, {t: d for t, (d, _) in texts.items()}, contexts, length, tuple(table.shape)))
    total = time.perf_counter() - t_all
    print(f"\n{machine()}; {total / 60:.1f} min in all.")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "model": str(src), "shape": list(table.shape),
                                         "contexts": contexts, "length": length,
                                         "texts": {t: d for t, (d, _) in texts.items()},
                                         "rows": results, "seconds": total}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
