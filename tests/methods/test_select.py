"""``--max-kld`` / ``--auto``: smallest overlay under a measured KLD, everything tried reported."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from embedq.jobs.recipe import QuantizeRecipe
from embedq.quality.select import (CANDIDATES, SelectError, overlay_bytes, quantize_auto,
                                    select_scheme)
from tests.methods.test_headaware import _tokenizer


@pytest.fixture
def tied(model_factory):
    path = model_factory("qwen2_tied")
    _tokenizer(path, 512)
    return path


def test_overlay_bytes_matches_written_overlay(tied):
    import embedq
    embedq.quantize(tied, bits=4, group_size=32, symmetric=False, progress=False)
    ov = embedq.load_overlay(tied)
    t = ov.tables["model.embed_tokens"]
    n = t.packed.numel() * 4 + t.scale.numel() * 2 + 16 + t.packed_zero_point().numel() * 4
    assert overlay_bytes((512, 64), 4, 32, False, 2) == n


def test_loose_threshold_picks_the_smallest_fitting_scheme(tied):
    sel = select_scheme(tied, 10.0, contexts=2, length=32)
    # cols = 64: g128 does not fit; the smallest that fits is Q4 g64 sym
    assert sel.chosen is not None and (sel.chosen.bits, sel.chosen.group_size, sel.chosen.symmetric) == (4, 64, True)
    assert sel.chosen.method == "gptq"  # tied: the head reads the table
    assert [t.overlay_bytes for t in sel.trials] == sorted(t.overlay_bytes for t in sel.trials)
    skipped = [t for t in sel.trials if t.note]
    assert skipped and all(t.group_size == 128 for t in skipped)
    assert len(sel.trials) == len(CANDIDATES)
    assert "<- chosen" in sel.table()


def test_threshold_orders_by_measured_kld(tied):
    loose = select_scheme(tied, 10.0, contexts=2, length=32, method="rtn")
    measured = {(t.bits, t.group_size, t.symmetric): t.mean_kld for t in loose.trials if t.mean_kld is not None}
    x = loose.chosen.mean_kld / 2  # the smallest scheme cannot pass this
    sel = select_scheme(tied, x, contexts=2, length=32, method="rtn")
    if sel.chosen is not None:
        assert sel.chosen.mean_kld <= x
        # every smaller candidate tried before it failed
        for t in sel.trials:
            if t is sel.chosen:
                break
            assert t.note or t.mean_kld > x
    assert measured


def test_impossible_threshold_is_a_clear_error(tied):
    with pytest.raises(SelectError, match="no candidate scheme"):
        quantize_auto(tied, QuantizeRecipe.from_options(max_kld=1e-15, method="rtn", progress=False))
    assert not (tied / "embedq.safetensors").exists()
    with pytest.raises(SelectError, match="positive"):
        select_scheme(tied, 0.0)


def test_cli_max_kld_writes_chosen_scheme(tied):
    from embedq.cli import app
    r = CliRunner().invoke(app, ["quantize", str(tied), "--max-kld", "10", "--method", "mse", "-q"])
    assert r.exit_code == 0, r.output
    assert "auto: smallest overlay" in r.output and "<- chosen" in r.output
    cfg = json.loads((tied / "quantization_config.json").read_text())
    e = cfg["modules"]["model.embed_tokens"]
    assert (e["num_bits"], e["group_size"], e["symmetric"], e["method"]) == (4, 64, True, "mse")


def test_cli_max_kld_refuses_explicit_scheme_flags(tied):
    from embedq.cli import app
    r = CliRunner().invoke(app, ["quantize", str(tied), "--auto", "--group-size", "32"])
    assert r.exit_code == 2 and "choose bits" in r.output
