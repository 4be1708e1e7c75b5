"""Issue #25: reads are confined to the model folder like writes. A downloaded folder
whose index, links or ONNX graph name files elsewhere on the disk must not make embedq
read them (and write their content into an overlay that gets published): refused with
one line naming the file and entry, nothing written, the source untouched. The Hugging
Face cache layout (snapshot files linking into the same repository's ``blobs/``) works.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

import embedq
from embedq.errors import EmbedqError, UnsafePathError
from embedq.format.files import inside, name_problem
from secutil import assert_refused, run_cli, tree

INDEX = "model.safetensors.index.json"


@pytest.fixture
def victim(model_factory, tmp_path):
    """A sharded llama in ``tmp/victim``; its index as a dict."""
    src = model_factory("llama_untied_sharded")
    v = tmp_path / "victim"
    shutil.move(src, v)
    return v, json.loads((v / INDEX).read_text())


def _embedding_shard(index: dict) -> str:
    return index["weight_map"]["model.embed_tokens.weight"]


def _point_index(v: Path, index: dict, shard: str, new: str) -> None:
    for k, f in index["weight_map"].items():
        if f == shard:
            index["weight_map"][k] = new
    (v / INDEX).write_text(json.dumps(index, indent=2))


def _refused_everywhere(v: Path, *needles) -> str:
    """quantize / inspect / verify-less commands refuse ``v``; nothing written anywhere."""
    parent = tree(v.parent)
    line = assert_refused(run_cli("quantize", v, "--bits", "8"), *needles)
    assert_refused(run_cli("inspect", v), *needles)
    assert_refused(run_cli("quantize", v, "--bits", "8", "--output", v.parent / "out"), *needles)
    assert tree(v.parent) == parent  # no overlay, no state folder, no output, shard untouched
    assert not (v / "embedq.safetensors").exists() and not (v / ".embedq").exists()
    with pytest.raises(UnsafePathError):
        embedq.quantize(v, 8, progress=False)
    return line


def test_index_shard_outside_the_folder_is_refused(victim):
    """The case of the issue: the embedding's shard moved next to the folder."""
    v, index = victim
    shard = _embedding_shard(index)
    (v.parent / "outside").mkdir()
    shutil.move(v / shard, v.parent / "outside" / shard)
    _point_index(v, index, shard, f"../outside/{shard}")
    line = _refused_everywhere(v, str(v / INDEX), "model.embed_tokens.weight", f"../outside/{shard}")
    assert line.startswith(f"embedq: error: {v / INDEX}: weight_map entry 'model.embed_tokens.weight': "
                           f"'../outside/{shard}' climbs out with '..'; "), line


def test_index_absolute_shard_is_refused(victim, tmp_path):
    v, index = victim
    shard = _embedding_shard(index)
    elsewhere = tmp_path / "elsewhere" / shard
    elsewhere.parent.mkdir()
    shutil.copy(v / shard, elsewhere)
    _point_index(v, index, shard, str(elsewhere))
    _refused_everywhere(v, str(v / INDEX), "model.embed_tokens.weight", "absolute path")


@pytest.mark.parametrize("entry,problem", [
    ("C:model-00001.safetensors", "drive letter"),
    ("sub\\model.safetensors", "backslash"),
    ("sub/../model.safetensors", "'..'"),
    ("\\\\server\\share\\m.safetensors", "absolute path"),
])
def test_index_entry_must_be_a_plain_relative_name(victim, entry, problem):
    v, index = victim
    _point_index(v, index, _embedding_shard(index), entry)
    _refused_everywhere(v, str(v / INDEX), "model.embed_tokens.weight", problem)


def test_index_entry_not_a_string(victim):
    v, index = victim
    index["weight_map"]["model.embed_tokens.weight"] = ["a", "b"]
    (v / INDEX).write_text(json.dumps(index))
    _refused_everywhere(v, str(v / INDEX), "model.embed_tokens.weight", "not a file name")


def test_shard_link_leaving_the_folder_is_refused(victim, tmp_path):
    v, index = victim
    shard = _embedding_shard(index)
    other = tmp_path / "other-model" / shard
    other.parent.mkdir()
    shutil.move(v / shard, other)
    os.symlink(other, v / shard)  # the index entry is a plain name; the link leads out
    _refused_everywhere(v, str(v / INDEX), "model.embed_tokens.weight", "link leading out")


def test_single_file_and_config_links_leaving_the_folder(model_factory, tmp_path):
    q = model_factory("qwen2_tied")
    away = tmp_path / "away"
    away.mkdir()
    shutil.move(q / "model.safetensors", away / "model.safetensors")
    os.symlink(away / "model.safetensors", q / "model.safetensors")
    before = tree(q)
    assert_refused(run_cli("quantize", q, "-q"), "model.safetensors", "link leading out")
    assert tree(q) == before
    (q / "model.safetensors").unlink()
    shutil.move(away / "model.safetensors", q / "model.safetensors")
    shutil.move(q / "config.json", away / "config.json")
    os.symlink(away / "config.json", q / "config.json")
    before = tree(q)
    assert_refused(run_cli("quantize", q, "-q"), "config.json", "link leading out")
    assert_refused(run_cli("inspect", q), "config.json", "link leading out")
    assert tree(q) == before


def test_tokenizer_or_generation_config_link_out_refused_before_transformers(model_factory, tmp_path):
    """``embedq.load`` / eval hand the folder to transformers, which reads files by name."""
    q = model_factory("qwen2_tied")
    embedq.quantize(q, 8, progress=False)
    embedq.load(q)  # positive control
    secret = tmp_path / "secret.json"
    secret.write_text('{"stolen": true}')
    for name in ("generation_config.json", "tokenizer_config.json"):
        (q / name).unlink(missing_ok=True)
        os.symlink(secret, q / name)
        with pytest.raises(UnsafePathError, match=name):
            embedq.load(q)
        assert_refused(run_cli("eval", q, "--contexts", "2", "--length", "8"), name, "link leading out")
        (q / name).unlink()


def test_load_refuses_an_index_entry_leading_out(victim, tmp_path):
    """``embedq.load`` hands the folder to transformers, which opens every shard the index
    names: each entry is checked first (not only the ones embedq reads itself)."""
    v, index = victim
    embedq.quantize(v, 8, progress=False)
    index = json.loads((v / INDEX).read_text())
    shard = index["weight_map"]["model.norm.weight"]  # no target of embedq's
    (v.parent / "outside").mkdir()
    shutil.copy(v / shard, v.parent / "outside" / shard)
    index["weight_map"]["model.norm.weight"] = f"../outside/{shard}"
    (v / INDEX).write_text(json.dumps(index))
    with pytest.raises(UnsafePathError, match=r"weight_map entry 'model.norm.weight'.*climbs out"):
        embedq.load(v)


def test_calibration_refuses_a_link_out_before_transformers(model_factory, tmp_path):
    """``--method gptq`` runs the float model on calibration text (transformers reads the
    tokenizer files by name): a tokenizer file linking out is refused first."""
    q = model_factory("llama_untied_fp32")
    secret = tmp_path / "secret.json"
    secret.write_text('{"stolen": true}')
    (q / "tokenizer_config.json").symlink_to(secret)
    before = tree(q)
    assert_refused(run_cli("quantize", q, "--method", "gptq", "--lm-head", "-q"), "tokenizer_config.json",
                   "link leading out")
    assert tree(q) == before


def test_onnx_export_refuses_a_link_out_before_transformers(model_factory, tmp_path):
    pytest.importorskip("onnxscript")
    q = model_factory("llama_untied_fp32")
    embedq.quantize(q, 8, progress=False)
    secret = tmp_path / "secret.json"
    secret.write_text('{"stolen": true}')
    (q / "generation_config.json").unlink(missing_ok=True)
    (q / "generation_config.json").symlink_to(secret)
    before = tree(q)
    out = tmp_path / "out" / "model.onnx"
    assert_refused(run_cli("onnx", "export", q, "-o", out), "generation_config.json", "link leading out")
    assert tree(q) == before and not out.exists()


def test_bundle_overlay_link_out_refused(model_factory, tmp_path):
    q = model_factory("qwen2_tied")
    bundle = tmp_path / "bundle"
    embedq.quantize(q, 8, output=bundle, overlay_only=True, progress=False)
    away = tmp_path / "away.safetensors"
    shutil.move(bundle / "embedq.safetensors", away)
    os.symlink(away, bundle / "embedq.safetensors")
    base = model_factory("qwen2_tied")
    before = tree(base)
    assert_refused(run_cli("apply", base, "--overlay", bundle), "embedq.safetensors", "link leading out")
    assert_refused(run_cli("verify", bundle), "embedq.safetensors", "link leading out")
    assert tree(base) == before


def test_in_place_overlay_config_link_out_refused(model_factory, tmp_path):
    q = model_factory("qwen2_tied")
    embedq.quantize(q, 8, progress=False)
    away = tmp_path / "qc.json"
    shutil.move(q / "quantization_config.json", away)
    os.symlink(away, q / "quantization_config.json")
    before = tree(q)
    assert_refused(run_cli("verify", q), "quantization_config.json", "link leading out")
    with pytest.raises(UnsafePathError):
        embedq.load_overlay(q)
    assert tree(q) == before


def test_state_links_are_recreated_only_inside(model_factory):
    """A planted state.json whose recorded link leads out (with matching bytes) is not
    recreated by ``remove``: config.json comes back as a regular file."""
    q = model_factory("qwen2_tied")
    original = (q / "config.json").read_bytes()
    embedq.quantize(q, 8, progress=False)
    twin = q.parent / "twin.json"
    twin.write_bytes(original)
    st = q / ".embedq" / "state.json"
    s = json.loads(st.read_text())
    s["links"] = {"config.json": str(twin)}
    st.write_text(json.dumps(s))
    embedq.remove(q)
    assert not (q / "config.json").is_symlink() and (q / "config.json").read_bytes() == original


# --- the Hugging Face cache layout ---------------------------------------------------------

def _hf_cache(src: Path, root: Path, name: str = "models--org--tiny", rev: str = "c" * 40):
    repo = root / name
    blobs, snap = repo / "blobs", repo / "snapshots" / rev
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.is_file():
            data = f.read_bytes()
            blob = blobs / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            os.symlink(os.path.relpath(blob, snap), snap / f.name)
    return blobs, snap


def test_hf_cache_snapshot_links_into_blobs_work(model_factory, tmp_path):
    blobs, snap = _hf_cache(model_factory("llama_untied_sharded"), tmp_path)
    before, links = tree(blobs), tree(snap)
    code, out, exc = run_cli("quantize", snap, "--bits", "8", "-q")
    assert code == 0, (out, exc)
    assert run_cli("verify", snap)[0] == 0
    assert run_cli("remove", snap)[0] == 0
    assert tree(blobs) == before
    assert tree(snap) == links  # config.json and the index are the same links into blobs/ again
    # reached through a link to the snapshot folder (a user's shortcut), too
    os.symlink(snap, tmp_path / "shortcut")
    assert run_cli("inspect", tmp_path / "shortcut")[0] == 0


def test_hf_cache_link_into_another_repos_blobs_is_refused(model_factory, tmp_path):
    blobs, snap = _hf_cache(model_factory("llama_untied_sharded"), tmp_path)
    other_blobs, _ = _hf_cache(model_factory("qwen2_tied"), tmp_path, name="models--org--other")
    index = json.loads((snap / INDEX).read_text())
    shard = _embedding_shard(index)
    theirs = other_blobs / "stolen"
    shutil.copy(snap / shard, theirs)
    (snap / shard).unlink()
    os.symlink(os.path.relpath(theirs, snap), snap / shard)
    before = tree(tmp_path)
    assert_refused(run_cli("quantize", snap, "-q"), str(snap / INDEX), "model.embed_tokens.weight",
                   "link leading out")
    assert tree(tmp_path) == before


# --- the one function ------------------------------------------------------------------------

@pytest.mark.parametrize("name,ok", [
    ("model.safetensors", True), ("sub/model.safetensors", True), ("./model.safetensors", False), ("a//b", False), ("a/", False),
    ("../model.safetensors", False), ("a/../../b", False), ("/etc/passwd", False),
    ("C:\\x.safetensors", False), ("c:x", False), ("a\\b", False), ("", False), ("a\0b", False),
    (None, False), (7, False), (["x"], False),
])
def test_name_rules(name, ok):
    """The rules of an index entry (``plain``: one spelling per file)."""
    assert (name_problem(name, plain=True) is None) == ok
    if name in ("./model.safetensors", "a//b"):  # fine for an ONNX external data location
        assert name_problem(name) is None


def test_inside_missing_file_is_returned(tmp_path):
    assert inside(tmp_path, "nothing.json") == tmp_path / "nothing.json"
    os.symlink("loop", tmp_path / "loop")
    with pytest.raises(EmbedqError, match="link"):
        inside(tmp_path, "loop")


def test_onnx_external_data_in_an_hf_cache_snapshot(model_factory, tmp_path):
    """An ONNX graph and its external data as snapshot links into ``blobs/`` are read;
    external data linking into another repository's blobs is refused."""
    from test_fuzz_onnx import _graph, _table, apply_onnx
    q = model_factory("qwen2_tied")
    bundle = tmp_path / "bundle"
    embedq.quantize(q, 8, output=bundle, overlay_only=True, progress=False)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.onnx").write_bytes(apply_onnx(_graph(_table(q)), ("external", ("ok", None)), plain, tmp_path))
    blobs, snap = _hf_cache(plain, tmp_path / "hub")
    assert (snap / "data.bin").is_symlink()
    code, out, exc = run_cli("onnx", "patch", snap / "model.onnx", "--overlay", bundle, "--output", tmp_path / "q.onnx")
    assert code == 0, (out, exc)
    other, _ = _hf_cache(plain, tmp_path / "hub", name="models--org--other")
    (snap / "data.bin").unlink()
    os.symlink(os.path.relpath(other / os.listdir(other)[0], snap), snap / "data.bin")
    assert_refused(run_cli("onnx", "patch", snap / "model.onnx", "--overlay", bundle, "--output",
                           tmp_path / "q2.onnx"), "external data location 'data.bin'")


def test_a_fifo_at_config_json_is_refused_not_waited_on(model_factory, tmp_path):
    """A FIFO (or device) at a JSON name the folder holds: every reader refuses it at once with
    one line, where a plain open() waited forever for a writer (inspect, quantize, verify)."""
    from faultutil import embedq, one_error_line
    model = shutil.copytree(model_factory("qwen2_tied"), tmp_path / "m")
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    for verb in (("inspect", model), ("quantize", model, "-q"), ("verify", model)):
        r = embedq(*verb, timeout=60)  # a hang is a TimeoutExpired: a failure, not a stuck suite
        one_error_line(r, str(model / "config.json"))
