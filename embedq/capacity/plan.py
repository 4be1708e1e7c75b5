"""``embedq plan``: what an overlay buys in KV cache on one GPU, by vLLM 0.33.0's rules.

The KV-cache side follows vLLM 0.33.0's own code (``vllm/v1/kv_cache_interface.py``,
``vllm/v1/core/kv_cache_planning.py``, ``vllm/v1/core/kv_cache_utils.py``,
``vllm/platforms/interface.py:_align_hybrid_block_size``,
``vllm/model_executor/layers/mamba/mamba_utils.py``), step by step:

1. one spec per layer: full attention, sliding window, chunked local, MLA, or a
   gated-delta-net (linear attention) state; page = block_size tokens of one layer
   (a state page holds one request's conv + recurrent state);
2. hybrid models: the attention block size is raised to
   ``a·⌈state page / (a·one-token page)⌉`` (``a`` = kernel alignment, 16) and state
   pages are padded to the attention page;
3. layers are grouped (one group per attention kind, a kind with n× more layers split
   into n groups of the smallest kind's size, or of the largest kind's where the kinds
   are within 1.5×); one block = the widest group's pages;
4. ``num_blocks = available // bytes_per_block``; a max_model_len request takes
   ⌈per-request bytes / page⌉ blocks in every group; ``concurrency = num_blocks /
   blocks per request``; KV tokens = ``int(concurrency · max_model_len)``
   (vLLM's "GPU KV cache size: N tokens");
5. a max_model_len starts when its blocks fit in ``available`` less the null block;
   the longest that starts is found by vLLM's binary search (block-granular).

``available`` is ``gpu_mem · gpu_memory_utilization − weights − reserve``; ``reserve``
stands for what vLLM's profiling run finds besides weights (non-torch allowance,
activation peak of one ``max_num_batched_tokens`` step, sampler logits:
:func:`estimate_reserve`). CUDA-graph memory is not in the estimate, although vLLM 0.33.0
on CUDA profiles it and subtracts it by default (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1``;
not with ``--enforce-eager``): where it is known, pass a ``reserve=`` that includes it (a
given reserve replaces the whole estimate). The *difference* the overlay makes does not
depend on the reserve. Weights are the checkpoint's tensor bytes on one GPU (no tensor
parallelism; a tied head counted once).

The parts, each in its own module: :mod:`~embedq.capacity.layout` (what config.json says,
step 1's inputs), :mod:`~embedq.capacity.vllm_rules` (vLLM's allocator rules, steps 1-5),
:mod:`~embedq.capacity.weights` (the model's source, local or Hub, and its weight bytes),
:mod:`~embedq.capacity.report` (the result and its table). This module puts them together.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict

from embedq.capacity.layout import (MODEL_DTYPE_BYTES, VLLM_VERSION, GiB, KVLayout, PlanError,
                                    gdn_state_bytes, kv_layout)
from embedq.capacity.report import Capacity, PlanResult
from embedq.capacity.vllm_rules import (DEFAULT_BATCHED_TOKENS, DEFAULT_BLOCK, KERNEL_ALIGN, KV_BYTES, KVPlan,
                                        Spec, VLLMConfig, kv_plan)
from embedq.capacity.weights import given_weights, source, weight_bytes

DEFAULT_UTILIZATION = 0.9
DEFAULT_MAX_SEQS = 256
DEFAULT_NON_TORCH = GiB // 2


def parse_bytes(s: str | int | float) -> int:
    """``32GiB`` / ``32G`` / ``32`` (GiB) / ``34.4GB`` (10^9) / ``512MiB`` -> bytes."""
    if isinstance(s, (int, float)):
        return int(s)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", str(s), re.IGNORECASE)
    if not m:
        raise PlanError(f"cannot read {s!r} as a memory size (e.g. 32GiB, 24GB, 80G)")
    num, unit, suffix = float(m.group(1)), m.group(2).upper(), m.group(3)
    if not unit:
        unit, suffix = ("G", "iB") if not suffix else ("", suffix)
    power = "KMGT".index(unit) + 1 if unit else 0
    decimal = suffix.upper() == "B" and "i" not in suffix
    return int(num * (1000 if decimal else 1024) ** power)


def estimate_reserve(layout: KVLayout, batched_tokens: int, max_seqs: int, act_bytes: int = 2,
                     non_torch: int = DEFAULT_NON_TORCH) -> dict:
    """The non-weight, non-KV memory vLLM's profiling finds (see module docstring).

    Peak activations of a ``batched_tokens`` step ≈ tokens x (6·hidden + 2·intermediate
    + (heads + 2·kv_heads)·head_dim) activation bytes; sampler float32 logits for
    ``min(max_seqs, batched_tokens)`` rows, 2 copies; a non-torch allowance.
    """
    per_tok = 6 * layout.hidden_size + 2 * layout.intermediate_size + \
        (layout.heads + 2 * layout.kv_heads) * layout.head_dim
    act = batched_tokens * per_tok * act_bytes
    sampler = min(max_seqs, batched_tokens) * layout.vocab_size * 4 * 2
    return {"non_torch": non_torch, "activations": act, "sampler_logits": sampler,
            "total": non_torch + act + sampler}


def _capacity(label: str, weights: int, usable: int, reserve: int, kp: KVPlan, max_len: int,
              limit: int) -> Capacity:
    budget = usable - weights - reserve
    blocks = kp.num_blocks(budget)
    per_req = kp.blocks_per_request(max_len)
    conc = blocks / per_req  # get_max_concurrency_for_kv_cache_config
    return Capacity(label, weights, budget, per_req * kp.bytes_per_block, conc, int(conc * max_len),
                    kp.longest(budget, limit), kp.fits(max_len, budget), blocks, per_req)


def plan(path: str | os.PathLike, gpu_mem: str | int = "32GiB", *, kv_dtype: str = "auto",
         max_model_len: int | None = None, gpu_memory_utilization: float = DEFAULT_UTILIZATION,
         reserve: str | int | None = None, max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS,
         max_num_seqs: int = DEFAULT_MAX_SEQS, bits: int | None = None, group_size: int | None = None,
         symmetric: bool | None = None, weights_gib: float | str | None = None, revision: str | None = None,
         block_size: int | None = None, prefix_caching: bool = True, async_scheduling: bool = True,
         gdn_checkpoints: bool = False, mamba_ssm_cache_dtype: str = "auto") -> PlanResult:
    """KV-cache capacity of ``path`` on one GPU with float tables and with the overlay.

    ``path``: a checkpoint folder, a folder with only ``config.json`` (then
    ``weights_gib``, the float weights in GiB, is required), or a Hub ``org/model`` id
    (config.json and safetensors headers only). ``kv_dtype``: ``fp8``, ``bf16``/``fp16``
    or ``auto`` (the model's dtype). ``max_model_len`` defaults to
    ``max_position_embeddings``. ``reserve`` overrides the activation / non-torch
    estimate. ``bits`` / ``group_size`` / ``symmetric`` describe the overlay to estimate
    when there is none yet (not given: ``embedq quantize``'s defaults). ``block_size``, ``prefix_caching``, ``async_scheduling``,
    ``mamba_ssm_cache_dtype`` mirror vLLM's flags; ``gdn_checkpoints``: the FlashInfer
    gated-delta-net prefill (Hopper/Blackwell) that keeps one more state page per request
    with prefix caching.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise PlanError(f"--gpu-memory-utilization {gpu_memory_utilization}: expected a fraction in (0, 1]")
    if max_num_batched_tokens < 1 or max_num_seqs < 1:
        raise PlanError("--max-num-batched-tokens and --max-num-seqs must be positive")
    if block_size is not None and (block_size < 1 or block_size % KERNEL_ALIGN):
        raise PlanError(f"--block-size {block_size}: expected a multiple of {KERNEL_ALIGN}")
    # Checked here, not left to the arithmetic: 0 would read as "not given" below, and a
    # negative length as a config without max_position_embeddings.
    if max_model_len is not None and max_model_len < 1:
        raise PlanError(f"--max-model-len {max_model_len}: expected a positive number of tokens")
    mem = parse_bytes(gpu_mem)
    if mem <= 0:
        raise PlanError(f"--gpu-mem {gpu_mem}: expected a positive size (e.g. 32GiB)")
    given = None
    if weights_gib is not None:
        # a bare number is GiB, as the option's name says
        given = int(weights_gib * GiB) if isinstance(weights_gib, (int, float)) else parse_bytes(weights_gib)
        if given <= 0:
            raise PlanError(f"--weights-gib {weights_gib}: expected a positive size")
    src = source(path, revision, need_weights=given is None)
    layout = kv_layout(src.config, where=src.config_where, mamba_ssm_cache_dtype=mamba_ssm_cache_dtype)
    kvd = layout.model_dtype if kv_dtype == "auto" else kv_dtype
    if kvd not in KV_BYTES:
        raise PlanError(f"--kv-dtype {kv_dtype}: expected fp8, bf16, fp16 or auto")
    kvb = KV_BYTES[kvd]
    max_len = int(max_model_len if max_model_len is not None else layout.max_position_embeddings or 0)
    if max_len <= 0:
        raise PlanError(f"{src.config_where}: no max_position_embeddings; pass --max-model-len")
    if given is not None:
        w = given_weights(given, layout, src.config_where, bits, group_size, symmetric)
    elif src.weights is None:
        raise PlanError(f"{src.label}: no *.safetensors weights found; pass --weights-gib "
                        "(the model's float weights) to plan from config.json alone")
    else:
        w = src.weights(bits, group_size, symmetric)
    act_bytes = MODEL_DTYPE_BYTES[layout.model_dtype]
    parts = estimate_reserve(layout, max_num_batched_tokens, max_num_seqs, act_bytes)
    if reserve is not None:
        parts = {"given": parse_bytes(reserve), "total": parse_bytes(reserve)}
    vc = VLLMConfig(kvb, block_size or DEFAULT_BLOCK, block_size is not None, max_num_batched_tokens,
                    async_scheduling, prefix_caching, gdn_checkpoints)
    kp = kv_plan(layout, vc, max_len)
    usable = int(mem * gpu_memory_utilization)
    limit = max(layout.max_position_embeddings or max_len, max_len)
    tables = layout.model_dtype.replace("bfloat16", "BF16").replace("float16", "F16")
    before = _capacity(f"{tables} (float)", w["float"], usable, parts["total"], kp, max_len, limit)
    after = _capacity(w["scheme"], w["quantized"], usable, parts["total"], kp, max_len, limit)
    notes = list(layout.notes)
    if layout.max_position_embeddings and max_len > layout.max_position_embeddings:
        notes.append(f"--max-model-len {max_len} exceeds max_position_embeddings "
                     f"{layout.max_position_embeddings}: vLLM refuses it unless told to override")
    if not before.starts:
        notes.append(f"with float tables a {max_len}-token request does not fit: vLLM would refuse "
                     f"--max-model-len {max_len}" + (f" (it accepts up to {before.max_context:,})"
                                                    if before.max_context else ""))
    if layout.mla_dims and block_size is None:
        notes.append("MLA: FlashMLA / FlashInfer-MLA backends use 64-token blocks; pass --block-size 64 "
                     "to plan for them")
    lay = asdict(layout)
    for k in ("notes", "kinds"):
        lay.pop(k)
    vllm = {"version": VLLM_VERSION, **kp.to_dict(), "mamba_cache_mode": vc.mamba_cache_mode
            if layout.linear_layers else None, "prefix_caching": prefix_caching,
            "async_scheduling": async_scheduling, "config_fields": layout.fields,
            "check": "fits when bytes_per_block x blocks_per_request <= KV budget - bytes_per_block "
                     "(the null block)"}
    ptb = layout.per_token_bytes(kvb)
    if layout.linear_layers:
        ptb["linear_state_per_request"] = layout.linear_layers * kp.state_page
    return PlanResult(src.label, mem, gpu_memory_utilization, kvd, kvb, max_len, parts["total"], parts,
                      max_num_batched_tokens, ptb, lay, w["scheme"], w["overlay_source"], before, after,
                      vllm, notes)


__all__ = ["plan", "PlanResult", "Capacity", "KVLayout", "KVPlan", "Spec", "VLLMConfig", "kv_layout",
           "kv_plan", "gdn_state_bytes", "weight_bytes", "parse_bytes", "estimate_reserve", "PlanError",
           "VLLM_VERSION"]
