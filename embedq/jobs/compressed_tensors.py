"""``--format compressed-tensors``: a derived checkpoint stock vLLM serves without the plugin.

The overlay tensors are already compressed-tensors ``pack-quantized``; only the
config differs. Stock compressed-tensors has no notion of a tied head reading a
quantized table or of zero points on an embedding, so those cases are refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from embedq.errors import SchemeError
from embedq.format.checkpoint import CONFIG_NAME, Checkpoint
from embedq.format.files import write_json_atomic
from embedq.jobs.overlay import plan_modules
from embedq.jobs.quantize import quantize_checkpoint
from embedq.format.scheme import Scheme


def quantize_compressed_tensors(path, bits: int = 8, *, output=None, symmetric: bool = True, **kwargs):
    """Like :func:`quantize_checkpoint` with ``output``, but config.json gets a pure
    compressed-tensors ``quantization_config``. Refuses tied or asymmetric cases."""
    if output is None:
        raise SchemeError("--format compressed-tensors writes a derived checkpoint: pass --output DIR")
    if not symmetric:
        raise SchemeError("--format compressed-tensors: stock vLLM serves only symmetric embedding "
                          "tables; drop --asym or use the default embedq format")
    ckpt = Checkpoint.open(path)
    scheme = Scheme.default(bits, symmetric, kwargs.get("group_size"))
    _, aliases, tied = plan_modules(ckpt, scheme, lm_head=kwargs.get("lm_head", False),
                                    targets=kwargs.get("targets"), trust=kwargs.get("trust"),
                                    fit_default=kwargs.get("group_size") is None)
    if tied or aliases:
        raise SchemeError(
            f"{ckpt.path / CONFIG_NAME}: tied embeddings: stock vLLM cannot run a tied lm_head on a "
            "compressed-tensors embedding table; use the default embedq format (vLLM plugin)")
    report = quantize_checkpoint(path, bits, output=output, symmetric=symmetric, **kwargs)
    out = Path(output)
    try:
        from embedq.format.compressed_tensors import compressed_tensors_config
        qc = json.loads((out / "quantization_config.json").read_text())
        ct = compressed_tensors_config(qc)
    except ValueError as e:
        shutil.rmtree(out, ignore_errors=True)
        raise SchemeError(f"--format compressed-tensors: {e}") from None
    cfg = json.loads((out / CONFIG_NAME).read_text())
    cfg["quantization_config"] = ct
    write_json_atomic(out / CONFIG_NAME, cfg)
    report.mode = "derived (compressed-tensors)"
    return report
