"""Head-aware quantization of a table the output head multiplies: ``--method gptq``.

A tied (or quantized untied) head computes ``logits = h @ W.T``: an error ``e_v`` in
row ``v`` moves logit ``v`` by ``h . e_v``, so what the head needs is small
``sum_v e_v^T H e_v`` with ``H = E[h h^T]``, the second moment of the head's inputs
(the final normed hidden states) — not small ``|e_v|^2``. On Gemma 3 270M ``H`` is
far from the identity: ten of 640 hidden dimensions carry over half of ``E|h|^2``,
which is why a plain clipping search (``--method mse``) hardly lowers the KLD.

This is GPTQ (Frantar et al., 2022) applied to the table, with the head's inputs as
the calibration activations: columns are quantized one at a time and each column's
rounding error is compensated on the columns not yet quantized, so that the error
lands where ``H`` is small. Group scales (and zero points) are chosen when a group
starts, from the compensated values, by the same search as ``--method mse``.

The same table is also the embedding gather, which reads single rows and is hurt by
element-wise error. Two things keep that in check:

- the damping ``H + damp * mean(diag H) * I`` is the weight of the gather's plain
  squared error relative to the head's (``damp = 1``: equal average weight);
- rows that the head never predicts but every context reads (the BOS token) are
  quantized with the plain ``mse`` search.

Guarantee: every row's head objective ``e^T (H + damp I) e`` is at most RTN's — a row
whose GPTQ result is not better keeps RTN's codes and scales. The output has the same
contract as :func:`embedq.quant.rtn.quantize_rtn` and the same overlay format.

``H`` comes from a calibration run (:func:`collect_calibration`): the float model is
run on a built-in text sample — docstrings of the Python standard library, deliberately
*not* the ``pydoc_data`` topics that ``embedq eval`` scores by default — or on a file.
Activate it around quantization with :func:`calibrated`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from embedq.errors import SchemeError
from embedq.quant.mse import quantize_mse
from embedq.format.codec import dequantize_codes
from embedq.quant.rtn import quantize_rtn
from embedq.format.scheme import Scheme

DEFAULT_DAMP = 1.0
BLOCK = 128  # columns per lazy-update block
@dataclass
class Calibration:
    """What the head needs: the second moment of its inputs, and rows to leave alone."""

    hessian: torch.Tensor  # [cols, cols] float64, E[h h^T]
    protected: torch.Tensor = field(default_factory=lambda: torch.empty(0, 0))  # rows [k, cols]
    damp: float = DEFAULT_DAMP
    source: str = ""
    tokens: int = 0
    _u: torch.Tensor | None = field(default=None, repr=False)

    @property
    def cols(self) -> int:
        return self.hessian.shape[0]

    def damped(self) -> torch.Tensor:
        h = self.hessian.double()
        return h + self.damp * h.diagonal().mean() * torch.eye(self.cols, dtype=torch.float64)

    def inverse_cholesky(self) -> torch.Tensor:
        """Upper Cholesky factor of ``(H + damp)^-1`` (GPTQ's update matrix), float32."""
        if self._u is None:
            hd = self.damped()
            hinv = torch.cholesky_inverse(torch.linalg.cholesky(hd))
            self._u = torch.linalg.cholesky(hinv, upper=True).float()
        return self._u

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.hessian.double().contiguous().numpy().tobytes())
        h.update(repr(self.damp).encode())
        return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------
# the quantizer


def row_objective(x: torch.Tensor, q, scale, zp, group: int | None, hd: torch.Tensor) -> torch.Tensor:
    """Per-row ``e^T Hd e`` of a quantization of ``x`` (float32 matmul, float64 sums)."""
    e = dequantize_codes(q, scale, zp, group) - x.float()
    return ((e @ hd.to(e.dtype)).double() * e.double()).sum(-1)


def _gptq_rows(x: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype, u: torch.Tensor):
    """Plain GPTQ over all rows of ``x`` with update matrix ``u``; group params by ``mse``."""
    w = x.float().clone()
    rows, cols = w.shape
    g = scheme.effective_group(cols)
    groups = cols // g
    q = torch.empty(rows, cols, dtype=torch.int8)
    scale = torch.empty(rows, groups, dtype=scale_dtype)
    zp = None if scheme.symmetric else torch.empty(rows, groups, dtype=torch.int8)
    row_scheme = Scheme(bits=scheme.bits, symmetric=scheme.symmetric, group_size=None, method="mse")
    sf = zf = None
    for i1 in range(0, cols, BLOCK):
        i2 = min(cols, i1 + BLOCK)
        w1 = w[:, i1:i2]  # a view: updates land in w
        err = torch.zeros(rows, i2 - i1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = i1 + i
            if c % g == 0:
                # This group's parameters from the compensated values (columns c..c+g,
                # all of them current: later blocks already carry earlier blocks' updates).
                _, s, z = quantize_mse(w[:, c:c + g], row_scheme, scale_dtype)
                scale[:, c // g] = s[:, 0]
                sf = s[:, 0].float()
                if zp is not None:
                    zp[:, c // g] = z[:, 0]
                    zf = z[:, 0].float()
            col = w1[:, i]
            qq = torch.round(col / sf)
            if zf is not None:
                qq += zf
            qq.clamp_(scheme.qmin, scheme.qmax)
            q[:, c] = qq.to(torch.int8)
            deq = (qq - zf) * sf if zf is not None else qq * sf
            e = (col - deq) / u1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            err[:, i] = e
        if i2 < cols:
            w[:, i2:] -= err @ u[i1:i2, i2:]
    return q, scale, zp


def quantize_gptq(x: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype,
                  calibration: Calibration | None = None):
    """Head-aware quantization of ``x`` ([rows, cols]) against ``calibration``; ``(q, scale, zp)``
    like RTN."""
    cal = calibration
    if cal is None:
        raise SchemeError("--method gptq needs a calibration run (embedq.quantize does it; or pass "
                          "calibration=embedq.jobs.calibration.collect_calibration(checkpoint))")
    rows, cols = x.shape
    if cal.cols != cols:
        raise SchemeError(f"calibration is for {cal.cols} columns, the table has {cols}")
    g = scheme.effective_group(cols)
    xf = x.float()
    q, s, zp = _gptq_rows(xf, scheme, scale_dtype, cal.inverse_cholesky())

    # never worse than RTN on the head objective, row by row
    hd = cal.damped()
    q_r, s_r, zp_r = quantize_rtn(x, scheme, scale_dtype)
    # (a margin well above the float32 matmul's rounding: near-ties keep RTN)
    take = row_objective(xf, q, s, zp, g, hd) < row_objective(xf, q_r, s_r, zp_r, g, hd) * (1 - 1e-4)
    # rows the head never predicts but every context reads (BOS): plain squared error
    plain = _protected_rows(xf, cal.protected)
    if bool(plain.any()):
        q_m, s_m, zp_m = quantize_mse(x[plain], scheme, scale_dtype)
        q_r, s_r = q_r.clone(), s_r.clone()
        q_r[plain], s_r[plain] = q_m, s_m
        if zp_r is not None:
            zp_r = zp_r.clone()
            zp_r[plain] = zp_m
        take &= ~plain
    t = take.unsqueeze(-1)
    q_out = torch.where(t, q, q_r)
    s_out = torch.where(t, s, s_r)
    zp_out = None if zp is None else torch.where(t, zp, zp_r)
    return q_out.contiguous(), s_out.contiguous(), zp_out


def _protected_rows(x: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    if protected.numel() == 0:
        return torch.zeros(x.shape[0], dtype=torch.bool)
    p = protected.float()
    eq = (x.unsqueeze(1) == p.unsqueeze(0)).all(-1)  # [rows, k]
    return eq.any(-1)


__all__ = ["Calibration", "quantize_gptq", "row_objective", "DEFAULT_DAMP"]
