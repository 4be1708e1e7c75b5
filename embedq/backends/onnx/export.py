"""``export_model``: torch.onnx export of a transformers causal LM, then patch."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from embedq.errors import EmbedqError
from embedq.format.constants import QUANT_METHOD
from embedq.format.checkpoint import check_folder_reads
from embedq.backends.onnx.common import META_PREFIX, PROTOBUF_LIMIT, OnnxError
from embedq.backends.onnx.patch import OnnxReport, load_onnx_model, patch_model


# -------------------------------------------------------------------------- export

class _LogitsOnly(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def load_float_model(model_dir: str | os.PathLike, overlay: str | os.PathLike | None = None,
                     dtype: torch.dtype = torch.float32):
    """The transformers causal LM of ``model_dir`` in ``dtype``, with float tables.

    An embedq ``quantization_config`` in config.json is ignored (the float source
    shards are still there in place); a table missing from the shards (a derived
    checkpoint) is filled with the overlay's dequantized values.
    """
    import transformers as tf

    from embedq.format.reader import load_overlay
    p = Path(model_dir)
    check_folder_reads(p)
    try:
        cfg = tf.AutoConfig.from_pretrained(p)
    except Exception as e:
        raise OnnxError(f"{p / 'config.json'}: not a transformers config ({e})") from None
    qc = getattr(cfg, "quantization_config", None)
    if qc is not None:
        qd = qc if isinstance(qc, dict) else qc.to_dict()
        if qd.get("quant_method") == QUANT_METHOD and qd.get("base_quantization_config"):
            raise OnnxError(f"{p / 'config.json'}: the model has a base quantization "
                            f"({qd['base_quantization_config'].get('quant_method')}); "
                            "embedq onnx export handles float checkpoints only")
        if qd.get("quant_method") != QUANT_METHOD:
            raise OnnxError(f"{p / 'config.json'}: quantized with {qd.get('quant_method')}; "
                            "embedq onnx export handles float checkpoints only")
        del cfg.quantization_config
    from transformers.utils import logging as tf_logging
    bar = tf_logging.is_progress_bar_enabled()
    tf_logging.disable_progress_bar()  # a verb's stderr is its one error line (or nothing)
    try:
        model, info = tf.AutoModelForCausalLM.from_pretrained(
            p, config=cfg, dtype=dtype, output_loading_info=True)
    except Exception as e:
        raise OnnxError(f"{p}: cannot load as a transformers causal LM ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    finally:
        if bar:
            tf_logging.enable_progress_bar()
    missing = set(info.get("missing_keys") or [])
    if missing:
        ov = load_overlay(overlay or p)
        sd = model.state_dict()
        filled = set()
        for name, entry in ov.config["modules"].items():
            tensor = (entry.get("source") or {}).get("tensor", f"{name}.weight")
            for key in (tensor, f"{name}.weight"):
                if key in missing and key in sd:
                    with torch.no_grad():
                        sd[key].copy_(ov.tables[name].dequantize(torch.float32).to(dtype))
                    filled.add(key)
        for alias, owner in (ov.config.get("aliases") or {}).items():
            key = f"{alias}.weight"
            if key in missing and key in sd:
                with torch.no_grad():
                    sd[key].copy_(ov.tables[owner].dequantize(torch.float32).to(dtype))
                filled.add(key)
        rest = sorted(missing - filled)
        if rest:
            raise OnnxError(f"{p}: weights missing from the checkpoint: {', '.join(rest[:5])}")
    return model.eval()


def export_float(model, path: str | os.PathLike, *, opset: int | None = None,
                 optimize: bool = True) -> float:
    """``torch.onnx.export(dynamo=True)`` of a causal LM returning logits; external data.

    Inputs: ``input_ids`` [batch, seq] (both dynamic); output: ``logits``.
    ``optimize=False`` skips onnxscript's graph optimizer (about half the export time
    of Gemma 3 270M; ONNX Runtime optimizes the graph itself at load).
    Returns the export time in seconds.
    """
    import logging
    import warnings as _w
    t0 = time.perf_counter()
    ids = torch.randint(0, min(100, model.config.get_text_config().vocab_size), (2, 8))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    try:
        with _w.catch_warnings(), torch.no_grad():
            _w.simplefilter("ignore")
            prog = torch.onnx.export(_LogitsOnly(model), (ids,), dynamo=True,
                                     input_names=["input_ids"], output_names=["logits"],
                                     dynamic_shapes=({0: batch, 1: seq},), opset_version=opset,
                                     optimize=optimize, verbose=False)
            prog.save(str(path), external_data=True)
    except Exception as e:
        cause = e
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:  # a full disk, a read-only folder: the caller names its output
            raise cause from None
        raise OnnxError(f"torch.onnx.export failed for {type(model).__name__}: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return time.perf_counter() - t0


def export_model(model_dir: str | os.PathLike, output: str | os.PathLike, *,
                 overlay: str | os.PathLike | None = None, dtype: str = "float32",
                 external_data: bool | None = None, force: bool = False,
                 opset: int | None = None, optimize: bool = True,
                 accuracy_level: int | None = None, max_tensor_bytes: int | str | None = None,
                 target: str | None = None) -> OnnxReport:
    """Export ``model_dir`` (a transformers causal LM) to ONNX and patch it with its overlay.

    The graph has no KV cache (``input_ids -> logits``): a quick check of the overlay in
    ONNX Runtime. Graphs for serving come from onnxruntime-genai's builder or optimum's
    ``text-generation-with-past`` export, which ``patch_model`` patches as they are.
    ``max_tensor_bytes`` / ``target``: split the quantized tables, as :func:`patch_model`.
    """
    from embedq.backends.onnx.common import require_onnx
    require_onnx(export=True)  # onnxscript too: fail before the slow load and export
    from embedq.format.reader import parse_overlay_config
    from embedq.format.dtypes import dtype_from_name
    from embedq.backends.onnx.write import check_not_input, check_output_file, folder_inputs, new_parents
    from embedq.backends.onnx.split import resolve_limit
    resolve_limit(max_tensor_bytes, target)  # fail before the slow part
    t0 = time.perf_counter()
    mdir, out = Path(model_dir), Path(output)
    ov_dir = Path(overlay) if overlay is not None else mdir
    cfg = parse_overlay_config(ov_dir)  # fail before the slow part
    if dtype not in ("float32", "float16"):
        raise OnnxError(f"--dtype {dtype}: expected float32 or float16 (ONNX Runtime CPU has no bf16 kernels)")
    if out.exists() and not force:
        raise OnnxError(f"{out}: already exists (pass --force to replace it)")
    check_output_file(out)
    # what the export reads: the model's and the overlay folder's files but ONNX ones (an
    # earlier export there is an output)
    check_not_input(out, folder_inputs(mdir) + folder_inputs(ov_dir))
    if ov_dir.resolve() != mdir.resolve():  # another folder's overlay: made from this model?
        from embedq.format.checkpoint import Checkpoint
        from embedq.jobs.apply import check_base
        check_base(Checkpoint.open(mdir), cfg)
    from embedq.backends.onnx.write import data_generations
    from embedq.format import staging
    with new_parents(out):  # a failed export leaves no folder it made
        # a killed export's float model (a staging folder) and staged files go first
        staging.clean_leftovers(out.parent, [out.name, *data_generations(out)])
        model = load_float_model(mdir, ov_dir, dtype_from_name(dtype))
        with staging.staging_dir(out.parent, "onnx", output=out) as tmp:
            fpath = tmp / "float.onnx"
            t_exp = export_float(model, fpath, opset=opset, optimize=optimize)
            del model
            staging.kill_point("export-float")
            if external_data is None:  # one file unless it would not fit protobuf's 2 GB
                external_data = estimate_patched(fpath, ov_dir) > PROTOBUF_LIMIT * 0.9
            try:
                report = patch_model(fpath, ov_dir, out, external_data=external_data, force=force,
                                     accuracy_level=accuracy_level, max_tensor_bytes=max_tensor_bytes,
                                     target=target)
            except EmbedqError as e:  # the float graph goes with its folder: name the model
                err = staging.renamed(e, fpath, mdir)
                if err is e:
                    raise
                raise err from None
    report.model = str(mdir)
    report.export_seconds = t_exp
    report.seconds = time.perf_counter() - t0
    return report


def estimate_patched(fpath: Path, ov_dir: Path) -> int:
    """Rough size of the patched model: the float file minus the quantized tables' savings."""
    from embedq.format.reader import read_overlay_config
    size = sum(f.stat().st_size for f in fpath.parent.iterdir())
    cfg = read_overlay_config(ov_dir)
    for e in cfg["modules"].values():
        v, h = e["shape"]
        size -= v * h * 4 * (1 - e["num_bits"] / 32)
    return int(size)


def read_metadata(path: str | os.PathLike) -> dict:
    """The ``embedq.*`` metadata_props of a patched model (JSON values decoded)."""
    mp = load_onnx_model(Path(path))
    out = {}
    for p in mp.metadata_props:
        if p.key.startswith(META_PREFIX):
            k = p.key[len(META_PREFIX):]
            try:
                out[k] = json.loads(p.value) if k in ("modules", "source_sha256", "source_blake3", "scheme") else p.value
            except json.JSONDecodeError:
                out[k] = p.value
    return out

