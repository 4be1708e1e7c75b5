"""The ``embedq`` command line: a thin typer layer over the Python API."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from embedq.cli import gguf as gguf_verbs
from embedq.cli import onnx as onnx_verbs
from embedq.cli import publish as publish_verbs
from embedq.cli import quality as quality_verbs
from embedq.cli.common import announce_leftovers, describe, fail, quiet_libraries, run
from embedq.errors import EmbedqError
from embedq.format import staging
from embedq.format.scheme import DEFAULT_BITS, DEFAULT_SCHEMES

# the defaults as help text, from the one table (embedq/format/scheme.py)
_DEFAULT_GROUPS = ", ".join(f"{'per row' if g is None else g} for {b}-bit" for b, (g, _) in DEFAULT_SCHEMES.items())
_DEFAULT_SYMMETRY = ", ".join(f"{'sym' if s else 'asym'} for {b}-bit" for b, (_, s) in DEFAULT_SCHEMES.items())

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Quantize embedding and lm_head tables into loadable overlays.")
staging.on_leftovers = announce_leftovers  # what a killed run left: one line on stderr


@app.command()
def quantize(
    model: Path = typer.Argument(..., help="HF checkpoint folder"),
    bits: Optional[int] = typer.Option(None, "--bits", help=f"4 or 8 (default {DEFAULT_BITS}); with --max-kld/--auto: search only schemes of these bits"),
    group_size: Optional[int] = typer.Option(None, "--group-size", help=f"Group size (default: {_DEFAULT_GROUPS}; 8-bit: per row where 64 does not divide the width; 0 = per row)"),
    asym: Optional[bool] = typer.Option(None, "--asym/--sym", help=f"Asymmetric (zero points) or symmetric (default: {_DEFAULT_SYMMETRY})"),
    method: Optional[str] = typer.Option(None, "--method", help="rtn (default), mse, or gptq (head-aware, calibrated); see docs/methods.md"),
    max_kld: Optional[float] = typer.Option(None, "--max-kld", help="Choose the scheme: the smallest overlay whose KLD on a built-in sample is <= this"),
    auto: bool = typer.Option(False, "--auto", help="--max-kld 0.01"),
    lm_head: bool = typer.Option(False, "--lm-head", help="Also quantize an untied lm_head"),
    per_layer_embeddings: bool = typer.Option(False, "--per-layer-embeddings", help="Also quantize per-layer input embeddings (Gemma 3n's embed_tokens_per_layer) with the table's scheme"),
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
    profile: bool = typer.Option(False, "--profile", help="Print CPU seconds per stage and thread to stderr (as EMBEDQ_PROFILE=1)"),
) -> None:
    """Quantize the embedding (and head) of MODEL into an overlay."""
    from embedq.jobs.recipe import QuantizeRecipe
    from embedq.quant.profile import PROFILE, stage
    if profile:
        PROFILE.enable()
    if trust_config and trust_tensors:
        fail(EmbedqError("--trust-config and --trust-tensors exclude each other"))
    recipe = run(QuantizeRecipe.from_options, bits, group_size=group_size,
                 symmetric=None if asym is None else not asym, method=method,
                 scale_dtype=scale_dtype, head_bits=head_bits, head_group_size=head_group_size,
                 max_kld=max_kld, auto=auto, lm_head=lm_head, per_layer_embeddings=per_layer_embeddings,
                 targets=[t.strip() for t in targets.split(",")] if targets is not None else None,
                 trust="config" if trust_config else "tensors" if trust_tensors else None,
                 output=output, overlay_only=overlay_only, force=force, format=fmt,
                 chunk_rows=chunk_rows, progress=not (quiet or as_json), base_model=base_model,
                 base_revision=base_revision, eval_results=eval_file)
    if recipe.search is not None:  # --max-kld / --auto: measured selection (embedq/quality/select.py)
        from embedq.quality.select import quantize_auto
        log = (lambda line: typer.echo(line, err=True)) if recipe.progress else None
        report, sel = run(quantize_auto, model, recipe, log=log)
        typer.echo(report.to_json() if as_json else sel.table() + "\n" + report.table())
        return
    with stage("imports: embedq.jobs.quantize (torch, ...)"):
        from embedq.jobs.quantize import quantize_checkpoint
    report = run(quantize_checkpoint, model, recipe)
    typer.echo(report.to_json() if as_json else report.table())


@app.command()
def inspect(model: str = typer.Argument(..., help="Checkpoint folder, or a Hub id (org/name: "
                                        "config.json and safetensors headers only, no weights)"),
            revision: Optional[str] = typer.Option(None, "--revision", help="Hub branch, tag or commit"),
            as_json: bool = typer.Option(False, "--json")) -> None:
    """Show targets, tie status and bytes now / after int8 / after Q4 (of a GGUF file too)."""
    if gguf_verbs.is_gguf_path(model):  # llama.cpp's file: embedq/cli/gguf.py
        return gguf_verbs.inspect(model, as_json)
    from embedq.jobs.inspect import format_inspect, inspect_checkpoint
    r = run(inspect_checkpoint, model, revision=revision)
    typer.echo(json.dumps(r.to_dict(), indent=2) if as_json else format_inspect(r))


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
    bits: Optional[int] = typer.Option(None, "--bits", help=f"4 or 8 (default {DEFAULT_BITS})"),
) -> None:
    """Build a small real transformers checkpoint locally, quantize it, print the table."""
    from embedq.cli.demo import run_demo
    report = run(run_demo, workdir, bits)
    typer.echo(report.table())
    typer.echo(f"demo checkpoint (kept, with its overlay): {report.path}")  # where it is, not a warning


# Verbs of the back ends and the publishing / quality layers, each registering its commands
# (their heavy imports stay inside the command bodies).
onnx_verbs.register(app)
gguf_verbs.register(app)
quality_verbs.register(app)
publish_verbs.register(app)


def main() -> None:  # pragma: no cover
    quiet_libraries()
    try:
        app()
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        print("embedq: interrupted; the source checkpoint is unchanged", file=sys.stderr)
        code = 130
    except Exception as e:  # raised outside a verb's run(): still one line
        from embedq.cli.common import debug
        if debug():
            raise
        from embedq.cli.common import one_line
        line, code = describe(e, None)
        print(f"embedq: error: {one_line(line)}", file=sys.stderr)
    if "torch" in sys.modules:
        # Skip the interpreter's teardown: with torch loaded it takes ~1 s of wall (module
        # destructors), more than a small job. Every output is closed and fsynced by now;
        # atexit handlers (the profile report) still run.
        import atexit
        import os
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
