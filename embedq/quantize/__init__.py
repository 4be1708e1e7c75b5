"""The math: schemes, quantizers, packing and streaming over rows."""

from embedq.quantize.packing import pack_int32, pack_zero_points, unpack_int32, unpack_zero_points
from embedq.quantize.rtn import dequantize_codes, quantize_rtn
from embedq.quantize.scheme import Scheme
from embedq.quantize.tensor import QuantizedTable

__all__ = [
    "Scheme", "QuantizedTable", "quantize_rtn", "dequantize_codes",
    "pack_int32", "unpack_int32", "pack_zero_points", "unpack_zero_points",
]


# ``embedq.quantize`` is both this subpackage and the top-level API call
# ``embedq.quantize(path, bits=8, ...)``. Python binds a package's submodule as an
# attribute of its parent on import, which would shadow a plain function of that
# name, so the module itself is made callable.
import sys as _sys
import types as _types


class _CallableModule(_types.ModuleType):
    def __call__(self, path, bits: int = 8, **kwargs):
        """Quantize a checkpoint; see :func:`embedq.overlays.write.quantize_checkpoint`."""
        from embedq.overlays.write import quantize_checkpoint
        return quantize_checkpoint(path, bits, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
