"""``embedq gguf`` (and ``embedq inspect X.gguf``): the llama.cpp back end's commands."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from embedq.cli.common import run


def _file_kind(p: Path) -> None:
    """A file that is not GGUF: say what it is (one line), as ``inspect`` cannot read it."""
    from embedq.errors import EmbedqError
    try:
        with open(p, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise EmbedqError(f"{p}: cannot read it ({e.strerror or e})") from None
    if len(head) >= 9 and head[8:9] == b"{":  # a safetensors header: u64 length, then JSON
        what = "a safetensors file"
    elif head[:1] in (b"{", b"["):
        what = "a JSON file"
    else:
        what = f"not a GGUF file (it starts {head[:4]!r}, GGUF files start b'GGUF')"
    raise EmbedqError(f"{p}: {what}: give the model's folder, a Hub id or a llama.cpp .gguf file")


def is_gguf_path(spec: str) -> bool:
    """Whether ``embedq inspect`` was given a GGUF file, decided by its content (magic
    ``GGUF``); another file gets one error line naming what it is; a folder or a Hub id is
    a checkpoint."""
    p = Path(spec)
    if not p.is_file():
        return spec.endswith(".gguf")  # a missing .gguf: the GGUF back end names it
    with open(p, "rb") as f:
        if f.read(4) == b"GGUF":
            return True
    run(_file_kind, p)
    return False


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
                                     "(int8 or 4-bit, groups of 32, float16 scales, symmetric)"),
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
