"""embedq's vLLM quantize method: the quantized gather and logits over one packed table,
and the custom ops that hide the serving kernels from dynamo (imports vLLM; loaded by
:mod:`embedq.backends.vllm.layers`). Serving goes through :mod:`embedq.kernels`."""

from __future__ import annotations

import logging
import os
import weakref

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.utils import set_weight_attrs

from embedq.format.codec import (dequantize_rows, pack_zero_point_rows, packed_zero_point_rows,
                                 unpack_zero_point_rows, zero_points_of)
from embedq.kernels import PreparedTable

logger = logging.getLogger("embedq.vllm")



# vLLM compiles the model's forward (embedding included) with dynamo; the fast path's
# Python (chunk loops over the token count, kernel choice) is opaque to it through these
# ops, which find their table by key. Eager calls skip the op dispatch.
PREPARED: "weakref.WeakValueDictionary[str, PreparedTable]" = weakref.WeakValueDictionary()


@torch.library.custom_op("embedq::vocab_embedding", mutates_args=())
def _vocab_embedding_op(ids: torch.Tensor, key: str, cols: int, dtype: torch.dtype) -> torch.Tensor:
    return PREPARED[key].embedding(ids, dtype)


@_vocab_embedding_op.register_fake
def _(ids, key, cols, dtype):
    return ids.new_empty((*ids.shape, cols), dtype=dtype)


@torch.library.custom_op("embedq::vocab_logits", mutates_args=())
def _vocab_logits_op(x: torch.Tensor, key: str, rows: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    return PREPARED[key].linear(x, bias)


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

    def __init__(self, config, name: str):  # config: layers.EmbedqConfig
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
            zp = Parameter(torch.zeros(packed_zero_point_rows(rows, spec.bits), spec.groups,
                                       dtype=torch.int32), requires_grad=False)

            def zp_loader(param, loaded_weight, _layer=layer):
                # On disk: int32 [ceil(rows*bits/32), groups] for the whole vocabulary.
                si = _layer.shard_indices
                start, count = si.org_vocab_start_index, si.num_org_elements
                want = spec.zero_point_rows
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
            prepared = self._reference(layer) if os.environ.get("EMBEDQ_FASTPATH") == "0" else None
            if prepared is None:
                zp = None if self.spec.symmetric else layer.weight_zero_point
                prepared = PreparedTable.from_packed(
                    packed.data, layer.weight_scale.data, self.spec.cols, self.spec.bits,
                    self.spec.group_size, zero_point_packed=None if zp is None else zp.data,
                    device=packed.device, dtype=layer.params_dtype)
            prepared.key = f"{self.owner}#{len(PREPARED)}@{id(prepared):x}"
            PREPARED[prepared.key] = prepared
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

    def _reference(self, layer) -> PreparedTable:
        """The kernel layer's chunked reference over the on-disk tensors as they are (no
        copy): ``EMBEDQ_FASTPATH=0``, and a table not prepared yet."""
        zp = None if self.spec.symmetric else layer.weight_zero_point
        return PreparedTable.from_packed(
            layer.weight_packed.data, layer.weight_scale.data, self.spec.cols, self.spec.bits,
            self.spec.group_size, zero_point_packed=None if zp is None else zp.data,
            device=layer.weight_packed.device, dtype=layer.params_dtype, prefer="chunked")

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
        return self._reference(layer).linear(x, bias)  # not prepared yet (an alias before sharing)


__all__ = ["EmbedqMethod", "PREPARED"]
