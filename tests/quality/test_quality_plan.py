"""embedq plan: KV-cache numbers against hand computations."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import embedq
from embedq.cli import app
from embedq.capacity.plan import PlanError, kv_layout, parse_bytes
from qualutil import overlay_tensor_bytes

GiB = 1 << 30


def _checkpoint(path, config: dict, tensors: dict[str, tuple[int, ...]]):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: torch.zeros(s, dtype=torch.bfloat16) for k, s in tensors.items()},
              str(path / "model.safetensors"))
    return path


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 256,
         "intermediate_size": 512, "vocab_size": 1024, "max_position_embeddings": 131072,
         "tie_word_embeddings": True, "dtype": "bfloat16"}


def test_llama_style_plan_by_hand(tmp_path):
    ck = _checkpoint(tmp_path / "llama", LLAMA, {"model.embed_tokens.weight": (1024, 256),
                                                 "model.layers.0.mlp.down_proj.weight": (256, 2048)})
    r = embedq.capacity.plan(ck, "10GiB", kv_dtype="bf16", max_model_len=8192, reserve="1GiB")
    per_token = 2 * 8 * 128 * 2 * 32  # K and V x kv heads x head dim x bf16 x layers = 131072
    assert sum(r.per_token_bytes.values()) == per_token
    usable = int(10 * GiB * 0.9)
    w_float = 1024 * 256 * 2 + 256 * 2048 * 2
    overlay = 1024 * 256 + 1024 * 2 + 16  # int8 codes + one bf16 scale per row + weight_shape
    w_int8 = 256 * 2048 * 2 + overlay
    assert (r.before.weights, r.after.weights) == (w_float, w_int8)
    for cap, w in ((r.before, w_float), (r.after, w_int8)):
        budget = usable - w - GiB
        assert cap.budget == budget
        assert cap.per_seq == 8192 * per_token
        assert cap.concurrency == pytest.approx(budget / (8192 * per_token))
        assert cap.kv_tokens == budget * 8192 // (8192 * per_token)  # = budget // per_token
        # longest request whose 16-token blocks fit: capped by max_position_embeddings
        assert cap.max_context == min(budget // per_token // 16 * 16, 131072)
    assert r.extra_tokens == r.after.kv_tokens - r.before.kv_tokens == \
        (usable - w_int8 - GiB) // per_token - (usable - w_float - GiB) // per_token
    assert r.scheme == "int8 row sym" and r.overlay_source.startswith("estimate")
    # fp8 KV halves the per-token bytes
    r8 = embedq.capacity.plan(ck, "10GiB", kv_dtype="fp8", max_model_len=8192, reserve="1GiB")
    assert r8.before.kv_tokens == (usable - w_float - GiB) // (per_token // 2)


def test_sliding_window_plan_by_hand(tmp_path):
    cfg = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6,
           "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "sliding_window": 512,
           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 640,
           "intermediate_size": 2048, "vocab_size": 4096, "max_position_embeddings": 32768,
           "tie_word_embeddings": True, "dtype": "bfloat16"}
    ck = _checkpoint(tmp_path / "gemma", cfg, {"model.embed_tokens.weight": (4096, 640)})
    r = embedq.capacity.plan(ck, "4GiB", kv_dtype="bf16", max_model_len=32768, reserve="1GiB",
                    max_num_batched_tokens=8192)
    lay = r.layout
    assert (lay["full_layers"], lay["sliding_layers"], lay["sliding_window"]) == (1, 5, 512)
    per_layer = 2 * 1 * 256 * 2  # 1024 bytes per token and layer
    # a sliding layer holds at most window - 1 + one in-flight chunk (8192) tokens, in 16-token blocks
    swa_tokens = -(-(512 - 1 + 8192) // 16) * 16  # 8704
    per_seq = 32768 * per_layer * 1 + swa_tokens * per_layer * 5
    assert r.before.per_seq == per_seq == 78118912
    budget = int(4 * GiB * 0.9) - 4096 * 640 * 2 - GiB
    assert r.before.budget == budget
    assert r.before.kv_tokens == int(budget / per_seq * 32768)
    # short requests: every layer holds every token
    r2 = embedq.capacity.plan(ck, "4GiB", kv_dtype="bf16", max_model_len=4096, reserve="1GiB")
    assert r2.before.per_seq == 4096 * per_layer * 6
    # max context that starts: all of max_position_embeddings fits on 4 GiB
    assert r.before.max_context == 32768
    tiny = embedq.capacity.plan(ck, "1.19GiB", kv_dtype="bf16", max_model_len=32768, reserve="1GiB")
    b = tiny.before.budget
    # solve 1024 * ceil16(T) + 5 * 1024 * 8704 <= b for T beyond the sliding cap
    expect = (b - 5 * per_layer * swa_tokens) // per_layer // 16 * 16
    assert swa_tokens < expect < 32768
    assert tiny.before.max_context == expect and not tiny.before.starts


@pytest.mark.parametrize("cfg,expect", [
    # Mistral-style: one window for every layer
    ({"model_type": "mistral", "sliding_window": 4096}, (0, 4, 4096)),
    # Qwen2 with the window switched off
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}, (4, 0, None)),
    # old Gemma 3 configs: every 6th layer global
    ({"model_type": "llama", "sliding_window": 512, "sliding_window_pattern": 2}, (2, 2, 512)),
    # no window at all
    ({"model_type": "llama"}, (4, 0, None)),
])
def test_layer_kinds_from_config(cfg, expect):
    base = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
            "vocab_size": 1000, "max_position_embeddings": 8192}
    lay = kv_layout({**base, **cfg})
    assert (lay.full_layers, lay.sliding_layers, lay.sliding_window) == expect
    assert lay.token_elems() == 2 * 2 * 64


def test_linear_attention_and_mla_layouts():
    qwen_next = {"model_type": "qwen3_next", "num_hidden_layers": 4, "num_attention_heads": 16,
                 "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 2048, "vocab_size": 1000,
                 "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                 "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                 "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "max_position_embeddings": 4096}
    lay = kv_layout(qwen_next, state_bytes=2)
    assert (lay.full_layers, lay.linear_layers) == (1, 3)
    conv = (4 - 1) * (2 * 16 * 128 + 32 * 128)
    rec = 32 * 128 * 128
    assert lay.linear_state_bytes == 3 * (conv + rec) * 2
    assert lay.per_seq_bytes(100, 2, 8192) == 112 * 2 * 2 * 256 * 2 + lay.linear_state_bytes
    mla = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "num_attention_heads": 16,
           "hidden_size": 1024, "vocab_size": 1000, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "max_position_embeddings": 4096}
    assert kv_layout(mla).token_elems() == 576


def test_plan_uses_the_overlay_on_disk(model_factory):
    src = model_factory("qwen2_tied")
    before = embedq.capacity.plan(src, "1GiB", reserve="0.25GiB", max_model_len=1024)
    embedq.quantize(src, bits=4, progress=False)
    r = embedq.capacity.plan(src, "1GiB", reserve="0.25GiB", max_model_len=1024)
    table = 512 * 64 * 2
    assert r.before.weights == before.before.weights
    assert r.before.weights - r.after.weights == table - overlay_tensor_bytes(src)
    assert r.overlay_source == "overlay on disk" and r.scheme == "int4 g32 sym"
    assert r.after.kv_tokens > r.before.kv_tokens


def test_parse_bytes():
    assert parse_bytes("32GiB") == 32 * GiB == parse_bytes("32G") == parse_bytes("32")
    assert parse_bytes("24GB") == 24 * 10 ** 9
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("1.5GiB") == 3 * GiB // 2
    with pytest.raises(PlanError, match="'lots'"):
        parse_bytes("lots")


def test_cli_plan_json_matches_api(model_factory):
    src = model_factory("gemma3_tied")
    embedq.quantize(src, bits=8, progress=False)
    res = CliRunner().invoke(app, ["plan", str(src), "--gpu-mem", "2GiB", "--kv-dtype", "fp8",
                                   "--max-model-len", "4096", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    api = embedq.capacity.plan(src, "2GiB", kv_dtype="fp8", max_model_len=4096)
    assert d["before"]["kv_tokens"] == api.before.kv_tokens
    assert d["after"]["kv_tokens"] == api.after.kv_tokens
    assert d["extra_kv_tokens"] == api.extra_tokens and d["kv_bytes"] == 1
    res = CliRunner().invoke(app, ["plan", str(src), "--gpu-mem", "2GiB"])
    assert res.exit_code == 0 and "KV tokens" in res.output and "max context that starts" in res.output
    res = CliRunner().invoke(app, ["plan", str(src), "--kv-dtype", "int3"])
    assert res.exit_code == 2 and "--kv-dtype int3" in res.output
