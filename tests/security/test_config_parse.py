"""docs/security.md rows 1 and 3: one validated parse of ``quantization_config.json``, run by
every reader (``validate_config``, ``read_config_file``, ``read_overlay_config``, ``scheme_of``
for one entry's scheme fields, transformers' quantizer), and the rule of what an overlay may
replace (an embedding or head by its last name component and role, its source
``<module>.weight``, a tied head the embedding's). Pure parses, and one
``from_pretrained``: fast. (vLLM's ``EmbedqConfig.from_config``: tests/vllm/test_vllm_models.py.)
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest

import embedq
from embedq.errors import OverlayError
from embedq.format.config import parse_config, read_config_file, scheme_of, validate_config
from embedq.format.reader import read_overlay_config
from secutil import read_qconfig, write_qconfig
from test_untrusted import MALFORMED

# the mutations of scheme fields, which scheme_of checks alone
SCHEME_FIELDS = {"num_bits_abc", "num_bits_2", "num_bits_true", "group_size_str", "group_size_huge",
                 "group_size_neg", "group_size_7", "symmetric_str", "scale_dtype_bad", "method_bad",
                 "strategy_mismatch"}


@pytest.fixture(scope="module")
def made(model_factory, tmp_path_factory):
    """An in-place per-row int8 overlay of qwen2_tied (MALFORMED's mutations assume it)."""
    src = tmp_path_factory.mktemp("parse") / "m"
    shutil.copytree(model_factory("qwen2_tied"), src)
    embedq.quantize(src, 8, group_size=0, progress=False)
    return src, read_qconfig(src)


def _error(fn, *args) -> str | None:
    try:
        fn(*args)
    except OverlayError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_every_reader_runs_the_one_parse(name, made, tmp_path):
    """``validate_config``, ``read_config_file`` and ``read_overlay_config`` refuse exactly
    what ``parse_config`` refuses, with its message (the file named, never a CLI flag);
    ``scheme_of`` refuses the same scheme fields."""
    src, good = made
    bad = MALFORMED[name](copy.deepcopy(good))
    where = "X/quantization_config.json"
    want = _error(parse_config, bad, where)
    assert _error(validate_config, bad, where) == want
    if want is not None:
        assert want.startswith(where + ": ") and "--" not in want, want
    qfile = tmp_path / "quantization_config.json"
    qfile.write_text(json.dumps(bad))
    assert _error(read_config_file, qfile) == (None if want is None else want.replace(where, str(qfile)))
    folder = tmp_path / "m"
    shutil.copytree(src, folder)
    (folder / "quantization_config.json").write_text(json.dumps(bad))  # config.json keeps the good one
    got = _error(read_overlay_config, folder)
    if want is None:
        assert got is None or "differs from quantization_config.json" in got, got
    else:
        assert got == want.replace(where, str(folder / "quantization_config.json")), got
    if name in SCHEME_FIELDS:
        entry = bad["modules"]["model.embed_tokens"]
        why = _error(scheme_of, entry)
        assert why is not None and want is not None, (why, want)
        assert why.split(": module entry: ", 1)[1] == want.split(": module model.embed_tokens: ", 1)[1]


def test_the_parse_is_frozen(made):
    """What the parse returns cannot be edited after the checks: frozen dataclasses and
    read-only mappings (a reader cannot change a checked field, by mistake or otherwise)."""
    import dataclasses
    _, good = made
    cfg = parse_config(good, "q.json")
    entry = cfg.modules["model.embed_tokens"]
    for obj, attr, value in ((cfg, "overlay", "../x"), (entry, "shape", (1, 1)), (entry.source, "tensor", "x")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, attr, value)
    for mapping in (cfg.modules, cfg.aliases, entry.checksums):
        with pytest.raises(TypeError):
            mapping["x"] = None  # type: ignore[index]


@pytest.mark.parametrize("broken", ["num_bits", "a non-embedding"])
def test_the_transformers_quantizer_runs_the_one_parse(made, tmp_path, broken):
    """A plain ``from_pretrained`` (no ``embedq.load`` in front) of a folder whose config.json
    carries a malformed embedq quantization_config: the quantizer's parse refuses it, naming
    config.json's quantization_config."""
    import transformers

    from embedq.backends.transformers import register
    src, _ = made
    folder = tmp_path / "m"
    shutil.copytree(src, folder)
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg["quantization_config"]
    if broken == "num_bits":
        qc["modules"]["model.embed_tokens"]["num_bits"] = 2
    else:
        e = qc["modules"].pop("model.embed_tokens")
        e["role"] = "head"
        e["source"]["tensor"] = "model.layers.0.mlp.down_proj.weight"
        qc["modules"]["model.layers.0.mlp.down_proj"] = e
        qc["aliases"], qc["onnx"] = {}, None
    (folder / "config.json").write_text(json.dumps(cfg))
    register()
    with pytest.raises(OverlayError, match=r"^config.json quantization_config: module "):
        transformers.AutoModelForCausalLM.from_pretrained(str(folder))


# --- row 3: an overlay replaces only embeddings and heads ----------------------------------

@pytest.mark.parametrize("module,role,source,problem", [
    ("model.embed_tokens", "embedding", "model.embed_tokens.weight", None),
    ("lm_head", "head", "lm_head.weight", None),
    ("lm_head", "head", "model.embed_tokens.weight", None),  # a tied head reads the embedding's
    ("model.norm", "embedding", "model.norm.weight", "is not an embedding table"),
    ("model.layers.0.mlp.down_proj", "head", "model.layers.0.mlp.down_proj.weight", "not an output embedding"),
    ("lm_head", "embedding", "lm_head.weight", "is not an embedding table"),  # a head's name, another role
    ("model.embed_tokens", "head", "model.embed_tokens.weight", "not an output embedding"),
    ("model.embed_tokens", "embedding", "model.norm.weight", "is not model.embed_tokens.weight"),
    ("model.embed_tokens", "embedding", "lm_head.weight", "is not model.embed_tokens.weight"),
    ("lm_head", "head", "model.norm.weight", "is not lm_head.weight"),
    ("model.embed_tokens", "embedding", "model.embed_tokens.bias", "is not a .weight"),
])
def test_a_module_replaces_only_an_embedding_or_head(made, module, role, source, problem):
    _, good = made
    cfg = copy.deepcopy(good)
    e = cfg["modules"].pop("model.embed_tokens")
    e.pop("checksums")
    e["role"], e["source"]["tensor"] = role, source
    cfg["modules"][module] = e
    cfg["aliases"], cfg["tie_word_embeddings"] = {}, False
    cfg.pop("onnx")
    why = _error(parse_config, cfg, "q.json")
    if problem is None:
        assert why is None, why
    else:
        assert why is not None and why.startswith(f"q.json: module {module}") and problem in why, why


def test_an_alias_names_only_an_embedding_or_head(made):
    _, good = made
    for alias, ok in (("lm_head", True), ("model.norm", False), ("model.layers.0.mlp.down_proj", False)):
        cfg = copy.deepcopy(good)
        cfg["aliases"] = {alias: "model.embed_tokens"}
        cfg.pop("onnx")
        why = _error(parse_config, cfg, "q.json")
        assert (why is None) == ok, (alias, why)
        if not ok:
            assert f"alias {alias} is not an embedding or head" in why, why


def test_a_refused_module_is_refused_by_verify_and_load_too(made, tmp_path):
    """The parse's refusal is what every verb meets (here through the file and config.json's copy)."""
    src, good = made
    folder = tmp_path / "m"
    shutil.copytree(src, folder)
    cfg = copy.deepcopy(good)
    cfg["modules"]["model.embed_tokens"]["source"]["tensor"] = "model.norm.weight"
    write_qconfig(folder, cfg)
    with pytest.raises(OverlayError, match="is not model.embed_tokens.weight"):
        embedq.verify(folder)
    with pytest.raises(OverlayError, match="is not model.embed_tokens.weight"):
        embedq.load(folder)
