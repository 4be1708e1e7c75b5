"""pytest hook: a skipped test marked ``founding`` (the seed scenario: Qwen3.5, an int8
table, the MTP drafter sharing it) is reported as a failure, never as a skip."""

from __future__ import annotations

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and item.get_closest_marker("founding") and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"a founding-case test may not skip (it fails the suite): {reason}"
