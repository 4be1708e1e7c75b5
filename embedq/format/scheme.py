"""Quantization scheme: what one quantized table looks like."""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, replace

from embedq.errors import SchemeError
from embedq.format.constants import METHODS, OVERLAY_SUFFIXES, ST_FLOAT_NAMES, SUPPORTED_BITS
from embedq.format.scheme_units import UNITS, IntUnit

# The defaults of ``embedq quantize`` / ``embedq.quantize`` (and of the overlay ``inspect`` and
# ``plan`` estimate), the one place to change them: bits when none is given, and per bits
# ``(group_size (None: one scale per row), symmetric)`` when those are not given.
DEFAULT_BITS = 8
# Chosen by measurement (docs/methods.md, "The defaults"), kept by each family
# (format/scheme_units.py): 8-bit g64 (per row where 64 does not divide the width, see
# Scheme.fit), 4-bit g32 (signed-max scales). Scales keep the source dtype by default.
DEFAULT_SCHEMES: dict[int, tuple[int | None, bool]] = {
    b: (u.default_group, u.default_symmetric) for b, u in sorted(UNITS.items(), reverse=True)}
DEFAULT_METHOD = "rtn"
DEFAULT_GROUP = {b: g for b, (g, _) in DEFAULT_SCHEMES.items()}


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


class RowsCols:
    """``rows`` and ``cols`` of a class holding a 2-D ``shape`` (tables, config entries)."""

    shape: tuple[int, int]

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]


# ONNX Runtime's block quantization (GatherBlockQuantized / MatMulNBits): blocks are a
# power of two of at least this many elements.
ONNX_MIN_BLOCK = 16


def onnx_block(group: int) -> int:
    """The largest power of two dividing ``group`` (the ONNX block a group splits into)."""
    return group & -group


@dataclass(frozen=True)
class Scheme:
    """One table's quantization: ``bits``, symmetry and grouping.

    ``group_size=None`` means one scale per row (compressed-tensors strategy
    ``channel``); otherwise ``cols`` must be divisible by it (strategy ``group``).
    """

    bits: int = 8
    symmetric: bool = True
    group_size: int | None = None
    method: str = "rtn"
    scale_dtype: str | None = None  # None: the source dtype

    def __post_init__(self) -> None:
        # Types first: a Scheme is also built from Python (embedq.quantize), where a float,
        # a string or a truthy "no" would otherwise fail deep inside torch, or silently.
        if not _is_int(self.bits):
            raise SchemeError(f"bits {self.bits!r}: must be an integer "
                              f"({' or '.join(map(str, SUPPORTED_BITS))})")
        if not isinstance(self.symmetric, bool):
            raise SchemeError(f"symmetric {self.symmetric!r}: must be True or False")
        if self.group_size is not None and not _is_int(self.group_size):
            raise SchemeError(f"group_size {self.group_size!r}: must be an integer (0 or None: per row)")
        if not isinstance(self.method, str):
            raise SchemeError(f"method {self.method!r}: must be a string ({', '.join(METHODS)})")
        if self.scale_dtype is not None and not isinstance(self.scale_dtype, str):
            raise SchemeError(f"scale_dtype {self.scale_dtype!r}: must be a dtype name "
                              f"({', '.join(sorted(ST_FLOAT_NAMES.values()))}) or None")
        if self.bits not in SUPPORTED_BITS:
            raise SchemeError(f"--bits {self.bits} is not supported (choose {' or '.join(map(str, SUPPORTED_BITS))})")
        if self.group_size is not None and (self.group_size < 8 or self.group_size % 8):
            raise SchemeError(f"--group-size {self.group_size} must be a positive multiple of 8")
        if self.method not in METHODS:
            raise SchemeError(f"--method {self.method!r} is not supported ({', '.join(METHODS)})")
        # Checked against the names, not torch's dtypes: a Scheme is built without torch
        # (inspect, plan).
        if self.scale_dtype is not None and self.scale_dtype not in ST_FLOAT_NAMES.values():
            raise SchemeError(f"unsupported dtype {self.scale_dtype!r} "
                              f"(expected one of {sorted(ST_FLOAT_NAMES.values())})")

    @classmethod
    def default(cls, bits: int | None = None, symmetric: bool | None = None,
                group_size: int | None = None, method: str | None = None,
                scale_dtype: str | None = None) -> "Scheme":
        """A scheme with what is not given taken from :data:`DEFAULT_SCHEMES` (``group_size=0``:
        explicitly one scale per row)."""
        bits = DEFAULT_BITS if bits is None else bits
        default_group, default_symmetric = DEFAULT_SCHEMES.get(bits, (None, True))
        if group_size is None:
            group_size = default_group
        if group_size == 0:  # explicit per-row request
            group_size = None
        symmetric = default_symmetric if symmetric is None else symmetric
        method = DEFAULT_METHOD if method is None else method
        return cls(bits=bits, symmetric=symmetric, group_size=group_size, method=method,
                   scale_dtype=scale_dtype)

    def fit(self, cols: int) -> "Scheme":
        """This *default* scheme for a table of ``cols`` columns: the default group of a
        family that allows it (8 bits) falls back to one scale per row where it does not
        divide them (an explicit ``--group-size`` is never changed: callers fit defaults only)."""
        u = self.unit
        if u.fit_to_row and self.group_size == u.default_group and cols % self.group_size:
            return replace(self, group_size=None)
        return self

    @property
    def unit(self) -> IntUnit:
        """The scheme family (:mod:`embedq.format.scheme_units`): rules, packing, sizes."""
        return UNITS[self.bits]

    @property
    def strategy(self) -> str:
        return "channel" if self.group_size is None else "group"

    @property
    def qmin(self) -> int:
        return self.unit.qmin

    @property
    def qmax(self) -> int:
        return self.unit.qmax

    def groups(self, cols: int) -> int:
        return 1 if self.group_size is None else cols // self.group_size

    def effective_group(self, cols: int) -> int:
        return cols if self.group_size is None else self.group_size

    def check_shape(self, shape: tuple[int, ...], name: str) -> None:
        """Refuse shapes this scheme cannot represent, naming the tensor."""
        if len(shape) != 2:
            raise SchemeError(f"{name}: expected a 2-D table, got shape {list(shape)}")
        rows, cols = shape
        if rows == 0 or cols == 0:
            raise SchemeError(f"{name}: empty table {list(shape)}")
        if self.group_size is not None and cols % self.group_size:
            raise SchemeError(
                f"{name}: {cols} columns are not divisible by group size {self.group_size}")
        if not self.unit.fits(cols):
            raise SchemeError(
                f"{name}: {cols} columns x {self.bits} bits is not a whole number of int32 words")

    def overlay_bytes(self, shape: tuple[int, int], scale_bytes: int) -> int:
        """Bytes of this table's overlay tensors (packed codes, scales, shape, zero points)."""
        rows, cols = shape
        groups, u = self.groups(cols), self.unit
        n = rows * u.packed_bytes(cols) + rows * groups * scale_bytes + 16
        if not self.symmetric:
            n += u.zero_point_rows(rows) * groups * 4
        return n

    def tensor_shapes(self, shape: tuple[int, int], scale_st: str
                      ) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The one tensor list of a quantized table: suffix (``weight_packed`` ...) ->
        (safetensors dtype name, shape); ``scale_st`` is the scales' (``"BF16"`` ...)."""
        rows, cols = shape
        groups, u = self.groups(cols), self.unit
        packed, scale, shape_, zero_point = OVERLAY_SUFFIXES
        t = {packed: ("I32", (rows, u.packed_words(cols))),
             scale: (scale_st, (rows, groups)),
             shape_: ("I64", (2,))}
        if not self.symmetric:
            t[zero_point] = ("I32", (u.zero_point_rows(rows), groups))
        return t

    def overlay_tensors(self, module: str, shape: tuple[int, int], scale_st: str
                        ) -> dict[str, tuple[str, tuple[int, ...]]]:
        """:meth:`tensor_shapes` named as in the overlay file: ``"<module>.<suffix>"``."""
        return {f"{module}.{k}": v for k, v in self.tensor_shapes(shape, scale_st).items()}

    def onnx_block_size(self, cols: int) -> int | None:
        """Block size ONNX Runtime uses for a table of ``cols`` columns, or None if it has
        none: the largest power of two dividing the group (per row: the whole row); each
        group becomes ``group/block`` blocks repeating its scale and zero point. ONNX
        Runtime needs a block of at least 16."""
        b = onnx_block(self.effective_group(cols))
        return b if b >= ONNX_MIN_BLOCK else None

    def label(self) -> str:
        g = "row" if self.group_size is None else f"g{self.group_size}"
        s = "sym" if self.symmetric else "asym"
        m = "" if self.method == "rtn" else f" {self.method}"
        return f"{self.unit.name} {g} {s}{m}"

    def to_dict(self) -> dict:
        return asdict(self)
