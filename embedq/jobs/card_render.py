"""The model card's text: :func:`render` turns a card context
(:func:`embedq.jobs.card_data.card_context`) into README.md, front matter and body."""

from __future__ import annotations

import json
import math
from typing import Any

from embedq.format.scheme_units import unit_for
from embedq.jobs.card_data import MARK, MARK_END, front_matter, stored_state, validate_metadata


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _fmt_num(x: Any) -> str:
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x == 0 or math.isnan(x) or math.isinf(x):
            return str(x)
        return f"{x:.4g}"
    return str(x)


def _scheme_words(m: dict) -> str:
    """'int8, one scale per row, symmetric, bfloat16 scales, RTN'."""
    bits = unit_for(m["bits"]).prose
    g = "one scale per row" if not m.get("group_size") else f"groups of {m['group_size']}"
    sym = "symmetric" if m.get("symmetric", True) else "asymmetric (zero points)"
    parts = [bits, g, sym]
    if m.get("scale_dtype"):
        parts.append(f"{m['scale_dtype']} scales")
    if m.get("method"):
        parts.append(m["method"].upper() if m["method"] in ("rtn", "mse") else m["method"])
    return ", ".join(parts)


def render_eval(results: Any) -> str:
    """Markdown for ``embedq eval`` results of unknown exact shape.

    A dict becomes a metric/value table of its scalar entries (nested dicts flattened
    with dots, lists of up to 8 numbers joined); a list of dicts one table per entry,
    titled by its ``scheme`` / ``name`` / ``label`` field when it has one.
    """
    if results is None:
        return ""
    runs = results if isinstance(results, list) else [results]
    out = []
    for i, run in enumerate(runs):
        if not isinstance(run, dict):
            out.append(f"- {_fmt_num(run)}")
            continue
        if _is_eval_result(run):
            out.append(_render_eval_result(run))
            continue
        title = next((str(run[k]) for k in ("scheme", "name", "label") if isinstance(run.get(k), str)), None)
        if len(runs) > 1:
            out.append(f"**{title or f'run {i + 1}'}**\n")
        rows = list(_flatten(run))
        if rows:
            out.append("| metric | value |\n|---|---|")
            out.extend(f"| {k} | {v} |" for k, v in rows)
            out.append("")
    return "\n".join(out).strip() + "\n"


def _is_eval_result(d: dict) -> bool:
    """The shape of ``embedq.quality.evaluate.EvalResult.to_dict()``."""
    return all(k in d for k in ("mean_kld", "kld_ci95", "kld_p50", "kld_p99", "same_top1",
                                "delta_ppl", "contexts", "length"))


def _render_eval_result(d: dict) -> str:
    def ci(v, fmt):
        return f" (95% CI {fmt(v[0])} – {fmt(v[1])})" if isinstance(v, list) and len(v) == 2 else ""
    f6 = lambda x: f"{x:.6f}"  # noqa: E731
    f2 = lambda x: f"{x:.2f}%"  # noqa: E731
    fp = lambda x: f"{x:+.4f}"  # noqa: E731
    mods = d.get("modules") or {}
    rows = [
        ("modules", ", ".join(f"`{m}`: {sc}" for m, sc in mods.items())
         + (" (head kept float)" if d.get("float_head") else "")
         + (" (head with int8 activations: EMBEDQ_ACTIVATIONS=int8)" if d.get("activations") == "int8" else "")),
        ("setup", f"{d['contexts']} contexts x {d['length']} tokens"
         + (" (BOS first)" if d.get("bos", True) else "")
         + (f", {d['tokens']:,} scored" if isinstance(d.get("tokens"), int) else "")
         + (f"; text: {d['text']}" if d.get("text") else "")
         + (f"; {d['dtype']}" if d.get("dtype") else "")),
        ("mean KL divergence", f6(d["mean_kld"]) + ci(d.get("kld_ci95"), f6)),
        ("KLD p50 / p90 / p99 / max", " / ".join(f6(d[k]) for k in ("kld_p50", "kld_p90", "kld_p99", "kld_max")
                                                 if isinstance(d.get(k), (int, float)))),
        ("same top-1 token", f2(d["same_top1"]) + ci(d.get("same_top1_ci95"), f2)),
    ]
    if isinstance(d.get("ppl_reference"), (int, float)) and isinstance(d.get("ppl_quantized"), (int, float)):
        rows.append(("perplexity", f"{d['ppl_reference']:.4f} → {d['ppl_quantized']:.4f} "
                                   f"(Δ {fp(d['delta_ppl'])}{ci(d.get('delta_ppl_ci95'), fp)})"))
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows if v]
    return "\n".join(lines) + "\n"


def _flatten(d: dict, prefix: str = "", depth: int = 0):
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and depth < 2:
            yield from _flatten(v, key + ".", depth + 1)
        elif isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= 80):
            yield key, _fmt_num(v).replace("|", "\\|")
        elif isinstance(v, list) and 0 < len(v) <= 8 and all(isinstance(x, (int, float, str)) for x in v):
            yield key, ", ".join(_fmt_num(x) for x in v).replace("|", "\\|")


def _usage(ctx: dict) -> str:
    repo = ctx.get("repo_id")
    here = f"./{repo.split('/')[-1]}" if repo else (ctx.get("folder_hint") or "./model")
    lines = []
    if repo and ctx.get("mode") != "overlay-only":
        # embedq.load and the ONNX commands take a local folder.
        lines += ["```bash", f"hf download {repo} --local-dir {here}", "```", ""]
    if ctx.get("mode") == "overlay-only":
        base = ctx.get("base_model") or "<base repository>"
        rev = ctx.get("base_revision")
        rev_arg = f" --revision {rev}" if rev else ""
        lines += [
            "This repository holds only the quantized tables. Lay them onto a local copy of the "
            "base checkpoint (the exact revision the checksums below were taken from); "
            "`embedq apply` refuses a base whose tables differ, and `embedq remove ./base` undoes it:",
            "",
            "```bash",
            "pip install embedq",
            f"hf download {base}{rev_arg} --local-dir ./base",
            f"hf download {repo} --local-dir ./overlay" if repo else "# this bundle, in ./overlay",
            "embedq apply ./base --overlay ./overlay",
            "embedq verify ./base",
            "```",
            "",
            "`./base` then loads as below.",
            "",
        ]
        here = "./base"
    stock = ctx.get("config_json") == "compressed-tensors"
    lines += [
        "### vLLM",
        "",
        ("`config.json` holds a stock compressed-tensors config: vLLM serves it as it is, without "
         "embedq:" if stock else "The `embedq` package registers a vLLM plugin; no flag is needed:"),
        "",
        "```bash",
        "pip install vllm" if stock else "pip install embedq vllm",
        f"vllm serve {here}",
        "```",
        "",
        "### transformers",
        "",
        "```python",
        "import embedq",
        f'model = embedq.load("{here}")  # keeps the packed tables; gathers/dequantizes on the fly',
        "# or, after `import embedq`: AutoModelForCausalLM.from_pretrained(...)",
        "```",
        "",
        "### ONNX Runtime",
        "",
        "The packed bytes are exactly what `GatherBlockQuantized` (embedding) and "
        "`MatMulNBits` (head) read:",
        "",
        "```bash",
        "pip install 'embedq[onnx]'",
        f"embedq onnx export {here} -o model.onnx          # export + patch in one step",
        f"embedq onnx patch float.onnx --overlay {here} -o model.onnx   # or patch your own graph",
        "```",
        "",
    ]
    return "\n".join(lines)


def render(ctx: dict) -> str:
    """The whole README.md text for a card context (see :func:`card_context`)."""
    meta = front_matter(ctx)
    validate_metadata(meta)
    from huggingface_hub import ModelCardData
    yaml = ModelCardData(**meta).to_yaml().rstrip("\n") + "\n"
    mods = ctx["modules"]
    overlay_only = ctx.get("mode") == "overlay-only"
    base = ctx.get("base_model")
    title = (ctx.get("repo_id") or "").split("/")[-1] or ctx.get("title") or "embedq checkpoint"
    schemes = sorted({m["scheme"] for m in mods})
    b = [f"# {title}", ""]
    what = (f"[{base}](https://huggingface.co/{base})" if base else f"`{ctx.get('source_name', 'the source')}`")
    if overlay_only:
        b.append(f"An embedq **overlay bundle** for {what}: the quantized token-embedding "
                 f"table{'s' if len(mods) > 1 else ''} ({', '.join(schemes)}) and {'their' if len(mods) > 1 else 'its'} config, "
                 "without the rest of the weights.")
    else:
        also = [x for r, x in (("per_layer", "per-layer embedding"), ("head", "lm_head"))
                if any(m["role"] == r for m in mods)]
        b.append(f"{what} with its token embedding{''.join(', ' + x for x in also[:-1])}"
                 f"{' and ' + also[-1] if also else ''} "
                 f"quantized by embedq ({', '.join(schemes)}). Every other tensor is the "
                 "source's, byte for byte.")
    if not base:
        b += ["", "> The base model's Hub id is not recorded; re-render this card with "
                  "`embedq card DIR --base-model owner/name`."]
    b += ["", "## Quantization", "",
          "| module | source tensor | shape | scheme | source dtype | before | after | max abs err | rms err |",
          "|---|---|---|---|---|---|---|---|---|"]
    for m in mods:
        name = f"`{m['module']}`" + (" (= " + ", ".join(f"`{a}`" for a in m["aliases"]) + ")" if m["aliases"] else "")
        err = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
        b.append(f"| {name} | `{m['tensor']}` | {' x '.join(map(str, m['shape']))} | {m['scheme']} | "
                 f"{m['source_dtype']} | {_fmt_bytes(m['bytes_before'])} | {_fmt_bytes(m['bytes_after'])} | "
                 f"{err(m.get('max_abs_error'))} | {err(m.get('rms_error'))} |")
    tb, ta = sum(m["bytes_before"] for m in mods), sum(m["bytes_after"] for m in mods)
    b += ["", f"Quantized tables: {_fmt_bytes(tb)} → {_fmt_bytes(ta)} "
              f"({tb:,} → {ta:,} bytes, {100 * (tb - ta) / tb:.1f}% smaller)." if tb else ""]
    if ctx.get("checkpoint_bytes_before") and ctx.get("checkpoint_bytes_after"):
        cb, ca = ctx["checkpoint_bytes_before"], ctx["checkpoint_bytes_after"]
        b.append(f"Whole checkpoint (safetensors): {_fmt_bytes(cb)} → {_fmt_bytes(ca)}.")
    b += ["", "Schemes:", ""]
    for m in mods:
        b.append(f"- `{m['module']}`: {_scheme_words(m)}.")
    b += ["", "Ties: " + _tie_words(ctx), ""]
    bq = ctx.get("base_quantization")
    if bq:
        b += [f"The source was already quantized (`{bq}`); that quantization is kept for every other "
              "layer and embedq serves only the tables above.", ""]
    fv = ctx.get("format_version")  # the overlay's own (unknown in a card stored before it was kept)
    b += ["Format: `embedq.safetensors` holds `weight_packed` (int32, compressed-tensors "
          "pack-quantized layout), `weight_scale`, `weight_shape` (and `weight_zero_point` when "
          "asymmetric) per module; `quantization_config.json` "
          + ("describes them (`quant_method: embedq`" if ctx.get("config_json") == "compressed-tensors"
             else "(also in `config.json` for full checkpoints) describes them (`quant_method: embedq`")
          + (f", format version {fv}" if fv is not None else "") + ")"
          + ("; `config.json` holds the equivalent stock compressed-tensors config "
             "(`quant_method: compressed-tensors`)" if ctx.get("config_json") == "compressed-tensors" else "")
          + ".", ""]
    b += ["## Source", ""]
    if base:
        rev = ctx.get("base_revision")
        b.append(f"- Base model: [{base}](https://huggingface.co/{base})"
                 + (f" at revision `{rev}`" if rev else " (revision not recorded)"))
    else:
        b.append(f"- Base model: not recorded (local folder `{ctx.get('source_name', '?')}`)")
    if ctx.get("base_model_source") and ctx["base_model_source"] != "user":
        b.append(f"  (taken from the {ctx['base_model_source']})")
    algo = mods[0].get("source_digest_name", "blake3") if mods else "blake3"
    b += [f"- {algo} of the source tables (raw little-endian bytes as stored in the safetensors "
          "shards; `embedq apply` and `embedq verify` check them):", "",
          f"| tensor | dtype | shape | {algo} |", "|---|---|---|---|"]
    for m in mods:
        b.append(f"| `{m['tensor']}` | {m['source_dtype']} | {' x '.join(map(str, m['shape']))} | "
                 f"`{m.get('source_digest') or '-'}` |")
    b += ["", "## How to use", "", _usage(ctx)]
    b += ["## Quality", ""]
    if ctx.get("eval") is not None:
        b += ["`embedq eval` (KL divergence of the quantized model against the original):", "",
              render_eval(ctx["eval"])]
    else:
        b += ["Not evaluated here. `embedq eval ./model` measures KL divergence against the "
              "original; `embedq card DIR --eval results.json` adds the numbers to this card.", ""]
    b += [f"_Made with embedq {ctx.get('embedq_version', '')}._", ""]
    body = "\n".join(b)
    state = json.dumps(stored_state(ctx), sort_keys=True, separators=(",", ":"))
    state = state.replace("<", "\\u003c").replace(">", "\\u003e").replace("--", "-\\u002d")
    return f"---\n{yaml}---\n\n{body}\n{MARK}{state}{MARK_END}\n"


def _tie_words(ctx: dict) -> str:
    mods = ctx["modules"]
    aliased = [(a, m["module"]) for m in mods for a in m["aliases"]]
    heads = [m for m in mods if m["role"] == "head"]
    if ctx.get("tied"):
        s = "the model ties its lm_head to the embedding."
        if aliased:
            s += " " + "; ".join(f"`{a}` reads the quantized `{o}` table (one table, no untie; no "
                                 f"`{a}.weight` tensor is written)" for a, o in aliased) + "."
        if heads:
            s += (" The head has its own higher-precision quantized table ("
                  + ", ".join(f"`{h['module']}`: {h['scheme']}" for h in heads)
                  + ") computed from the shared float table: an explicit, recorded untie in quantized form.")
        return s
    if heads:
        return ("untied; the lm_head is quantized separately ("
                + ", ".join(f"`{h['module']}`: {h['scheme']}" for h in heads) + ").")
    return "untied; the lm_head is not quantized and keeps its source dtype."


__all__ = ["render", "render_eval"]
