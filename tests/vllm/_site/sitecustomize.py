"""Loaded at start-up by every Python process the whole-engine tests start (their
PYTHONPATH names this folder): vLLM's engine and its registry subprocesses included."""

from _missing_kernels import without_torchvision

without_torchvision()
