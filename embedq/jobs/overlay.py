"""Planning and streaming the overlay of a checkpoint (shared by in-place and derived jobs).

:func:`plan_modules` decides what to quantize (targets, ties, aliases, schemes);
:func:`write_overlay` streams every planned table into a new ``embedq.safetensors``,
finished and fsynced but not yet committed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from embedq.errors import CheckpointError, EmbedqError, SchemeError
from embedq.format.checkpoint import CONFIG_NAME, Checkpoint
from embedq.format.codec import pack_zero_points, packed_zero_point_rows
from embedq.format.config import module_entry
from embedq.format.constants import OVERLAY_SUFFIXES, is_head_name
from embedq.format.digest import DIGEST, new_hasher
from embedq.format.dtypes import (DTYPE_NAMES, DTYPE_TO_ST_NAME, ST_NAME_TO_DTYPE, ST_TO_TORCH,
                                  dtype_from_name)
from embedq.format.scheme import Scheme
from embedq.format.writer import StreamingSafetensorsWriter
from embedq.jobs import testpoint
from embedq.jobs.report import ModuleReport
from embedq.jobs.targets import find_targets, resolve_ties
from embedq.quant.fused import has_cached_kernel, native_ready
from embedq.quant.profile import stage
from embedq.quant.stream import (ROW_ALIGN, ErrorStats, MappedRows, Pipeline, check_finite,
                                 default_chunk_rows, quantize_pack_chunk, stats_finite)


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
    def head_reads(self) -> bool:
        """A head reads this table: the head's own, or one a tied head aliases (what gptq needs)."""
        return self.role == "head" or any(is_head_name(a) for a in self.aliases)

    @property
    def scale_dtype(self) -> torch.dtype:
        return dtype_from_name(self.scheme.scale_dtype) if self.scheme.scale_dtype else self.dtype

    def overlay_tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The module's overlay tensors (the one list, :meth:`Scheme.overlay_tensors`), as
        torch dtypes."""
        t = self.scheme.overlay_tensors(self.module, self.shape, DTYPE_TO_ST_NAME[self.scale_dtype])
        return {k: (ST_NAME_TO_DTYPE[st], shape) for k, (st, shape) in t.items()}


def _strip_weight(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def plan_modules(ckpt: Checkpoint, scheme: Scheme, *, lm_head: bool = False,
                 head_scheme: Scheme | None = None, targets: list[str] | None = None,
                 trust: str | None = None, fit_default: bool = False, per_layer: bool = False
                 ) -> tuple[list[ModulePlan], dict[str, str], bool]:
    """Decide what to quantize: module plans, aliases, and whether the model is tied.

    ``per_layer``: also the per-layer input embeddings (Gemma 3n), with the table's scheme.

    ``fit_default``: the schemes are defaults, fitted to each table's width (:meth:`Scheme.fit`).
    """
    t, tied_cfg = find_targets(ckpt, targets)
    identical = ckpt.tensors_identical(t.embedding, t.head) if t.head else None
    where = str(ckpt.path / CONFIG_NAME)
    tied = resolve_ties(t, tied_cfg, identical, trust, where)
    emb_mod = _strip_weight(t.embedding)
    plans = [ModulePlan(emb_mod, t.embedding, scheme, "embedding")]
    aliases: dict[str, str] = {}
    if tied and t.head_module is not None:
        if head_scheme is not None and head_scheme != scheme:
            # An explicit, recorded untie in quantized form: the head gets its own
            # (higher-precision) table computed from the shared float table.
            plans.append(ModulePlan(t.head_module, t.embedding, head_scheme, "head"))
        else:
            aliases[t.head_module] = emb_mod
    elif lm_head or head_scheme is not None:
        if t.head is None:  # not tied, no head tensor: the model has no output embedding
            raise EmbedqError(f"{where}: this model has no lm_head (output embedding) to quantize; "
                              "drop --lm-head/--head-bits/--head-group-size (head_symmetric)")
        if not lm_head:  # the head options would be ignored: the head stays float
            raise EmbedqError(f"{where}: the model is untied, its head {t.head} is quantized only with "
                              "--lm-head; add --lm-head, or drop --head-bits/--head-group-size (head_symmetric)")
        plans.append(ModulePlan(_strip_weight(t.head), t.head, head_scheme or scheme, "head"))
    for extra in t.extra_embeddings:
        if ckpt.tensors_identical(t.embedding, extra):
            aliases[_strip_weight(extra)] = emb_mod
        else:
            plans.append(ModulePlan(_strip_weight(extra), extra, scheme, "mtp"))
    if per_layer and not t.per_layer:
        raise EmbedqError(f"{where}: --per-layer-embeddings: this model has no per-layer input embedding "
                          "(embed_tokens_per_layer, as Gemma 3n has); drop the flag")
    for table in t.per_layer if per_layer else ():
        plans.append(ModulePlan(_strip_weight(table), table, scheme, "per_layer"))
    for p in plans:
        info = ckpt.tensor(p.tensor)
        if info.dtype not in ST_TO_TORCH:
            raise SchemeError(f"{ckpt.path / info.file}: {p.tensor} has dtype {info.dtype}; "
                              "embedq quantizes BF16, F16 or F32 tables")
        if fit_default and len(info.shape) == 2:
            p.scheme = p.scheme.fit(info.shape[1])
        p.scheme.check_shape(info.shape, f"{ckpt.path / info.file}: {p.tensor}")
        p.shape, p.dtype, p.file = tuple(info.shape), ST_TO_TORCH[info.dtype], info.file
        p.aliases = sorted(a for a, o in aliases.items() if o == p.module)
    return plans, aliases, tied


def write_overlay(ckpt: Checkpoint, plans: list[ModulePlan], dest: Path, metadata: dict,
                  chunk_rows: int | None = None, progress: bool = True, calibration=None
                  ) -> tuple[StreamingSafetensorsWriter, dict[str, dict], list[ModuleReport]]:
    """Stream every planned module into ``dest`` (finished, fsynced, not yet renamed)."""
    min_bytes = compile_min_bytes()  # a bad value refused before anything is written
    declared: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for p in plans:
        declared.update(p.overlay_tensors())
    writer = StreamingSafetensorsWriter(dest, declared, metadata)
    with stage("overlay: create + fallocate"):
        writer.open()
    entries: dict[str, dict] = {}
    reports: list[ModuleReport] = []
    total = sum(p.shape[0] * p.shape[1] * p.dtype.itemsize for p in plans)
    # The native kernel (built in under a second) is always worth it. Otherwise build an
    # inductor kernel only when the job is big enough to repay it; one already built
    # (cached on disk) is always used.
    with stage("kernel: load (build once)"):
        fast = all(native_ready(p.dtype) for p in plans if p.scheme.method == "rtn")
    compiled = None if fast or total >= min_bytes else False
    try:
        for p in plans:
            rows, cols = p.shape
            itemsize = p.dtype.itemsize
            cr = chunk_rows or default_chunk_rows(cols, itemsize)
            out_hash = {n: new_hasher(DIGEST) for n in p.overlay_tensors()}
            stats = ErrorStats()
            bar = tqdm(total=rows, desc=f"{p.module} {p.scheme.label()}", unit="row",
                       disable=not progress, leave=False)
            try:
                src_digest = stream_module(ckpt, p, writer, out_hash, stats, cr, bar, compiled, calibration)
            finally:
                bar.close()
            shape_t = torch.tensor([rows, cols], dtype=torch.int64)
            writer.write(f"{p.module}.weight_shape", shape_t)
            out_hash[f"{p.module}.weight_shape"].update(shape_t.numpy().tobytes())
            source = {"tensor": p.tensor, "dtype": DTYPE_NAMES[p.dtype], DIGEST: src_digest}
            entry = module_entry(p.scheme, p.shape, DTYPE_NAMES[p.scale_dtype], source,
                                 {n: h.hexdigest() for n, h in out_hash.items()})
            entry["role"] = p.role
            entries[p.module] = entry
            before = rows * cols * itemsize
            after = p.scheme.overlay_bytes(p.shape, p.scale_dtype.itemsize)
            reports.append(ModuleReport(p.module, p.tensor, [rows, cols], p.scheme.label(),
                                        DTYPE_NAMES[p.dtype], before, after, stats.max_abs,
                                        stats.rms, stats.rel_rms, p.role, p.aliases))
        with stage("overlay: fsync"):
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
    if not v:
        return COMPILE_MIN_BYTES
    try:
        n = int(v)
    except ValueError:
        n = -1
    if n < 0:
        raise EmbedqError(f"EMBEDQ_COMPILE_MIN_BYTES={v!r}: expected a number of bytes (0 or more, "
                          "e.g. 1073741824); unset it for the default (1 GiB)")
    return n


def check_scales(scale: torch.Tensor, row0: int, where: str, p: ModulePlan) -> None:
    """Raise SchemeError naming the first row whose stored scale is not finite.

    A pass over the scales only (1/group_size of the table), so it runs on every chunk."""
    if bool(torch.isfinite(scale).all()):
        return
    bad = ~torch.isfinite(scale.reshape(scale.shape[0], -1))
    row = row0 + int(bad.any(dim=-1).nonzero()[0, 0])
    dt = DTYPE_NAMES[p.scale_dtype]
    if p.scale_dtype.itemsize < 4:
        fix = "use --scale-dtype float32"
    elif not p.scheme.symmetric:
        fix = "quantize it symmetric (drop --asym) or fix the table's values"
    else:
        fix = "fix or re-export the table's values"
    raise SchemeError(f"{where}: row {row}: its {dt} quantization scale overflows (the row's "
                      f"values are too large for the {dt} scale); {fix}")


def stream_module(ckpt: Checkpoint, p: ModulePlan, writer: StreamingSafetensorsWriter,
                  out_hash: dict, stats: ErrorStats, chunk_rows: int, bar=None,
                  compiled: bool | None = None, calibration=None) -> str:
    """Quantize one planned table into ``writer``, chunk by chunk, in bounded memory.

    Three stages overlap (see :class:`embedq.quant.stream.Pipeline`): the source
    rows are mapped from the shard and hashed, quantized and packed by the fused
    kernel (``compiled``: None = when available, False = the eager reference), then
    written and hashed. Returns the source's digest (:data:`embedq.format.digest.DIGEST`).

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
    packed_name, scale_name, _, zp_name = (f"{p.module}.{s}" for s in OVERLAY_SUFFIXES)
    bits = p.scheme.bits
    if chunk_rows % (32 // bits):
        raise SchemeError(f"--chunk-rows {chunk_rows}: must be a multiple of {32 // bits} for {bits}-bit tables "
                          f"(any multiple of {ROW_ALIGN} fits every scheme)")

    where = f"{path}: {p.tensor}"
    # RTN (any kernel) tolerates NaN/inf input and reports it in its statistics, so the
    # refusal costs nothing unless a chunk is suspect; mse/gptq get the full pre-check.
    rtn = p.scheme.method == "rtn"

    def compute(r0: int, x: torch.Tensor):
        with stage("kernel: quantize + pack + stats"):
            packed, scale, zp, st = quantize_pack_chunk(x, p.scheme, p.scale_dtype, pad_rows=chunk_rows,
                                                        compiled=compiled, calibration=calibration)
        if rtn and not stats_finite(st):
            with stage("finite check (suspect chunk only)"):
                check_finite(x, r0, where)
        # A finite source can still overflow the stored scale (a narrower --scale-dtype, or
        # an asymmetric range max-min past float32): such an overlay dequantizes to inf/NaN
        # and verify refuses it, so refuse it here, before anything is committed.
        check_scales(scale, r0, where, p)
        stats.add(*st, x.numel())
        testpoint.reached("stream")
        if bar is not None:
            bar.update(x.shape[0])
        if zp is None:
            return packed, scale
        with stage("kernel: pack zero points"):
            return packed, scale, pack_zero_points(zp, bits)

    def write(r0: int, out) -> None:
        names = (packed_name, scale_name, zp_name)
        rows_at = (r0, r0, packed_zero_point_rows(r0, bits))  # r0: whole zero-point words
        for name, t, row in zip(names, out, rows_at):
            with stage("write: pwrite"):
                writer.write(name, t, row=row)
            with stage("write: hash outputs"):
                out_hash[name].update(t.contiguous().view(torch.uint8).numpy())

    try:
        source = MappedRows(path, info.file_offset, (rows, cols), p.dtype, name=p.tensor)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {p.tensor}: {e.strerror or e}") from None
    with source:
        return Pipeline(source, chunk_rows, compute, write, writer_fd=getattr(writer, "_fd", None),
                        precheck=not rtn, digest=new_hasher(DIGEST)).run()


__all__ = ["ModulePlan", "plan_modules", "write_overlay", "stream_module", "check_scales", "compile_min_bytes"]
