"""vLLM back end: serve embedq overlays with no patch to vLLM.

Registered through the ``vllm.general_plugins`` entry point (function :func:`register`),
which vLLM calls in every engine and worker process. It registers the quantization
method ``embedq`` (:class:`EmbedqConfig`), read from ``config.json``'s
``quantization_config`` (written by ``embedq quantize``) or, with
``--quantization embedq``, from ``quantization_config.json`` in the model folder.

What the method does
--------------------
* Overlay modules (``modules`` of the config) get :class:`EmbedqMethod`: the packed table
  (``weight_packed`` int32, packed as on disk, so 4-bit stays packed in memory), the scales
  and, for asymmetric schemes, the zero points are parameters loaded through vLLM's own
  weight loader (vocab-sharded under tensor parallelism). Embedding lookups gather packed
  rows and dequantize only those; logits (``apply``) dequantize the table chunk by chunk
  and multiply, never materializing the float table. Pure torch: runs on CPU and GPU.
* Aliases (a tied ``lm_head``, an MTP/draft embedding) share the owner's parameter
  objects, so a tied model holds one quantized table.
* Every other layer is handed to ``base_quantization_config`` (the method vLLM builds from
  it: FP8, AWQ, GPTQ, compressed-tensors, ...) or served unquantized.
* The float table that an in-place overlay leaves in the original shard is dropped: by the
  checkpoint weight mapper (models using ``AutoWeightsLoader``) and by a zero-row ``weight``
  stub whose loader discards float input (hand-written loaders; it also keeps
  ``embed_tokens.weight.shape[-1]`` meaningful for EAGLE/MTP embedding sharing).
* Models that build ``VocabParallelEmbedding`` without ``quant_config`` are covered by an
  out-of-tree ``VocabParallelEmbedding`` (``PluggableLayer.register_oot``) that fetches the
  current config when it is an embedq one; models that pass no ``prefix`` are matched by
  shape.

This package imports nothing from vLLM at import time; the classes live in
:mod:`embedq.backends.vllm.layers`, imported by :func:`register` inside vLLM processes.
"""

from __future__ import annotations

import logging

from embedq.format.constants import QUANT_METHOD

logger = logging.getLogger("embedq.vllm")

ENTRY_POINT = 'embedq = "embedq.backends.vllm:register"'

_registered = False


def register() -> None:
    """Entry point for ``vllm.general_plugins``: registers the ``embedq`` method.

    Idempotent, and never raises (vLLM calls plugin functions unguarded): a failure is
    logged, and vLLM then reports "Unknown quantization method: embedq".
    """
    global _registered
    if _registered:
        return
    try:
        _register()
        _registered = True
    except Exception:  # pragma: no cover - depends on the installed vLLM
        logger.exception("embedq: could not register the vLLM quantization method")


def _register() -> None:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from embedq.backends.vllm.layers import EmbedqConfig, EmbedqVocabParallelEmbedding
    register_quantization_config(QUANT_METHOD)(EmbedqConfig)
    name = VocabParallelEmbedding.__name__
    existing = op_registry_oot.get(name)
    if existing is None:
        VocabParallelEmbedding.register_oot(EmbedqVocabParallelEmbedding, name=name)
    elif existing is not EmbedqVocabParallelEmbedding:
        logger.warning(
            "embedq: another plugin replaces VocabParallelEmbedding (%s); models that do not "
            "pass quant_config to their embedding will load it unquantized", existing)


__all__ = ["register", "ENTRY_POINT"]
