"""``embedq gguf`` (and ``embedq inspect X.gguf``): the llama.cpp back end's commands."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from embedq.cli.common import run


def is_gguf_path(spec: str) -> bool:
    """Whether ``embedq inspect`` was given a GGUF file, decided by its content
    (:func:`embedq.format.files.inspect_target`); another file gets one error line."""
    from embedq.format.files import inspect_target
    return run(inspect_target, spec) == "gguf"


def _backend():
    from embedq.errors import EmbedqError

    def load():
        try:
            import gguf  # noqa: F401  (ggml's type table and dequantization)
        except ImportError:
            raise EmbedqError("gguf: not installed: pip install 'embedq[gguf]'") from None
        from embedq.backends import gguf as backend
        return backend
    return run(load)


def inspect(spec: str, as_json: bool) -> None:
    """``embedq inspect X.gguf``: tables, types, sizes, and the file after ``embedq gguf``."""
    backend = _backend()
    from embedq.backends.gguf.inspect import format_inspect_gguf
    d = run(backend.inspect_gguf, spec)
    typer.echo(json.dumps(d, indent=2) if as_json else format_inspect_gguf(d))


def register(app: typer.Typer) -> None:
    @app.command("gguf")
    def gguf(
        base: Path = typer.Argument(..., help="llama.cpp GGUF file of the model the overlay was made from"),
        overlay: Path = typer.Option(..., "--overlay", help="Folder with the embedq overlay "
                                     "(int8 or 4-bit, symmetric, float16 scales, per row or groups of a multiple of 32)"),
        output: Path = typer.Option(..., "--output", "-o", help="GGUF file to write"),
        force: bool = typer.Option(False, "--force", help="Replace OUTPUT"),
        as_json: bool = typer.Option(False, "--json", help="Print the report as JSON"),
    ) -> None:
        """Write BASE with its token_embd (and a separate output head) holding the overlay's
        tables as Q8_0 / Q4_0 — the same codes and scales, nothing re-rounded; every other
        tensor and key byte for byte. An overlay of another model is refused."""
        backend = _backend()
        report = run(backend.transcode, base, overlay, output, force=force)
        typer.echo(report.to_json() if as_json else report.table())
