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

from embedq.errors import CheckpointError, SchemeError
from embedq.format.checkpoint import OVERLAY_NAME, QCONFIG_NAME, Checkpoint
from embedq.format.config import build_config, parse_config
from embedq.format.constants import FORMAT_VERSION, OVERLAY_FORMAT
from embedq.format.files import check_writable
from embedq.jobs import state
from embedq.jobs.advice import scheme_advice  # measured on Gemma 3 270M, see docs/quality.md
from embedq.jobs.compressed_tensors import refuse_early
from embedq.jobs.derived import check_output, write_derived
from embedq.jobs.overlay import ModulePlan, compile_min_bytes, plan_modules, write_overlay
from embedq.jobs.recipe import QuantizeRecipe
from embedq.jobs.report import Report
from embedq.quant.profile import stage


def quantize_checkpoint(path: str | os.PathLike, recipe: QuantizeRecipe) -> Report:
    """Quantize a checkpoint's embedding (and head) into an embedq overlay, as ``recipe`` says.

    Without ``recipe.output`` the overlay is added in place (source shards untouched;
    ``config.json`` and the index are edited and restorable with :func:`remove`).
    With it a derived, upload-ready checkpoint is written there instead (with
    ``recipe.format == "compressed-tensors"``, one stock vLLM serves). A recipe whose
    scheme is still to be chosen (``search``) goes through
    :func:`embedq.quality.select.quantize_auto` instead.
    """
    if recipe.search is not None:
        raise SchemeError("--max-kld/--auto: the scheme is chosen by embedq.quality.select.quantize_auto")
    compile_min_bytes()  # a bad EMBEDQ_COMPILE_MIN_BYTES fails before gptq's calibration run
    calibration = recipe.calibration
    if calibration is None and _needs_calibration(path, recipe):  # the head's inputs, measured once
        from embedq.jobs.calibration import collect_calibration
        calibration = collect_calibration(path, progress=recipe.progress)
    t0 = time.perf_counter()
    with stage("open checkpoint (config, index)"):
        ckpt = Checkpoint.open(path)
    if recipe.output is not None:  # the source is only read (it may be a read-only cache)
        check_output(ckpt.path, recipe.output, recipe.force)
        # --format compressed-tensors is converted inside write_derived's staging folder
        return _quantize(ckpt, t0, recipe, calibration)
    with state.folder_lock(ckpt.path, "quantize"):  # read again under the lock: a killed
        return _quantize(Checkpoint.open(path), t0, recipe, calibration)  # run's overlay may be back


def _plan(ckpt: Checkpoint, r: QuantizeRecipe) -> tuple[list[ModulePlan], dict[str, str], bool]:
    """:func:`plan_modules` for ``r``, with gptq only on tables a head reads (gather-only: mse)."""
    plans, aliases, tied = plan_modules(ckpt, r.scheme, lm_head=r.lm_head, head_scheme=r.head_scheme,
                                        targets=list(r.targets) if r.targets else None, trust=r.trust,
                                        fit_default=r.fit_default, per_layer=r.per_layer_embeddings)
    for p in plans:
        if p.scheme.method == "gptq" and not p.head_reads:
            p.scheme = dataclasses.replace(p.scheme, method="mse")
    return plans, aliases, tied


def _per_layer_note(ckpt: Checkpoint) -> list[str]:
    """A line per per-layer input embedding left float (Gemma 3n's is its largest table)."""
    from embedq.jobs.targets import per_layer_tables
    out = []
    for name in per_layer_tables(ckpt):
        info = ckpt.tensor(name)
        rows, cols = info.shape
        out.append(f"{name} ({rows} x {cols}, {info.nbytes / 1e9:.2f} GB) stays float: --per-layer-embeddings "
                   "quantizes it too (see docs/usage.md)")
    return out


def _needs_calibration(path: str | os.PathLike, r: QuantizeRecipe) -> bool:
    """Whether some table gets gptq. Planned without the lock, as :func:`_quantize` will (it
    plans again under the lock): calibration runs the model and must not hold the folder."""
    if all(s is None or s.method != "gptq" for s in (r.scheme, r.head_scheme)):
        return False
    ckpt = Checkpoint.open(path)
    state.base_state(ckpt, r.force, derived=r.output is not None)  # the config _quantize plans on
    return any(p.scheme.method == "gptq" for p in _plan(ckpt, r)[0])


def _quantize(ckpt: Checkpoint, t0: float, recipe: QuantizeRecipe, calibration) -> Report:
    r, head_scheme = recipe, recipe.head_scheme
    notes: list[str] = []
    with stage("base state (existing overlay, config)"):
        base_qc = state.base_state(ckpt, r.force, derived=r.output is not None, warnings=notes)
    with stage("target discovery + tie check"):
        plans, aliases, tied = _plan(ckpt, r)
    if not r.per_layer_embeddings:
        notes += _per_layer_note(ckpt)
    if calibration is None and any(p.scheme.method == "gptq" for p in plans):
        raise CheckpointError(f"{ckpt.path}: changed during the run (a head now reads a gptq "
                              "table, which needs the calibration not collected); run again")
    if r.format == "compressed-tensors":  # before anything is written: an older output stays
        refuse_early(ckpt, base_qc, tied, aliases)
    scheme = plans[0].scheme  # as fitted to the embedding's width
    advice = scheme_advice(scheme, {"tie_word_embeddings": tied}, head_scheme=head_scheme,
                           lm_head=r.lm_head)
    if r.output is not None:
        report = write_derived(ckpt, plans, aliases, tied, base_qc, r, calibration)
        report.seconds = time.perf_counter() - t0
        report.warnings += notes + ([advice] if advice else [])
        return report

    check_writable(ckpt.path)
    state.cleanup_partials(ckpt.path)
    metadata = {"format": OVERLAY_FORMAT, "format_version": str(FORMAT_VERSION)}
    writer, entries, reports = write_overlay(ckpt, plans, ckpt.path / OVERLAY_NAME, metadata,
                                             r.chunk_rows, r.progress, calibration)
    qconfig = build_config(entries, tied, aliases, base_qc)
    try:
        with stage("commit (config, index, rename, fsync)"):
            parse_config(qconfig, str(ckpt.path / QCONFIG_NAME))  # what readers will accept
            state.commit_in_place(ckpt, writer, qconfig)
    except BaseException:
        writer.abort()
        raise
    warnings = notes + ([advice] if advice else [])
    if r.base_model or r.base_revision or r.eval_results is not None:
        warnings.append("--base-model/--base-revision/--eval only go into the model card, "
                        "which is written with --output; ignored")
    return Report(str(ckpt.path), "in-place", reports, tied, overlay=str(ckpt.path / OVERLAY_NAME),
                  seconds=time.perf_counter() - t0, warnings=warnings)


__all__ = ["quantize_checkpoint"]
