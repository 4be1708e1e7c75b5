"""The ``embedq`` command line: a thin typer layer over the Python API."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from embedq.cli import onnx as onnx_verbs
from embedq.cli import publish as publish_verbs
from embedq.cli import quality as quality_verbs
from embedq.cli.common import fail, run
from embedq.errors import EmbedqError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Quantize embedding and lm_head tables into loadable overlays.")


@app.command()
def quantize(
    model: Path = typer.Argument(..., help="HF checkpoint folder"),
    bits: int = typer.Option(8, "--bits", help="4 or 8"),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Group size (default: 64 for 8-bit, per row where 64 does not divide the width; 32 for 4-bit; 0 = per row)"),
    asym: bool = typer.Option(False, "--asym", help="Asymmetric (zero points)"),
    method: Optional[str] = typer.Option(None, "--method", help="rtn (default), mse, or gptq (head-aware, calibrated); see docs/methods.md"),
    max_kld: Optional[float] = typer.Option(None, "--max-kld", help="Choose the scheme: the smallest overlay whose KLD on a built-in sample is <= this"),
    auto: bool = typer.Option(False, "--auto", help="--max-kld 0.01"),
    lm_head: bool = typer.Option(False, "--lm-head", help="Also quantize an untied lm_head"),
    head_bits: Optional[int] = typer.Option(None, "--head-bits"),
    head_group_size: Optional[int] = typer.Option(None, "--head-group-size"),
    targets: Optional[str] = typer.Option(None, "--targets", help="Comma-separated tensor names: embedding[,head]"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write a derived checkpoint here"),
    overlay_only: bool = typer.Option(False, "--overlay-only", help="With --output: only the overlay bundle"),
    fmt: str = typer.Option("embedq", "--format", help="embedq or compressed-tensors (with --output)"),
    force: bool = typer.Option(False, "--force", help="Replace an existing overlay / destination"),
    trust_config: bool = typer.Option(False, "--trust-config"),
    trust_tensors: bool = typer.Option(False, "--trust-tensors"),
    scale_dtype: Optional[str] = typer.Option(None, "--scale-dtype", help="bfloat16, float16 or float32 (default: the source dtype)"),
    chunk_rows: Optional[int] = typer.Option(None, "--chunk-rows", hidden=True),
    base_model: Optional[str] = typer.Option(None, "--base-model", help="Hub id of the source, for the model card (with --output)"),
    base_revision: Optional[str] = typer.Option(None, "--base-revision", help="Hub revision of the source, for the model card"),
    eval_file: Optional[Path] = typer.Option(None, "--eval", help="`embedq eval --json` results to put in the model card"),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars"),
) -> None:
    """Quantize the embedding (and head) of MODEL into an overlay."""
    from embedq.jobs.quantize import quantize_checkpoint
    if trust_config and trust_tensors:
        fail(EmbedqError("--trust-config and --trust-tensors exclude each other"))
    trust = "config" if trust_config else "tensors" if trust_tensors else None
    if auto or max_kld is not None:
        _quantize_auto(model, max_kld, method, group_size, asym, head_bits, head_group_size, fmt,
                       lm_head=lm_head, targets=targets.split(",") if targets else None, trust=trust,
                       output=output, overlay_only=overlay_only, force=force, scale_dtype=scale_dtype,
                       chunk_rows=chunk_rows, progress=not (quiet or as_json), as_json=as_json)
        return
    method = method or "rtn"
    kwargs = dict(group_size=group_size, symmetric=not asym, method=method, lm_head=lm_head,
                  head_bits=head_bits, head_group_size=head_group_size,
                  targets=targets.split(",") if targets else None, output=output,
                  overlay_only=overlay_only, force=force, trust=trust, scale_dtype=scale_dtype,
                  chunk_rows=chunk_rows, progress=not (quiet or as_json))
    if base_model or base_revision or eval_file:
        kwargs.update(base_model=base_model, base_revision=base_revision, eval_results=eval_file)
    if fmt == "compressed-tensors":
        from embedq.jobs.compressed_tensors import quantize_compressed_tensors
        report = run(quantize_compressed_tensors, model, bits, **kwargs)
    elif fmt == "embedq":
        report = run(quantize_checkpoint, model, bits, **kwargs)
    else:
        fail(EmbedqError(f"--format {fmt!r}: expected embedq or compressed-tensors"))
    typer.echo(report.to_json() if as_json else report.table())


def _quantize_auto(model, max_kld, method, group_size, asym, head_bits, head_group_size, fmt, *,
                   as_json: bool, **kwargs) -> None:
    """``--max-kld`` / ``--auto``: measured scheme selection (embedq/quantize/select.py)."""
    from embedq.quality.select import quantize_auto
    if group_size is not None or asym or head_bits is not None or head_group_size is not None:
        fail(EmbedqError("--max-kld/--auto choose bits, group size and symmetry; "
                          "drop --group-size/--asym/--head-bits/--head-group-size"))
    if fmt != "embedq":
        fail(EmbedqError("--max-kld/--auto write the embedq format only"))
    log = (lambda line: typer.echo(line, err=True)) if kwargs.get("progress") else None
    report, sel = run(quantize_auto, model, max_kld, method=method, log=log, **kwargs)
    typer.echo(report.to_json() if as_json else sel.table() + "\n" + report.table())


@app.command()
def inspect(model: str = typer.Argument(..., help="Checkpoint folder, or a Hub id (org/name: "
                                        "config.json and safetensors headers only, no weights)"),
            revision: Optional[str] = typer.Option(None, "--revision", help="Hub branch, tag or commit"),
            as_json: bool = typer.Option(False, "--json")) -> None:
    """Show targets, tie status and bytes now / after int8 / after Q4."""
    from embedq.jobs.inspect import format_inspect, inspect_checkpoint
    d = run(inspect_checkpoint, model, revision=revision)
    typer.echo(json.dumps(d, indent=2) if as_json else format_inspect(d))


@app.command()
def remove(model: Path, as_json: bool = typer.Option(False, "--json")) -> None:
    """Remove an in-place overlay; restores config.json and the index byte for byte."""
    from embedq.jobs.state import remove_overlay
    restored = run(remove_overlay, model)
    typer.echo(json.dumps({"restored": restored}) if as_json else f"removed embedq overlay from {model}")


@app.command()
def verify(model: Path, as_json: bool = typer.Option(False, "--json")) -> None:
    """Re-read the overlay, check checksums against the source, print error metrics."""
    from embedq.jobs.verify import verify_overlay
    report = run(verify_overlay, model)
    typer.echo(report.to_json() if as_json else "overlay OK\n" + report.table())


@app.command()
def demo(
    workdir: Optional[Path] = typer.Option(None, "--dir", help="Where to build the demo model"),
    bits: int = typer.Option(8, "--bits"),
) -> None:
    """Build a small real transformers checkpoint locally, quantize it, print the table."""
    from embedq.cli.demo import run_demo
    typer.echo(run(run_demo, workdir, bits).table())


# Verbs of the back ends and the publishing / quality layers, each registering its commands
# (their heavy imports stay inside the command bodies).
onnx_verbs.register(app)
quality_verbs.register(app)
publish_verbs.register(app)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
