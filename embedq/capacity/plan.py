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
   into n groups of the smallest kind's size); one block = the widest group's pages;
4. ``num_blocks = available // bytes_per_block``; a max_model_len request takes
   ⌈per-request bytes / page⌉ blocks in every group; ``concurrency = num_blocks /
   blocks per request``; KV tokens = ``int(concurrency · max_model_len)``
   (vLLM's "GPU KV cache size: N tokens");
5. a max_model_len starts when its blocks fit in ``available`` less the null block;
   the longest that starts is found by vLLM's binary search (block-granular).

``available`` is ``gpu_mem · gpu_memory_utilization − weights − reserve``; ``reserve``
stands for what vLLM's profiling run finds besides weights (non-torch allowance,
activation peak of one ``max_num_batched_tokens`` step, sampler logits; CUDA graphs not
counted). Override it with ``reserve=`` when known: the *difference* the overlay makes
does not depend on it. Weights are the checkpoint's tensor bytes on one GPU (no tensor
parallelism; a tied head counted once).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from embedq.errors import EmbedqError
from embedq.format.constants import QUANT_METHOD

VLLM_VERSION = "0.33.0"
GiB = 1 << 30
DEFAULT_BLOCK = 16  # vLLM CacheConfig.DEFAULT_BLOCK_SIZE
KERNEL_ALIGN = 16  # smallest kernel block of vLLM's CUDA attention backends (MultipleOf(16))
MLA_HYBRID_ALIGN = 128  # _align_hybrid_block_size: MLA + mamba blocks are multiples of 128
GDN_CHECKPOINT_ALIGN = 64  # vllm/v1/attention/backends/gdn_attn.py FLASHINFER_GDN_CHECKPOINT_ALIGNMENT
DEFAULT_UTILIZATION = 0.9
DEFAULT_BATCHED_TOKENS = 8192
DEFAULT_MAX_SEQS = 256
DEFAULT_NON_TORCH = GiB // 2
KV_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "bf16": 2, "bfloat16": 2, "fp16": 2,
            "float16": 2, "half": 2, "fp32": 4, "float32": 4, "float": 4}
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U32": 4, "U16": 2, "U64": 8}
FULL_TYPES = ("full_attention", "attention", "global_attention", "global")
SLIDING_TYPES = ("sliding_attention", "sliding_window", "local_attention", "local")
CHUNKED_TYPES = ("chunked_attention",)
LINEAR_TYPES = ("linear_attention",)  # gated delta net (Qwen3-Next, Qwen3.5)
# model_types whose layers are gated-delta-net / full attention hybrids
GDN_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# vLLM reads mamba_ssm_dtype from config.json only for these (models/config.py
# Qwen3_5ForConditionalGenerationConfig / Qwen3_5ForCausalLMConfig); others use the
# model dtype unless --mamba-ssm-cache-dtype says otherwise.
SSM_DTYPE_ARCHS = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                   "Qwen3_5MoeForConditionalGeneration")
# Fields of SSM hybrids (Mamba-1/2, Jamba, NemotronH, Granite 4, Falcon-H1...) whose
# state embedq plan does not model: refuse rather than count them as attention.
SSM_FIELDS = ("hybrid_override_pattern", "layers_block_type", "attn_layer_indices", "attn_layer_period",
              "mamba_d_state", "mamba_n_heads", "ssm_state_size", "ssm_cfg", "state_size", "block_types")


class PlanError(EmbedqError):
    """The model's config or the arguments do not allow a plan."""


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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------
# model shape from config.json


@dataclass
class KVLayout:
    """What config.json says about the KV cache: layer kinds, heads, state dims."""

    layers: int
    full_layers: int
    sliding_layers: int
    chunked_layers: int
    linear_layers: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None
    attention_chunk: int | None
    mla_dims: int | None  # elements per token per MLA layer (kv_lora_rank + qk_rope_head_dim)
    linear_state_bytes: int  # one request's state in one linear-attention layer (unpadded)
    max_position_embeddings: int | None
    hidden_size: int
    intermediate_size: int
    heads: int
    vocab_size: int
    model_dtype: str = "bfloat16"
    kinds: list[str] = field(default_factory=list, repr=False)  # per layer
    linear_dims: dict | None = None  # linear_* fields as read
    conv_dtype: str | None = None
    ssm_dtype: str | None = None
    fields: dict = field(default_factory=dict)  # every config field that was read -> value
    notes: list[str] = field(default_factory=list)

    def token_elems(self) -> int:
        """KV elements one token costs in one attention layer."""
        return self.mla_dims if self.mla_dims else 2 * self.kv_heads * self.head_dim

    def per_token_bytes(self, kv_bytes: int) -> dict[str, int]:
        """Bytes one token costs in all layers of each attention kind (unpadded)."""
        e = self.token_elems() * kv_bytes
        return {"full": self.full_layers * e, "sliding": self.sliding_layers * e,
                "chunked": self.chunked_layers * e}


_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4, "half": 2, "float": 4, "bf16": 2, "fp16": 2,
           "fp32": 4}


def _dtype_name(value, where: str, what: str) -> str:
    name = str(value).replace("torch.", "")
    canon = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
             "fp32": "float32"}.get(name, name)
    if canon not in ("bfloat16", "float16", "float32"):
        raise PlanError(f"{where}: {what} {value!r}: expected bfloat16, float16 or float32")
    return canon


def _text_config(config: dict) -> tuple[dict, str]:
    """The decoder's config (``text_config`` of multimodal models) and its name in messages."""
    for key in ("text_config", "llm_config", "language_config"):
        if isinstance(config.get(key), dict):
            return config[key], f"config.json: {key}"
    return config, "config.json"


def kv_layout(config: dict, *, where: str = "config.json",
              mamba_ssm_cache_dtype: str = "auto", mamba_cache_dtype: str = "auto") -> KVLayout:
    """Read every field that changes vLLM's KV cache; refuse what is missing or unknown.

    No defaults are invented: a field vLLM's model class needs and config.json lacks is
    a :class:`PlanError` naming the file and the field.
    """
    t, tw = _text_config(config)
    tw = tw.replace("config.json", where, 1)
    read: dict = {}

    def get(key):
        v = t.get(key)
        if v is not None:
            read[key] = v
        return v

    def need(*keys):
        for k in keys:
            if t.get(k) is not None:
                read[k] = t[k]
                return t[k]
        raise PlanError(f"{tw}: no {' / '.join(keys)} (needed for the KV-cache plan)")

    notes: list[str] = []
    model_type = str(t.get("model_type") or config.get("model_type") or "")
    archs = list(config.get("architectures") or t.get("architectures") or [])
    layers = int(need("num_hidden_layers", "n_layer", "num_layers"))
    heads = int(need("num_attention_heads", "n_head"))
    hidden = int(need("hidden_size", "n_embd", "d_model"))
    vocab = int(need("vocab_size"))
    kv_heads = get("num_key_value_heads")
    if kv_heads is None:
        kv_heads = get("num_kv_heads")
    if kv_heads is None:
        # vLLM ModelConfig.get_total_num_kv_heads: no KV-head field means multi-head attention
        kv_heads = heads
        notes.append("no num_key_value_heads: one KV head per attention head (vLLM's rule)")
    kv_heads = int(kv_heads)
    head_dim = get("head_dim")
    if head_dim is None:
        head_dim = hidden // heads  # vLLM ModelConfig.get_head_size without head_dim
    head_dim = int(head_dim)
    inter = int(t.get("intermediate_size") or t.get("n_inner") or 4 * hidden)
    max_pos = get("max_position_embeddings") or get("n_positions") or get("max_seq_len")
    dtype_raw = t.get("dtype") or t.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
    if dtype_raw is None:
        # vLLM's dtype "auto" on a config without one: float32 weights, served as bfloat16
        model_dtype = "bfloat16"
        notes.append("no dtype in config.json: vLLM serves it as bfloat16")
    else:
        model_dtype = _dtype_name(dtype_raw, tw, "dtype")
        read["dtype"] = dtype_raw
        if model_dtype == "float32":
            model_dtype = "bfloat16"  # vLLM's dtype "auto" downcasts float32 checkpoints
            notes.append("float32 config: vLLM's dtype auto serves it as bfloat16")
    for k in SSM_FIELDS:
        if t.get(k) is not None:
            raise PlanError(f"{tw}: {k}: Mamba/SSM hybrid layers are not modelled by embedq plan "
                            f"(vLLM {VLLM_VERSION} rules implemented: full, sliding, chunked, MLA, "
                            "gated-delta-net linear attention)")
    mla = None
    if t.get("kv_lora_rank"):
        mla = int(need("kv_lora_rank")) + int(need("qk_rope_head_dim"))

    window = get("sliding_window")
    chunk = get("attention_chunk_size")
    types_ = get("layer_types")
    interval = get("full_attention_interval")
    if types_ is not None:
        if not isinstance(types_, list) or len(types_) != layers:
            n = len(types_) if isinstance(types_, list) else "no list of"
            raise PlanError(f"{tw}: layer_types has {n} entries, num_hidden_layers is {layers}")
        kinds = []
        for x in types_:
            x = str(x)
            k = ("full" if x in FULL_TYPES else "sliding" if x in SLIDING_TYPES else
                 "chunked" if x in CHUNKED_TYPES else "linear" if x in LINEAR_TYPES else None)
            if k is None:
                raise PlanError(f"{tw}: layer_types: {x!r} layers are not modelled by embedq plan "
                                f"(known: {', '.join(FULL_TYPES + SLIDING_TYPES + CHUNKED_TYPES + LINEAR_TYPES)})")
            kinds.append(k)
    elif interval is not None or model_type in GDN_MODEL_TYPES:
        if interval is None:
            raise PlanError(f"{tw}: no layer_types / full_attention_interval (needed to tell "
                            f"{model_type}'s linear-attention layers from full attention)")
        interval = int(interval)
        if interval < 1:
            raise PlanError(f"{tw}: full_attention_interval {interval}: expected a positive integer")
        # transformers Qwen3NextConfig / Qwen3_5TextConfig: every interval-th layer is full
        kinds = ["linear" if (i + 1) % interval else "full" for i in range(layers)]
    else:
        kinds = ["full"] * layers
        pattern = get("sliding_window_pattern") or get("_sliding_window_pattern")
        use_sw = get("use_sliding_window")
        if window and use_sw is not False:
            if pattern:
                kinds = ["full" if (i + 1) % int(pattern) == 0 else "sliding" for i in range(layers)]
            elif use_sw is not None and get("max_window_layers") is not None:
                kinds = ["sliding" if i >= int(t["max_window_layers"]) else "full" for i in range(layers)]
            else:
                kinds = ["sliding"] * layers
        if chunk:
            rope = get("no_rope_layers")
            if not isinstance(rope, list) or len(rope) < layers:
                raise PlanError(f"{tw}: attention_chunk_size without a no_rope_layers list of "
                                f"{layers} entries (needed to tell chunked layers from full ones)")
            kinds = ["chunked" if int(r) else "full" for r in rope[:layers]]
    if "sliding" in kinds and not window:
        raise PlanError(f"{tw}: sliding-window layers but no sliding_window")
    if "chunked" in kinds and not chunk:
        raise PlanError(f"{tw}: chunked-attention layers but no attention_chunk_size")
    if mla and any(k in ("sliding", "chunked") for k in kinds):
        raise PlanError(f"{tw}: kv_lora_rank with sliding/chunked layers: MLA with local attention "
                        "is not modelled by embedq plan")
    if "sliding" not in kinds:
        window = None
    if "chunked" not in kinds:
        chunk = None

    lin = None
    state = 0
    conv_dt = ssm_dt = None
    n_linear = kinds.count("linear")
    if n_linear:
        lin = {k: int(need(k)) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                         "linear_key_head_dim", "linear_value_head_dim",
                                         "linear_conv_kernel_dim")}
        conv_dt = model_dtype if mamba_cache_dtype == "auto" else _dtype_name(
            mamba_cache_dtype, "--mamba-cache-dtype", "value")
        cfg_ssm = get("mamba_ssm_dtype")
        if mamba_ssm_cache_dtype != "auto":
            ssm_dt = _dtype_name(mamba_ssm_cache_dtype, "--mamba-ssm-cache-dtype", "value")
        elif cfg_ssm is not None and set(archs) & set(SSM_DTYPE_ARCHS):
            ssm_dt = _dtype_name(cfg_ssm, tw, "mamba_ssm_dtype")
        else:
            if cfg_ssm is not None:
                notes.append(f"mamba_ssm_dtype {cfg_ssm} is not read by vLLM for {archs or model_type}: "
                             "recurrent state at the conv-state dtype")
            ssm_dt = conv_dt
        state = gdn_state_bytes(**lin, conv_bytes=_DTYPES[conv_dt], ssm_bytes=_DTYPES[ssm_dt])
    return KVLayout(layers, kinds.count("full"), kinds.count("sliding"), kinds.count("chunked"),
                    n_linear, kv_heads, head_dim, int(window) if window else None,
                    int(chunk) if chunk else None, mla, state, int(max_pos) if max_pos else None,
                    hidden, inter, heads, vocab, model_dtype, kinds, lin, conv_dt, ssm_dt, read, notes)


def gdn_state_bytes(linear_num_key_heads: int, linear_num_value_heads: int, linear_key_head_dim: int,
                    linear_value_head_dim: int, linear_conv_kernel_dim: int, conv_bytes: int,
                    ssm_bytes: int, num_spec: int = 0) -> int:
    """One request's gated-delta-net state (vLLM MambaStateShapeCalculator, TP 1).

    conv state (k_heads·k_dim·2 + v_heads·v_dim, kernel − 1 + spec) at the conv dtype,
    recurrent state (v_heads, v_dim, k_dim) at the ssm dtype.
    """
    conv_dim = linear_key_head_dim * linear_num_key_heads * 2 + linear_value_head_dim * linear_num_value_heads
    conv = conv_dim * (linear_conv_kernel_dim - 1 + num_spec) * conv_bytes
    rec = linear_num_value_heads * linear_value_head_dim * linear_key_head_dim * ssm_bytes
    return conv + rec


# ---------------------------------------------------------------------------------------
# vLLM's KV-cache specs, groups and block count


@dataclass(frozen=True)
class Spec:
    """One layer's KV cache as vLLM's KVCacheSpec sees it (page = one block of one layer)."""

    kind: str  # full | sliding | chunked | mla | mamba
    block_size: int
    real_page: int  # unpadded bytes of one page
    page: int  # bytes of one page, padding included
    window: int | None = None
    chunk: int | None = None
    state_pages: int = 1  # mamba: pages one request holds

    def max_memory_usage_bytes(self, max_len: int, in_flight: int) -> int:
        """``KVCacheSpec.max_memory_usage_bytes`` of vLLM 0.33.0 (DCP 1)."""
        if self.kind in ("full", "mla"):
            return _cdiv(max_len, self.block_size) * self.page
        if self.kind == "sliding":
            # +1: the window need not start at a block boundary
            return (_cdiv(min(self.window - 1 + in_flight, max_len), self.block_size) + 1) * self.page
        if self.kind == "chunked":
            return _cdiv(min(self.chunk + in_flight, max_len), self.block_size) * self.page
        return self.page * self.state_pages

    def pages(self, max_len: int, in_flight: int) -> int:
        return _cdiv(self.max_memory_usage_bytes(max_len, in_flight), self.page)


@dataclass
class Group:
    spec: Spec
    layers: int


@dataclass
class VLLMConfig:
    """The parts of vLLM's engine config the KV-cache plan depends on."""

    kv_bytes: int
    block_size: int = DEFAULT_BLOCK
    user_block_size: bool = False
    max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS
    async_scheduling: bool = True  # vLLM default: 2 batches in flight
    prefix_caching: bool = True  # vLLM default for generative (also hybrid) models
    gdn_checkpoints: bool = False  # FlashInfer GDN prefill (Hopper/Blackwell) exports checkpoints
    num_speculative_tokens: int = 0

    @property
    def max_in_flight_tokens(self) -> int:
        return (2 if self.async_scheduling else 1) * self.max_num_batched_tokens

    @property
    def mamba_cache_mode(self) -> str:
        return "align" if self.prefix_caching else "none"


@dataclass
class KVPlan:
    """vLLM's grouping for one model: block size, pages, groups, bytes per block."""

    block_size: int
    attention_page_1_token: int
    state_page: int | None  # unpadded linear-attention state page
    state_page_padded: int | None
    groups: list[Group]
    bytes_per_block: int
    in_flight: int
    rules: list[str]

    def blocks_per_request(self, max_len: int) -> int:
        return sum(g.spec.pages(max_len, self.in_flight) for g in self.groups)

    def usage(self, max_len: int) -> int:
        """``_max_memory_usage_bytes_from_groups``: bytes one max_len request holds."""
        return self.bytes_per_block * self.blocks_per_request(max_len)

    def num_blocks(self, available: int) -> int:
        return max(available, 0) // self.bytes_per_block

    def fits(self, max_len: int, available: int) -> bool:
        # vLLM checks against available less the null block the BlockPool keeps back
        return available > 0 and self.usage(max_len) <= available - self.bytes_per_block

    def longest(self, available: int, limit: int) -> int:
        """``_estimate_max_model_len_from_groups``: largest len ≤ limit that fits (0: none)."""
        if not self.fits(1, available):
            return 0
        lo, hi, best = 1, limit, 1
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.fits(mid, available):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best

    def to_dict(self) -> dict:
        return {"block_size": self.block_size, "attention_page_bytes_per_token": self.attention_page_1_token,
                "state_page_bytes": self.state_page, "state_page_padded_bytes": self.state_page_padded,
                "bytes_per_block": self.bytes_per_block, "max_in_flight_tokens": self.in_flight,
                "groups": [{"kind": g.spec.kind, "layers": g.layers, "block_size": g.spec.block_size,
                            "page_bytes": g.spec.page, "unpadded_page_bytes": g.spec.real_page,
                            **({"window": g.spec.window} if g.spec.window else {}),
                            **({"chunk": g.spec.chunk} if g.spec.chunk else {}),
                            **({"state_pages_per_request": g.spec.state_pages}
                               if g.spec.kind == "mamba" else {})}
                           for g in self.groups],
                "rules": self.rules}


def kv_plan(layout: KVLayout, vc: VLLMConfig, max_model_len: int) -> KVPlan:
    """vLLM 0.33.0's KV-cache groups for ``layout`` (one GPU, no DCP/PP, no spec decode)."""
    rules: list[str] = []
    kvb = vc.kv_bytes
    tok_page = layout.token_elems() * kvb
    bs = vc.block_size
    kinds = list(layout.kinds)
    state = state_padded = None
    mamba_bs = max_model_len
    if layout.linear_layers:
        lin = dict(layout.linear_dims)
        state = gdn_state_bytes(**lin, conv_bytes=_DTYPES[layout.conv_dtype],
                                ssm_bytes=_DTYPES[layout.ssm_dtype], num_spec=vc.num_speculative_tokens)
        # platforms/interface.py _align_hybrid_block_size
        align = max(KERNEL_ALIGN, bs)
        if layout.mla_dims:
            align = max(align, MLA_HYBRID_ALIGN)
        if vc.mamba_cache_mode == "align" and vc.gdn_checkpoints:
            align = math.lcm(align, GDN_CHECKPOINT_ALIGN)
        attn_bs = align * _cdiv(state, align * tok_page)
        attn_bs = KERNEL_ALIGN * _cdiv(attn_bs, KERNEL_ALIGN)
        if bs < attn_bs:
            rules.append(f"hybrid: attention block raised from {bs} to {attn_bs} tokens = {align}·"
                         f"⌈{state} B state page / ({align}·{tok_page} B per token)⌉")
            bs = attn_bs
        state_padded = bs * tok_page
        if state_padded != state:
            rules.append(f"hybrid: state page padded from {state} to {state_padded} B "
                         f"(+{100 * (state_padded - state) / state:.2f}%)")
        if vc.mamba_cache_mode == "align":
            mamba_bs = bs
        rules.append(f"linear-attention state: conv {layout.conv_dtype}, recurrent {layout.ssm_dtype}; "
                     f"mamba_cache_mode {vc.mamba_cache_mode} (prefix caching "
                     f"{'on' if vc.prefix_caching else 'off'})")
    page = bs * tok_page
    hma = True
    if layout.attention_chunk is not None:
        # config/vllm.py: attention_chunk_size disables the hybrid KV cache manager by default
        hma = False
    if not hma and "full" in kinds and any(k in ("sliding", "chunked") for k in kinds):
        rules.append("hybrid KV cache manager off (attention_chunk_size): sliding/chunked layers "
                     "allocate every token like full attention")
        kinds = ["full" if k in ("sliding", "chunked") else k for k in kinds]
    specs = []
    for k in kinds:
        if k == "linear":
            pages = (2 + vc.num_speculative_tokens + int(vc.gdn_checkpoints)) \
                if vc.mamba_cache_mode == "align" else 1 + vc.num_speculative_tokens
            specs.append(Spec("mamba", mamba_bs, state, state_padded, state_pages=pages))
        elif layout.mla_dims:
            specs.append(Spec("mla", bs, page, page))
        elif k == "sliding":
            specs.append(Spec("sliding", bs, page, page, window=layout.sliding_window))
        elif k == "chunked":
            specs.append(Spec("chunked", bs, page, page, chunk=layout.attention_chunk))
        else:
            specs.append(Spec("full", bs, page, page))
    groups = _groups(specs, rules)
    bytes_per_block = max(g.spec.page * g.layers for g in groups)
    rules.append(f"one block = widest group: {bytes_per_block} B "
                 f"({max(g.layers for g in groups)} layers x {groups[0].spec.page} B pages)")
    return KVPlan(bs, tok_page, state, state_padded if state else None, groups, bytes_per_block,
                  vc.max_in_flight_tokens, rules)


def _groups(specs: list[Spec], rules: list[str]) -> list[Group]:
    """kv_cache_planning.get_kv_cache_groups for layers of one page size."""
    if len(set(specs)) == 1:
        return [Group(specs[0], len(specs))]
    buckets: dict[Spec, int] = {}
    for s in specs:  # same spec -> same bucket, in first-seen order
        buckets[s] = buckets.get(s, 0) + 1
    lo, hi = min(buckets.values()), max(buckets.values())
    # _get_kv_cache_groups_uniform_page_size: groups as large as the smallest kind,
    # or the largest when the kinds are within 1.5x of each other
    size = hi if hi < lo * 1.5 else lo
    groups = []
    for s, n in buckets.items():
        parts = _cdiv(n, size)
        if parts * size != n:
            rules.append(f"{parts * size - n} padding layer(s) for the {s.kind} layers")
        # layers[i::parts] -> the first n % parts groups get one more layer
        for i in range(parts):
            groups.append(Group(s, len(range(i, n, parts))))
    desc = ", ".join(f"{sum(1 for g in groups if g.spec == s)} {s.kind}" for s in buckets)
    rules.append(f"{len(groups)} KV cache groups of {size} layers ({desc})")
    return groups


# ---------------------------------------------------------------------------------------
# weights


def weight_bytes(path: str | os.PathLike, bits: int = 8, group_size: int | None = None,
                 symmetric: bool = True) -> dict:
    """Resident weight bytes of a local checkpoint with float tables and with the overlay."""
    from embedq.format.checkpoint import Checkpoint
    return _checkpoint_weights(Checkpoint.open(path), bits, group_size, symmetric)


def _checkpoint_weights(ck, bits: int, group_size: int | None, symmetric: bool,
                        hub: tuple | None = None) -> dict:
    """Float and overlay weight bytes from safetensors headers (local or Hub).

    With an overlay (in place or derived) its real tensor bytes are used; without one,
    the overlay a ``bits`` / ``group_size`` run of ``embedq quantize`` would write is
    estimated (embedding only, plus a tied head that reads it). ``hub``: (overlay config
    or None, overlay header reader) of a Hub repo, whose files are not on disk.
    """
    from embedq.format.checkpoint import OVERLAY_NAME, read_safetensors_header
    from embedq.format.scheme import Scheme
    sizes: dict[str, int] = {}
    for f in ck.files():
        _, header = ck.header(f)
        for k, v in header.items():
            if k != "__metadata__" and ck.weight_map.get(k) == f:
                sizes[k] = v["data_offsets"][1] - v["data_offsets"][0]
    qc = hub[0] if hub else _overlay_config(ck)
    if qc is not None:
        if hub is None:
            overlay_file = ck.path / qc.get("overlay", OVERLAY_NAME)
            if not overlay_file.exists():
                raise PlanError(f"{overlay_file}: overlay file missing")
            _, oh = read_safetensors_header(overlay_file)
        else:
            oh = hub[1](qc.get("overlay", OVERLAY_NAME))
        overlay = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in oh.items() if k != "__metadata__")
        floats, drop = 0, set()
        for name, e in qc["modules"].items():
            src = (e.get("source") or {}).get("tensor", name + ".weight")
            if src in drop:
                continue
            drop.add(src)
            rows, cols = e["shape"]
            floats += rows * cols * DTYPE_BYTES.get(_st_dtype((e.get("source") or {}).get("dtype")), 2)
        for alias in (qc.get("aliases") or {}):
            drop.add(alias + ".weight")  # a tied head's duplicate is not resident
        base = sum(s for k, s in sizes.items() if k not in drop)
        schemes = sorted({_label(e) for e in qc["modules"].values()})
        return {"float": base + floats, "quantized": base + overlay, "float_tables": floats,
                "overlay": overlay, "overlay_source": "overlay on disk", "scheme": ", ".join(schemes)}
    from embedq.jobs.targets import find_targets
    t, tied_cfg = find_targets(ck)
    emb = ck.tensor(t.embedding)
    scheme = Scheme.default(bits, symmetric, group_size)
    if group_size is None and len(emb.shape) == 2:
        scheme = scheme.fit(emb.shape[1])
    scheme.check_shape(emb.shape, f"{ck.path / emb.file}: {t.embedding}")
    scale_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(scheme.scale_dtype, DTYPE_BYTES.get(emb.dtype, 2))
    overlay = scheme.overlay_bytes(emb.shape, scale_bytes)
    drop = {t.embedding}
    if t.head and tied_cfg:
        drop.add(t.head)
    base = sum(s for k, s in sizes.items() if k not in drop)
    return {"float": base + emb.nbytes, "quantized": base + overlay, "float_tables": emb.nbytes,
            "overlay": overlay, "overlay_source": "estimate (no overlay yet)", "scheme": scheme.label()}


def _given_weights(total: int, layout: KVLayout, where: str, bits: int, group_size: int | None,
                   symmetric: bool) -> dict:
    """``--weights-gib``: float weights as given, the embedding (vocab x hidden) from config."""
    from embedq.format.scheme import Scheme
    shape = (layout.vocab_size, layout.hidden_size)
    scheme = Scheme.default(bits, symmetric, group_size)
    if group_size is None:
        scheme = scheme.fit(shape[1])
    scheme.check_shape(shape, f"{where}: embedding vocab_size x hidden_size")
    isz = _DTYPES[layout.model_dtype]
    table = shape[0] * shape[1] * isz
    if table >= total:
        raise PlanError(f"--weights-gib {total / GiB:.2f}: smaller than the embedding table alone "
                        f"({table / GiB:.2f} GiB from {where})")
    overlay = scheme.overlay_bytes(shape, {"float32": 4, "float16": 2, "bfloat16": 2}.get(scheme.scale_dtype, isz))
    return {"float": total, "quantized": total - table + overlay, "float_tables": table,
            "overlay": overlay, "overlay_source": "estimate from config.json and --weights-gib",
            "scheme": scheme.label()}


def _st_dtype(name: str | None) -> str:
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(name or "", "BF16")


def _label(entry: dict) -> str:
    from embedq.format.config import scheme_of
    return scheme_of(entry).label()


def _overlay_config(ck) -> dict | None:
    """The checkpoint's overlay config, validated by the one reader (None: no overlay)."""
    from embedq.format.checkpoint import QCONFIG_NAME
    from embedq.format.reader import read_overlay_config
    qc = ck.config.get("quantization_config")
    if (ck.path / QCONFIG_NAME).exists() or (isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD):
        return read_overlay_config(ck.path)
    return None


# ---------------------------------------------------------------------------------------
# inputs: local checkpoint, config-only folder, Hub id

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass
class _Source:
    label: str
    config: dict
    config_where: str
    weights: object  # callable(bits, group_size, symmetric) -> dict, or None (config only)


def _local(p: Path) -> _Source:
    from embedq.format.checkpoint import CONFIG_NAME, Checkpoint, read_json
    if not p.is_dir():
        raise PlanError(f"{p}: not a directory")
    cfg_path = p / CONFIG_NAME
    if not cfg_path.exists():
        raise PlanError(f"{cfg_path}: no config.json in the checkpoint folder")
    has_weights = any(x.suffix == ".safetensors" for x in p.iterdir())
    if not has_weights:
        return _Source(str(p), read_json(cfg_path), str(cfg_path), None)
    ck = Checkpoint.open(p)
    return _Source(str(p), ck.config, str(cfg_path),
                   lambda b, g, s: _checkpoint_weights(ck, b, g, s))


def _hub(repo_id: str, revision: str | None, need_weights: bool) -> _Source:
    """config.json and safetensors headers of a Hub repo (huggingface_hub; no weight bytes)."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import (EntryNotFoundError, HfHubHTTPError, NotASafetensorsRepoError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        raise PlanError(f"{repo_id}: planning a Hub model needs huggingface_hub") from None
    from embedq.format.checkpoint import OVERLAY_NAME, Checkpoint
    where = f"{repo_id}/config.json"
    api = HfApi()  # HF_ENDPOINT / HF_TOKEN as huggingface_hub reads them
    try:
        cfg_file = api.hf_hub_download(repo_id, "config.json", revision=revision)
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise PlanError(f"{repo_id}: no such directory or Hub model ({type(e).__name__})") from None
    except EntryNotFoundError:
        raise PlanError(f"{where}: not in the Hub repo") from None
    except (HfHubHTTPError, OSError) as e:
        raise PlanError(f"{where}: cannot download: {str(e).splitlines()[0]}") from None
    try:
        config = json.loads(Path(cfg_file).read_text())
    except ValueError:
        raise PlanError(f"{where}: not valid JSON") from None
    if not need_weights:
        return _Source(repo_id, config, where, None)
    try:
        meta = api.get_safetensors_metadata(repo_id, revision=revision)
    except NotASafetensorsRepoError:
        raise PlanError(f"{repo_id}: no model.safetensors(.index.json) on the Hub; pass --weights-gib") from None
    except (HfHubHTTPError, OSError) as e:
        raise PlanError(f"{repo_id}: cannot read safetensors headers: {str(e).splitlines()[0]}") from None

    def header_of(fm) -> dict:
        return {k: {"dtype": v.dtype, "shape": list(v.shape), "data_offsets": list(v.data_offsets)}
                for k, v in fm.tensors.items()}

    wm = {k: f for k, f in meta.weight_map.items() if f != OVERLAY_NAME}
    ck = Checkpoint(Path(repo_id), config, meta.sharded, wm, None,
                    {f: (0, header_of(fm)) for f, fm in meta.files_metadata.items() if f != OVERLAY_NAME})
    qc = config.get("quantization_config")
    qc = qc if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD else None

    def overlay_header(name: str) -> dict:
        try:
            return header_of(api.parse_safetensors_file_metadata(repo_id, name, revision=revision))
        except (HfHubHTTPError, OSError) as e:
            raise PlanError(f"{repo_id}/{name}: cannot read the overlay header: {str(e).splitlines()[0]}") from None

    return _Source(repo_id, config, where,
                   lambda b, g, s: _checkpoint_weights(ck, b, g, s, (qc, overlay_header)))


def _source(path, revision: str | None, need_weights: bool) -> _Source:
    p = Path(path)
    if p.exists():
        return _local(p)
    if _HUB_ID.fullmatch(str(path)) and not str(path).startswith((".", "/")):
        return _hub(str(path), revision, need_weights)
    raise PlanError(f"{p}: no such directory (and not an org/model Hub id)")


# ---------------------------------------------------------------------------------------
# the plan


@dataclass
class Capacity:
    label: str
    weights: int
    budget: int  # KV-cache memory vLLM gets (available)
    per_seq: int  # bytes one max_model_len request holds (whole blocks, all groups)
    concurrency: float
    kv_tokens: int  # int(concurrency * max_model_len)
    max_context: int  # longest max_model_len that starts (0: none)
    starts: bool  # does max_model_len itself start
    num_blocks: int = 0
    blocks_per_request: int = 0


@dataclass
class PlanResult:
    path: str
    gpu_mem: int
    gpu_memory_utilization: float
    kv_dtype: str
    kv_bytes: int
    max_model_len: int
    reserve: int
    reserve_parts: dict
    max_num_batched_tokens: int
    per_token_bytes: dict
    layout: dict
    scheme: str
    overlay_source: str
    before: Capacity
    after: Capacity
    vllm: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def extra_tokens(self) -> int:
        return self.after.kv_tokens - self.before.kv_tokens

    def to_dict(self) -> dict:
        d = asdict(self)
        d["extra_kv_tokens"] = self.extra_tokens
        d["saved_bytes"] = self.before.weights - self.after.weights
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), indent=2, **kw)

    def table(self) -> str:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        lay, v = self.layout, self.vllm
        kinds = ", ".join(f"{lay[k]} {n}" for k, n in (("full_layers", "full"), ("sliding_layers", "sliding"),
                                                       ("chunked_layers", "chunked"), ("linear_layers", "linear"))
                          if lay[k])
        attn = (f"MLA {lay['mla_dims']} per token" if lay["mla_dims"]
                else f"{lay['kv_heads']} KV heads x {lay['head_dim']}")
        lines = [
            f"{self.path}: {lay['layers']} layers ({kinds}), {attn}"
            + (f", window {lay['sliding_window']}" if lay["sliding_layers"] else ""),
            f"GPU {g(self.gpu_mem)} x {self.gpu_memory_utilization} utilization, KV {self.kv_dtype}, "
            f"reserve {g(self.reserve)}; vLLM {v['version']} rules: block {v['block_size']} tokens, "
            f"{len(v['groups'])} groups, {v['bytes_per_block']:,} B per block, "
            f"{self.before.blocks_per_request:,} blocks per {self.max_model_len:,}-token request",
        ]
        head = ["embeddings", "weights", "KV budget", "blocks", "KV tokens", f"seqs @ {self.max_model_len}",
                "max context that starts"]
        rows = []
        for c in (self.before, self.after):
            rows.append([c.label, g(c.weights), g(max(c.budget, 0)), f"{c.num_blocks:,}", f"{c.kv_tokens:,}",
                         f"{c.concurrency:.2f}", f"{c.max_context:,}" if c.max_context else "does not start"])
        widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
        fmt = lambda r: "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w)  # noqa: E731
                                   for i, (x, w) in enumerate(zip(r, widths)))
        lines += [fmt(head), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]
        saved = self.before.weights - self.after.weights
        lines.append(f"overlay ({self.scheme}; {self.overlay_source}) frees {saved / 2**20:.1f} MiB: "
                     f"{self.extra_tokens:+,} KV tokens")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


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
         max_num_seqs: int = DEFAULT_MAX_SEQS, bits: int = 8, group_size: int | None = None,
         symmetric: bool = True, weights_gib: float | str | None = None, revision: str | None = None,
         block_size: int | None = None, prefix_caching: bool = True, async_scheduling: bool = True,
         gdn_checkpoints: bool = False, mamba_ssm_cache_dtype: str = "auto") -> PlanResult:
    """KV-cache capacity of ``path`` on one GPU with float tables and with the overlay.

    ``path``: a checkpoint folder, a folder with only ``config.json`` (then
    ``weights_gib``, the float weights in GiB, is required), or a Hub ``org/model`` id
    (config.json and safetensors headers only). ``kv_dtype``: ``fp8``, ``bf16``/``fp16``
    or ``auto`` (the model's dtype). ``max_model_len`` defaults to
    ``max_position_embeddings``. ``reserve`` overrides the activation / non-torch
    estimate. ``bits`` / ``group_size`` / ``symmetric`` describe the overlay to estimate
    when there is none yet. ``block_size``, ``prefix_caching``, ``async_scheduling``,
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
    mem = parse_bytes(gpu_mem)
    given = None
    if weights_gib is not None:
        # a bare number is GiB, as the option's name says
        given = int(weights_gib * GiB) if isinstance(weights_gib, (int, float)) else parse_bytes(weights_gib)
        if given <= 0:
            raise PlanError(f"--weights-gib {weights_gib}: expected a positive size")
    src = _source(path, revision, need_weights=given is None)
    layout = kv_layout(src.config, where=src.config_where, mamba_ssm_cache_dtype=mamba_ssm_cache_dtype)
    kvd = layout.model_dtype if kv_dtype == "auto" else kv_dtype
    if kvd not in KV_BYTES:
        raise PlanError(f"--kv-dtype {kv_dtype}: expected fp8, bf16, fp16 or auto")
    kvb = KV_BYTES[kvd]
    max_len = int(max_model_len or layout.max_position_embeddings or 0)
    if max_len <= 0:
        raise PlanError(f"{src.config_where}: no max_position_embeddings; pass --max-model-len")
    if given is not None:
        w = _given_weights(given, layout, src.config_where, bits, group_size, symmetric)
    elif src.weights is None:
        raise PlanError(f"{src.label}: no *.safetensors weights found; pass --weights-gib "
                        "(the model's float weights) to plan from config.json alone")
    else:
        w = src.weights(bits, group_size, symmetric)
    act_bytes = _DTYPES[layout.model_dtype]
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
