/* Vector instruction rates on this CPU (not part of the package): ns per zmm vfmadd231ps,
   vdpbf16ps, vpdpbusd and vpdpwssd, 12 independent chains (no latency bound), one thread,
   or one per core with an argument. The facts behind the AVX512-BF16 rows' order in
   embedq/kernels/dispatch.py (docs/performance.md, twentieth session); the mixes (two kinds
   interleaved) and the ymm rows: whether they share ports (twenty-third session).

     gcc -O3 -march=native scripts/vec_rates.c -o vec_rates -lpthread && ./vec_rates && ./vec_rates 2

   Needs AVX512-BF16 and AVX512-VNNI. Run it alone. */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define N 20000000L
#define BODY(OP) {                                                                            \
    __m512 a[12];                                                                             \
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(i * 1e-9f);                            \
    __m512 x = _mm512_set1_ps(1e-9f), y = _mm512_set1_ps(1e-9f);                              \
    for (long n = 0; n < N; n++) {                                                            \
        _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) a[i] = OP;                      \
        __asm__ volatile("" : "+v"(x));                                                       \
    }                                                                                         \
    __m512 s = a[0];                                                                          \
    for (int i = 1; i < 12; i++) s = _mm512_add_ps(s, a[i]);                                  \
    volatile float r = _mm512_reduce_add_ps(s); (void)r; }
#define I(v) _mm512_castps_si512(v)
static void fmaz(void) BODY(_mm512_fmadd_ps(x, y, a[i]))
static void dpbf(void) BODY(_mm512_dpbf16_ps(a[i], (__m512bh)x, (__m512bh)y))
static void dpbusd(void) BODY(_mm512_castsi512_ps(_mm512_dpbusd_epi32(I(a[i]), I(x), I(y))))
static void dpwssd(void) BODY(_mm512_castsi512_ps(_mm512_dpwssd_epi32(I(a[i]), I(x), I(y))))
/* two kinds interleaved, 6 chains each: do they issue side by side (half the time of 12 of one)? */
#define MIX(OP0, OP1) BODY((i & 1 ? (OP1) : (OP0)))
static void dpbf_dpwssd(void) MIX(_mm512_dpbf16_ps(a[i], (__m512bh)x, (__m512bh)y),
                                  _mm512_castsi512_ps(_mm512_dpwssd_epi32(I(a[i]), I(x), I(y))))
/* ymm (the AVX2 kernels' M = 1 planes: vpmaddwd and the code unpacks, eq_q4planes.h) */
#define Y(v) _mm512_castsi256_si512(v)
#define L(v) _mm512_castsi512_si256(I(v))
static void maddwd256(void) BODY(_mm512_castsi512_ps(Y(_mm256_madd_epi16(L(a[i]), L(x)))))
static void unpack256(void) BODY(_mm512_castsi512_ps(Y(_mm256_unpacklo_epi8(L(a[i]), L(x)))))
static void madd_unpack256(void) MIX(_mm512_castsi512_ps(Y(_mm256_madd_epi16(L(a[i]), L(x)))),
                                     _mm512_castsi512_ps(Y(_mm256_unpacklo_epi8(L(a[i]), L(x)))))
static void (*fns[])(void) = {fmaz, dpbf, dpbusd, dpwssd, dpbf_dpwssd, maddwd256, unpack256, madd_unpack256};
static const char* names[] = {"vfmadd231ps (16 MACs)", "vdpbf16ps (32)", "vpdpbusd (64)", "vpdpwssd (32)",
                              "vdpbf16ps + vpdpwssd", "vpmaddwd ymm", "vpunpcklbw ymm", "vpmaddwd + vpunpcklbw ymm"};
static int cur;
static void* th(void* a) { (void)a; fns[cur](); return 0; }

int main(int argc, char** argv) {
    (void)argv;
    const int T = argc > 1 ? 2 : 1;
    for (int rep = 0; rep < 2; rep++)
        for (cur = 0; cur < 8; cur++) {
            pthread_t t[2];
            const double t0 = now();
            for (int i = 0; i < T; i++) pthread_create(&t[i], 0, th, 0);
            for (int i = 0; i < T; i++) pthread_join(t[i], 0);
            printf("%-22s %d thread(s): %.3f ns per instruction per thread\n", names[cur], T,
                   (now() - t0) / (N * 12.0) * 1e9);
        }
    return 0;
}
