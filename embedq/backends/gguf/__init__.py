"""llama.cpp's GGUF: an overlay's tables written into a GGUF as Q8_0 / Q4_0 (no re-rounding).

``transcode`` (``embedq gguf``) writes the file; ``inspect_gguf`` (``embedq inspect
X.gguf``) reads a GGUF's header only. Needs gguf-py (``pip install 'embedq[gguf]'``) for
ggml's type table and the base table's dequantization.
"""

from embedq.backends.gguf.inspect import inspect_gguf
from embedq.backends.gguf.transcode import GGUFReport, transcode

__all__ = ["GGUFReport", "inspect_gguf", "transcode"]
