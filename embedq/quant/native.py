"""A small C kernel for RTN quantize + pack (+ error statistics), built in well under a second.

The heavy, element-wise part of RTN (``u = clamp(round(x / s) + zp) + 2^(b-1)``, packed,
plus the error statistics) is one loop in C, compiled on first use with the system C
compiler (``cc -O3 -march=native -ffp-contract=off``; ~0.3 s, no torch headers, no
inductor) into :func:`embedq.kernels.build.kernel_cache_dir` and loaded with
:mod:`ctypes` (which releases the GIL during the call). Scales and zero points are
computed by torch, by the same code as the reference (they are small: one per group).

Bit-identity with :func:`embedq.quant.rtn.quantize_rtn` holds because every float
operation is the reference's own IEEE operation in the same order: float32 ``x / s``
(a correctly rounded division, never a reciprocal), ``rintf`` (round half to even, as
``torch.round``), float adds of small integers (exact), and no FMA contraction. Group
maxima are exact whatever the order. Only the float statistics' sums may differ in
their last bits (summation order), as with the inductor kernel.

Sources: bf16 and float32 tables (bf16 -> float32 is a shift). float16 tables take the
eager path. Nothing here is needed for correctness: without a C compiler, or with
``EMBEDQ_KERNEL=eager|aoti|jit``, the other kernels run and write the same bytes.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading

import torch

from embedq.format.scheme_units import UNITS
from embedq.kernels.build import SCALE_KIND, LazyLibrary, kernel_cache_dir
from embedq.quant.profile import stage

log = logging.getLogger(__name__)

# The C twin of the units' rules (tested against them: tests/test_scheme_units.py): which bit
# widths take signed-max symmetric scales, as a bit mask. The packing loop handles one or
# two codes a byte (a family of fewer bits needs its loop here).
_RULES = f"#define SIGNED_MAX_BITS {sum(1 << b for b, u in UNITS.items() if u.signed_max)}u\n"

C_SOURCE = _RULES + r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

#define BLK 64 /* elements converted to float at a time */

static inline float bf16f(uint16_t h) { uint32_t w = (uint32_t)h << 16; float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t fbits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }
static inline float bitsf(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
/* Monotone map float bits -> signed int (NaN with sign 0 above +inf, with sign 1 below -inf). */
static inline int32_t okey(uint32_t w) { return (int32_t)w >= 0 ? (int32_t)w : (int32_t)(w ^ 0x7fffffffu); }
static inline uint32_t unkey(int32_t k) { return k >= 0 ? (uint32_t)k : ((uint32_t)k ^ 0x7fffffffu); }

/* Group min / max back from their order keys (okey); NaN in both where either is NaN. */
static inline void keys_range(int32_t lo, int32_t hi, float* a, float* b) {
    float fl = bitsf(unkey(lo)), fh = bitsf(unkey(hi));
    int nan = fl != fl || fh != fh;
    *a = nan ? NAN : fl; *b = nan ? NAN : fh;
}

/* Per group: max |x| (sym: a) or min (a) and max (b) (asym). Integer compares on the
   float bits: exact, vectorized, and NaN propagates like torch.amax/amin. */
void range_bits(const uint32_t* w, int64_t ngroups, int64_t g, int asym, float* a, float* b) {
    for (int64_t k = 0; k < ngroups; k++) {
        const uint32_t* p = w + k * g;
        if (!asym) {
            uint32_t m = 0;
            for (int64_t i = 0; i < g; i++) { uint32_t v = p[i] & 0x7fffffffu; m = v > m ? v : m; }
            a[k] = m > 0x7f800000u ? NAN : bitsf(m);
        } else {
            int32_t lo = INT32_MAX, hi = INT32_MIN;
            for (int64_t i = 0; i < g; i++) { int32_t v = okey(p[i]); lo = v < lo ? v : lo; hi = v > hi ? v : hi; }
            keys_range(lo, hi, a + k, b + k);
        }
    }
}
void range_bf16(const uint16_t* x, int64_t ngroups, int64_t g, int asym, float* a, float* b) {
    for (int64_t k = 0; k < ngroups; k++) {
        const uint16_t* p = x + k * g;
        if (!asym) {
            uint16_t m = 0;
            for (int64_t i = 0; i < g; i++) { uint16_t v = p[i] & 0x7fffu; m = v > m ? v : m; }
            a[k] = m > 0x7f80u ? NAN : bf16f(m);
        } else {
            int32_t lo = INT32_MAX, hi = INT32_MIN;
            for (int64_t i = 0; i < g; i++) { int32_t v = okey((uint32_t)p[i] << 16); lo = v < lo ? v : lo; hi = v > hi ? v : hi; }
            keys_range(lo, hi, a + k, b + k);
        }
    }
}
void range_f32(const float* x, int64_t ngroups, int64_t g, int asym, float* a, float* b) {
    range_bits((const uint32_t*)x, ngroups, g, asym, a, b);
}

/* n (<= BLK) floats v of one group -> codes u, then the statistics. Only the statistics'
   loop reassociates (omp simd reduction): the codes' arithmetic is the reference's. */
static inline void qblock(const float* restrict v, int64_t n, float sc, float z, float qmin, float qmax,
                          float off, uint8_t* restrict u, int stats, uint32_t* restrict mx,
                          float* restrict se, float* restrict sr) {
    float q[BLK];
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float t = rintf(v[i] / sc) + z;
        t = t < qmin ? qmin : t;
        t = t > qmax ? qmax : t;
        q[i] = t;
        u[i] = (uint8_t)(int32_t)(t + off);
    }
    if (stats) {
        uint32_t m = *mx; float a = 0.0f, b = 0.0f;
        #pragma omp simd reduction(max:m) reduction(+:a,b)
        for (int64_t i = 0; i < n; i++) {
            float d = (q[i] - z) * sc - v[i];
            uint32_t ad = fbits(d) & 0x7fffffffu;
            m = ad > m ? ad : m;
            a += d * d;
            b += v[i] * v[i];
        }
        *mx = m; *se += a; *sr += b;
    }
}

/* A float32 scale rounded to the storage dtype, its magnitude never down (rtn.round_scale_up):
   kind 0 float32, 1 bfloat16 (round to nearest even, as torch), 2 float16. */
static inline float scale_up(float scale, int kind, void* out, int64_t k) {
    if (kind == 0) { ((float*)out)[k] = scale; return scale; }
    uint16_t h; float f;
    if (kind == 1) {
        uint32_t w = fbits(scale);
        h = scale != scale ? 0x7fc0 : (uint16_t)((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
        f = bf16f(h);
        if (fabsf(f) < fabsf(scale)) { h = (uint16_t)(h + 1); f = bf16f(h); }
    } else {
        _Float16 x = (_Float16)scale; memcpy(&h, &x, 2); f = (float)x;
        if (fabsf(f) < fabsf(scale)) { h = (uint16_t)(h + 1); memcpy(&x, &h, 2); f = (float)x; }
    }
    ((uint16_t*)out)[k] = h;
    return f;
}

/* AVX-512: a group of a multiple of 16 elements in registers, 16 at a time (range, codes,
   packing, statistics; AVX2 below: 8). The same IEEE operations per element as qblock (division, round to
   nearest even, adds of small integers, the clamps' NaN behaviour), so the same bytes; only
   the statistics' sums reassociate. -DEQ_QUANT_SCALAR builds the loops above alone (tests). */
#if defined(__AVX512F__) && !defined(EQ_QUANT_SCALAR)
#include <immintrin.h>
#define QVEC 16
static inline __m512i vload(const void* p, int isbf, int64_t i) {  /* 16 elements as float32 bits */
    if (isbf) return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i))), 16);
    return _mm512_loadu_si512((const float*)p + i);
}
static inline void vrange(const void* p, int isbf, int64_t g, int asym, float* a, float* b) {
    const __m512i abs = _mm512_set1_epi32(0x7fffffff);
    if (!asym) {
        __m512i m = _mm512_setzero_si512();
        for (int64_t i = 0; i < g; i += 16) m = _mm512_max_epu32(m, _mm512_and_si512(vload(p, isbf, i), abs));
        uint32_t r = _mm512_reduce_max_epu32(m);
        *a = r > 0x7f800000u ? NAN : bitsf(r);
        return;
    }
    __m512i lo = _mm512_set1_epi32(INT32_MAX), hi = _mm512_set1_epi32(INT32_MIN);
    for (int64_t i = 0; i < g; i += 16) {
        __m512i v = vload(p, isbf, i);
        __m512i k = _mm512_xor_si512(v, _mm512_and_si512(_mm512_srai_epi32(v, 31), abs));  /* okey */
        lo = _mm512_min_epi32(lo, k);
        hi = _mm512_max_epi32(hi, k);
    }
    keys_range(_mm512_reduce_min_epi32(lo), _mm512_reduce_max_epi32(hi), a, b);
}
static inline void vgroup(const void* p, int isbf, int64_t g, float sc, float z, float qmin, float qmax, float off,
                          int bits, uint8_t* restrict o, int stats, __m512i* mx, float* gse, float* gsr) {
    const __m512 vsc = _mm512_set1_ps(sc), vz = _mm512_set1_ps(z), vmin = _mm512_set1_ps(qmin),
                 vmax = _mm512_set1_ps(qmax), voff = _mm512_set1_ps(off);
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), lo32 = _mm512_set1_epi64(0xffffffffLL);
    __m512 se = _mm512_setzero_ps(), sr = _mm512_setzero_ps();
    for (int64_t i = 0; i < g; i += 16) {
        __m512 v = _mm512_castsi512_ps(vload(p, isbf, i));
        __m512 t = _mm512_add_ps(_mm512_roundscale_ps(_mm512_div_ps(v, vsc), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), vz);
        t = _mm512_max_ps(vmin, t);  /* t < qmin ? qmin : t -- a NaN stays (max_ps returns its 2nd operand) */
        t = _mm512_min_ps(vmax, t);
        __m512i u = _mm512_cvttps_epi32(_mm512_add_ps(t, voff));
        if (bits == 8) {
            _mm_storeu_si128((__m128i*)(o + i), _mm512_cvtepi32_epi8(u));
        } else {  /* element 2j low nibble, 2j+1 high: per 64-bit lane lo | hi << 4, then its low byte */
            __m512i w = _mm512_or_si512(_mm512_and_si512(u, lo32), _mm512_slli_epi64(_mm512_srli_epi64(u, 32), 4));
            _mm_storel_epi64((__m128i*)(o + i / 2), _mm512_cvtepi64_epi8(w));
        }
        if (stats) {
            __m512 d = _mm512_sub_ps(_mm512_mul_ps(_mm512_sub_ps(t, vz), vsc), v);
            *mx = _mm512_max_epu32(*mx, _mm512_and_si512(_mm512_castps_si512(d), abs));
            se = _mm512_add_ps(se, _mm512_mul_ps(d, d));
            sr = _mm512_add_ps(sr, _mm512_mul_ps(v, v));
        }
    }
    if (stats) { *gse += _mm512_reduce_add_ps(se); *gsr += _mm512_reduce_add_ps(sr); }
}
#define VMX_DECL __m512i vmx = _mm512_setzero_si512()
#define VMX_FOLD do { uint32_t v_ = _mm512_reduce_max_epu32(vmx); mx = v_ > mx ? v_ : mx; } while (0)
#define vrange_ vrange
#define vgroup_ vgroup
#elif defined(__AVX2__) && !defined(EQ_QUANT_SCALAR)
/* AVX2 (Zen 1-3, Haswell to Comet Lake, E-core Xeons): the same, 8 elements at a time */
#include <immintrin.h>
#define QVEC 8
static inline __m256i vload(const void* p, int isbf, int64_t i) {
    if (isbf) return _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i))), 16);
    return _mm256_loadu_si256((const __m256i*)((const float*)p + i));
}
static inline __m128i fold(__m256i v, int op) {  /* 8 lanes to 4, then 4 to 1 (lane 0): 0 max_epu32, 1 min_epi32, 2 max_epi32 */
    __m128i a = _mm256_castsi256_si128(v), b = _mm256_extracti128_si256(v, 1);
    for (int k = 0; k < 3; k++) {
        a = op == 0 ? _mm_max_epu32(a, b) : op == 1 ? _mm_min_epi32(a, b) : _mm_max_epi32(a, b);
        b = _mm_shuffle_epi32(a, k == 0 ? 0x4e : 0xb1);
    }
    return a;
}
static inline float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
static inline void vrange(const void* p, int isbf, int64_t g, int asym, float* a, float* b) {
    const __m256i abs = _mm256_set1_epi32(0x7fffffff);
    if (!asym) {
        __m256i m = _mm256_setzero_si256();
        for (int64_t i = 0; i < g; i += 8) m = _mm256_max_epu32(m, _mm256_and_si256(vload(p, isbf, i), abs));
        uint32_t r = (uint32_t)_mm_cvtsi128_si32(fold(m, 0));
        *a = r > 0x7f800000u ? NAN : bitsf(r);
        return;
    }
    __m256i lo = _mm256_set1_epi32(INT32_MAX), hi = _mm256_set1_epi32(INT32_MIN);
    for (int64_t i = 0; i < g; i += 8) {
        __m256i v = vload(p, isbf, i);
        __m256i k = _mm256_xor_si256(v, _mm256_and_si256(_mm256_srai_epi32(v, 31), abs));  /* okey */
        lo = _mm256_min_epi32(lo, k);
        hi = _mm256_max_epi32(hi, k);
    }
    keys_range(_mm_cvtsi128_si32(fold(lo, 1)), _mm_cvtsi128_si32(fold(hi, 2)), a, b);
}
static inline void vgroup(const void* p, int isbf, int64_t g, float sc, float z, float qmin, float qmax, float off,
                          int bits, uint8_t* restrict o, int stats, __m256i* mx, float* gse, float* gsr) {
    const __m256 vsc = _mm256_set1_ps(sc), vz = _mm256_set1_ps(z), vmin = _mm256_set1_ps(qmin),
                 vmax = _mm256_set1_ps(qmax), voff = _mm256_set1_ps(off);
    const __m256i abs = _mm256_set1_epi32(0x7fffffff), low = _mm256_set1_epi64x(0xff);
    /* byte 0 and 8 of each 128-bit lane to its bytes 0 and 1 */
    const __m256i pick = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256 se = _mm256_setzero_ps(), sr = _mm256_setzero_ps();
    for (int64_t i = 0; i < g; i += 8) {
        __m256 v = _mm256_castsi256_ps(vload(p, isbf, i));
        __m256 t = _mm256_add_ps(_mm256_round_ps(_mm256_div_ps(v, vsc), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), vz);
        t = _mm256_max_ps(vmin, t);  /* t < qmin ? qmin : t -- a NaN stays (max_ps returns its 2nd operand) */
        t = _mm256_min_ps(vmax, t);
        __m256i u = _mm256_cvttps_epi32(_mm256_add_ps(t, voff));
        if (bits == 8) {  /* codes 0..255 (a NaN's 0x80000000 saturates to 0, its low byte) */
            __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
            _mm_storel_epi64((__m128i*)(o + i), _mm_packus_epi16(w, w));
        } else {  /* element 2j low nibble, 2j+1 high: per 64-bit lane (lo | hi << 4) & 0xff */
            __m256i w = _mm256_and_si256(_mm256_or_si256(u, _mm256_slli_epi64(_mm256_srli_epi64(u, 32), 4)), low);
            w = _mm256_shuffle_epi8(w, pick);
            int32_t four = _mm_cvtsi128_si32(_mm_unpacklo_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
            memcpy(o + i / 2, &four, 4);
        }
        if (stats) {
            __m256 d = _mm256_sub_ps(_mm256_mul_ps(_mm256_sub_ps(t, vz), vsc), v);
            *mx = _mm256_max_epu32(*mx, _mm256_and_si256(_mm256_castps_si256(d), abs));
            se = _mm256_add_ps(se, _mm256_mul_ps(d, d));
            sr = _mm256_add_ps(sr, _mm256_mul_ps(v, v));
        }
    }
    if (stats) { *gse += hsum(se); *gsr += hsum(sr); }
}
#define VMX_DECL __m256i vmx = _mm256_setzero_si256()
#define VMX_FOLD do { uint32_t v_ = (uint32_t)_mm_cvtsi128_si32(fold(vmx, 0)); mx = v_ > mx ? v_ : mx; } while (0)
#define vrange_ vrange
#define vgroup_ vgroup
#else
#define QVEC 0
#define VMX_DECL int vmx = 0
#define VMX_FOLD (void)vmx
#define vrange_(...) ((void)0)
#define vgroup_(...) ((void)0)
#endif

/* One chunk of ngroups groups of g elements: range, scale (+ zero point), codes, packing,
   statistics -- each group read from memory once and then from L1/L2.
   s_out: the scales in the storage dtype; zp_out (asym): int8 zero points.
   out: one code per byte, or two (element 2j in the low nibble, 2j+1 high): IntUnit.pack_bytes.
   st (when not NULL): max|xhat-x|, sum (xhat-x)^2, sum x^2 (float per group, double total). */
#define QUANT(NAME, RANGE, T, CVT)                                                           \
void NAME(const T* x, int64_t ngroups, int64_t g, int bits, int asym, int kind,             \
          void* s_out, int8_t* zp_out, uint8_t* out, double* st) {                           \
    const float qmax = (float)((1 << (bits - 1)) - 1), qmin = -qmax - 1.0f, off = qmax + 1.0f; \
    const int stats = st != 0, per = 8 / bits, smax = (SIGNED_MAX_BITS >> bits) & 1;        \
    uint32_t mx = 0; double se = 0.0, sr = 0.0;                                              \
    const int vec = QVEC && g % (QVEC ? QVEC : 1) == 0 && (bits == 8 || bits == 4); VMX_DECL; \
    float v[BLK]; uint8_t u[BLK];                                                            \
    for (int64_t k = 0; k < ngroups; k++) {                                                  \
        const T* p = x + k * g;                                                              \
        float a, b, sc, z = 0.0f;                                                            \
        if (vec) vrange_(p, sizeof(T) == 2, g, asym || smax, &a, &b);                       \
        else RANGE(p, 1, g, asym || smax, &a, &b); /* signed-max: min (a) and max (b) */    \
        if (!asym) {                                                                         \
            /* absmax / qmax, or signed-max: the signed extreme / qmin (IntUnit.signed_max) */ \
            float m = smax ? (-a > b ? a : b) : a;                                           \
            float scale = smax ? m / qmin : m / qmax;                                        \
            sc = scale_up(m > 0 || m < 0 ? scale : 1.0f, kind, s_out, k);                    \
        } else {                                                                             \
            float lo = a > 0 ? 0.0f : a, hi = b < 0 ? 0.0f : b; /* clamp; NaN stays NaN */    \
            float span = hi - lo;                                                            \
            float scale = span / (float)((1 << bits) - 1);                                   \
            sc = scale_up(span > 0 ? scale : 1.0f, kind, s_out, k);                          \
            z = rintf(qmin - lo / sc);                                                       \
            z = z < qmin ? qmin : (z > qmax ? qmax : z);                                     \
            zp_out[k] = (int8_t)(int32_t)z;                                                  \
        }                                                                                    \
        float gse = 0.0f, gsr = 0.0f;                                                        \
        if (vec) vgroup_(p, sizeof(T) == 2, g, sc, z, qmin, qmax, off, bits,                 \
                         out + k * g * bits / 8, stats, &vmx, &gse, &gsr);                   \
        else for (int64_t i0 = 0; i0 < g; i0 += BLK) {                                      \
            int64_t n = g - i0 < BLK ? g - i0 : BLK;                                         \
            for (int64_t i = 0; i < n; i++) v[i] = CVT(p[i0 + i]);                           \
            if (per == 1) {                                                                  \
                qblock(v, n, sc, z, qmin, qmax, off, out + k * g + i0, stats, &mx, &gse, &gsr); \
            } else {                                                                         \
                qblock(v, n, sc, z, qmin, qmax, off, u, stats, &mx, &gse, &gsr);             \
                uint8_t* o = out + (k * g + i0) / 2; /* per == 2: element 2j low */           \
                for (int64_t i = 0; i < n / 2; i++) o[i] = (uint8_t)(u[2 * i] | (u[2 * i + 1] << bits)); \
            }                                                                                \
        }                                                                                    \
        if (stats) { se += gse; sr += gsr; }                                                 \
    }                                                                                        \
    VMX_FOLD;                                                                                \
    if (stats) { st[0] = mx > 0x7f800000u ? NAN : bitsf(mx); st[1] = se; st[2] = sr; }       \
}
static inline float f32f(float f) { return f; }
int quant_vector(void) { return QVEC; }  /* the vector width groups of its multiples take (0: none) */
QUANT(quant_bf16, range_bf16, uint16_t, bf16f)
QUANT(quant_f32, range_f32, float, f32f)
"""

FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fno-math-errno",
         "-fopenmp-simd",
         "-shared", "-fPIC"]

_lock = threading.Lock()  # the kernel thread pool's


def _signatures(lib) -> None:
    P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.quant_vector.restype = F
    lib.quant_vector.argtypes = []
    for n in ("quant_bf16", "quant_f32"):
        getattr(lib, n).argtypes = [P, I, I, F, F, F, P, P, P, P]
        getattr(lib, n).restype = None


# The one loader (kernels.build.LazyLibrary): built on first use, at most once per process.
LIBRARY = LazyLibrary("native", C_SOURCE, FLAGS, ["-lm"], setup=_signatures, label="native quantize")


def library():
    """The loaded kernel library, or None (see :func:`unavailable_reason`)."""
    return LIBRARY.get()


def unavailable_reason() -> str | None:
    return LIBRARY.unavailable()


def supports_dtype(dtype: torch.dtype) -> bool:
    """Source dtypes the C kernel reads (float16 tables take the other kernels)."""
    return dtype in (torch.bfloat16, torch.float32)


def quantize_pack(x: torch.Tensor, bits: int, group: int, symmetric: bool,
                  scale_dtype: torch.dtype, stats: bool):
    """``(packed_uint8 [rows, cols*bits/8], scale, zp_int8 | None, stats | None)`` of one chunk.

    Same bytes as ``quantize_rtn`` + ``pack_int32``; ``stats`` is ``(max_abs, sq_err,
    sq_ref)`` as floats. The caller checks :func:`library` and :func:`supports_dtype` first.
    """
    lib = library()
    rows, cols = x.shape
    x = x.contiguous()
    groups = cols // group
    s = torch.empty(rows, groups, dtype=scale_dtype)
    zp = None if symmetric else torch.empty(rows, groups, dtype=torch.int8)
    out = torch.empty(rows, cols * bits // 8, dtype=torch.uint8)
    fn = lib.quant_bf16 if x.dtype == torch.bfloat16 else lib.quant_f32
    # Rows are independent: with more than one kernel thread (torch.get_num_threads(), which
    # the pipeline sets from EMBEDQ_KERNEL_THREADS) the chunk is cut into row ranges run in
    # parallel (ctypes releases the GIL). Same bytes; only the statistics' sums reassociate.
    parts = max(1, min(torch.get_num_threads(), x.numel() * x.element_size() // _MIN_PART_BYTES, rows))
    bounds = [rows * i // parts for i in range(parts + 1)]
    sts = [(ctypes.c_double * 3)() if stats else None for _ in range(parts)]
    xs, ss, os_ = x.element_size(), s.element_size(), cols * bits // 8

    def run(i: int) -> None:
        a, b = bounds[i], bounds[i + 1]
        fn(x.data_ptr() + a * cols * xs, (b - a) * groups, group, bits, 0 if symmetric else 1,
           SCALE_KIND[scale_dtype], s.data_ptr() + a * groups * ss,
           None if zp is None else zp.data_ptr() + a * groups, out.data_ptr() + a * os_, sts[i])

    if parts == 1:
        run(0)
    else:
        _run_parallel(run, parts)
    if not stats:
        return out, s, zp, None
    m = [st[0] for st in sts]
    mx = math.nan if any(v != v for v in m) else max(m)
    return out, s, zp, (mx, math.fsum(st[1] for st in sts), math.fsum(st[2] for st in sts))


_MIN_PART_BYTES = 1 << 20  # smaller parts are not worth a thread hand-off
_pool_obj = None


def _pool(n: int):
    global _pool_obj
    with _lock:
        if _pool_obj is None or _pool_obj._max_workers < n:
            from concurrent.futures import ThreadPoolExecutor
            _pool_obj = ThreadPoolExecutor(n, thread_name_prefix="embedq-kernel")
        return _pool_obj


def _run_parallel(run, parts: int) -> list:
    """``run(0)`` here and ``run(1..parts-1)`` on the kernel pool; wait for all."""
    futures = [_pool(parts - 1).submit(_timed, run, i) for i in range(1, parts)]
    run(0)
    return [f.result() for f in futures]


def _timed(run, i: int) -> None:
    with stage("kernel: quantize + pack + stats"):
        run(i)



__all__ = ["kernel_cache_dir", "library", "supports_dtype", "quantize_pack", "unavailable_reason", "C_SOURCE"]
