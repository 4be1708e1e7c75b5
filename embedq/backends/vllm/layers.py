"""vLLM-facing classes of the embedq quantization method (imports vLLM).

Imported by :func:`embedq.backends.vllm.register` inside vLLM processes only. Decoding
goes through :mod:`embedq.format.codec`, the one decoder every back end uses, and serving
through :mod:`embedq.kernels` (tested against it).

Serving layout: after loading, ``process_weights_after_loading`` converts each table (this
rank's vocab shard, padding rows included) once to a :class:`PreparedTable` (torch's
weight-only int8/int4 kernels, or the bounded chunked fallback) and releases the storage
of the on-disk-layout Parameters (they stay registered, empty, so names and sharing are
unchanged). The prepared table hangs off the ``weight_packed`` Parameter object, which a
tied head / MTP alias shares with its owner, so every sharer reads ONE table; each layer
also gets it as ``layer.embedq_prepared``. ``EMBEDQ_FASTPATH=0`` keeps the reference
path (chunked dequantization of the on-disk layout). Re-loading weights into a served
model (vLLM's ``reload_weights``) is not supported once prepared.
"""

from __future__ import annotations

import logging
import os
import re
import weakref
from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import get_quantization_config
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.model_executor.utils import set_weight_attrs


from embedq.format.codec import (dequantize_rows, pack_zero_point_rows, unpack_zero_point_rows,
                                 zero_points_of)
from embedq.errors import OverlayError
from embedq.format.config import parse_config, scheme_of
from embedq.format.constants import (QCONFIG_NAME, QUANT_METHOD, READABLE_FORMAT_VERSIONS,
                                     is_head_name)
from embedq.format.dtypes import dtype_from_name
from embedq.kernels import PreparedTable

logger = logging.getLogger("embedq.vllm")

# Elements of dequantized table per chunk in ``apply`` (logits); 16M elements = 32 MB bf16.
_CHUNK_ELEMS = int(os.environ.get("EMBEDQ_VLLM_CHUNK_ELEMS", str(1 << 24)))


class _HybridMethod:
    """A method that works on the class (returns the default) and on instances."""

    def __init__(self, f):
        self.f = f

    def __get__(self, obj, cls):
        return lambda *a, **k: self.f(obj, cls, *a, **k)

class _Spec:
    """One overlay module as the vLLM layers need it (from the validated config entry)."""

    __slots__ = ("name", "rows", "cols", "bits", "group_size", "symmetric", "scale_dtype",
                 "groups")

    def __init__(self, name: str, entry: dict):
        self.name = name
        self.rows, self.cols = (int(x) for x in entry["shape"])
        s = scheme_of(entry)
        s.check_shape((self.rows, self.cols), f"embedq: {name}")
        self.bits, self.group_size, self.symmetric = s.bits, s.group_size, s.symmetric
        self.groups = s.groups(self.cols)
        self.scale_dtype = dtype_from_name(entry.get("scale_dtype") or "bfloat16")

    def same_scheme(self, other: "_Spec") -> bool:
        return (self.bits, self.group_size, self.symmetric, self.scale_dtype, self.cols) == (
            other.bits, other.group_size, other.symmetric, other.scale_dtype, other.cols)


class EmbedqConfig(QuantizationConfig):
    """The ``embedq`` quantization method (overlay contract, format version 1)."""

    def __init__(self, config: dict[str, Any], base: QuantizationConfig | None = None):
        self._pmm: dict[str, list[str]] = {}
        self.base = base
        super().__init__()
        self.raw = config
        self.modules: dict[str, _Spec] = {
            name: _Spec(name, entry) for name, entry in config["modules"].items()}
        self.aliases: dict[str, str] = dict(config.get("aliases") or {})
        for alias, owner in self.aliases.items():
            if owner not in self.modules:
                raise ValueError(f"embedq: alias {alias} -> {owner}: {owner} is not a "
                                 "quantized module of the overlay")
        self.tied = bool(config.get("tie_word_embeddings"))
        # Names of the float tensors an in-place overlay leaves in the original shards.
        self.float_names: set[str] = set()
        for name, entry in config["modules"].items():
            self.float_names.add(f"{name}.weight")
            src = (entry.get("source") or {}).get("tensor")
            if src:
                self.float_names.add(src)
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
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.layers = weakref.WeakValueDictionary()

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
        if self.base is not None:
            self.base.maybe_update_config(model_name, hf_config=hf_config, revision=revision)

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

        By name first (checkpoint name, or its vLLM-mapped form); models that build the
        layer without a name (Llama, Mixtral, Gemma, ...) are matched by kind (head or
        embedding) and shape.
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
# vLLM compiles the model's forward (embedding included) with dynamo; the fast path's
# Python (chunk loops over the token count, kernel choice) is opaque to it through these
# ops, which find their table by key. Eager calls skip the op dispatch.
_PREPARED: "weakref.WeakValueDictionary[str, PreparedTable]" = weakref.WeakValueDictionary()


@torch.library.custom_op("embedq::vocab_embedding", mutates_args=())
def _vocab_embedding_op(ids: torch.Tensor, key: str, cols: int, dtype: torch.dtype) -> torch.Tensor:
    return _PREPARED[key].embedding(ids, dtype)


@_vocab_embedding_op.register_fake
def _(ids, key, cols, dtype):
    return ids.new_empty((*ids.shape, cols), dtype=dtype)


@torch.library.custom_op("embedq::vocab_logits", mutates_args=())
def _vocab_logits_op(x: torch.Tensor, key: str, rows: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    return _PREPARED[key].linear(x, bias)


@_vocab_logits_op.register_fake
def _(x, key, rows, bias=None):
    return x.new_empty((*x.shape[:-1], rows))


def _mark_loaded(param) -> None:
    param._embedq_loaded = True

def _discard_float(param, loaded_weight) -> None:
    logger.debug("embedq: dropping a float table of shape %s (replaced by the overlay)",
                 tuple(loaded_weight.shape))

class EmbedqMethod(QuantizeMethodBase):
    """Quantized gather (``embedding``) and logits (``apply``) over one packed table."""

    requires_device_loading = True

    def __init__(self, config: EmbedqConfig, name: str):
        self.config = config
        self.name = name
        self.owner = config.aliases.get(name, name)
        self.spec = config.modules[self.owner]
        self.is_alias = self.owner != name

    # -- weights --
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype, **extra_weight_attrs):
        spec = self.spec
        if input_size_per_partition != spec.cols or layer.org_vocab_size != spec.rows:
            raise ValueError(
                f"embedq: {self.name}: overlay shape {[spec.rows, spec.cols]} does not "
                f"match the model's layer ({layer.org_vocab_size} x "
                f"{input_size_per_partition})")
        layer.embedq_name = self.name
        layer.embedq_owner = self.owner
        # Float tables of an in-place overlay arrive under ``weight``: a zero-row stub
        # (dtype and hidden size intact) whose loader drops them.
        stub = Parameter(torch.empty(0, spec.cols, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(stub, {"weight_loader": _discard_float, "embedq_stub": True})
        layer.register_parameter("weight", stub)

        owner_layer = self.config.layers.get(self.owner) if self.is_alias else None
        if owner_layer is not None and self._can_share(layer, owner_layer):
            self._share(layer, owner_layer)
            return

        rows = sum(output_partition_sizes)
        pf = 32 // spec.bits
        vocab_loader = extra_weight_attrs.get("weight_loader", layer.weight_loader)

        def loader(param, loaded_weight, _inner=vocab_loader):
            _inner(param, loaded_weight)
            _mark_loaded(param)

        packed = Parameter(torch.zeros(rows, spec.cols // pf, dtype=torch.int32),
                           requires_grad=False)
        set_weight_attrs(packed, {"input_dim": 1, "output_dim": 0, "packed_dim": 1,
                                  "pack_factor": pf, "packed_factor": pf,
                                  "weight_loader": loader})
        scale = Parameter(torch.zeros(rows, spec.groups, dtype=spec.scale_dtype),
                          requires_grad=False)
        set_weight_attrs(scale, {"output_dim": 0, "weight_loader": loader})
        shape = Parameter(torch.tensor([spec.rows, spec.cols], dtype=torch.int64),
                          requires_grad=False)

        def shape_loader(param, loaded_weight, _name=self.owner):
            got = [int(x) for x in loaded_weight.reshape(-1).tolist()]
            if got != [spec.rows, spec.cols]:
                raise ValueError(f"embedq: {_name}.weight_shape is {got}, the config says "
                                 f"{[spec.rows, spec.cols]}")
            _mark_loaded(param)

        set_weight_attrs(shape, {"weight_loader": shape_loader})
        layer.register_parameter("weight_packed", packed)
        layer.register_parameter("weight_scale", scale)
        layer.register_parameter("weight_shape", shape)
        if not spec.symmetric:
            # Kept packed along rows as on disk (int32), for this partition's rows.
            zp = Parameter(torch.zeros(-(-rows * spec.bits // 32), spec.groups,
                                       dtype=torch.int32), requires_grad=False)

            def zp_loader(param, loaded_weight, _layer=layer):
                # On disk: int32 [ceil(rows*bits/32), groups] for the whole vocabulary.
                si = _layer.shard_indices
                start, count = si.org_vocab_start_index, si.num_org_elements
                want = -(-spec.rows * spec.bits // 32)
                if tuple(loaded_weight.shape) != (want, spec.groups):
                    raise ValueError(
                        f"embedq: {self.owner}.weight_zero_point has shape "
                        f"{tuple(loaded_weight.shape)}, expected {(want, spec.groups)}")
                part = unpack_zero_point_rows(loaded_weight.to(torch.int32), spec.bits,
                                              start, count)
                param.data.copy_(pack_zero_point_rows(part, spec.bits, rows))
                _mark_loaded(param)

            set_weight_attrs(zp, {"weight_loader": zp_loader})
            layer.register_parameter("weight_zero_point", zp)
        if not self.is_alias:
            self.config.layers[self.owner] = layer

    def _param_names(self):
        names = ["weight", "weight_packed", "weight_scale", "weight_shape"]
        if not self.spec.symmetric:
            names.append("weight_zero_point")
        return names

    def _can_share(self, layer, owner_layer) -> bool:
        return (owner_layer.num_embeddings_per_partition == layer.num_embeddings_per_partition
                and owner_layer.shard_indices == layer.shard_indices)

    def _share(self, layer, owner_layer) -> None:
        for n in self._param_names():
            if n in layer._parameters:
                del layer._parameters[n]
            layer.register_parameter(n, getattr(owner_layer, n))
        layer.embedq_shares = owner_layer

    def tie_weights(self, layer, embed_tokens):
        """Tie a head to the embedding: share the packed table's Parameter objects."""
        method = getattr(embed_tokens, "quant_method", None)
        if not isinstance(method, EmbedqMethod):
            raise ValueError(
                f"embedq: {self.name} is quantized but the embedding it is tied to "
                f"({type(method).__name__}) is not: re-quantize the tied model so that "
                "lm_head aliases the embedding")
        if method.spec is not self.spec and not method.spec.same_scheme(self.spec):
            raise ValueError(f"embedq: {self.name} is tied to an embedding quantized with "
                             "another scheme")
        if not self._can_share(layer, embed_tokens):
            raise ValueError(f"embedq: {self.name} cannot share the embedding's table "
                             "(different vocab partitioning)")
        self._share(layer, embed_tokens)
        return layer

    def process_weights_after_loading(self, layer) -> None:
        missing = [n for n in ("weight_packed", "weight_scale", "weight_zero_point")
                   if n in layer._parameters
                   and not getattr(layer._parameters[n], "_embedq_loaded", False)]
        if not missing:
            self._prepare(layer)
            return
        if self.is_alias and getattr(layer, "embedq_shares", None) is None:
            # An MTP/draft embedding aliased to a table of another model: vLLM shares the
            # target's embedding module with the draft after loading.
            logger.info("embedq: %s aliases %s, which is not in this model; expecting "
                        "vLLM to share the target model's layer", self.name, self.owner)
            return
        raise RuntimeError(
            f"embedq: quantized parameters {missing} of {self.owner} were not loaded "
            f"from the checkpoint (expected tensors {self.owner}.weight_packed, ...). "
            "Is embedq.safetensors listed in model.safetensors.index.json?")

    # -- serving layout --
    @torch.no_grad()
    def _prepare(self, layer) -> None:
        """Convert this partition's table once to the fast path's layout (shared through
        the ``weight_packed`` Parameter object) and release the on-disk copies."""
        packed = layer.weight_packed
        prepared = getattr(packed, "embedq_prepared", None)
        if prepared is None:
            if os.environ.get("EMBEDQ_FASTPATH") == "0":  # the reference decoder
                return
            zp = None if self.spec.symmetric else layer.weight_zero_point
            prepared = PreparedTable.from_packed(
                packed.data, layer.weight_scale.data, self.spec.cols, self.spec.bits,
                self.spec.group_size, zero_point_packed=None if zp is None else zp.data,
                device=packed.device, dtype=layer.params_dtype)
            prepared.key = f"{self.owner}#{len(_PREPARED)}@{id(prepared):x}"
            _PREPARED[prepared.key] = prepared
            packed.embedq_prepared = prepared
            # Release the on-disk layout (the Parameters stay, empty; a chunked fallback
            # that kept the same tensors still holds them: one copy either way).
            for n in ("weight_packed", "weight_scale", "weight_zero_point"):
                p = layer._parameters.get(n)
                if p is not None:
                    p.data = torch.empty((0,) + tuple(p.shape[1:]), dtype=p.dtype,
                                         device=p.device)
            logger.debug("embedq: %s prepared: %s", self.owner, prepared.describe())
        layer.embedq_prepared = prepared

    @staticmethod
    def prepared_of(layer) -> PreparedTable | None:
        """The layer's prepared table (shared by tied heads and aliases), or None."""
        return getattr(layer.weight_packed, "embedq_prepared", None)

    # -- compute --
    def embedding(self, layer, input_: torch.Tensor) -> torch.Tensor:
        prepared = self.prepared_of(layer)
        if prepared is not None:
            if torch.compiler.is_compiling():
                return _vocab_embedding_op(input_, prepared.key, prepared.cols,
                                           layer.params_dtype)
            return prepared.embedding(input_, layer.params_dtype)
        ids = input_.reshape(-1)
        zp = (None if self.spec.symmetric
              else zero_points_of(layer.weight_zero_point, self.spec.bits, ids))
        out = dequantize_rows(layer.weight_packed[ids], layer.weight_scale[ids], zp,
                              self.spec.bits, self.spec.cols, layer.params_dtype)
        return out.reshape(*input_.shape, self.spec.cols)

    def dequantize_weight(self, layer, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The partition's full float table (for tests and re-quantization)."""
        dtype = layer.params_dtype if dtype is None else dtype
        prepared = self.prepared_of(layer)
        if prepared is not None:
            return prepared.dequantize_range(0, prepared.rows, dtype)
        rows = layer.weight_packed.shape[0]
        zp = (None if self.spec.symmetric else zero_points_of(
            layer.weight_zero_point, self.spec.bits,
            torch.arange(rows, device=layer.weight_packed.device)))
        return dequantize_rows(layer.weight_packed, layer.weight_scale, zp,
                               self.spec.bits, self.spec.cols, dtype)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``x @ W^T`` over the padded partition."""
        prepared = self.prepared_of(layer)
        if prepared is not None:
            if torch.compiler.is_compiling():
                return _vocab_logits_op(x, prepared.key, prepared.rows, bias)
            return prepared.linear(x, bias)
        # reference path (EMBEDQ_FASTPATH=0): dequantize W chunk by chunk
        packed, scale = layer.weight_packed, layer.weight_scale
        rows = packed.shape[0]
        zps = None
        if not self.spec.symmetric:
            zps = zero_points_of(layer.weight_zero_point, self.spec.bits,
                                 torch.arange(rows, device=packed.device))
        step = max(64, _CHUNK_ELEMS // max(1, self.spec.cols))
        out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            w = dequantize_rows(packed[r0:r1], scale[r0:r1],
                                None if zps is None else zps[r0:r1],
                                self.spec.bits, self.spec.cols, x.dtype)
            out[..., r0:r1] = torch.nn.functional.linear(
                x, w, None if bias is None else bias[r0:r1])
        return out

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
