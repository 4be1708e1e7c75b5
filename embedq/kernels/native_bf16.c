#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include "eq_parallel.h"
#include "eq_bf16dec.h"
#include "eq_convert.h"

/* EQ_PREFETCH (eq_convert.h) on every pair decoded: on an Intel Xeon (Sapphire Rapids class,
   AMX taken away: the AVX512-BF16 family emulated) Gemma head int8 g64 M = 1 / 2 / 8 13.9 /
   15.2 / 51.1 -> 8.6 / 8.9 / 18.3 ms, Q4 g32 M = 8 21.1 -> 15.7; flat from 3 to 16 KiB ahead;
   M >= 16 (compute-bound) unchanged. EQ_BF16_PF_L2 (native_head._source defines it on AMD):
   into L2 (prefetcht1) 8 KiB ahead instead, so the DRAM misses wait in L2's larger queue, not
   in L1's fill buffers: AMD EPYC Zen 4, Gemma head from memory, interleaved, int8 g64 M = 2 /
   3 / 4 / 8 / 64 0.71 / 0.74 / 0.81 / 0.99 / 0.93x the time, int8 per row 0.71 / 0.72 / 0.76 /
   0.95 / 0.95x, Q4 g32 M = 2 0.93x, M = 3-64 0.98-1.01x (the float32 builds: 1.00-1.06x there,
   so they keep EQ_PREFETCH). Bit for bit the same. */
#define PAIR_CODES(j, pair) ((j)->w + (pair) * ((j)->bits == 8 ? 32 : 16))
#if EQ_BF16_PF_L2
#define PREFETCH(j, pair) __builtin_prefetch((const char*)PAIR_CODES(j, pair) + 8192, 0, 2)
#else
#define PREFETCH(j, pair) EQ_PREFETCH(PAIR_CODES(j, pair))
#endif

/* Layout (one table, head and gather): rows in blocks of 16 (padded), columns in pairs.
   int8: codes [NB][K/2][16][2] signed; 4-bit: bytes [NB][K/2][16], low nibble = column 2p,
   high = 2p+1, offset binary (u = q + 8) as stored. scales [NB][G][16] in their stored
   dtype (0 f32, 1 bf16, 2 f16); zero points [NB][G][16] int8 or NULL. */

typedef struct {
    const uint8_t* w; const void* s; const int8_t* z; const int32_t* xp; const float* xs;
    uint16_t* out; int64_t ldo, M, K, G, g, V, nb0, nb1; int bits, skind;
} job_t;

static inline __m512i dec(const job_t* j, int64_t pair, __m512i tbl) { return dec_pair(j->w, j->bits, pair, tbl); }

#define DP(a, w, xv) _mm512_dpbf16_ps(a, (__m512bh)(w), (__m512bh)_mm512_set1_epi32(xv))

/* nm (<= 8 with groups, <= 16 per row) activation rows over one block of 16 table rows:
   each column pair of the block is decoded in registers (W) and used by all nm rows
   (one tile per block, M <= 8 / 16), or read from the block decoded once (tile_s).
   xp: activation pairs [K/2][16]; the group's scale (and zero) applied after its dot;
   two accumulator sets (even/odd pairs) hide vdpbf16ps latency when nm <= 8. */
#define TILE_BODY(W)                                                                       \
    enum { NA = 2 };                                                                       \
    __m512 out[16], acc[NA][16];                                                           \
    for (int i = 0; i < nm; i++) out[i] = _mm512_setzero_ps();                             \
    for (int64_t gi = 0; gi < G; gi++) {                                                   \
        for (int i = 0; i < nm; i++) { acc[0][i] = _mm512_setzero_ps(); acc[1][i] = _mm512_setzero_ps(); } \
        const int64_t p0 = gi * P, p1 = p0 + P;                                            \
        int64_t p = p0;                                                                    \
        for (; nm <= 8 && p + 1 < p1; p += 2) {                                            \
            __m512i w0 = W(p), w1 = W(p + 1);                                              \
            for (int i = 0; i < nm; i++) {                                                 \
                acc[0][i] = DP(acc[0][i], w0, xp[p * 16 + i]);                             \
                acc[1][i] = DP(acc[1][i], w1, xp[p * 16 + 16 + i]);                        \
            }                                                                              \
        }                                                                                  \
        for (; p < p1; p++) { __m512i w0 = W(p);                                           \
            for (int i = 0; i < nm; i++) acc[0][i] = DP(acc[0][i], w0, xp[p * 16 + i]); }  \
        __m512 sv = load_scale(j->s, j->skind, (nb * G + gi) * 16);                        \
        __m512 zv = z ? load_zero(z, (nb * G + gi) * 16) : _mm512_setzero_ps();            \
        for (int i = 0; i < nm; i++) {                                                     \
            __m512 t = nm <= 8 ? _mm512_add_ps(acc[0][i], acc[1][i]) : acc[0][i];          \
            if (z) t = _mm512_fnmadd_ps(zv, _mm512_set1_ps(xs[i * G + gi]), t);            \
            out[i] = G == 1 ? _mm512_mul_ps(t, sv) : _mm512_fmadd_ps(t, sv, out[i]);       \
        }                                                                                  \
    }                                                                                      \
    for (int i = 0; i < nm; i++)                                                           \
        _mm256_mask_storeu_epi16(o + i * ldo, mk, (__m256i)_mm512_cvtneps_pbh(out[i]));

/* Groups, nm = 9..16 rows: one accumulator per row (16 chains hide the latency) and the
   finished groups' sums in an L1 array, so one block's decode serves 16 rows where the body
   above holds 8 (2 x nm accumulators + nm outputs: 32 registers at most). AMD EPYC with
   AVX512-BF16 (Zen 4), synthetic Gemma head, interleaved: M = 16 int8 g64 19.7 -> 13.3 ms,
   Q4 g32 16.6 -> 13.5 (twenty-first session). */
#define TILE_BODY16(W)                                                                     \
    __m512 acc[16];                                                                        \
    float om[16][16] __attribute__((aligned(64)));                                         \
    for (int64_t gi = 0; gi < G; gi++) {                                                   \
        for (int i = 0; i < nm; i++) acc[i] = _mm512_setzero_ps();                         \
        for (int64_t p = gi * P; p < (gi + 1) * P; p++) { __m512i w0 = W(p);               \
            for (int i = 0; i < nm; i++) acc[i] = DP(acc[i], w0, xp[p * 16 + i]); }       \
        __m512 sv = load_scale(j->s, j->skind, (nb * G + gi) * 16);                        \
        __m512 zv = z ? load_zero(z, (nb * G + gi) * 16) : _mm512_setzero_ps();            \
        for (int i = 0; i < nm; i++) {                                                     \
            __m512 t = acc[i];                                                             \
            if (z) t = _mm512_fnmadd_ps(zv, _mm512_set1_ps(xs[i * G + gi]), t);            \
            _mm512_store_ps(om[i], gi ? _mm512_fmadd_ps(t, sv, _mm512_load_ps(om[i])) : _mm512_mul_ps(t, sv)); \
        }                                                                                  \
    }                                                                                      \
    for (int i = 0; i < nm; i++)                                                           \
        _mm256_mask_storeu_epi16(o + i * ldo, mk, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(om[i])));

#define W(p) (PREFETCH(j, nb * KP + (p)), dec(j, nb * KP + (p), tbl))

static inline __attribute__((always_inline)) void tile(const int nm, const job_t* j, int64_t nb,
        __m512i tbl, const int32_t* xp, const float* xs, uint16_t* o, __mmask16 mk) {
    const int64_t G = j->G, P = j->g / 2, KP = j->K / 2, ldo = j->ldo; const int8_t* z = j->z;
    if (G > 1 && nm > 8) { TILE_BODY16(W) } else { TILE_BODY(W) }
}

#undef W
/* The same tile over a block decoded once per call into an L1 scratch (wd: [K/2][16] bf16
   pairs), for M above one tile: each extra tile then reloads instead of re-decoding. */
#define W(p) _mm512_load_si512(wd + (p) * 16)

static inline __attribute__((always_inline)) void tile_s(const int nm, const job_t* j, int64_t nb,
        const int32_t* wd, const int32_t* xp, const float* xs, uint16_t* o, int64_t ldo, __mmask16 mk) {
    const int64_t G = j->G, P = j->g / 2; const int8_t* z = j->z;
    if (G > 1 && nm > 8) { TILE_BODY16(W) } else { TILE_BODY(W) }
}
#undef W

#define C(n) case n: tile(n, j, nb, tbl, xp, xs, o, mk); break;
static void tile_any(int nm, const job_t* j, int64_t nb, __m512i tbl, const int32_t* xp,
                            const float* xs, uint16_t* o, __mmask16 mk) {
    switch (nm) { C(1) C(2) C(3) C(4) C(5) C(6) C(7) C(8) C(9) C(10) C(11) C(12) C(13) C(14) C(15) C(16) }
}
#undef C
#define C(n) case n: tile_s(n, j, nb, wd, xp, xs, o, ldo, mk); break;
static void tile_s_any(int nm, const job_t* j, int64_t nb, const int32_t* wd, const int32_t* xp,
                       const float* xs, uint16_t* o, int64_t ldo, __mmask16 mk) {
    switch (nm) { C(1) C(2) C(3) C(4) C(5) C(6) C(7) C(8) C(9) C(10) C(11) C(12) C(13) C(14) C(15) C(16) }
}
#undef C


/* A staged block pair's outputs ([M][32] bf16 at st: the even block's 16 rows, then the odd
   one's) to the logits: one 64-byte line per activation row, streamed past the caches where
   whole and aligned (no read for ownership of lines the caller reads later, from memory:
   M = 64-256 writes 32-128 MiB). mk: the odd block's rows. */
static void flush_pair(const job_t* j, const uint16_t* st, int64_t nb, __mmask16 mk) {
    const __mmask32 m32 = 0xFFFFu | ((uint32_t)mk << 16);
    for (int64_t m = 0; m < j->M; m++) {
        __m512i v = _mm512_load_si512(st + m * 32);
        uint16_t* p = j->out + m * j->ldo + nb * 16;
        if (m32 == 0xFFFFFFFFu && ((uintptr_t)p & 63) == 0) _mm512_stream_si512((__m512i*)p, v);
        else _mm512_mask_storeu_epi16(p, m32, v);
    }
}

static void* run(void* arg) {
    job_t* j = (job_t*)arg;
    const int64_t M = j->M, KP = j->K / 2;
    /* tiles of 16 rows (groups at M <= 8: one tile of TILE_BODY's 8) */
    const int mt = j->G > 1 && M <= 8 ? 8 : 16;
    __m512i tbl = j->bits == 4 ? dec4_table() : _mm512_setzero_si512();
    /* More than one tile per block: decode the block once into an L1 scratch (measured on an
       AMD EPYC with AVX512-BF16, Gemma head: M = 256 1.36x -> 1.05x bf16 F.linear); int8 at
       M <= 32 decodes again per tile instead (Zen 4, synthetic Gemma head, M = 32: int8 g64
       34.4 -> 27.7 ms, per row 34.0 -> 26.7; 4-bit's decode costs more: Q4 g32 30.0 with the
       scratch, 39.3 without). NULL (no memory): in registers. */
    int32_t* wd = M > (j->bits == 8 ? 32 : 16) ? aligned_alloc(64, KP * 64) : NULL;
    /* With the scratch, block pairs (even, odd) leave through a stage (flush_pair): each
       activation row's two half lines become one whole line (Zen 4, synthetic Gemma head,
       outputs in 2 MiB pages, interleaved, after / before: M = 64 int8 g64 / Q4 g32 / int8 per
       row 0.90 / 0.99 / 0.92, M = 256 0.98 / 0.98 / 0.87; bit for bit the same). NULL: stored
       per block. */
    uint16_t* st = wd ? aligned_alloc(64, M * 64) : NULL;
    for (int64_t nb = j->nb0; nb < j->nb1; nb++) {
        int64_t r0 = nb * 16, nr = j->V - r0 < 16 ? j->V - r0 : 16;
        __mmask16 mk = (__mmask16)((1u << nr) - 1);
        /* 1: the even block of a pair, 2: the odd one, 0: no pair (a range's odd ends) */
        const int half = !st ? 0 : nb & 1 ? (nb > j->nb0 ? 2 : 0) : (nb + 1 < j->nb1 ? 1 : 0);
        if (wd)
            for (int64_t p = 0; p < KP; p++) {
                PREFETCH(j, nb * KP + p);
                _mm512_store_si512(wd + p * 16, dec(j, nb * KP + p, tbl));
            }
        for (int64_t m0 = 0; m0 < M; m0 += mt) {
            int nm = M - m0 < mt ? (int)(M - m0) : mt;
            /* activation pairs are packed in tiles of 16 rows: [M/16][K/2][16] */
            const int32_t* xp = j->xp + ((m0 / 16) * KP) * 16 + (m0 % 16);
            const float* xs = j->xs ? j->xs + m0 * j->G : NULL;
            if (half) tile_s_any(nm, j, nb, wd, xp, xs, st + m0 * 32 + (half - 1) * 16, 32, mk);
            else if (wd) tile_s_any(nm, j, nb, wd, xp, xs, j->out + m0 * j->ldo + r0, j->ldo, mk);
            else tile_any(nm, j, nb, tbl, xp, xs, j->out + m0 * j->ldo + r0, mk);
        }
        if (half == 2) flush_pair(j, st, nb - 1, mk);
    }
    _mm_sfence(); /* the streamed lines visible before the caller's join */
    free(wd); free(st);
    return NULL;
}

/* logits[M, V] (bf16, row stride ldo) = x[M, K] (bf16) @ dequant(W)^T, on nthreads threads. */
int head_bf16(const uint8_t* w, const void* s, int skind, const int8_t* z, int bits, int64_t V, int64_t K,
              int64_t g, const uint16_t* x, int64_t M, uint16_t* out, int64_t ldo, int nthreads) {
    const int64_t G = K / g, NB = (V + 15) / 16, KP = K / 2, MB = (M + 15) / 16;
    float* xs = NULL;
    if (z) { /* per-group sums of the activations (asymmetric rows) */
        xs = malloc(M * G * sizeof(float));
        if (!xs) return 1;
        eq_group_sums(x, 1, M, K, g, xs);
    }
    /* Activations once per call: [M/16][K/2][16] bf16 pairs (a transpose, exact). */
    int32_t* xp = aligned_alloc(64, MB * KP * 64);
    const int32_t* x32 = (const int32_t*)x;
    for (int64_t mb = 0; mb < MB; mb++)
        for (int64_t p = 0; p < KP; p++)
            for (int64_t i = 0; i < 16; i++) {
                int64_t m = mb * 16 + i;
                xp[(mb * KP + p) * 16 + i] = m < M ? x32[m * KP + p] : 0;
            }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > NB) nthreads = (int)NB;
    if (nthreads > EQ_MAX_THREADS) nthreads = EQ_MAX_THREADS;
    job_t jobs[EQ_MAX_THREADS];
    for (int t = 0; t < nthreads; t++) {
        job_t jj = {w, s, z, xp, xs, out, ldo, M, K, G, g, V, NB * t / nthreads, NB * (t + 1) / nthreads, bits, skind};
        jobs[t] = jj;
    }
    eq_fanout(run, jobs, sizeof(job_t), nthreads);
    free(xs); free(xp);
    return 0;
}
