"""``embedq plan``: what an overlay buys in KV cache on a given GPU, vLLM-style.

Formula (vLLM V1 memory model, simplified; every term is in the result):

    budget      = gpu_mem * gpu_memory_utilization - weights - reserve
    per_seq(T)  = Σ_full-attention layers   2 * kv_heads * head_dim * kv_bytes * ⌈T⌉
                + Σ_sliding-window layers   2 * kv_heads * head_dim * kv_bytes * ⌈min(T, W - 1 + B)⌉
                + Σ_linear-attention layers constant recurrent + conv state
                  (⌈x⌉ rounds up to the 16-token KV block; B = max_num_batched_tokens,
                   the chunk in flight; MLA layers store kv_lora_rank + rope dims once)
    concurrency = budget / per_seq(max_model_len)
    KV tokens   = concurrency * max_model_len        (vLLM's "GPU KV cache size: N tokens")
    max context that starts = largest T ≤ max_position_embeddings with per_seq(T) ≤ budget
                  (vLLM refuses to start when one max_model_len request does not fit)

Assumptions: the GPU memory vLLM may use is ``gpu_mem * gpu_memory_utilization`` (vLLM's
default 0.9). ``reserve`` is what vLLM's profiling run finds besides weights: a
non-torch allowance (default 0.5 GiB: CUDA/NCCL/cuBLAS workspaces), peak activations of a
B-token forward (≈ B * (6*hidden + 2*intermediate + (heads + 2*kv_heads)*head_dim)
activation bytes) and the sampler's float32 logits for ``max_num_seqs`` rows (2 copies);
CUDA-graph memory is not counted (vLLM only subtracts it with
VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS). Override with ``reserve=`` when you know
better: the *difference* before/after does not depend on it — every byte the overlay
saves becomes KV cache, ``saved / per-token bytes`` more tokens. Weights are the
checkpoint's tensor bytes (a tied head counted once), resident on one GPU (no tensor
parallelism).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from embedq.errors import EmbedqError
from embedq.format.constants import QUANT_METHOD

GiB = 1 << 30
BLOCK = 16
DEFAULT_UTILIZATION = 0.9
DEFAULT_BATCHED_TOKENS = 8192  # vLLM's LLM-class default below 70 GiB cards (16384 above)
DEFAULT_MAX_SEQS = 256
DEFAULT_NON_TORCH = GiB // 2
KV_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "bf16": 2, "bfloat16": 2, "fp16": 2,
            "float16": 2, "fp32": 4, "float32": 4}
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U32": 4, "U16": 2, "U64": 8}
FULL_TYPES = ("full_attention", "attention", "global_attention", "global")
SLIDING_TYPES = ("sliding_attention", "sliding_window", "local_attention", "local")
CHUNKED_TYPES = ("chunked_attention",)
LINEAR_TYPES = ("linear_attention", "mamba", "mamba2", "gated_delta_net", "conv", "short_conv")


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


# ---------------------------------------------------------------------------------------
# KV layout from config.json


@dataclass
class KVLayout:
    """Per-token / per-sequence KV cost of a model, from its config."""

    layers: int
    full_layers: int
    sliding_layers: int
    chunked_layers: int
    linear_layers: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None
    attention_chunk: int | None
    mla_dims: int | None  # elements per token per MLA layer (kv_lora_rank + rope dims)
    linear_state_bytes: int  # per sequence, all linear-attention layers together
    max_position_embeddings: int | None
    hidden_size: int
    intermediate_size: int
    heads: int
    vocab_size: int
    notes: list[str] = field(default_factory=list)

    def token_elems(self) -> int:
        """KV elements one token costs in one attention layer."""
        return self.mla_dims if self.mla_dims else 2 * self.kv_heads * self.head_dim

    def per_token_bytes(self, kv_bytes: int) -> dict[str, int]:
        e = self.token_elems() * kv_bytes
        return {"full": self.full_layers * e, "sliding": self.sliding_layers * e,
                "chunked": self.chunked_layers * e}

    def per_seq_bytes(self, tokens: int, kv_bytes: int, batched_tokens: int) -> int:
        pt = self.per_token_bytes(kv_bytes)
        total = _blocks(tokens) * pt["full"]
        if self.sliding_layers:
            total += _blocks(min(tokens, self.sliding_window - 1 + batched_tokens)) * pt["sliding"]
        if self.chunked_layers:
            total += _blocks(min(tokens, self.attention_chunk + batched_tokens)) * pt["chunked"]
        return total + self.linear_state_bytes


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK) * BLOCK


def _text_config(config: dict) -> dict:
    """The decoder's config (``text_config`` / ``llm_config`` of multimodal models), with
    transformers' defaults filled in when transformers knows the model type."""
    raw = config
    for key in ("text_config", "llm_config", "language_config"):
        if isinstance(config.get(key), dict):
            raw = config[key]
            break
    try:
        from transformers import AutoConfig
        c = dict(config)
        c.pop("quantization_config", None)
        mt = c.pop("model_type")
        full = AutoConfig.for_model(mt, **c).get_text_config().to_dict()
        return {**full, **{k: v for k, v in raw.items() if v is not None}}
    except Exception:
        return raw


def kv_layout(config: dict, state_bytes: int = 2) -> KVLayout:
    """Read layers, KV heads, head dim, sliding-window / chunked / linear layers from a config."""
    t = _text_config(config)
    notes: list[str] = []

    def need(*keys, default=None):
        for k in keys:
            if t.get(k) is not None:
                return t[k]
        if default is not None:
            return default
        raise PlanError(f"config.json: no {' / '.join(keys)} (needed for the KV-cache plan)")

    layers = int(need("num_hidden_layers", "n_layer", "num_layers"))
    heads = int(need("num_attention_heads", "n_head"))
    hidden = int(need("hidden_size", "n_embd", "d_model"))
    kv_heads = int(need("num_key_value_heads", "num_kv_heads", default=heads))
    head_dim = int(t.get("head_dim") or hidden // heads)
    inter = int(t.get("intermediate_size") or t.get("n_inner") or 4 * hidden)
    vocab = int(need("vocab_size"))
    max_pos = t.get("max_position_embeddings") or t.get("n_positions") or t.get("max_seq_len")
    window = t.get("sliding_window")
    chunk = t.get("attention_chunk_size")
    mla = None
    if t.get("kv_lora_rank"):
        mla = int(t["kv_lora_rank"]) + int(t.get("qk_rope_head_dim") or 0)
        notes.append("MLA: one latent of kv_lora_rank + qk_rope_head_dim per token and layer")

    types_ = t.get("layer_types")
    if isinstance(types_, list) and len(types_) == layers:
        kinds = []
        for x in types_:
            x = str(x)
            kinds.append("full" if x in FULL_TYPES else "sliding" if x in SLIDING_TYPES else
                         "chunked" if x in CHUNKED_TYPES else "linear" if x in LINEAR_TYPES else x)
        unknown = sorted({k for k in kinds if k not in ("full", "sliding", "chunked", "linear")})
        if unknown:
            notes.append(f"layer types {unknown} counted as full attention")
            kinds = ["full" if k in unknown else k for k in kinds]
    else:
        kinds = ["full"] * layers
        pattern = t.get("sliding_window_pattern") or t.get("_sliding_window_pattern")
        if window and t.get("use_sliding_window", True) is not False:
            if pattern:
                kinds = ["full" if (i + 1) % int(pattern) == 0 else "sliding" for i in range(layers)]
            elif t.get("max_window_layers") is not None and "use_sliding_window" in t:
                kinds = ["sliding" if i >= int(t["max_window_layers"]) else "full" for i in range(layers)]
            else:
                kinds = ["sliding"] * layers
        if chunk and t.get("no_rope_layers"):
            kinds = ["chunked" if int(r) else "full" for r in t["no_rope_layers"]][:layers]
    if "sliding" in kinds and not window:
        notes.append("sliding layers without sliding_window: counted as full attention")
        kinds = ["full" if k == "sliding" else k for k in kinds]
    if "chunked" in kinds and not chunk:
        kinds = ["full" if k == "chunked" else k for k in kinds]

    if "sliding" not in kinds:
        window = None
    if "chunked" not in kinds:
        chunk = None
    n_linear = kinds.count("linear")
    linear_bytes = 0
    if n_linear:
        nk, nv = t.get("linear_num_key_heads"), t.get("linear_num_value_heads")
        dk, dv = t.get("linear_key_head_dim"), t.get("linear_value_head_dim")
        kc = t.get("linear_conv_kernel_dim")
        if all(v is not None for v in (nk, nv, dk, dv, kc)):
            conv = (int(kc) - 1) * (2 * int(nk) * int(dk) + int(nv) * int(dv))
            rec = int(nv) * int(dk) * int(dv)
            linear_bytes = n_linear * (conv + rec) * state_bytes
            notes.append(f"{n_linear} linear-attention layers: constant state "
                         f"{linear_bytes / 2**20:.1f} MiB per sequence")
        else:
            notes.append(f"{n_linear} linear-attention / SSM layers: state size unknown, not counted")
    return KVLayout(layers, kinds.count("full"), kinds.count("sliding"), kinds.count("chunked"),
                    n_linear, kv_heads, head_dim, int(window) if window else None,
                    int(chunk) if chunk else None, mla, linear_bytes,
                    int(max_pos) if max_pos else None, hidden, inter, heads, vocab, notes)


# ---------------------------------------------------------------------------------------
# weights


def weight_bytes(path: str | os.PathLike, bits: int = 8, group_size: int | None = None,
                 symmetric: bool = True) -> dict:
    """Resident weight bytes with float tables and with the overlay.

    With an overlay (in place or derived) its real tensor bytes are used; without one,
    the overlay a ``bits`` / ``group_size`` run of ``embedq quantize`` would write is
    estimated (embedding only, plus a tied head that reads it).
    """
    from embedq.format.checkpoint import OVERLAY_NAME, Checkpoint, read_safetensors_header
    from embedq.format.scheme import Scheme
    ck = Checkpoint.open(path)
    sizes: dict[str, int] = {}
    dtypes: dict[str, str] = {}
    for f in ck.files():
        _, header = ck.header(f)
        for k, v in header.items():
            if k != "__metadata__" and ck.weight_map.get(k) == f:
                sizes[k] = v["data_offsets"][1] - v["data_offsets"][0]
                dtypes[k] = v["dtype"]
    qc = _overlay_config(ck)
    if qc is not None:
        overlay_file = ck.path / qc.get("overlay", OVERLAY_NAME)
        if not overlay_file.exists():
            raise PlanError(f"{overlay_file}: overlay file missing")
        _, oh = read_safetensors_header(overlay_file)
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
    scheme = Scheme.default(bits, symmetric, group_size)
    emb = ck.tensor(t.embedding)
    rows, cols = emb.shape
    scheme.check_shape(emb.shape, str(ck.path / emb.file) + ": " + t.embedding)
    isz = DTYPE_BYTES.get(emb.dtype, 2)
    overlay = rows * cols * bits // 8 + rows * scheme.groups(cols) * isz + 16
    if not symmetric:
        overlay += -(-rows * bits // 32) * scheme.groups(cols) * 4
    drop = {t.embedding}
    if t.head and tied_cfg:
        drop.add(t.head)
    base = sum(s for k, s in sizes.items() if k not in drop)
    return {"float": base + emb.nbytes, "quantized": base + overlay, "float_tables": emb.nbytes,
            "overlay": overlay, "overlay_source": "estimate (no overlay yet)", "scheme": scheme.label()}


def _st_dtype(name: str | None) -> str:
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(name or "", "BF16")


def _label(entry: dict) -> str:
    from embedq.format.config import scheme_of
    return scheme_of(entry).label()


def _overlay_config(ck) -> dict | None:
    from embedq.format.checkpoint import QCONFIG_NAME
    if (ck.path / QCONFIG_NAME).exists():
        try:
            return json.loads((ck.path / QCONFIG_NAME).read_text())
        except ValueError:
            raise PlanError(f"{ck.path / QCONFIG_NAME}: not valid JSON") from None
    qc = ck.config.get("quantization_config")
    return qc if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD else None


# ---------------------------------------------------------------------------------------
# the plan


@dataclass
class Capacity:
    label: str
    weights: int
    budget: int
    per_seq: int  # bytes one max_model_len request needs
    concurrency: float
    kv_tokens: int
    max_context: int  # longest max_model_len that starts (0: none)
    starts: bool  # does max_model_len itself start


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
        lay = self.layout
        kinds = ", ".join(f"{lay[k]} {n}" for k, n in (("full_layers", "full"), ("sliding_layers", "sliding"),
                                                       ("chunked_layers", "chunked"), ("linear_layers", "linear"))
                          if lay[k])
        ptb = sum(self.per_token_bytes.values())
        eff = self.before.per_seq / self.max_model_len
        lines = [
            f"{self.path}: {lay['layers']} layers ({kinds}), {lay['kv_heads']} KV heads x {lay['head_dim']}"
            + (f", window {lay['sliding_window']}" if lay["sliding_layers"] else ""),
            f"GPU {g(self.gpu_mem)} x {self.gpu_memory_utilization} utilization, KV {self.kv_dtype} "
            f"({ptb} bytes/token in all attention layers, {eff:.0f} at max_model_len "
            f"{self.max_model_len}), reserve {g(self.reserve)}",
        ]
        head = ["embeddings", "weights", "KV budget", "KV tokens", f"seqs @ {self.max_model_len}",
                "max context that starts"]
        rows = []
        for c in (self.before, self.after):
            rows.append([c.label, g(c.weights), g(max(c.budget, 0)), f"{c.kv_tokens:,}",
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
    """The non-weight, non-KV memory vLLM's profiling finds (see module docstring)."""
    per_tok = 6 * layout.hidden_size + 2 * layout.intermediate_size + \
        (layout.heads + 2 * layout.kv_heads) * layout.head_dim
    act = batched_tokens * per_tok * act_bytes
    sampler = min(max_seqs, batched_tokens) * layout.vocab_size * 4 * 2
    return {"non_torch": non_torch, "activations": act, "sampler_logits": sampler,
            "total": non_torch + act + sampler}


def _capacity(label: str, weights: int, usable: int, reserve: int, layout: KVLayout, kv_bytes: int,
              max_len: int, batched: int) -> Capacity:
    budget = usable - weights - reserve
    per_seq = layout.per_seq_bytes(max_len, kv_bytes, batched)
    conc = budget / per_seq if budget > 0 and per_seq > 0 else 0.0
    tokens = int(conc * max_len) if per_seq else 0
    limit = layout.max_position_embeddings or max_len
    if budget <= 0 or layout.per_seq_bytes(1, kv_bytes, batched) > budget:
        longest = 0
    elif layout.per_seq_bytes(limit, kv_bytes, batched) <= budget:
        longest = limit
    else:
        lo, hi = 1, limit  # per_seq is non-decreasing in T
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if layout.per_seq_bytes(mid, kv_bytes, batched) <= budget:
                lo = mid
            else:
                hi = mid - 1
        longest = lo
    return Capacity(label, weights, budget, per_seq, conc, tokens, longest, budget >= per_seq > 0)


def plan(path: str | os.PathLike, gpu_mem: str | int = "32GiB", *, kv_dtype: str = "auto",
         max_model_len: int | None = None, gpu_memory_utilization: float = DEFAULT_UTILIZATION,
         reserve: str | int | None = None, max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS,
         max_num_seqs: int = DEFAULT_MAX_SEQS, bits: int = 8, group_size: int | None = None,
         symmetric: bool = True) -> PlanResult:
    """KV-cache capacity of ``path`` on one GPU with float tables and with the overlay.

    ``kv_dtype``: ``fp8``, ``bf16``/``fp16`` or ``auto`` (the model's dtype).
    ``max_model_len`` defaults to the config's ``max_position_embeddings``.
    ``reserve`` overrides the activation / non-torch estimate (bytes or ``"2GiB"``).
    ``bits`` / ``group_size`` / ``symmetric`` describe the overlay to estimate when the
    checkpoint has none yet.
    """
    p = Path(path)
    from embedq.format.checkpoint import Checkpoint
    ck = Checkpoint.open(p)
    if not 0 < gpu_memory_utilization <= 1:
        raise PlanError(f"--gpu-memory-utilization {gpu_memory_utilization}: expected a fraction in (0, 1]")
    mem = parse_bytes(gpu_mem)
    model_dtype = str((ck.config.get("text_config") or {}).get("dtype") or ck.config.get("dtype")
                      or ck.config.get("torch_dtype") or "bfloat16")
    kvd = model_dtype if kv_dtype == "auto" else kv_dtype
    if kvd not in KV_BYTES:
        raise PlanError(f"--kv-dtype {kv_dtype}: expected fp8, bf16, fp16 or auto")
    kvb = KV_BYTES[kvd]
    act_bytes = KV_BYTES.get(model_dtype, 2)
    layout = kv_layout(ck.config, state_bytes=act_bytes)
    max_len = int(max_model_len or layout.max_position_embeddings or 0)
    if max_len <= 0:
        raise PlanError(f"{p / 'config.json'}: no max_position_embeddings; pass --max-model-len")
    if max_num_batched_tokens < 1 or max_num_seqs < 1:
        raise PlanError("--max-num-batched-tokens and --max-num-seqs must be positive")
    w = weight_bytes(p, bits, group_size, symmetric)
    parts = estimate_reserve(layout, max_num_batched_tokens, max_num_seqs, act_bytes)
    if reserve is not None:
        parts = {"given": parse_bytes(reserve), "total": parse_bytes(reserve)}
    usable = int(mem * gpu_memory_utilization)
    tables = "float" if model_dtype in ("float32", "fp32") else model_dtype.replace("bfloat16", "BF16")
    before = _capacity(f"{tables} (float)", w["float"], usable, parts["total"], layout, kvb, max_len,
                       max_num_batched_tokens)
    after = _capacity(w["scheme"], w["quantized"], usable, parts["total"], layout, kvb, max_len,
                      max_num_batched_tokens)
    notes = list(layout.notes)
    if layout.max_position_embeddings and max_len > layout.max_position_embeddings:
        notes.append(f"--max-model-len {max_len} exceeds max_position_embeddings "
                     f"{layout.max_position_embeddings}: vLLM refuses it unless told to override")
    if not before.starts:
        notes.append(f"with float tables a {max_len}-token request does not fit: vLLM would refuse "
                     f"--max-model-len {max_len}")
    lay = asdict(layout)
    lay.pop("notes")
    return PlanResult(str(p), mem, gpu_memory_utilization, kvd, kvb, max_len, parts["total"], parts,
                      max_num_batched_tokens, layout.per_token_bytes(kvb), lay, w["scheme"],
                      w["overlay_source"], before, after, notes)


__all__ = ["plan", "PlanResult", "Capacity", "KVLayout", "kv_layout", "weight_bytes", "parse_bytes",
           "estimate_reserve", "PlanError"]
