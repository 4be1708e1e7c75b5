"""``max_tensor_bytes`` / ``--target webgpu``: quantized tables split by rows (CPU EP).

Split graphs against the unsplit graph and PyTorch with the dequantized tables; every
initializer of the written graph within the limit; a tied table one set of parts.
(The same graphs on the WebGPU EP: test_webgpu.py; exporters' graphs: test_exporters.py.)
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from embedq.backends.onnx import OnnxError, patch_model, parse_size, read_metadata
from embedq.backends.onnx.split import WEBGPU_MAX_BUFFER, row_ranges

from onnxutil import initializer_bytes, reference_logits, run_ort
from test_patch import expected_table_bytes

#: 4096 x 96: int8 384 KiB of packed rows -> 7 parts (586 rows), Q4 192 KiB -> 4; every other
#: initializer of the tiny model is <= 48 KiB
LIMIT = 64 << 10
TIED, UNTIED = "tied96-v4k", "untied96-v4k"


def _ids(vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(3))
    ids[0, :6] = torch.tensor([0, vocab - 1, 585, 586, 1023, 1024])  # both ends, part boundaries
    return ids


def _ops(path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


@pytest.mark.parametrize("kind,lm_head", [(TIED, False), (UNTIED, True)])
@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_split_equals_unsplit(float_model, overlay_for, tmp_path, kind, lm_head, bits, group):
    ckpt, fpath = float_model(kind)
    ov = overlay_for(kind, bits, group, True, lm_head)
    V, H = json.loads((ov / "quantization_config.json").read_text())["modules"]["model.embed_tokens"]["shape"]
    whole = tmp_path / "whole.onnx"
    patch_model(fpath, ov, whole, accuracy_level=0)
    out = tmp_path / "split.onnx"
    r = patch_model(fpath, ov, out, accuracy_level=0, max_tensor_bytes=f"{LIMIT // 1024}KiB")

    sizes = initializer_bytes(out)
    assert max(sizes.values()) <= LIMIT == r.max_tensor_bytes and r.largest_initializer == max(sizes.values())
    emb, head = r.modules
    n = len(emb.parts)
    assert n == (7 if bits == 8 else 4) == len(row_ranges(V, H * bits // 8, LIMIT, "t"))
    assert [p["rows"] for p in emb.parts][0][0] == 0 and emb.parts[-1]["rows"][1] == V
    assert all(a["rows"][1] == b["rows"][0] for a, b in zip(emb.parts, emb.parts[1:]))
    ops = _ops(out)
    n_tables = 1 if kind == TIED else 2
    assert ops.count("GatherBlockQuantized") == n and ops.count("MatMulNBits") == len(head.parts) == n
    assert "Gather" not in ops
    # bytes: the parts hold exactly one table's bytes per overlay table (tied: one, shared)
    q = expected_table_bytes(V, H, bits, group)
    part_bytes = sum(v for k, v in sizes.items() if ".part" in k and k.endswith(tuple(f"part{i}" for i in range(n))))
    assert part_bytes == n_tables * q
    assert sum(p["bytes"] for p in emb.parts) == emb.quantized_bytes == q
    assert head.quantized_bytes == (0 if kind == TIED else q)
    mp = onnx.load(str(out), load_external_data=False)
    gbq = [n_ for n_ in mp.graph.node if n_.op_type == "GatherBlockQuantized"]
    producer = {o: n_ for n_ in mp.graph.node for o in n_.output}
    mm_w = [producer[n_.input[1]].input[0] for n_ in mp.graph.node if n_.op_type == "MatMulNBits"]
    if kind == TIED:  # the head reads the gather's parts through Reshapes
        assert mm_w == [g.input[0] for g in gbq]
    else:
        assert not set(mm_w) & {g.input[0] for g in gbq}

    ids = _ids(V)
    got = run_ort(out, ids)
    np.testing.assert_allclose(got, run_ort(whole, ids), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, reference_logits(ckpt, ov, ids), rtol=1e-5, atol=1e-5)
    meta = read_metadata(out)
    assert meta["max_tensor_bytes"] == str(LIMIT)
    assert meta["modules"]["model.embed_tokens"]["parts"] == [p["rows"] for p in emb.parts]
    text = r.table()
    assert f"{n} parts" in text and "rows 0-" in text


def test_target_webgpu_and_no_split_below_limit(float_model, overlay_for, tmp_path):
    _, fpath = float_model("tied96")
    ov = overlay_for("tied96", 4, 32)
    r = patch_model(fpath, ov, tmp_path / "w.onnx", target="webgpu", accuracy_level=0)
    assert r.max_tensor_bytes == WEBGPU_MAX_BUFFER and [m.parts for m in r.modules] == [[], []]
    assert _ops(tmp_path / "w.onnx").count("GatherBlockQuantized") == 1
    # an explicit limit overrides the target's
    r = patch_model(fpath, ov, tmp_path / "s.onnx", target="webgpu", max_tensor_bytes=4096, accuracy_level=0)
    assert r.max_tensor_bytes == 4096 and len(r.modules[0].parts) == 7  # 24 KiB of packed rows
    with pytest.raises(OnnxError, match="smaller than one row"):
        patch_model(fpath, ov, tmp_path / "t.onnx", max_tensor_bytes=16)
    with pytest.raises(OnnxError, match="--target 'tpu'"):
        patch_model(fpath, ov, tmp_path / "t.onnx", target="tpu")


@pytest.mark.parametrize("text,n", [("262144", 262144), ("256KiB", 256 << 10), ("256MiB", 256 << 20),
                                    ("1GiB", 1 << 30), ("2mb", 2_000_000), (4096, 4096)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "12XB", "-5", "0", "1.5MiB", "MiB"])
def test_cli_bad_size_one_line(float_model, overlay_for, tmp_path, bad):
    from typer.testing import CliRunner

    from embedq.cli import app
    _, fpath = float_model("tied96")
    ov = overlay_for("tied96", 4, 32)
    out = tmp_path / "q.onnx"
    for verb in (["onnx", "patch", str(fpath), "--overlay", str(ov)], ["onnx", "export", str(ov)]):
        res = CliRunner().invoke(app, verb + ["-o", str(out), "--max-tensor-bytes", bad])
        lines = res.output.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("embedq: error: --max-tensor-bytes")
        assert not out.exists()
    res = CliRunner().invoke(app, ["onnx", "patch", str(fpath), "--overlay", str(ov), "-o", str(out),
                                   "--target", "gpu"])
    assert res.exit_code == 2 and res.output.strip().splitlines() == [
        "embedq: error: --target 'gpu': expected one of webgpu"]


def test_cli_split_report(float_model, overlay_for, tmp_path):
    from typer.testing import CliRunner

    from embedq.cli import app
    _, fpath = float_model(UNTIED)
    ov = overlay_for(UNTIED, 8, None, True, True)
    out = tmp_path / "q.onnx"
    res = CliRunner().invoke(app, ["onnx", "patch", str(fpath), "--overlay", str(ov), "-o", str(out),
                                   "--max-tensor-bytes", "64KiB", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output[res.output.index("{"):])
    assert rep["max_tensor_bytes"] == LIMIT and [len(m["parts"]) for m in rep["modules"]] == [7, 7]
    assert max(initializer_bytes(out).values()) <= LIMIT
