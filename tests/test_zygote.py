"""The fault tests' runs are forks of a server that imported embedq once (tests/zygote.py):
each must end as a fresh ``python -m embedq.cli`` does — exit status, stdout, stderr, a kill
point's signal, a timeout."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from faultutil import embedq, tree


def _both(monkeypatch, *args, **kw):
    """(the forked run, a fresh interpreter's run) of the same command."""
    forked = embedq(*args, **kw)
    with monkeypatch.context() as m:
        m.setenv("EMBEDQ_TEST_FORK", "0")
        fresh = embedq(*args, **kw)
    return forked, fresh


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("llama_untied_sharded")


def test_bad_input_ends_alike(monkeypatch, tmp_path):
    forked, fresh = _both(monkeypatch, "quantize", tmp_path / "missing", "-q")
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == 2 and forked.stderr.startswith("embedq: error:")


def test_a_run_ends_alike(monkeypatch, model, tmp_path):
    outs = []
    out = tmp_path / "out"  # the same name: the card names its folder
    for fork in ("1", "0"):
        monkeypatch.setenv("EMBEDQ_TEST_FORK", fork)
        shutil.rmtree(out, ignore_errors=True)
        r = embedq("quantize", model, "-q", "--lm-head", "--output", out, "--json")
        assert r.returncode == 0, r.stderr
        outs.append((tree(out), r.stdout.count("\n")))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("sig,code", [("KILL", -9), ("INT", 130)])
def test_kill_points_end_alike(monkeypatch, model, tmp_path, sig, code):
    for fork in ("1", "0"):
        monkeypatch.setenv("EMBEDQ_TEST_FORK", fork)
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        r = embedq("quantize", model, "-q", "--lm-head", "--output", tmp_path / "out",
                   kill_at="committed:1", sig=sig)
        assert r.returncode == code and "Traceback" not in r.stderr, (fork, r.returncode, r.stderr)


def test_timeout(model, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        embedq("quantize", model, "-q", "--lm-head", "--output", tmp_path / "out", timeout=0)
    assert embedq("quantize", tmp_path / "missing", "-q").returncode == 2  # the server lives on
