"""``embedq onnx patch`` / ``embedq onnx export``: the ONNX Runtime back end's commands."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from embedq.cli.common import run


def register(app: typer.Typer) -> None:
    onnx_app = typer.Typer(
        add_completion=False, no_args_is_help=True,
        help="ONNX Runtime: the overlay as GatherBlockQuantized / MatMulNBits (no re-quantization).")

    @onnx_app.command("patch")
    def patch(
        model: Path = typer.Argument(..., help="Float ONNX model (.onnx; external data is streamed)"),
        overlay: Path = typer.Option(..., "--overlay", help="Folder with the embedq overlay "
                                     "(quantization_config.json + embedq.safetensors)"),
        output: Path = typer.Option(..., "--output", "-o", help="Patched model to write"),
        external_data: Optional[bool] = typer.Option(
            None, "--external-data/--no-external-data",
            help="Weights in OUTPUT.data (default: as the input, or when over 2 GB)"),
        force: bool = typer.Option(False, "--force", help="Replace OUTPUT (or patch MODEL in place)"),
        as_json: bool = typer.Option(False, "--json", help="Print the report as JSON"),
    ) -> None:
        """Rewrite MODEL's embedding Gather and head MatMul to read the overlay's bytes.

        The float table must be the overlay's source (checked by sha256 or, for a
        float16 graph of a bfloat16 model, sampled rows); anything else is refused.
        """
        from embedq.backends.onnx import patch_model
        report = run(patch_model, model, overlay, output, external_data=external_data, force=force)
        typer.echo(report.to_json() if as_json else report.table())

    @onnx_app.command("export")
    def export(
        model: Path = typer.Argument(..., help="HF checkpoint folder with an embedq overlay"),
        output: Path = typer.Option(..., "--output", "-o", help="ONNX model to write"),
        overlay: Optional[Path] = typer.Option(None, "--overlay",
                                               help="Overlay folder (default: MODEL itself)"),
        dtype: str = typer.Option("float32", "--dtype", help="float32 or float16"),
        opset: Optional[int] = typer.Option(None, "--opset", help="ONNX opset (default: exporter's)"),
        optimize: bool = typer.Option(True, "--optimize/--no-optimize",
                                      help="Run onnxscript's graph optimizer (slower export)"),
        external_data: Optional[bool] = typer.Option(
            None, "--external-data/--no-external-data",
            help="Weights in OUTPUT.data (default: only when over 2 GB)"),
        force: bool = typer.Option(False, "--force", help="Replace OUTPUT"),
        as_json: bool = typer.Option(False, "--json", help="Print the report as JSON"),
    ) -> None:
        """Export MODEL (a transformers causal LM) with torch.onnx and patch it in one step.

        The graph takes ``input_ids`` [batch, seq] and returns ``logits`` (no KV cache).
        """
        from embedq.backends.onnx import export_model
        report = run(export_model, model, output, overlay=overlay, dtype=dtype,
                      external_data=external_data, force=force, opset=opset,
                      optimize=optimize)
        typer.echo(report.to_json() if as_json else report.table())

    app.add_typer(onnx_app, name="onnx")
