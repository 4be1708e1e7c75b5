"""``embedq card`` / ``quantize --eval`` on hostile inputs: a README.md that is not UTF-8 or
leads out of the folder, eval JSON nested beyond the recursion limit or holding NaN /
Infinity. One ``embedq: error:`` line, exit 2, nothing read out of the folder or rewritten."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from embedq.cli import app
from embedq.jobs.card import CardError, refresh_card

from pubutil import derive  # noqa: F401 (fixture)
from ckptutil import refused

runner = CliRunner()


def test_readme_not_utf8(derive):
    _, out, _ = derive("qwen2_tied")
    card = out / "README.md"
    card.write_bytes(b"---\nlicense: mit\n---\n\xff\xfe caf\xe9\n")
    before = card.read_bytes()
    refused(runner.invoke(app, ["card", str(out)]), str(card), "not UTF-8")
    assert card.read_bytes() == before


def test_readme_link_out_of_the_folder(derive, tmp_path):
    _, out, _ = derive("qwen2_tied")
    outside = tmp_path / "elsewhere.md"
    outside.write_text((out / "README.md").read_text())  # a valid embedq card, but not this folder's
    (out / "README.md").unlink()
    (out / "README.md").symlink_to(outside)
    before = outside.read_text()
    refused(runner.invoke(app, ["card", str(out)]), "README.md", "link leading out of the folder")
    assert (out / "README.md").is_symlink() and outside.read_text() == before


@pytest.mark.parametrize("body,words", [
    ("[" * 100000 + "]" * 100000, "not valid JSON"),
    ('{"mean_kld": NaN}', "NaN"),
    ('{"mean_kld": Infinity}', "Infinity"),
    ('{"mean_kld": -Infinity}', "Infinity"),
    ('{"mean_kld": 1e999}', "non-finite"),
])
def test_bad_eval_json(derive, model_factory, tmp_path, body, words):
    _, out, _ = derive("qwen2_tied")
    f = tmp_path / "ev.json"
    f.write_text(body)
    before = (out / "README.md").read_bytes()
    refused(runner.invoke(app, ["card", str(out), "--eval", str(f)]), str(f), words)
    assert (out / "README.md").read_bytes() == before
    src = model_factory("qwen2_tied")
    res = runner.invoke(app, ["quantize", str(src), "--output", str(tmp_path / "o"), "--eval", str(f), "-q"])
    refused(res, str(f), words)
    assert not (tmp_path / "o").exists()


def test_api_eval_values_must_be_finite(derive):
    _, out, _ = derive("qwen2_tied")
    with pytest.raises(CardError, match="non-finite"):
        refresh_card(out, eval_results={"mean_kld": math.nan}, write=False)
    deep: list = []
    for _ in range(100000):
        deep = [deep]
    with pytest.raises(CardError, match="nested too deeply"):
        refresh_card(out, eval_results=deep, write=False)
