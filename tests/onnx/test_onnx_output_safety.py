"""`embedq onnx patch` / `onnx export` write only the outputs they name: never an input, a
foreign folder or data file, even with --force; a refusal is one line and leaves no trace."""

from __future__ import annotations

import json
import shutil

import pytest

import embedq
from faultutil import embedq as run, one_error_line, tree
from onnxutil import build_checkpoint

pytest.importorskip("onnxruntime")

KIND = "tied96"


@pytest.fixture(scope="module")
def inputs(float_model, overlay_for):
    ckpt, fpath = float_model(KIND)
    return ckpt, fpath, overlay_for(KIND, 4, 32, True)


def _genai(fpath, folder):
    """A minimal onnxruntime-genai folder: the float model, genai_config.json, a tokenizer."""
    shutil.copytree(fpath.parent, folder)
    (folder / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "model.onnx"}}}))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_genai_force_replaces_only_an_earlier_output(inputs, tmp_path):
    from embedq.backends.onnx.genai import is_genai_output
    _, fpath, ov = inputs
    parent = tmp_path / "parent"
    src = _genai(fpath, parent / "gsrc")
    (parent / "notes.txt").write_text("mine")
    before, ov_before = tree(parent), tree(ov)
    for out, says in [(parent, "holds the input folder"), (ov, "is the overlay"),
                      (src / "sub", "is inside the input folder"), (ov / "q", "is inside the overlay")]:
        one_error_line(run("onnx", "patch", src, "--overlay", ov, "-o", out, "--force"), str(out), says)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    one_error_line(run("onnx", "patch", src, "--overlay", ov, "-o", foreign, "--force"),
                   str(foreign), "not a genai folder embedq patched")
    assert tree(parent) == before and tree(ov) == ov_before and (foreign / "keep.txt").read_text() == "mine"
    assert not (src / "sub").exists() and not (ov / "q").exists()
    # a new folder, then the same again with --force (an earlier output), then an empty one
    out = tmp_path / "new" / "q"
    assert run("onnx", "patch", src, "--overlay", ov, "-o", out).returncode == 0
    first = tree(out)
    r = run("onnx", "patch", src, "--overlay", ov, "-o", out, "--force")
    assert r.returncode == 0, r.stderr
    assert tree(out) == first
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("onnx", "patch", src, "--overlay", ov, "-o", empty, "--force").returncode == 0
    assert tree(parent) == before and tree(ov) == ov_before
    inplace = shutil.copytree(src, tmp_path / "inplace")  # in place with --force: still allowed
    r = run("onnx", "patch", inplace, "--overlay", ov, "-o", inplace, "--force")
    assert r.returncode == 0 and is_genai_output(inplace), r.stderr


def test_genai_folder_reads_stay_inside(inputs, tmp_path):
    """docs/security.md 14: a genai folder is read (and copied into OUT) whole, so a link in it
    leading out, or a decoder named outside it, is refused before anything is read or written."""
    _, fpath, ov = inputs
    src = _genai(fpath, tmp_path / "g")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "tokenizer.json").write_text('{"secret": true}')
    shutil.copy(src / "model.onnx", elsewhere / "model.onnx")
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(elsewhere / "tokenizer.json")
    before, outside = tree(src), tree(elsewhere)
    one_error_line(run("onnx", "patch", src, "--overlay", ov, "-o", tmp_path / "o1"), "tokenizer.json",
                   "link leading out")
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").write_text("{}")
    for decoder in ("../elsewhere/model.onnx", str(elsewhere / "model.onnx")):
        (src / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": decoder}}}))
        one_error_line(run("onnx", "patch", src, "--overlay", ov, "-o", tmp_path / "o2"),
                       str(src / "genai_config.json"), "decoder")
    assert tree(elsewhere) == outside
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    assert {k: v for k, v in tree(src).items() if k not in ("tokenizer.json", "genai_config.json")} == \
        {k: v for k, v in before.items() if k not in ("tokenizer.json", "genai_config.json")}


def test_new_output_leaves_unrelated_data_files(inputs, tmp_path):
    _, fpath, ov = inputs
    o2 = tmp_path / "o2"
    o2.mkdir()
    (o2 / "m.onnx.data").write_bytes(b"someone else's")
    (o2 / "m.onnx.1.data").write_bytes(b"someone else's too")
    before = tree(o2)
    out = o2 / "m.onnx"
    one_error_line(run("onnx", "patch", fpath, "--overlay", ov, "-o", out), str(o2 / "m.onnx.data"), "--force")
    assert tree(o2) == before
    r = run("onnx", "patch", fpath, "--overlay", ov, "-o", out, "--no-external-data")
    assert r.returncode == 0, r.stderr
    assert {k: v for k, v in tree(o2).items() if k != "m.onnx"} == before
    out.unlink()
    r = run("onnx", "patch", fpath, "--overlay", ov, "-o", out, "--force")  # may replace m.onnx.data
    assert r.returncode == 0, r.stderr
    assert tree(o2)["m.onnx.1.data"] == before["m.onnx.1.data"]


def test_output_that_is_an_input_file_is_refused(inputs, tmp_path):
    ckpt, fpath, ov = inputs
    src = tmp_path / "src"
    shutil.copytree(fpath.parent, src)
    model = tmp_path / "model"
    shutil.copytree(ckpt, model)
    before = {p: tree(p) for p in (src, model, ov)}
    for out in (src / "model.onnx.data", ov / "embedq.safetensors", ov / "quantization_config.json"):
        one_error_line(run("onnx", "patch", src / "model.onnx", "--overlay", ov, "-o", out, "--force"),
                       str(out), "input")
    one_error_line(run("onnx", "export", model, "--overlay", ov, "-o", model / "config.json", "--force"),
                   str(model / "config.json"), "input")
    assert {p: tree(p) for p in (src, model, ov)} == before


def test_export_wrong_overlay_fails_first_in_one_line(inputs, tmp_path):
    ckpt, _, _ = inputs
    other = build_checkpoint(KIND, tmp_path / "other", seed=3)
    embedq.quantize(other, bits=4, group_size=32, progress=False)  # in place: another model's overlay
    out = tmp_path / "new" / "a" / "b" / "out.onnx"
    r = run("onnx", "export", ckpt, "--overlay", other, "-o", out, "--no-optimize")
    line = one_error_line(r, "differs from the overlay's source")
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1, r.stderr
    assert "float.onnx" not in line and not (tmp_path / "new").exists()


def test_export_error_after_the_export_names_the_model(inputs, tmp_path, monkeypatch):
    """An error about the float graph (a staging file, gone with its folder) names the
    model; the folders the export made are removed; loading shows no progress bar."""
    import embedq.backends.onnx.export as export_mod
    from embedq.backends.onnx import OnnxError
    ckpt, _, ov = inputs

    def refuse(fpath, *a, **k):
        raise OnnxError(f"{fpath}: no Gather reads a float table")
    monkeypatch.setattr(export_mod, "patch_model", refuse)
    out = tmp_path / "new" / "a" / "out.onnx"
    with pytest.raises(OnnxError) as e:
        export_mod.export_model(ckpt, out, overlay=ov, optimize=False)
    assert str(e.value).startswith(f"{ckpt}: no Gather") and not (tmp_path / "new").exists()
    monkeypatch.undo()
    r = run("onnx", "export", ckpt, "--overlay", ov, "-o", out, "--no-optimize")
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_single_file_patch_to_a_folder_is_refused(inputs, tmp_path):
    _, fpath, ov = inputs
    d = tmp_path / "d"
    d.mkdir()
    (d / "x").write_text("mine")
    one_error_line(run("onnx", "patch", fpath, "--overlay", ov, "-o", d, "--force", "--external-data"),
                   str(d), "is a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"] and tree(d) == {"x": tree(d)["x"]}


def test_failed_model_rename_takes_the_new_data_back(inputs, tmp_path, monkeypatch):
    """Data renamed, then the model's rename fails: the old state stays (no new data file)."""
    from embedq.backends.onnx import patch_model
    from embedq.errors import EmbedqError
    from embedq.format import staging
    _, fpath, ov = inputs
    out = tmp_path / "o" / "m.onnx"
    real = staging.commit

    def commit(tmp, path):
        if path == out:
            raise OSError(28, "No space left on device", str(tmp))
        real(tmp, path)
    monkeypatch.setattr(staging, "commit", commit)
    with pytest.raises(EmbedqError, match="cannot write"):
        patch_model(fpath, ov, out, external_data=True)
    assert not (tmp_path / "o").exists()


def test_force_replaces_its_own_output_in_the_overlay_folder(inputs, tmp_path):
    """An in-place overlay's folder is the model's: an earlier `onnx export` / `onnx patch`
    output there is an output, not an input, so --force replaces it (only the overlay's
    configs and tensors file are inputs)."""
    ckpt, fpath, ov = inputs
    model = shutil.copytree(ckpt, tmp_path / "model")
    embedq.quantize(model, bits=4, group_size=32, progress=False)  # in place
    out = model / "model.onnx"
    for _ in range(2):  # a new output, then the same again with --force
        r = run("onnx", "export", model, "-o", out, "--no-optimize", "--force")
        assert r.returncode == 0, r.stderr
    # every other file of the folder is an input: the float shards, the backup under .embedq/
    # (remove needs it), a shard the index names in a sub-folder
    shard = next(p for p in model.glob("*.safetensors") if p.name != "embedq.safetensors")
    (model / "sub").mkdir()
    (model / "sub" / "extra.json").write_text("{}")
    before = tree(model)
    for victim in (shard, model / ".embedq" / "state.json", model / "sub" / "extra.json"):
        assert victim.is_file()
        one_error_line(run("onnx", "export", model, "-o", victim, "--no-optimize", "--force"), str(victim), "input")
        one_error_line(run("onnx", "patch", fpath, "--overlay", model, "-o", victim, "--force"), str(victim), "input")
    assert tree(model) == before
    bundle = shutil.copytree(ov, tmp_path / "bundle")
    out = bundle / "model.onnx"
    for _ in range(2):
        r = run("onnx", "patch", fpath, "--overlay", bundle, "-o", out, "--force")
        assert r.returncode == 0, r.stderr
    for name in ("embedq.safetensors", "quantization_config.json"):  # still refused
        one_error_line(run("onnx", "patch", fpath, "--overlay", bundle, "-o", bundle / name, "--force"),
                       str(bundle / name), "input")


def test_genai_in_place_with_the_overlay_inside(inputs, tmp_path):
    """In place only the decoder and its data are rewritten: an overlay kept in the genai
    folder (G/embedq) is no reason to refuse, and stays as it was."""
    from embedq.backends.onnx.genai import is_genai_output
    _, fpath, ov = inputs
    g = _genai(fpath, tmp_path / "g")
    inner = shutil.copytree(ov, g / "embedq")
    before = tree(inner)
    r = run("onnx", "patch", g, "--overlay", inner, "-o", g, "--force")
    assert r.returncode == 0 and is_genai_output(g), r.stderr
    assert tree(inner) == before
