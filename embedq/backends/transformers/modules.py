"""The quantized modules transformers models get: :class:`PackedTable`, :class:`QuantizedEmbedding`,
:class:`QuantizedLMHead`, and the mapping of overlay modules onto a model's module tree."""

from __future__ import annotations

import os

import torch
from torch import nn

from embedq.errors import OverlayError
from embedq.format.codec import dequantize_rows as codec_dequantize_rows
from embedq.format.codec import zero_points_of
from embedq.format.config import ModuleEntry, OverlayConfig
from embedq.format.constants import HEAD_NAMES, SUPPORTED_BITS
from embedq.format.dtypes import ST_NAME_TO_DTYPE, dtype_from_name
from embedq.format.scheme import Scheme
from embedq.kernels import PreparedTable
from embedq.format.reader import load_overlay

# Dequantize about this many bytes of float32 table at a time in the head.


# ---------------------------------------------------------------------------------------
# modules


class PackedTable(nn.Module):
    """One quantized table, in the overlay's on-disk layout (buffers, non-persistent).

    ``weight_zero_point`` stays packed along rows (compressed-tensors layout) and is
    unpacked only for the rows being dequantized, so the module's memory equals the
    overlay's tensor bytes.
    """

    def __init__(self, rows: int, cols: int, bits: int, group_size: int | None, symmetric: bool,
                 scale_dtype: torch.dtype, device: torch.device | str | None = "meta"):
        super().__init__()
        if bits not in SUPPORTED_BITS:
            raise OverlayError(f"unsupported num_bits {bits}")
        self.rows, self.cols, self.bits = rows, cols, bits
        self.group_size = group_size
        self.symmetric = symmetric
        scheme = Scheme(bits=bits, symmetric=symmetric, group_size=group_size)
        self.groups = scheme.groups(cols)
        # the overlay's tensors, as buffers (format.scheme: the one tensor list)
        for name, (st, shape) in scheme.tensor_shapes((rows, cols), "").items():
            dt = scale_dtype if name == "weight_scale" else ST_NAME_TO_DTYPE[st]
            self.register_buffer(name, torch.empty(shape, dtype=dt, device=device), persistent=False)
        if symmetric:
            self.weight_zero_point = None
        self.prepared: PreparedTable | None = None

    @classmethod
    def from_entry(cls, entry: ModuleEntry, device="meta") -> "PackedTable":
        s = entry.scheme
        return cls(entry.rows, entry.cols, s.bits, s.group_size, s.symmetric,
                   dtype_from_name(entry.scale_dtype), device)

    def extra_repr(self) -> str:
        g = "row" if self.group_size is None else f"g{self.group_size}"
        return (f"rows={self.rows}, cols={self.cols}, bits={self.bits}, {g}, "
                f"{'sym' if self.symmetric else 'asym'}, scale={self.weight_scale.dtype}")

    # -- memory -----------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held: the overlay's tensor bytes, or once :meth:`prepare` ran, the serving
        layout's (the quantized size; 4-bit adds its kernel's zeros and row padding)."""
        held = sum(b.numel() * b.element_size() for b in self.buffers())
        return held + (self.prepared.nbytes if self.prepared is not None else 0)

    # -- serving layout ---------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, dtype: torch.dtype) -> None:
        """Convert the loaded table to the serving layout of :mod:`embedq.kernels`
        (chosen by its dispatch table) for activations of ``dtype``, on the
        buffers' device, chunk by chunk; the on-disk copies are then released, so the
        gather and the head of a tied model read one table."""
        if self.prepared is not None or self.weight_packed.device.type == "meta":
            return
        # EMBEDQ_FASTPATH=0: the kernel layer's chunked reference (for comparisons)
        prefer = "chunked" if os.environ.get("EMBEDQ_FASTPATH") == "0" else None
        self.prepared = PreparedTable.from_packed(
            self.weight_packed, self.weight_scale, self.cols, self.bits, self.group_size,
            zero_point_packed=self.weight_zero_point, device=self.weight_packed.device, dtype=dtype,
            prefer=prefer)
        dev = self.weight_packed.device
        self.weight_packed = torch.empty(0, dtype=torch.int32, device=dev)
        self.weight_scale = torch.empty(0, dtype=self.weight_scale.dtype, device=dev)
        if self.weight_zero_point is not None:
            self.weight_zero_point = torch.empty(0, dtype=torch.int32, device=dev)

    def _apply(self, fn, recurse=True):
        # ``model.to(device/dtype)`` moves the prepared tensors too (they are not buffers:
        # their layout is the kernel's, not the overlay's)
        super()._apply(fn, recurse)
        if self.prepared is not None:
            self.prepared.move_(fn)
        return self

    # -- forward helpers (fast path when prepared, else the reference decoder) ----------
    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows for token ids of any shape: ``[..., cols]`` in ``dtype``."""
        if self.prepared is not None:
            return self.prepared.embedding(ids, dtype)
        return self.dequantize_rows(ids.reshape(-1), dtype).view(*ids.shape, self.cols)

    def linear(self, hidden: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden @ dequant(W)^T (+ bias)`` in ``hidden``'s dtype, never a float copy of W
        (not prepared yet: the kernel layer's chunked reference over the buffers as they are)."""
        if self.prepared is not None:
            return self.prepared.linear(hidden, bias)
        return PreparedTable.from_packed(
            self.weight_packed, self.weight_scale, self.cols, self.bits, self.group_size,
            zero_point_packed=self.weight_zero_point, dtype=hidden.dtype, prefer="chunked").linear(hidden, bias)

    # -- loading ----------------------------------------------------------------------
    @torch.no_grad()
    def load_from(self, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
                  zero_point_packed: torch.Tensor | None) -> None:
        """Copy overlay tensors into the buffers (allocating them off the meta device)."""
        pairs = [("weight_packed", packed), ("weight_scale", scale), ("weight_shape", shape)]
        if not self.symmetric:
            if zero_point_packed is None:
                raise OverlayError("asymmetric table without weight_zero_point")
            pairs.append(("weight_zero_point", zero_point_packed))
        for name, src in pairs:
            buf = getattr(self, name)
            if tuple(buf.shape) != tuple(src.shape):
                raise OverlayError(f"{name}: overlay tensor has shape {list(src.shape)}, "
                                   f"expected {list(buf.shape)}")
            device = buf.device if buf.device.type != "meta" else torch.device("cpu")
            if buf.device.type == "meta" or buf.dtype != src.dtype:
                setattr(self, name, src.to(device=device, dtype=buf.dtype).contiguous())
            else:
                buf.copy_(src)

    # -- dequantization (through the one codec) ---------------------------------------
    def _dequant(self, packed: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
        zp = None if self.symmetric else zero_points_of(self.weight_zero_point, self.bits, ids)
        return codec_dequantize_rows(packed, scale, zp, self.bits, self.cols, dtype)

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows ``ids`` (1-D long) as ``[n, cols]`` in ``dtype``.

        Same arithmetic as the quantizer's contract: ``(u - zp) * scale`` in float32,
        with ``zp = 2^(bits-1)`` when symmetric, then cast to ``dtype``.
        """
        if self.prepared is not None:
            return self.prepared.dequantize_rows(ids, dtype)
        return self._dequant(self.weight_packed[ids], self.weight_scale[ids], ids, dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32, start: int = 0, end: int | None = None
                   ) -> torch.Tensor:
        """Rows ``start:end`` of the table (the whole table by default) in ``dtype``."""
        end = self.rows if end is None else end
        if self.prepared is not None:
            return self.prepared.dequantize_range(start, end, dtype)
        ids = None if self.symmetric else torch.arange(start, end, device=self.weight_packed.device)
        return self._dequant(self.weight_packed[start:end], self.weight_scale[start:end], ids, dtype)


def _scale_spec(original: nn.Module | None) -> tuple[str, float] | None:
    """How an original (scaled) embedding multiplies its output, to reproduce it exactly.

    Gemma-style modules keep a float32 buffer and multiply by ``embed_scale.to(dtype)``
    (``scalar_embed_scale`` holds the value); BART-style ones multiply by a Python float.
    """
    if original is None:
        return None
    v = getattr(original, "scalar_embed_scale", None)
    if isinstance(v, (int, float)):
        return ("tensor", float(v))
    v = getattr(original, "embed_scale", None)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return ("float", float(v))
    return None


class QuantizedEmbedding(nn.Module):
    """Token embedding reading a :class:`PackedTable`: gathers and dequantizes looked-up rows only.

    The output dtype follows the model's dtype (a zero-size float buffer tracks
    ``model.to(dtype)``). A Gemma-style ``embed_scale`` of the replaced module is kept and
    applied exactly as the original does.
    """

    def __init__(self, table: PackedTable, dtype: torch.dtype = torch.bfloat16,
                 embed_scale: tuple[str, float] | None = None, padding_idx: int | None = None,
                 device="meta"):
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.rows, table.cols
        self.padding_idx = padding_idx
        self.embed_scale_spec = embed_scale
        if embed_scale is not None:
            self.scalar_embed_scale = embed_scale[1]
        self._scale_cache: dict = {}
        self.register_buffer("_dtype_probe", torch.empty(0, dtype=dtype, device=device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype_probe.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        dtype = self.dtype
        out = self.table.embedding(input_ids, dtype)
        spec = self.embed_scale_spec
        if spec is not None:
            kind, value = spec
            if kind == "tensor":
                out = out * self._scale_tensor(value, dtype, out.device)
            else:
                out = out * value
        return out

    def _scale_tensor(self, value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``embed_scale.to(dtype)`` as the original computes it (a float32 value rounded to
        ``dtype``), made once per dtype and device: two torch ops fewer per decode step."""
        key = (dtype, device)
        t = self._scale_cache.get(key)
        if t is None:
            t = self._scale_cache[key] = torch.tensor(value, dtype=torch.float32, device=device).to(dtype)
        return t

    def extra_repr(self) -> str:
        es = "" if self.embed_scale_spec is None else f", embed_scale={self.embed_scale_spec[1]:g}"
        return f"{self.num_embeddings}, {self.embedding_dim}{es}"


class QuantizedLMHead(nn.Module):
    """Output projection reading a :class:`PackedTable` (possibly the embedding's).

    Logits come from the table's prepared kernel (:mod:`embedq.kernels`; its chunked
    reference bounds the memory of a call where no kernel serves).
    """

    def __init__(self, table: PackedTable, bias: nn.Parameter | None = None):
        super().__init__()
        self.table = table
        self.in_features, self.out_features = table.cols, table.rows
        self.bias = bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.table.linear(hidden, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> :class:`QuantizedEmbedding` / :class:`QuantizedLMHead` in ``model``."""
    return {n: m for n, m in model.named_modules(remove_duplicate=False)
            if isinstance(m, (QuantizedEmbedding, QuantizedLMHead))}


def quantized_nbytes(model: nn.Module) -> int:
    """Bytes held by the model's quantized tables (each shared table counted once)."""
    seen, total = set(), 0
    for m in quantized_modules(model).values():
        if id(m.table) not in seen:
            seen.add(id(m.table))
            total += m.table.nbytes()
    return total


# ---------------------------------------------------------------------------------------
# mapping overlay module names (checkpoint layout) to the model's module tree


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _io_module(model, which: str) -> tuple[str, nn.Module] | None:
    fn = getattr(model, "get_input_embeddings" if which == "in" else "get_output_embeddings", None)
    if fn is None:
        return None
    try:
        mod = fn()
    except (NotImplementedError, AttributeError):
        return None
    if mod is None:
        return None
    for n, m in model.named_modules():
        if m is mod:
            return n, m
    return None


def _by_suffix(model: nn.Module, name: str) -> tuple[str, nn.Module] | None:
    parts = name.split(".")
    names = [n for n, _ in model.named_modules()]
    for k in range(len(parts), 0, -1):
        suffix = ".".join(parts[-k:])
        hits = [n for n in names if n == suffix or n.endswith("." + suffix)]
        if len(hits) == 1:
            return hits[0], model.get_submodule(hits[0])
        if len(hits) > 1:
            break
    return None


def resolve_targets(model: nn.Module, qconfig: OverlayConfig) -> dict[str, tuple[str, str]]:
    """Map every overlay module and alias to a module of ``model``.

    Returns ``{model_module_name: (owner_table, kind)}`` where ``kind`` is ``embedding``
    (input, MTP/draft and per-layer embeddings: gathers) or ``head``. Names are matched
    exactly first, for every module before any fallback: the checkpoint may use another
    layout than the module tree (``language_model.model.embed_tokens`` vs
    ``model.language_model.embed_tokens``), so the model's input / output embeddings and
    then unique name suffixes are used as fallbacks, never onto a module another table
    already holds (Gemma 3n's ``embed_tokens`` and ``embed_tokens_per_layer``). MTP / draft
    modules the model does not have are skipped.
    """
    wanted: list[tuple[str, str, str]] = []  # (overlay name, owner, role)
    for name, e in qconfig.modules.items():
        wanted.append((name, name, e.role))
    for alias, owner in qconfig.aliases.items():
        role = "head" if alias.split(".")[-1] in HEAD_NAMES else "mtp"
        wanted.append((alias, owner, role))
    exact = {name: _get(model, name) for name, _, _ in wanted}
    # exact names first, then the tables a model must have before MTP/draft ones it may lack
    wanted.sort(key=lambda w: (exact[w[0]] is None, w[2] == "mtp"))
    io_in, io_out = _io_module(model, "in"), _io_module(model, "out")
    out: dict[str, tuple[str, str]] = {}
    for name, owner, role in wanted:
        hit = (name, exact[name]) if exact[name] is not None else None
        if hit is None and role == "embedding":
            hit = io_in
        if hit is None and role == "head":
            hit = io_out
        if hit is None:
            hit = _by_suffix(model, name)
        if hit is not None and hit[0] in out and out[hit[0]][0] != owner:
            if role == "mtp":  # a suffix fallback onto the main embedding: the MTP layer is not built
                continue
            raise OverlayError(f"quantization_config.json: module {name} maps to {hit[0]}, which "
                               f"{out[hit[0]][0]} already replaces")
        if hit is None:
            if role == "mtp":
                continue  # the model class has no such module (e.g. MTP layers not built)
            raise OverlayError(f"quantization_config.json: module {name} not found in "
                               f"{type(model).__name__}")
        mname, mod = hit
        kind = "head" if role == "head" else "embedding"
        if kind == "embedding" and not isinstance(mod, nn.Embedding):
            raise OverlayError(f"quantization_config.json: {name} maps to {mname}, a "
                               f"{type(mod).__name__}, not an embedding")
        if kind == "head" and not isinstance(mod, nn.Linear):
            raise OverlayError(f"quantization_config.json: {name} maps to {mname}, a "
                               f"{type(mod).__name__}, not a linear head")
        out[mname] = (owner, kind)
    return out


def replace_modules(model: nn.Module, qconfig: OverlayConfig, dtype: torch.dtype, device="meta"
                    ) -> dict[str, PackedTable]:
    """Swap the targets for quantized modules (empty tables); return owner -> table."""
    targets = resolve_targets(model, qconfig)
    tables: dict[str, PackedTable] = {}
    for owner in sorted({o for o, _ in targets.values()}):
        tables[owner] = PackedTable.from_entry(qconfig.modules[owner], device)
    for mname, (owner, kind) in targets.items():
        old = model.get_submodule(mname)
        t = tables[owner]
        rows, cols = (old.num_embeddings, old.embedding_dim) if kind == "embedding" else \
            (old.out_features, old.in_features)
        if (rows, cols) != (t.rows, t.cols):
            raise OverlayError(f"quantization_config.json: {owner} has shape {[t.rows, t.cols]} but "
                               f"the model's {mname} is {[rows, cols]}")
        if kind == "embedding":
            new = QuantizedEmbedding(t, dtype, _scale_spec(old), getattr(old, "padding_idx", None), device)
        else:
            bias = old.bias if getattr(old, "bias", None) is not None else None
            new = QuantizedLMHead(t, bias)
        parent_name, _, child = mname.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    return tables


def fill_tables(tables: dict[str, PackedTable], overlay_dir: str | os.PathLike) -> None:
    """Read the overlay (through the one reader) and copy its tensors into ``tables``."""
    ov = load_overlay(overlay_dir, modules=list(tables))
    for owner, table in tables.items():
        qt = ov.tables[owner]
        if tuple(qt.shape) != (table.rows, table.cols):
            raise OverlayError(f"{ov.file}: {owner} has shape {list(qt.shape)}, "
                               f"config says {[table.rows, table.cols]}")
        try:
            table.load_from(qt.packed, qt.scale, torch.tensor(qt.shape, dtype=torch.int64),
                            qt.packed_zero_point())
        except OverlayError as e:
            raise OverlayError(f"{ov.file}: {owner}: {e}") from None


__all__ = ["PackedTable", "QuantizedEmbedding", "QuantizedLMHead",
           "quantized_modules", "quantized_nbytes", "resolve_targets",
           "replace_modules", "fill_tables"]
