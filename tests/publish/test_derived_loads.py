"""A published (derived) folder loads in transformers and computes the quantized model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import embedq

from pubutil import derive  # noqa: F401 (fixture)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quality"))
from qualutil import head_operands, logit_bound  # noqa: E402

IDS = torch.tensor([[1, 5, 17, 42, 99, 3, 250, 7]])


def _reference_logits(src, out):
    """The source model with its quantized tables replaced by their dequantized values."""
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ov = embedq.load_overlay(out)
    aliases = ov.config.get("aliases") or {}
    for module in list(ov.config["modules"]) + list(aliases):
        table = ov.table_for(module).dequantize(torch.float32)
        sub = model.get_submodule(module)
        sub.weight = torch.nn.Parameter(table.clone())
    with torch.no_grad():
        return model(IDS).logits


def _plain_transformers_logits(out):
    """Build the model from the derived folder with plain transformers: every tensor from
    the folder's shards (through its index) plus the dequantized overlay tables."""
    import transformers as tf
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config")
    config = tf.AutoConfig.for_model(**cfg)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    state = {}
    for f in sorted(set(index["weight_map"].values())):
        state.update(load_file(out / f))
    assert set(index["weight_map"]) == set(state)
    ov = embedq.load_overlay(out)
    state = {k: v.float() for k, v in state.items() if not k.startswith(tuple(ov.config["modules"]))}
    for module in list(ov.config["modules"]) + list(ov.config.get("aliases") or {}):
        state[module + ".weight"] = ov.table_for(module).dequantize(torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    assert not [k for k in missing if "rotary" not in k], missing
    with torch.no_grad():
        return model(IDS).logits


CASES = [("qwen2_tied", dict(bits=8)), ("llama_untied_sharded", dict(bits=4, lm_head=True, head_bits=8)),
         ("gemma3_tied", dict(bits=8, group_size=32))]


@pytest.mark.parametrize("kind,kw", CASES)
def test_derived_folder_is_complete(derive, kind, kw):
    src, out, _ = derive(kind, **kw)
    ref = _reference_logits(src, out)
    got = _plain_transformers_logits(out)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,kw", CASES)
def test_derived_folder_loads_with_embedq_load(derive, kind, kw):
    from embedq.backends.transformers import load
    src, out, _ = derive(kind, **kw)
    ref = _reference_logits(src, out)
    model = load(out, dtype=torch.float32)
    # float32 activations take a native kernel (another summation order than F.linear): the
    # derived float32 bound of tests/quality/qualutil.py, with this model's head input
    got, x, w = head_operands(model, IDS)
    d = (got - ref).abs()
    tol = logit_bound(x, w, got, ref)
    assert not (d > tol).any(), f"{int((d > tol).sum())} logits beyond the float32 bound, max diff {d.max():.3g}"
