"""Graphs the real exporters write, patched and run: onnxruntime-genai's model builder
(default: tied table shared through Transpose(perm=[1,0]); untied) and optimum's
text-generation-with-past export (tied through Transpose; untied [H, V] copy).

The exporters install into caches outside the repo (scripts/setup_genai_onnx.sh,
scripts/setup_optimum_onnx_venv.sh); a test skips when its exporter cannot be installed.
Reference: transformers with the overlay's dequantized tables. accuracy_level 0 keeps the
activations float, so patched logits match to float rounding; the default (CPU 4)
quantizes activations to int8 and is checked for greedy agreement.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from embedq.backends.onnx import patch_model, read_metadata
from onnxutil import VOCAB, reference_greedy, reference_logits, run_decoder

TIED, UNTIED = "tied96-h32", "untied96-h32"  # hidden 96: 3 blocks of 32 per row (odd)


def _ids(kind: str, b: int = 2, s: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB[kind], (b, s), generator=torch.Generator().manual_seed(1))


def _ops(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


def _check_decoder(kind, ckpt, ov, model_path, level):
    """Prefill logits vs the dequantized PyTorch reference, then 4 greedy steps with KV cache."""
    ids = _ids(kind)
    prefill, toks, _ = run_decoder(model_path, ids, steps=4, head_dim=32)
    ref = reference_logits(ckpt, ov, ids)
    if level == 0:
        np.testing.assert_allclose(prefill, ref, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(toks, reference_greedy(ckpt, ov, ids, 4))
    else:  # int8 activations: close, and the same next token almost everywhere
        assert np.abs(prefill - ref).max() < 0.05 * np.abs(ref).max()
        assert (prefill.argmax(-1) == ref.argmax(-1)).mean() >= 0.85


# ------------------------------------------------------------- onnxruntime-genai builder

@pytest.mark.parametrize("bits,group", [(4, 32), (8, None)])
def test_builder_default_tied_transpose(builder_folder, overlay, checkpoints, tmp_path, bits, group):
    """The builder's default tied graph: Gather reads Transpose(perm=[1,0]) of the head's
    [H, V] initializer. Patched as a folder that onnxruntime_genai opens as is."""
    src = builder_folder(TIED)
    assert "Transpose" in _ops(src / "model.onnx")
    ckpt, ov = checkpoints(TIED), overlay(TIED, bits, group)
    out = tmp_path / "q"
    r = patch_model(src, ov, out, accuracy_level=0)
    assert [(m.op, m.replaced, m.source_check) for m in r.modules] == [
        ("GatherBlockQuantized", "lm_head.MatMul.weight", "blake3"),
        ("MatMulNBits", "lm_head.MatMul.weight", "blake3")]
    assert r.modules[0].float_bytes == 512 * 96 * 4 and r.modules[1].quantized_bytes == 0
    ops = _ops(out / "model.onnx")
    assert "Transpose" not in ops and "Gather" not in ops[:3]
    inits = {i.name for i in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.initializer}
    assert "lm_head.MatMul.weight" not in inits
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    assert json.loads((out / "genai_config.json").read_text()) == json.loads((src / "genai_config.json").read_text())
    _check_decoder(TIED, ckpt, ov, out / "model.onnx", 0)
    _genai_matches_reference(out, ckpt, ov, TIED)


def test_builder_default_level4_and_untied(builder_folder, overlay, checkpoints, tmp_path):
    """Default accuracy_level (CPU: 4) recorded; untied builder graph (Gather of the
    embedding, MatMul of an [H, V] head) with an --lm-head overlay."""
    src = builder_folder(TIED)
    ckpt, ov = checkpoints(TIED), overlay(TIED, 4, 32)
    r = patch_model(src, ov, tmp_path / "q4")
    assert r.accuracy_level == 4
    meta = read_metadata(tmp_path / "q4" / "model.onnx")
    assert meta["accuracy_level"] == "4" and meta["modules"]["lm_head"]["accuracy_level"] == 4
    mm = [n for n in onnx.load(str(tmp_path / "q4" / "model.onnx"), load_external_data=False).graph.node
          if n.op_type == "MatMulNBits"]
    assert [a.i for n in mm for a in n.attribute if a.name == "accuracy_level"] == [4]
    _check_decoder(TIED, ckpt, ov, tmp_path / "q4" / "model.onnx", 4)

    src = builder_folder(UNTIED)
    ckpt, ov = checkpoints(UNTIED), overlay(UNTIED, 8, None)
    r = patch_model(src, ov, tmp_path / "u", accuracy_level=0)
    assert [(m.op, m.source_check) for m in r.modules] == [
        ("GatherBlockQuantized", "blake3"), ("MatMulNBits", "blake3")]
    assert r.modules[0].replaced != r.modules[1].replaced
    _check_decoder(UNTIED, ckpt, ov, tmp_path / "u" / "model.onnx", 0)
    _genai_matches_reference(tmp_path / "u", ckpt, ov, UNTIED)


def _genai_matches_reference(folder: Path, ckpt: Path, ov: Path, kind: str, steps: int = 6) -> None:
    import onnxruntime_genai as og  # the genai_site fixture put it on sys.path
    model = og.Model(str(folder))
    ids = _ids(kind, b=1, s=5)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=5 + steps, min_length=5 + steps)
    g = og.Generator(model, params)
    g.append_tokens(ids[0].tolist())
    got = []
    while not g.is_done() and len(got) < steps:
        g.generate_next_token()
        got.append(int(g.get_next_tokens()[0]))
    assert got == reference_greedy(ckpt, ov, ids, steps)[0].tolist()


def test_genai_folder_cli_and_refusals(builder_folder, overlay, tmp_path):
    from typer.testing import CliRunner

    from embedq.cli import app
    src = builder_folder(TIED)
    ov = overlay(TIED, 4, 32)
    out = tmp_path / "cli"
    runner = CliRunner()
    res = runner.invoke(app, ["onnx", "patch", str(src), "--overlay", str(ov), "-o", str(out),
                              "--accuracy-level", "0", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output[res.output.index("{"):])
    assert rep["accuracy_level"] == 0 and rep["output"] == str(out)
    assert read_metadata(out / "model.onnx")["accuracy_level"] == "0"
    res = runner.invoke(app, ["onnx", "patch", str(src), "--overlay", str(ov), "-o", str(out)])
    assert res.exit_code == 2 and "not empty" in res.output
    res = runner.invoke(app, ["onnx", "patch", str(src), "--overlay", str(ov), "-o", str(tmp_path / "x"),
                              "--accuracy-level", "7"])
    assert res.exit_code == 2 and "accuracy_level 7" in res.output


# --------------------------------------------------------------------------------- optimum

@pytest.mark.parametrize("kind,bits,group", [(TIED, 4, 32), (UNTIED, 8, None)])
def test_optimum_with_past(optimum_model, overlay, checkpoints, tmp_path, kind, bits, group):
    src = optimum_model(kind)
    ckpt, ov = checkpoints(kind), overlay(kind, bits, group)
    out = tmp_path / "model.onnx"
    r = patch_model(src, ov, out, accuracy_level=0)
    assert [m.op for m in r.modules] == ["GatherBlockQuantized", "MatMulNBits"]
    assert all(m.source_check == "blake3" for m in r.modules)
    if kind == TIED:  # one table: MatMul read a Transpose of the Gather's initializer
        assert r.modules[0].replaced == r.modules[1].replaced and r.modules[1].quantized_bytes == 0
    mp = onnx.load(str(out), load_external_data=False)
    assert "model.embed_tokens.weight" not in {i.name for i in mp.graph.initializer}
    if kind == TIED:  # the Transpose that fed the head is gone with the float table
        assert not [n for n in mp.graph.node if n.op_type == "Transpose" and n.input[0] == r.modules[0].replaced]
    _check_decoder(kind, ckpt, ov, out, 0)


# ------------------------------------------------------- split tables (--max-tensor-bytes)

SPLIT = 128 << 10  # 4096 x 96: int8 384 KiB -> 4 parts, Q4 192 KiB -> 2; other weights are smaller


@pytest.mark.parametrize("flavour,bits,group", [("builder", 4, 32), ("optimum", 8, None)])
def test_exporters_split_tied(builder_folder, optimum_model, overlay, checkpoints, tmp_path, flavour, bits, group):
    """The builder's and optimum's tied graphs (the table shared through a Transpose) split:
    one set of parts read by the gather and the head, every initializer within the limit,
    logits and KV-cache greedy tokens as the dequantized reference."""
    from onnxutil import initializer_bytes
    kind = TIED + "-v4k"
    ckpt, ov = checkpoints(kind), overlay(kind, bits, group)
    if flavour == "builder":
        src = builder_folder(kind)
        r = patch_model(src, ov, tmp_path / "q", accuracy_level=0, max_tensor_bytes=SPLIT)
        path = tmp_path / "q" / "model.onnx"
    else:
        path = tmp_path / "model.onnx"
        r = patch_model(optimum_model(kind), ov, path, accuracy_level=0, max_tensor_bytes=SPLIT)
    emb, head = r.modules
    assert len(emb.parts) == (2 if bits == 4 else 4) and head.parts == emb.parts and head.quantized_bytes == 0
    sizes = initializer_bytes(path)
    # the builder's rotary caches (2 MiB each) are not the overlay's: named in a warning
    big = sorted(k for k, v in sizes.items() if v > SPLIT)
    assert big == (["cos_cache", "sin_cache"] if flavour == "builder" else []), big
    assert not big or any(all(b_ in w for b_ in big) for w in r.warnings), r.warnings
    assert sum(v for k, v in sizes.items() if re.search(r"\.part\d+$", k)) == emb.quantized_bytes
    ops = _ops(path)
    assert ops.count("GatherBlockQuantized") == ops.count("MatMulNBits") == len(emb.parts)
    _check_decoder(kind, ckpt, ov, path, 0)
    if flavour == "builder":
        _genai_matches_reference(tmp_path / "q", ckpt, ov, kind)
