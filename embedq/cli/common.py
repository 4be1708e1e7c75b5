"""What every CLI verb shares: one-line errors and the exit codes."""

from __future__ import annotations

import typer

from embedq.errors import EmbedqError


def fail(e: Exception) -> None:
    typer.echo(f"embedq: error: {e}", err=True)
    raise typer.Exit(getattr(e, "exit_code", 2))


def run(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except EmbedqError as e:
        fail(e)
    except KeyboardInterrupt:
        typer.echo("embedq: interrupted; the source checkpoint is unchanged", err=True)
        raise typer.Exit(130)
    except OSError as e:
        fail(EmbedqError(f"{getattr(e, 'filename', '') or ''}: {e.strerror or e}"))
