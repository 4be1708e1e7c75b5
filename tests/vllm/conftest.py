"""Tests of the vLLM back end against the real vLLM 0.33.0 package.

They run inside the vLLM virtual environment (``scripts/test_vllm.sh`` creates it and
runs them with ``EMBEDQ_VLLM_TESTS=1``). In any other run this folder is not collected;
with ``EMBEDQ_VLLM_TESTS=1`` a missing vLLM is an error, never a skip, and so is a skip
of a test marked ``founding`` (_founding.py).
"""

from __future__ import annotations

import os

if os.environ.get("EMBEDQ_VLLM_TESTS") != "1":
    collect_ignore_glob = ["*"]
else:
    from _harness import configure_env

    configure_env()

    import pytest

    from _founding import pytest_runtest_makereport  # noqa: F401  (hook)
    from _harness import Builder

    @pytest.fixture(scope="session")
    def builder(tmp_path_factory):
        return Builder(tmp_path_factory.mktemp("ckpts"))
