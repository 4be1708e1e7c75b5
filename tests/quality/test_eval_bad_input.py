"""``embedq eval`` / :func:`embedq.evaluate` on bad input: a tokenizer larger than the table,
a device this machine lacks, out-of-range or mistyped ``bos`` / ``tokens`` / ``bootstrap``.
A typed EvalError (one ``embedq: error:`` line from the CLI), never torch's IndexError."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import embedq
from embedq.cli import app
from embedq.quality.evaluate import EvalError
from qualutil import add_tokenizer
from ckptutil import refused

TOKENS = list(range(3, 73))
runner = CliRunner()


@pytest.fixture
def q8(model_factory):
    src = model_factory("qwen2_tied")  # 512-row table
    embedq.quantize(src, bits=8, progress=False)
    return src


def test_tokenizer_larger_than_the_table(q8, tmp_path):
    add_tokenizer(q8, 1500)  # ids up to ~1500 on a 512-row table
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"The {i}th line says something about Python {i % 13}." for i in range(300)))
    res = runner.invoke(app, ["eval", str(q8), "--text", str(text), "--contexts", "2", "--length", "16"])
    refused(res, str(q8), "the tokenizer and the model disagree", "512 rows")


@pytest.mark.parametrize("device,words", [
    ("bogus", "not a torch device"), ("meta", "not available"),
    pytest.param("cuda", "no CUDA GPU", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")),
])
def test_device_checked_up_front(q8, device, words):
    res = runner.invoke(app, ["eval", str(q8), "--device", device, "-q"])
    refused(res, str(q8), f"--device {device}" if device != "bogus" else "'bogus'", words)


@pytest.mark.parametrize("kw,words", [
    ({"bos": 99999}, "token id 99999"),
    ({"bos": -1}, "bos=-1"),
    ({"bos": "x"}, "bos='x'"),
    ({"tokens": [[9999] * 70]}, "token id 9999"),
    ({"tokens": [-5] * 70}, "token id -5"),
    ({"tokens": ["a", "b"]}, "tokens: not a list"),
    ({"bootstrap": -1}, "bootstrap=-1"),
])
def test_api_bad_arguments_are_typed(q8, kw, words):
    args = {"tokens": TOKENS, "contexts": 3, "length": 8, "bos": 1, "progress": False, **kw}
    with pytest.raises(EvalError, match="") as e:
        embedq.evaluate(q8, **args)
    assert words in str(e.value) and str(q8) in str(e.value)
