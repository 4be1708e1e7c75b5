"""transformers back end: load an embedq overlay into a ``PreTrainedModel``.

After ``import embedq`` the ``embedq`` quant method is registered with transformers'
quantizer registry, so ``AutoModelForCausalLM.from_pretrained(path)`` loads an
in-place overlay or a derived checkpoint (``embedq quantize --output``) with
:class:`QuantizedEmbedding` / :class:`QuantizedLMHead` modules in place of the float
tables. :func:`load` does the same with the right auto class picked for you.

Memory: the modules keep exactly the overlay's tensors (``weight_packed`` int32,
``weight_scale``, ``weight_shape``, and the compressed-tensors packed
``weight_zero_point`` when asymmetric) as buffers — nothing else. A lookup gathers
and dequantizes only the requested rows; the head dequantizes the table in chunks
of rows while computing the logits, so no float copy of the table is ever held.
A tied model's embedding and head share one :class:`PackedTable`.

How the loading works (transformers 5.x): the quantizer replaces the target modules
on the meta-device skeleton with quantized ones whose buffers are non-persistent, so
transformers neither expects nor loads them (the float table, absent from a derived
checkpoint, is not expected either). After the weights are loaded the quantizer
reads the overlay file itself (:func:`embedq.load_overlay`) and copies its tensors
into the buffers, which transformers has already placed on the right device.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
from pathlib import Path

import torch
from torch import nn

from embedq.errors import OverlayError

QUANT_METHOD = "embedq"
# Dequantize about this many bytes of float32 table at a time in the head.
HEAD_CHUNK_BYTES = 32 << 20
_OVERLAY_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


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
        if bits not in (4, 8):
            raise OverlayError(f"unsupported num_bits {bits}")
        self.rows, self.cols, self.bits = rows, cols, bits
        self.group_size = group_size
        self.symmetric = symmetric
        groups = 1 if group_size is None else cols // group_size
        self.groups = groups
        kw = dict(device=device)
        self.register_buffer("weight_packed", torch.empty(rows, cols * bits // 32, dtype=torch.int32, **kw),
                             persistent=False)
        self.register_buffer("weight_scale", torch.empty(rows, groups, dtype=scale_dtype, **kw),
                             persistent=False)
        self.register_buffer("weight_shape", torch.empty(2, dtype=torch.int64, **kw), persistent=False)
        if not symmetric:
            zp_rows = -(-rows * bits // 32)
            self.register_buffer("weight_zero_point", torch.empty(zp_rows, groups, dtype=torch.int32, **kw),
                                 persistent=False)
        else:
            self.weight_zero_point = None

    @classmethod
    def from_entry(cls, entry: dict, device="meta") -> "PackedTable":
        from embedq.overlays.config import scheme_of
        from embedq.quantize.scheme import dtype_from_name
        s = scheme_of(entry)
        rows, cols = (int(x) for x in entry["shape"])
        scale_dtype = dtype_from_name(entry.get("scale_dtype") or "bfloat16")
        return cls(rows, cols, s.bits, s.group_size, s.symmetric, scale_dtype, device)

    def extra_repr(self) -> str:
        g = "row" if self.group_size is None else f"g{self.group_size}"
        return (f"rows={self.rows}, cols={self.cols}, bits={self.bits}, {g}, "
                f"{'sym' if self.symmetric else 'asym'}, scale={self.weight_scale.dtype}")

    # -- memory -----------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held by the buffers (equals the overlay's tensor bytes for this table)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

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

    # -- dequantization ---------------------------------------------------------------
    def _signed_codes(self, packed: torch.Tensor) -> torch.Tensor:
        """Codes ``u - 2^(bits-1)`` (int8 [n, cols]) of packed rows."""
        b = packed.contiguous().view(torch.uint8)
        if self.bits == 8:
            return (b ^ 0x80).view(torch.int8)  # u - 128, wrapped into int8
        out = torch.empty(b.shape[0], b.shape[1] * 2, dtype=torch.uint8, device=b.device)
        out[:, 0::2] = b & 0x0F
        out[:, 1::2] = b >> 4
        return out.view(torch.int8) - 8

    def _zero_points(self, ids: torch.Tensor) -> torch.Tensor:
        """Signed zero points ``zp_u - 2^(bits-1)`` (int32 [n, groups]) of rows ``ids``."""
        per_word = 32 // self.bits
        words = self.weight_zero_point[ids // per_word]  # [n, groups] int32
        shift = ((ids % per_word) * self.bits).unsqueeze(-1).to(torch.int32)
        return ((words >> shift) & ((1 << self.bits) - 1)) - (1 << (self.bits - 1))

    def _dequant(self, packed: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
        n = packed.shape[0]
        g = self.cols if self.group_size is None else self.group_size
        if self.symmetric and dtype in (torch.bfloat16, torch.float16) and scale.dtype == dtype:
            # Half the memory traffic, same bits: a code (|q| <= 128) is exact in 16-bit
            # floats, and the CPU/GPU kernels multiply half types in float32 and round once,
            # exactly like the float32 product cast to ``dtype`` below.
            x = self._signed_codes(packed).to(dtype).view(n, self.cols // g, g)
            return x.mul_(scale.unsqueeze(-1)).view(n, self.cols)
        x = self._signed_codes(packed).to(torch.float32).view(n, self.cols // g, g)
        if not self.symmetric:
            x.sub_(self._zero_points(ids).to(torch.float32).unsqueeze(-1))
        x.mul_(scale.to(torch.float32).unsqueeze(-1))
        return x.view(n, self.cols).to(dtype)

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows ``ids`` (1-D long) as ``[n, cols]`` in ``dtype``.

        Same arithmetic as the quantizer's contract: ``(u - zp) * scale`` in float32,
        with ``zp = 2^(bits-1)`` when symmetric, then cast to ``dtype``.
        """
        return self._dequant(self.weight_packed[ids], self.weight_scale[ids], ids, dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32, start: int = 0, end: int | None = None
                   ) -> torch.Tensor:
        """Rows ``start:end`` of the table (the whole table by default) in ``dtype``."""
        end = self.rows if end is None else end
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
        self.register_buffer("_dtype_probe", torch.empty(0, dtype=dtype, device=device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype_probe.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        dtype = self.dtype
        flat = input_ids.reshape(-1)
        out = self.table.dequantize_rows(flat, dtype).view(*input_ids.shape, self.embedding_dim)
        spec = self.embed_scale_spec
        if spec is not None:
            kind, value = spec
            if kind == "tensor":
                out = out * torch.tensor(value, dtype=torch.float32, device=out.device).to(dtype)
            else:
                out = out * value
        return out

    def extra_repr(self) -> str:
        es = "" if self.embed_scale_spec is None else f", embed_scale={self.embed_scale_spec[1]:g}"
        return f"{self.num_embeddings}, {self.embedding_dim}{es}"


class QuantizedLMHead(nn.Module):
    """Output projection reading a :class:`PackedTable` (possibly the embedding's).

    Logits are computed ``chunk_rows`` vocabulary rows at a time: each chunk is
    dequantized to the activation dtype, multiplied, and dropped.
    """

    def __init__(self, table: PackedTable, bias: nn.Parameter | None = None,
                 chunk_rows: int | None = None):
        super().__init__()
        self.table = table
        self.in_features, self.out_features = table.cols, table.rows
        self.bias = bias
        self.chunk_rows = chunk_rows or max(256, HEAD_CHUNK_BYTES // (4 * table.cols))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        rows = self.table.rows
        out = torch.empty(*hidden.shape[:-1], rows, dtype=dtype, device=hidden.device)
        step = self.chunk_rows
        for a in range(0, rows, step):
            b = min(rows, a + step)
            w = self.table.dequantize(dtype, a, b)
            bias = None if self.bias is None else self.bias[a:b].to(dtype)
            out[..., a:b] = nn.functional.linear(hidden, w, bias)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, chunk_rows={self.chunk_rows}"


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


HEAD_NAMES = ("lm_head", "embed_out", "output")


def resolve_targets(model: nn.Module, qconfig: dict) -> dict[str, tuple[str, str]]:
    """Map every overlay module and alias to a module of ``model``.

    Returns ``{model_module_name: (owner_table, role)}`` where ``role`` is
    ``embedding`` or ``head``. Names are matched exactly first; the checkpoint may use
    another layout than the module tree (``language_model.model.embed_tokens`` vs
    ``model.language_model.embed_tokens``), so the model's input / output embeddings
    and then unique name suffixes are used as fallbacks. MTP / draft modules the
    model does not have are skipped.
    """
    modules = qconfig["modules"]
    aliases = qconfig.get("aliases") or {}
    wanted: list[tuple[str, str, str]] = []  # (overlay name, owner, role)
    for name, e in modules.items():
        role = e.get("role") or ("head" if name.split(".")[-1] in HEAD_NAMES else "embedding")
        wanted.append((name, name, "head" if role == "head" else ("mtp" if role == "mtp" else "embedding")))
    for alias, owner in aliases.items():
        role = "head" if alias.split(".")[-1] in HEAD_NAMES else "mtp"
        wanted.append((alias, owner, role))
    io_in, io_out = _io_module(model, "in"), _io_module(model, "out")
    out: dict[str, tuple[str, str]] = {}
    for name, owner, role in wanted:
        hit = (name, _get(model, name)) if _get(model, name) is not None else None
        if hit is None and role == "embedding":
            hit = io_in
        if hit is None and role == "head":
            hit = io_out
        if hit is None:
            hit = _by_suffix(model, name)
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


def replace_modules(model: nn.Module, qconfig: dict, dtype: torch.dtype, device="meta"
                    ) -> dict[str, PackedTable]:
    """Swap the targets for quantized modules (empty tables); return owner -> table."""
    targets = resolve_targets(model, qconfig)
    tables: dict[str, PackedTable] = {}
    for owner in sorted({o for o, _ in targets.values()}):
        tables[owner] = PackedTable.from_entry(qconfig["modules"][owner], device)
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
    """Read the overlay file and copy its tensors into ``tables``."""
    from safetensors import safe_open

    from embedq.overlays.reader import read_overlay_config
    p = Path(overlay_dir)
    cfg = read_overlay_config(p)
    file = p / cfg.get("overlay", "embedq.safetensors")
    if not file.exists():
        raise OverlayError(f"{file}: overlay file missing")
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != "embedq":
            raise OverlayError(f"{file}: not an embedq overlay (metadata format={meta.get('format')!r})")
        keys = set(f.keys())
        for owner, table in tables.items():
            def get(suffix, required=True):
                k = f"{owner}.{suffix}"
                if k not in keys:
                    if required:
                        raise OverlayError(f"{file}: missing tensor {k}")
                    return None
                return f.get_tensor(k)
            shape = get("weight_shape")
            if [int(x) for x in shape.tolist()] != [table.rows, table.cols]:
                raise OverlayError(f"{file}: {owner}.weight_shape is {shape.tolist()}, "
                                   f"config says {[table.rows, table.cols]}")
            try:
                table.load_from(get("weight_packed"), get("weight_scale"), shape,
                                get("weight_zero_point", required=not table.symmetric))
            except OverlayError as e:
                raise OverlayError(f"{file}: {owner}: {e}") from None


# ---------------------------------------------------------------------------------------
# transformers registration

_REGISTERED = False
_LOCK = threading.RLock()  # importing transformers below re-enters via the import hook


def _overlay_dir_from(checkpoint_files, config) -> Path:
    for f in checkpoint_files or []:
        d = Path(f).parent
        if (d / "quantization_config.json").exists() or (d / "config.json").exists():
            return d
    name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None)
    if name and Path(name).is_dir():
        return Path(name)
    raise OverlayError("embedq: cannot locate the checkpoint folder holding the overlay "
                       "(only local folders are supported)")


def register() -> None:
    """Register the ``embedq`` quant method with transformers (idempotent)."""
    global _REGISTERED
    with _LOCK:
        if _REGISTERED:
            return
        from transformers.quantizers import auto as qauto
        from transformers.quantizers.base import HfQuantizer
        from transformers.utils.quantization_config import QuantizationConfigMixin
        if _REGISTERED:  # the import above ran the import hook, which registered
            return

        class EmbedqConfig(QuantizationConfigMixin):
            """transformers' view of an embedq ``quantization_config`` (kept verbatim)."""

            def __init__(self, **kwargs):
                kwargs.setdefault("quant_method", QUANT_METHOD)
                for k, v in kwargs.items():
                    setattr(self, k, v)
                self.quant_method = QUANT_METHOD

            def to_dict(self) -> dict:
                import copy
                return {k: copy.deepcopy(v) for k, v in self.__dict__.items() if not k.startswith("_")}

        class EmbedqHfQuantizer(HfQuantizer):
            """Loads embedq overlays: quantized embedding / head modules, everything else float."""

            requires_calibration = True

            def validate_environment(self, *args, **kwargs):
                base = getattr(self.quantization_config, "base_quantization_config", None)
                if base:
                    raise OverlayError(
                        "embedq: this checkpoint also has a base quantization "
                        f"({base.get('quant_method')!r}); the transformers back end only loads "
                        "embedq overlays on float checkpoints (use vLLM)")
                dm = kwargs.get("device_map")
                if isinstance(dm, dict) and "disk" in dm.values():
                    raise OverlayError("embedq: disk offload is not supported")

            def preprocess_model(self, model, dtype=None, **kwargs):
                self._dtype = dtype  # the base class does not pass it on
                return super().preprocess_model(model, dtype=dtype, **kwargs)

            def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
                qc = self.quantization_config.to_dict()
                from embedq.overlays.config import validate_config
                validate_config(qc, "config.json quantization_config")
                self.overlay_dir = _overlay_dir_from(checkpoint_files, model.config)
                dtype = getattr(self, "_dtype", None)
                if not isinstance(dtype, torch.dtype):
                    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                                 torch.get_default_dtype())
                targets = resolve_targets(model, qc)
                self.tables = replace_modules(model, qc, dtype)
                # The replaced modules have no float weight: drop them from the tie
                # mapping of every (sub)model, and ignore their float / overlay tensors
                # when the shards list them (in-place sharded overlays, derived indexes).
                gone = tuple(targets)
                from transformers import PreTrainedModel
                for _, sub in model.named_modules():
                    if isinstance(sub, PreTrainedModel):
                        tk = getattr(sub, "all_tied_weights_keys", None) or {}
                        prefix = next((n + "." for n, m in model.named_modules() if m is sub and n), "")
                        keep = {}
                        for k, v in tk.items():
                            fk, fv = prefix + k, prefix + v
                            if any(fk.startswith(g + ".") or fv.startswith(g + ".") for g in gone):
                                continue
                            keep[k] = v
                        sub.all_tied_weights_keys = keep
                import re
                pats = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
                names = set(qc["modules"]) | set(qc.get("aliases") or {}) | set(gone)
                for n in names:
                    last = re.escape(n.split(".")[-1])
                    pats.add(rf"(^|\.){last}\.(weight|{'|'.join(_OVERLAY_SUFFIXES)})$")
                model._keys_to_ignore_on_load_unexpected = pats

            def _process_model_after_weight_loading(self, model, **kwargs):
                fill_tables(self.tables, self.overlay_dir)
                model.embedq_overlay = str(self.overlay_dir)
                return model

            def update_dtype(self, dtype):
                return dtype

            def is_serializable(self, *args, **kwargs):
                return False

            @property
            def is_trainable(self):
                return False

        if QUANT_METHOD not in qauto.AUTO_QUANTIZATION_CONFIG_MAPPING:
            qauto.AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] = EmbedqConfig
        if QUANT_METHOD not in qauto.AUTO_QUANTIZER_MAPPING:
            qauto.AUTO_QUANTIZER_MAPPING[QUANT_METHOD] = EmbedqHfQuantizer
        _REGISTERED = True


class _RegisterAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Registers embedq as soon as ``transformers.quantizers.auto`` finishes importing.

    Keeps ``import embedq`` free of transformers' import cost while making
    ``AutoModel*.from_pretrained`` see the ``embedq`` quant method whatever the import
    order.
    """

    TARGET = "transformers.quantizers.auto"

    def __init__(self):
        self._loader = None

    def find_spec(self, fullname, path, target=None):
        if fullname != self.TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        try:
            register()
        except Exception:  # pragma: no cover - never break transformers' import
            pass


def install_import_hook() -> None:
    """Register now if transformers' quantizer registry is loaded, else when it is."""
    if "transformers.quantizers.auto" in sys.modules:
        register()
        return
    if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


# ---------------------------------------------------------------------------------------
# public entry point


def load(path: str | os.PathLike, model_class=None, **from_pretrained_kwargs):
    """Load a checkpoint with an embedq overlay (in place or derived) into transformers.

    ``model_class`` defaults to ``AutoModelForCausalLM`` (falling back to
    ``AutoModelForImageTextToText`` for multimodal configs). Extra keyword arguments go
    to ``from_pretrained`` (``dtype=``, ``device_map=`` ...). The returned model has
    :class:`QuantizedEmbedding` / :class:`QuantizedLMHead` modules and ``generate()``
    works as usual.
    """
    p = Path(path)
    from embedq.overlays.reader import read_overlay_config
    if not p.is_dir():
        raise OverlayError(f"{p}: no such checkpoint folder")
    read_overlay_config(p)  # clear error when there is no overlay
    register()
    import transformers
    if model_class is None:
        cfg = transformers.AutoConfig.from_pretrained(str(p))
        model_class = transformers.AutoModelForCausalLM
        if type(cfg) not in transformers.AutoModelForCausalLM._model_mapping:
            model_class = getattr(transformers, "AutoModelForImageTextToText", model_class)
    qc = _config_quantization(p)
    if qc is None:
        # overlay-only bundle or a config.json without the quantization_config:
        # pass it explicitly so that transformers routes through embedq.
        from embedq.overlays.reader import read_overlay_config as _r
        cfg = transformers.AutoConfig.from_pretrained(str(p))
        cfg.quantization_config = _r(p)
        from_pretrained_kwargs.setdefault("config", cfg)
    result = model_class.from_pretrained(str(p), **from_pretrained_kwargs)
    model = result[0] if isinstance(result, tuple) else result  # output_loading_info=True
    if not quantized_modules(model):
        raise OverlayError(f"{p}: loaded, but no module was replaced by the overlay")
    return result


def _config_quantization(p: Path) -> dict | None:
    import json
    try:
        qc = json.loads((p / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    return qc if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD else None


__all__ = ["PackedTable", "QuantizedEmbedding", "QuantizedLMHead", "load", "register",
           "install_import_hook", "quantized_modules", "quantized_nbytes", "resolve_targets",
           "replace_modules", "fill_tables"]
