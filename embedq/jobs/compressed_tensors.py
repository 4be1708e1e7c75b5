"""``--format compressed-tensors``: a derived checkpoint stock vLLM serves without the plugin.

The overlay tensors are already compressed-tensors ``pack-quantized``; only the
config differs. Stock compressed-tensors has no notion of a tied head reading a
quantized table or of zero points on an embedding, so those cases are refused
(zero points by :class:`embedq.jobs.recipe.QuantizeRecipe`, ties here).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from embedq.errors import SchemeError
from embedq.format.checkpoint import CONFIG_NAME, QCONFIG_NAME, Checkpoint, read_json
from embedq.format.config import read_config_file
from embedq.format.files import write_json_atomic


def refuse_tied(ckpt: Checkpoint, tied: bool, aliases: dict) -> None:
    """Refuse a tied model before anything is written."""
    if tied or aliases:
        raise SchemeError(
            f"{ckpt.path / CONFIG_NAME}: tied embeddings: stock vLLM cannot run a tied lm_head on a "
            "compressed-tensors embedding table; use the default embedq format (vLLM plugin)")


def to_compressed_tensors(output: Path, report) -> None:
    """Give the derived checkpoint at ``output`` a pure compressed-tensors ``quantization_config``."""
    out = Path(output)
    try:
        from embedq.format.compressed_tensors import compressed_tensors_config
        ct = compressed_tensors_config(read_config_file(out / QCONFIG_NAME))
    except ValueError as e:
        shutil.rmtree(out, ignore_errors=True)
        raise SchemeError(f"--format compressed-tensors: {e}") from None
    cfg = read_json(out / CONFIG_NAME)
    cfg["quantization_config"] = ct
    write_json_atomic(out / CONFIG_NAME, cfg)
    report.mode = "derived (compressed-tensors)"


__all__ = ["refuse_tied", "to_compressed_tensors"]
