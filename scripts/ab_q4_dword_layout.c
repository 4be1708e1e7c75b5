/* Kernel A/B prototype for the next layout step of issue 40 (not part of the package):
   4-bit codes at M = 1, one exact int16 activation plane per group of 32 (eq_q4planes.h's
   arithmetic), today's native nibble layout (A: a byte = two columns of one row, 16 rows per
   column pair; 17 vector instructions per 64 codes) against "8 columns of one row per dword"
   (B1: 5-op decode, two int32 sums with weights 1 and 16; B2: 4-op decode, three sums with
   weights 1, 16, 256, folded exactly by arithmetic shifts at the group's end: 12 instructions
   per 64 codes, no cross-lane permute). Synthetic 262,144 x 640 table (84 MB, larger than any
   L3 here), outputs compared bit for bit, interleaved medians.

       gcc -O3 -mavx2 -mfma -mf16c -fopenmp scripts/ab_q4_dword_layout.c -o /tmp/ab && OMP_NUM_THREADS=2 /tmp/ab 30

   Since the fourteenth session the layout is in the package (opt-in: layouts.NativeQ4D,
   EMBEDQ_SERVE_KERNEL=native_q4d; B2 in eq_q4planes.h). On an Emerald Rapids the real kernel
   measured 0.82-0.86 at M = 1 (this prototype 0.58-0.65 the same minutes) and the Gemma head
   on real hidden states equal within noise: docs/performance.md, "The dword layout in the package".

   B2's weight-256 sum is < 2^30 for g32 (8 products of < 2^22 each, times 256); g64 needs
   B1's two sums or a split group. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define N 262144
#define K 640
#define G 32
#define NG (K / G)
#define NB (N / 16)

static uint8_t codes[N][K]; /* logical codes 0..15 */
static int16_t xi[K];       /* one plane: int16 activations */
static float sc[N / 16][NG][16];

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

/* ---- A: today's layout: block nb, group gi, pair p: 16 bytes (rows), lo nibble col 2p, hi 2p+1 */
static uint8_t* WA;
static int16_t XA[K / 2 * 8]; /* per it (two pairs): (x2p, x2p+1) x 4 | (x2p+2, x2p+3) x 4 */
static void packA(void) {
    WA = aligned_alloc(64, (size_t)N * K / 2);
    for (int64_t nb = 0; nb < NB; nb++)
        for (int p = 0; p < K / 2; p++)
            for (int r = 0; r < 16; r++)
                WA[(nb * (K / 2) + p) * 16 + r] = codes[nb * 16 + r][2 * p] | (codes[nb * 16 + r][2 * p + 1] << 4);
    for (int it = 0; it < K / 4; it++)
        for (int lane = 0; lane < 2; lane++)
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < 2; c++) XA[it * 16 + lane * 8 + 2 * r + c] = xi[4 * it + 2 * lane + c];
}
static void runA(float* out) {
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < NB; nb++) {
        const uint8_t* wb = WA + nb * (K / 2) * 16;
        __m256 o0 = _mm256_setzero_ps(), o1 = _mm256_setzero_ps();
        for (int gi = 0; gi < NG; gi++) {
            const uint8_t* b0 = wb + gi * (G / 2) * 16;
            for (int c = 0; c < G / 2 * 16; c += 64) __builtin_prefetch(b0 + c + 4096, 0, 3);
            const __m256i m4 = _mm256_set1_epi8(0x0f), zero = _mm256_setzero_si256();
            __m256i a[4] = {zero, zero, zero, zero};
            const int16_t* X0 = XA + gi * (G / 4) * 16;
#pragma GCC unroll 8
            for (int it = 0; it < G / 4; it++) {
                const __m256i w = _mm256_loadu_si256((const __m256i*)(b0 + it * 32));
                const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                const __m256i u0 = _mm256_unpacklo_epi8(lo, hi), u1 = _mm256_unpackhi_epi8(lo, hi);
                const __m256i c[4] = {_mm256_unpacklo_epi8(u0, zero), _mm256_unpackhi_epi8(u0, zero),
                                      _mm256_unpacklo_epi8(u1, zero), _mm256_unpackhi_epi8(u1, zero)};
                const __m256i x0 = _mm256_loadu_si256((const __m256i*)(X0 + it * 16));
                for (int r = 0; r < 4; r++) a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(c[r], x0));
            }
            const __m256i r0 = _mm256_add_epi32(_mm256_permute2x128_si256(a[0], a[1], 0x20), _mm256_permute2x128_si256(a[0], a[1], 0x31));
            const __m256i r1 = _mm256_add_epi32(_mm256_permute2x128_si256(a[2], a[3], 0x20), _mm256_permute2x128_si256(a[2], a[3], 0x31));
            const __m256 m = _mm256_set1_ps(0.5f);
            const __m256 t0 = _mm256_mul_ps(_mm256_cvtepi32_ps(r0), m), t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(r1), m);
            o0 = _mm256_fmadd_ps(t0, _mm256_loadu_ps(sc[nb][gi]), o0);
            o1 = _mm256_fmadd_ps(t1, _mm256_loadu_ps(sc[nb][gi] + 8), o1);
        }
        _mm256_storeu_ps(out + nb * 16, o0);
        _mm256_storeu_ps(out + nb * 16 + 8, o1);
    }
}

/* ---- B: block nb, chunk of 8 columns ch: 16 dwords (rows), nibble j = column 8ch + (j%2)*4 + j/2
   so that word 0 holds columns 0..3 at nibbles 0..3 and word 1 columns 4..7. */
static uint32_t* WB;
static int32_t XB[K / 8][4]; /* per chunk: dword (x_k, x_k+4) for k = 0..3 */
static void packB(void) {
    WB = aligned_alloc(64, (size_t)N * K / 2);
    for (int64_t nb = 0; nb < NB; nb++)
        for (int ch = 0; ch < K / 8; ch++)
            for (int r = 0; r < 16; r++) {
                uint32_t d = 0;
                for (int c = 0; c < 8; c++) d |= (uint32_t)codes[nb * 16 + r][8 * ch + c] << (4 * (c % 4) + 16 * (c / 4));
                WB[(nb * (K / 8) + ch) * 16 + r] = d;
            }
    for (int ch = 0; ch < K / 8; ch++)
        for (int k = 0; k < 4; k++)
            XB[ch][k] = (uint16_t)xi[8 * ch + k] | ((uint32_t)(uint16_t)xi[8 * ch + k + 4] << 16);
}
static inline __m256i bx(int ch, int k) { return _mm256_set1_epi32(XB[ch][k]); }
static void runB(float* out, int variant) {
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < NB; nb++) {
        const uint32_t* wb = WB + nb * (K / 8) * 16;
        __m256 o0 = _mm256_setzero_ps(), o1 = _mm256_setzero_ps();
        const __m256i f = _mm256_set1_epi16(0x000f), f1 = _mm256_set1_epi16(0x00f0), f2 = _mm256_set1_epi16(0x0f00);
        for (int gi = 0; gi < NG; gi++) {
            const uint32_t* b0 = wb + gi * (G / 8) * 16;
            for (int c = 0; c < G / 8 * 64; c += 64) __builtin_prefetch((const char*)b0 + c + 4096, 0, 3);
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, c0 = a0, c1 = a0, c2 = a0;
#pragma GCC unroll 4
            for (int ch = 0; ch < G / 8; ch++) {
                const int cg = gi * (G / 8) + ch;
                const __m256i x0 = bx(cg, 0), x1 = bx(cg, 1), x2 = bx(cg, 2), x3 = bx(cg, 3);
                for (int h = 0; h < 2; h++) {
                    const __m256i d = _mm256_loadu_si256((const __m256i*)(b0 + ch * 16 + h * 8));
                    __m256i s0, s1, s2;
                    if (variant == 1) {
                        s0 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(d, f), x0),
                                              _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(d, 8), f), x2));
                        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_srli_epi16(d, 12), x3));
                        s1 = _mm256_madd_epi16(_mm256_and_si256(d, f1), x1);
                        s2 = _mm256_setzero_si256();
                    } else {
                        s0 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(d, f), x0),
                                              _mm256_madd_epi16(_mm256_srli_epi16(d, 12), x3));
                        s1 = _mm256_madd_epi16(_mm256_and_si256(d, f1), x1);
                        s2 = _mm256_madd_epi16(_mm256_and_si256(d, f2), x2);
                    }
                    if (h == 0) { a0 = _mm256_add_epi32(a0, s0); a1 = _mm256_add_epi32(a1, s1); a2 = _mm256_add_epi32(a2, s2); }
                    else { c0 = _mm256_add_epi32(c0, s0); c1 = _mm256_add_epi32(c1, s1); c2 = _mm256_add_epi32(c2, s2); }
                }
            }
            const __m256i r0 = _mm256_add_epi32(_mm256_add_epi32(a0, _mm256_srai_epi32(a1, 4)), _mm256_srai_epi32(a2, 8));
            const __m256i r1 = _mm256_add_epi32(_mm256_add_epi32(c0, _mm256_srai_epi32(c1, 4)), _mm256_srai_epi32(c2, 8));
            const __m256 m = _mm256_set1_ps(0.5f);
            const __m256 t0 = _mm256_mul_ps(_mm256_cvtepi32_ps(r0), m), t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(r1), m);
            o0 = _mm256_fmadd_ps(t0, _mm256_loadu_ps(sc[nb][gi]), o0);
            o1 = _mm256_fmadd_ps(t1, _mm256_loadu_ps(sc[nb][gi] + 8), o1);
        }
        _mm256_storeu_ps(out + nb * 16, o0);
        _mm256_storeu_ps(out + nb * 16 + 8, o1);
    }
}

static int cmpd(const void* a, const void* b) { double x = *(double*)a, y = *(double*)b; return (x > y) - (x < y); }

int main(int argc, char** argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 30;
    srand(1);
    for (int64_t r = 0; r < N; r++) for (int k = 0; k < K; k++) codes[r][k] = rand() & 15;
    for (int k = 0; k < K; k++) xi[k] = (int16_t)((rand() % 32767) - 16383);
    for (int64_t b = 0; b < NB; b++) for (int g = 0; g < NG; g++) for (int r = 0; r < 16; r++) sc[b][g][r] = 1.0f / (1 + r);
    packA(); packB();
    float *oA = aligned_alloc(64, N * 4), *oB1 = aligned_alloc(64, N * 4), *oB2 = aligned_alloc(64, N * 4);
    runA(oA); runB(oB1, 1); runB(oB2, 2);
    printf("B1 == A: %d, B2 == A: %d (threads %d)\n", !memcmp(oA, oB1, N * 4), !memcmp(oA, oB2, N * 4), omp_get_max_threads());
    double tA[200], tB1[200], tB2[200];
    for (int i = 0; i < reps; i++) {
        double t = now(); runA(oA); tA[i] = now() - t;
        t = now(); runB(oB1, 1); tB1[i] = now() - t;
        t = now(); runB(oB2, 2); tB2[i] = now() - t;
    }
    qsort(tA, reps, 8, cmpd); qsort(tB1, reps, 8, cmpd); qsort(tB2, reps, 8, cmpd);
    printf("median ms: A %.2f  B1 %.2f (%.2f)  B2 %.2f (%.2f)\n", 1e3 * tA[reps / 2], 1e3 * tB1[reps / 2],
           tB1[reps / 2] / tA[reps / 2], 1e3 * tB2[reps / 2], tB2[reps / 2] / tA[reps / 2]);
    return 0;
}
