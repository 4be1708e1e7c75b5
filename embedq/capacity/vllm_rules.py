"""vLLM 0.33.0's KV-cache allocator rules: one spec per layer, hybrid block sizes, groups,
bytes per block (:func:`kv_plan`); steps 1-5 of :mod:`embedq.capacity.plan`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from embedq.capacity.layout import MODEL_DTYPE_BYTES, KVLayout, cdiv, gdn_state_bytes

DEFAULT_BLOCK = 16  # vLLM CacheConfig.DEFAULT_BLOCK_SIZE
KERNEL_ALIGN = 16  # smallest kernel block of vLLM's CUDA attention backends (MultipleOf(16))
MLA_HYBRID_ALIGN = 128  # _align_hybrid_block_size: MLA + mamba blocks are multiples of 128
GDN_CHECKPOINT_ALIGN = 64  # vllm/v1/attention/backends/gdn_attn.py FLASHINFER_GDN_CHECKPOINT_ALIGNMENT
DEFAULT_BATCHED_TOKENS = 8192
KV_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "bf16": 2, "bfloat16": 2, "fp16": 2,
            "float16": 2, "half": 2, "fp32": 4, "float32": 4, "float": 4}


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
            return cdiv(max_len, self.block_size) * self.page
        if self.kind == "sliding":
            # +1: the window need not start at a block boundary
            return (cdiv(min(self.window - 1 + in_flight, max_len), self.block_size) + 1) * self.page
        if self.kind == "chunked":
            return cdiv(min(self.chunk + in_flight, max_len), self.block_size) * self.page
        return self.page * self.state_pages

    def pages(self, max_len: int, in_flight: int) -> int:
        return cdiv(self.max_memory_usage_bytes(max_len, in_flight), self.page)


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
        state = gdn_state_bytes(**lin, conv_bytes=MODEL_DTYPE_BYTES[layout.conv_dtype],
                                ssm_bytes=MODEL_DTYPE_BYTES[layout.ssm_dtype], num_spec=vc.num_speculative_tokens)
        # platforms/interface.py _align_hybrid_block_size
        align = max(KERNEL_ALIGN, bs)
        if layout.mla_dims:
            align = max(align, MLA_HYBRID_ALIGN)
        if vc.mamba_cache_mode == "align" and vc.gdn_checkpoints:
            align = math.lcm(align, GDN_CHECKPOINT_ALIGN)
        attn_bs = align * cdiv(state, align * tok_page)
        attn_bs = KERNEL_ALIGN * cdiv(attn_bs, KERNEL_ALIGN)
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
    groups = kv_groups(specs, rules)
    bytes_per_block = max(g.spec.page * g.layers for g in groups)
    rules.append(f"one block = widest group: {bytes_per_block} B "
                 f"({max(g.layers for g in groups)} layers x {groups[0].spec.page} B pages)")
    return KVPlan(bs, tok_page, state, state_padded if state else None, groups, bytes_per_block,
                  vc.max_in_flight_tokens, rules)


def kv_groups(specs: list[Spec], rules: list[str]) -> list[Group]:
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
        parts = cdiv(n, size)
        if parts * size != n:
            rules.append(f"{parts * size - n} padding layer(s) for the {s.kind} layers")
        # layers[i::parts] -> the first n % parts groups get one more layer
        for i in range(parts):
            groups.append(Group(s, len(range(i, n, parts))))
    desc = ", ".join(f"{sum(1 for g in groups if g.spec == s)} {s.kind}" for s in buckets)
    rules.append(f"{len(groups)} KV cache groups of {size} layers ({desc})")
    return groups



__all__ = ["Spec", "Group", "VLLMConfig", "KVPlan", "kv_plan", "kv_groups", "KV_BYTES", "DEFAULT_BLOCK",
           "KERNEL_ALIGN", "DEFAULT_BATCHED_TOKENS"]
