"""``embedq onnx patch`` / ``embedq onnx export``: the ONNX Runtime back end's commands."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from embedq.cli.common import run

_ACCURACY_HELP = ("MatMulNBits accuracy_level 0-4 (default: per device as onnxruntime-genai's "
                  "builder: cpu/webgpu 4 = int8 activations, 3-30x faster heads; 0 = float)")


_SIZE_HELP = ("Split each quantized table by rows so that no initializer exceeds SIZE "
              "(262144, 256KiB, 256MiB); default: no split")
_TARGET_HELP = "webgpu: split at 256 MiB (WebGPU's default maxBufferSize); --max-tensor-bytes overrides"


def _backend():
    """The back end, or one ``embedq: error:`` line when the onnx extra is missing."""
    from embedq.errors import EmbedqError

    def load():
        try:
            from embedq.backends import onnx as backend
            backend.require_onnx()
        except ImportError as e:  # a dependency of the back end itself (numpy/torch: broken install)
            raise EmbedqError(f"{e.name or e}: not installed: pip install 'embedq[onnx]'") from None
        return backend
    return run(load)


def register(app: typer.Typer) -> None:
    onnx_app = typer.Typer(
        add_completion=False, no_args_is_help=True,
        help="ONNX Runtime: the overlay as GatherBlockQuantized / MatMulNBits (no re-quantization).")

    @onnx_app.command("patch")
    def patch(
        model: Path = typer.Argument(..., help="Float ONNX model (.onnx; external data is streamed), "
                                     "or an onnxruntime-genai folder (genai_config.json beside it)"),
        overlay: Path = typer.Option(..., "--overlay", help="Folder with the embedq overlay "
                                     "(quantization_config.json + embedq.safetensors)"),
        output: Path = typer.Option(..., "--output", "-o",
                                    help="Patched model to write (a folder for a genai folder)"),
        external_data: Optional[bool] = typer.Option(
            None, "--external-data/--no-external-data",
            help="Weights in OUTPUT.data (default: as the input, or from ~1.8 GB, 0.9 of protobuf's 2 GB limit)"),
        accuracy_level: Optional[int] = typer.Option(None, "--accuracy-level", help=_ACCURACY_HELP),
        execution_provider: Optional[str] = typer.Option(
            None, "--execution-provider", help="cpu, cuda, webgpu, ... (picks the default "
            "accuracy level; default: a genai folder's configured provider, else cpu)"),
        max_tensor_bytes: Optional[str] = typer.Option(None, "--max-tensor-bytes", metavar="SIZE",
                                                       help=_SIZE_HELP),
        target: Optional[str] = typer.Option(None, "--target", help=_TARGET_HELP),
        force: bool = typer.Option(False, "--force", help="Replace OUTPUT (or patch MODEL in place)"),
        as_json: bool = typer.Option(False, "--json", help="Print the report as JSON"),
    ) -> None:
        """Rewrite MODEL's embedding Gather and head MatMul to read the overlay's bytes.

        The float table must be the overlay's source (checked by its recorded digest or, for a
        float16 graph of a bfloat16 model, sampled rows); anything else is refused.
        """
        backend = _backend()
        report = run(backend.patch_model, model, overlay, output, external_data=external_data,
                      force=force, accuracy_level=accuracy_level,
                      execution_provider=execution_provider, max_tensor_bytes=max_tensor_bytes,
                      target=target)
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
            help="Weights in OUTPUT.data (default: only from ~1.8 GB, 0.9 of protobuf's 2 GB limit)"),
        accuracy_level: Optional[int] = typer.Option(None, "--accuracy-level", help=_ACCURACY_HELP),
        max_tensor_bytes: Optional[str] = typer.Option(None, "--max-tensor-bytes", metavar="SIZE",
                                                       help=_SIZE_HELP),
        target: Optional[str] = typer.Option(None, "--target", help=_TARGET_HELP),
        force: bool = typer.Option(False, "--force", help="Replace OUTPUT"),
        as_json: bool = typer.Option(False, "--json", help="Print the report as JSON"),
    ) -> None:
        """Quick check: export MODEL with torch.onnx (no KV cache) and patch it in one step.

        The graph takes ``input_ids`` (batch x seq) and returns ``logits``. For serving,
        build the graph with onnxruntime-genai's model builder or optimum
        (text-generation-with-past) and run ``embedq onnx patch`` on it (docs/onnx.md).
        """
        backend = _backend()
        report = run(backend.export_model, model, output, overlay=overlay, dtype=dtype,
                      external_data=external_data, force=force, opset=opset,
                      optimize=optimize, accuracy_level=accuracy_level,
                      max_tensor_bytes=max_tensor_bytes, target=target)
        typer.echo(report.to_json() if as_json else report.table())

    app.add_typer(onnx_app, name="onnx")
