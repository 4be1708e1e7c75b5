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
        for mname, (owner, _) in resolve_targets(ref, ov.parsed).items():
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


# The serving fast path (embedq.kernels: torch's weight-only int8/int4 kernels)
# applies the scale after the float32 dot product, where the dequantized reference first
# rounds every weight q*s to the activation dtype (bf16: relative 2^-9) and then
# accumulates. Each logit therefore differs by at most ~2^-8 * sum_i |x_i w_i| plus one
# output rounding; sum_i |x_i w_i| is bounded here by a small multiple of the row's largest
# logit (tiny models: hidden <= 1024). The float32 path is bit-exact (see test_fastpath).
def assert_logits_match(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.float32:
        assert torch.equal(a, b)
        return
    a, b = a.float(), b.float()
    tol = 2 ** -5 * b.abs().amax(-1, keepdim=True) + 2 ** -7 * b.abs()
    bad = (a - b).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} logits beyond the rounding bound; max diff {(a - b).abs().max():.4g}"


@torch.no_grad()
def assert_same_greedy(model, ref, ids: torch.Tensor, new_tokens: int) -> None:
    """Greedy tokens equal the reference's, except where the reference's own top-2 margin
    is within the rounding bound of :func:`assert_logits_match` (a genuine near-tie)."""
    out = ref.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    la = model(out).logits[:, ids.shape[1] - 1:-1].float()
    lb = ref(out).logits[:, ids.shape[1] - 1:-1].float()
    want = out[:, ids.shape[1]:]
    got = la.argmax(-1)
    top2 = lb.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    tol = 2 * (2 ** -5 * lb.abs().amax(-1) + 2 ** -7 * top2[..., 0].abs())
    ok = (got == want) | (margin <= tol)
    assert ok.all(), f"greedy differs at {(~ok).nonzero().tolist()} with margins {margin[~ok].tolist()}"
