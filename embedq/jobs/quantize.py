"""``embedq quantize``: stream the targets of a checkpoint into an overlay.

In place (default) the overlay and its config are added beside untouched shards;
with ``output`` a self-contained derived checkpoint is built (see
:mod:`embedq.jobs.derived`). Nothing becomes visible until every byte of the
overlay is written and fsynced; the edited JSON files are written last, each
atomically, after their originals were backed up for :func:`remove`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from embedq.errors import SchemeError
from embedq.format.checkpoint import OVERLAY_NAME, QCONFIG_NAME, Checkpoint
from embedq.format.config import build_config, parse_config
from embedq.format.constants import FORMAT_VERSION, OVERLAY_FORMAT, is_head_name
from embedq.format.files import check_writable
from embedq.format.scheme import Scheme
from embedq.jobs import state
from embedq.jobs.advice import scheme_advice  # measured on Gemma 3 270M, see docs/quality.md
from embedq.jobs.derived import check_output, write_derived
from embedq.jobs.overlay import plan_modules, write_overlay
from embedq.jobs.report import Report


def quantize_checkpoint(path: str | os.PathLike, bits: int = 8, *, group_size: int | None = None,
                        symmetric: bool = True, method: str = "rtn", lm_head: bool = False,
                        head_bits: int | None = None, head_group_size: int | None = None,
                        head_symmetric: bool | None = None, targets: list[str] | None = None,
                        output: str | os.PathLike | None = None, overlay_only: bool = False,
                        force: bool = False, trust: str | None = None,
                        scale_dtype: str | None = None, chunk_rows: int | None = None,
                        progress: bool = True, base_model: str | None = None,
                        base_revision: str | None = None, eval_results=None,
                        calibration=None) -> Report:
    """Quantize a checkpoint's embedding (and head) into an embedq overlay.

    Without ``output`` the overlay is added in place (source shards untouched;
    ``config.json`` and the index are edited and restorable with :func:`remove`).
    With ``output`` a derived, upload-ready checkpoint is written there instead.
    ``base_model`` / ``base_revision`` (Hub id and revision of the source) and
    ``eval_results`` (an ``embedq eval`` result dict or JSON file) go into the model
    card written with ``output``. ``calibration`` (:func:`embedq.jobs.calibration.collect_calibration`)
    is what ``method="gptq"`` quantizes against; collected from ``path`` when not given.
    """
    if method == "gptq" and calibration is None:  # head-aware: needs the head's inputs, measured once
        from embedq.jobs.calibration import collect_calibration
        calibration = collect_calibration(path, progress=progress)
    t0 = time.perf_counter()
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool)
                                   or chunk_rows < 1):
        raise SchemeError(f"--chunk-rows {chunk_rows!r}: must be a positive number of rows")
    ckpt = Checkpoint.open(path)
    if output is not None:  # the source is only read (it may be a read-only cache)
        check_output(ckpt.path, Path(output), force)
        return _quantize(ckpt, t0, **_args(locals()))
    with state.folder_lock(ckpt.path, "quantize"):
        return _quantize(ckpt, t0, **_args(locals()))


def _args(scope: dict) -> dict:
    return {k: scope[k] for k in _ARGS}


_ARGS = ("bits", "group_size", "symmetric", "method", "lm_head", "head_bits", "head_group_size",
         "head_symmetric", "targets", "output", "overlay_only", "force", "trust", "scale_dtype",
         "chunk_rows", "progress", "base_model", "base_revision", "eval_results", "calibration")


def _quantize(ckpt: Checkpoint, t0: float, *, bits, group_size, symmetric, method, lm_head,
              head_bits, head_group_size, head_symmetric, targets, output, overlay_only, force,
              trust, scale_dtype, chunk_rows, progress, base_model, base_revision, eval_results,
              calibration) -> Report:
    notes: list[str] = []
    base_qc = state.base_state(ckpt, force, derived=output is not None, warnings=notes)
    scheme = Scheme.default(bits, symmetric, group_size, method, scale_dtype)
    head_scheme = None
    if head_bits is not None or head_group_size is not None or head_symmetric is not None:
        hb = head_bits if head_bits is not None else bits
        hg = head_group_size if head_group_size is not None else (group_size if hb == bits else None)
        head_scheme = Scheme.default(hb, symmetric if head_symmetric is None else head_symmetric,
                                     hg, method, scale_dtype)
    plans, aliases, tied = plan_modules(ckpt, scheme, lm_head=lm_head, head_scheme=head_scheme,
                                        targets=targets, trust=trust, fit_default=group_size is None)
    for p in plans:  # gptq weights by what the head needs: gather-only tables get mse
        if p.scheme.method == "gptq" and p.role != "head" and not any(
                is_head_name(a) for a in p.aliases):
            p.scheme = dataclasses.replace(p.scheme, method="mse")
    scheme = plans[0].scheme  # as fitted to the embedding's width
    advice = scheme_advice(scheme, {"tie_word_embeddings": tied}, head_scheme=head_scheme, lm_head=lm_head)
    if output is not None:
        report = write_derived(ckpt, plans, aliases, tied, base_qc, Path(output), force=force,
                               overlay_only=overlay_only, chunk_rows=chunk_rows, progress=progress,
                               base_model=base_model, base_revision=base_revision,
                               eval_results=eval_results, calibration=calibration)
        report.seconds = time.perf_counter() - t0
        report.warnings += notes + ([advice] if advice else [])
        return report

    check_writable(ckpt.path)
    state.cleanup_partials(ckpt.path)
    metadata = {"format": OVERLAY_FORMAT, "format_version": str(FORMAT_VERSION)}
    writer, entries, reports = write_overlay(ckpt, plans, ckpt.path / OVERLAY_NAME, metadata,
                                             chunk_rows, progress, calibration)
    qconfig = build_config(entries, tied, aliases, base_qc)
    try:
        parse_config(qconfig, str(ckpt.path / QCONFIG_NAME))  # what readers will accept
        state.commit_in_place(ckpt, writer, qconfig)
    except BaseException:
        writer.abort()
        raise
    warnings = notes + ([advice] if advice else [])
    if base_model or base_revision or eval_results is not None:
        warnings.append("--base-model/--base-revision/--eval only go into the model card, "
                        "which is written with --output; ignored")
    return Report(str(ckpt.path), "in-place", reports, tied, overlay=str(ckpt.path / OVERLAY_NAME),
                  seconds=time.perf_counter() - t0, warnings=warnings)


__all__ = ["quantize_checkpoint"]
