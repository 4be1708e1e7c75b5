"""What ``embedq plan`` returns and prints: :class:`PlanResult`, one :class:`Capacity` with
float tables and one with the overlay."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from embedq.capacity.layout import GiB


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


__all__ = ["Capacity", "PlanResult"]
