"""The streaming safetensors writer, checked with the safetensors library's own reader."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from embedq.errors import OverlayError
from embedq.format.writer import StreamingSafetensorsWriter


def test_streamed_file_reads_back_with_safetensors(tmp_path):
    a = torch.arange(40 * 6, dtype=torch.int32).reshape(40, 6)
    b = torch.randn(40, 3).to(torch.bfloat16)
    c = torch.tensor([40, 6], dtype=torch.int64)
    path = tmp_path / "x.safetensors"
    spec = {"a": (a.dtype, tuple(a.shape)), "b": (b.dtype, tuple(b.shape)), "c": (c.dtype, (2,))}
    with StreamingSafetensorsWriter(path, spec, {"format": "embedq"}) as w:
        for r in range(0, 40, 16):  # rows in chunks, tensors interleaved
            w.write("a", a[r:r + 16], row=r)
            w.write("b", b[r:r + 16], row=r)
        w.write("c", c)
    got = load_file(path)
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b) and torch.equal(got["c"], c)
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "embedq"}
    assert not list(tmp_path.glob(".*partial*"))


def test_incomplete_write_never_appears(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(OverlayError, match="not fully written"):
        with StreamingSafetensorsWriter(path, {"a": (torch.int32, (4, 2))}) as w:
            w.write("a", torch.zeros(2, 2, dtype=torch.int32), row=0)
    assert not path.exists() and not list(tmp_path.iterdir())


def test_exception_midway_removes_temp(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(RuntimeError):
        with StreamingSafetensorsWriter(path, {"a": (torch.int32, (4, 2))}) as w:
            w.write("a", torch.zeros(2, 2, dtype=torch.int32), row=0)
            raise RuntimeError("boom")
    assert not list(tmp_path.iterdir())


def test_full_disk_fails_before_work(tmp_path, monkeypatch):
    def nospace(fd, off, n):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", nospace)
    path = tmp_path / "x.safetensors"
    with pytest.raises(OverlayError, match="No space left"):
        StreamingSafetensorsWriter(path, {"a": (torch.int32, (4, 2))}).open()
    assert not list(tmp_path.iterdir())


def test_wrong_shape_rejected(tmp_path):
    with StreamingSafetensorsWriter(tmp_path / "x.safetensors", {"a": (torch.int32, (4, 2))}) as w:
        with pytest.raises(ValueError):
            w.write("a", torch.zeros(2, 3, dtype=torch.int32))
        with pytest.raises(ValueError):
            w.write("a", torch.zeros(4, 2, dtype=torch.int32), row=2)
        w.write("a", torch.zeros(4, 2, dtype=torch.int32))
