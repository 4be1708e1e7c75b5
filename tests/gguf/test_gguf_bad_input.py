"""``embedq gguf`` / ``inspect`` on inputs an adversary picks: an output that is one of the
inputs, a header cut inside a key/value, a table type gguf-py cannot read. One line, exit 2,
every input untouched."""

from __future__ import annotations

import shutil
import struct

import pytest
from typer.testing import CliRunner

from ckptutil import snapshot
from embedq.cli import app
from ggufutil import write_llama_gguf

runner = CliRunner()


def _refused(res, *words):
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("embedq: error: "), res.output
    assert "Traceback" not in res.output
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize("name", ["embedq.safetensors", "quantization_config.json"])
def test_force_output_is_an_overlay_file(tiny, tiny_overlays, tmp_path, name):
    _, base = tiny
    ov = tmp_path / "ov"
    shutil.copytree(tiny_overlays["q8"], ov)
    before = snapshot(ov)
    res = runner.invoke(app, ["gguf", str(base), "--overlay", str(ov), "-o", str(ov / name), "--force"])
    _refused(res, str(ov / name), "an input of this run")
    assert snapshot(ov) == before
    assert runner.invoke(app, ["verify", str(ov)]).exit_code == 0


def test_force_never_replaces_a_file_of_an_in_place_overlays_folder(tiny, tmp_path):
    """An in-place overlay's folder is the model's: --force replaces an earlier GGUF output
    there, never a float shard or a backup (as onnx's --force), and leaves the folder whole."""
    hf, base = tiny
    model = shutil.copytree(hf, tmp_path / "model")
    r = runner.invoke(app, ["quantize", str(model), "-q", "--lm-head", "--group-size", "32", "--scale-dtype", "float16"])
    assert r.exit_code == 0, r.output
    out = model / "out.gguf"
    for _ in range(2):  # a new output, then the same again with --force
        res = runner.invoke(app, ["gguf", str(base), "--overlay", str(model), "-o", str(out), "--force"])
        assert res.exit_code == 0, res.output
    out.unlink()
    before = snapshot(model)
    victims = [p for p in model.rglob("*") if p.is_file() and p.suffix != ".gguf"
               and p.name not in ("embedq.safetensors", "quantization_config.json", "config.json")]
    assert any(p.suffix == ".safetensors" for p in victims) and any(".embedq" in p.parts for p in victims)
    for victim in victims:
        res = runner.invoke(app, ["gguf", str(base), "--overlay", str(model), "-o", str(victim), "--force"])
        _refused(res, str(victim), "a file of the overlay's folder")
    assert snapshot(model) == before
    assert runner.invoke(app, ["verify", str(model)]).exit_code == 0


def _kv_header(key: str, vtype: int) -> bytes:
    """A GGUF v3 header with one key/value, cut right after the value's type."""
    k = key.encode()
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype)


@pytest.mark.parametrize("key,vtype", [("general.alignment", 4), ("split.count", 2)])
def test_header_cut_after_a_value_type(tiny_overlays, tmp_path, key, vtype):
    f = tmp_path / "cut.gguf"
    f.write_bytes(_kv_header(key, vtype))
    _refused(runner.invoke(app, ["inspect", str(f)]), str(f), "truncated GGUF")
    res = runner.invoke(app, ["gguf", str(f), "--overlay", str(tiny_overlays["q8"]), "-o", str(tmp_path / "o.gguf")])
    _refused(res, str(f), "truncated GGUF")
    assert not (tmp_path / "o.gguf").exists()


def _retype(path, tensor: str, ggml_type: int) -> None:
    """Change one tensor's recorded ggml type (a type of the same byte size)."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    nd = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * nd, ggml_type)
    path.write_bytes(bytes(data))


def test_table_type_gguf_py_cannot_read(tiny, tiny_overlays, tmp_path):
    hf, _ = tiny
    base = write_llama_gguf(hf, tmp_path / "f32.gguf", table_type="F32")
    _retype(base, "token_embd.weight", 26)  # I32: as many bytes as F32
    before = base.read_bytes()
    res = runner.invoke(app, ["gguf", str(base), "--overlay", str(tiny_overlays["q8"]), "-o", str(tmp_path / "o.gguf")])
    _refused(res, str(base), "token_embd.weight is I32")
    assert base.read_bytes() == before and not (tmp_path / "o.gguf").exists()


def _with_empty_string_array(path) -> None:
    """Insert one key/value, an empty string array (valid per the spec; gguf-py's writer refuses
    it, its reader reads it), right after the header. 32 bytes, so tensor data stays aligned."""
    data = bytearray(path.read_bytes())
    key = b"test.abc"  # 8 + 8 + 16 = 32 bytes in all: a multiple of the 32-byte alignment
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 8, 0)  # ARRAY of STRING, n=0
    assert len(kv) == 32
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    struct.pack_into("<Q", data, 16, n_kv + 1)
    path.write_bytes(bytes(data[:24] + kv + data[24:]))


def test_empty_string_array_in_metadata(tiny, tiny_overlays, tmp_path):
    import gguf
    hf, _ = tiny
    base = write_llama_gguf(hf, tmp_path / "base.gguf")
    _with_empty_string_array(base)
    assert len(gguf.GGUFReader(str(base)).fields["test.abc"].data) == 0  # gguf-py reads it
    res = runner.invoke(app, ["inspect", str(base)])
    assert res.exit_code == 0, res.output
    out = tmp_path / "o.gguf"
    res = runner.invoke(app, ["gguf", str(base), "--overlay", str(tiny_overlays["q8"]), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert out.exists()
