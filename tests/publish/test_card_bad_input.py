"""``embedq card`` / ``quantize --eval`` on hostile inputs: a README.md that is not UTF-8 or
leads out of the folder, eval JSON nested beyond the recursion limit or holding NaN /
Infinity, a quantization_config.json that cannot be read. One ``embedq: error:`` line, exit 2,
nothing read out of the folder or rewritten."""

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


def _garble(q, kind: str, monkeypatch) -> None:
    """Make the folder's quantization_config.json ``q`` unreadable in the way ``kind`` names."""
    q.unlink()
    if kind == "dir":
        q.mkdir()
    elif kind == "dangling link":
        q.symlink_to(q.parent / "gone.json")
    elif kind == "permission denied":
        q.write_text("{}")
        q.chmod(0)
        # root opens a mode-0 file anyway: refuse the open (the JSON reader's os.open) as the
        # kernel would for others
        import embedq.format.files as files
        real_open = files.os.open

        def denying_open(path, flags, *a, **kw):
            if str(path) == str(q):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *a, **kw)

        monkeypatch.setattr(files.os, "open", denying_open)
    else:
        q.write_text({"not JSON": "{nope", "empty": "", "a list": "[1, 2]", "a string": '"embedq"',
                      "NaN": '{"format_version": NaN}', "not an embedq config": '{"modules": {}}'}[kind])


@pytest.mark.parametrize("stdout", [False, True], ids=["write", "stdout"])
@pytest.mark.parametrize("kind,words", [
    ("not JSON", "not valid JSON"),
    ("empty", "not valid JSON"),
    ("a list", "expected a JSON object"),
    ("a string", "expected a JSON object"),
    ("NaN", "NaN is not JSON"),
    ("not an embedq config", "not 'embedq'"),
    ("dir", "a folder, not a JSON file"),
    ("dangling link", "not found"),
    ("permission denied", "cannot read it (Permission denied)"),
])
def test_unreadable_quantization_config(derive, monkeypatch, kind, words, stdout):
    """``embedq card`` on a folder whose quantization_config.json is unreadable: the line the
    other verbs give for it (parse_overlay_config's), the fix, exit 2; the card and every
    other file as they were."""
    from pubutil import snapshot
    _, out, _ = derive("qwen2_tied", overlay_only=True)
    q = out / "quantization_config.json"
    before = {k: v for k, v in snapshot(out).items() if k != q.name}
    _garble(q, kind, monkeypatch)
    res = runner.invoke(app, ["card", str(out), *(["--stdout"] if stdout else [])])
    refused(res, str(q), words, "README.md left as it was", "embedq quantize --output")
    if kind == "permission denied":
        q.chmod(0o644)
    assert {k: v for k, v in snapshot(out).items() if k != q.name} == before
    with pytest.raises(CardError, match=words.replace("(", r"\(").replace(")", r"\)")):
        refresh_card(out, write=False)


def test_quantization_config_missing_is_not_refused(derive):
    """No quantization_config.json at all: the card's stored state is enough (unchanged)."""
    _, out, _ = derive("qwen2_tied", overlay_only=True)
    (out / "quantization_config.json").unlink()
    res = runner.invoke(app, ["card", str(out), "--stdout"])
    assert res.exit_code == 0, res.output
