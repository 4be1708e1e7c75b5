"""The model card (``README.md``) of a derived checkpoint or an overlay-only bundle.

The card has YAML front matter the Hub understands (``base_model``,
``base_model_relation: quantized``, ``library_name``, ``tags``, and ``license`` copied
from the source's own card) and a body that states what was done: the scheme of every
quantized module, bytes before and after, how a tied head is handled, the source
checksums, how to load the result with vLLM / ONNX Runtime / transformers, and the
``embedq eval`` numbers when there are any.

Everything the card was rendered from is kept at its end in an HTML comment
(``<!-- embedq-card {...} -->``, invisible on the Hub), so :func:`refresh_card` can
re-render it later (with eval results, a base model or the repository id) from the
folder alone, without the source checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from embedq.errors import EmbedqError
from embedq.format.checkpoint import QCONFIG_NAME, read_json
from embedq.format.files import stays_inside
from embedq.format.files import write_bytes_atomic

CARD_NAME = "README.md"
EVAL_NAME = "embedq-eval.json"
CARD_VERSION = 1
_MARK = "<!-- embedq-card "
_MARK_END = " -->"
RELATIONS = ("adapter", "merge", "quantized", "finetune")
# A Hub repository id: ``owner/name`` (one slash, no spaces, no leading dot or dash).
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
_REVISION = re.compile(r"[^\s]{1,256}")
# Fields of the source card's front matter that describe the weights and stay true
# for the quantized copy.
_COPIED_FIELDS = ("license", "license_name", "license_link", "language", "pipeline_tag")


class CardError(EmbedqError):
    """A model card input (base model, eval results, front matter) is invalid."""


# --------------------------------------------------------------------------- inputs

def is_repo_id(value: Any) -> bool:
    return (isinstance(value, str) and bool(_REPO_ID.fullmatch(value))
            and ".." not in value and not value.endswith((".", "-")))


def check_base_model(value: str | None, where: str = "--base-model") -> str | None:
    if value is None:
        return None
    if not is_repo_id(value):
        raise CardError(f"{where} {value!r}: not a Hub repository id (expected owner/name)")
    return value


def check_revision(value: str | None, where: str = "--base-revision") -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _REVISION.fullmatch(value):
        raise CardError(f"{where} {value!r}: not a revision (branch, tag or commit sha)")
    return value


def check_card_inputs(base_model: str | None, base_revision: str | None, eval_results: Any) -> Any:
    """Validate the user's card inputs up front; returns the loaded eval results."""
    check_base_model(base_model)
    check_revision(base_revision)
    return load_eval(eval_results)


def infer_base(path: Path) -> dict[str, str]:
    """Hub id / revision of a local checkpoint, from where huggingface_hub put it.

    * a cache snapshot ``.../models--owner--name/snapshots/<sha>/`` names both;
    * a ``hf download --local-dir`` folder records the commit in
      ``.cache/huggingface/download/config.json.metadata`` (first line).
    """
    out: dict[str, str] = {}
    p = Path(path).resolve()
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        parts = p.parent.parent.name[len("models--"):].split("--")
        repo = "/".join(parts)
        if len(parts) == 2 and is_repo_id(repo):
            out["base_model"] = repo
            out["base_model_source"] = "Hugging Face cache path"
        if re.fullmatch(r"[0-9a-f]{40}", p.name):
            out["base_revision"] = p.name
    meta = p / ".cache" / "huggingface" / "download" / "config.json.metadata"
    if "base_revision" not in out and meta.is_file():
        try:
            line = meta.read_text().splitlines()[0].strip()
        except (OSError, UnicodeDecodeError, IndexError):
            line = ""
        if re.fullmatch(r"[0-9a-f]{40}", line):
            out["base_revision"] = line
    return out


def _name_or_path(config: dict, ckpt_path: Path) -> str | None:
    """``_name_or_path`` of config.json when it is a Hub id, not a local path."""
    for cfg in (config, config.get("text_config") or {}):
        v = cfg.get("_name_or_path") if isinstance(cfg, dict) else None
        if not is_repo_id(v):
            continue
        # A relative path that exists locally is a folder, not a repository id.
        if Path(v).exists() or (ckpt_path.parent / v).exists():
            continue
        return v
    return None


def read_source_card(path: Path) -> tuple[dict, str | None]:
    """Front matter of the checkpoint's own README.md: ``(metadata, problem)``."""
    f = Path(path) / CARD_NAME
    if not f.is_file():
        return {}, None
    if not stays_inside(path, f):
        return {}, f"{f}: a link out of the folder; not read, license not copied"
    try:
        from huggingface_hub import ModelCard
        import logging
        logging.getLogger("huggingface_hub.repocard").setLevel(logging.ERROR)
        data = ModelCard(f.read_text(encoding="utf-8")).data.to_dict()
    except Exception as e:  # yaml errors, bad encodings
        return {}, f"{f}: front matter not readable ({type(e).__name__}); license not copied"
    return (data if isinstance(data, dict) else {}), None


def load_eval(value: Any) -> Any:
    """Eval results from a dict / list, a JSON file, or a folder holding ``embedq-eval.json``.

    Anything the ``embedq eval`` command reports as JSON is accepted; the card renders
    its scalar numbers (see :func:`render_eval`).
    """
    if value is None:
        return None
    if hasattr(value, "to_dict") and callable(value.to_dict):
        value = value.to_dict()
    if isinstance(value, (dict, list)):
        return _publishable(json.loads(json.dumps(value, default=_json_default)))
    p = Path(value)
    if p.is_dir():
        p = p / EVAL_NAME
    try:
        return _publishable(json.loads(p.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise CardError(f"{p}: eval results file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CardError(f"{p}: eval results are not valid JSON ({e})") from None


_PATH_KEYS = ("path", "reference", "folder", "overlay", "output")


def _publishable(x: Any) -> Any:
    """Eval results without local paths (folder names only) or per-context detail."""
    if isinstance(x, list):
        return [_publishable(v) for v in x]
    if not isinstance(x, dict):
        return x
    out = {}
    for k, v in x.items():
        if k in ("per_context", "per_token"):
            continue
        if isinstance(v, str) and (k in _PATH_KEYS or v.startswith(("/", "~")) or re.match(r"[A-Za-z]:\\", v)):
            v = Path(v).name
        out[k] = _publishable(v)
    return out


def _json_default(o):
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "__dataclass_fields__"):
        from dataclasses import asdict
        return asdict(o)
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


# ------------------------------------------------------------------ front matter

def front_matter(ctx: dict) -> dict:
    """The card's YAML metadata, in the order the Hub shows it."""
    meta: dict[str, Any] = {}
    if ctx.get("base_model"):
        meta["base_model"] = ctx["base_model"]
        meta["base_model_relation"] = "quantized"
    meta["library_name"] = ctx.get("library_name") or "transformers"
    src = ctx.get("source_meta") or {}
    for k in _COPIED_FIELDS:
        if src.get(k) not in (None, "", []):
            meta[k] = src[k]
    tags = ["embedq", "quantized"]
    for bits in sorted({m["bits"] for m in ctx["modules"]}, reverse=True):
        tags.append("int8" if bits == 8 else f"{bits}-bit")
    tags.append("embedding-quantization")
    if ctx.get("mode") == "overlay-only":
        tags.append("overlay")
    meta["tags"] = tags
    return meta


def validate_metadata(meta: dict, where: str = CARD_NAME) -> dict:
    """Offline checks of the fields the Hub validates; raises :class:`CardError`.

    Also round-trips the metadata through ``huggingface_hub.ModelCardData``.
    """
    from huggingface_hub import ModelCardData
    bm = meta.get("base_model")
    if bm is not None:
        for b in ([bm] if isinstance(bm, str) else bm):
            if not is_repo_id(b):
                raise CardError(f"{where}: base_model {b!r} is not a Hub repository id")
    rel = meta.get("base_model_relation")
    if rel is not None:
        if rel not in RELATIONS:
            raise CardError(f"{where}: base_model_relation {rel!r} is not one of {', '.join(RELATIONS)}")
        if not bm:
            raise CardError(f"{where}: base_model_relation needs a base_model")
    lic = meta.get("license")
    if lic is not None and not (isinstance(lic, str) and re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", lic)):
        raise CardError(f"{where}: license {lic!r} is not a Hub license id")
    tags = meta.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) and t for t in tags)):
        raise CardError(f"{where}: tags must be a list of strings")
    ln = meta.get("library_name")
    if ln is not None and not (isinstance(ln, str) and re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", ln)):
        raise CardError(f"{where}: library_name {ln!r} is not a library id")
    data = ModelCardData(**meta).to_dict()
    for k, v in meta.items():
        if data.get(k) != v:
            raise CardError(f"{where}: field {k} does not survive ModelCardData ({data.get(k)!r})")
    return data


# -------------------------------------------------------------------------- body

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
    bits = f"int{m['bits']}" if m["bits"] == 8 else f"{m['bits']}-bit int"
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
         + (" (head kept float)" if d.get("float_head") else "")),
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
    lines += [
        "### vLLM",
        "",
        "The `embedq` package registers a vLLM plugin; no flag is needed:",
        "",
        "```bash",
        "pip install embedq vllm",
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
        b.append(f"{what} with its token embedding{' and lm_head' if any(m['role'] == 'head' for m in mods) else ''} "
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
    b += ["Format: `embedq.safetensors` holds `weight_packed` (int32, compressed-tensors "
          "pack-quantized layout), `weight_scale`, `weight_shape` (and `weight_zero_point` when "
          "asymmetric) per module; `quantization_config.json` (also in `config.json` for full "
          "checkpoints) describes them (`quant_method: embedq`, format version 1).", ""]
    b += ["## Source", ""]
    if base:
        rev = ctx.get("base_revision")
        b.append(f"- Base model: [{base}](https://huggingface.co/{base})"
                 + (f" at revision `{rev}`" if rev else " (revision not recorded)"))
    else:
        b.append(f"- Base model: not recorded (local folder `{ctx.get('source_name', '?')}`)")
    if ctx.get("base_model_source") and ctx["base_model_source"] != "user":
        b.append(f"  (taken from the {ctx['base_model_source']})")
    b += ["- sha256 of the source tables (raw little-endian bytes as stored in the safetensors "
          "shards; `embedq apply` and `embedq verify` check them):", "",
          "| tensor | dtype | shape | sha256 |", "|---|---|---|---|"]
    for m in mods:
        b.append(f"| `{m['tensor']}` | {m['source_dtype']} | {' x '.join(map(str, m['shape']))} | "
                 f"`{m.get('source_sha256') or '-'}` |")
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
    state = json.dumps(_stored(ctx), sort_keys=True, separators=(",", ":"))
    state = state.replace("<", "\\u003c").replace(">", "\\u003e").replace("--", "-\\u002d")
    return f"---\n{yaml}---\n\n{body}\n{_MARK}{state}{_MARK_END}\n"


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


def _stored(ctx: dict) -> dict:
    keep = ("mode", "base_model", "base_revision", "base_model_source", "library_name",
            "source_meta", "modules", "tied", "base_quantization", "eval", "repo_id", "title",
            "source_name", "folder_hint", "checkpoint_bytes_before", "checkpoint_bytes_after",
            "embedq_version")
    d = {k: ctx[k] for k in keep if ctx.get(k) is not None}
    d["card_version"] = CARD_VERSION
    return d


def read_stored(text: str) -> dict | None:
    """The card inputs kept in an embedq-generated README.md, or None."""
    i = text.rfind(_MARK)
    if i < 0:
        return None
    j = text.find(_MARK_END, i + len(_MARK))
    try:
        d = json.loads(text[i + len(_MARK):j])
    except (json.JSONDecodeError, ValueError):
        return None
    return d if isinstance(d, dict) and d.get("card_version") == CARD_VERSION else None


# ------------------------------------------------------------------------ context

def _modules(report, qconfig: dict | None) -> list[dict]:
    entries = (qconfig or {}).get("modules") or {}
    out = []
    for m in report.modules:
        e = entries.get(m.module) or {}
        src = e.get("source") or {}
        out.append({
            "module": m.module, "tensor": m.tensor, "shape": list(m.shape), "scheme": m.scheme,
            "source_dtype": m.source_dtype, "bytes_before": m.bytes_before, "bytes_after": m.bytes_after,
            "max_abs_error": m.max_abs_error, "rms_error": m.rms_error, "role": m.role,
            "aliases": list(m.aliases), "bits": e.get("num_bits") or _bits_of(m.scheme),
            "group_size": e.get("group_size"), "symmetric": e.get("symmetric", "asym" not in m.scheme),
            "scale_dtype": e.get("scale_dtype"), "method": e.get("method"),
            "source_sha256": src.get("sha256"),
        })
    return out


def _bits_of(label: str) -> int:
    m = re.match(r"int(\d+)", label)
    return int(m.group(1)) if m else 8


def card_context(report, qconfig: dict | None = None, ckpt=None, *, base_model: str | None = None,
                 base_revision: str | None = None, eval_results: Any = None,
                 repo_id: str | None = None, license: str | None = None) -> dict:
    """Everything a card says, gathered from the run, the source checkpoint and the user.

    ``base_model`` precedence: the argument / ``report.extra['base_model']``, then the
    Hugging Face cache layout of the source folder, then config.json's
    ``_name_or_path`` when it is a Hub id (not a local path). The source card's
    ``base_model`` is deliberately not used: it names the source's *own* parent.
    """
    from embedq.version import __version__
    extra = getattr(report, "extra", {}) or {}
    ctx: dict[str, Any] = {"mode": report.mode if report.mode in ("overlay-only",) else "derived",
                           "tied": bool(report.tied), "embedq_version": __version__}
    ctx["modules"] = _modules(report, qconfig)
    bm = check_base_model(base_model or extra.get("base_model"))
    rev = check_revision(base_revision or extra.get("base_revision"))
    src_path = Path(ckpt.path) if ckpt is not None else Path(report.path)
    ctx["source_name"] = src_path.name
    if bm:
        ctx["base_model_source"] = "user"
    inferred = infer_base(src_path) if src_path.exists() else {}
    if not bm and inferred.get("base_model"):
        bm, ctx["base_model_source"] = inferred["base_model"], inferred["base_model_source"]
    if not bm and ckpt is not None:
        v = _name_or_path(ckpt.config, src_path)
        if v:
            bm, ctx["base_model_source"] = v, "config.json _name_or_path"
    if not rev and inferred.get("base_model", bm) == bm:
        # (a revision found beside another repository's id is not this base's)
        rev = inferred.get("base_revision")
    ctx["base_model"], ctx["base_revision"] = bm, rev
    warnings = []
    if not bm:
        warnings.append("model card: base model unknown (pass --base-model owner/name)")
    elif ctx.get("base_model_source") not in (None, "user"):
        warnings.append(f"model card: base_model {bm} taken from the {ctx['base_model_source']} "
                        "(pass --base-model to override)")
    if ctx["mode"] == "overlay-only" and not rev:
        warnings.append("model card: base revision unknown (pass --base-revision); "
                        "the source checksums still pin the tables")
    meta, problem = read_source_card(src_path) if src_path.exists() else ({}, None)
    if problem:
        warnings.append(problem)
    ctx["source_meta"] = {k: meta[k] for k in _COPIED_FIELDS if meta.get(k) not in (None, "", [])}
    link = ctx["source_meta"].get("license_link")
    if isinstance(link, str) and bm and not re.match(r"[a-z]+://", link):
        # A link relative to the source repository (e.g. "LICENSE") must keep pointing there.
        ctx["source_meta"]["license_link"] = (f"https://huggingface.co/{bm}/blob/"
                                              f"{rev or 'main'}/{link.lstrip('./')}")
    if license:
        ctx["source_meta"]["license"] = license
    ctx["library_name"] = "embedq" if ctx["mode"] == "overlay-only" else "transformers"
    bq = (qconfig or {}).get("base_quantization_config")
    ctx["base_quantization"] = (bq.get("quant_method") or "unknown method") if isinstance(bq, dict) else None
    ev = eval_results if eval_results is not None else extra.get("eval")
    ctx["eval"] = load_eval(ev)
    ctx["repo_id"] = check_base_model(repo_id, "--repo-id") if repo_id else None
    out = getattr(report, "output", None)
    ctx["title"] = Path(out).name if out else f"{src_path.name}-embedq"
    ctx["folder_hint"] = f"./{Path(out).name}" if out else None
    ctx["_warnings"] = warnings
    return ctx


def _safetensors_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors") if f.is_file())


def write_card(folder: str | os.PathLike, ckpt, report, qconfig: dict) -> Path:
    """Write ``README.md`` into ``folder`` (a derived checkpoint or overlay bundle being built).

    Called by :func:`embedq.jobs.derived.write_derived`; card inputs given to
    ``embedq.quantize`` arrive in ``report.extra`` (``base_model``, ``base_revision``,
    ``eval``). Warnings (e.g. unknown base model) are added to the report.
    """
    folder = Path(folder)
    ctx = card_context(report, qconfig, ckpt)
    if ctx["eval"] is None and (folder / EVAL_NAME).is_file():
        ctx["eval"] = load_eval(folder / EVAL_NAME)
    if ctx["mode"] != "overlay-only":
        try:
            ctx["checkpoint_bytes_before"] = sum(ckpt.tensor(n).nbytes for n in ckpt.weight_map)
            ctx["checkpoint_bytes_after"] = _safetensors_bytes(folder)
        except Exception:  # sizes are informative only
            pass
    for w in ctx.pop("_warnings"):
        if w not in report.warnings:
            report.warnings.append(w)
    path = folder / CARD_NAME
    write_bytes_atomic(path, render(ctx).encode("utf-8"))
    return path


def render_report_card(report, *, base_model: str | None = None, base_revision: str | None = None,
                       eval_results: Any = None, repo_id: str | None = None,
                       license: str | None = None) -> str:
    """README.md text for a :class:`~embedq.jobs.report.Report` (``Report.to_model_card()``)."""
    qconfig = None
    for d in (getattr(report, "output", None), getattr(report, "path", None)):
        if d and (Path(d) / QCONFIG_NAME).is_file():
            try:
                qconfig = read_json(Path(d) / QCONFIG_NAME)
            except EmbedqError:
                qconfig = None
            break
    ckpt = None
    try:
        from embedq.format.checkpoint import Checkpoint
        ckpt = Checkpoint.open(report.path)
    except Exception:
        ckpt = None
    ctx = card_context(report, qconfig, ckpt, base_model=base_model, base_revision=base_revision,
                       eval_results=eval_results, repo_id=repo_id, license=license)
    ctx.pop("_warnings")
    return render(ctx)


def refresh_card(folder: str | os.PathLike, *, eval_results: Any = None, base_model: str | None = None,
                 base_revision: str | None = None, repo_id: str | None = None,
                 license: str | None = None, write: bool = True) -> str:
    """Re-render an embedq-generated README.md in ``folder`` with new inputs.

    Eval results: ``eval_results`` if given, else ``embedq-eval.json`` in the folder,
    else whatever the card already showed. Returns the new text (written unless
    ``write=False``). Refuses a README.md embedq did not write.
    """
    folder = Path(folder)
    path = folder / CARD_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CardError(f"{path}: no model card (made by `embedq quantize --output`?)") from None
    ctx = read_stored(text)
    if ctx is None:
        raise CardError(f"{path}: not a card written by embedq; refusing to overwrite it")
    ctx.pop("card_version", None)
    if base_model:
        ctx["base_model"], ctx["base_model_source"] = check_base_model(base_model), "user"
        if not base_revision:
            ctx.pop("base_revision", None)
    if base_revision:
        ctx["base_revision"] = check_revision(base_revision)
    if repo_id:
        ctx["repo_id"] = check_base_model(repo_id, "--repo-id")
    if license:
        ctx.setdefault("source_meta", {})["license"] = license
    if eval_results is not None:
        ctx["eval"] = load_eval(eval_results)
    elif (folder / EVAL_NAME).is_file():
        ctx["eval"] = load_eval(folder / EVAL_NAME)
    new = render(ctx)
    if write and new != text:
        write_bytes_atomic(path, new.encode("utf-8"))
    return new


__all__ = ["write_card", "render_report_card", "refresh_card", "card_context", "render",
           "validate_metadata", "front_matter", "load_eval", "render_eval", "read_stored",
           "infer_base", "CardError", "CARD_NAME", "EVAL_NAME"]
