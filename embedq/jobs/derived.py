"""Derived checkpoints: a self-contained, upload-ready copy with the overlay inside.

Unchanged shards are hard-linked (copied across filesystems); shards that held a
quantized float table are rewritten streaming without it. Everything is built in
a hidden sibling folder and renamed to the destination at the end, so a
half-built checkpoint never sits at the destination's name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from embedq.errors import OverlayError
from embedq.format.constants import FORMAT_VERSION, OVERLAY_FORMAT
from embedq.format.checkpoint import (CONFIG_NAME, read_safetensors_header, INDEX_NAME, OVERLAY_NAME, QCONFIG_NAME,
                                        STATE_DIR, Checkpoint)
from embedq.format.config import build_config, parse_config
from embedq.format import staging
from embedq.format.files import check_writable, link_or_copy, stays_inside, write_json_atomic
from embedq.format.dtypes import ST_NAME_TO_DTYPE
from embedq.format.writer import StreamingSafetensorsWriter, fsync_dir
from embedq.jobs import testpoint
from embedq.jobs.card import check_card_inputs, write_card
from embedq.jobs.compressed_tensors import ct_quantization_config
from embedq.jobs.overlay import write_overlay
from embedq.jobs.recipe import QuantizeRecipe
from embedq.jobs.report import Report

COPY_CHUNK = 64 << 20
# Written into every derived checkpoint / bundle: ``--force`` replaces only a folder
# that has it (or an empty one). A dotfile, so ``embedq push`` leaves it out.
OUTPUT_MARKER = ".embedq-output"
SKIP_FILES = {CONFIG_NAME, INDEX_NAME, OVERLAY_NAME, QCONFIG_NAME, "README.md"}


def rewrite_shard_without(src: Path, dst: Path, drop: set[str]) -> dict[str, int]:
    """Copy safetensors ``src`` to ``dst`` minus tensors ``drop``, streaming raw bytes.

    Returns the kept tensors' byte sizes.
    """
    n, header = read_safetensors_header(src)
    meta = header.get("__metadata__")
    keep = {k: v for k, v in header.items() if k != "__metadata__" and k not in drop}
    order = sorted(keep, key=lambda k: keep[k]["data_offsets"][0])
    decl = {k: (ST_NAME_TO_DTYPE[keep[k]["dtype"]], tuple(keep[k]["shape"])) for k in order}
    sizes = {}
    with open(src, "rb") as f, StreamingSafetensorsWriter(dst, decl, meta) as w:
        for k in order:
            b, e = keep[k]["data_offsets"]
            for off in range(0, e - b, COPY_CHUNK):
                m = min(COPY_CHUNK, e - b - off)
                w.write_bytes(k, os.pread(f.fileno(), m, 8 + n + b + off), off)
            sizes[k] = e - b
    return sizes


def write_derived(ckpt: Checkpoint, plans, aliases: dict[str, str], tied: bool,
                  base_qc: dict | None, recipe: QuantizeRecipe, calibration=None) -> Report:
    """Build the derived checkpoint (or overlay-only bundle) ``recipe.output``."""
    # fail on bad card inputs before any work
    eval_results = check_card_inputs(recipe.base_model, recipe.base_revision, recipe.eval_results)
    output = check_output(ckpt.path, recipe.output, recipe.force)
    overlay_only = recipe.overlay_only
    output.parent.mkdir(parents=True, exist_ok=True)
    check_writable(output.parent)
    staging.clean_leftovers(output.parent, [output.name])
    stage = staging.partial_path(output)
    stage.mkdir()
    try:
        metadata = {"format": OVERLAY_FORMAT, "format_version": str(FORMAT_VERSION)}
        writer, entries, reports = write_overlay(ckpt, plans, stage / OVERLAY_NAME, metadata,
                                                 recipe.chunk_rows, recipe.progress, calibration)
        writer.commit()
        qconfig = build_config(entries, tied, aliases, base_qc)
        parse_config(qconfig, str(output / QCONFIG_NAME))  # what readers will accept
        compressed = recipe.format == "compressed-tensors"
        # Built here, inside the staging folder: a refusal leaves an older output in place.
        served_qc = ct_quantization_config(ckpt, qconfig) if compressed else qconfig
        sources = {p.tensor for p in plans}
        # Tensors loaders must no longer see: the quantized float tables, and a
        # tied head's duplicate of the embedding.
        drop = set(sources) | {a + ".weight" for a in aliases if ckpt.has(a + ".weight")}
        if overlay_only:
            write_json_atomic(stage / QCONFIG_NAME, qconfig)
        else:
            _write_weights(ckpt, stage, drop, writer)
            config = dict(ckpt.config)
            config["quantization_config"] = served_qc
            write_json_atomic(stage / QCONFIG_NAME, qconfig)
            for f in sorted(ckpt.path.iterdir()):
                if f.name in SKIP_FILES or f.name.startswith(".") or f.suffix == ".safetensors" \
                        or f.suffix in (".bin", ".pt", ".pth") or f.name == STATE_DIR:
                    continue
                if f.is_file() and stays_inside(ckpt.path, f):
                    shutil.copy2(f, stage / f.name)
            write_json_atomic(stage / CONFIG_NAME, config)
        mode = "overlay-only" if overlay_only else (
            "derived (compressed-tensors)" if compressed else "derived")
        report = Report(str(ckpt.path), mode, reports, tied,
                        overlay=str(output / OVERLAY_NAME), output=str(output))
        # Inputs of the model card (embedq.jobs.card reads them from here).
        report.extra.update({k: v for k, v in (("base_model", recipe.base_model),
                                                ("base_revision", recipe.base_revision),
                                                ("eval", eval_results)) if v is not None})
        try:
            write_card(stage, ckpt, report, qconfig)
        except ImportError:
            pass
        write_json_atomic(stage / OUTPUT_MARKER, {"written_by": "embedq", "source": str(ckpt.path)})
        fsync_dir(stage)
        testpoint.reached("derived-staged")
        staging.kill_point("staged")
        staging.exchange(stage, output)  # an older output (--force) and the new swap at once
        staging.kill_point("committed")
        return report
    except Exception as e:
        staging.remove(stage)
        err = staging.renamed(e, stage, output)  # say the output's name, never the staging one
        if err is e:
            raise
        raise err from e
    except BaseException:
        staging.remove(stage)
        raise


def check_output(source: Path, output: Path, force: bool) -> Path:
    """The resolved destination, or an OverlayError: never the source, a folder inside
    it or one holding it; an existing folder only when empty, or with ``force`` when
    embedq wrote it (it has :data:`OUTPUT_MARKER`)."""
    src = Path(source).resolve()
    out = Path(output).resolve()
    if out == src:
        raise OverlayError(f"{out}: --output must differ from the source folder")
    if src in out.parents:
        raise OverlayError(f"{out}: --output is inside the source folder {src}; choose a folder outside it")
    if out in src.parents:
        raise OverlayError(f"{out}: --output contains the source folder {src}; refusing "
                           "(replacing it would delete the source)")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise OverlayError(f"{out}: --output exists and is not a folder")
        if any(out.iterdir()):
            if not force:
                raise OverlayError(f"{out}: destination exists and is not empty (pass --force to replace it)")
            marker = out / OUTPUT_MARKER
            if marker.is_symlink() or not marker.is_file():
                raise OverlayError(f"{out}: not a folder embedq wrote (no {OUTPUT_MARKER}); --force only "
                                   "replaces an earlier embedq output or an empty folder")
    return out


def _write_weights(ckpt: Checkpoint, stage: Path, drop: set[str], writer) -> None:
    files = ckpt.files()
    weight_map: dict[str, str] = {}
    total = 0
    subfolders: set[Path] = set()  # shards the index names in sub-folders ("sub/x.safetensors")
    for f in files:
        names = [k for k, v in ckpt.weight_map.items() if v == f]
        (stage / f).parent.mkdir(parents=True, exist_ok=True)
        if any(n in drop for n in names):
            sizes = rewrite_shard_without(ckpt.path / f, stage / f, drop)
            if not sizes:  # the shard held nothing else: neither it nor an emptied sub-folder stays
                (stage / f).unlink()
                for d in (stage / f).parents:
                    if d == stage or any(d.iterdir()):
                        break
                    d.rmdir()
                continue
        else:
            link_or_copy(ckpt.path / f, stage / f)
            _, header = ckpt.header(f)
            sizes = {k: v["data_offsets"][1] - v["data_offsets"][0]
                     for k, v in header.items() if k != "__metadata__"}
        subfolders.update(d for d in (stage / f).parents if stage in d.parents)
        for k, s in sizes.items():
            weight_map[k] = f
            total += s
    for name, size in writer.sizes.items():
        weight_map[name] = OVERLAY_NAME
        total += size
    index = {"metadata": {"total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}
    if ckpt.index and isinstance(ckpt.index.get("metadata"), dict):
        meta = {k: v for k, v in ckpt.index["metadata"].items() if k != "total_parameters"}
        index["metadata"] = {**meta, "total_size": total}
    write_json_atomic(stage / INDEX_NAME, index)
    for d in sorted(subfolders, key=lambda d: -len(d.parts)):  # their entries, deepest first
        fsync_dir(d)
