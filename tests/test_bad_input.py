"""Every bad input: one clear line naming the file, exit != 0, source untouched."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptutil import assert_one_line_error, run_cli, snapshot


def test_missing_dir(tmp_path):
    code, out = run_cli("quantize", tmp_path / "nope", "--bits", "8")
    assert_one_line_error(code, out, "nope", "no such directory")


def test_no_config(model_factory):
    path = model_factory("qwen2_tied")
    (path / "config.json").unlink()
    before = snapshot(path)
    code, out = run_cli("quantize", path)
    assert_one_line_error(code, out, "config.json", "no config.json")
    assert snapshot(path) == before


def test_bin_only_checkpoint(model_factory):
    path = model_factory("qwen2_tied")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    code, out = run_cli("quantize", path)
    assert_one_line_error(code, out, ".bin", "safetensors")


def test_corrupt_header(model_factory):
    path = model_factory("qwen2_tied")
    with open(path / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage")
    before = snapshot(path)
    code, out = run_cli("quantize", path)
    assert_one_line_error(code, out, "model.safetensors", "corrupt safetensors header")
    assert snapshot(path) == before


def test_truncated_shard(model_factory):
    path = model_factory("llama_untied_sharded")
    idx = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = path / idx["model.embed_tokens.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    before = snapshot(path)
    code, out = run_cli("quantize", path)
    assert_one_line_error(code, out, shard.name, "truncated")
    assert snapshot(path) == before


def test_index_names_missing_file(model_factory):
    path = model_factory("llama_untied_sharded")
    idx = json.loads((path / "model.safetensors.index.json").read_text())
    shard = idx["weight_map"]["lm_head.weight"]
    (path / shard).unlink()
    code, out = run_cli("quantize", path)
    assert_one_line_error(code, out, "model.safetensors.index.json", shard, "does not exist")


def test_index_names_missing_tensor(model_factory):
    path = model_factory("llama_untied_sharded")
    ip = path / "model.safetensors.index.json"
    idx = json.loads(ip.read_text())
    shard = idx["weight_map"]["model.embed_tokens.weight"]
    other = next(f for f in set(idx["weight_map"].values()) if f != shard)
    idx["weight_map"]["model.embed_tokens.weight"] = other
    ip.write_text(json.dumps(idx))
    code, out = run_cli("quantize", path)
    assert_one_line_error(code, out, other, "model.embed_tokens.weight", "no such tensor")


def test_cols_not_divisible_by_group(model_factory):
    path = model_factory("qwen2_tied")  # hidden 64
    code, out = run_cli("quantize", path, "--bits", "4", "--group-size", "48")
    assert_one_line_error(code, out, "model.safetensors", "64 columns are not divisible by group size 48")


def test_unsupported_dtype(model_factory):
    path = model_factory("qwen2_tied")
    sd = load_file(path / "model.safetensors")
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"].double()
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    code, out = run_cli("quantize", path)
    assert_one_line_error(code, out, "model.safetensors", "F64")


def test_unsupported_bits(model_factory):
    path = model_factory("qwen2_tied")
    code, out = run_cli("quantize", path, "--bits", "3")
    assert_one_line_error(code, out, "--bits 3")


def _make_readonly(path):
    """chattr +i binds root too; chmod is enough for other users."""
    if os.geteuid() == 0:
        try:
            r = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
        except FileNotFoundError:
            pytest.skip("running as root and no chattr: cannot make a folder read-only for root")
        if r.returncode != 0:  # tmpfs / overlayfs have no immutable flag
            pytest.skip(f"running as root and chattr +i fails on this filesystem "
                        f"({r.stderr.decode(errors='replace').strip()[:120]}): cannot make a folder read-only")
        return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)
    os.chmod(path, 0o555)
    return lambda: os.chmod(path, 0o755)


def test_read_only_dir(model_factory):
    path = model_factory("qwen2_tied")
    before = snapshot(path)
    undo = _make_readonly(path)
    try:
        code, out = run_cli("quantize", path)
    finally:
        undo()
    assert_one_line_error(code, out, str(path), "not writable")
    assert snapshot(path) == before


def test_destination_without_space(model_factory, monkeypatch):
    path = model_factory("qwen2_tied")
    before = snapshot(path)

    def nospace(fd, off, n):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", nospace)
    code, out = run_cli("quantize", path)
    assert_one_line_error(code, out, "embedq.safetensors", "No space left")
    assert snapshot(path) == before
    out_dir = path.parent / "derived"
    code, out = run_cli("quantize", path, "--output", out_dir)
    assert_one_line_error(code, out, "No space left")
    assert not out_dir.exists() and not list(path.parent.glob(".*partial*"))


def test_space_runs_out_while_committing_json(model_factory, monkeypatch):
    """A failure after the overlay was renamed rolls back to the original state."""
    path = model_factory("llama_untied_sharded")
    before = snapshot(path)
    import embedq.jobs.state as st
    real = st.write_json_atomic
    calls = []

    def flaky(p, obj):
        calls.append(p.name)
        if p.name == "config.json":
            raise __import__("embedq.errors").errors.OverlayError(f"{p}: cannot write: No space left on device")
        return real(p, obj)
    monkeypatch.setattr(st, "write_json_atomic", flaky)
    code, out = run_cli("quantize", path)
    assert_one_line_error(code, out, "config.json", "No space left")
    assert "model.safetensors.index.json" in calls
    assert snapshot(path) == before


def test_trust_flags_exclusive(model_factory):
    path = model_factory("qwen2_tied")
    code, out = run_cli("quantize", path, "--trust-config", "--trust-tensors")
    assert_one_line_error(code, out, "exclude each other")


def test_remove_without_overlay(model_factory):
    path = model_factory("qwen2_tied")
    code, out = run_cli("remove", path)
    assert_one_line_error(code, out, "no embedq overlay")


# --- interruption ----------------------------------------------------------------------

def _quantize_subprocess(path, env_extra, *args):
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-m", "embedq.cli", "quantize", str(path), "-q", *args],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("kill_after", [1, 3, 7])
def test_killed_midway_leaves_source_intact_and_no_valid_overlay(model_factory, kill_after):
    path = model_factory("llama_untied_sharded")
    before = snapshot(path)
    r = _quantize_subprocess(path, {"EMBEDQ_TEST_KILL_AFTER_WRITES": str(kill_after)},
                             "--bits", "4", "--lm-head", "--chunk-rows", "128")
    assert r.returncode == -signal.SIGKILL, r.stderr
    after = snapshot(path)
    partial = [f for f in after if "partial" in f]
    assert partial, "the kill should have hit while the overlay was being written"
    for f, h in before.items():
        assert after[f] == h  # every original file byte-identical
    assert "embedq.safetensors" not in after and "quantization_config.json" not in after
    # the next run cleans up and succeeds; remove restores everything
    r = _quantize_subprocess(path, {}, "--bits", "4", "--lm-head")
    assert r.returncode == 0, r.stderr
    assert not [f for f in snapshot(path) if "partial" in f]
    code, out = run_cli("verify", path)
    assert code == 0, out
    code, out = run_cli("remove", path)
    assert code == 0, out
    assert snapshot(path) == before


def _default_sigint():
    # A shell starts background jobs with SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler: the child gets the disposition a foreground run has.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("output,point", [(False, "stream"), (False, "committing"),
                                          (True, "stream"), (True, "derived-staged")])
def test_ctrl_c_midway_cleans_up(model_factory, output, point):
    """Ctrl-C at a named stage of the job (embedq.jobs.testpoint), not after a count of
    writes: the same stage is hit on every machine and under any load."""
    path = model_factory("llama_untied_sharded")
    before = snapshot(path)
    extra = ["--output", str(path.parent / "out")] if output else []
    env = {**os.environ, "EMBEDQ_TEST_SIGINT_AT": point}
    r = subprocess.run([sys.executable, "-m", "embedq.cli", "quantize", str(path), "-q", "--lm-head",
                        "--chunk-rows", "128", *extra], env=env, capture_output=True, text=True,
                       timeout=300, preexec_fn=_default_sigint)
    assert r.returncode == 130, r.stderr
    assert "source checkpoint is unchanged" in r.stderr
    assert snapshot(path) == before  # not even a temporary file left
    assert not (path.parent / "out").exists()
    assert not list(path.parent.glob(".*partial*"))


def test_testpoint_refuses_an_unknown_point(monkeypatch):
    from embedq.jobs import testpoint
    monkeypatch.setenv(testpoint.ENV, "strem")  # a typo must not make the Ctrl-C tests vacuous
    with pytest.raises(RuntimeError, match="points are"):
        testpoint.reached("stream")
