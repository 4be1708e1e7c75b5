"""``embedq apply``, ``embedq push`` and ``embedq card``: publishing commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from embedq.cli.common import run


def register(app: typer.Typer) -> None:

    @app.command()
    def apply(
        base: Path = typer.Argument(..., help="Local copy of the base checkpoint (modified in place)"),
        overlay: Path = typer.Option(..., "--overlay", help="Overlay bundle folder (embedq.safetensors + quantization_config.json)"),
        force: bool = typer.Option(False, "--force", help="Replace an embedq overlay the base already has"),
        as_json: bool = typer.Option(False, "--json", help="Print the report as JSON"),
    ) -> None:
        """Lay an overlay-only bundle onto BASE in place (refuses a base whose tables differ)."""
        from embedq.jobs.apply import apply_overlay
        report = run(apply_overlay, base, overlay, force=force)
        typer.echo(report.to_json() if as_json else
                   f"applied {overlay} to {base} (undo: embedq remove {base})\n" + report.table())

    @app.command()
    def push(
        folder: Path = typer.Argument(..., help="Derived checkpoint or overlay bundle folder"),
        repo_id: str = typer.Option(..., "--repo-id", help="Hub repository, user/name"),
        private: bool = typer.Option(False, "--private", help="Create the repository private"),
        revision: Optional[str] = typer.Option(None, "--revision", help="Branch to commit to (created if missing)"),
        dry_run: bool = typer.Option(False, "--dry-run", help="List the operations and sizes; send nothing"),
        token: Optional[str] = typer.Option(None, "--token", help="Hub token (default: HF_TOKEN or `hf auth login`)"),
        message: Optional[str] = typer.Option(None, "--message", "-m", help="Commit message"),
        no_card_update: bool = typer.Option(False, "--no-card-update", help="Upload README.md as it is"),
        include: Optional[List[str]] = typer.Option(None, "--include", help="Also upload files matching this glob (repeatable); by default only weights, configs, tokenizer, card and overlay go up"),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON"),
    ) -> None:
        """Upload FOLDER to the Hub in one commit; prints the commit URL."""
        from embedq.hub.push import push as _push
        result = run(_push, folder, repo_id, private=private, revision=revision, dry_run=dry_run,
                      token=token, commit_message=message, update_card=not no_card_update,
                      progress=not as_json, include=include or None)
        typer.echo(json.dumps(result.to_dict(), indent=2) if as_json else str(result))

    @app.command()
    def card(
        folder: Path = typer.Argument(..., help="Derived checkpoint or overlay bundle with an embedq README.md"),
        eval_file: Optional[Path] = typer.Option(None, "--eval", help="`embedq eval --json` results (default: embedq-eval.json in FOLDER)"),
        base_model: Optional[str] = typer.Option(None, "--base-model", help="Hub id of the source"),
        base_revision: Optional[str] = typer.Option(None, "--base-revision", help="Hub revision of the source"),
        repo_id: Optional[str] = typer.Option(None, "--repo-id", help="Hub id this folder is published as"),
        license: Optional[str] = typer.Option(None, "--license", help="License id (default: copied from the source card)"),
        stdout: bool = typer.Option(False, "--stdout", help="Print the card instead of writing README.md"),
    ) -> None:
        """Re-render the model card README.md of FOLDER (e.g. to add eval results)."""
        from embedq.jobs.card import refresh_card
        text = run(refresh_card, folder, eval_results=eval_file, base_model=base_model,
                    base_revision=base_revision, repo_id=repo_id, license=license, write=not stdout)
        typer.echo(text if stdout else f"wrote {folder / 'README.md'}")
