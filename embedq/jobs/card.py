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

This module writes and refreshes cards; the card's data (inputs, front matter, kept
state, :func:`card_context`) is :mod:`embedq.jobs.card_data`, its text
:mod:`embedq.jobs.card_render`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from embedq.errors import EmbedqError
from embedq.format.checkpoint import QCONFIG_NAME, read_json
from embedq.format.files import stays_inside, write_bytes_atomic
from embedq.format.reader import parse_overlay_config
from embedq.jobs.card_data import (CARD_NAME, EVAL_NAME, CardError, card_context, check_base_model,
                                   check_card_inputs, check_revision, format_version_of, front_matter,
                                   infer_base, load_eval, read_stored, validate_metadata)
from embedq.jobs.card_render import render, render_eval


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


def _overlay_config(folder: Path) -> dict | None:
    """The folder's validated ``quantization_config.json`` (None when it has none).

    The card describes that overlay, so one that is there but unreadable is refused with
    the line other verbs give (``parse_overlay_config``), as ``push`` refuses it, rather
    than a card rendered around a broken folder.
    """
    q = folder / QCONFIG_NAME
    if not (q.exists() or q.is_symlink()):
        return None  # the card's stored state is all a refresh needs
    fix = (f"; {CARD_NAME} left as it was: restore {QCONFIG_NAME} (or re-create the folder with "
           "`embedq quantize --output`), then run `embedq card` again")
    try:
        return parse_overlay_config(folder).to_dict()
    except EmbedqError as e:
        # a line naming another file (config.json, a half-replaced overlay) carries its own fix
        raise CardError(f"{e}{fix}" if str(e).startswith(str(q)) else str(e)) from None
    except OSError as e:  # read_json names bad content; a file it cannot open arrives here
        raise CardError(f"{q}: cannot read it ({e.strerror or type(e).__name__}){fix}") from None


def refresh_card(folder: str | os.PathLike, *, eval_results: Any = None, base_model: str | None = None,
                 base_revision: str | None = None, repo_id: str | None = None,
                 license: str | None = None, write: bool = True) -> str:
    """Re-render an embedq-generated README.md in ``folder`` with new inputs.

    Eval results: ``eval_results`` if given, else ``embedq-eval.json`` in the folder,
    else whatever the card already showed. Returns the new text (written unless
    ``write=False``). Refuses a README.md embedq did not write, and a folder whose
    ``quantization_config.json`` is unreadable (the card is then left as it was).
    """
    folder = Path(folder)
    path = folder / CARD_NAME
    if write:  # a killed run's staged card
        from embedq.format.staging import clean_leftovers
        clean_leftovers(folder, [CARD_NAME])
    if path.is_symlink() and not stays_inside(folder, path):
        # like push: a README.md leading out of the folder is neither read nor replaced
        raise CardError(f"{path}: a link leading out of the folder ({os.readlink(path)}); refusing to "
                        "read or replace it (copy the card into the folder)")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CardError(f"{path}: no model card (made by `embedq quantize --output`?)") from None
    except UnicodeDecodeError:
        raise CardError(f"{path}: not UTF-8 text, so not a card written by embedq; refusing to "
                        "overwrite it") from None
    ctx = read_stored(text)
    if ctx is None:
        raise CardError(f"{path}: not a card written by embedq; refusing to overwrite it")
    ctx.pop("card_version", None)
    qconfig = _overlay_config(folder)
    if "format_version" not in ctx and qconfig is not None:  # stored before it was kept
        ctx["format_version"] = format_version_of(qconfig)
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
           "infer_base", "check_card_inputs", "CardError", "CARD_NAME", "EVAL_NAME"]
