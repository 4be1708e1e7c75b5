"""`embedq onnx patch` / `onnx export` as real processes under kills, a full disk and a
read-only folder (the other verbs: tests/test_faults.py)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from faultutil import embedq, leftovers, one_error_line, read_only, sweep, tree, without_leftovers
from onnxutil import run_ort

pytest.importorskip("onnxruntime")  # the [onnx] extra; tests/onnx/conftest.py requires it in CI

KIND = "tied96"


@pytest.fixture(scope="module")
def inputs(float_model, overlay_for):
    ckpt, fpath = float_model(KIND)
    return ckpt, fpath, overlay_for(KIND, 4, 32, True)


def _ids():
    import torch
    return torch.arange(0, 40).reshape(2, 20) % 500


def _onnx_view(out):
    """All but leftovers and a data generation OUT does not read (a run killed between
    renaming the new data and renaming OUT: the old OUT still reads its own data)."""
    from embedq.backends.onnx.write import _referenced, data_generations

    def view(t):
        reads = _referenced(out) or set() if out.exists() else set()
        stray = {g for g in data_generations(out) if g not in reads}
        return {k: v for k, v in without_leftovers(t).items() if k not in stray}
    return view


def test_patch_new_file_killed_at_every_commit(inputs, tmp_path):
    _, fpath, ov = inputs
    dest = tmp_path / "out"
    out = dest / "m.onnx"
    args = ("onnx", "patch", fpath, "--overlay", ov, "-o", out, "--external-data")
    src_before = tree(fpath.parent)
    reset = lambda: shutil.rmtree(dest, ignore_errors=True)  # noqa: E731
    reset()
    assert embedq(*args).returncode == 0
    new = tree(dest)
    assert sorted(new) == ["m.onnx", "m.onnx.data"]
    assert sweep(args, dest, reset, {}, new, view=_onnx_view(out)) == 2  # data, then the model
    assert tree(fpath.parent) == src_before


def test_patch_in_place_killed_never_pairs_two_generations(inputs, tmp_path):
    """--force in place: after a kill at any step the model runs with its own data — the
    old float logits or the new patched ones — and a rerun leaves one model, one data file."""
    _, fpath, ov = inputs
    folder = tmp_path / "m"
    model = folder / "model.onnx"

    def reset():
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(fpath.parent, folder)
    reset()
    ids = _ids()
    old_logits = run_ort(model, ids)
    old = tree(folder)
    args = ("onnx", "patch", model, "--overlay", ov, "-o", model, "--force")
    assert embedq(*args).returncode == 0
    new = tree(folder)
    new_logits = run_ort(model, ids)
    assert sorted(new) == ["model.onnx", "model.onnx.1.data"]  # the other generation's name

    def runs_with_its_own_data(n):
        got = run_ort(model, ids)
        assert any(np.array_equal(got, ref) for ref in (old_logits, new_logits)), n
    def rerun_refused_and_cleans(at):
        # the graph is patched already: the rerun says so, and removes the old data
        # generation the kill left (named on one line)
        r = embedq(*args)
        one_error_line(r, "already patched")
        assert "leftover" in r.stderr, r.stderr
    assert sweep(args, folder, reset, old, new, view=_onnx_view(model),
                 extra=runs_with_its_own_data, after_switch=rerun_refused_and_cleans) == 2


def test_patch_full_disk_and_read_only(inputs, tmp_path):
    _, fpath, ov = inputs
    dest = tmp_path / "out"
    dest.mkdir()
    out = dest / "m.onnx"
    args = ("onnx", "patch", fpath, "--overlay", ov, "-o", out, "--external-data")
    one_error_line(embedq(*args, fsize=32 << 10), str(out), "File too large")
    assert tree(dest) == {}
    with read_only(dest):
        one_error_line(embedq(*args), str(dest))
    assert tree(dest) == {}
    assert embedq(*args).returncode == 0


def test_patch_garbage_model(inputs, tmp_path):
    _, _, ov = inputs
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage" * 50)
    one_error_line(embedq("onnx", "patch", bad, "--overlay", ov, "-o", tmp_path / "o.onnx"), str(bad))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.onnx"]


def test_export_killed_leaves_nothing_after_the_rerun(inputs, tmp_path):
    """A killed export's float model (its staging folder) is removed by the next run,
    which names it on one line; a full disk or a read-only folder is one error line
    naming the output, never the staging folder."""
    ckpt, _, ov = inputs
    dest = tmp_path / "e"
    dest.mkdir()
    out = dest / "model.onnx"
    args = ("onnx", "export", ckpt, "--overlay", ov, "-o", out, "--no-optimize")
    # killed with the float model exported (a full float copy in the staging folder);
    # the patch's own kills are test_patch_* above
    r = embedq(*args, kill_at="export-float")
    assert r.returncode == -9, r.stderr
    assert leftovers(dest) and not out.exists()
    r = embedq(*args)
    assert r.returncode == 0, r.stderr
    assert "leftover" in r.stderr and not leftovers(dest), r.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["model.onnx"]
    out.unlink()
    one_error_line(embedq(*args, fsize=64 << 10), str(out), "File too large")
    assert tree(dest) == {}
    with read_only(dest):
        one_error_line(embedq(*args), str(dest))
    assert tree(dest) == {}
