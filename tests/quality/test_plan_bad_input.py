"""``embedq plan`` with non-positive sizes: ``--max-model-len -1`` / ``0`` and ``--gpu-mem 0``
(API ``gpu_mem=-5``) are refused with one line naming the option, never planned with nor
mistaken for "not given" / "no max_position_embeddings"."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import embedq
from embedq.capacity.plan import PlanError
from embedq.cli import app

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256,
         "intermediate_size": 512, "vocab_size": 1024, "max_position_embeddings": 4096,
         "tie_word_embeddings": True, "dtype": "bfloat16"}


@pytest.fixture
def cfg(tmp_path):
    folder = tmp_path / "cfg"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    return folder


@pytest.mark.parametrize("args,words", [
    (["--max-model-len", "-1"], "--max-model-len -1: expected a positive"),
    (["--max-model-len", "0"], "--max-model-len 0: expected a positive"),
    (["--gpu-mem", "0"], "--gpu-mem 0: expected a positive size"),
    (["--gpu-mem", "0GiB"], "--gpu-mem 0GiB: expected a positive size"),
])
def test_cli_refuses_non_positive(cfg, args, words):
    res = CliRunner().invoke(app, ["plan", str(cfg), "--weights-gib", "1", *args])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("embedq: error: ") and words in lines[0], res.output


@pytest.mark.parametrize("kw,words", [
    ({"gpu_mem": -5}, "--gpu-mem -5"), ({"gpu_mem": 0}, "--gpu-mem 0"),
    ({"max_model_len": 0}, "--max-model-len 0"), ({"max_model_len": -1}, "--max-model-len -1"),
])
def test_api_refuses_non_positive(cfg, kw, words):
    with pytest.raises(PlanError, match="expected a positive") as e:
        embedq.plan(cfg, **{"gpu_mem": "10GiB", "weights_gib": 1, **kw})
    assert words in str(e.value)


def test_positive_values_still_plan(cfg):
    r = embedq.plan(cfg, "10GiB", weights_gib=1, max_model_len=1)
    assert r.max_model_len == 1
