"""``--format compressed-tensors``: a derived checkpoint stock vLLM serves without the plugin.

The overlay tensors are already compressed-tensors ``pack-quantized``; only the
config differs. Stock compressed-tensors has no notion of a tied head reading a
quantized table, of zero points on an embedding, or of a second quantization method
beside it, so those cases are refused (zero points and ``--overlay-only`` by
:class:`embedq.jobs.recipe.QuantizeRecipe`, the rest by :func:`refuse_early`) before
anything is written; the config itself is built inside the derived checkpoint's
staging folder (:func:`ct_quantization_config`), so a refusal there still leaves an
earlier output untouched.
"""

from __future__ import annotations

from embedq.errors import SchemeError
from embedq.format.checkpoint import CONFIG_NAME, Checkpoint


def refuse_early(ckpt: Checkpoint, base_qc: dict | None, tied: bool, aliases: dict) -> None:
    """Refuse, before anything is written, what a pure compressed-tensors config cannot say."""
    where = ckpt.path / CONFIG_NAME
    if base_qc:
        method = base_qc.get("quant_method") if isinstance(base_qc, dict) else None
        raise SchemeError(
            f"{where}: --format compressed-tensors: the checkpoint already has a quantization_config "
            f"({method!r}); a pure compressed-tensors config cannot describe both — drop --format "
            "(the default embedq format, served with the embedq plugin) or quantize an unquantized source")
    if tied or aliases:
        raise SchemeError(
            f"{where}: tied embeddings: stock vLLM cannot run a tied lm_head on a "
            "compressed-tensors embedding table; use the default embedq format (vLLM plugin)")


def ct_quantization_config(ckpt: Checkpoint, qconfig: dict) -> dict:
    """The compressed-tensors ``quantization_config`` of the embedq ``qconfig``, or a SchemeError
    (one line naming the source's config) for what :func:`refuse_early` could not see."""
    from embedq.format.compressed_tensors import compressed_tensors_config
    try:
        return compressed_tensors_config(qconfig)
    except ValueError as e:
        raise SchemeError(f"{ckpt.path / CONFIG_NAME}: --format compressed-tensors: {e}") from None


__all__ = ["refuse_early", "ct_quantization_config"]
