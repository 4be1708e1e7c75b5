"""``embedq plan``'s KV-cache numbers against vLLM 0.33.0's own functions.

For hand-written configs of each attention kind, vLLM's spec classes, its grouping
(``get_kv_cache_groups``), block count (``get_kv_cache_config_from_groups``), capacity
(``get_kv_cache_capacity``: tokens, concurrency), max-model-len search
(``_estimate_max_model_len_from_groups``) and, for hybrids, its block-size raise
(``Platform._align_hybrid_block_size`` with the real Qwen3.5 model class) are run on
the same config and memory budget as :func:`embedq.capacity.plan.kv_plan`; the numbers must be
equal. vLLM's engine config is stubbed with the few fields these functions read.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from embedq.capacity.plan import VLLM_VERSION, VLLMConfig, kv_layout, kv_plan

GiB = 1 << 30
BATCHED = 8192


def _vllm_config(max_len: int, *, mode: str = "none", hma: bool = True, cache_dtype: str = "auto",
                 model=None):
    from vllm.v1.kv_cache_layout import KVCacheLayout
    return NS(model_config=model or NS(max_model_len=max_len, supports_kv_cache_grouping=False),
              parallel_config=NS(decode_context_parallel_size=1, tensor_parallel_size=1),
              max_in_flight_tokens=2 * BATCHED,  # async scheduling: two batches in flight
              cache_config=NS(mamba_cache_mode=mode, cache_dtype=cache_dtype, block_size=16,
                              mamba_page_size_padded=None, mamba_block_size=None, mamba_cache_dtype="auto",
                              mamba_ssm_cache_dtype="auto", kv_cache_dtype_skip_layers=None,
                              get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC,
                              num_gpu_blocks_override=None, prefix_cache_retention_interval=None),
              scheduler_config=NS(disable_hybrid_kv_cache_manager=not hma),
              attention_config=NS(hisparse_config=None), speculative_config=None,
              # no GDN layer built: no prefill-checkpoint alignment (Triton/FLA prefill)
              compilation_config=NS(static_forward_context={}))


def _vllm_numbers(vc, specs: dict, available: int) -> dict:
    """Groups, block count, capacity and longest max_model_len by vLLM's functions."""
    from vllm.v1.core import kv_cache_planning as P
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
    builder = P.DefaultKVCacheConfigBuilder()
    groups = P.get_kv_cache_groups(vc, dict(specs))
    per_block = P._pool_bytes_per_block_from_builder(builder, vc, groups)
    kc = P.get_kv_cache_config_from_groups(vc, groups, available)
    tokens, conc = get_kv_cache_capacity(vc, kc)
    # get_kv_cache_configs checks and searches against memory less the null block
    longest = P._estimate_max_model_len_from_groups(builder, vc, groups, available - per_block)
    return {"groups": sorted(len(g.layer_names) for g in groups), "bytes_per_block": per_block,
            "page": {g.kv_cache_spec.page_size_bytes for g in groups},
            "block_size": min(g.kv_cache_spec.block_size for g in groups),
            "num_blocks": kc.num_blocks, "tokens": tokens, "concurrency": conc,
            "usage": P._max_memory_usage_bytes_from_groups(builder, vc, groups), "longest": longest}


def _embedq_numbers(config: dict, kv_bytes: int, max_len: int, available: int, **kw) -> dict:
    kp = kv_plan(kv_layout(config), VLLMConfig(kv_bytes=kv_bytes, **kw), max_len)
    nb = kp.num_blocks(available)
    per_req = kp.blocks_per_request(max_len)
    return {"groups": sorted(g.layers for g in kp.groups), "bytes_per_block": kp.bytes_per_block,
            "page": {g.spec.page * g.layers for g in kp.groups}, "block_size": kp.block_size,
            "num_blocks": nb, "tokens": int(nb / per_req * max_len), "concurrency": nb / per_req,
            "usage": kp.usage(max_len), "longest": kp.longest(available, max_len)}


def _compare(ours: dict, theirs: dict) -> None:
    theirs = dict(theirs)
    # vLLM's group page is the sum over a group's layers only for multi-spec groups;
    # the bytes per block (widest group) is what both must agree on
    theirs.pop("page"), ours.pop("page")
    assert ours == theirs


BASE = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "hidden_size": 1024,
        "vocab_size": 1000, "max_position_embeddings": 131072, "dtype": "bfloat16"}


def test_version_is_the_installed_vllm():
    import vllm
    assert vllm.__version__.startswith(VLLM_VERSION)


@pytest.mark.parametrize("available", [3 * GiB, 5 * GiB // 7, 9 << 20])
@pytest.mark.parametrize("kv,dtype", [(2, torch.bfloat16), (1, torch.float8_e4m3fn)])
def test_full_attention(available, kv, dtype):
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    cfg = {**BASE, "num_hidden_layers": 12}
    specs = {f"l{i}": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=dtype)
             for i in range(12)}
    _compare(_embedq_numbers(cfg, kv, 32768, available), _vllm_numbers(_vllm_config(32768), specs, available))


@pytest.mark.parametrize("available", [2 * GiB, 300 << 20, 70 << 20])
@pytest.mark.parametrize("max_len", [32768, 4096])
def test_sliding_window_hybrid(available, max_len):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    # Gemma 3 pattern: 5 sliding : 1 full, 17 sliding + 4 full (padding layers in the sliding groups)
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 3 + ["sliding_attention"] * 2 + \
        ["full_attention"]
    cfg = {**BASE, "num_hidden_layers": len(types), "layer_types": types, "sliding_window": 1024}
    kw = dict(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    specs = {f"l{i}": SlidingWindowSpec(sliding_window=1024, **kw) if t.startswith("sliding")
             else FullAttentionSpec(**kw) for i, t in enumerate(types)}
    _compare(_embedq_numbers(cfg, 2, max_len, available),
             _vllm_numbers(_vllm_config(max_len), specs, available))


def test_sliding_window_only():
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    cfg = {**BASE, "num_hidden_layers": 8, "model_type": "mistral", "sliding_window": 4096}
    specs = {f"l{i}": SlidingWindowSpec(sliding_window=4096, block_size=16, num_kv_heads=2, head_size=128,
                                        dtype=torch.bfloat16) for i in range(8)}
    for available in (GiB, 40 << 20):
        _compare(_embedq_numbers(cfg, 2, 65536, available),
                 _vllm_numbers(_vllm_config(65536), specs, available))


@pytest.mark.parametrize("all_chunked", [False, True])
def test_chunked_local_attention(all_chunked):
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec
    rope = [1, 1, 1, 1] if all_chunked else [1, 1, 1, 0]
    cfg = {**BASE, "num_hidden_layers": 8, "attention_chunk_size": 8192, "no_rope_layers": rope * 2}
    kw = dict(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    specs = {f"l{i}": ChunkedLocalAttentionSpec(attention_chunk_size=8192, **kw) if r else FullAttentionSpec(**kw)
             for i, r in enumerate(rope * 2)}
    # attention_chunk_size switches the hybrid KV cache manager off (vLLM's default)
    vc = _vllm_config(131072, hma=False)
    for available in (4 * GiB, 300 << 20):
        _compare(_embedq_numbers(cfg, 2, 131072, available), _vllm_numbers(vc, specs, available))


@pytest.mark.parametrize("block", [16, 64])
def test_mla(block):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    cfg = {"num_hidden_layers": 6, "num_attention_heads": 16, "hidden_size": 2048, "vocab_size": 1000,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "max_position_embeddings": 163840, "dtype": "bfloat16"}
    specs = {f"l{i}": MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
             for i in range(6)}
    for available in (2 * GiB, 50 << 20):
        _compare(_embedq_numbers(cfg, 2, 163840, available, block_size=block),
                 _vllm_numbers(_vllm_config(163840), specs, available))


QWEN35_TEXT = {"model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
               "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
               "intermediate_size": 17408, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
               "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
               "full_attention_interval": 4, "vocab_size": 248320, "max_position_embeddings": 262144,
               "mamba_ssm_dtype": "float32", "dtype": "bfloat16"}
QWEN35 = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
          "text_config": QWEN35_TEXT}


class _Backend:
    """An attention backend as vLLM's CUDA ones declare themselves: 16-token kernel blocks."""

    @classmethod
    def get_supported_kernel_block_sizes(cls):
        from vllm.v1.attention.backend import MultipleOf
        return [MultipleOf(16)]

    @classmethod
    def customize_spec(cls, spec):
        return spec

    @classmethod
    def get_name(cls):
        return "STUB_FLASH_ATTN"


def _qwen35_vllm(max_len: int, cache_dtype: str, mode: str, monkeypatch):
    """vLLM's block-size raise and per-layer specs for QWEN35, from its Qwen3.5 model class."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    hf = NS(**QWEN35_TEXT)
    model = NS(model_impl="auto", runner_type="generate", convert_type="none", use_mla=False,
               dtype=torch.bfloat16, architecture="Qwen3_5ForConditionalGeneration", hf_text_config=hf,
               get_num_kv_heads=lambda pc: 4, get_head_size=lambda: 256, max_model_len=max_len,
               supports_kv_cache_grouping=False)
    vc = _vllm_config(max_len, mode=mode, cache_dtype=cache_dtype, model=model)
    # models/config.py Qwen3_5ForConditionalGenerationConfig: mamba_ssm_dtype from the config
    vc.cache_config.mamba_ssm_cache_dtype = hf.mamba_ssm_dtype
    vc.cache_config.mamba_block_size = vc.cache_config.block_size if mode == "align" else max_len
    monkeypatch.setattr(Platform, "_find_non_ssm_backends", classmethod(lambda cls, v: [_Backend]))
    Platform._align_hybrid_block_size(vc, _Backend)
    cc = vc.cache_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
    kv_dtype = torch.bfloat16 if cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
    specs = {}
    for i in range(64):
        if (i + 1) % 4:
            specs[f"l{i}"] = MambaSpec(shapes=model_cls.get_mamba_state_shape_from_config(vc),
                                       dtypes=model_cls.get_mamba_state_dtype_from_config(vc),
                                       block_size=cc.mamba_block_size, page_size_padded=cc.mamba_page_size_padded,
                                       mamba_cache_mode=mode)
        else:
            specs[f"l{i}"] = FullAttentionSpec(block_size=cc.block_size, num_kv_heads=4, head_size=256,
                                               dtype=kv_dtype)
    return vc, specs


@pytest.mark.parametrize("kv,cache_dtype,block", [(2, "auto", 784), (1, "fp8", 1568)])
@pytest.mark.parametrize("mode", ["none", "align"])
@pytest.mark.parametrize("max_len", [262144, 65536, 8192])
def test_qwen35_27b_hybrid(kv, cache_dtype, block, mode, max_len, monkeypatch):
    vc, specs = _qwen35_vllm(max_len, cache_dtype, mode, monkeypatch)
    assert vc.cache_config.block_size == block
    state = next(s for s in specs.values() if s.mamba_cache_mode == mode and hasattr(s, "shapes"))
    assert state.real_page_size_bytes == 3_207_168  # conv bf16 + recurrent float32
    for available in (30 * GiB, 8 * GiB, 900 << 20):
        ours = _embedq_numbers(QWEN35, kv, max_len, available, prefix_caching=mode == "align")
        theirs = _vllm_numbers(vc, specs, available)
        assert ours["block_size"] == block
        _compare(ours, theirs)


def test_plan_reports_vllm_numbers(tmp_path, monkeypatch):
    """``embedq plan --json``'s vllm section carries the numbers vLLM's functions compute."""
    import json

    import embedq
    folder = tmp_path / "q35"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN35))
    r = embedq.plan(folder, "32GiB", kv_dtype="fp8", max_model_len=65536, weights_gib="20GiB",
                    reserve="2GiB", prefix_caching=False)
    vc, specs = _qwen35_vllm(65536, "fp8", "none", monkeypatch)
    theirs = _vllm_numbers(vc, specs, r.before.budget)
    assert (r.vllm["block_size"], r.vllm["bytes_per_block"]) == (1568, theirs["bytes_per_block"])
    assert (r.before.num_blocks, r.before.kv_tokens) == (theirs["num_blocks"], theirs["tokens"])
    assert r.before.concurrency == theirs["concurrency"] and theirs["longest"] == 65536
    # "max context that starts" is vLLM's search up to max_position_embeddings
    vc, specs = _qwen35_vllm(262144, "fp8", "none", monkeypatch)
    assert r.before.max_context == _vllm_numbers(vc, specs, r.before.budget)["longest"] == 216384
