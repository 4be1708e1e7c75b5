/* embedq's fp32-FMA head kernel over the native blocked layout (see native_head.py).

   One source, several builds (native_f32.py; built with -mavxvnni or -mavx512vnni too, the
   M == 1 planes sum in vpdpwssd, and with -mavx512vnni int8 activations in vpdpbusd):
     avx512f   -O3 -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c  (Skylake-SP .. Ice
               Lake, Zen 4/5: the AVX2 code with a 16-wide micro-kernel, #if EQ_AVX512)
     avx2      -O3 -mavx2 -mfma -mf16c  (x86-64-v3: the same code on every such CPU)
     portable  -O3                      (plain C the compiler vectorizes: SSE2, NEON, ...)
   The AVX2 build uses the intrinsics below (#if EQ_AVX2); the portable one the plain loops.
   The AVX-512 micro-kernel does, lane for lane, the AVX2 one's operations (one zmm is the
   two ymm halves of a 16-row tile; same FMA order, same accumulator split), so its results
   are bit-identical to the AVX2 build's. -DEQ_SIMDE builds it on an AVX2 CPU over SIMDe's
   AVX-512 emulation (tests: the same source checked where no AVX-512 CPU is at hand).

   Layout (the ONE prepared table, shared with the gather and the AVX512-BF16 kernel): rows in
   blocks of 16 (the last padded with zero scales), columns in pairs.
     int8:  codes [NB][K/2][16][2] signed          4-bit: bytes [NB][K/2][16], low nibble =
     column 2p, high = 2p+1, offset binary u = q + 8.   scales [NB][G][16] (kind 0 f32,
     1 bf16, 2 f16); zero points [NB][G][16] int8 or NULL.

   Arithmetic: each weight is decoded once per call to float32 as ((q - z) * s), the very
   float32 operations of the reference decoder (embedq/format/codec.py: q - z is an exact
   integer, one rounding of the product), so the decoded weights ARE the reference's; the
   dot with float32 activations (converted by the caller, exactly, from bf16/f16) then
   differs from F.linear only in summation order.

   M <= 4 (4-bit) / 8 (int8) (AVX2): decoded in registers, scale after each group's dot (direct8/direct4), two
   rows at a time (M > 2 in passes over L2-sized chunks of blocks: run_direct);
   M == 1: integer dot products over exact int16 activation planes (eq_q4planes.h, eq_i8planes.h).
   Larger M: a super-block of SB x 16 rows x KC columns is decoded once into a float32 scratch
   (4 x 16 x 64 x 4 B = 16 KiB: stays in L1 between the decode and the tiles that read it; KC
   = 256 (64 KiB, L2) took 1.02-1.11x the time of KC = 64 for the AVX2 build and 1.08-1.22x
   for the AVX-512F one, KC = 32 1.0-1.07x: Emerald Rapids, Gemma-size table, M = 5-256); every
   activation row runs over it in tiles of MR = 6 rows x 16 table rows (12 accumulators +
   2 weights + 1 broadcast = 15 of 16 ymm: the classic sgemm microkernel; the AVX-512 build
   runs a whole super-block per tile, 6 x 64: 24 of 32 zmm, eq_f32micro.h). Each weight byte
   is read from memory once per call at every M. */

#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include "eq_convert.h"
#include "eq_parallel.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EQ_AVX2 1
#else
#define EQ_AVX2 0
#endif
/* -DEQ_Q4D (the native_q4d builds, layouts.NativeQ4D): 4-bit codes in the 8-column dword
   layout, [NB][K/8][16] uint32 (column 8ch + c of a row at bits 4c of its dword: the stored
   int32 word). The int8 layout is the same in every build. */
#ifdef EQ_Q4D
#if !EQ_AVX2
#error "EQ_Q4D: the dword 4-bit layout has AVX2 kernels only"
#endif
#define EQ_Q4DW 1
#else
#define EQ_Q4DW 0
#endif
#if EQ_AVX2 && !defined(EQ_NO_Q4PLANES)  /* -DEQ_NO_Q4PLANES: 4-bit M == 1 on the float path (A/B) */
#define EQ_Q4PLANES 1
#else
#define EQ_Q4PLANES 0
#endif
/* -DEQ_NO_I8PLANES: int8 M == 1 on the float path (A/B) */
#if EQ_Q4PLANES && !defined(EQ_NO_I8PLANES)
#define I8PLANES i8planes_build
#else
#define I8PLANES(x, K, g, P) 0
#endif
#if EQ_AVX2 && defined(EQ_SIMDE)  /* tests only: AVX-512 intrinsics emulated on AVX2 */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define EQ_AVX512 1
#if defined(EQ_SIMDE_VNNI)
/* The conversions the AVX512-VNNI int8-activation body uses that SIMDe does not alias, as two
   256-bit halves (the same values): with them the -DEQ_SIMDE -DEQ_SIMDE_VNNI build compiles
   that body too, so CPUs without AVX512-VNNI test its source (tests/perf/test_int8_activations.py). */
static inline __m512i eq_s_join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
static inline __m512 eq_s_joinps(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
static inline __m512i eq_s_cvtepu8_epi16(__m256i a) {
    return eq_s_join(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(a)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(a, 1)));
}
static inline __m512i eq_s_cvtepu16_epi32(__m256i a) {
    return eq_s_join(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)));
}
static inline __m512i eq_s_cvtepi8_epi32(__m128i a) {
    return eq_s_join(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
}
static inline __m512 eq_s_cvtepi32_ps(__m512i a) {
    return eq_s_joinps(_mm256_cvtepi32_ps(_mm512_castsi512_si256(a)), _mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(a, 1)));
}
static inline __m512 eq_s_cvtph_ps(__m256i h) {
    return eq_s_joinps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}
#define _mm512_cvtepu8_epi16 eq_s_cvtepu8_epi16
#define _mm512_cvtepu16_epi32 eq_s_cvtepu16_epi32
#define _mm512_cvtepi8_epi32 eq_s_cvtepi8_epi32
#define _mm512_cvtepi32_ps eq_s_cvtepi32_ps
#define _mm512_cvtph_ps eq_s_cvtph_ps
#endif
#elif EQ_AVX2 && defined(__AVX512F__)
#define EQ_AVX512 1
#else
#define EQ_AVX512 0
#endif
/* the avx512vnni build: vpdpbusd (and, tests only, its source over SIMDe: -DEQ_SIMDE -DEQ_SIMDE_VNNI) */
#if EQ_AVX512 && ((defined(__AVX512VNNI__) && !defined(EQ_SIMDE)) || (defined(EQ_SIMDE) && defined(EQ_SIMDE_VNNI)))
#define EQ_VNNI 1
#else
#define EQ_VNNI 0
#endif

enum { RB = 16, SB = 4, KC = 64, MR = 6 };
/* The direct path's largest M (run_direct; passes of two rows from L2 against the tiles, Xeon,
   Gemma head from memory, AVX2 / AVX-512F builds: int8 g64 M = 6 17.9 / 17.5 vs 21.4 / 20.4 ms,
   M = 8 22.8 / 22.6 vs 27.2 / 26.5, M = 12 equal or slower; 4-bit M = 5-6 +-5 % in the AVX2 build,
   ~20 % slower in the AVX-512F one). */
static inline int64_t pass_m(int bits) { return bits == 8 ? 8 : 4; }

typedef struct {
    const uint8_t* w; const void* s; const int8_t* z; const float* x; const float* xs;
    void* out; int64_t ldo, M, K, G, g, V, nb0, nb1; int bits, skind, okind;
    const struct q4planes* planes; /* M == 1: integer planes (eq_q4planes.h, eq_i8planes.h) or NULL */
} job_t;

static inline float scale_at(const void* s, int kind, int64_t i) {
    if (kind == 0) return ((const float*)s)[i];
    uint16_t h = ((const uint16_t*)s)[i];
    return kind == 1 ? bf16_to_f32(h) : f16_to_f32(h);
}

/* The 16 rows' scale and offset of group gi of block nb; 4-bit folds the +8 of offset
   binary into the offset: q - z = u - (8 + z), exact. */
static inline void group_params(const job_t* j, int64_t nb, int64_t gi, float* sc, float* zc) {
    const int64_t i0 = (nb * j->G + gi) * RB;
    const float off = j->bits == 4 ? 8.0f : 0.0f;
    for (int r = 0; r < RB; r++) {
        sc[r] = scale_at(j->s, j->skind, i0 + r);
        zc[r] = off + (j->z ? (float)j->z[i0 + r] : 0.0f);
    }
}

/* Decode column pairs [p0, p1) of block nb into dst [2 (p1 - p0)][16] float32. */
static void decode(const job_t* j, int64_t nb, int64_t p0, int64_t p1, float* restrict dst) {
    const int64_t KP = j->K / 2, PG = j->g / 2;
    float sc[RB], zc[RB];
    for (int64_t p = p0; p < p1;) {
        const int64_t gi = p / PG, pe = (gi + 1) * PG < p1 ? (gi + 1) * PG : p1;
        group_params(j, nb, gi, sc, zc);
#if EQ_AVX512 && !EQ_Q4DW && !defined(EQ_SIMDE)
        /* 16 rows per zmm: one convert, subtract, multiply and store per column where the ymm
           code needs two (the same float32 operations per lane: the same bits). The AVX-512
           builds spent ~40 % of a 4-bit M = 16 call here (Xeon, AVX-512F build, synthetic
           Gemma head: 14.6 of 34.5 ms; now 0.91x the call at M = 16, 0.95x at 64). Not in the
           SIMDe build (SIMDe lacks these conversions): tests/perf/test_cpu_variants.py compares
           the real AVX-512F build with the AVX2 one on AVX-512 CPUs. */
        const __m512 s16 = _mm512_loadu_ps(sc), z16 = _mm512_loadu_ps(zc);
#define DEC16(c, off) _mm512_storeu_ps(d + (off), _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(c), z16), s16))
        if (j->bits == 8) {
            const __m256i sh = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
            for (; p < pe; p++) {
                /* [r0..7 c0 | r0..7 c1 || r8..15 c0 | r8..15 c1] -> [c0 r0..15 | c1 r0..15] */
                const __m256i v = _mm256_permute4x64_epi64(
                    _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i*)(j->w + (nb * KP + p) * 32)), sh), 0xD8);
                float* d = dst + (p - p0) * 32;
                DEC16(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)), 0);
                DEC16(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)), 16);
            }
        } else {
            const __m128i m4 = _mm_set1_epi8(0x0f);
            for (; p < pe; p++) {
                const __m128i b = _mm_loadu_si128((const __m128i*)(j->w + (nb * KP + p) * 16));
                float* d = dst + (p - p0) * 32;
                DEC16(_mm512_cvtepu8_epi32(_mm_and_si128(b, m4)), 0);
                DEC16(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m4)), 16);
            }
        }
#undef DEC16
#elif EQ_AVX2
        const __m256 s0 = _mm256_loadu_ps(sc), s1 = _mm256_loadu_ps(sc + 8);
        const __m256 z0 = _mm256_loadu_ps(zc), z1 = _mm256_loadu_ps(zc + 8);
        if (j->bits == 8) {
            /* per 128-bit lane: [r0c0 r0c1 .. r7c0 r7c1] -> [r0..r7 c0 | r0..r7 c1] */
            const __m256i sh = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
            for (; p < pe; p++) {
                __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i*)(j->w + (nb * KP + p) * 32)), sh);
                __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
                float* d = dst + (p - p0) * 32;
                _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), z0), s0));
                _mm256_storeu_ps(d + 8, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), z1), s1));
                _mm256_storeu_ps(d + 16, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), z0), s0));
                _mm256_storeu_ps(d + 24, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), z1), s1));
            }
        } else if (EQ_Q4DW) {
            /* whole 8-column chunks (head_f32 takes K and g multiples of 8 for this layout),
               turned into the pair layout's 16-byte pairs by 6 shuffles (port 5) and decoded as
               those: shifts per column would load ports 0/1, which the convert, subtract and
               multiply already fill (Xeon, AVX2 build, M = 8: 1.08-1.11x the pair layout's
               time with shifts) */
            const __m256i T = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                               0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
            const __m256i I = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            const __m128i m4 = _mm_set1_epi8(0x0f);
            for (; p < pe; p += 4) {
                const uint32_t* dw = (const uint32_t*)j->w + (nb * (j->K / 8) + p / 4) * RB;
                const __m256i u = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i*)dw), T), I);
                const __m256i v = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i*)(dw + 8)), T), I);
                const __m256i e = _mm256_unpacklo_epi64(u, v), o = _mm256_unpackhi_epi64(u, v); /* pairs 0, 2 | 1, 3 */
                const __m128i pr[4] = {_mm256_castsi256_si128(e), _mm256_castsi256_si128(o),
                                       _mm256_extracti128_si256(e, 1), _mm256_extracti128_si256(o, 1)};
                for (int q = 0; q < 4; q++) {
                    __m128i lo = _mm_and_si128(pr[q], m4), hi = _mm_and_si128(_mm_srli_epi16(pr[q], 4), m4);
                    float* d = dst + (p + q - p0) * 32;
                    _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), z0), s0));
                    _mm256_storeu_ps(d + 8, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), z1), s1));
                    _mm256_storeu_ps(d + 16, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), z0), s0));
                    _mm256_storeu_ps(d + 24, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), z1), s1));
                }
            }
        } else {
            const __m128i m4 = _mm_set1_epi8(0x0f);
            for (; p < pe; p++) {
                __m128i b = _mm_loadu_si128((const __m128i*)(j->w + (nb * KP + p) * 16));
                __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
                float* d = dst + (p - p0) * 32;
                _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), z0), s0));
                _mm256_storeu_ps(d + 8, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), z1), s1));
                _mm256_storeu_ps(d + 16, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), z0), s0));
                _mm256_storeu_ps(d + 24, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), z1), s1));
            }
        }
#else
        for (; p < pe; p++) {
            float* restrict d = dst + (p - p0) * 32;
            if (j->bits == 8) {
                const int8_t* q = (const int8_t*)j->w + (nb * KP + p) * 32;
                for (int r = 0; r < RB; r++) {
                    d[r] = ((float)q[2 * r] - zc[r]) * sc[r];
                    d[RB + r] = ((float)q[2 * r + 1] - zc[r]) * sc[r];
                }
            } else {
                const uint8_t* b = j->w + (nb * KP + p) * 16;
                for (int r = 0; r < RB; r++) {
                    d[r] = ((float)(b[r] & 15) - zc[r]) * sc[r];
                    d[RB + r] = ((float)(b[r] >> 4) - zc[r]) * sc[r];
                }
            }
        }
#endif
    }
}

#include "eq_f32micro.h"

/* nr (<= 16) float32 results -> out in its dtype (0 f32, 1 bf16, 2 f16). */
static void store_row(const float* a, void* out, int okind, int64_t i, int nr) {
#if EQ_AVX2
    if (nr == RB && okind != 0) {
        __m256 v0 = _mm256_loadu_ps(a), v1 = _mm256_loadu_ps(a + 8);
        uint16_t* o = (uint16_t*)out + i;
        if (okind == 2) {
            _mm_storeu_si128((__m128i*)o, _mm256_cvtps_ph(v0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            _mm_storeu_si128((__m128i*)(o + 8), _mm256_cvtps_ph(v1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            return;
        }
        /* bf16: round to nearest even on the bits; NaN stays a quiet NaN */
        for (int h = 0; h < 2; h++) {
            __m256 v = h ? v1 : v0;
            __m256i u = _mm256_castps_si256(v);
            __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                         _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
            __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            r = _mm256_srli_epi32(_mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan), 16);
            _mm_storeu_si128((__m128i*)(o + 8 * h),
                             _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
        }
        return;
    }
#endif
    if (okind == 0) { memcpy((float*)out + i, a, nr * sizeof(float)); return; }
    uint16_t* o = (uint16_t*)out + i;
    for (int r = 0; r < nr; r++) o[r] = okind == 1 ? f32_to_bf16(a[r]) : f32_to_f16(a[r]);
}

#if EQ_AVX2
#include "eq_f32direct.h"
#include "eq_q4planes.h"
#include "eq_i8planes.h"

/* Blocks [b0, b1) for the (one or two) rows of j (the caller's slice of x, xs and out). */
static void direct_blocks(const job_t* j, int64_t b0, int64_t b1) {
    float o[DIRECT_M * RB];
    for (int64_t nb = b0; nb < b1; nb++) {
        if (j->planes && j->bits == 8) direct8i(j, j->planes, nb, j->xs, o);
        else if (j->planes) direct4i(j, j->planes, nb, j->xs, o);
        else if (j->bits == 8) { if (j->M == 1) direct8(1, j, nb, j->xs, o); else direct8(2, j, nb, j->xs, o); }
        else { if (j->M == 1) direct4(1, j, nb, j->xs, o); else direct4(2, j, nb, j->xs, o); }
        const int64_t r0 = nb * RB;
        const int nr = j->V - r0 < RB ? (int)(j->V - r0) : RB;
        for (int64_t m = 0; m < j->M; m++) store_row(o + m * RB, j->out, j->okind, m * j->ldo + r0, nr);
    }
}

/* M <= pass_m(bits): the rows in passes of two over chunks of blocks that stay in L2 (~256 KiB of
   codes), so each block is read from memory once and the later passes find it in L2. The
   tiles below decode into a float32 scratch and were bound by that at M = 3-4 (Xeon, AVX-512F
   build, Gemma head from memory: int8 M = 3 20.3 ms against 6.9 at M = 2). */
static void run_direct(const job_t* j) {
    const int64_t bpb = j->bits == 8 ? RB * j->K : RB * j->K / 2; /* code bytes per block */
    const int64_t ch = (256 << 10) / bpb > 1 ? (256 << 10) / bpb : 1;
    const size_t es = j->okind == 0 ? 4 : 2;
    for (int64_t c0 = j->nb0; c0 < j->nb1; c0 += ch) {
        const int64_t c1 = c0 + ch < j->nb1 ? c0 + ch : j->nb1;
        for (int64_t m0 = 0; m0 < j->M; m0 += DIRECT_M) {
            job_t p = *j;
            p.M = j->M - m0 < DIRECT_M ? j->M - m0 : DIRECT_M;
            p.x = j->x + m0 * j->K;
            p.xs = j->xs ? j->xs + m0 * j->G : NULL;
            p.out = (char*)j->out + (size_t)(m0 * j->ldo) * es;
            direct_blocks(&p, c0, c1);
        }
    }
}
#endif

static void* run(void* arg) {
    job_t* j = (job_t*)arg;
    const int64_t M = j->M, K = j->K, LDA = SB * RB;
#if EQ_AVX2
    if (M <= pass_m(j->bits)) { run_direct(j); return NULL; }
#endif
    float* scratch = malloc(sizeof(float) * SB * KC * RB);
    float* acc = malloc(sizeof(float) * M * LDA);
    if (!scratch || !acc) { free(scratch); free(acc); return (void*)1; }
    for (int64_t s0 = j->nb0; s0 < j->nb1; s0 += SB) {
        const int nbk = j->nb1 - s0 < SB ? (int)(j->nb1 - s0) : SB;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = K - k0 < KC ? K - k0 : KC;  /* even: K is */
            for (int b = 0; b < nbk; b++) decode(j, s0 + b, k0 / 2, (k0 + kc) / 2, scratch + b * KC * RB);
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int nm = M - m0 < MR ? (int)(M - m0) : MR;
                int b = 0;
#if EQ_AVX512
                if (nbk == SB) { micro4_any(nm, scratch, kc, j->x + m0 * K + k0, K, acc + m0 * LDA, LDA, k0 == 0); b = SB; }
#endif
                for (; b < nbk; b++)
                    micro_any(nm, scratch + b * KC * RB, kc, j->x + m0 * K + k0, K, acc + m0 * LDA + b * RB,
                              LDA, k0 == 0);
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int b = 0; b < nbk; b++) {
                const int64_t r0 = (s0 + b) * RB;
                const int nr = j->V - r0 < RB ? (int)(j->V - r0) : RB;
                store_row(acc + m * LDA + b * RB, j->out, j->okind, m * j->ldo + r0, nr);
            }
    }
    free(scratch); free(acc);
    return NULL;
}

/* logits[M, V] (dtype okind, row stride ldo) = x[M, K] (dtype xkind: 0 float32, 1 bf16, 2 float16;
   converted once, exactly) @ dequant(W)^T. 0 on success. */
int head_f32(const uint8_t* w, const void* s, int skind, const int8_t* z, int bits, int64_t V, int64_t K,
             int64_t g, const void* x0, int xkind, int64_t M, void* out, int okind, int64_t ldo, int nthreads) {
    const int64_t NB = (V + RB - 1) / RB;
    if (K % 2 || g % 2 || K % g || (EQ_Q4DW && bits == 4 && g % 8)) return 2;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > (NB + SB - 1) / SB) nthreads = (int)((NB + SB - 1) / SB);
    if (nthreads > EQ_MAX_THREADS) nthreads = EQ_MAX_THREADS;
    float* xbuf;
    const float* x = eq_x_f32(x0, xkind, M * K, &xbuf);
    if (!x) return 1;
    float* xs = NULL;  /* per-group sums of x: the zero-point term of the direct path */
    if (z && M <= pass_m(bits)) {
        xs = malloc(sizeof(float) * M * (K / g));
        if (!xs) { free(xbuf); return 1; }
        eq_group_sums(x, 0, M, K, g, xs);
    }
#if EQ_Q4PLANES
    q4planes_t P;
    const q4planes_t* planes = M == 1 && (bits == 4 ? q4planes_build(x, K, g, &P) : I8PLANES(x, K, g, &P)) ? &P : NULL;
#else
    const struct q4planes* planes = NULL;
#endif
    job_t jobs[EQ_MAX_THREADS];
    for (int t = 0; t < nthreads; t++) {
        /* whole super-blocks per thread */
        int64_t nsb = (NB + SB - 1) / SB, a = nsb * t / nthreads * SB, b = nsb * (t + 1) / nthreads * SB;
        job_t jj = {w, s, z, x, xs, out, ldo, M, K, K / g, g, V, a, b < NB ? b : NB, bits, skind, okind, planes};
        jobs[t] = jj;
    }
    int rc = eq_fanout(run, jobs, sizeof(job_t), nthreads);
#if EQ_Q4PLANES
    if (planes) q4planes_free(&P);
#endif
    free(xs);
    free(xbuf);
    return rc;
}

/* Activation planes of an M == 1 call (tests, benchmarks): their number, or 0 when the call
   takes the float path (eq_q4planes.h, eq_i8planes.h). */
int head_f32_planes(const float* x, int64_t K, int64_t g, int bits) {
#if EQ_Q4PLANES
    q4planes_t P;
    if (!(bits == 4 ? q4planes_build(x, K, g, &P) : I8PLANES(x, K, g, &P))) return 0;
    const int n = P.off[K / P.chunk];
    q4planes_free(&P);
    return n;
#else
    (void)x; (void)K; (void)g; (void)bits;
    return 0;
#endif
}

typedef struct {
    const uint8_t* w; const void* s; const int8_t* z; const int64_t* ids; void* out;
    int64_t K, g, i0, i1; int skind, bits, span, okind;
} gather_job_t;

static void* gather_run(void* arg) {
    const gather_job_t* j = arg;
    const int64_t K = j->K, g = j->g, G = K / g, KP = K / 2;
    float* buf = j->okind == 0 ? NULL : malloc(sizeof(float) * K);
    if (j->okind != 0 && !buf) return arg;
    for (int64_t i = j->i0; i < j->i1; i++) {
        const int64_t nb = j->ids[i] / RB, r = j->ids[i] % RB;
        float* d = j->okind == 0 ? (float*)j->out + i * K : buf;
        for (int64_t gi = 0; gi < G; gi++) {
            const int64_t pi = (nb * G + gi) * RB + r;
            /* 4-bit: the +8 of offset binary folded into the offset (q - z = u - (8 + z), exact) */
            const float sc = scale_at(j->s, j->skind, pi), zc = (j->z ? (float)j->z[pi] : 0.0f) + (j->bits == 8 ? 0.0f : 8.0f);
            if (j->bits == 8) {
                const int8_t* q = (const int8_t*)j->w + nb * KP * 32 + 2 * r;
                for (int64_t p = gi * g / 2; p < (gi + 1) * g / 2; p++) {
                    d[2 * p] = ((float)q[p * 32] - zc) * sc;
                    d[2 * p + 1] = ((float)q[p * 32 + 1] - zc) * sc;
                }
            } else if (j->span == 8) {
                const uint32_t* q = (const uint32_t*)j->w + nb * (K / 8) * RB + r;
                for (int64_t ch = gi * g / 8; ch < (gi + 1) * g / 8; ch++)
                    for (int c = 0; c < 8; c++) d[ch * 8 + c] = ((float)((q[ch * RB] >> (4 * c)) & 15) - zc) * sc;
            } else {
                const uint8_t* q = j->w + nb * KP * RB + r;
                for (int64_t p = gi * g / 2; p < (gi + 1) * g / 2; p++) {
                    d[2 * p] = ((float)(q[p * RB] & 15) - zc) * sc;
                    d[2 * p + 1] = ((float)(q[p * RB] >> 4) - zc) * sc;
                }
            }
        }
        if (j->okind != 0) {
            uint16_t* o = (uint16_t*)j->out + i * K;
            if (j->okind == 1) for (int64_t k = 0; k < K; k++) o[k] = f32_to_bf16(buf[k]);
            else for (int64_t k = 0; k < K; k++) o[k] = f32_to_f16(buf[k]);
        }
    }
    free(buf);
    return NULL;
}

/* Rows ids[0 .. n) of the table (layouts.Native: span 2; NativeQ4D: span 8, 4-bit) as
   out[n][K] (okind 0 float32, 1 bf16, 2 float16): (q - z) * s in float32, one rounding, then
   the cast — format/codec.dequantize_codes' arithmetic, so its bits. The embedding's gather: a
   decode step's row in ~15-20 us where the torch reference's chain of small ops takes 45-80
   (Zen 4; 120 against 190-300 with the caches cold); from 64 ids on nthreads threads. 3 when
   an id is outside [0, V) (nothing written), 1 out of memory. */
int gather_rows(const uint8_t* w, const void* s, int skind, const int8_t* z, int bits, int span, int64_t V,
                int64_t K, int64_t g, const int64_t* ids, int64_t n, void* out, int okind, int nthreads) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= V) return 3;
    if (n < 64 || nthreads < 1) nthreads = 1;
    if (nthreads > EQ_MAX_THREADS) nthreads = EQ_MAX_THREADS;
    gather_job_t jobs[EQ_MAX_THREADS];
    for (int t = 0; t < nthreads; t++) {
        gather_job_t jj = {w, s, z, ids, out, K, g, n * t / nthreads, n * (t + 1) / nthreads, skind, bits, span, okind};
        jobs[t] = jj;
    }
    return nthreads == 1 ? gather_run(jobs) != NULL : eq_fanout(gather_run, jobs, sizeof(gather_job_t), nthreads);
}

#if EQ_Q4DW  /* the int8-activation rows read the pair layout (layouts.Native) only */
int head_q4a8(const uint8_t* w, const void* s, int skind, const int8_t* z, int64_t V, int64_t K, int64_t g,
              const void* x, int xkind, int64_t M, void* out, int okind, int64_t ldo, int nthreads) {
    (void)w; (void)s; (void)skind; (void)z; (void)V; (void)K; (void)g; (void)x; (void)xkind; (void)M; (void)out;
    (void)okind; (void)ldo; (void)nthreads;
    return 2;
}
#else
#include "eq_q4a8.h"
#endif
