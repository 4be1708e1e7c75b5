"""The compressed-tensors ``quantization_config`` equivalent to an embedq overlay.

The overlay tensors are already compressed-tensors ``pack-quantized``; only the config
differs. Pure Python: used by ``embedq quantize --format compressed-tensors``.
"""

from __future__ import annotations

from embedq.format.config import OverlayConfig, parse_config
from embedq.format.constants import QUANT_METHOD, is_head_name


def compressed_tensors_config(overlay_config: OverlayConfig | dict) -> dict:
    """A pure compressed-tensors ``quantization_config`` equivalent to an embedq overlay.

    Stock vLLM (no plugin) serves it only when every quantized table is symmetric and no
    module reads another's table: its ``CompressedTensorsEmbeddingWNA16Int`` ignores zero
    points and cannot compute logits, so a tied head cannot share the quantized embedding.
    Raises ``ValueError`` saying why for every other overlay.

    The embedding group targets the class name ``Embedding`` (vLLM matches it as a
    substring of ``VocabParallelEmbedding``; many vLLM models, Llama among them, build the
    embedding without a layer name, so a name target would not match there). It is used
    only when the overlay has exactly one quantized embedding; otherwise names are used.
    """
    cfg = overlay_config.to_dict() if isinstance(overlay_config, OverlayConfig) else overlay_config
    if cfg.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"not an embedq config (quant_method={cfg.get('quant_method')!r})")
    if cfg.get("base_quantization_config"):
        raise ValueError(
            "the checkpoint already has a quantization_config "
            f"({cfg['base_quantization_config'].get('quant_method')!r}); a pure "
            "compressed-tensors config cannot describe both — serve it with the embedq plugin")
    aliases = cfg.get("aliases") or {}
    if cfg.get("tie_word_embeddings") or aliases:
        which = ", ".join(f"{a} -> {o}" for a, o in aliases.items()) or "tie_word_embeddings"
        raise ValueError(
            f"the model is tied or shares a quantized table ({which}): stock vLLM's "
            "compressed-tensors embedding cannot compute logits, so a tied lm_head cannot "
            "read the quantized embedding — serve it with the embedq plugin")
    if not cfg.get("modules"):
        raise ValueError("the overlay quantizes no module")
    parsed = overlay_config if isinstance(overlay_config, OverlayConfig) else \
        parse_config(cfg, "quantization_config")
    modules = parsed.modules
    groups: dict[str, dict] = {}
    embeddings = [m for m in modules if not is_head_name(m)]
    for i, (name, entry) in enumerate(sorted(modules.items())):
        s = entry.scheme  # type "int": the parse refuses any other
        bits, gs, sym = s.bits, s.group_size, s.symmetric
        if not sym:
            raise ValueError(
                f"{name} is asymmetric: stock vLLM's compressed-tensors embedding ignores "
                "zero points — re-quantize symmetric or serve it with the embedq plugin")
        is_head = name not in embeddings
        target = name if (is_head or len(embeddings) != 1) else "Embedding"
        groups[f"group_{i}"] = {
            "targets": [target],
            "weights": {
                "num_bits": bits, "type": "int", "symmetric": True,
                "strategy": "group" if gs else "channel", "group_size": gs,
                "dynamic": False, "actorder": None, "block_structure": None,
                "observer": "minmax", "observer_kwargs": {},
            },
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": [],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }
