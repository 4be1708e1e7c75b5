"""llama.cpp itself (node-llama-cpp 3.21.1, prebuilt CPU binary) loads what ``embedq gguf``
writes: Gemma 3 270M with Q8_0 / Q4_0 tables agrees with BASE on greedy tokens, a
nibble-swapped file does not; the tiny untied model's output.weight is read.
The fixture runs scripts/setup_llamacpp.sh (cached); skipped only when it fails
(tests/clients.py: a failure under CI)."""

from __future__ import annotations

import shutil

import pytest

from ggufutil import generate, negate_q8_0, swap_q4_0_nibbles

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "The three primary colors are", "Once upon a time,", "The largest planet in the solar system is"]
STEPS = 3


def _first(runs, path):
    return [r["tokens"] for r in next(x for x in runs if x["model"] == str(path))["results"]]


@pytest.mark.slow
def test_gemma_generates(llamacpp, gemma_gguf, gemma_outs, tmp_path):
    swapped = tmp_path / "swapped.gguf"
    shutil.copy(gemma_outs[4], swapped)
    swap_q4_0_nibbles(swapped, "token_embd.weight")
    models = [gemma_gguf, gemma_outs[8], gemma_outs[4], gemma_outs["4h8"], swapped]
    runs = generate(llamacpp, models, PROMPTS, STEPS, tmp_path)
    base, q8, q4, q4h8, bad = (_first(runs, m) for m in models)
    assert all(len(t) == STEPS for t in base), base
    agree = lambda x: sum(a[0] == b[0] for a, b in zip(x, base))  # noqa: E731
    # first tokens equal to BASE's, measured on this machine (AMD EPYC Zen 3): int8 table
    # 6/6, Q4_0 table 5/6, nibble-swapped Q4_0 0/6 (garbage); one near-tie of slack each
    assert agree(q8) >= len(PROMPTS) - 1, (q8, base)
    assert agree(q4) >= len(PROMPTS) - 2, (q4, base)
    # Q4_0 table + the added Q8_0 output.weight (llama.cpp's own shape)
    assert agree(q4h8) >= len(PROMPTS) - 1, (q4h8, base)
    assert agree(bad) <= 1, (bad, base)


def test_untied_head_is_read(llamacpp, tiny, tiny_overlays, tmp_path):
    """OUT with the 8-bit head as output.weight generates; negating output.weight (exactly:
    every block's scale sign) changes the greedy tokens, so llama.cpp reads that tensor."""
    import embedq
    _, base = tiny
    out = tmp_path / "out.gguf"
    embedq.gguf(base, tiny_overlays["q4"], out)
    neg = tmp_path / "neg.gguf"
    shutil.copy(out, neg)
    negate_q8_0(neg, "output.weight")
    prompts = ["hello world", "abc"]
    runs = generate(llamacpp, [out, neg], prompts, 6, tmp_path)
    a, b = _first(runs, out), _first(runs, neg)
    assert all(len(t) > 0 for t in a)
    assert a != b
