"""Shared by the fast-path tests (test_fastpath.py, test_fastpath_x86.py and the CPU-variant
suites): seeded tables, activations, the reference decoder and the derived error bound.

Gathers must be bit-exact (same float32 arithmetic as QuantizedTable.dequantize).

Logits cannot be bit-exact: the kernels accumulate in float32 in another order than
F.linear and round differently. The bound used (``_bound``), per output element, with
``u`` the unit roundoff of the activation dtype (2^-8 bf16, 2^-11 fp16, 2^-24 fp32) and
``A = |x| @ ((|q| + |zp|) * s)^T`` (>= |x| @ |W|^T, bounds every partial sum):
  * reference: each weight rounded to the activation dtype (<= u*|w|) -> u*A;
  * fast path: int4 rounds -zp*s to the activation dtype (<= u*|zp*s|); asymmetric int8
    rounds s*(x.q) (or each group's partial) to the activation dtype before the float32
    zero-point correction / group sum -> u*A;
  * one output rounding each side -> 2u*A;
  * float32 accumulation in different orders -> K * 2^-24 * A.
Hence |fast - ref| <= (4u + K*2^-24) * A; the test allows 6u for slack. A second check
bounds the relative Frobenius error by 2u + 2*sqrt(K)*2^-24*|A|/|ref| (typical errors are
random, not worst case: rounding errors of a K-term float32 sum grow like sqrt(K)).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from embedq.kernels import PreparedTable, dispatch, native_head
from embedq.quant.rtn import quantize_rtn
from embedq.format.scheme import Scheme
from embedq.format.codec import QuantizedTable

BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32
U = {BF: 2.0 ** -8, F16: 2.0 ** -11, F32: 2.0 ** -24}


@lru_cache(maxsize=None)
def _table(bits, group, sym, rows, cols, scale_dtype=BF, seed=0) -> QuantizedTable:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))
    w[0] = 0  # all-zero row: scale 1, code 0
    w[1] = torch.rand(cols, generator=gen) + 2  # positive only: zero point at qmin
    q, s, zp = quantize_rtn(w, Scheme(bits=bits, symmetric=sym, group_size=group), scale_dtype)
    return QuantizedTable.from_codes(q, s, zp, bits, group)


def _wabs(qt: QuantizedTable) -> torch.Tensor:
    q = qt.codes().float().abs()
    zp = torch.zeros_like(qt.scale, dtype=torch.float32) if qt.zero_point is None else qt.zero_point.float().abs()
    g = qt.cols if qt.group_size is None else qt.group_size
    qg = q.reshape(qt.rows, -1, g) + zp.unsqueeze(-1)
    # |scale|: 4-bit sym (signed-max) scales may be negative
    return (qg * qt.scale.float().abs().unsqueeze(-1)).reshape(qt.rows, qt.cols)


def _reference(qt: QuantizedTable, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, qt.dequantize(F32).to(x.dtype))


def _bound(qt: QuantizedTable, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The derived per-logit bound of an exact kernel against the reference (a = |x| @ |W|^T)."""
    return (6 * U[x.dtype] + qt.cols * 2.0 ** -24) * a + 1e-30


def _check_linear(p: PreparedTable, qt: QuantizedTable, x: torch.Tensor, wabs: torch.Tensor) -> None:
    got = p.linear(x)
    ref = _reference(qt, x)
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], qt.rows)
    u, k = U[x.dtype], qt.cols
    a = x.float().abs() @ wabs.t()
    err = (got.float() - ref.float()).abs()
    bound = _bound(qt, x, a)
    worst = (err / bound).max().item()
    assert worst <= 1, f"{p.describe()} {x.dtype} {tuple(x.shape)}: error {worst:.2f}x the bound"
    # typical (random-walk) summation error: ~sqrt(K) * 2^-24 * |A| per element; 2x slack
    rnorm = ref.float().norm().clamp_min(1e-30)
    rel = (err.norm() / rnorm).item()
    lim = 2 * u + 2 * k ** 0.5 * 2.0 ** -24 * (a.norm() / rnorm).item()
    assert rel <= lim, f"{p.describe()} {x.dtype}: relative error {rel:.3g} > {lim:.3g}"


def _xs(cols: int, seed: int = 1, full: bool = True):
    """Activations: M in {1, 2, 3, 8, 10, 16, 17, 64, 256} (every tile remainder and small-M switch of
    the native kernels), a 3-D batch and a vector; ``full=False``: M in {1, 3, 64} (torch's
    fallback ops)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((1, cols), (3, cols), (8, cols), (17, cols), (64, cols), (2, 5, cols), (cols,), (2, cols),
              (256, cols), (16, cols))  # 10-16: native_bf16's 16-row tile of groups in registers
    for shape in shapes if full else shapes[:2] + shapes[4:7]:
        x = torch.randn(*shape, generator=gen)
        for dt in (BF, F16, F32):
            yield x.to(dt)


NATIVE = native_head.unavailable() is None  # the AVX512-BF16 kernel
# The native layout runs wherever one of its C variants does (AVX512-BF16, AVX2, portable);
# each act dtype and M then has the first variant of dispatch.rows_for("native") that takes it
# (bf16 at small M: the AVX-512F rows before the AVX512-BF16 one).
NATIVE_LAYOUT = dispatch.layout_unavailable("native") is None


def _native_kernel(dt, spec, m: int) -> str:
    """The native variant this CPU serves ``m`` activation rows of ``dt`` with for a table of
    ``spec`` (no silent fallback)."""
    return next(r.kernel for r in dispatch.rows_for("native", spec) if dt in r.acts
                and (r.m_max is None or m <= r.m_max) and m >= r.m_min)
