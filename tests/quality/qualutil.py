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


# The rounding bound of a quantized head against the dequantized reference, per logit j.
# The reference rounds every weight q*s to the activation dtype, w = q*s*(1+d) with
# |d| <= u (bf16: u = 2^-8; fp16: 2^-11), then sums x_i*w_i in float32 and rounds the
# result to the activation dtype. The serving fast path sums x_i*q_i*s in float32 (the
# scale applied after the dot product or per group) and rounds once. So, with
# S_j = sum_i |x_i| |w_ji| and g = n*2^-24 (a float32 sum of n terms, either order):
#     |a_j - b_j| <= (u/(1-u) + 2g) * S_j + u * (|a_j| + |b_j|)
# (x is the head's input, the same in both models: the quantized embedding returns the
# reference table's rows bit for bit). float32 activations: u = 2^-24, the same bound (the
# kernels' products are exact, their float32 sums run in another order: the AMX kernel sums
# 3 exact bf16 parts of x in tiles; see test_fastpath_x86).
def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def logit_bound(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-logit bound of :func:`assert_logits_match` for head input ``x`` and weight ``w``."""
    u = _unit_roundoff(a.dtype)
    n = x.shape[-1]
    g = n * 2.0 ** -24
    s = x.float().abs() @ w.float().abs().t()
    s = s[..., : a.shape[-1]] * (1 + g)  # S itself is a float32 sum
    return (u / (1 - u) + 2 * g) * s + u * (a.float().abs() + b.float().abs())


def head_operands(model, ids: torch.Tensor):
    """``(logits, x, w)`` of one forward: the logits, the head's input and the head's weight."""
    head = model.get_output_embeddings()
    seen = []
    hook = head.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        hook.remove()
    w = head.weight if hasattr(head, "weight") and head.weight is not None else head.table.dequantize(logits.dtype)
    return logits, seen[-1], w


def assert_logits_match(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Fast-path logits ``a`` against the dequantized reference's ``b`` (head input ``x``,
    the reference head's weight ``w``), within :func:`logit_bound`."""
    assert a.dtype == b.dtype and a.shape == b.shape
    tol = logit_bound(x, w, a, b)
    d = (a.float() - b.float()).abs()
    bad = d > tol
    assert not bad.any(), (f"{int(bad.sum())} logits beyond the rounding bound; max diff {d.max():.4g}, "
                           f"worst diff/bound {(d / tol).max():.3g}")


def assert_model_logits_match(model, ref, ids: torch.Tensor) -> None:
    """The quantized model's logits against the reference's, on ``ids``."""
    a, xa, _ = head_operands(model, ids)
    b, xb, w = head_operands(ref, ids)
    assert torch.equal(xa, xb), "the head inputs differ: the bound assumes identical embeddings and body"
    assert_logits_match(a, b, xb, w)


@torch.no_grad()
def assert_same_greedy(model, ref, ids: torch.Tensor, new_tokens: int) -> None:
    """Greedy tokens equal the reference's, except where the reference's own top-2 margin
    is within twice the rounding bound of :func:`logit_bound` (a genuine near-tie)."""
    out = ref.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    la = head_operands(model, out)[0][:, ids.shape[1] - 1:-1].float()
    lb, x, w = head_operands(ref, out)
    lb, x = lb[:, ids.shape[1] - 1:-1], x[:, ids.shape[1] - 1:-1]
    tol = logit_bound(x, w, la.to(lb.dtype), lb)
    want = out[:, ids.shape[1]:]
    got = la.argmax(-1)
    lb = lb.float()
    # a differing token is a near-tie: the reference prefers `want` over `got` by no more
    # than the two logits' bounds together
    margin = (lb.gather(-1, want[..., None]) - lb.gather(-1, got[..., None]))[..., 0]
    slack = (tol.gather(-1, want[..., None]) + tol.gather(-1, got[..., None]))[..., 0]
    ok = (got == want) | (margin <= slack)
    assert ok.all(), f"greedy differs at {(~ok).nonzero().tolist()} with margins {margin[~ok].tolist()}"
