"""ONNX Runtime back end: the overlay's bytes as ``GatherBlockQuantized`` and ``MatMulNBits``.

``weight_packed`` (int32, compressed-tensors ``pack-quantized``) viewed as little-endian
bytes *is* the uint8 table ONNX Runtime's ``com.microsoft`` block-quantized operators read
(overlay contract §1), so no value is re-quantized here. :func:`patch_model`:

1. finds, by graph structure (not by name), the ``Gather`` that reads the float token
   embedding and the ``MatMul``/``Gemm`` that computes the logits from the head table,
   through Identity and ``Transpose(perm=[1,0])`` nodes, either orientation, tied or
   not (:mod:`.graph`) — the layouts of torch.onnx, optimum and onnxruntime-genai's builder;
2. checks that each float initializer is the overlay's source table (recorded digest of the rows
   as the source dtype, or, where the graph dtype cannot hold the source exactly, sampled
   rows within quantization error) and refuses otherwise (:mod:`.source`);
3. builds ``GatherBlockQuantized`` and ``MatMulNBits`` (``accuracy_level`` per device, CPU
   4) reading one shared uint8 initializer (tied: ``MatMulNBits`` through a ``Reshape``),
   or, under ``max_tensor_bytes`` (WebGPU's buffer limit), row parts of it (:mod:`.split`);
   per-row scales become a block scale repeated over the largest power-of-two block
   dividing the row; zero points are always written, in ONNX Runtime's layout (:mod:`.common`);
4. splices them in and drops the float tables and Identity/Transpose nodes left unread;
5. records what it did in ``metadata_props``; writes atomically, streaming external data
   (whose locations must stay inside the model's folder) (:mod:`.write`).

An onnxruntime-genai folder (``genai_config.json``) is patched into a complete folder
(:mod:`.genai`); :mod:`.report` says what was done.
``export_model`` exports a transformers causal LM without KV cache (a quick check; see
docs/onnx.md for the builder / optimum path) and patches it.
"""

from embedq.backends.onnx.common import (MIN_ORT, MIN_ORT_ODD_BLOCKS_4BIT, OnnxError, TensorRef,
                                         onnx_block_size, ort_scales, ort_weight_bytes,
                                         ort_zero_points, require_onnx)
from embedq.backends.onnx.export import (estimate_patched, export_float, export_model,
                                         load_float_model, read_metadata)
from embedq.backends.onnx.patch import default_accuracy_level, patch_model
from embedq.backends.onnx.report import OnnxModuleReport, OnnxReport
from embedq.backends.onnx.source import SourceCheck, check_source
from embedq.backends.onnx.split import WEBGPU_MAX_BUFFER, parse_size

__all__ = ["patch_model", "export_model", "export_float", "load_float_model", "OnnxReport",
           "OnnxModuleReport", "OnnxError", "onnx_block_size", "ort_scales", "ort_zero_points",
           "ort_weight_bytes", "check_source", "read_metadata", "default_accuracy_level",
           "require_onnx", "SourceCheck", "MIN_ORT", "MIN_ORT_ODD_BLOCKS_4BIT", "TensorRef",
           "estimate_patched", "parse_size", "WEBGPU_MAX_BUFFER"]
