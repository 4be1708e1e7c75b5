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


def build_tiny(class_name: str, model_type: str, path: Path, tie: bool | None = None) -> Path:
    """A tiny random checkpoint of ``class_name`` saved by transformers (bf16)."""
    import transformers as tf
    from transformers import AutoConfig
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type)
    targets = [cfg]
    for sub in ("text_config", "language_config", "llm_config"):
        c = getattr(cfg, sub, None)
        if c is not None and hasattr(c, "to_dict"):
            targets.append(c)
    for sub in ("vision_config", "audio_config", "vision_tower_config"):
        c = getattr(cfg, sub, None)
        if c is not None and hasattr(c, "to_dict"):
            for k, v in VISION.items():
                if hasattr(c, k):
                    setattr(c, k, v)
    for c in targets:
        for k, v in SMALL.items():
            if hasattr(c, k) or k in ("vocab_size", "hidden_size"):
                setattr(c, k, v)
        for k in ("layer_types", "mlp_layer_types"):  # per-layer lists (Step 3.7)
            if getattr(c, k, None) is not None:
                setattr(c, k, list(getattr(c, k))[: SMALL["num_hidden_layers"]])
        if tie is not None:
            c.tie_word_embeddings = tie
    cls = getattr(tf, class_name)
    with torch.device("meta"):  # count first: a config the shrinking missed can be huge
        n = sum(p.numel() for p in cls(cfg).parameters())
    if n > MAX_PARAMS:
        raise RuntimeError(f"{class_name}: tiny build still has {n / 1e6:.0f}M parameters")
    model = cls(cfg)
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    return path
