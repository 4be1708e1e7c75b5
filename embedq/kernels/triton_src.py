"""The jitted Triton kernels of :mod:`embedq.kernels.triton_head` (imports triton: load lazily).

Module level because Triton resolves a kernel's helpers through its globals. Layout and
arithmetic: see :mod:`embedq.kernels.triton_head`. Only ``tl`` builtins are used (``tl.full``,
not ``tl.zeros``): helpers of triton.language that are themselves ``@triton.jit`` functions
were decorated when triton was imported, and break the interpreter when that import came
before ``TRITON_INTERPRET=1`` was set (vLLM imports triton early).
"""

import triton
import triton.language as tl


@triton.jit
def unpack_codes(wd, BITS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # [BN, BK/PF] words -> [BN, BK] signed codes (int32), element 0 in the low bits
    PF: tl.constexpr = 32 // BITS
    sh = tl.arange(0, PF) * BITS
    u = (wd[:, :, None] >> sh[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(u, (BN, BK)) - (1 << (BITS - 1))


@triton.jit
def logits_kernel(x_ptr, w_ptr, s_ptr, z_ptr, o_ptr, M, V, K, NW,
                  sxm, swn, ssn, som,
                  BITS: tl.constexpr, GROUP: tl.constexpr, PER_ROW: tl.constexpr,
                  HAS_ZP: tl.constexpr, IEEE: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    PF: tl.constexpr = 32 // BITS
    BW: tl.constexpr = BK // PF
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mm = offs_m < M
    mn = offs_n < V
    rows = offs_n.to(tl.int64)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * sxm
    w_rows = w_ptr + rows[:, None] * swn
    kk = tl.arange(0, BK)
    kw = tl.arange(0, BW)
    acc = tl.full((BM, BN), 0.0, tl.float32)
    if PER_ROW:
        if HAS_ZP:
            z = tl.load(z_ptr + rows * ssn, mask=mn, other=0).to(tl.int32)
        for k0 in range(0, K, BK):
            xt = tl.load(x_rows + (k0 + kk)[None, :], mask=mm[:, None] & (k0 + kk < K)[None, :],
                         other=0.0)
            wd = tl.load(w_rows + (k0 // PF + kw)[None, :],
                         mask=mn[:, None] & (k0 // PF + kw < NW)[None, :], other=0)
            q = unpack_codes(wd, BITS, BN, BK)
            if HAS_ZP:
                q = q - z[:, None]
            if IEEE:
                acc += tl.dot(xt, tl.trans(q.to(xt.dtype)), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(q.to(xt.dtype)))
        s = tl.load(s_ptr + rows * ssn, mask=mn, other=0.0).to(tl.float32)
        acc = acc * s[None, :]
    else:
        for gi in range(0, K // GROUP):
            part = tl.full((BM, BN), 0.0, tl.float32)
            if HAS_ZP:
                z = tl.load(z_ptr + rows * ssn + gi, mask=mn, other=0).to(tl.int32)
            for k1 in range(0, GROUP, BK):
                k0 = gi * GROUP + k1
                xt = tl.load(x_rows + (k0 + kk)[None, :], mask=mm[:, None], other=0.0)
                wd = tl.load(w_rows + (k0 // PF + kw)[None, :], mask=mn[:, None], other=0)
                q = unpack_codes(wd, BITS, BN, BK)
                if HAS_ZP:
                    q = q - z[:, None]
                if IEEE:
                    part += tl.dot(xt, tl.trans(q.to(xt.dtype)), input_precision="ieee")
                else:
                    part += tl.dot(xt, tl.trans(q.to(xt.dtype)))
            s = tl.load(s_ptr + rows * ssn + gi, mask=mn, other=0.0).to(tl.float32)
            acc += part * s[None, :]
    o = o_ptr + offs_m.to(tl.int64)[:, None] * som + offs_n[None, :]
    tl.store(o, acc.to(o_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


@triton.jit
def gather_kernel(ids_ptr, w_ptr, s_ptr, z_ptr, o_ptr, V, K, swn, ssn, son,
                  BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
                  BLOCK: tl.constexpr):
    PF: tl.constexpr = 32 // BITS
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    r = tl.load(ids_ptr + i).to(tl.int64)
    # ids outside the table read nothing (zero rows) instead of stray memory
    mc = (c < K) & (r >= 0) & (r < V)
    wd = tl.load(w_ptr + r * swn + c // PF, mask=mc, other=0)
    q = ((wd >> ((c % PF) * BITS)) & ((1 << BITS) - 1)) - (1 << (BITS - 1))
    g = c // GROUP
    if HAS_ZP:
        q = q - tl.load(z_ptr + r * ssn + g, mask=mc, other=0).to(tl.int32)
    s = tl.load(s_ptr + r * ssn + g, mask=mc, other=0.0).to(tl.float32)
    v = q.to(tl.float32) * s
    tl.store(o_ptr + i.to(tl.int64) * son + c, v.to(o_ptr.dtype.element_ty), mask=c < K)

