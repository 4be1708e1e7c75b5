"""The model card's data: its inputs (checked), what it copies from the source, its
front matter, the state kept at its end, and :func:`card_context` (everything a card
says, gathered from the run); rendered by :mod:`embedq.jobs.card_render`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from embedq.errors import EmbedqError
from embedq.format.constants import FORMAT_VERSION
from embedq.format.files import read_json, stays_inside
from embedq.format.scheme_units import unit_for

CARD_NAME = "README.md"
EVAL_NAME = "embedq-eval.json"
CARD_VERSION = 1
MARK = "<!-- embedq-card "
MARK_END = " -->"
RELATIONS = ("adapter", "merge", "quantized", "finetune")
# A Hub repository id: ``owner/name`` (one slash, no spaces, no leading dot or dash).
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
_REVISION = re.compile(r"[^\s]{1,256}")
# Fields of the source card's front matter that describe the weights and stay true
# for the quantized copy.
COPIED_FIELDS = ("license", "license_name", "license_link", "language", "pipeline_tag")


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
        where = "eval results"
        try:
            data = json.loads(json.dumps(value, default=_json_default))
        except RecursionError:
            raise CardError(f"{where}: nested too deeply to be eval results") from None
    else:
        p = Path(value)
        if p.is_dir():
            p = p / EVAL_NAME
        where = str(p)
        # the shared reader: a missing file, bad UTF-8, NaN/Infinity, nesting -> one CardError
        data = read_json(p, CardError, missing="eval results file not found", what="eval results file",
                         max_bytes=_EVAL_MAX_BYTES)
    try:
        # A card must not publish nan / inf (a NaN-free JSON can still say 1e999).
        json.dumps(data, allow_nan=False)
        return _publishable(data)
    except ValueError:
        raise CardError(f"{where}: eval results hold a non-finite number (NaN or Infinity); "
                        "rerun `embedq eval --json`") from None
    except RecursionError:
        raise CardError(f"{where}: nested too deeply to be eval results") from None


# `embedq eval --json` writes a few KiB; a bound keeps a hostile file from filling memory.
_EVAL_MAX_BYTES = 16 << 20


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
    for k in COPIED_FIELDS:
        if src.get(k) not in (None, "", []):
            meta[k] = src[k]
    tags = ["embedq", "quantized"]
    for bits in sorted({m["bits"] for m in ctx["modules"]}, reverse=True):
        tags.append(unit_for(bits).tag)
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


# -------------------------------------------------------------- state kept in the card

def stored_state(ctx: dict) -> dict:
    keep = ("mode", "base_model", "base_revision", "base_model_source", "library_name",
            "source_meta", "modules", "tied", "base_quantization", "eval", "repo_id", "title",
            "source_name", "folder_hint", "checkpoint_bytes_before", "checkpoint_bytes_after",
            "embedq_version", "format_version", "config_json")
    d = {k: ctx[k] for k in keep if ctx.get(k) is not None}
    d["card_version"] = CARD_VERSION
    return d


def read_stored(text: str) -> dict | None:
    """The card inputs kept in an embedq-generated README.md, or None."""
    i = text.rfind(MARK)
    if i < 0:
        return None
    j = text.find(MARK_END, i + len(MARK))
    try:
        d = json.loads(text[i + len(MARK):j])
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
            "source_digest": src.get("blake3") or src.get("sha256"),
            "source_digest_name": "blake3" if src.get("blake3") else "sha256",
        })
    return out


def format_version_of(qconfig: dict | None) -> int:
    """The overlay's ``format_version`` (what embedq writes, :data:`FORMAT_VERSION`, when
    the card describes a run without its config at hand)."""
    fv = qconfig.get("format_version") if isinstance(qconfig, dict) else None
    return fv if isinstance(fv, int) and not isinstance(fv, bool) else FORMAT_VERSION


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
    ctx["format_version"] = format_version_of(qconfig)
    if report.mode == "derived (compressed-tensors)":  # config.json: the stock config, not embedq's
        ctx["config_json"] = "compressed-tensors"
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
    ctx["source_meta"] = {k: meta[k] for k in COPIED_FIELDS if meta.get(k) not in (None, "", [])}
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


__all__ = ["card_context", "format_version_of", "front_matter", "validate_metadata", "load_eval", "read_stored", "stored_state",
           "infer_base", "check_card_inputs", "check_base_model", "check_revision", "is_repo_id",
           "CardError", "CARD_NAME", "EVAL_NAME", "CARD_VERSION", "MARK", "MARK_END"]
