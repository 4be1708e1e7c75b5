"""``embedq demo --dir D``: a bad scheme is refused before the 32k-vocab model is built, and
a ``D/demo-model`` that demo did not make (a user's checkpoint, its overlay) is never
re-quantized in place. One ``embedq: error:`` line, exit 2, the folder untouched."""

from __future__ import annotations

import shutil

import pytest

from typer.testing import CliRunner

import embedq
from ckptutil import refused, snapshot
from embedq.cli import app
from embedq.cli.demo import DEMO_MARKER

runner = CliRunner()


def test_bad_bits_builds_nothing(tmp_path):
    refused(runner.invoke(app, ["demo", "--bits", "3", "--dir", str(tmp_path)]), "3")
    assert not (tmp_path / "demo-model").exists()


def test_a_users_checkpoint_is_not_requantized(model_factory, tmp_path):
    mine = tmp_path / "demo-model"
    shutil.copytree(model_factory("qwen2_tied"), mine)
    embedq.quantize(mine, bits=4, progress=False)  # the user's own overlay
    before = snapshot(mine)
    refused(runner.invoke(app, ["demo", "--dir", str(tmp_path)]), str(mine), "not made by `embedq demo`")
    assert snapshot(mine) == before


def test_demo_reuses_its_own_folder(tmp_path):
    d = tmp_path / "new" / "dir"  # made as needed
    r = runner.invoke(app, ["demo", "--dir", str(d)])
    assert r.exit_code == 0, r.output
    assert (d / "demo-model" / DEMO_MARKER).is_file()
    r = runner.invoke(app, ["demo", "--dir", str(d), "--bits", "4"])
    assert r.exit_code == 0, r.output
    assert "int4" in r.stdout


def test_an_interrupted_build_leaves_no_half_model(tmp_path, monkeypatch):
    """Ctrl-C while the model is saved: no demo-model without its marker stays behind (it
    would be refused as a user's folder), and the next run builds and quantizes it."""
    import embedq.cli.demo as demo
    real = demo.build_demo_model

    def interrupted(path, seed=0):
        real(path, seed)
        raise KeyboardInterrupt
    monkeypatch.setattr(demo, "build_demo_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == []
    monkeypatch.undo()
    assert runner.invoke(app, ["demo", "--dir", str(tmp_path)]).exit_code == 0
    assert (tmp_path / "demo-model" / DEMO_MARKER).is_file()


def test_a_killed_builds_staging_folder_is_removed_and_announced(tmp_path):
    """A kill (no Ctrl-C handler runs) mid-build leaves demo's staging folder,
    ``.embedq-demo-<pid>-<token>``; the next run removes it and says so on one line, as every
    writing verb does with its leftovers (docs/usage.md, Safety)."""
    import subprocess
    import sys
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f".embedq-demo-{dead.pid}-0a1b2c3d"
    (left / "m").mkdir(parents=True)
    (left / "m" / "config.json").write_text("{}")
    r = runner.invoke(app, ["demo", "--dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert not left.exists()
    lines = [ln for ln in r.output.splitlines() if "leftover(s) of an interrupted run" in ln]
    assert len(lines) == 1 and left.name in lines[0], r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-model"]
