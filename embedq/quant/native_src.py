"""The C source of the native quantizer (:mod:`embedq.quant.native`): the scalar reference
loops, each group's scale, and the group loop; the vector paths are in :mod:`.native_simd`."""

from __future__ import annotations

from embedq.format.scheme_units import UNITS
from embedq.quant.native_simd import SIMD

# The C twin of the units' rules (tested against them: tests/test_scheme_units.py): which bit
# widths take signed-max symmetric scales, as a bit mask. The packing loop handles one or
# two codes a byte (a family of fewer bits needs its loop here).
_RULES = f"#define SIGNED_MAX_BITS {sum(1 << b for b, u in UNITS.items() if u.signed_max)}u\n"

_SCALAR = r"""#include <stdint.h>
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

/* Group k's scale (stored in s_out, in the storage dtype; returned as float) and, asym, its zero
   point (zp_out[k], *z) from its range: a = max|x| (sym), or min (a) and max (b). */
static inline float group_scale(float a, float b, int asym, int smax, int bits, int kind, float qmin, float qmax,
                                void* s_out, int8_t* zp_out, int64_t k, float* z) {
    if (!asym) {
        /* absmax / qmax, or signed-max: the signed extreme / qmin (IntUnit.signed_max) */
        float m = smax ? (-a > b ? a : b) : a;
        float scale = smax ? m / qmin : m / qmax;
        return scale_up(m > 0 || m < 0 ? scale : 1.0f, kind, s_out, k);
    }
    float lo = a > 0 ? 0.0f : a, hi = b < 0 ? 0.0f : b; /* clamp; NaN stays NaN */
    float span = hi - lo;
    float scale = span / (float)((1 << bits) - 1);
    float sc = scale_up(span > 0 ? scale : 1.0f, kind, s_out, k);
    float zz = rintf(qmin - lo / sc);
    zz = zz < qmin ? qmin : (zz > qmax ? qmax : zz);
    zp_out[k] = (int8_t)(int32_t)zz;
    *z = zz;
    return sc;
}

"""

_LOOP = r"""#else
#define QVEC 0
#define QB 0
#define QB_MAX_GROUP 0
#define vbatch_(...) ((void)0)
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
        if (QB && vec && g <= QB_MAX_GROUP && ngroups - k >= QB) {                           \
            vbatch_(p, sizeof(T) == 2, g, asym, smax, bits, kind, qmin, qmax, off, s_out, zp_out, \
                    k, out + k * g * bits / 8, stats, &vmx, &se, &sr);                         \
            k += QB - 1;                                                                     \
            continue;                                                                        \
        }                                                                                    \
        float a, b, sc, z = 0.0f;                                                            \
        if (vec) vrange_(p, sizeof(T) == 2, g, asym || smax, &a, &b);                       \
        else RANGE(p, 1, g, asym || smax, &a, &b); /* signed-max: min (a) and max (b) */    \
        sc = group_scale(a, b, asym, smax, bits, kind, qmin, qmax, s_out, zp_out, k, &z);    \
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

C_SOURCE = _RULES + _SCALAR + SIMD + _LOOP

__all__ = ["C_SOURCE"]
