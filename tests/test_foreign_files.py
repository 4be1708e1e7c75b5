"""Files of embedq's names that embedq did not write: another tool's quantization_config.json,
a folder where the overlay goes, a config.json whose quantization_config disagrees with the
overlay's. Each is refused in one line (or left alone), and the folder is unchanged."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import embedq
from ckptutil import snapshot
from embedq.cli import app

KIND = "qwen2_tied"


def cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def one_error(code, out, *needles):
    assert code == 2 and "Traceback" not in out, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("embedq: error: "), out
    for n in needles:
        assert n in lines[0], lines[0]


def tree(path):
    """Every entry under ``path`` (hidden ones and folders too) with its bytes."""
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else p.is_dir())
            for p in sorted(path.rglob("*"))}


@pytest.fixture
def bundle(model_factory, tmp_path):
    out = tmp_path / "ov"
    embedq.quantize(model_factory(KIND), 8, output=out, overlay_only=True, progress=False)
    return out


@pytest.mark.parametrize("foreign", ['{"quant_method": "awq", "bits": 4}', '{"note": "mine"}', "not json"])
def test_foreign_quantization_config_is_never_overwritten(model_factory, bundle, foreign):
    base = model_factory(KIND)
    (base / "quantization_config.json").write_text(foreign)
    before = tree(base)
    qc = base / "quantization_config.json"
    one_error(*cli("apply", base, "--overlay", bundle), str(qc), "not embedq's", "move it out")
    one_error(*cli("quantize", base, "--bits", "8", "-q"), str(qc), "not embedq's", "--output")
    one_error(*cli("remove", base), "no embedq overlay to remove", "not embedq's; left alone")
    assert tree(base) == before
    code, out = cli("quantize", base, "--bits", "8", "-q", "-o", base.parent / "derived")  # the named fix
    assert code == 0, out
    assert tree(base) == before


@pytest.mark.parametrize("name", ["embedq.safetensors", "quantization_config.json"])
def test_a_folder_where_the_overlay_goes(model_factory, bundle, name):
    base = model_factory(KIND)
    (base / name).mkdir()
    before = tree(base)
    one_error(*cli("apply", base, "--overlay", bundle), str(base / name), "not a regular file")
    assert tree(base) == before  # no .embedq/ (backup, lock) left behind
    one_error(*cli("quantize", base, "--bits", "8", "-q", "--force"), str(base / name))
    one_error(*cli("remove", base), "no embedq overlay to remove")
    assert tree(base) == before


@pytest.mark.parametrize("name", ["embedq.safetensors", "quantization_config.json"])
def test_link_out_of_the_folder_where_the_overlay_goes(model_factory, bundle, tmp_path, name):
    """A link leading out of the folder at either name: apply and quantize refuse before any
    backup; remove leaves the link (and what it points at) alone and says there is no overlay."""
    base = model_factory(KIND)
    target = tmp_path / "elsewhere"
    target.write_text('{"quant_method": "embedq"}')
    (base / name).symlink_to(target)
    before = tree(base)
    one_error(*cli("apply", base, "--overlay", bundle), str(base / name), "a link out of the folder")
    one_error(*cli("quantize", base, "--bits", "8", "-q"), str(base / name), "a link out of the folder")
    one_error(*cli("remove", base), "no embedq overlay to remove")
    assert tree(base) == before and (base / name).is_symlink()
    assert target.read_text() == '{"quant_method": "embedq"}'


def test_a_failed_commit_restores_the_old_tree(model_factory, bundle, monkeypatch):
    """Whatever stops the commit after the backup (here a folder at the overlay's name that
    the checks were told to miss), the restore finishes: the old tree, no state folder."""
    from embedq.jobs import state
    base = model_factory(KIND)
    (base / "embedq.safetensors").mkdir()
    before = tree(base)
    monkeypatch.setattr(state, "check_slots", lambda path: None, raising=False)
    with pytest.raises(embedq.EmbedqError, match="cannot write overlay: Is a directory"):
        embedq.apply(base, bundle)
    assert tree(base) == before


def test_remove_after_apply_keeps_nothing_else(model_factory, bundle):
    base = model_factory(KIND)
    pristine = snapshot(base)
    embedq.apply(base, bundle)
    assert json.loads((base / "quantization_config.json").read_text())["quant_method"] == "embedq"
    code, out = cli("remove", base)
    assert code == 0 and "removed" in out, out
    assert snapshot(base) == pristine


@pytest.mark.parametrize("broken", [{"quant_method": "embedq", "format_version": 2}, "other bits"])
def test_config_json_quantization_config_must_match(model_factory, tmp_path, broken):
    """Loaders read config.json's copy: verify and push check it, not only quantization_config.json."""
    derived = tmp_path / "d"
    embedq.quantize(model_factory(KIND), 8, output=derived, progress=False)
    cfg = json.loads((derived / "config.json").read_text())
    if broken == "other bits":
        broken = json.loads(json.dumps(cfg["quantization_config"]))
        broken["modules"]["model.embed_tokens"]["num_bits"] = 4
    cfg["quantization_config"] = broken
    (derived / "config.json").write_text(json.dumps(cfg))
    before = snapshot(derived)
    where = str(derived / "config.json")
    one_error(*cli("verify", derived), where)
    one_error(*cli("push", derived, "--repo-id", "me/x", "--dry-run"), where)
    assert snapshot(derived) == before


@pytest.mark.parametrize("name", ["embedq.safetensors", "quantization_config.json"])
def test_broken_link_inside_the_folder_is_replaced(model_factory, name):
    """A link inside the folder that points nowhere holds nothing an overlay could destroy:
    quantize in place replaces it (it was refused as 'not a regular file'), remove restores."""
    path = model_factory(KIND)
    pristine = {k: v for k, v in tree(path).items()}
    (path / name).symlink_to("gone.bin")
    code, out = cli("quantize", path, "-q")
    assert code == 0, out
    assert (path / name).is_file() and not (path / name).is_symlink()
    embedq.verify(path)
    code, out = cli("remove", path)
    assert code == 0, out
    assert tree(path) == pristine
