"""Prints how many examples each fuzz test ran, and how they ended (issue #25)."""

from __future__ import annotations


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
