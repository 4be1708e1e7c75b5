"""Layer 6, the ``embedq`` command line (one typer app, :data:`embedq.cli.app.app`)."""

from embedq.cli.app import app, main

__all__ = ["app", "main"]
