"""vLLM-facing classes of the embedq quantization method (imports vLLM).

Imported by :func:`embedq.backends.vllm.register` inside vLLM processes only. Decoding
goes through :mod:`embedq.format.codec`, the one decoder every back end uses, and serving
through :mod:`embedq.kernels` (tested against it).

The quantize method itself (gather, logits, the custom ops) is in
:mod:`embedq.backends.vllm.method`; this module holds the config that resolves which
layers get it. Serving layout: after loading, ``process_weights_after_loading`` converts each table (this
rank's vocab shard, padding rows included) once to a ``PreparedTable`` (the layout
the dispatch table of :mod:`embedq.kernels` picks) and releases the storage
of the on-disk-layout Parameters (they stay registered, empty, so names and sharing are
unchanged). The prepared table hangs off the ``weight_packed`` Parameter object, which a
tied head / MTP alias shares with its owner, so every sharer reads ONE table; each layer
also gets it as ``layer.embedq_prepared``. ``EMBEDQ_FASTPATH=0`` keeps the reference
path (chunked dequantization of the on-disk layout). Re-loading weights into a served
model (vLLM's ``reload_weights``) is not supported once prepared.
"""

from __future__ import annotations

import logging
import re
import weakref
from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import get_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)


from embedq.errors import OverlayError
from embedq.format.config import ModuleEntry, parse_config
from embedq.format.files import inside
from embedq.format.reader import check_overlay_header
from embedq.format.constants import (QCONFIG_NAME, QUANT_METHOD, READABLE_FORMAT_VERSIONS,
                                     is_head_name)
from embedq.format.dtypes import dtype_from_name
from embedq.backends.vllm.method import PREPARED as _PREPARED  # noqa: F401 - engine workers read it here
from embedq.backends.vllm.method import EmbedqMethod

logger = logging.getLogger("embedq.vllm")



# Layer names vLLM's model classes spell otherwise than the checkpoint's module (the last
# name component: vLLM name -> checkpoint name). vllm/model_executor/models/gemma3n.py
# (0.32, 0.33) builds Gemma 3n's embed_tokens_per_layer with
# prefix=f"{prefix}.per_layer_embed_tokens" (its weights load under the attribute's name).
VLLM_SPELLINGS = {"per_layer_embed_tokens": "embed_tokens_per_layer"}


class _HybridMethod:
    """A method that works on the class (returns the default) and on instances."""

    def __init__(self, f):
        self.f = f

    def __get__(self, obj, cls):
        return lambda *a, **k: self.f(obj, cls, *a, **k)

class _Spec:
    """One overlay module as the vLLM layers need it (from the validated config entry)."""

    __slots__ = ("name", "rows", "cols", "bits", "group_size", "symmetric", "scale_dtype",
                 "groups", "zero_point_rows")

    def __init__(self, name: str, entry: ModuleEntry):
        self.name = name
        self.rows, self.cols = entry.shape
        s = entry.scheme
        self.bits, self.group_size, self.symmetric = s.bits, s.group_size, s.symmetric
        self.groups = s.groups(self.cols)
        self.zero_point_rows = s.unit.zero_point_rows(self.rows)
        self.scale_dtype = dtype_from_name(entry.scale_dtype)

    def same_scheme(self, other: "_Spec") -> bool:
        return (self.bits, self.group_size, self.symmetric, self.scale_dtype, self.cols) == (
            other.bits, other.group_size, other.symmetric, other.scale_dtype, other.cols)


class EmbedqConfig(QuantizationConfig):
    """The ``embedq`` quantization method (overlay contract, format version 2; version 1 still read)."""

    def __init__(self, config: dict[str, Any], base: QuantizationConfig | None = None):
        self._pmm: dict[str, list[str]] = {}
        self.base = base
        super().__init__()
        self.raw = config
        try:  # the one validated parse; every field below is read from it
            parsed = parse_config(config, QCONFIG_NAME)
        except OverlayError as e:
            raise ValueError(f"embedq: {e}") from None
        self.parsed = parsed
        self.modules: dict[str, _Spec] = {
            name: _Spec(name, entry) for name, entry in parsed.modules.items()}
        self.aliases: dict[str, str] = dict(parsed.aliases)
        for alias, owner in self.aliases.items():
            if owner not in self.modules:
                raise ValueError(f"embedq: alias {alias} -> {owner}: {owner} is not a "
                                 "quantized module of the overlay")
        self.tied = parsed.tied
        # Names of the float tensors an in-place overlay leaves in the original shards.
        self.float_names: set[str] = set()
        for name, entry in parsed.modules.items():
            self.float_names.add(f"{name}.weight")
            self.float_names.add(entry.source.tensor)
        for alias in self.aliases:
            self.float_names.add(f"{alias}.weight")
        # vLLM-side (mapped) module name -> overlay module name.
        self.name_map: dict[str, str] = {n: n for n in (*self.modules, *self.aliases)}
        # Layers created for owner modules in this model (for alias sharing).
        self.layers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        if base is not None:
            self._ignore_unexpected_suffixes = tuple(dict.fromkeys(
                (*QuantizationConfig._ignore_unexpected_suffixes,
                 *getattr(base, "_ignore_unexpected_suffixes", ()))))

    def __getstate__(self):
        state = dict(self.__dict__)
        state["layers"] = None  # per-process (weak references to this model's layers)
        state["parsed"] = None  # read-only mappings; parsed again from ``raw`` below
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.layers = weakref.WeakValueDictionary()
        self.parsed = parse_config(self.raw, QCONFIG_NAME)

    # packed_modules_mapping is updated in place by models (SupportsQuant); share the
    # same dict with the base config so its fused-layer matching keeps working.
    @property
    def packed_modules_mapping(self):
        return self._pmm

    @packed_modules_mapping.setter
    def packed_modules_mapping(self, value):
        self._pmm = value
        if self.base is not None:
            self.base.packed_modules_mapping = value

    def __getattr__(self, name: str):
        # Attributes that model code reads from the base method (weight_block_size,
        # is_checkpoint_fp8_serialized, ...). Only called for missing attributes.
        base = self.__dict__.get("base")
        if base is not None and not name.startswith("__"):
            return getattr(base, name)
        raise AttributeError(name)

    # -- QuantizationConfig interface --
    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        if self.base is not None:
            return list(self.base.get_supported_act_dtypes())
        return [torch.bfloat16, torch.float16, torch.float32]

    @_HybridMethod
    def get_min_capability(self, cls) -> int:  # noqa: N805 - hybrid
        if self is not None and self.base is not None:
            return self.base.get_min_capability()
        return -1

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [QCONFIG_NAME]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "EmbedqConfig":
        method = config.get("quant_method")
        if method != QUANT_METHOD:
            raise ValueError(f"embedq: not an embedq quantization_config "
                             f"(quant_method={method!r})")
        version = config.get("format_version")
        if version not in READABLE_FORMAT_VERSIONS:
            raise ValueError(
                f"embedq: overlay format_version {version!r}; this embedq serves "
                f"format_version {' and '.join(map(str, READABLE_FORMAT_VERSIONS))} — upgrade embedq "
                "or re-quantize")
        if not config.get("modules"):
            raise ValueError("embedq: quantization_config lists no modules")
        try:  # the one validated parse (docs/security.md): types, ranges, names
            parse_config(config, QCONFIG_NAME)
        except OverlayError as e:
            raise ValueError(f"embedq: {e}") from None
        base = None
        base_cfg = config.get("base_quantization_config")
        if base_cfg:
            base_cfg = dict(base_cfg)
            bm = str(base_cfg.get("quant_method", "")).lower().replace(
                "compressed_tensors", "compressed-tensors")
            if bm == QUANT_METHOD:
                raise ValueError("embedq: base_quantization_config is itself embedq")
            base_cfg["quant_method"] = bm
            base_cls = get_quantization_config(bm)
            base = base_cls.from_config(base_cfg)
        return cls(config, base)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        if isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") == QUANT_METHOD:
            if user_quant in (None, QUANT_METHOD):
                return QUANT_METHOD
        return None

    def maybe_update_config(self, model_name, hf_config=None, revision=None):
        # vLLM calls this once per engine config, with the model folder, before any model
        # is built or weight read; its loader reads every tensor of embedq.safetensors (an
        # in-place overlay's file is globbed with the shards), so hold the file to the config
        # here as every other reader does: only the declared tensors (docs/security.md row 2).
        self.check_overlay_file(model_name)
        if self.base is not None:
            self.base.maybe_update_config(model_name, hf_config=hf_config, revision=revision)

    def check_overlay_file(self, model_name) -> None:
        """``format.reader.check_overlay_header`` on the overlay file of a local model
        folder (a Hub id is not a folder yet: vLLM downloads it later); an
        ``OverlayError`` naming the file, as ``embedq verify``/``load`` give."""
        folder = Path(str(model_name)) if model_name else None
        if folder is None or not folder.is_dir():
            return
        name = self.parsed.overlay
        if (folder / name).exists() or (folder / name).is_symlink():
            check_overlay_header(inside(folder, name), self.parsed)

    def apply_vllm_mapper(self, hf_to_vllm_mapper):
        if self.base is not None:
            self.base.apply_vllm_mapper(hf_to_vllm_mapper)
        for name in list(self.name_map.values()):
            for probe, strip in ((name + ".weight", ".weight"), (name, "")):
                mapped = hf_to_vllm_mapper.map_name(probe)
                if mapped and mapped.endswith(strip):
                    mapped = mapped[: len(mapped) - len(strip)] if strip else mapped
                    self.name_map.setdefault(mapped, name)
                    break

    def get_cache_scale_mapper(self):
        if self.base is not None:
            return self.base.get_cache_scale_mapper()
        return QuantizationConfig.get_cache_scale_mapper()

    def get_checkpoint_weight_mapper(self):
        from vllm.model_executor.models.utils import WeightsMapper
        mapper = (self.base.get_checkpoint_weight_mapper() if self.base is not None
                  else QuantizationConfig.get_checkpoint_weight_mapper())
        names = set(self.float_names)
        for vllm_name, name in self.name_map.items():
            if vllm_name != name:
                names.add(f"{vllm_name}.weight")
        pattern = re.compile("^(?:" + "|".join(re.escape(n) for n in sorted(names)) + ")$")
        return mapper | WeightsMapper(orig_to_new_regex={pattern: None})

    # -- dispatch --
    def resolve(self, prefix: str, is_head: bool, rows: int, cols: int) -> str | None:
        """The overlay module (or alias) a vocab layer serves, or None.

        By name first (checkpoint name, or its vLLM-mapped form); then by kind (head or
        embedding) and shape, among the modules of the layer's last name component
        (vLLM's spelling of it read through ``VLLM_SPELLINGS``) when it has a name, among
        all when it has none (Llama, Mixtral, Gemma, ...).
        """
        p = (prefix or "").lstrip(".")
        if p in self.name_map:
            return self.name_map[p]

        def fits(name: str) -> bool:
            spec = self.modules[self.aliases.get(name, name)]
            return is_head_name(name) == is_head and spec.rows == rows and spec.cols == cols

        candidates = [n for n in (*self.modules, *self.aliases) if fits(n)]
        if p:  # named, but not by the checkpoint's name: match on the last component
            last = p.rsplit(".", 1)[-1]
            last = VLLM_SPELLINGS.get(last, last)
            candidates = [n for n in candidates if n.rsplit(".", 1)[-1] == last]
        if len(candidates) == 1:
            logger.debug("embedq: layer %r serves overlay module %s", prefix, candidates[0])
            return candidates[0]
        if len(candidates) > 1:
            specs = [self.modules[self.aliases.get(n, n)] for n in candidates]
            owners = {self.aliases.get(n, n) for n in candidates}
            if len(owners) == 1 or all(s.same_scheme(specs[0]) for s in specs):
                # Weights load by parameter name, so only the scheme must be right.
                return candidates[0]
            raise ValueError(
                f"embedq: cannot tell which overlay module the layer named {prefix!r} is "
                f"({candidates}), and their schemes differ")
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, VocabParallelEmbedding):
            name = self.resolve(prefix, isinstance(layer, ParallelLMHead),
                                layer.org_vocab_size, layer.embedding_dim)
            if name is not None:
                return EmbedqMethod(self, name)
        if self.base is not None:
            return self.base.get_quant_method(layer, prefix)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        if isinstance(layer, VocabParallelEmbedding):
            return UnquantizedEmbeddingMethod()
        return None

# -- the prepared tables as custom ops ------------------------------------------------------
class EmbedqVocabParallelEmbedding(VocabParallelEmbedding):
    """``VocabParallelEmbedding`` that finds the embedq config when a model passes none."""

    def __init__(self, num_embeddings, embedding_dim, params_dtype=None,
                 org_num_embeddings=None, padding_size=64, quant_config=None, prefix="",
                 **kwargs):
        if quant_config is None and kwargs.get("quant_method") is None:
            try:
                from vllm.config import get_current_vllm_config_or_none
                vc = get_current_vllm_config_or_none()
                current = getattr(vc, "quant_config", None) if vc is not None else None
            except Exception:  # pragma: no cover
                current = None
            if isinstance(current, EmbedqConfig):
                name = current.resolve(prefix, False, org_num_embeddings or num_embeddings,
                                       embedding_dim)
                if name is not None:
                    # The method itself, not the config: layers the overlay does not
                    # cover stay exactly as the model built them.
                    kwargs["quant_method"] = EmbedqMethod(current, name)
        super().__init__(num_embeddings, embedding_dim, params_dtype, org_num_embeddings,
                         padding_size, quant_config, prefix, **kwargs)
