"""Tiny checkpoints of architectures whose saved embedding / head keys differ from their
module paths, enumerated from transformers' own conversion mapping (a uniquely named
helper module)."""

from __future__ import annotations

from pathlib import Path

import torch

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, depth=1,
              num_attention_heads=2, num_heads=2, image_size=32, patch_size=8, embed_dim=32)


def renamed_architectures() -> dict[str, tuple[str, dict[str, str]]]:
    """``{class|model_type: (class, {module param: saved key})}`` for every causal-LM /
    image-text-to-text / masked-LM class of the installed transformers whose input or output
    embedding is saved under another key than its module path (save_pretrained's reversed
    conversion mapping, computed live, not read from embedq's packaged table)."""
    from transformers.models.auto import modeling_auto as ma

    from embedq.jobs import archfacts
    out = {}
    for mapping in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                    "MODEL_FOR_MASKED_LM_MAPPING_NAMES"):
        for mt, names in getattr(ma, mapping, {}).items():
            for name in (names if isinstance(names, (list, tuple)) else [names]):
                cfg = {"architectures": [name], "model_type": mt}
                try:
                    cls = archfacts.model_class(cfg)
                    pair = archfacts.tied_pair(cls) if cls is not None else None
                    if pair is None:
                        continue
                    ren = archfacts.root_renamings(cls, mt)
                except Exception:
                    continue
                diff = {}
                for p in pair:
                    sp = archfacts.saved_spellings(p, ren)
                    if len(sp) > 1:
                        diff[p] = sp[1]
                if diff:
                    out[archfacts.class_key(cfg)] = (name, diff)
    return out


MAX_PARAMS = 30_000_000

# Expert counts and sizes (and the linear-attention heads of Qwen3.5's Gated DeltaNet), applied
# only to a build still over MAX_PARAMS after SMALL (Qwen3.5 MoE: 256 experts of
# moe_intermediate_size 512), so the architectures that already fit keep their expert layout;
# top-k stays <= the expert count.
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
           num_experts_per_tok=2, moe_k=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
           linear_key_head_dim=16, linear_value_head_dim=16)

_S, _F = "sliding_attention", "full_attention"
# What the generic shrink cannot derive, by the model_type of the (sub-)config it applies to.
OVERRIDES = {
    # Gemma 3n: the last num_kv_shared_layers layers reuse the K/V of the last unshared layer of
    # their type (transformers' kv_sharing_modes; vLLM takes "1 before sharing" for full, "2
    # before" for sliding), so every type must occur before and after the split: 4 layers,
    # 2 shared. The per-layer embedding table (vocab_size_per_layer_input x layers x
    # hidden_size_per_layer_input) is the size of the real vocabulary otherwise. Tied whatever
    # ``tie`` asks: every Gemma 3n checkpoint is, and vLLM's Gemma3nForCausalLM has no lm_head
    # (an untied build's lm_head.weight fails its loader: "no module or parameter named
    # 'lm_head'", embedq or not).
    "gemma3n_text": dict(num_hidden_layers=4, layer_types=[_S, _F, _S, _F], num_kv_shared_layers=2,
                         vocab_size_per_layer_input=256, hidden_size_per_layer_input=16,
                         tie_word_embeddings=True),
    # ERNIE 4.5 VL: the 3-D RoPE splits head_dim/2 into h, w, t sections; the defaults
    # ([22, 22, 20], vLLM's freq_allocation 20 = t) are for head_dim 128, SMALL's is 16.
    "ernie4_5_vl_moe_text": dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0,
                                                      mrope_section=[3, 3, 2]),
                                 freq_allocation=2),
    # Emu3: the image-token vocabulary map is read at construction (None by default) ...
    "emu3": dict(vocabulary_map={"<image>": 3, "<|extra_200|>": 4, "<|visual token 000000|>": 5,
                                 "<|visual token 000001|>": 6}),
    # ... and the VQ-VAE image tokenizer is a conv net of its own (GroupNorm of 32 groups).
    "emu3_vqgan": dict(base_channels=32, channel_multiplier=[1, 2], num_res_blocks=1,
                       codebook_size=16, hidden_size=32),
}


def _shrink(c, values: dict, per_layer: bool = False) -> None:
    """Set ``values`` on config ``c`` where it has the field, keeping a list a list (InternVL's
    image_size / patch_size, Gemma 3n's per-layer intermediate_size); then ``c``'s own
    override. With ``per_layer``, layer_types / mlp_layer_types (Step 3.7) and every other list
    as long as the old num_hidden_layers (Gemma 3n's activation_sparsity_pattern) are cut to
    the new count."""
    n0 = getattr(c, "num_hidden_layers", None)
    over = OVERRIDES.get(getattr(c, "model_type", None), {})
    for k, v in {**values, **over}.items():
        if not (hasattr(c, k) or k in ("vocab_size", "hidden_size") and per_layer or k in over):
            continue
        old = getattr(c, k, None)
        if isinstance(old, (list, tuple)) and not isinstance(v, (list, tuple)):
            v = [v] * len(old)
        setattr(c, k, v)
    if not per_layer:
        return
    n = getattr(c, "num_hidden_layers", SMALL["num_hidden_layers"])
    for k, v in list(vars(c).items()):
        if isinstance(v, (list, tuple)) and k not in over and (
                k in ("layer_types", "mlp_layer_types") or n0 != n and len(v) == n0):
            setattr(c, k, list(v)[:n])


def _count(cls, cfg) -> int:
    with torch.device("meta"):  # count first: a config the shrinking missed can be huge
        return sum(p.numel() for p in cls(cfg).parameters())


def build_tiny(class_name: str, model_type: str, path: Path, tie: bool | None = None,
               overrides: dict | None = None) -> Path:
    """A tiny random checkpoint of ``class_name`` saved by transformers (bf16); ``overrides``:
    fields set last on the (text) configs that have them (e.g. a per-layer width that sets a
    table's shape apart)."""
    import transformers as tf
    from transformers import AutoConfig
    torch.manual_seed(0)
    cls = getattr(tf, class_name)
    cfg = AutoConfig.for_model(model_type)
    targets = [cfg]
    for sub in ("text_config", "language_config", "llm_config"):
        c = getattr(cfg, sub, None)
        if c is not None and hasattr(c, "to_dict"):
            targets.append(c)
    for sub in ("vision_config", "audio_config", "vision_tower_config", "vq_config"):
        c = getattr(cfg, sub, None)
        if c is not None and hasattr(c, "to_dict"):
            _shrink(c, VISION)
    for c in targets:
        _shrink(c, SMALL, per_layer=True)
        if tie is not None and "tie_word_embeddings" not in OVERRIDES.get(c.model_type, {}):
            c.tie_word_embeddings = tie
        for k, v in (overrides or {}).items():
            if hasattr(c, k):
                setattr(c, k, v)
    want = getattr(cls, "config_class", None)  # Emu3ForCausalLM reads emu3's text_config only
    if isinstance(want, type) and not isinstance(cfg, want):
        cfg = next((c for c in targets if isinstance(c, want)), cfg)
    # Built from the config as config.json will read it back: fields a config derives in
    # __post_init__ (MistralLarge 4's head_dim = qk_rope_head_dim) then match the reload.
    built = type(cfg).from_dict(cfg.to_dict())
    n = _count(cls, built)
    if n > MAX_PARAMS:
        for c in targets:
            _shrink(c, MOE)
        built = type(cfg).from_dict(cfg.to_dict())
        n = _count(cls, built)
    if n > MAX_PARAMS:
        raise RuntimeError(f"{class_name}: tiny build still has {n / 1e6:.0f}M parameters")
    model = cls(built)
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    return path
