"""``embedq quantize``: stream the targets of a checkpoint into an overlay.

In place (default) the overlay and its config are added beside untouched shards;
with ``output`` a self-contained derived checkpoint is built (see
:mod:`embedq.overlays.derived`). Nothing becomes visible until every byte of the
overlay is written and fsynced; the edited JSON files are written last, each
atomically, after their originals were backed up for :func:`remove`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from embedq.errors import CheckpointError, EmbedqError, OverlayError, SchemeError
from embedq.overlays import state
from embedq.overlays.checkpoint import (CONFIG_NAME, INDEX_NAME, OVERLAY_NAME, QCONFIG_NAME,
                                        Checkpoint)
from embedq.overlays.config import QUANT_METHOD, build_config, module_entry
from embedq.overlays.files import check_writable, write_json_atomic
from embedq.overlays.safetensors_writer import StreamingSafetensorsWriter
from embedq.overlays.targets import find_targets, resolve_ties
from embedq.quantize.kernels import has_cached_kernel
from embedq.quantize.packing import pack_zero_points, packed_zero_point_rows
from embedq.quantize.scheme import DTYPE_NAMES, Scheme, dtype_from_name
from embedq.quantize.stream import (ROW_ALIGN, ErrorStats, MappedRows, Pipeline,
                                   default_chunk_rows, quantize_pack_chunk)
from embedq.report import ModuleReport, Report

ST_TO_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass
class ModulePlan:
    module: str  # overlay module name, e.g. model.embed_tokens
    tensor: str  # source tensor name
    scheme: Scheme
    role: str  # embedding | head | mtp
    shape: tuple[int, int] = (0, 0)
    dtype: torch.dtype = torch.bfloat16
    file: str = ""
    aliases: list[str] = field(default_factory=list)

    @property
    def scale_dtype(self) -> torch.dtype:
        return dtype_from_name(self.scheme.scale_dtype) if self.scheme.scale_dtype else self.dtype

    def overlay_tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        rows, cols = self.shape
        s = self.scheme
        t = {
            f"{self.module}.weight_packed": (torch.int32, (rows, cols * s.bits // 32)),
            f"{self.module}.weight_scale": (self.scale_dtype, (rows, s.groups(cols))),
            f"{self.module}.weight_shape": (torch.int64, (2,)),
        }
        if not s.symmetric:
            t[f"{self.module}.weight_zero_point"] = (
                torch.int32, (packed_zero_point_rows(rows, s.bits), s.groups(cols)))
        return t


def _strip_weight(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _tensors_identical(ckpt: Checkpoint, a: str, b: str) -> bool:
    ta, tb = ckpt.tensor(a), ckpt.tensor(b)
    if ta.shape != tb.shape or ta.dtype != tb.dtype:
        return False
    step = 8 << 20  # usually decided by the first block; keeps peak memory small
    with open(ckpt.path / ta.file, "rb") as fa, open(ckpt.path / tb.file, "rb") as fb:
        for off in range(0, ta.nbytes, step):
            n = min(step, ta.nbytes - off)
            if os.pread(fa.fileno(), n, ta.file_offset + off) != os.pread(fb.fileno(), n, tb.file_offset + off):
                return False
    return True


def _base_state(ckpt: Checkpoint, force: bool) -> dict | None:
    """Undo a previous overlay in memory; return the original quantization_config."""
    qc = ckpt.existing_quantization_config()
    backup = state.read_backup(ckpt.path)
    if qc and qc.get("quant_method") == QUANT_METHOD:
        if backup is None:
            raise OverlayError(
                f"{ckpt.path}: already quantized by embedq and no original is recorded "
                "(a derived checkpoint?); quantize its source instead")
        if not force:
            raise OverlayError(f"{ckpt.path}: already has an embedq overlay; "
                               "pass --force to replace it or run `embedq remove` first")
    if backup is not None:
        # The original config (and index) as they were before any embedq run.
        ckpt.config = json.loads(backup[CONFIG_NAME])
        qc = ckpt.existing_quantization_config()
    return qc


def plan_modules(ckpt: Checkpoint, scheme: Scheme, *, lm_head: bool = False,
                 head_scheme: Scheme | None = None, targets: list[str] | None = None,
                 trust: str | None = None) -> tuple[list[ModulePlan], dict[str, str], bool]:
    """Decide what to quantize: module plans, aliases, and whether the model is tied."""
    t, tied_cfg = find_targets(ckpt, targets)
    identical = _tensors_identical(ckpt, t.embedding, t.head) if t.head else None
    tied = resolve_ties(t, tied_cfg, identical, trust, str(ckpt.path / CONFIG_NAME))
    emb_mod = _strip_weight(t.embedding)
    plans = [ModulePlan(emb_mod, t.embedding, scheme, "embedding")]
    aliases: dict[str, str] = {}
    if tied:
        if head_scheme is not None and head_scheme != scheme:
            # An explicit, recorded untie in quantized form: the head gets its own
            # (higher-precision) table computed from the shared float table.
            plans.append(ModulePlan(t.head_module, t.embedding, head_scheme, "head"))
        else:
            aliases[t.head_module] = emb_mod
    elif lm_head:
        plans.append(ModulePlan(_strip_weight(t.head), t.head, head_scheme or scheme, "head"))
    for extra in t.extra_embeddings:
        if _tensors_identical(ckpt, t.embedding, extra):
            aliases[_strip_weight(extra)] = emb_mod
        else:
            plans.append(ModulePlan(_strip_weight(extra), extra, scheme, "mtp"))
    for p in plans:
        info = ckpt.tensor(p.tensor)
        if info.dtype not in ST_TO_TORCH:
            raise SchemeError(f"{ckpt.path / info.file}: {p.tensor} has dtype {info.dtype}; "
                              "embedq quantizes BF16, F16 or F32 tables")
        p.scheme.check_shape(info.shape, f"{ckpt.path / info.file}: {p.tensor}")
        p.shape, p.dtype, p.file = tuple(info.shape), ST_TO_TORCH[info.dtype], info.file
        p.aliases = sorted(a for a, o in aliases.items() if o == p.module)
    return plans, aliases, tied


def write_overlay(ckpt: Checkpoint, plans: list[ModulePlan], dest: Path, metadata: dict,
                  chunk_rows: int | None = None, progress: bool = True
                  ) -> tuple[StreamingSafetensorsWriter, dict[str, dict], list[ModuleReport]]:
    """Stream every planned module into ``dest`` (finished, fsynced, not yet renamed)."""
    declared: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for p in plans:
        declared.update(p.overlay_tensors())
    writer = StreamingSafetensorsWriter(dest, declared, metadata)
    writer.open()
    entries: dict[str, dict] = {}
    reports: list[ModuleReport] = []
    total = sum(p.shape[0] * p.shape[1] * p.dtype.itemsize for p in plans)
    # Build a compiled kernel only when the job is big enough to repay it; one already
    # built (cached on disk) is always used.
    compiled = None if total >= compile_min_bytes() else False
    try:
        for p in plans:
            rows, cols = p.shape
            itemsize = p.dtype.itemsize
            cr = chunk_rows or default_chunk_rows(cols, itemsize)
            out_hash = {n: hashlib.sha256() for n in p.overlay_tensors()}
            stats = ErrorStats()
            bar = tqdm(total=rows, desc=f"{p.module} {p.scheme.label()}", unit="row",
                       disable=not progress, leave=False)
            try:
                src_digest = stream_module(ckpt, p, writer, out_hash, stats, cr, bar, compiled)
            finally:
                bar.close()
            shape_t = torch.tensor([rows, cols], dtype=torch.int64)
            writer.write(f"{p.module}.weight_shape", shape_t)
            out_hash[f"{p.module}.weight_shape"].update(shape_t.numpy().tobytes())
            source = {"tensor": p.tensor, "dtype": DTYPE_NAMES[p.dtype], "sha256": src_digest}
            entry = module_entry(p.scheme, p.shape, DTYPE_NAMES[p.scale_dtype], source,
                                 {n: h.hexdigest() for n, h in out_hash.items()})
            entry["role"] = p.role
            entries[p.module] = entry
            before = rows * cols * itemsize
            after = p.scheme.overlay_bytes(p.shape, p.scale_dtype.itemsize)
            reports.append(ModuleReport(p.module, p.tensor, [rows, cols], p.scheme.label(),
                                        DTYPE_NAMES[p.dtype], before, after, stats.max_abs,
                                        stats.rms, stats.rel_rms, p.role, p.aliases))
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return writer, entries, reports


# Compiling the fused kernel costs 10-20 s once per machine, chunk shape and scheme
# (then it is loaded from disk in milliseconds); it saves ~3.5 s per GB of table.
# Below this many bytes of tables per run, a kernel not built yet is not worth building.
COMPILE_MIN_BYTES = 1 << 30


def compile_min_bytes() -> int:
    v = os.environ.get("EMBEDQ_COMPILE_MIN_BYTES")
    return int(v) if v else COMPILE_MIN_BYTES


def stream_module(ckpt: Checkpoint, p: ModulePlan, writer: StreamingSafetensorsWriter,
                  out_hash: dict, stats: ErrorStats, chunk_rows: int, bar=None,
                  compiled: bool | None = None) -> str:
    """Quantize one planned table into ``writer``, chunk by chunk, in bounded memory.

    Three stages overlap (see :class:`embedq.quantize.stream.Pipeline`): the source
    rows are mapped from the shard and hashed, quantized and packed by the fused
    kernel (``compiled``: None = when available, False = the eager reference), then
    written and hashed. Returns the source's sha256.

    Zero points (asymmetric) are packed along rows, ``32/bits`` rows per int32; chunks
    are a multiple of 64 rows, so each chunk's zero points pack on their own into
    whole rows of ``weight_zero_point`` (the last chunk padded exactly as the whole
    tensor would be) and are written with the chunk: no full-table temporary.
    """
    rows, cols = p.shape
    path = ckpt.path / p.file
    info = ckpt.tensor(p.tensor)
    # A table smaller than one chunk is one (padded) chunk of its own size.
    chunk_rows = min(chunk_rows, -(-rows // ROW_ALIGN) * ROW_ALIGN)
    if compiled is False and has_cached_kernel(chunk_rows, cols, p.dtype, p.scheme, p.scale_dtype):
        compiled = None
    packed_name, scale_name = f"{p.module}.weight_packed", f"{p.module}.weight_scale"
    zp_name = f"{p.module}.weight_zero_point"
    bits = p.scheme.bits
    assert chunk_rows % (32 // bits) == 0

    def compute(r0: int, x: torch.Tensor):
        packed, scale, zp, st = quantize_pack_chunk(x, p.scheme, p.scale_dtype, pad_rows=chunk_rows,
                                                    compiled=compiled)
        stats.add(*st, x.numel())
        if bar is not None:
            bar.update(x.shape[0])
        if zp is None:
            return packed, scale
        return packed, scale, pack_zero_points(zp, bits)

    def write(r0: int, out) -> None:
        names = (packed_name, scale_name, zp_name)
        rows_at = (r0, r0, r0 * bits // 32)
        for name, t, row in zip(names, out, rows_at):
            writer.write(name, t, row=row)
            out_hash[name].update(t.contiguous().view(torch.uint8).numpy())

    try:
        source = MappedRows(path, info.file_offset, (rows, cols), p.dtype)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {p.tensor}: {e.strerror or e}") from None
    with source:
        return Pipeline(source, chunk_rows, compute, write, writer_fd=getattr(writer, "_fd", None)).run()



def quantize_checkpoint(path: str | os.PathLike, bits: int = 8, *, group_size: int | None = None,
                        symmetric: bool = True, method: str = "rtn", lm_head: bool = False,
                        head_bits: int | None = None, head_group_size: int | None = None,
                        head_symmetric: bool | None = None, targets: list[str] | None = None,
                        output: str | os.PathLike | None = None, overlay_only: bool = False,
                        force: bool = False, trust: str | None = None,
                        scale_dtype: str | None = None, chunk_rows: int | None = None,
                        progress: bool = True, base_model: str | None = None,
                        base_revision: str | None = None, eval_results=None) -> Report:
    """Quantize a checkpoint's embedding (and head) into an embedq overlay.

    Without ``output`` the overlay is added in place (source shards untouched;
    ``config.json`` and the index are edited and restorable with :func:`remove`).
    With ``output`` a derived, upload-ready checkpoint is written there instead.
    ``base_model`` / ``base_revision`` (Hub id and revision of the source) and
    ``eval_results`` (an ``embedq eval`` result dict or JSON file) go into the model
    card written with ``output``.
    """
    if method == "gptq":  # head-aware: needs the head's inputs, measured once (quantize/headaware.py)
        args = {k: v for k, v in locals().items() if k != "path"}
        from embedq.quantize.headaware import active_calibration, calibrated
        if active_calibration() is None:
            with calibrated(path, progress=progress):
                return quantize_checkpoint(path, **args)
    t0 = time.perf_counter()
    ckpt = Checkpoint.open(path)
    base_qc = _base_state(ckpt, force) if output is None else _derived_base_state(ckpt)
    scheme = Scheme.default(bits, symmetric, group_size, method, scale_dtype)
    head_scheme = None
    if head_bits is not None or head_group_size is not None or head_symmetric is not None:
        hb = head_bits if head_bits is not None else bits
        hg = head_group_size if head_group_size is not None else (group_size if hb == bits else None)
        head_scheme = Scheme.default(hb, symmetric if head_symmetric is None else head_symmetric,
                                     hg, method, scale_dtype)
    plans, aliases, tied = plan_modules(ckpt, scheme, lm_head=lm_head, head_scheme=head_scheme,
                                        targets=targets, trust=trust)
    for p in plans:  # gptq weights by what the head needs: gather-only tables get mse
        if p.scheme.method == "gptq" and p.role != "head" and not any(
                a.split(".")[-1] in ("lm_head", "embed_out", "output") for a in p.aliases):
            p.scheme = dataclasses.replace(p.scheme, method="mse")
    from embedq.evaluate import scheme_advice  # measured on Gemma 3 270M, see docs/quality.md
    advice = scheme_advice(scheme, {"tie_word_embeddings": tied}, head_scheme=head_scheme, lm_head=lm_head)
    if output is not None:
        from embedq.overlays.derived import write_derived
        report = write_derived(ckpt, plans, aliases, tied, base_qc, Path(output), force=force,
                               overlay_only=overlay_only, chunk_rows=chunk_rows, progress=progress,
                               base_model=base_model, base_revision=base_revision,
                               eval_results=eval_results)
        report.seconds = time.perf_counter() - t0
        report.warnings += [advice] if advice else []
        return report

    check_writable(ckpt.path)
    state.cleanup_partials(ckpt.path)
    metadata = {"format": "embedq", "format_version": "1"}
    writer, entries, reports = write_overlay(ckpt, plans, ckpt.path / OVERLAY_NAME, metadata,
                                             chunk_rows, progress)
    qconfig = build_config(entries, tied, aliases, base_qc)
    try:
        state.commit_in_place(ckpt, writer, qconfig)
    except BaseException:
        writer.abort()
        raise
    warnings = [advice] if advice else []
    if base_model or base_revision or eval_results is not None:
        warnings.append("--base-model/--base-revision/--eval only go into the model card, "
                        "which is written with --output; ignored")
    return Report(str(ckpt.path), "in-place", reports, tied, overlay=str(ckpt.path / OVERLAY_NAME),
                  seconds=time.perf_counter() - t0, warnings=warnings)


def _derived_base_state(ckpt: Checkpoint) -> dict | None:
    qc = ckpt.existing_quantization_config()
    if qc and qc.get("quant_method") == QUANT_METHOD:
        backup = state.read_backup(ckpt.path)
        if backup is None:
            raise OverlayError(f"{ckpt.path}: already an embedq-derived checkpoint; use its source")
        ckpt.config = json.loads(backup[CONFIG_NAME])
        qc = ckpt.existing_quantization_config()
    return qc


__all__ = ["quantize_checkpoint", "plan_modules", "write_overlay", "ModulePlan", "EmbedqError"]
