"""scheme_advice: warnings follow the measured Gemma 3 270M data
(embedq/jobs/measured_gemma3_270m.json, written by scripts/eval_gemma3.py --update-advice)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from embedq.jobs.advice import LOSSY_KLD, LOSSY_TOP1, MEASURED_GEMMA3_270M, scheme_advice
from embedq.format.scheme import Scheme

TIED = {"tie_word_embeddings": True}
UNTIED = {"tie_word_embeddings": False}


# cites: the row the warning quotes, None where it quotes none; the Q4-gather rows (head float, or its own int8 table) were re-measured
# with the signed-max mapping by scripts/eval_gemma3.py --all --update-advice
@pytest.mark.parametrize("scheme,config,kw,warns,cites", [
    (Scheme.default(8), TIED, {}, False, None),  # the default, int8 g64: below the bf16 floor
    (Scheme.default(8, group_size=0), TIED, {}, True, (8, None, True, "shared")),
    (Scheme.default(8, group_size=128), TIED, {}, False, None),
    (Scheme.default(8, group_size=32), TIED, {}, False, None),
    (Scheme.default(4), TIED, {}, True, (4, 32, True, "shared")),
    (Scheme.default(4, symmetric=False), TIED, {}, True, (4, 32, False, "shared")),
    (Scheme.default(4), TIED, {"head_scheme": Scheme.default(8)}, True, (4, 32, True, "float")),  # the gather is still Q4
    (Scheme.default(8), UNTIED, {}, False, None),  # not measured on an untied model
    (Scheme.default(4), UNTIED, {}, True, (4, 32, True, "float")),  # a gather only: that row
    (Scheme.default(8), UNTIED, {"lm_head": True}, False, None),
    (Scheme.default(4), UNTIED, {"lm_head": True}, True, (4, 32, True, "shared")),
    (Scheme.default(8, group_size=0), {"text_config": {"tie_word_embeddings": True},
                                       "tie_word_embeddings": False}, {}, True, (8, None, True, "shared")),
])
def test_advice(scheme, config, kw, warns, cites):
    a = scheme_advice(scheme, config, **kw)
    assert (a is not None) == warns
    if a:
        assert "\n" not in a
    if cites is not None:
        kld, top1, _ = MEASURED_GEMMA3_270M[cites]
        assert f"Gemma 3 270M: mean KLD {kld:.4g}, same top-1 {top1:.1f}%" in a
    elif a:
        assert "Gemma 3 270M:" not in a  # no number without a measured row


def test_warnings_agree_with_the_measurements():
    for (bits, group, sym, head), (kld, top1, _) in MEASURED_GEMMA3_270M.items():
        lossy = kld >= LOSSY_KLD or top1 < LOSSY_TOP1
        s = Scheme(bits=bits, group_size=group, symmetric=sym)
        if head == "shared":
            a = scheme_advice(s, TIED)
        elif head == "float":
            a = scheme_advice(s, UNTIED)
        else:
            a = scheme_advice(s, TIED, head_scheme=Scheme(bits=8))
        if head == "float" and bits == 8:
            continue  # untied int8 is deliberately not warned about (see scheme_advice)
        assert (a is not None) == lossy, (bits, group, sym, head)


def test_quantize_reports_the_advice(model_factory, tmp_path):
    import embedq
    src = model_factory("qwen2_tied")
    rep = embedq.quantize(src, bits=8, progress=False)  # the default: no warning about itself
    assert rep.modules[0].scheme == "int8 g64 sym" and not any("Gemma 3 270M" in w for w in rep.warnings)
    rep = embedq.quantize(src, bits=8, group_size=0, force=True, progress=False)
    assert any("measurably lossy" in w for w in rep.warnings)
    assert "warning: int8 per-row on a tied table" in rep.table()
    rep = embedq.quantize(src, bits=8, group_size=32, force=True, progress=False)
    assert not any("Gemma 3 270M" in w for w in rep.warnings)
    rep = embedq.quantize(src, bits=4, output=tmp_path / "d", progress=False)
    assert any("4-bit tied head is lossy" in w for w in rep.warnings)


def _eval_script():
    script = Path(__file__).resolve().parents[2] / "scripts" / "eval_gemma3.py"
    spec = importlib.util.spec_from_file_location("eval_gemma3", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_measured_row_names_its_run_and_no_retired_mapping():
    from importlib.resources import files
    data = json.loads(files("embedq.jobs").joinpath("measured_gemma3_270m.json").read_text())
    for r in data["rows"] + [data["floor"]]:
        assert r["measured_by"] and "absmax" not in r["measured_by"], r
    # the stale absmax/7 rows are not claimed until scripts/eval_gemma3.py re-measures them
    rows = {(r["bits"], r["group_size"], r["symmetric"], r["head"]): r for r in data["rows"]}
    for key in [(4, 128, True, "shared"), (4, 64, True, "shared"), (4, 32, True, "float"), (4, 32, True, "int8")]:
        assert key not in rows or rows[key]["measured_by"].startswith("python scripts/eval_gemma3.py"), key


def test_eval_script_writes_the_data_advice_reads(tmp_path):
    """scripts/eval_gemma3.py --update-advice: its rows replace the data's, under the advice's keys."""
    ev = _eval_script()
    from importlib.resources import files
    dest = tmp_path / "measured.json"
    dest.write_text(files("embedq.jobs").joinpath("measured_gemma3_270m.json").read_text())
    label, qkw, float_head = ev.ROWS["q4-g32-gather"]
    ev.update_advice([{"quantize": qkw, "float_head": float_head, "mean_kld": 0.0412345, "same_top1": 91.23,
                       "overlay_MB": 94.4}], "test machine", "python scripts/eval_gemma3.py --rows q4-g32-gather",
                     path=dest)
    rows = {(r["bits"], r["group_size"], r["symmetric"], r["head"]): r for r in json.loads(dest.read_text())["rows"]}
    assert rows[(4, 32, True, "float")]["mean_kld"] == 0.04123
    assert "test machine" in rows[(4, 32, True, "float")]["measured_by"]
    assert ev.advice_key(*ev.ROWS["int8-row"][1:]) == (8, None, True, "shared")  # per row, not the default g64
    assert ev.advice_key(*ev.ROWS["q4-g32-head8"][1:]) == (4, 32, True, "int8")  # --head-bits 8: g64
    assert ev.advice_key(*ev.ROWS["q4-g32-head8-row"][1:]) is None  # a per-row head: not the advice's
    assert set(MEASURED_GEMMA3_270M) <= {ev.advice_key(q, f) for _, q, f in ev.ROWS.values()}
