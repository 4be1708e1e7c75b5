/* embedq's AMX-BF16 head kernel over the native blocked layout (native_head.py).

   logits[M, V] = x[M, K] @ dequant(W)^T, exact like native_bf16.c: every int8 and 4-bit
   code is exact in bf16, TDPBF16PS multiplies exactly and sums in float32, and each group's
   scale (and z * sum(x) for asymmetric rows) is applied after that group's dot. float16 and
   float32 activations are split once per call into 2 / 3 bf16 parts whose sum is x exactly
   (x = h + m + l: 8 significant bits each), each part a dot of its own into the same
   accumulators: the float32 products of the reference, summed in another order.

   Why AMX: on Sapphire Rapids and later, torch's bf16 F.linear runs on AMX tiles (~1,024
   bf16 FLOP per cycle per core); vdpbf16ps does 64. With tiles the head is bound by reading
   the table (int8: half of bf16's bytes, 4-bit: a quarter) and decoding it once per call.

   The blocked layout is already the B-tile layout: a block of 16 table rows decoded to bf16
   pairs is [K/2][16][2], so 16 column pairs (32 columns) of it are one B tile (16 rows of
   64 bytes: pair p, table row n). A tiles are 16 activation rows x 32 columns of x, stored
   tile by tile (1 KiB each, see head_amx).
   Tiles: C 0-3 = (activation tile a, table block b) for a, b in {0, 1}; A 4-5; B 6-7.
   Three loops: sweep_jit (M <= 16: one A tile x two blocks per sweep, each k-step's B tiles
   decoded just in time, every group's scaling unrolled over the tile's rows), pair_groups
   (M > 16, 4-bit and grouped int8 tables: the group loop outside the A tiles, each group's
   B tiles in L1, 2 x 2 C tiles, one or two groups per sweep) and the memory loop (2 x 2
   tiles, epilogue() per C tile: int8 per row at M > 16, whose one epilogue per sweep is
   cheap beside the 2 x 2 tiles' fewer tile loads), int8 codes decoded as q * 2^-112 (see
   head_amx; instances S8). Needs Linux's permission for tile data (arch_prctl(ARCH_REQ_XCOMP_PERM)): amx_init(). */
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
#include "eq_parallel.h"
#include "eq_bf16dec.h"
#include "eq_convert.h"
#include <math.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 0 when this process may use AMX tile data (asked once; the permission is per process). */
int amx_init(void) {
    static int rc = 1;
    if (rc == 1) rc = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
    return rc;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg_t;

typedef struct {
    const uint8_t* w; const void* s; const int8_t* z; const uint16_t* xa; const float* xs;
    void* out; int64_t ldo, M, MP, K, G, g, V, nb0, nb1; int bits, skind, nt, parts, okind, sc;
} job_t;

/* 16 rows x one column pair as bf16: int8 codes times 2^-112 (dec8s) where head_amx scaled
   the activations by 2^56 (sc: S8, a constant of each loop's instance), else exact (dec8);
   4-bit codes by the lookup. S8 chosen per pair at run time instead cost most of what dec8s
   saves (C A/B, int8 g64 M = 16 / 64: 0.97-0.98 against 0.86-0.91), hoisted out of each run
   of 16 pairs 1.13 at M = 64: hence the instances. The decode loops stay rolled (GCC unroll 1):
   with the branch gone GCC unrolled them 16-fold and int8 g64 M = 64 took 1.08-1.14x. */
static inline __attribute__((always_inline)) __m512i dec_b(const job_t* j, int64_t pair, __m512i tbl, const int S8) {
#ifdef __AVX512FP16__
    if (S8) return dec8s((const int8_t*)j->w + pair * 32);
#endif
    return dec_pair(j->w, j->bits, pair, tbl);
}

/* scales i .. i + 15 as float32, times 2^56 under sc (exact: a power of two, normal either way) */
static inline __m512 scale_at(const job_t* j, int64_t i) {
    const __m512 s = load_scale(j->s, j->skind, i);
    return j->sc ? _mm512_mul_ps(s, _mm512_set1_ps(0x1p56f)) : s;
}

/* C tile (a, b) -> acc rows of activation tile a, block b: acc[b][a*16 + i][16 lanes] */
static inline void epilogue(const job_t* j, float* cbuf, float* acc, int64_t nb, int64_t gi, int64_t m0) {
    const int64_t G = j->G;
    __m512 sv = scale_at(j, (nb * G + gi) * 16);
    __m512 zv = j->z ? load_zero(j->z, (nb * G + gi) * 16) : _mm512_setzero_ps();
    const int n = j->M - m0 < 16 ? (int)(j->M - m0) : 16; /* the real activation rows */
    for (int i = 0; i < n; i++) {
        __m512 t = _mm512_load_ps(cbuf + i * 16);
        if (j->z) t = _mm512_fnmadd_ps(zv, _mm512_set1_ps(j->xs[(m0 + i) * G + gi]), t);
        __m512 a = gi == 0 ? _mm512_mul_ps(t, sv) : _mm512_fmadd_ps(t, sv, _mm512_load_ps(acc + i * 16));
        _mm512_store_ps(acc + i * 16, a);
    }
}

#define STORE_C(c, a, b) do { _tile_stored(c, cbuf, 64);                                  \
        epilogue(j, cbuf, acc + ((b) * 32 + (a) * 16) * 16, nb + (b), gi, m0 + (a) * 16); } while (0)

/* One output row's 16 (32 with hi) logits from float32 at column r0, in the output dtype.
   Past L2 size (nt) a whole 64-byte line is one streaming store (see head_amx). */
static inline void store_row(const job_t* j, int64_t m, int64_t r0, const float* lo, const float* hi) {
    const int64_t n = j->V - r0;
    const int full = hi && n >= 32;
    if (j->okind == 0) { /* float32: a block row is one line */
        float* o = (float*)j->out + m * j->ldo + r0;
        for (int b = 0; b < (hi ? 2 : 1); b++) {
            __m512 v = _mm512_load_ps(b ? hi : lo);
            const int64_t nr = n - b * 16 < 16 ? n - b * 16 : 16;
            if (j->nt && nr == 16 && ((uintptr_t)(o + b * 16) & 63) == 0) _mm512_stream_ps(o + b * 16, v);
            else _mm512_mask_storeu_ps(o + b * 16, (__mmask16)((1u << nr) - 1), v);
        }
        return;
    }
#define CVT16(p) (j->okind == 1 ? (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(p))                   \
                                : _mm512_cvtps_ph(_mm512_load_ps(p), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
    uint16_t* o = (uint16_t*)j->out + m * j->ldo + r0;
    if (j->nt && full && ((uintptr_t)o & 63) == 0) {
        _mm512_stream_si512((__m512i*)o, _mm512_inserti64x4(_mm512_castsi256_si512(CVT16(lo)), CVT16(hi), 1));
        return;
    }
    for (int b = 0; b < (hi ? 2 : 1); b++) {
        const int64_t nr = n - b * 16 < 16 ? n - b * 16 : 16;
        _mm256_mask_storeu_epi16(o + b * 16, (__mmask16)((1u << nr) - 1), CVT16(b ? hi : lo));
    }
#undef CVT16
}

/* decode the pairs [p0, p1) of both blocks of block pair nb into buffer d (names j, KP,
   tbl and S8 from the caller's scope) */
#define DECODE(d, nb, p0, p1) for (int b_ = 0; b_ < 2 && (nb) + b_ < j->nb1; b_++)                \
        _Pragma("GCC unroll 1") for (int64_t p_ = (p0); p_ < (p1); p_++)                   \
            _mm512_store_si512((d) + (b_ * KP + p_) * 16, dec_b(j, ((nb) + b_) * KP + p_, tbl, S8));

/* k-step ks (16 column pairs) of both blocks of block pair nb into ring slot ks & 1 of d
   ([2 slots][2 blocks][16 pairs][16 rows] bf16 pairs: 4 KiB, stays in L1; names j, KP, nb,
   two, tbl and S8 from the caller's scope) */
#define DECODE_STEP(d, ks) for (int b_ = 0; b_ < 1 + two; b_++) _Pragma("GCC unroll 1") for (int p_ = 0; p_ < 16; p_++)      \
        _mm512_store_si512((d) + (((ks) & 1) * 2 + b_) * 256 + p_ * 16,                             \
                           dec_b(j, (nb + b_) * KP + (ks) * 16 + p_, tbl, S8));

/* group gi's scales (and zero points, ZP) of blocks nb and nb + 1 (two; else block nb's twice) */
static inline __attribute__((always_inline)) void group_consts(const job_t* j, int64_t nb, int64_t gi, int two, const int ZP,
                                                           __m512* s0, __m512* s1, __m512* z0, __m512* z1) {
    const int64_t G = j->G;
    *s0 = scale_at(j, (nb * G + gi) * 16);
    *s1 = two ? scale_at(j, ((nb + 1) * G + gi) * 16) : *s0;
    *z0 = *z1 = _mm512_setzero_ps();
    if (ZP) {
        *z0 = load_zero(j->z, (nb * G + gi) * 16);
        *z1 = two ? load_zero(j->z, ((nb + 1) * G + gi) * 16) : *z0;
    }
}

/* M <= 16: the block pair nb (two: both blocks exist) against the activation rows [0, 16),
   one sweep: each k-step's B tiles decoded into the ring (4 KiB, L1) one k-step ahead of
   their loads (DECODE_STEP), the next pair's codes prefetched; after each group's tile dots
   its two C tiles are stored and scaled into 2 x RN sums, the row loop unrolled (RN = 8 or
   16 and ZP, zero points or not, constants per instance; rows past M are the A tile's zero
   padding, summed and not stored). The operations and their order are epilogue()'s, so the
   bits are too. Not registers: 32 sums, two scales and the tile's values exceed the 32 zmm,
   and GCC 12 keeps the C values in registers and the sums in stack slots (a memory operand
   of each FMA); still faster than epilogue()'s runtime-bounded loop per C tile. */
static inline __attribute__((always_inline)) void sweep_jit(const job_t* j, int two, int32_t* ring, int64_t nb,
                                                        float* cbuf, float* acc, __m512i tbl, const int RN,
                                                        const int ZP, const int S8) {
    const int64_t K = j->K, KP = K / 2, G = j->G, KS = j->g / 32, NS = K / 32;
    const int64_t cb = j->bits == 8 ? 32 : 16;  /* code bytes per column pair of a block */
    const uint8_t* pf = nb + 3 < j->nb1 ? j->w + (nb + 2) * KP * cb : NULL;  /* the next pair's codes */
    __m512 r0[16], r1[16];
    DECODE_STEP(ring, 0)
    for (int64_t gi = 0; gi < G; gi++) {
        _tile_zero(0); _tile_zero(1);
        for (int64_t ks = gi * KS; ks < (gi + 1) * KS; ks++) {
            const int32_t* b0 = ring + (ks & 1) * 512;
            _tile_loadd(6, b0, 64);
            if (two) _tile_loadd(7, b0 + 256, 64);
            for (int pt = 0; pt < j->parts; pt++) {
                _tile_loadd(4, j->xa + pt * j->MP * K + ks * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two) _tile_dpbf16ps(1, 4, 7);
            }
            /* the next k-step's B tiles, and the next pair's codes toward L1 */
            if (ks + 1 < NS) DECODE_STEP(ring, ks + 1)
            if (pf) for (int64_t l = 0; l < 16 * cb; l += 64) {
                _mm_prefetch((const char*)pf + ks * 16 * cb + l, _MM_HINT_T0);
                _mm_prefetch((const char*)pf + (KP + ks * 16) * cb + l, _MM_HINT_T0);
            }
        }
        _tile_stored(0, cbuf, 64);
        if (two) _tile_stored(1, cbuf + 256, 64);
        __m512 s0, s1, z0, z1;
        group_consts(j, nb, gi, two, ZP, &s0, &s1, &z0, &z1);
#pragma GCC unroll 16
        for (int i = 0; i < RN; i++) {
            __m512 t0 = _mm512_load_ps(cbuf + i * 16), t1 = _mm512_load_ps(cbuf + 256 + i * 16);
            if (ZP) {  /* xs has zero rows up to MP */
                const __m512 xs = _mm512_set1_ps(j->xs[i * G + gi]);
                t0 = _mm512_fnmadd_ps(z0, xs, t0);
                t1 = _mm512_fnmadd_ps(z1, xs, t1);
            }
            r0[i] = gi == 0 ? _mm512_mul_ps(t0, s0) : _mm512_fmadd_ps(t0, s0, r0[i]);
            r1[i] = gi == 0 ? _mm512_mul_ps(t1, s1) : _mm512_fmadd_ps(t1, s1, r1[i]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < RN; i++) {
        _mm512_store_ps(acc + i * 16, r0[i]);
        _mm512_store_ps(acc + (32 + i) * 16, r1[i]);
    }
    for (int64_t i = 0; i < RN && i < j->M; i++)
        store_row(j, i, nb * 16, acc + i * 16, two ? acc + (32 + i) * 16 : NULL);
}

/* one function per instance, compiled apart: four instances inlined into run() made the
   16-row ones ~10 % slower (Xeon with AMX, Gemma-size head, M = 64). */
typedef void (*sweep_fn)(const job_t*, int, int32_t*, int64_t, float*, float*, __m512i);
#define SWEEP_FN(RN, ZP, S8) static __attribute__((noinline)) void sweep_##RN##_##ZP##_##S8(const job_t* j, int two,  \
        int32_t* ring, int64_t nb, float* cbuf, float* acc, __m512i tbl) { sweep_jit(j, two, ring, nb, cbuf, acc, tbl, RN, ZP, S8); }
SWEEP_FN(8, 0, 0) SWEEP_FN(8, 1, 0) SWEEP_FN(16, 0, 0) SWEEP_FN(16, 1, 0)
SWEEP_FN(8, 0, 1) SWEEP_FN(8, 1, 1) SWEEP_FN(16, 0, 1) SWEEP_FN(16, 1, 1)
static const sweep_fn SWEEPS[8] = {sweep_8_0_0, sweep_8_1_0, sweep_16_0_0, sweep_16_1_0,
                                   sweep_8_0_1, sweep_8_1_1, sweep_16_0_1, sweep_16_1_1};

/* One k-step of the 2 x 2 tiles: B tiles b0 (and b1, two) against the activation tiles at x
   (rows m0.., this k-step; x + 16 * K: the next 16 rows, twoa), every bf16 part of x. */
static inline __attribute__((always_inline)) void dots_2x2(const job_t* j, const int32_t* b0, const int32_t* b1,
                                                       const uint16_t* x, int two, int twoa) {
    _tile_loadd(6, b0, 64);
    if (two) _tile_loadd(7, b1, 64);
    for (int pt = 0; pt < j->parts; pt++) {  /* the bf16 parts of x */
        const uint16_t* xp = x + pt * j->MP * j->K;
        _tile_loadd(4, xp, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) _tile_dpbf16ps(1, 4, 7);
        if (twoa) {
            _tile_loadd(5, xp + 16 * j->K, 64);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* The group loop outside the sweeps (4-bit and grouped int8 tables at M > 16): GP groups
   (1 or 2) at a time, their B tiles of both blocks decoded into a ring slot (2 KiB per
   k-step: L1), the next GP groups' into the other slot during the first sweep; then the
   groups' dots for two A tiles at a time (2 x 2 C tiles: each tile load serves two dots),
   every C tile stored, and each row's sums of the pair ([MP][32]) read once, scaled with
   the GP groups in order (the operations and order of sweep_jit's scaling, so the bits
   too) and stored once: a C tile's scaling is bound by its stores, two groups share one
   store of the sums. Groups of 32 (one k-step, so one dot per tile store) store one tile
   pair behind the other pair's dots: tiles are not renamed, so a dot into a C tile waits
   for that tile's store. Measured (C A/B, tries not kept): docs/performance.md, "AMX: two
   activation tiles and two groups per sweep" and "AMX: int8 codes as q·2^-112". */
static inline __attribute__((always_inline)) void pair_groups(const job_t* j, int64_t nb, int two, int32_t* ring,
                                                          float* cbuf, float* accp, __m512i tbl, const int ZP, const int GP,
                                                          const int S8) {
    const int64_t K = j->K, KP = K / 2, G = j->G, KS = j->g / 32, MP = j->MP;
    const int64_t SL = (G < GP ? G : GP) * KS * 512;  /* one ring slot: GP groups x KS k-steps x 2 blocks x 16 pairs x 16 int32 */
#define GDEC(slot, q, ks) for (int b_ = 0; b_ < 1 + two; b_++) _Pragma("GCC unroll 1") for (int p_ = 0; p_ < 16; p_++)          \
        _mm512_store_si512(ring + (slot) * SL + ((q) * 2 + b_) * 256 + p_ * 16,                          \
                           dec_b(j, (nb + b_) * KP + (ks) * 16 + p_, tbl, S8));
    for (int64_t q = 0; q < (G < GP ? G : GP) * KS; q++) GDEC(0, q, q)
    for (int64_t g0 = 0, sl = 0; g0 < G; g0 += GP, sl ^= 1) {
        const int ng = G - g0 < GP ? (int)(G - g0) : GP;
        const int64_t nq = (G - g0 - ng < GP ? G - g0 - ng : GP) * KS;  /* k-steps of the next sweep's groups */
        const int32_t* rg = ring + sl * SL;
        __m512 s0[2], s1[2], z0[2], z1[2];
        for (int gg = 0; gg < ng; gg++) group_consts(j, nb, g0 + gg, two, ZP, &s0[gg], &s1[gg], &z0[gg], &z1[gg]);
        for (int64_t m0 = 0; m0 < MP; m0 += 32) {
            const int twoa = m0 + 16 < MP;
            if (KS == 1 && twoa && two) {  /* group gg: C 0-1's dots, gg - 1's C 2-3 stored, C 2-3's dots, C 0-1 stored */
                for (int gg = 0; gg < ng; gg++) {
                    const uint16_t* x = j->xa + m0 * K + (g0 + gg) * 512;
                    float* cb = cbuf + gg * 1024;
                    _tile_zero(0); _tile_zero(1);
                    _tile_loadd(6, rg + gg * 512, 64); _tile_loadd(7, rg + gg * 512 + 256, 64);
                    for (int pt = 0; pt < j->parts; pt++) {
                        _tile_loadd(4, x + pt * MP * K, 64);
                        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
                    }
                    if (gg) { _tile_stored(2, cb - 512, 64); _tile_stored(3, cb - 256, 64); }
                    _tile_zero(2); _tile_zero(3);
                    for (int pt = 0; pt < j->parts; pt++) {
                        _tile_loadd(5, x + pt * MP * K + 16 * K, 64);
                        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(0, cb, 64); _tile_stored(1, cb + 256, 64);
                    if (m0 == 0 && gg < nq) GDEC(sl ^ 1, gg, g0 + GP + gg)
                }
                _tile_stored(2, cbuf + ng * 1024 - 512, 64); _tile_stored(3, cbuf + ng * 1024 - 256, 64);
            } else
            for (int gg = 0; gg < ng; gg++) {
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t kk = 0; kk < KS; kk++) {
                    const int64_t q = gg * KS + kk, ks = g0 * KS + q;
                    dots_2x2(j, rg + q * 512, rg + q * 512 + 256, j->xa + m0 * K + ks * 512, two, twoa);
                    if (m0 == 0 && q < nq) GDEC(sl ^ 1, q, (g0 + GP) * KS + q)
                }
                float* cb = cbuf + gg * 1024;
                _tile_stored(0, cb, 64);
                if (two) _tile_stored(1, cb + 256, 64);
                if (twoa) { _tile_stored(2, cb + 512, 64); if (two) _tile_stored(3, cb + 768, 64); }
            }
            for (int h = 0; h < 1 + twoa; h++) {
                float* a = accp + (m0 + h * 16) * 32;
                const int64_t mr = m0 + h * 16;
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++) {
                    __m512 r0 = _mm512_setzero_ps(), r1 = r0;
                    if (g0) { r0 = _mm512_load_ps(a + i * 32); r1 = _mm512_load_ps(a + i * 32 + 16); }
#pragma GCC unroll 4
                    for (int gg = 0; gg < GP; gg++) {
                        if (gg >= ng) break;
                        const float* cb = cbuf + gg * 1024 + h * 512;
                        __m512 t0 = _mm512_load_ps(cb + i * 16), t1 = _mm512_load_ps(cb + 256 + i * 16);
                        if (ZP) {
                            const __m512 xs = _mm512_set1_ps(j->xs[(mr + i) * G + g0 + gg]);
                            t0 = _mm512_fnmadd_ps(z0[gg], xs, t0);
                            t1 = _mm512_fnmadd_ps(z1[gg], xs, t1);
                        }
                        r0 = g0 + gg == 0 ? _mm512_mul_ps(t0, s0[gg]) : _mm512_fmadd_ps(t0, s0[gg], r0);
                        r1 = g0 + gg == 0 ? _mm512_mul_ps(t1, s1[gg]) : _mm512_fmadd_ps(t1, s1[gg], r1);
                    }
                    _mm512_store_ps(a + i * 32, r0);
                    _mm512_store_ps(a + i * 32 + 16, r1);
                }
            }
        }
    }
#undef GDEC
}
#define PG_FN(ZP, GP, S8) static __attribute__((noinline)) void pair_groups_##ZP##_##GP##_##S8(const job_t* j, int64_t nb, \
        int two, int32_t* ring, float* cbuf, float* accp, __m512i tbl) { pair_groups(j, nb, two, ring, cbuf, accp, tbl, ZP, GP, S8); }
PG_FN(0, 1, 0) PG_FN(1, 1, 0) PG_FN(0, 2, 0) PG_FN(1, 2, 0)
PG_FN(0, 1, 1) PG_FN(1, 1, 1) PG_FN(0, 2, 1) PG_FN(1, 2, 1)
typedef void (*pg_fn)(const job_t*, int64_t, int, int32_t*, float*, float*, __m512i);
static const pg_fn PAIR_GROUPS[8] = {pair_groups_0_1_0, pair_groups_1_1_0, pair_groups_0_2_0, pair_groups_1_2_0,
                                     pair_groups_0_1_1, pair_groups_1_1_1, pair_groups_0_2_1, pair_groups_1_2_1};

/* The memory loop (int8 per row at M > 16): the pair after this one decoded into the other
   half of wbuf ([2][2][K/2][16] bf16 pairs) during this pair's first sweep, 2 x 2 C tiles,
   epilogue() per C tile. */
static inline __attribute__((always_inline)) void rows_loop(const job_t* j, int32_t* wbuf, float* cbuf, float* acc,
                                                        __m512i tbl, const int S8) {
    const int64_t K = j->K, KP = K / 2, G = j->G, KS = j->g / 32, PB = 2 * KP * 16;
    if (j->nb0 < j->nb1) DECODE(wbuf, j->nb0, 0, KP)
    for (int64_t nb = j->nb0, cur = 0; nb < j->nb1; nb += 2, cur ^= 1) {
        const int two = nb + 1 < j->nb1;
        const int32_t* wd = wbuf + cur * PB, * wd1 = wd + KP * 16;
        int32_t* wn = wbuf + (cur ^ 1) * PB;
        for (int64_t m0 = 0; m0 < j->MP; m0 += 32) {
            const int dn = m0 == 0 && nb + 2 < j->nb1;  /* decode the next pair in this sweep */
            const int twoa = m0 + 16 < j->MP;
            const uint16_t* xa = j->xa + m0 * K;
            for (int64_t gi = 0; gi < G; gi++) {
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t ks = gi * KS; ks < (gi + 1) * KS; ks++) {
                    dots_2x2(j, wd + ks * 16 * 16, wd1 + ks * 16 * 16, xa + ks * 512, two, twoa);
                    if (dn) DECODE(wn, nb + 2, ks * 16, ks * 16 + 16)  /* while the tiles run */
                }
                STORE_C(0, 0, 0);
                if (two) STORE_C(1, 0, 1);
                if (twoa) { STORE_C(2, 1, 0); if (two) STORE_C(3, 1, 1); }
            }
            for (int64_t i = 0; i < 32 && m0 + i < j->M; i++)
                store_row(j, m0 + i, nb * 16, acc + i * 16, two ? acc + (32 + i) * 16 : NULL);
        }
    }
}
#define RL_FN(S8) static __attribute__((noinline)) void rows_loop_##S8(const job_t* j, int32_t* wbuf, float* cbuf,   \
        float* acc, __m512i tbl) { rows_loop(j, wbuf, cbuf, acc, tbl, S8); }
RL_FN(0) RL_FN(1)

static void* run(void* arg) {
    const job_t* j = (const job_t*)arg;
    const int64_t K = j->K, KP = K / 2, G = j->G, KS = j->g / 32; /* k-steps of 32 per group */
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    /* M <= 8: C and A tiles of 8 rows, half the tile work (M = 3-8: 0.96-0.99x) */
    const int tr = j->M <= 8 ? 8 : 16;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = t < 6 ? tr : 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    __m512i tbl = j->bits == 4 ? dec4_table() : _mm512_setzero_si512();
    const int S8 = j->sc;  /* which instances: dec8s (sc: int8 tables only) or dec8 / dec4 */
    /* the memory loop's two decoded block pairs ([2][2][K/2][16] bf16 pairs, see rows_loop) */
    const int64_t PB = 2 * KP * 16; /* one decoded pair (int32 units) */
    /* M <= 16: the 4 KiB ring of sweep_jit; else pair_groups' ring or the memory loop's two decoded pairs */
    int32_t* wbuf = aligned_alloc(64, j->MP == 16 ? 4096 : 2 * PB * 4);
    float* acc = aligned_alloc(64, 2 * 32 * 16 * sizeof(float));
    float* cbuf = aligned_alloc(64, 8 * 16 * 16 * sizeof(float));  /* 2 x 4 C tiles, as stored for scaling */
    if (!wbuf || !acc || !cbuf) { free(wbuf); free(acc); free(cbuf); _tile_release(); return (void*)1; }
    memset(cbuf, 0, 8 * 16 * 16 * sizeof(float));  /* one block left: its second tile's sums stay finite */
    {   /* Fault in this thread's output pages in address order first: a fresh output (every
           call's) faulted in the kernel's order - 16-32 rows at a time, a 2*V-byte stride -
           cost ~2x more (Xeon with AMX, Gemma head M = 256: 92.7 -> 79 ms with the stores below). */
        const int64_t c0 = j->nb0 * 16, c1 = (j->nb1 * 16 < j->V ? j->nb1 * 16 : j->V);
        for (int64_t m = 0; m < j->M; m++) {
            const int es = j->okind == 0 ? 4 : 2;
            volatile char* a = (volatile char*)j->out + (m * j->ldo + c0) * es;
            volatile char* e = (volatile char*)j->out + (m * j->ldo + c1) * es;
            for (; a < e; a = (volatile char*)(((uintptr_t)a + 4096) & ~(uintptr_t)4095)) *a = 0;
        }
    }
    /* M <= 16: one sweep per block pair, each k-step's B tiles decoded into a ring in L1 one
       step ahead of their loads, the next pair's codes prefetched (a whole decoded pair, 80 KiB
       for Gemma, sat in L2: Q4 g32 M = 2-16 0.78-0.86 x 0.87-0.89 with the ring and prefetch) */
    if (j->MP == 16) {
        const sweep_fn sweep = SWEEPS[S8 * 4 + (j->M > 8) * 2 + !!j->z];
        for (int64_t nb = j->nb0; nb < j->nb1; nb += 2)
            sweep(j, nb + 1 < j->nb1, wbuf, nb, cbuf, acc, tbl);
        goto done;
    }
    /* M > 16: pair_groups (4-bit and grouped int8 tables) or the memory loop (int8 per row:
       against the unrolled sweeps at M = 256 it measured 1.1x faster, the 2 x 2 tiles load
       fewer tiles per dot and its one epilogue per sweep is cheap; fifteenth session). Two
       groups per sweep where that measured faster (pair_groups): groups of 32 at every M, 64
       from M = 128. */
    if (j->bits == 4 || G > 1) {
        float* accp = aligned_alloc(64, j->MP * 32 * sizeof(float));
        if (!accp) { free(wbuf); free(acc); free(cbuf); _tile_release(); return (void*)1; }
        const pg_fn pg = PAIR_GROUPS[S8 * 4 + (KS == 1 || (KS == 2 && j->MP >= 128)) * 2 + !!j->z];
        for (int64_t nb = j->nb0; nb < j->nb1; nb += 2) {
            const int two = nb + 1 < j->nb1;
            pg(j, nb, two, wbuf, cbuf, accp, tbl);
            for (int64_t i = 0; i < j->M; i++)
                store_row(j, i, nb * 16, accp + i * 32, two ? accp + i * 32 + 16 : NULL);
        }
        free(accp);
        goto done;
    }
    (S8 ? rows_loop_1 : rows_loop_0)(j, wbuf, cbuf, acc, tbl);
done:
    _mm_sfence();
    free(wbuf); free(acc); free(cbuf);
    _tile_release();
    return NULL;
}

/* logits[M, V] (row stride ldo, x's dtype) = x[M, K] (xkind: 0 float32, 1 bf16, 2 float16)
   @ dequant(W)^T on nthreads threads. K and the group g multiples of 32 (one B tile never
   spans two groups). 0, or -1 when the kernel refused (no tile permission, no memory). */
int head_amx(const uint8_t* w, const void* s, int skind, const int8_t* z, int bits, int64_t V, int64_t K,
             int64_t g, const void* x, int xkind, int64_t M, void* out, int64_t ldo, int nthreads) {
    if (amx_init() != 0 || K % 32 || g % 32 || xkind < 0 || xkind > 2) return -1;
    const int64_t G = K / g, NB = (V + 15) / 16, MP = (M + 15) / 16 * 16;
    const int parts = xkind == 1 ? 1 : xkind == 2 ? 2 : 3;
    /* activations as `parts` bf16 matrices [parts][MP][K], padded with zero rows to whole
       16-row A tiles: h = bf16(x), m = bf16(x - h), l = bf16(x - h - m); each difference is
       exact in float32 and the last part holds the remaining <= 8 bits (inf/NaN: h alone).
       Each part is stored tile by tile, [MP/16][K/32][16][32]: an A tile is one contiguous
       KiB instead of 16 lines 2*K bytes apart (interleaved C A/B, Gemma-size head, Xeon with
       AMX, outputs identical: Q4 g32 M = 8-256 0.96-0.98, int8 g64 0.96-0.99, M = 1 1.00) */
    uint16_t* xa = aligned_alloc(64, parts * MP * K * 2);
    float* xs = z ? calloc(MP * G, sizeof(float)) : NULL;  /* zero padding rows (sweep_jit, pair_groups) */
    if (!xa || (z && !xs)) { free(xa); free(xs); return -1; }
    memset(xa, 0, parts * MP * K * 2);
    float lo = INFINITY, hi = 0.f;  /* int8 tables: the smallest and largest nonzero finite part */
    for (int64_t m = 0; m < M; m++) for (int64_t k = 0; k < K; k++) {
        float r = eq_x_at(x, xkind, m * K + k);
        const int fin = isfinite(r);
        const int64_t at = (m >> 4) * 16 * K + (k >> 5) * 512 + (m & 15) * 32 + (k & 31);
        for (int pt = 0; pt < parts; pt++) {
            const uint16_t h = f32_to_bf16(r);
            const float hf = bf16_to_f32(h), a = fabsf(hf);
            xa[pt * MP * K + at] = h;
            if (bits == 8 && fin && a != 0.f) { lo = a < lo ? a : lo; hi = a > hi ? a : hi; }
            r = fin ? r - hf : 0.f;
        }
    }
    if (xs) eq_group_sums(x, xkind, M, K, g, xs); /* asymmetric rows: z * sum(x) per group */
    /* int8 tables: B tiles of q * 2^-112 (dec8s) against parts and scales times 2^56 and z * sum(x)
       times 2^-56: powers of two, so dec8's bits wherever every nonzero finite part lies in
       [2^-63, 2^63] - each product, partial sum and C - z * sum(x) is then 0 or a multiple of
       2^-70 (>= 2^-126 scaled: nothing AMX flushes). Outside: dec8, unscaled. C A/B, Gemma-size
       int8 table: g64 M = 8 / 16 / 64 0.81 / 0.91 / 0.90, per row M = 16 / 64 0.84 / 0.95. */
    int sc = 0;
#ifdef __AVX512FP16__
    sc = bits == 8 && lo >= 0x1p-63f && hi <= 0x1p63f;
#endif
    if (sc) {
        for (int64_t i = 0; i < parts * MP * K; i++) {
            const uint16_t v = xa[i];  /* nonzero finite parts: exponent + 56 */
            if ((v & 0x7fff) && (v & 0x7f80) != 0x7f80) xa[i] = (uint16_t)(v + (56 << 7));
        }
        if (xs) for (int64_t i = 0; i < MP * G; i++) xs[i] *= 0x1p-56f;
    }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > NB) nthreads = (int)NB;
    if (nthreads > EQ_MAX_THREADS) nthreads = EQ_MAX_THREADS;
    /* Outputs from 8 MiB are written by streaming stores, a whole line (two blocks) at a time:
       each block writes 32 bytes into M rows 2*V bytes apart, rows that alias in the cache sets
       (Gemma head M = 256 72.7 -> 48.3 ms); smaller ones stay in cache for softmax / sampling. */
    const int nt = M * V * (xkind == 0 ? 4 : 2) >= (8 << 20);
    job_t jobs[EQ_MAX_THREADS];
    for (int t = 0; t < nthreads; t++) {
        /* blocks split at even numbers: the streaming stores write two blocks as one line */
        job_t jj = {w, s, z, xa, xs, out, ldo, M, MP, K, G, g, V, NB * t / nthreads & ~1,
                    t + 1 == nthreads ? NB : NB * (t + 1) / nthreads & ~1,
                    bits, skind, nt, parts, xkind, sc};
        jobs[t] = jj;
    }
    int rc = eq_fanout(run, jobs, sizeof(job_t), nthreads);
    free(xa); free(xs);
    return rc ? -1 : 0;
}
