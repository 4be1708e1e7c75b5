"""Helpers for the quality tests: dequantized reference models, overlay byte counts,
a tiny byte-level tokenizer for the tiny checkpoints."""

from __future__ import annotations

import struct
from pathlib import Path

import torch

import embedq
from embedq.backends.transformers import resolve_targets


def overlay_tensor_bytes(folder: Path) -> int:
    """Sum of the overlay's tensor bytes (file size minus header)."""
    f = Path(folder) / "embedq.safetensors"
    with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
    return f.stat().st_size - 8 - n


def dequantized_reference(source: Path, overlay: Path, model_class, dtype=torch.bfloat16):
    """The float model of ``source`` whose target weights are replaced by the overlay's
    dequantized tables (each module gets its own parameter: a head with its own table
    is untied from the embedding)."""
    from embedq.quality.evaluate import load_reference
    ov = embedq.load_overlay(overlay)
    ref = load_reference(Path(source), model_class, dtype)  # float: embedq config stripped
    with torch.no_grad():
        for mname, (owner, _) in resolve_targets(ref, ov.config).items():
            mod = ref.get_submodule(mname)
            mod.weight = torch.nn.Parameter(ov.tables[owner].dequantize(mod.weight.dtype).clone(),
                                            requires_grad=False)
    return ref


def add_tokenizer(folder: Path, vocab_size: int, bos: str = "<bos>") -> None:
    """Train a small byte-level BPE on Python's bundled docs and save it into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from embedq.quality.evaluate import default_text
    text, _ = default_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[bos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i:i + 4096] for i in range(0, 200_000, 4096)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos)
    assert len(fast) <= vocab_size
    fast.save_pretrained(str(folder))


def set_table(folder: Path, tensor: str, value: torch.Tensor) -> None:
    """Replace one tensor of a single-file checkpoint (same shape and dtype)."""
    from safetensors.torch import load_file, save_file
    f = Path(folder) / "model.safetensors"
    sd = load_file(str(f))
    assert sd[tensor].shape == value.shape
    sd[tensor] = value.to(sd[tensor].dtype).contiguous()
    save_file(sd, str(f), metadata={"format": "pt"})
