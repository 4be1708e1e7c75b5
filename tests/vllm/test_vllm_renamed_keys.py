"""vLLM's own model classes loading overlays of architectures whose saved embedding / head
keys differ from transformers' module paths (GPT-NeoX's ``embed_out``), enumerated from
transformers' conversion mapping; architectures vLLM does not support are skipped."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from _harness import assert_logits_match, load_model, magnitude, reference, vocab_layers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoints"))
from archs import build_tiny, renamed_architectures  # noqa: E402

import _ev as ev  # noqa: E402

ev.register()


def _supported() -> set[str]:
    from vllm import ModelRegistry
    return set(ModelRegistry.get_supported_archs())


ARCHS = renamed_architectures()
MISSING_OP = re.compile(r"'_OpNamespace' '_C' object has no attribute '(\w+)'")


def _upstream(e: BaseException, path: Path) -> str | None:
    """Why vLLM itself, not embedq, cannot build this tiny model here, or None. Only an
    error raised outside embedq counts: a CPU kernel the PyPI wheel lacks and
    _missing_kernels.py does not route (e.g. Aria's torch.ops._C.prepack_moe_weight), an
    optional package vLLM imports, or the generic tiny multimodal build (a vision tower
    without its processor), which vLLM cannot build before the embedding is reached."""
    import traceback
    import embedq
    frames = traceback.extract_tb(e.__traceback__)
    # embedq's package folder, not any path with "embedq" in it (the venvs live in ~/.cache/embedq)
    pkg = str(Path(embedq.__file__).resolve().parent) + os.sep
    if not frames or str(Path(frames[-1].filename).resolve()).startswith(pkg):
        return None  # raised by embedq's own code
    m = MISSING_OP.search(str(e))
    if isinstance(e, AttributeError) and m:
        return f"the PyPI vLLM wheel lacks the CPU kernel torch.ops._C.{m.group(1)}"
    if isinstance(e, ModuleNotFoundError) and e.name and not e.name.startswith("embedq"):
        return f"vLLM needs the package {e.name}, not installed ({frames[-1].filename})"
    if "vision_config" in json.loads((path / "config.json").read_text()):
        return f"tiny multimodal build not loadable by vLLM ({type(e).__name__}: {str(e)[:160]})"
    return None


def test_gpt_neox_is_enumerated():
    assert "GPTNeoXForCausalLM|gpt_neox" in ARCHS


@pytest.mark.parametrize("key", sorted(ARCHS))
def test_vllm_loads_renamed_architecture(key, tmp_path):
    import embedq
    cls_name, _ = ARCHS[key]
    if cls_name not in _supported():
        pytest.skip(f"vLLM does not support {cls_name}")
    mt = key.split("|", 1)[1]
    try:
        path = build_tiny(cls_name, mt, tmp_path / "m", tie=False)
    except Exception as e:
        pytest.skip(f"{cls_name}: no tiny build ({type(e).__name__}: {str(e)[:120]})")
    d = embedq.inspect(path)
    embedq.quantize(path, bits=8, lm_head=d["head_tensor"] is not None, progress=False)
    try:
        _, model = load_model(path)
    except Exception as e:
        why = _upstream(e, path)
        if why is None:
            raise
        pytest.skip(f"{cls_name}: {why}")
    embed, head = vocab_layers(model)
    assert isinstance(embed.quant_method, ev.EmbedqMethod)
    emb_module = d["tensors"][0]["tensor"][: -len(".weight")]
    ref = reference(path, emb_module, torch.bfloat16)
    ids = torch.arange(ref.shape[0])
    torch.testing.assert_close(embed(ids), ref[ids], rtol=0, atol=0)
    if d["head_tensor"] is not None and head is not None:
        assert isinstance(head.quant_method, ev.EmbedqMethod)
        ref_head = reference(path, d["head_module"], torch.bfloat16)
        h = torch.randn(3, ref_head.shape[1]).to(torch.bfloat16)
        got = head.quant_method.apply(head, h)[:, : ref_head.shape[0]]
        assert_logits_match(got, h @ ref_head.t(), h, magnitude(path, d["head_module"]))
