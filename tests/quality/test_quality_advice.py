"""scheme_advice: warnings follow the measured Gemma 3 270M table."""

from __future__ import annotations

import pytest

from embedq.jobs.advice import LOSSY_KLD, LOSSY_TOP1, MEASURED_GEMMA3_270M, scheme_advice
from embedq.format.scheme import Scheme

TIED = {"tie_word_embeddings": True}
UNTIED = {"tie_word_embeddings": False}


@pytest.mark.parametrize("scheme,config,kw,warns", [
    (Scheme.default(8), TIED, {}, False),  # the default, int8 g64: below the bf16 floor
    (Scheme.default(8, group_size=0), TIED, {}, True),  # int8 per-row, tied: 0.0067 / 96.5%
    (Scheme.default(8, group_size=128), TIED, {}, False),
    (Scheme.default(8, group_size=32), TIED, {}, False),
    (Scheme.default(4), TIED, {}, True),
    (Scheme.default(4, symmetric=False), TIED, {}, True),
    (Scheme.default(4), TIED, {"head_scheme": Scheme.default(8)}, True),  # the gather is still Q4
    (Scheme.default(8), UNTIED, {}, False),  # not measured on an untied model
    (Scheme.default(4), UNTIED, {}, True),
    (Scheme.default(8), UNTIED, {"lm_head": True}, False),
    (Scheme.default(4), UNTIED, {"lm_head": True}, True),
    (Scheme.default(8, group_size=0), {"text_config": {"tie_word_embeddings": True},
                                       "tie_word_embeddings": False}, {}, True),
])
def test_advice(scheme, config, kw, warns):
    a = scheme_advice(scheme, config, **kw)
    assert (a is not None) == warns
    if a:
        assert "\n" not in a and "Gemma 3 270M" in a


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
