"""What a model's config.json says about its KV cache (:func:`kv_layout`), read as vLLM
0.33.0's model classes read it; no defaults invented."""

from __future__ import annotations

from dataclasses import dataclass, field

from embedq.errors import EmbedqError

VLLM_VERSION = "0.33.0"  # the vLLM whose rules embedq plan follows
GiB = 1 << 30
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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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


MODEL_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "half": 2, "float": 4, "bf16": 2, "fp16": 2,
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
        state = gdn_state_bytes(**lin, conv_bytes=MODEL_DTYPE_BYTES[conv_dt],
                                ssm_bytes=MODEL_DTYPE_BYTES[ssm_dt])
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



__all__ = ["KVLayout", "kv_layout", "gdn_state_bytes", "PlanError", "VLLM_VERSION", "GiB",
           "MODEL_DTYPE_BYTES", "cdiv"]
