"""The fuzz suites' pristine folders (``made``), and a table of how many examples each fuzz
test ran and how they ended (issue #25)."""

from __future__ import annotations

import shutil

import pytest

import embedq


def pytest_terminal_summary(terminalreporter):
    from secutil import FUZZ_COUNTS
    if not FUZZ_COUNTS:
        return
    tr = terminalreporter
    tr.section("embedq fuzz examples")
    total = 0
    for test, outcomes in sorted(FUZZ_COUNTS.items()):
        outcomes = dict(outcomes)
        n = outcomes.pop("", 0)
        total += n
        tr.write_line(f"{test:<34} {n:>4} examples: "
                      + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    tr.write_line(f"{'total':<34} {total:>4} examples, 0 tracebacks (a traceback fails its test)")


# Module scope, as each suite had it: built once per fuzz file. test_fuzz_config.py defines its
# own ``made`` (one bundle), which pytest uses there instead of this one.
@pytest.fixture(scope="module")
def made(model_factory, tmp_path_factory):
    """Pristine folders, made once: float qwen2_tied, llama sharded, their in-place
    quantized copies and an overlay-only bundle of qwen2_tied."""
    root = tmp_path_factory.mktemp("fuzzsrc")
    q, l = model_factory("qwen2_tied"), model_factory("llama_untied_sharded")
    qq, lq = root / "qwen_q", root / "llama_q"
    shutil.copytree(q, qq)
    shutil.copytree(l, lq)
    embedq.quantize(qq, 8, progress=False)
    embedq.quantize(lq, 4, lm_head=True, progress=False)
    bundle = root / "bundle"
    embedq.quantize(q, 8, output=bundle, overlay_only=True, progress=False)
    return {"qwen": q, "llama": l, "qwen_q": qq, "llama_q": lq, "bundle": bundle}
