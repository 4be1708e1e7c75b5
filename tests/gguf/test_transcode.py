"""``embedq gguf`` on a tiny untied llama GGUF: exact transcoding, byte-identical rest,
every refusal (one line, exit 2, nothing written, sources untouched), ``inspect``."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ckptutil import snapshot
from embedq.cli import app
from ggufutil import FLAGS4, assert_transcoded, quantize_cli, swap_q4_0_nibbles

runner = CliRunner()
BOTH = {"token_embd.weight": "model.embed_tokens", "output.weight": "lm_head"}


def gguf_cli(base, ov, out, *extra):
    return runner.invoke(app, ["gguf", str(base), "--overlay", str(ov), "-o", str(out), *extra])


def test_separate_head_scheme_exact(tiny, tiny_overlays, tmp_path):
    """4-bit embedding -> Q4_0, 8-bit head -> Q8_0: gguf-py decodes both to the overlay's
    values bit for bit; the other tensors and every key are BASE's bytes."""
    _, base = tiny
    before = snapshot(base.parent)
    out = tmp_path / "out.gguf"
    res = gguf_cli(base, tiny_overlays["q4"], out, "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert {t["tensor"]: t["type_after"] for t in rep["tables"]} == {"token_embd.weight": "Q4_0",
                                                                     "output.weight": "Q8_0"}
    assert rep["tied"] is False and os.path.getsize(out) == rep["bytes_after"]
    assert_transcoded(base, out, tiny_overlays["q4"], BOTH)
    assert snapshot(base.parent) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out.gguf"]  # no temporary left


def test_embedding_only_keeps_head(tiny, tiny_overlays, tmp_path):
    import embedq
    _, base = tiny
    out = tmp_path / "out.gguf"
    rep = embedq.gguf(base, tiny_overlays["q8"], out)
    assert [t.tensor for t in rep.tables] == ["token_embd.weight"]
    assert any("output.weight kept" in n for n in rep.notes)
    assert_transcoded(base, out, tiny_overlays["q8"], {"token_embd.weight": "model.embed_tokens"})


def test_nibble_order_caught(tiny, tiny_overlays, tmp_path):
    """The round-trip check fails on a file whose Q4_0 nibbles use embedq's even/odd order."""
    _, base = tiny
    out = tmp_path / "out.gguf"
    assert gguf_cli(base, tiny_overlays["q4"], out).exit_code == 0
    swap_q4_0_nibbles(out, "token_embd.weight")
    with pytest.raises(AssertionError, match="token_embd.weight does not decode"):
        assert_transcoded(base, out, tiny_overlays["q4"], BOTH)


def test_group_multiple_of_32(tiny, tmp_path):
    """A g64 table is exact too: each Q8_0 block repeats its group's scale."""
    hf, base = tiny
    ov = quantize_cli(hf, tmp_path / "ov", "--bits", "8", "--group-size", "64", "--scale-dtype", "float16")
    out = tmp_path / "out.gguf"
    assert gguf_cli(base, ov, out).exit_code == 0
    assert_transcoded(base, out, ov, {"token_embd.weight": "model.embed_tokens"})


def _refused(res, *words):
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("embedq: error: "), res.output
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("flags,why", [
    (["--bits", "8", "--group-size", "32"], "float32 scales"),
    (["--bits", "4", "--group-size", "32", "--scale-dtype", "float16", "--asym"], "asymmetric"),
    (["--bits", "4", "--group-size", "16", "--scale-dtype", "float16"], "groups of 16"),
])
def test_refuses_inexact_scheme(tiny, tmp_path, flags, why):
    hf, base = tiny
    ov = quantize_cli(hf, tmp_path / "ov", *flags)
    out = tmp_path / "out.gguf"
    line = _refused(gguf_cli(base, ov, out), why, "--bits 8 --group-size 32 --scale-dtype float16",
                    "--bits 4 --group-size 32 --scale-dtype float16")
    assert "quantization_config.json" in line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ov"]


def test_refuses_other_model_shape(tiny, model_factory, tmp_path):
    _, base = tiny
    ov = quantize_cli(model_factory("llama_untied_sharded"), tmp_path / "ov", *FLAGS4)
    _refused(gguf_cli(base, ov, tmp_path / "out.gguf"), "1000x64", "another model")
    assert not (tmp_path / "out.gguf").exists()


def test_refuses_other_model_values(tiny, tmp_path):
    """Same shape, another table (rows shifted by one): outside the derived bound."""
    from safetensors.torch import load_file, save_file
    hf, base = tiny
    other = tmp_path / "other"
    shutil.copytree(hf, other)
    f = other / "model.safetensors"
    sd = load_file(f)
    sd["model.embed_tokens.weight"] = torch.roll(sd["model.embed_tokens.weight"], 1, dims=0).contiguous()
    save_file(sd, f, metadata={"format": "pt"})
    ov = quantize_cli(other, tmp_path / "ov", *FLAGS4)
    _refused(gguf_cli(base, ov, tmp_path / "out.gguf"), "not a quantization of the GGUF's token_embd.weight")
    assert not (tmp_path / "out.gguf").exists()


def test_refuses_bad_base(tiny, tiny_overlays, tmp_path):
    _, base = tiny
    ov = tiny_overlays["q4"]
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model\n" * 4)
    _refused(gguf_cli(text, ov, tmp_path / "o1.gguf"), "not a GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _refused(gguf_cli(empty, ov, tmp_path / "o2.gguf"), "not a GGUF file")
    data = base.read_bytes()
    for cut in (len(data) // 2, 40, len(data) - 1):
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        _refused(gguf_cli(short, ov, tmp_path / "o3.gguf"), "truncated GGUF")
    assert not any(p.name.startswith("o") for p in tmp_path.iterdir())


def test_refuses_out_is_base(tiny, tiny_overlays, tmp_path):
    _, src = tiny
    base = tmp_path / "base.gguf"
    shutil.copy(src, base)
    before = base.read_bytes()
    ov = tiny_overlays["q4"]
    (tmp_path / "link.gguf").symlink_to(base)
    os.link(base, tmp_path / "hard.gguf")
    for out in (base, tmp_path / "link.gguf", tmp_path / "hard.gguf", tmp_path / "." / "base.gguf"):
        _refused(gguf_cli(base, ov, out, "--force"), "is the base GGUF itself")
    assert base.read_bytes() == before
    (tmp_path / "exists.gguf").write_bytes(b"x")
    _refused(gguf_cli(base, ov, tmp_path / "exists.gguf"), "--force")
    assert gguf_cli(base, ov, tmp_path / "exists.gguf", "--force").exit_code == 0
    assert base.read_bytes() == before


def test_inspect(tiny):
    _, base = tiny
    res = runner.invoke(app, ["inspect", str(base), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["format"] == "gguf" and d["tied"] is False and d["architecture"] == "llama"
    rows = {r["tensor"]: r for r in d["tables"]}
    assert rows["token_embd.weight"]["shape"] == [300, 64] and rows["output.weight"]["type"] == "Q8_0"
    assert rows["token_embd.weight"]["bytes_q4_0"] == 300 * 2 * 18
    assert d["bytes_q8_0"] == os.path.getsize(base)  # tables already Q8_0: the same layout
    res = runner.invoke(app, ["inspect", str(base)])
    assert res.exit_code == 0 and "MB Q4_0" in res.output and "token_embd.weight" in res.output
    bad = base.parent / "bad.txt"
    bad.write_text("x")
    _refused(runner.invoke(app, ["inspect", str(bad)]), "not a GGUF file")


def test_inspect_decides_by_content(tiny):
    """A file of a checkpoint folder is named for what it is (by its bytes), not sent to
    the GGUF reader; a GGUF file under another name is still read as GGUF."""
    hf, base = tiny
    _refused(runner.invoke(app, ["inspect", str(hf / "config.json")]), "a JSON file", "model's folder")
    st = next(hf.glob("*.safetensors"))
    _refused(runner.invoke(app, ["inspect", str(st)]), "a safetensors file")
    other = base.parent / "renamed.bin"
    shutil.copy(base, other)
    res = runner.invoke(app, ["inspect", str(other), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["format"] == "gguf", res.output
    other.unlink()


def test_block_encoders_match_gguf_py():
    """Q8_0 / Q4_0 encoders against gguf-py's own quantizer on values already on the grid."""
    import gguf
    from embedq.backends.gguf.blocks import Q4_0, Q8_0, encode
    g = torch.Generator().manual_seed(0)
    for bits, qt, lo, hi in ((8, Q8_0, -127, 128), (4, Q4_0, -8, 8)):
        q = torch.randint(lo, hi, (5, 64), generator=g, dtype=torch.int8)
        q[:, 0] = lo  # the extreme that fixes each block's scale: gguf-py re-derives d exactly
        q[:, 32] = lo
        s = (torch.rand(5, 2, generator=g) * 0.1 + 0.01).half()
        x = (q.float().reshape(5, 2, 32) * s.float().unsqueeze(-1)).reshape(5, 64)
        if bits == 8:
            s = (x.reshape(5, 2, 32).abs().amax(-1) / 127).half()  # Q8_0's d = amax/127
        ours = encode(q if bits == 4 else torch.round(x / s.float().repeat_interleave(32, 1)).to(torch.int8),
                      s, qt)
        theirs = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType(qt))
        assert np.array_equal(ours, theirs), bits
