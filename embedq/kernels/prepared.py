"""Fast paths over one quantized table: logits ``x @ dequant(W)^T`` and row gathers.

A :class:`PreparedTable` is built once at load from the overlay's tensors (packed int32
codes, scales, optional zero points) and then serves both the head (:meth:`linear`) and
the embedding (:meth:`embedding`) of a tied model from ONE buffer: one layout object
(:mod:`embedq.kernels.layouts`, :mod:`embedq.kernels.torch_layouts`) chosen at load by
the one dispatch table (:mod:`embedq.kernels.dispatch`), the kernel per call by
activation dtype and M. The in-memory layout may differ from the on-disk one (it is what
the kernel reads) but stays the quantized size; no float copy of the table is made.

Layouts, best first (the table's rows; ``PreparedTable.kind`` is the layout's name):
``native`` (embedq's C kernels: AVX512-BF16, AVX2+FMA, portable C; the default wherever
a C compiler is found), ``triton`` (CUDA), torch's weight-only ops ``int8_row``,
``int8_group``, ``int4_cpu`` (fallbacks), and ``chunked``, the reference arithmetic
over the stored layout (a bounded chunk dequantized at a time), with a one-time warning
naming why a better layout was refused. Activations in a dtype a layout's kernels do not
take run the same reference arithmetic over that layout.
"""

from __future__ import annotations

import logging
import sys

import torch

from embedq.format.codec import unpack_zero_points
from embedq.kernels import actquant, dispatch, layouts
from embedq.kernels.layouts import Chunked, KernelFailed, Refused, Spec, warn_once
from embedq.kernels.layouts import warned as _warned
from embedq.kernels.torch_int4 import int4_layout as _int4_layout


class _Stderr(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (which tests and notebooks replace)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


# The one line per load naming the kernel variant (INFO: users silence it with
# ``logging.getLogger("embedq.kernels").setLevel(logging.WARNING)``).
log = logging.getLogger("embedq.kernels")
if not log.handlers:
    _h = _Stderr()
    _h.setFormatter(logging.Formatter("embedq: %(message)s"))
    log.addHandler(_h)
    log.setLevel(logging.INFO)
    log.propagate = False
_said: set[str] = set()


def _say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        log.info(msg)


class PreparedTable:
    """One quantized table prepared for fast logits and gathers (see the module doc).

    Build with :meth:`from_table` or :meth:`from_packed`; ``dtype`` is the activation
    dtype serving will use (the int4 path stores its scales in it). Tied models: use
    the same object for the embedding and the head. ``rows``, ``cols``, ``bits``,
    ``group_size``, ``group``, ``groups``, ``symmetric``, ``scale_dtype``, ``dtype`` and
    ``device`` are those of its :class:`~embedq.kernels.layouts.Spec`.
    """

    def __init__(self, layout) -> None:  # use the constructors below
        self.layout = layout
        self.spec: Spec = layout.spec
        self.reason: str | None = None
        self.activations = actquant.mode()  # "exact", or "int8" where a row fits (EMBEDQ_ACTIVATIONS)
        self.routes = dispatch.rows_for(type(layout), layout.spec, self.activations)
        self.last_kernel: str | None = None  # the kernel the latest linear() ran (tests assert it)

    @property
    def routes(self) -> tuple[dispatch.Route, ...]:
        """The dispatch rows that can serve this table here, best first."""
        return self._routes

    @routes.setter
    def routes(self, rows: tuple[dispatch.Route, ...]) -> None:
        self._routes = rows
        self._routes_seen: dict = {}  # (dtype, M <= 64, device type) -> the row _route chose

    @property
    def kind(self) -> str:
        """The layout's name (``native``, ``triton``, ``int8_row``, ..., ``chunked``)."""
        return self.layout.name

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_table(cls, qt, device=None, dtype: torch.dtype = torch.bfloat16,
                   prefer: str | None = None) -> "PreparedTable":
        """From an :class:`embedq.format.codec.QuantizedTable`."""
        return cls.from_packed(qt.packed, qt.scale, qt.cols, qt.bits, qt.group_size,
                               zero_point=qt.zero_point, device=device, dtype=dtype, prefer=prefer)

    @classmethod
    @torch.no_grad()
    def from_packed(cls, packed: torch.Tensor, scale: torch.Tensor, cols: int, bits: int,
                    group_size: int | None, zero_point: torch.Tensor | None = None,
                    zero_point_packed: torch.Tensor | None = None, device=None,
                    dtype: torch.dtype = torch.bfloat16, prefer: str | None = None) -> "PreparedTable":
        """From overlay tensors: ``packed`` int32 [rows, cols*bits/32], ``scale`` [rows, groups];
        zero points either signed int8 [rows, groups] (``zero_point``) or the
        compressed-tensors layout packed along rows (``zero_point_packed``).

        ``prefer="chunked"`` forces the reference layout (tests, benchmarks).
        """
        if bits not in (4, 8):
            raise ValueError(f"unsupported bits {bits}")
        rows = packed.shape[0]
        device = torch.device(device) if device is not None else packed.device
        if zero_point is None and zero_point_packed is not None:
            zero_point = unpack_zero_points(zero_point_packed.cpu(), bits, rows)
        g = cols if group_size is None else group_size
        if cols % g:
            raise ValueError(f"{cols} columns are not a whole number of groups of {g}")
        spec = Spec(rows, cols, bits, group_size, zero_point is None, scale.dtype, dtype, device)
        if tuple(scale.shape) != (rows, spec.groups):
            raise ValueError(f"scale has shape {list(scale.shape)}, expected {[rows, spec.groups]}")

        if prefer == "chunked":
            return cls._chunked(spec, packed, scale, zero_point, "requested")
        choice, refused = dispatch.choose_layout(spec)
        if refused:  # a better layout for this device could not hold the table
            warn_once(f"{'; '.join(refused)}; using {choice.name}")
        if choice is Chunked:
            return cls._chunked(spec, packed, scale, zero_point, "; ".join(refused) or "no kernel")
        layout = choice(spec)
        try:
            layout.prepare(packed, scale, zero_point)
        except Refused as e:  # a property of the values (the shape was fine): the reference
            warn_once(f"{e}: using chunked dequantization (slow)")
            return cls._chunked(spec, packed, scale, zero_point, str(e))
        self = cls(layout)
        if device.type == "cpu":
            _say_once(f"{self.describe()}: {self.variants()}")
        return self

    @classmethod
    def _chunked(cls, spec, packed, scale, zero_point, why: str) -> "PreparedTable":
        layout = Chunked(spec)
        layout.prepare(packed, scale, zero_point)
        self = cls(layout)
        self.reason = why
        return self

    def variants(self) -> str:
        """Which kernel serves which activation dtype, e.g. ``native_avx2 for bf16/f16/f32``."""
        # (act, dtype, m_min, m_max) an earlier row serves: a later row never runs there (an
        # int8-activation row hands inf/NaN rows to the exact kernels, so it covers only its kind)
        covered, parts = [], []
        for r in self.routes:
            acts = [a for a in r.acts if not any(
                k in ("exact", r.act) and a == d and lo <= r.m_min
                and (hi is None or (r.m_max is not None and r.m_max <= hi)) for k, d, lo, hi in covered)]
            covered += [(r.act, a, r.m_min, r.m_max) for a in r.acts]
            if acts:
                m = f" at M <= {r.m_max}" if r.m_max else f" at M >= {r.m_min}" if r.m_min > 1 else ""
                q = " (int8 activations)" if r.act == "int8" else ""
                parts.append(f"{r.kernel} for {'/'.join(str(a).replace('torch.', '') for a in acts)}{m}{q}")
        if self.activations != "exact" and not any(r.act == self.activations for r in self.routes):
            parts.append(f"{self.activations} activations not used: {self._why_exact()}")
        return "; ".join(parts) or "chunked"

    def _why_exact(self) -> str:
        sp = self.spec
        if sp.bits != 4:
            return "8-bit tables stay exact"
        if sp.group_size is None:
            return "4-bit per-row tables stay exact"
        rows = [r for r in dispatch.ROUTES if r.act == self.activations and r.layout is type(self.layout)]
        why = [r.fits(sp) for r in rows if r.fits is not None and r.fits(sp)]
        return why[0] if why else f"no such kernel for the {self.kind} layout on this CPU"

    def use_activations(self, mode: str) -> str:
        """Serve with ``mode`` = ``"exact"`` or ``"int8"`` (int8 activations: 4-bit tables
        with groups of 32k; see :mod:`embedq.kernels.actquant`) from now on, as
        ``EMBEDQ_ACTIVATIONS`` would at load. Returns :meth:`variants` (what now serves)."""
        self.activations = actquant.mode(mode)
        self.routes = dispatch.rows_for(type(self.layout), self.spec, self.activations)
        return self.variants()

    def move_(self, fn) -> "PreparedTable":
        """Apply ``fn`` (a ``Module._apply`` function: a device or dtype move) to the held
        tensors, in place (codes and scales keep their dtype; see the layout's ``move_``)."""
        self.layout.move_(fn)
        return self

    # -- introspection --------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held (codes, scales, zero points; padding included)."""
        return self.layout.nbytes

    def describe(self) -> str:
        sp = self.spec
        g = "row" if sp.group_size is None else f"g{sp.group_size}"
        extra = f" ({self.reason})" if self.reason else ""
        return (f"{sp.rows}x{sp.cols} int{sp.bits} {g} {'sym' if sp.symmetric else 'asym'} "
                f"-> {self.kind}{extra} on {sp.device}")

    # -- rows (gather, and the reference) ------------------------------------------------
    def dequantize_range(self, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``a:b`` as [b-a, cols] ``dtype``: the reference arithmetic, bit-exact."""
        return layouts.dequantize_range(self.layout, a, b, dtype)

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (1-D long) as [n, cols] ``dtype``: the reference arithmetic, bit-exact."""
        return layouts.dequantize_rows(self.layout, ids, dtype)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantized rows for token ids of any shape: [..., cols] in ``dtype`` (default: ``self.dtype``)."""
        dtype = self.dtype if dtype is None else dtype
        try:
            out = self.layout.gather(ids, dtype)
        except KernelFailed as e:
            out = self._fall_back(e)
        if out is not None:
            return out
        flat = ids.reshape(-1).to(device=self.device, dtype=torch.long)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.rows):
            # as nn.Embedding (a padded layout would hand back a padding row; -1 a wrapped one)
            raise IndexError(f"token id out of range for a table of {self.rows} rows")
        out = torch.empty(flat.numel(), self.cols, dtype=dtype, device=self.device)
        step = max(1, layouts.CHUNK_ELEMS // self.cols)
        for a in range(0, flat.numel(), step):  # bounded transient (int4 index tensors)
            out[a:a + step] = self.dequantize_rows(flat[a:a + step], dtype)
        return out.view(*ids.shape, self.cols)

    def _fall_back(self, e: KernelFailed) -> None:
        """A kernel failed to run here: warn once, serve the same tensors by the reference."""
        self.reason = str(e)
        warn_once(f"{self.reason}; using chunked dequantization")
        self.layout = Chunked.adopt(self.layout)
        self.routes = dispatch.rows_for(Chunked, self.spec, self.activations)
        return None

    # -- logits -----------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ dequant(W)^T (+ bias)`` for x [..., cols] in any float dtype; output in x's dtype."""
        if x.dim() == 2 and x.shape[1] == self.cols and x.shape[0] and bias is None:
            # the decode step's call, without a reshape and a view: with the caches cold (the
            # model's body streamed through them) each torch op costs ~20 us. Zen 4, Q4 g32 head
            # at M = 1 after a 64 MiB read: 150 us over the kernel's own call before, 25-40 after
            return self._linear2d(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.cols)
        if x2.shape[0] == 0:
            out = x2.new_empty(0, self.rows)
        else:
            out = self._linear2d(x2)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.view(*lead, self.rows)

    __call__ = linear

    def _route(self, x: torch.Tensor) -> dispatch.Route:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.cols)
        # the decode step's row, remembered per (dtype, M): walking the rows cost ~40 us a step
        # with the caches cold (Zen 4, after a 64 MiB read). Only a row of this device's own:
        # one chosen through EMBEDQ_SERVE_KERNEL (read per call) is looked up every time
        key = (x2.dtype, x2.shape[0], x2.device.type)
        r = self._routes_seen.get(key)
        if r is None:
            r = dispatch.kernel_for(self.routes, x2)
            if r is None:
                return dispatch.ROUTES[-1]
            if r.device in ("*", key[2]) and key[1] <= 64:
                self._routes_seen[key] = r
        return r

    def kernel_for(self, x: torch.Tensor) -> str:
        """The name of the kernel :meth:`linear` runs for activations ``x`` [M, cols]."""
        return self._route(x).kernel

    def _linear2d(self, x: torch.Tensor) -> torch.Tensor:
        r = self._route(x)
        self.last_kernel = r.kernel
        try:
            return r.run(self.layout, x)
        except KernelFailed as e:
            self._fall_back(e)
            self.last_kernel = "chunked"
            return layouts.chunked(self.layout, x)


def _spec_attr(name: str) -> property:
    return property(lambda self: getattr(self.spec, name))


for _name in ("rows", "cols", "bits", "group_size", "group", "groups", "symmetric", "scale_dtype", "dtype", "device"):
    setattr(PreparedTable, _name, _spec_attr(_name))

__all__ = ["PreparedTable", "_int4_layout", "_warned"]
