"""The native quantizer's vector paths (C, part of :data:`embedq.quant.native_src.C_SOURCE`):
AVX-512 and AVX2 bodies for groups of a multiple of the vector width, with the scalar loops'
IEEE operations lane by lane, so the same bytes; groups of <= 128 elements in batches of 16
(AVX-512) or 8 (AVX2). Twins by ISA, as ggml's per-ISA code is."""

from __future__ import annotations

SIMD = r"""/* AVX-512: a group of a multiple of 16 elements in registers, 16 at a time (range, codes,
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
/* A group's range lane by lane: max |x| bits (*lo), or (sgn) min and max order keys (okey). */
static inline void vlanes(const void* p, int isbf, int64_t g, int sgn, __m512i* lo, __m512i* hi) {
    const __m512i abs = _mm512_set1_epi32(0x7fffffff);
    if (!sgn) {
        __m512i m = _mm512_setzero_si512();
        for (int64_t i = 0; i < g; i += 16) m = _mm512_max_epu32(m, _mm512_and_si512(vload(p, isbf, i), abs));
        *lo = m;
        return;
    }
    __m512i l = _mm512_set1_epi32(INT32_MAX), h = _mm512_set1_epi32(INT32_MIN);
    for (int64_t i = 0; i < g; i += 16) {
        __m512i v = vload(p, isbf, i);
        __m512i k = _mm512_xor_si512(v, _mm512_and_si512(_mm512_srai_epi32(v, 31), abs));  /* okey */
        l = _mm512_min_epi32(l, k);
        h = _mm512_max_epi32(h, k);
    }
    *lo = l; *hi = h;
}
static inline void vrange(const void* p, int isbf, int64_t g, int asym, float* a, float* b) {
    __m512i lo, hi;
    vlanes(p, isbf, g, asym, &lo, &hi);
    if (!asym) {
        __m512i m = lo;
        uint32_t r = _mm512_reduce_max_epu32(m);
        *a = r > 0x7f800000u ? NAN : bitsf(r);
        return;
    }
    keys_range(_mm512_reduce_min_epi32(lo), _mm512_reduce_max_epi32(hi), a, b);
}
static inline void vgroup_acc(const void* p, int isbf, int64_t g, float sc, float z, float qmin, float qmax,
                              float off, int bits, uint8_t* restrict o, int stats, __m512i* mx, __m512* vse, __m512* vsr) {
    const __m512 vsc = _mm512_set1_ps(sc), vz = _mm512_set1_ps(z), vmin = _mm512_set1_ps(qmin),
                 vmax = _mm512_set1_ps(qmax), voff = _mm512_set1_ps(off);
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), lo32 = _mm512_set1_epi64(0xffffffffLL);
    __m512 se = *vse, sr = *vsr;
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
    *vse = se; *vsr = sr;
}
static inline void vgroup(const void* p, int isbf, int64_t g, float sc, float z, float qmin, float qmax, float off,
                          int bits, uint8_t* restrict o, int stats, __m512i* mx, float* gse, float* gsr) {
    __m512 se = _mm512_setzero_ps(), sr = _mm512_setzero_ps();
    vgroup_acc(p, isbf, g, sc, z, qmin, qmax, off, bits, o, stats, mx, &se, &sr);
    if (stats) { *gse += _mm512_reduce_add_ps(se); *gsr += _mm512_reduce_add_ps(sr); }
}

/* QB groups at a time (small groups, where one group's reductions and scale were most of its
   time): the 16 ranges' horizontal reductions are one tree (lane j: group j), then each group's
   scale, codes and packing as above; the statistics' sums run over the batch (they reassociate). */
#define QB 16
#define QB_MAX_GROUP 128 /* <= 128 addends per lane in a batch's float sums */
static const int32_t tree_order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
#define TREE(NAME, OP)                                                                           \
static inline __m512i NAME(const __m512i* v) {  /* lane j: OP over the 16 lanes of v[j] */       \
    __m512i w[8], u[4];                                                                          \
    for (int i = 0; i < 8; i++)  /* chunks 0-1: v[2i] halved, 2-3: v[2i+1] */                    \
        w[i] = OP(_mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0x44),                            \
                  _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0xee));                           \
    for (int i = 0; i < 4; i++)  /* chunk j: group 4i+j, 4 lanes */                               \
        u[i] = OP(_mm512_shuffle_i32x4(w[2 * i], w[2 * i + 1], 0x88),                            \
                  _mm512_shuffle_i32x4(w[2 * i], w[2 * i + 1], 0xdd));                           \
    /* chunk j: lanes 0-1 group j (8+j), 2-3 group 4+j (12+j) */                                 \
    __m512 a = _mm512_castsi512_ps(OP(_mm512_unpacklo_epi64(u[0], u[1]), _mm512_unpackhi_epi64(u[0], u[1]))); \
    __m512 b = _mm512_castsi512_ps(OP(_mm512_unpacklo_epi64(u[2], u[3]), _mm512_unpackhi_epi64(u[2], u[3]))); \
    __m512i r = OP(_mm512_castps_si512(_mm512_shuffle_ps(a, b, 0x88)),                          \
                   _mm512_castps_si512(_mm512_shuffle_ps(a, b, 0xdd)));  /* lane 4j+t: group 4t+j */ \
    return _mm512_permutexvar_epi32(_mm512_loadu_si512(tree_order), r);                         \
}
TREE(tree_max_epu32, _mm512_max_epu32)
TREE(tree_min_epi32, _mm512_min_epi32)
TREE(tree_max_epi32, _mm512_max_epi32)
/* group_scale for 16 groups (lane j: group k0+j), the same IEEE operations lane by lane; float16
   scales (kind 2) take group_scale itself per lane. */
static inline void vscales(const float* a, const float* b, int asym, int smax, int bits, int kind, float qmin,
                           float qmax, void* s_out, int8_t* zp_out, int64_t k0, float* sc, float* z) {
    if (kind == 2) {
        for (int j = 0; j < QB; j++) { z[j] = 0.0f; sc[j] = group_scale(a[j], b[j], asym, smax, bits, kind, qmin, qmax, s_out, zp_out, k0 + j, z + j); }
        return;
    }
    const __m512 A = _mm512_loadu_ps(a), B = _mm512_loadu_ps(b), zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    __m512 in, lo = zero;
    if (!asym) {
        __m512 m = A;  /* smax: -a > b ? a : b */
        if (smax) m = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(A), sign)), B, _CMP_GT_OQ), B, A);
        __m512 scale = _mm512_div_ps(m, _mm512_set1_ps(smax ? qmin : qmax));
        in = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, zero, _CMP_NEQ_OQ), one, scale);  /* m > 0 || m < 0 */
    } else {
        lo = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(A, zero, _CMP_GT_OQ), A, zero);  /* a > 0 ? 0 : a */
        __m512 hi = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(B, zero, _CMP_LT_OQ), B, zero);
        __m512 span = _mm512_sub_ps(hi, lo);
        __m512 scale = _mm512_div_ps(span, _mm512_set1_ps((float)((1 << bits) - 1)));
        in = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(span, zero, _CMP_GT_OQ), one, scale);
    }
    __m512 f = in;
    if (kind == 0) {
        _mm512_storeu_ps((float*)s_out + k0, in);
    } else {  /* scale_up's bfloat16: round to nearest even (NaN: 0x7fc0), then up while |f| < |scale| */
        const __m512i w = _mm512_castps_si512(in);
        __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(w, _mm512_set1_epi32(0x7fff)),
                                                       _mm512_and_si512(_mm512_srli_epi32(w, 16), _mm512_set1_epi32(1))), 16);
        h = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(in, in, _CMP_UNORD_Q), h, _mm512_set1_epi32(0x7fc0));
        const __m512i mag = _mm512_set1_epi32(0x7fffffff);
        __m512 fa = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(h, 16), mag));
        __m512 sa = _mm512_castsi512_ps(_mm512_and_si512(w, mag));
        h = _mm512_mask_add_epi32(h, _mm512_cmp_ps_mask(fa, sa, _CMP_LT_OQ), h, _mm512_set1_epi32(1));
        h = _mm512_and_si512(h, _mm512_set1_epi32(0xffff));  /* (uint16_t) */
        _mm256_storeu_si256((__m256i*)((uint16_t*)s_out + k0), _mm512_cvtepi32_epi16(h));
        f = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    }
    _mm512_storeu_ps(sc, f);
    if (!asym) { _mm512_storeu_ps(z, zero); return; }
    __m512 zz = _mm512_roundscale_ps(_mm512_sub_ps(_mm512_set1_ps(qmin), _mm512_div_ps(lo, f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 vmin = _mm512_set1_ps(qmin), vmax = _mm512_set1_ps(qmax);
    __mmask16 under = _mm512_cmp_ps_mask(zz, vmin, _CMP_LT_OQ), over = _mm512_cmp_ps_mask(zz, vmax, _CMP_GT_OQ);
    zz = _mm512_mask_blend_ps(under, _mm512_mask_blend_ps(over, zz, vmax), vmin);
    _mm_storeu_si128((__m128i*)(zp_out + k0), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(zz)));
    _mm512_storeu_ps(z, zz);
}
static inline void vbatch(const void* p, int isbf, int64_t g, int asym, int smax, int bits, int kind,
                          float qmin, float qmax, float off, void* s_out, int8_t* zp_out, int64_t k0,
                          uint8_t* restrict o, int stats, __m512i* mx, double* se, double* sr) {
    const int64_t es = isbf ? 2 : 4;
    const int sgn = asym || smax;  /* min and max (signed-max: min (a) and max (b)) */
    __m512i v0[QB], v1[QB];
    float a[QB], b[QB];
    for (int j = 0; j < QB; j++) vlanes((const char*)p + j * g * es, isbf, g, sgn, v0 + j, v1 + j);
    if (!sgn) {
        uint32_t r[QB];
        _mm512_storeu_si512(r, tree_max_epu32(v0));
        for (int j = 0; j < QB; j++) { a[j] = r[j] > 0x7f800000u ? NAN : bitsf(r[j]); b[j] = 0.0f; }
    } else {
        int32_t lo[QB], hi[QB];
        _mm512_storeu_si512(lo, tree_min_epi32(v0));
        _mm512_storeu_si512(hi, tree_max_epi32(v1));
        for (int j = 0; j < QB; j++) keys_range(lo[j], hi[j], a + j, b + j);
    }
    float sc[QB], z[QB];
    vscales(a, b, asym, smax, bits, kind, qmin, qmax, s_out, zp_out, k0, sc, z);
    __m512 vse = _mm512_setzero_ps(), vsr = _mm512_setzero_ps();
    for (int j = 0; j < QB; j++)
        vgroup_acc((const char*)p + j * g * es, isbf, g, sc[j], z[j], qmin, qmax, off, bits, o + j * g * bits / 8,
                   stats, mx, &vse, &vsr);
    if (stats) { *se += _mm512_reduce_add_ps(vse); *sr += _mm512_reduce_add_ps(vsr); }
}
#define vbatch_ vbatch
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
/* A group's range lane by lane: max |x| bits (*lo), or (sgn) min and max order keys (okey). */
static inline void vlanes(const void* p, int isbf, int64_t g, int sgn, __m256i* lo, __m256i* hi) {
    const __m256i abs = _mm256_set1_epi32(0x7fffffff);
    if (!sgn) {
        __m256i m = _mm256_setzero_si256();
        for (int64_t i = 0; i < g; i += 8) m = _mm256_max_epu32(m, _mm256_and_si256(vload(p, isbf, i), abs));
        *lo = m;
        return;
    }
    __m256i l = _mm256_set1_epi32(INT32_MAX), h = _mm256_set1_epi32(INT32_MIN);
    for (int64_t i = 0; i < g; i += 8) {
        __m256i v = vload(p, isbf, i);
        __m256i k = _mm256_xor_si256(v, _mm256_and_si256(_mm256_srai_epi32(v, 31), abs));  /* okey */
        l = _mm256_min_epi32(l, k);
        h = _mm256_max_epi32(h, k);
    }
    *lo = l; *hi = h;
}
static inline void vrange(const void* p, int isbf, int64_t g, int asym, float* a, float* b) {
    __m256i lo, hi;
    vlanes(p, isbf, g, asym, &lo, &hi);
    if (!asym) {
        __m256i m = lo;
        uint32_t r = (uint32_t)_mm_cvtsi128_si32(fold(m, 0));
        *a = r > 0x7f800000u ? NAN : bitsf(r);
        return;
    }
    keys_range(_mm_cvtsi128_si32(fold(lo, 1)), _mm_cvtsi128_si32(fold(hi, 2)), a, b);
}
static inline void vgroup_acc(const void* p, int isbf, int64_t g, float sc, float z, float qmin, float qmax,
                              float off, int bits, uint8_t* restrict o, int stats, __m256i* mx, __m256* vse, __m256* vsr) {
    const __m256 vsc = _mm256_set1_ps(sc), vz = _mm256_set1_ps(z), vmin = _mm256_set1_ps(qmin),
                 vmax = _mm256_set1_ps(qmax), voff = _mm256_set1_ps(off);
    const __m256i abs = _mm256_set1_epi32(0x7fffffff), low = _mm256_set1_epi64x(0xff);
    /* byte 0 and 8 of each 128-bit lane to its bytes 0 and 1 */
    const __m256i pick = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256 se = *vse, sr = *vsr;
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
    *vse = se; *vsr = sr;
}
static inline void vgroup(const void* p, int isbf, int64_t g, float sc, float z, float qmin, float qmax, float off,
                          int bits, uint8_t* restrict o, int stats, __m256i* mx, float* gse, float* gsr) {
    __m256 se = _mm256_setzero_ps(), sr = _mm256_setzero_ps();
    vgroup_acc(p, isbf, g, sc, z, qmin, qmax, off, bits, o, stats, mx, &se, &sr);
    if (stats) { *gse += hsum(se); *gsr += hsum(sr); }
}

/* 8 groups at a time, as the AVX-512 batches (one tree for their ranges, their scales in one vector). */
#define QB 8
#define QB_MAX_GROUP 128 /* <= 128 addends per lane in a batch's float sums */
static const int32_t tree_order[8] = {0, 4, 1, 5, 2, 6, 3, 7};
#define TREE(NAME, OP)                                                                           \
static inline __m256i NAME(const __m256i* v) {  /* lane j: OP over the 8 lanes of v[j] */        \
    __m256i w[4], u[2];                                                                          \
    for (int i = 0; i < 4; i++)  /* low half: v[2i] halved, high half: v[2i+1] */                \
        w[i] = OP(_mm256_permute2x128_si256(v[2 * i], v[2 * i + 1], 0x20),                       \
                  _mm256_permute2x128_si256(v[2 * i], v[2 * i + 1], 0x31));                      \
    for (int i = 0; i < 2; i++)  /* half h: lanes 0-1 group 4i+h, 2-3 group 4i+2+h */            \
        u[i] = OP(_mm256_unpacklo_epi64(w[2 * i], w[2 * i + 1]), _mm256_unpackhi_epi64(w[2 * i], w[2 * i + 1])); \
    __m256 a = _mm256_castsi256_ps(u[0]), b = _mm256_castsi256_ps(u[1]);                         \
    __m256i r = OP(_mm256_castps_si256(_mm256_shuffle_ps(a, b, 0x88)),                          \
                   _mm256_castps_si256(_mm256_shuffle_ps(a, b, 0xdd)));  /* lane 4h+t: group 2t+h */ \
    return _mm256_permutevar8x32_epi32(r, _mm256_loadu_si256((const __m256i*)tree_order));       \
}
TREE(tree_max_epu32, _mm256_max_epu32)
TREE(tree_min_epi32, _mm256_min_epi32)
TREE(tree_max_epi32, _mm256_max_epi32)
/* group_scale for 8 groups (lane j: group k0+j); float16 scales per lane. */
static inline void vscales(const float* a, const float* b, int asym, int smax, int bits, int kind, float qmin,
                           float qmax, void* s_out, int8_t* zp_out, int64_t k0, float* sc, float* z) {
    if (kind == 2) {
        for (int j = 0; j < QB; j++) { z[j] = 0.0f; sc[j] = group_scale(a[j], b[j], asym, smax, bits, kind, qmin, qmax, s_out, zp_out, k0 + j, z + j); }
        return;
    }
    const __m256 A = _mm256_loadu_ps(a), B = _mm256_loadu_ps(b), zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    __m256 in, lo = zero;
    if (!asym) {
        __m256 m = A;  /* smax: -a > b ? a : b */
        if (smax) m = _mm256_blendv_ps(B, A, _mm256_cmp_ps(_mm256_xor_ps(A, _mm256_set1_ps(-0.0f)), B, _CMP_GT_OQ));
        __m256 scale = _mm256_div_ps(m, _mm256_set1_ps(smax ? qmin : qmax));
        in = _mm256_blendv_ps(one, scale, _mm256_cmp_ps(m, zero, _CMP_NEQ_OQ));  /* m > 0 || m < 0 */
    } else {
        lo = _mm256_blendv_ps(A, zero, _mm256_cmp_ps(A, zero, _CMP_GT_OQ));  /* a > 0 ? 0 : a */
        __m256 hi = _mm256_blendv_ps(B, zero, _mm256_cmp_ps(B, zero, _CMP_LT_OQ));
        __m256 span = _mm256_sub_ps(hi, lo);
        __m256 scale = _mm256_div_ps(span, _mm256_set1_ps((float)((1 << bits) - 1)));
        in = _mm256_blendv_ps(one, scale, _mm256_cmp_ps(span, zero, _CMP_GT_OQ));
    }
    __m256 f = in;
    if (kind == 0) {
        _mm256_storeu_ps((float*)s_out + k0, in);
    } else {  /* scale_up's bfloat16: round to nearest even (NaN: 0x7fc0), then up while |f| < |scale| */
        const __m256i w = _mm256_castps_si256(in), mag = _mm256_set1_epi32(0x7fffffff);
        __m256i h = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(w, _mm256_set1_epi32(0x7fff)),
                                                       _mm256_and_si256(_mm256_srli_epi32(w, 16), _mm256_set1_epi32(1))), 16);
        h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(in, in, _CMP_UNORD_Q)));
        __m256 fa = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(h, 16), mag));
        __m256 sa = _mm256_castsi256_ps(_mm256_and_si256(w, mag));
        h = _mm256_sub_epi32(h, _mm256_castps_si256(_mm256_cmp_ps(fa, sa, _CMP_LT_OQ)));  /* a true compare is -1 */
        h = _mm256_and_si256(h, _mm256_set1_epi32(0xffff));  /* (uint16_t) */
        _mm_storeu_si128((__m128i*)((uint16_t*)s_out + k0),
                         _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
        f = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    }
    _mm256_storeu_ps(sc, f);
    if (!asym) { _mm256_storeu_ps(z, zero); return; }
    const __m256 vmin = _mm256_set1_ps(qmin), vmax = _mm256_set1_ps(qmax);
    __m256 zz = _mm256_round_ps(_mm256_sub_ps(vmin, _mm256_div_ps(lo, f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 under = _mm256_cmp_ps(zz, vmin, _CMP_LT_OQ), over = _mm256_cmp_ps(zz, vmax, _CMP_GT_OQ);
    zz = _mm256_blendv_ps(_mm256_blendv_ps(zz, vmax, over), vmin, under);
    /* int8 zero points: the low byte of each (a NaN's 0x80000000 -> 0, as the scalar cast) */
    __m256i zi = _mm256_shuffle_epi8(_mm256_cvttps_epi32(zz),
                                     _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                      0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    _mm_storel_epi64((__m128i*)(zp_out + k0), _mm_unpacklo_epi32(_mm256_castsi256_si128(zi), _mm256_extracti128_si256(zi, 1)));
    _mm256_storeu_ps(z, zz);
}
static inline void vbatch(const void* p, int isbf, int64_t g, int asym, int smax, int bits, int kind,
                          float qmin, float qmax, float off, void* s_out, int8_t* zp_out, int64_t k0,
                          uint8_t* restrict o, int stats, __m256i* mx, double* se, double* sr) {
    const int64_t es = isbf ? 2 : 4;
    const int sgn = asym || smax;  /* min and max (signed-max: min (a) and max (b)) */
    __m256i v0[QB], v1[QB];
    float a[QB], b[QB];
    for (int j = 0; j < QB; j++) vlanes((const char*)p + j * g * es, isbf, g, sgn, v0 + j, v1 + j);
    if (!sgn) {
        uint32_t r[QB];
        _mm256_storeu_si256((__m256i*)r, tree_max_epu32(v0));
        for (int j = 0; j < QB; j++) { a[j] = r[j] > 0x7f800000u ? NAN : bitsf(r[j]); b[j] = 0.0f; }
    } else {
        int32_t lo[QB], hi[QB];
        _mm256_storeu_si256((__m256i*)lo, tree_min_epi32(v0));
        _mm256_storeu_si256((__m256i*)hi, tree_max_epi32(v1));
        for (int j = 0; j < QB; j++) keys_range(lo[j], hi[j], a + j, b + j);
    }
    float sc[QB], z[QB];
    vscales(a, b, asym, smax, bits, kind, qmin, qmax, s_out, zp_out, k0, sc, z);
    __m256 vse = _mm256_setzero_ps(), vsr = _mm256_setzero_ps();
    for (int j = 0; j < QB; j++)
        vgroup_acc((const char*)p + j * g * es, isbf, g, sc[j], z[j], qmin, qmax, off, bits, o + j * g * bits / 8,
                   stats, mx, &vse, &vsr);
    if (stats) { *se += hsum(vse); *sr += hsum(vsr); }
}
#define vbatch_ vbatch
#define VMX_DECL __m256i vmx = _mm256_setzero_si256()
#define VMX_FOLD do { uint32_t v_ = (uint32_t)_mm_cvtsi128_si32(fold(vmx, 0)); mx = v_ > mx ? v_ : mx; } while (0)
#define vrange_ vrange
#define vgroup_ vgroup
"""

__all__ = ["SIMD"]
