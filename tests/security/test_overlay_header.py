"""docs/security.md row 2: the overlay file's header is held to the config. Exactly the declared
tensors, each with the declared dtype and shape, data offsets holding exactly their bytes,
inside the file, not overlapping: anything else is refused by ``verify``, ``load_overlay``,
``embedq.load`` and ``apply`` (of a bundle) before a tensor is read, with the checksums
updated as a careful attacker would (only the header check can catch it). Extra tensors and
NaN/inf scales: test_untrusted.py (item 5) and test_doc_guarantees.py.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

import embedq
from embedq.errors import OverlayError
from secutil import assert_refused, run_cli, tamper_overlay, tree

EMB = "model.embed_tokens"


@pytest.fixture(scope="module")
def made(model_factory, tmp_path_factory):
    """(in-place int8 overlay of qwen2_tied, an overlay-only bundle of it), made once."""
    root = tmp_path_factory.mktemp("hdr")
    src = root / "m"
    shutil.copytree(model_factory("qwen2_tied"), src)
    bundle = root / "bundle"
    embedq.quantize(src, 8, output=bundle, overlay_only=True, progress=False)
    embedq.quantize(src, 8, progress=False)
    return src, bundle


def _edit_header(file, fn, extra: bytes = b"", cut: int = 0) -> None:
    """Rewrite the JSON header of a safetensors file with ``fn(header)``; the data as is
    (``extra`` appended, ``cut`` bytes dropped at the end)."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    fn(header)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    body = raw[8 + n:] + extra
    file.write_bytes(struct.pack("<Q", len(hb)) + hb + body[:len(body) - cut])


def _scale_as_f32(t):
    t[f"{EMB}.weight_scale"] = t[f"{EMB}.weight_scale"].float()


def _half_the_rows(t):
    t[f"{EMB}.weight_packed"] = t[f"{EMB}.weight_packed"][:256].clone()


def _no_shape(t):
    del t[f"{EMB}.weight_shape"]


def _overlap(h):
    """The shape tensor's 16 bytes moved onto the start of the first tensor's."""
    first = min((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    h[f"{EMB}.weight_shape"]["data_offsets"] = [0, 16] if first != f"{EMB}.weight_shape" else [16, 32]


def _past_the_end(h):
    """Nothing changed in the header: the file is cut short (below), so the last tensor's
    declared bytes lie past its end."""


def _more_bytes_than_the_shape(h):
    b, e = h[f"{EMB}.weight_scale"]["data_offsets"]
    h[f"{EMB}.weight_scale"]["data_offsets"] = [b, e + 8]


CASES = {  # name: (tensor edit | header edit, words of the error)
    "dtype": (_scale_as_f32, None, ("weight_scale", "the config declares BF16")),
    "shape": (_half_the_rows, None, ("weight_packed", "the config declares I32 [512,")),
    "missing": (_no_shape, None, ("missing tensor", "weight_shape")),
    "overlap": (None, _overlap, ("overlapping",)),
    "outside the file": (None, _past_the_end, ("truncated safetensors file",)),
    "offsets not the size": (None, _more_bytes_than_the_shape, ("weight_scale", "data_offsets hold")),
}


def _break(folder, name):
    tensors, header, _ = CASES[name]
    if tensors is not None:
        tamper_overlay(folder, tensors)  # checksums recomputed
    else:
        _edit_header(folder / "embedq.safetensors", header, cut=8 if name == "outside the file" else 0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_overlay_header_held_to_the_config(made, model_factory, tmp_path, name):
    src, bundle = made
    words = CASES[name][2]
    folder = tmp_path / "m"
    shutil.copytree(src, folder)
    _break(folder, name)
    before = tree(folder)
    assert_refused(run_cli("verify", folder), str(folder / "embedq.safetensors"), *words)
    for load in (embedq.load_overlay, embedq.load):
        with pytest.raises(OverlayError) as e:
            load(folder)
        assert str(folder / "embedq.safetensors") in str(e.value) and all(w in str(e.value) for w in words), \
            str(e.value)
    assert tree(folder) == before
    b = tmp_path / "bundle"
    shutil.copytree(bundle, b)
    _break(b, name)
    base = model_factory("qwen2_tied")
    base_before = tree(base)
    assert_refused(run_cli("apply", base, "--overlay", b), str(b / "embedq.safetensors"), *words)
    assert tree(base) == base_before


def test_the_genuine_header_passes(made):
    """The positive control: the header checks accept what quantize wrote."""
    src, _ = made
    embedq.load_overlay(src)
    assert run_cli("verify", src)[0] == 0
    assert torch.is_tensor(embedq.load_overlay(src).tables[EMB].scale)
