"""One unit per scheme family: everything a bit width means, written once.

As gguf-py keeps one class per quant type, each family here (:class:`Int8`, :class:`Int4`)
holds its RTN rule (how symmetric scales are chosen), its packing and decoding, its byte
sizes and its defaults (which serving layouts read it is the dispatch table's rows).
:class:`embedq.format.scheme.Scheme` (what one table looks like) reaches its family as
``scheme.unit``; the codec, the quantizers and the fused kernels call the unit instead of
branching on bits. The C twins (``quant/native.py``, ``kernels/native_head.py``) are
tested against it.

A new family is a subclass here, registered in :data:`UNITS` (and its bits in
``constants.SUPPORTED_BITS``); see docs/architecture.md, "Add a scheme".

torch is imported inside the methods that need it: a ``Scheme`` (and its sizes) is used
without torch (``inspect``, ``plan``).
"""

from __future__ import annotations

from typing import ClassVar

from embedq.format.constants import SUPPORTED_BITS


class IntUnit:
    """A family of integer schemes: signed codes ``q`` in ``[qmin, qmax]`` stored as
    ``u = q + 2^(bits-1)``, dense little-endian in int32 words, ``x = (q - zp) * scale``."""

    bits: ClassVar[int]
    name: ClassVar[str]            # "int8": labels, tags
    prose: ClassVar[str]           # the model card's words for it
    tag: ClassVar[str]             # the model card's Hub tag
    # RTN's symmetric rule: False: absmax / qmax; True: the group's signed extreme / qmin
    # (llama.cpp's Q4_0: all 2^bits codes used; measured better at 4 bits, docs/methods.md).
    signed_max: ClassVar[bool]
    # Defaults (docs/methods.md, "The defaults"): group size, symmetry, and whether the
    # default group falls back to one scale per row where it does not divide the width.
    default_group: ClassVar[int]
    default_symmetric: ClassVar[bool] = True
    fit_to_row: ClassVar[bool]
    # Measured lossy enough on Gemma 3 270M to warn about (embedq.jobs.advice).
    lossy: ClassVar[bool]
    # The fused RTN kernel reads a bf16 chunk as int32 pairs (measured faster here).
    fused_pairs: ClassVar[bool]
    pair_dtype: ClassVar[str]      # torch dtype of two packed codes (fused pairs)

    # ---------------------------------------------------------------- numbers and sizes
    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def offset(self) -> int:
        """``u - q``: codes are stored offset binary."""
        return 1 << (self.bits - 1)

    @property
    def levels(self) -> int:
        """Steps of the asymmetric range (``2^bits - 1``)."""
        return (1 << self.bits) - 1

    @property
    def mask(self) -> int:
        return (1 << self.bits) - 1

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    def fits(self, cols: int) -> bool:
        """Whether ``cols`` codes fill whole int32 words."""
        return (cols * self.bits) % 32 == 0

    def packed_words(self, cols: int) -> int:
        """int32 words of one ``weight_packed`` row."""
        return cols * self.bits // 32

    def packed_bytes(self, cols: int) -> int:
        return cols * self.bits // 8

    def zero_point_rows(self, rows: int) -> int:
        """int32 rows of ``weight_zero_point`` (packed along dim 0, compressed-tensors)."""
        return -(-rows * self.bits // 32)

    # ---------------------------------------------------------------- the RTN rule
    def symmetric_scale(self, parts):
        """Float32 scales (before rounding to the storage dtype) of grouped values: ``parts``
        is a list of float32 tensors [..., groups, n] whose last dims together form each
        group (the fused kernel's even/odd streams; the reference passes one)."""
        raise NotImplementedError

    @staticmethod
    def group_range(parts):
        """Per group (min, max) over ``parts``."""
        import torch
        lo, hi = parts[0].amin(dim=-1), parts[0].amax(dim=-1)
        for p in parts[1:]:
            lo = torch.minimum(lo, p.amin(dim=-1))
            hi = torch.maximum(hi, p.amax(dim=-1))
        return lo, hi

    def asymmetric_scale(self, lo, hi):
        """Min-max scales of ranges clamped to contain 0 (so the zero point is representable,
        as compressed-tensors): ``(scale, lo)``."""
        import torch
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        span = hi - lo
        return torch.where(span > 0, span / self.levels, torch.ones_like(span)), lo

    # ---------------------------------------------------------------- packing and decoding
    def pack_bytes(self, u):
        """Unsigned codes [rows, cols] to packed bytes [rows, cols*bits/8] (input dtype kept)."""
        raise NotImplementedError

    def pack_pairs(self, even, odd):
        """Unsigned codes of elements 2j and 2j+1 (int32) to their packed little-endian bytes,
        as ``pair_dtype`` (the fused kernel's bf16-pairs form)."""
        import torch
        return (even + odd * (1 << self.bits)).to(getattr(torch, self.pair_dtype))

    def unpack_bytes(self, b, cols: int):
        """Packed bytes [rows, cols*bits/8] (uint8) to unsigned codes [rows, cols] (uint8)."""
        raise NotImplementedError

    def signed_from_bytes(self, b):
        """Packed bytes [..., n] (uint8) to signed codes [..., n*per_byte] (int8)."""
        raise NotImplementedError

    # The native blocked layout (kernels/native_head.py) keeps each column pair of a row
    # as the bytes its C kernels read, ``native_pair_bytes`` of them, in ``native_dtype``.
    native_pair_bytes: ClassVar[int]
    native_dtype: ClassVar[str]

    def to_native(self, b):
        """Packed bytes [..., n] (uint8) to the native layout's bytes (``native_dtype``)."""
        raise NotImplementedError

    def from_native(self, b):
        """The native layout's bytes [..., n] to signed codes [..., n*per_byte] (int8)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Int8(IntUnit):
    """8 bits: one byte per code; symmetric scale ``absmax / 127``."""

    bits = 8
    name = "int8"
    prose = "int8"
    tag = "int8"
    signed_max = False
    default_group = 64
    fit_to_row = True
    lossy = False
    fused_pairs = False
    pair_dtype = "int16"

    def symmetric_scale(self, parts):
        import torch
        amax = parts[0].abs().amax(dim=-1)
        for p in parts[1:]:
            amax = torch.maximum(amax, p.abs().amax(dim=-1))
        return torch.where(amax > 0, amax / self.qmax, torch.ones_like(amax))

    def pack_bytes(self, u):
        return u.contiguous()

    def unpack_bytes(self, b, cols: int):
        return b[:, :cols]

    def signed_from_bytes(self, b):
        import torch
        return (b ^ self.offset).view(torch.int8)  # u - 128, wrapped into int8

    # native: signed codes (the top bit of u flipped), read by the C kernels as int8 pairs
    native_pair_bytes = 2
    native_dtype = "int8"

    def to_native(self, b):
        return self.signed_from_bytes(b)

    def from_native(self, b):
        return b


class Int4(IntUnit):
    """4 bits: two codes per byte, element 2j in the low nibble; symmetric scale
    signed-max (``m / -8``, ``m`` the group's element of largest magnitude, sign kept)."""

    bits = 4
    name = "int4"
    prose = "4-bit int"
    tag = "4-bit"
    signed_max = True
    default_group = 32
    fit_to_row = False
    lossy = True
    fused_pairs = True
    pair_dtype = "uint8"

    def symmetric_scale(self, parts):
        import torch
        lo, hi = self.group_range(parts)
        m = torch.where(-lo > hi, lo, hi)  # ties keep the positive one (as MLAS)
        return torch.where((m > 0) | (m < 0), m / self.qmin, torch.ones_like(m))

    def pack_bytes(self, u):
        return (u[:, 0::2] | (u[:, 1::2] << self.bits)).contiguous()

    def unpack_bytes(self, b, cols: int):
        import torch
        out = torch.empty(b.shape[0], b.shape[1] * 2, dtype=torch.uint8, device=b.device)
        out[:, 0::2] = b & self.mask
        out[:, 1::2] = b >> self.bits
        return out[:, :cols]

    def signed_from_bytes(self, b):
        import torch
        u = torch.stack((b & self.mask, b >> self.bits), dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)
        return u.view(torch.int8) - self.offset

    # native: the stored byte (two offset nibbles; the C kernels subtract the offset). The
    # dword layout (kernels/layouts.NativeQ4D) keeps four of them together: the stored int32
    # word, column c of its 8 at bits 4c, so the same to_native / from_native serve it.
    native_pair_bytes = 1
    native_dtype = "uint8"

    def to_native(self, b):
        return b

    def from_native(self, b):
        return self.signed_from_bytes(b)


INT8, INT4 = Int8(), Int4()
UNITS: dict[int, IntUnit] = {u.bits: u for u in (INT8, INT4)}
if tuple(sorted(UNITS)) != tuple(sorted(SUPPORTED_BITS)):  # pragma: no cover - a new family half added
    raise ImportError(f"scheme units {sorted(UNITS)} != SUPPORTED_BITS {SUPPORTED_BITS}")


def unit_for(bits: int) -> IntUnit:
    """The family of ``bits`` (a ValueError for bits no family has)."""
    try:
        return UNITS[bits]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported bits {bits}") from None


__all__ = ["INT4", "INT8", "Int4", "Int8", "IntUnit", "UNITS", "unit_for"]
