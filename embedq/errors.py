"""Errors raised by embedq. The CLI prints them as one line and exits non-zero."""

from __future__ import annotations


class EmbedqError(Exception):
    """A user-facing error: bad input, unsupported checkpoint, unsafe destination."""

    exit_code = 2


class CheckpointError(EmbedqError):
    """The checkpoint on disk is missing, corrupt or inconsistent."""


class UnsafePathError(CheckpointError):
    """A model folder names, or links to, a file outside itself (see format/files.inside)."""


class TieError(EmbedqError):
    """Config and tensors disagree on whether the embedding and head are tied."""


class SchemeError(EmbedqError):
    """The requested quantization scheme does not fit the tensor."""


class OverlayError(EmbedqError):
    """An overlay is missing, stale, half-written or does not match its source."""


class EvalError(EmbedqError):
    """The evaluation cannot run (no float reference, no tokenizer, text too short...)."""
