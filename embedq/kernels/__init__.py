"""Serving kernels over one quantized table: logits ``x @ dequant(W)^T`` and row gathers.

One home for every kernel, one dispatch table (:mod:`embedq.kernels.dispatch`: scheme x
device x batch range -> kernel), every entry tested against the one reference decoder
(:mod:`embedq.format.codec`). Imports only :mod:`embedq.format`.
"""

from embedq.kernels.prepared import PreparedTable

__all__ = ["PreparedTable"]
