/* The float32 micro-kernels of native_f32.c (included there once; RB, KC, MR, EQ_AVX512 and
   EQ_AVX2 come from it). */
#ifndef EQ_F32MICRO_H
#define EQ_F32MICRO_H

/* acc[nm][16] (row stride lda) (+)= x[nm][kc] (row stride ldx) . w[kc][16].
   nm <= 2 keeps NS independent accumulator sets over interleaved k (FMA latency:
   2 x nm x NS chains in flight). */
static inline __attribute__((always_inline)) void micro(const int nm, const float* restrict w, int64_t kc,
        const float* restrict x, int64_t ldx, float* restrict acc, int64_t lda, int first) {
    enum { NS = 4 };
    const int ns = nm == 1 ? 4 : nm == 2 ? 2 : 1;
#if EQ_AVX512
    __m512 a[NS][MR];
    for (int s = 0; s < ns; s++)
        for (int i = 0; i < nm; i++)
            a[s][i] = s || first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + i * lda);
    int64_t k = 0;
    for (; k + ns <= kc; k += ns)
        for (int s = 0; s < ns; s++) {
            const __m512 w0 = _mm512_loadu_ps(w + (k + s) * RB);
            for (int i = 0; i < nm; i++)
                a[s][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k + s]), w0, a[s][i]);
        }
    for (; k < kc; k++) {
        const __m512 w0 = _mm512_loadu_ps(w + k * RB);
        for (int i = 0; i < nm; i++)
            a[0][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k]), w0, a[0][i]);
    }
    for (int i = 0; i < nm; i++) {
        __m512 t = a[0][i];
        for (int s = 1; s < ns; s++) t = _mm512_add_ps(t, a[s][i]);
        _mm512_storeu_ps(acc + i * lda, t);
    }
#elif EQ_AVX2
    __m256 a[NS][MR][2];
    for (int s = 0; s < ns; s++)
        for (int i = 0; i < nm; i++) {
            a[s][i][0] = s || first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + i * lda);
            a[s][i][1] = s || first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + i * lda + 8);
        }
    int64_t k = 0;
    for (; k + ns <= kc; k += ns)
        for (int s = 0; s < ns; s++) {
            const __m256 w0 = _mm256_loadu_ps(w + (k + s) * RB), w1 = _mm256_loadu_ps(w + (k + s) * RB + 8);
            for (int i = 0; i < nm; i++) {
                const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k + s);
                a[s][i][0] = _mm256_fmadd_ps(xb, w0, a[s][i][0]);
                a[s][i][1] = _mm256_fmadd_ps(xb, w1, a[s][i][1]);
            }
        }
    for (; k < kc; k++) {
        const __m256 w0 = _mm256_loadu_ps(w + k * RB), w1 = _mm256_loadu_ps(w + k * RB + 8);
        for (int i = 0; i < nm; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);
            a[0][i][0] = _mm256_fmadd_ps(xb, w0, a[0][i][0]);
            a[0][i][1] = _mm256_fmadd_ps(xb, w1, a[0][i][1]);
        }
    }
    for (int i = 0; i < nm; i++) {
        __m256 t0 = a[0][i][0], t1 = a[0][i][1];
        for (int s = 1; s < ns; s++) { t0 = _mm256_add_ps(t0, a[s][i][0]); t1 = _mm256_add_ps(t1, a[s][i][1]); }
        _mm256_storeu_ps(acc + i * lda, t0);
        _mm256_storeu_ps(acc + i * lda + 8, t1);
    }
#else
    float a[NS][MR][RB];
    for (int s = 0; s < ns; s++)
        for (int i = 0; i < nm; i++)
            for (int r = 0; r < RB; r++) a[s][i][r] = s || first ? 0.0f : acc[i * lda + r];
    int64_t k = 0;
    for (; k + ns <= kc; k += ns)
        for (int s = 0; s < ns; s++)
            for (int i = 0; i < nm; i++) {
                const float xv = x[i * ldx + k + s];
                for (int r = 0; r < RB; r++) a[s][i][r] += xv * w[(k + s) * RB + r];
            }
    for (; k < kc; k++)
        for (int i = 0; i < nm; i++) {
            const float xv = x[i * ldx + k];
            for (int r = 0; r < RB; r++) a[0][i][r] += xv * w[k * RB + r];
        }
    for (int i = 0; i < nm; i++)
        for (int r = 0; r < RB; r++) {
            float t = a[0][i][r];
            for (int s = 1; s < ns; s++) t += a[s][i][r];
            acc[i * lda + r] = t;
        }
#endif
}

#define C(n) case n: micro(n, w, kc, x, ldx, acc, lda, first); break;
static void micro_any(int nm, const float* w, int64_t kc, const float* x, int64_t ldx, float* acc,
                      int64_t lda, int first) {
    switch (nm) { C(1) C(2) C(3) C(4) C(5) C(6) }
}
#undef C

#if EQ_AVX512
/* micro over the 4 blocks of a super-block at once (block q: w + q * KC * RB, acc + q * RB):
   nm x 4 zmm accumulators (24 at MR = 6) meet 4 weight loads and nm broadcasts per k, where
   one block at a time meets 1 load and nm broadcasts per nm FMAs (load-bound). Each
   (row, block) sums the same FMAs in the same order and split as micro: bit-identical. */
static inline __attribute__((always_inline)) void micro4(const int nm, const float* restrict w, int64_t kc,
        const float* restrict x, int64_t ldx, float* restrict acc, int64_t lda, int first) {
    enum { NS = 4, NQ = 4 };
    const int ns = nm == 1 ? 4 : nm == 2 ? 2 : 1;
    __m512 a[NS][MR][NQ];
    for (int s = 0; s < ns; s++)
        for (int i = 0; i < nm; i++)
            for (int q = 0; q < NQ; q++)
                a[s][i][q] = s || first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + i * lda + q * RB);
    int64_t k = 0;
#define STEP(S, K_) do {                                                                           \
        __m512 w_[NQ];                                                                            \
        for (int q = 0; q < NQ; q++) w_[q] = _mm512_loadu_ps(w + q * KC * RB + (K_) * RB);        \
        for (int i = 0; i < nm; i++) {                                                            \
            const __m512 xb = _mm512_set1_ps(x[i * ldx + (K_)]);                                  \
            for (int q = 0; q < NQ; q++) a[S][i][q] = _mm512_fmadd_ps(xb, w_[q], a[S][i][q]);     \
        }                                                                                         \
    } while (0)
    for (; k + ns <= kc; k += ns)
        for (int s = 0; s < ns; s++) STEP(s, k + s);
    for (; k < kc; k++) STEP(0, k);
#undef STEP
    for (int i = 0; i < nm; i++)
        for (int q = 0; q < NQ; q++) {
            __m512 t = a[0][i][q];
            for (int s = 1; s < ns; s++) t = _mm512_add_ps(t, a[s][i][q]);
            _mm512_storeu_ps(acc + i * lda + q * RB, t);
        }
}

#define C(n) case n: micro4(n, w, kc, x, ldx, acc, lda, first); break;
static void micro4_any(int nm, const float* w, int64_t kc, const float* x, int64_t ldx, float* acc,
                       int64_t lda, int first) {
    switch (nm) { C(1) C(2) C(3) C(4) C(5) C(6) }
}
#undef C
#endif

#endif
