"""embedq plan: KV-cache numbers against hand computations."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import embedq
from embedq.cli import app
from embedq.capacity.plan import PlanError, VLLMConfig, kv_layout, kv_plan, parse_bytes
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
    r = embedq.plan(ck, "10GiB", kv_dtype="bf16", max_model_len=8192, reserve="1GiB")
    per_token = 2 * 8 * 128 * 2 * 32  # K and V x kv heads x head dim x bf16 x layers = 131072
    assert sum(r.per_token_bytes.values()) == per_token
    usable = int(10 * GiB * 0.9)
    w_float = 1024 * 256 * 2 + 256 * 2048 * 2
    overlay = 1024 * 256 + 1024 * 4 * 2 + 16  # int8 codes + a bf16 scale per 64 columns + weight_shape
    w_int8 = 256 * 2048 * 2 + overlay
    assert (r.before.weights, r.after.weights) == (w_float, w_int8)
    block = 16 * per_token  # one 16-token block in all 32 layers (one group)
    assert r.vllm["block_size"] == 16 and r.vllm["bytes_per_block"] == block
    for cap, w in ((r.before, w_float), (r.after, w_int8)):
        budget = usable - w - GiB
        assert cap.budget == budget
        assert cap.num_blocks == budget // block and cap.blocks_per_request == 8192 // 16
        assert cap.per_seq == 8192 * per_token
        assert cap.concurrency == cap.num_blocks / 512
        assert cap.kv_tokens == cap.num_blocks * 16  # int(concurrency x max_model_len)
        # longest request whose blocks fit next to the null block, capped by max_position_embeddings
        assert cap.max_context == min((cap.num_blocks - 1) * 16, 131072)
    assert r.extra_tokens == 16 * ((usable - w_int8 - GiB) // block - (usable - w_float - GiB) // block)
    assert r.scheme == "int8 g64 sym" and r.overlay_source.startswith("estimate")
    # fp8 KV halves the page
    r8 = embedq.plan(ck, "10GiB", kv_dtype="fp8", max_model_len=8192, reserve="1GiB")
    assert r8.before.kv_tokens == (usable - w_float - GiB) // (block // 2) * 16


def test_sliding_window_plan_by_hand(tmp_path):
    cfg = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6,
           "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "sliding_window": 512,
           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 640,
           "intermediate_size": 2048, "vocab_size": 4096, "max_position_embeddings": 32768,
           "tie_word_embeddings": True, "dtype": "bfloat16"}
    ck = _checkpoint(tmp_path / "gemma", cfg, {"model.embed_tokens.weight": (4096, 640)})
    r = embedq.plan(ck, "4GiB", kv_dtype="bf16", max_model_len=32768, reserve="1GiB",
                    max_num_batched_tokens=8192)
    lay = r.layout
    assert (lay["full_layers"], lay["sliding_layers"], lay["sliding_window"]) == (1, 5, 512)
    page = 16 * 2 * 1 * 256 * 2  # 16 tokens x 1024 bytes
    # 5 sliding + 1 full layer: groups of 1 layer (5 sliding groups, 1 full); a block is one page
    assert [g["kind"] for g in r.vllm["groups"]] == ["sliding"] * 5 + ["full"]
    assert r.vllm["bytes_per_block"] == page
    # a sliding layer holds window - 1 + 2 in-flight batches (async scheduling) of tokens,
    # + 1 block because the window need not start on a block boundary
    swa_blocks = -(-(512 - 1 + 2 * 8192) // 16) + 1  # 1057
    per_req = 32768 // 16 + 5 * swa_blocks
    assert r.before.blocks_per_request == per_req == 7333
    assert r.before.per_seq == per_req * page
    budget = int(4 * GiB * 0.9) - 4096 * 640 * 2 - GiB
    assert r.before.budget == budget and r.before.num_blocks == budget // page
    assert r.before.kv_tokens == int(budget // page / per_req * 32768)
    # short requests: the window never binds
    r2 = embedq.plan(ck, "4GiB", kv_dtype="bf16", max_model_len=4096, reserve="1GiB")
    assert r2.before.blocks_per_request == 256 + 5 * (256 + 1)
    assert r.before.max_context == 32768
    tiny = embedq.plan(ck, "1.223GiB", kv_dtype="bf16", max_model_len=32768, reserve="1GiB")
    nb = tiny.before.num_blocks
    assert nb - 1 < per_req  # 32768 does not start
    # below window - 1 + in-flight tokens every layer holds every token (+1 block per
    # sliding layer): 6·⌈T/16⌉ + 5 blocks must fit beside the null block
    expect = (nb - 1 - 5) // 6 * 16
    assert expect < 512 - 1 + 2 * 8192
    assert tiny.before.max_context == expect and not tiny.before.starts


# Qwen3.5-27B's text_config (the fields vLLM reads), layer kinds from full_attention_interval
QWEN35 = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
          "text_config": {"model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
                          "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                          "intermediate_size": 17408, "linear_num_key_heads": 16,
                          "linear_num_value_heads": 48, "linear_key_head_dim": 128,
                          "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                          "full_attention_interval": 4, "vocab_size": 248320,
                          "max_position_embeddings": 262144, "mamba_ssm_dtype": "float32",
                          "dtype": "bfloat16"}}
STATE = (2 * 16 * 128 + 48 * 128) * 3 * 2 + 48 * 128 * 128 * 4  # conv bf16 + recurrent fp32


@pytest.mark.parametrize("kv,block", [("bf16", 784), ("fp8", 1568)])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_qwen35_hybrid_by_hand(tmp_path, kv, block, prefix_caching):
    folder = tmp_path / "q35"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN35))
    r = embedq.plan(folder, "32GiB", kv_dtype=kv, max_model_len=65536, weights_gib="20GiB",
                    reserve="2GiB", prefix_caching=prefix_caching)
    lay, v = r.layout, r.vllm
    assert (lay["full_layers"], lay["linear_layers"]) == (16, 48)
    assert STATE == 3_207_168 and lay["linear_state_bytes"] == STATE  # 3.06 MiB per layer and request
    tok = 2 * 4 * 256 * KV[kv]  # one token in one full-attention layer
    # the block grows until one attention page covers one state page: 16·⌈state/(16·tok)⌉
    assert block == 16 * -(-STATE // (16 * tok))
    assert v["block_size"] == block and v["state_page_bytes"] == STATE
    assert v["state_page_padded_bytes"] == block * tok
    # 16 full + 48 linear layers: 4 groups of 16, one block = 16 pages
    assert [(g["kind"], g["layers"]) for g in v["groups"]] == [("mamba", 16)] * 3 + [("full", 16)]
    assert v["bytes_per_block"] == 16 * block * tok
    # each linear group holds 1 state page per request (2 with prefix caching's align mode)
    pages = 2 if prefix_caching else 1
    per_req = -(-65536 // block) + 3 * pages
    budget = int(32 * GiB * 0.9) - 20 * GiB - 2 * GiB
    assert r.before.blocks_per_request == per_req and r.before.budget == budget
    nb = budget // v["bytes_per_block"]
    assert r.before.num_blocks == nb and r.before.kv_tokens == int(nb / per_req * 65536)
    # longest max_model_len vLLM accepts: whole blocks left beside the state pages and the null block
    assert r.before.max_context == min((nb - 1 - 3 * pages) * block, 262144)
    assert v["version"] == "0.33.0" and v["mamba_cache_mode"] == ("align" if prefix_caching else "none")


KV = {"bf16": 2, "fp8": 1}


def test_qwen35_issue_numbers():
    """The per-request state of issue #17: 146.8 MiB, not 74.8 MiB at the activation dtype."""
    lay = kv_layout(QWEN35)
    assert lay.linear_layers * lay.linear_state_bytes / 2**20 == pytest.approx(146.8, abs=0.05)
    wrong = kv_layout(QWEN35, mamba_ssm_cache_dtype="bfloat16")
    assert wrong.linear_layers * wrong.linear_state_bytes / 2**20 == pytest.approx(74.8, abs=0.05)
    # layer_types spelled out gives the same layers as full_attention_interval
    t = dict(QWEN35["text_config"])
    t["layer_types"] = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(64)]
    assert kv_layout({**QWEN35, "text_config": t}).kinds == lay.kinds


@pytest.mark.parametrize("drop,field", [
    ("full_attention_interval", "layer_types / full_attention_interval"),
    ("linear_value_head_dim", "linear_value_head_dim"),
    ("num_hidden_layers", "num_hidden_layers"),
])
def test_missing_fields_are_refused(drop, field):
    t = {k: v for k, v in QWEN35["text_config"].items() if k != drop}
    with pytest.raises(PlanError, match=r"^config.json: text_config: no " + re.escape(field)):
        kv_layout({**QWEN35, "text_config": t})


@pytest.mark.parametrize("extra,match", [
    ({"layer_types": ["mamba"] * 4}, "layer_types: 'mamba' layers are not modelled"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries, num_hidden_layers is 4"),
    ({"hybrid_override_pattern": "M*M*"}, "hybrid_override_pattern: Mamba/SSM hybrid"),
    ({"layer_types": ["sliding_attention"] * 4}, "sliding-window layers but no sliding_window"),
    ({"dtype": "int8"}, "dtype 'int8'"),
    ({"layer_types": ["linear_attention"] * 4, "architectures": ["Qwen3NextForCausalLM"]},
     "no linear_num_key_heads"),
])
def test_unknown_configs_are_refused(extra, match):
    base = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
            "vocab_size": 1000, "max_position_embeddings": 8192}
    with pytest.raises(PlanError, match=r"^config.json: .*" + re.escape(match)):
        kv_layout({**base, **extra})


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


def test_mla_and_chunked_plans():
    mla = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "num_attention_heads": 16,
           "hidden_size": 1024, "vocab_size": 1000, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "max_position_embeddings": 4096}
    lay = kv_layout(mla)
    assert lay.token_elems() == 576
    kp = kv_plan(lay, VLLMConfig(kv_bytes=2), 4096)
    assert [(g.spec.kind, g.layers, g.spec.page) for g in kp.groups] == [("mla", 2, 16 * 576 * 2)]
    # Llama 4: chunked local attention switches vLLM's hybrid allocator off, so chunked
    # layers allocate every token like the full ones: one group of all layers
    l4 = {"model_type": "llama4_text", "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 512, "vocab_size": 1000,
          "attention_chunk_size": 8192, "no_rope_layers": [1, 1, 1, 0], "max_position_embeddings": 65536}
    lay = kv_layout(l4)
    assert (lay.chunked_layers, lay.full_layers) == (3, 1)
    kp = kv_plan(lay, VLLMConfig(kv_bytes=2), 65536)
    assert [(g.spec.kind, g.layers) for g in kp.groups] == [("full", 4)]
    assert kp.blocks_per_request(65536) == 4096
    # all layers chunked (no full layer): chunk + in-flight tokens per request
    only = kv_plan(kv_layout({**l4, "no_rope_layers": [1] * 4}), VLLMConfig(kv_bytes=2), 65536)
    assert only.groups[0].spec.kind == "chunked"
    assert only.blocks_per_request(65536) == -(-(8192 + 2 * 8192) // 16)


def test_config_only_folder_needs_weights_gib(tmp_path):
    folder = tmp_path / "cfg"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    with pytest.raises(PlanError, match="no \\*.safetensors weights found; pass --weights-gib"):
        embedq.plan(folder, "10GiB")
    r = embedq.plan(folder, "10GiB", weights_gib=2, kv_dtype="bf16", max_model_len=8192, reserve="1GiB")
    table = 1024 * 256 * 2
    assert r.before.weights == 2 * GiB
    assert r.after.weights == 2 * GiB - table + 1024 * 256 + 1024 * 4 * 2 + 16  # int8 g64
    assert r.overlay_source == "estimate from config.json and --weights-gib"
    res = CliRunner().invoke(app, ["plan", str(folder), "--weights-gib", "2", "--json"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["plan", str(folder)])
    assert res.exit_code == 2 and res.output.startswith(f"embedq: error: {folder}: no *.safetensors")


def test_cli_refuses_with_the_file_and_field(tmp_path):
    folder = tmp_path / "q"
    folder.mkdir()
    t = {k: v for k, v in QWEN35["text_config"].items() if k != "full_attention_interval"}
    (folder / "config.json").write_text(json.dumps({**QWEN35, "text_config": t}))
    res = CliRunner().invoke(app, ["plan", str(folder), "--weights-gib", "50"])
    assert res.exit_code == 2
    assert res.output == (f"embedq: error: {folder / 'config.json'}: text_config: no layer_types / "
                          "full_attention_interval (needed to tell qwen3_5_text's linear-attention "
                          "layers from full attention)\n")


def test_plan_uses_the_overlay_on_disk(model_factory):
    src = model_factory("qwen2_tied")
    before = embedq.plan(src, "1GiB", reserve="0.25GiB", max_model_len=1024)
    embedq.quantize(src, bits=4, progress=False)
    r = embedq.plan(src, "1GiB", reserve="0.25GiB", max_model_len=1024)
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
    d = json.loads(res.stdout)
    api = embedq.plan(src, "2GiB", kv_dtype="fp8", max_model_len=4096)
    assert d["before"]["kv_tokens"] == api.before.kv_tokens
    assert d["after"]["kv_tokens"] == api.after.kv_tokens
    assert d["extra_kv_tokens"] == api.extra_tokens and d["kv_bytes"] == 1
    assert d["vllm"]["version"] == "0.33.0" and d["vllm"]["block_size"] == 16
    assert d["before"]["num_blocks"] == api.before.num_blocks and d["vllm"]["rules"]
    res = CliRunner().invoke(app, ["plan", str(src), "--gpu-mem", "2GiB"])
    assert res.exit_code == 0 and "KV tokens" in res.output and "max context that starts" in res.output
    res = CliRunner().invoke(app, ["plan", str(src), "--kv-dtype", "int3"])
    assert res.exit_code == 2 and "--kv-dtype int3" in res.output
