"""docs/security.md row 2 in vLLM: an in-place overlay's ``embedq.safetensors`` sits in the
model folder, and vLLM's own loader reads every tensor of it (the file is globbed with the
shards, or listed in the index), so a tensor the config does not declare would be handed to
the model's weight loader. The plugin holds the file to the config (``format.reader.check_overlay_header``)
when vLLM hands it the model folder, before any model is built or weight read, and refuses
with the one error the other readers give. (The untouched overlay loads: test_vllm_models.py.)"""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from _harness import engine_config, load_model

import _ev as ev

ev.register()


def _plant(src, dst, name: str, shape: tuple[int, ...]) -> None:
    """A copy of the in-place overlay ``src`` at ``dst`` whose embedq.safetensors also holds
    ``name`` (a float tensor), the declared tensors and the metadata kept as they were."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    shutil.copytree(src, dst)
    f = dst / "embedq.safetensors"
    with safe_open(str(f), "pt") as r:
        tensors = {k: r.get_tensor(k) for k in r.keys()}
        meta = r.metadata()
    assert name not in tensors
    tensors[name] = torch.ones(shape, dtype=torch.bfloat16)  # the shape the model's weight has
    save_file(tensors, str(f), metadata=meta)


@pytest.mark.parametrize("kind,planted,shape", [
    ("llama", "lm_head.weight", (1000, 64)),  # untied, float head in a shard: vLLM takes either
    ("qwen2", "model.layers.0.mlp.down_proj.weight", (64, 128)),  # one file, no index: globbed
])
def test_undeclared_tensor_in_overlay_is_refused(builder, tmp_path, kind, planted, shape):
    from embedq.errors import OverlayError
    d = tmp_path / "m"
    _plant(builder.quantized(kind, "q8", bits=8), d, planted, shape)
    want = re.escape(f"{d / 'embedq.safetensors'}: holds tensor '{planted}', which the config "
                     "does not declare")
    # refused while vLLM builds its engine config: no model built, no weight read
    with pytest.raises(OverlayError, match=want):
        engine_config(d)
    with pytest.raises(OverlayError, match=want):
        load_model(d)
