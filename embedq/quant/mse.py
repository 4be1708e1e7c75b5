"""Error-minimizing scales (and zero points): ``--method mse``.

Round-to-nearest takes the scale from the group's extremes (absmax, or min/max when
asymmetric). That is rarely the scale with the smallest reconstruction error: one
outlier stretches the step for every other element of its group, and the scale's own
rounding to the storage dtype is ignored. Here, per group (or row):

1. a search over clipping ratios: candidate scales ``extreme / (qmax * r)`` for a grid
   of ``r`` (asymmetric: the range ``[lo, hi]`` shrunk about its middle), each rounded
   to the storage dtype *before* the codes are computed, so the error measured is the
   error stored;
2. a closed-form least-squares refinement of the best candidate: with the codes fixed
   the optimal scale is ``sum(w x q) / sum(w q^2)`` (asymmetric: a two-parameter fit of
   scale and offset, the offset then rounded to an integer zero point), after which
   the codes are recomputed; repeated a few times (each step is kept only if it lowers
   the error, so the search is monotone);
3. a final comparison with round-to-nearest's own result: a group keeps RTN's scale
   and codes unless the search found a strictly smaller error. ``mse`` is therefore
   never worse than ``rtn`` on any group, by construction.

The objective is ``sum_j w_j (xhat_j - x_j)^2`` with optional per-column weights
``w`` (default 1: plain squared error). Output follows the same contract as
:func:`embedq.quant.rtn.quantize_rtn`: signed int8 codes, scales already in the
storage dtype, signed zero points (asymmetric only), ``x ≈ (q - zp) * scale`` in
float32 — so the overlay format, and every reader of it, is unchanged.
"""

from __future__ import annotations

import torch

from embedq.quant.rtn import quantize_rtn
from embedq.format.scheme import Scheme

# Clipping ratios searched. A ratio above 1 lets the extreme land on the extra
# negative code (-2^(b-1)) of a symmetric scheme; below 1 clips outliers.
SYM_RATIOS = {
    4: [0.60 + 0.04 * i for i in range(11)] + [1.0 + 1.0 / 7 * f for f in (0.5, 1.0)],
    8: [0.85 + 0.015 * i for i in range(11)] + [1.0 + 1.0 / 127],
}
ASYM_RATIOS = {
    4: [0.60 + 0.04 * i for i in range(11)],
    8: [0.85 + 0.015 * i for i in range(11)],
}
REFINE_STEPS = 3
# Rows searched at a time: keeps the search's temporaries cache-sized.
BLOCK_ELEMENTS = 1 << 18
# A group takes the searched result only when it beats RTN by more than this relative
# margin: ties (and float noise) keep RTN's exact output.
KEEP_RTN_MARGIN = 1e-7


def group_errors(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                 zero_point: torch.Tensor | None, group: int,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per-group (weighted) squared reconstruction error, float64 ``[rows, groups]``.

    The dequantization is float32 ``(q - zp) * scale`` exactly as every reader computes
    it; only the difference to ``x`` is accumulated in float64.
    """
    rows, cols = x.shape
    qg = q.float().reshape(rows, cols // group, group)
    if zero_point is not None:
        qg = qg - zero_point.float().unsqueeze(-1)
    xhat = qg * scale.float().unsqueeze(-1)
    d2 = (xhat.double() - x.double().reshape(rows, cols // group, group)) ** 2
    if weights is not None:
        d2 = d2 * weights.double().expand(rows, cols).reshape(rows, cols // group, group)
    return d2.sum(-1)


def _to_storage(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float32 scales to the storage dtype (nearest) and back to float32."""
    return s.to(dtype).float()


def _valid(s: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(s) & (s > 0)


class _Search:
    """Vectorized state of the search over all groups of a chunk."""

    def __init__(self, xg: torch.Tensor, w: torch.Tensor | None, scheme: Scheme,
                 dtype: torch.dtype):
        self.x, self.w, self.dtype = xg, w, dtype
        self.qmin, self.qmax = float(scheme.qmin), float(scheme.qmax)
        shape = xg.shape[:-1]
        self.err = torch.full(shape, float("inf"))
        self.scale = torch.ones(shape)
        self.zp = torch.zeros(shape)

    def codes(self, s: torch.Tensor, zp: torch.Tensor) -> torch.Tensor:
        return torch.round(self.x / s.unsqueeze(-1) + zp.unsqueeze(-1)).clamp_(self.qmin, self.qmax)

    def error(self, q: torch.Tensor, s: torch.Tensor, zp: torch.Tensor) -> torch.Tensor:
        d = (q - zp.unsqueeze(-1)).mul_(s.unsqueeze(-1)).sub_(self.x)
        if self.w is None:
            return torch.linalg.vecdot(d, d)
        return torch.linalg.vecdot(d, d * self.w)

    def offer(self, s: torch.Tensor, zp: torch.Tensor) -> torch.Tensor:
        """Evaluate candidate (storage-rounded) scales and zero points; keep improvements.

        Returns the candidate's codes (for a refinement step).
        """
        ok = _valid(s)
        s_safe = torch.where(ok, s, torch.ones_like(s))
        q = self.codes(s_safe, zp)
        e = torch.where(ok, self.error(q, s_safe, zp), torch.full_like(s, float("inf")))
        better = e < self.err
        self.err = torch.where(better, e, self.err)
        self.scale = torch.where(better, s_safe, self.scale)
        self.zp = torch.where(better, zp, self.zp)
        return q

    def best_codes(self) -> torch.Tensor:
        return self.codes(self.scale, self.zp)


def _weighted_sum(a: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    return (a if w is None else a * w).sum(-1)


def _search_symmetric(st: _Search, ratios: list[float]) -> None:
    amax = st.x.abs().amax(-1)
    zp = torch.zeros_like(amax)
    for r in ratios:
        st.offer(_to_storage(amax / (st.qmax * r), st.dtype), zp)
    x, w = st.x, st.w
    for _ in range(REFINE_STEPS):
        q = st.best_codes()
        num, den = _weighted_sum(x * q, w), _weighted_sum(q * q, w)
        s = torch.where(den > 0, num / den.clamp_min(1e-30), st.scale)
        st.offer(_to_storage(s, st.dtype), zp)


def _search_asymmetric(st: _Search, ratios: list[float], levels: int) -> None:
    x, w = st.x, st.w
    lo = x.amin(-1).clamp(max=0)
    hi = x.amax(-1).clamp(min=0)
    mid = (lo + hi) / 2
    for r in ratios:
        a, b = mid + (lo - mid) * r, mid + (hi - mid) * r
        s = _to_storage((b - a) / levels, st.dtype)
        zp = torch.round(st.qmin - a / s).clamp_(st.qmin, st.qmax)
        st.offer(s, zp)
    # Least squares with the codes fixed: x ≈ s*q + c (c = -s*zp), then the zero point
    # is rounded to an integer and the scale refitted for it.
    ones = torch.ones_like(x) if w is None else w
    sw = ones.sum(-1)
    for _ in range(REFINE_STEPS):
        q = st.best_codes()
        sq, sqq = _weighted_sum(q, w), _weighted_sum(q * q, w)
        sx, sxq = _weighted_sum(x, w), _weighted_sum(x * q, w)
        det = sw * sqq - sq * sq
        s = torch.where(det > 0, (sw * sxq - sq * sx) / det.clamp_min(1e-30), st.scale)
        c = torch.where(det > 0, (sqq * sx - sq * sxq) / det.clamp_min(1e-30), -st.scale * st.zp)
        s_ok = _valid(s)
        s = torch.where(s_ok, s, st.scale)
        zp = torch.round(-c / s).clamp_(st.qmin, st.qmax)
        # refit the scale for the integer zero point
        qz = q - zp.unsqueeze(-1)
        num, den = _weighted_sum(x * qz, w), _weighted_sum(qz * qz, w)
        s2 = torch.where(den > 0, num / den.clamp_min(1e-30), s)
        st.offer(_to_storage(s2, st.dtype), zp)
        st.offer(_to_storage(s, st.dtype), zp)


def quantize_mse(x: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype,
                 weights: torch.Tensor | None = None):
    """Quantize ``x`` ([rows, cols]) with error-minimizing scales (and zero points).

    ``weights``: optional non-negative weights of the squared error, per column
    ``[cols]`` or per element ``[rows, cols]`` (default: all ones). Returns ``(q, scale, zero_point)`` like
    :func:`~embedq.quant.rtn.quantize_rtn`; no group's (weighted) error exceeds RTN's.
    """
    rows, cols = x.shape
    g = scheme.effective_group(cols)
    groups = cols // g
    xf = x.float()
    xg = xf.reshape(rows, groups, g)
    wg = None
    if weights is not None:
        weights = weights.float()
        if weights.shape not in ((cols,), (rows, cols)):
            raise ValueError(f"weights must have shape [{cols}] or [{rows}, {cols}], "
                             f"not {list(weights.shape)}")
        if not bool((torch.isfinite(weights) & (weights >= 0)).all()):
            raise ValueError("weights must be finite and non-negative")
        weights = weights.expand(rows, cols)
        wg = weights.reshape(rows, groups, g)

    step = max(1, BLOCK_ELEMENTS // cols)
    scale_f = torch.empty(rows, groups)
    zp_f = torch.zeros(rows, groups)
    q = torch.empty(rows, groups, g)
    for a in range(0, rows, step):
        st = _Search(xg[a:a + step], None if wg is None else wg[a:a + step], scheme, scale_dtype)
        if scheme.symmetric:
            _search_symmetric(st, SYM_RATIOS[scheme.bits])
        else:
            _search_asymmetric(st, ASYM_RATIOS[scheme.bits], (1 << scheme.bits) - 1)
        scale_f[a:a + step], zp_f[a:a + step] = st.scale, st.zp
        q[a:a + step] = st.best_codes()
    q8 = q.to(torch.int8).reshape(rows, cols)
    scale = scale_f.to(scale_dtype)
    zp = None if scheme.symmetric else zp_f.to(torch.int8)

    # Never worse than round-to-nearest: compare exactly as readers dequantize.
    q_r, s_r, zp_r = quantize_rtn(x, scheme, scale_dtype)
    e_new = group_errors(xf, q8, scale, zp, g, weights)
    e_rtn = group_errors(xf, q_r, s_r, zp_r, g, weights)
    take = e_new < e_rtn * (1 - KEEP_RTN_MARGIN)  # [rows, groups]
    q_out = torch.where(take.unsqueeze(-1), q8.reshape(rows, groups, g),
                        q_r.reshape(rows, groups, g)).reshape(rows, cols)
    s_out = torch.where(take, scale, s_r)
    zp_out = None if zp is None else torch.where(take, zp, zp_r)
    return q_out.contiguous(), s_out.contiguous(), zp_out


__all__ = ["quantize_mse", "group_errors"]
