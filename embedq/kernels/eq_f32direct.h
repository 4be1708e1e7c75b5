/* The small-M direct path of native_f32.c (M <= pass_m(bits), rows in passes of two), its
   per-block dots: int8 (direct8) and 4-bit (direct4) decoded in registers. Textually part of
   native_f32.c (included inside its #if EQ_AVX2, after job_t, group_params and store_row);
   a header only to keep each file readable at once. */
#ifndef EQ_F32DIRECT_H
#define EQ_F32DIRECT_H

/* ---- small M (decode-bound: the common decode batch), two rows per pass: codes decoded in registers ----
   No scratch round trip: each code is widened and converted once and used by the nm rows
   right away; the group's scale is applied after its dot and asymmetric rows subtract
   z * sum(x_group) first (x . ((q - z) s) = s (x . q - z sum x): the reference value up to
   float32 rounding, within the summation-order bound). */
enum { DIRECT_M = 2 };

static inline void scales16(const job_t* j, int64_t i0, __m256* s0, __m256* s1) {
    if (j->skind == 0) { *s0 = _mm256_loadu_ps((const float*)j->s + i0); *s1 = _mm256_loadu_ps((const float*)j->s + i0 + 8); return; }
    __m128i a = _mm_loadu_si128((const __m128i*)((const uint16_t*)j->s + i0));
    __m128i b = _mm_loadu_si128((const __m128i*)((const uint16_t*)j->s + i0 + 8));
    if (j->skind == 2) { *s0 = _mm256_cvtph_ps(a); *s1 = _mm256_cvtph_ps(b); return; }
    *s0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
    *s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

/* Group gi's dot for the 16 rows (t0: rows 0-7, t1: 8-15) into the block's sums o0, o1: minus
   z * sum(x_group) for asymmetric rows, times the scales, added to the earlier groups' (gi == 0:
   set). The M = 1 plane paths keep o0, o1 in registers for the whole block (the stores and
   reloads of a 16-float array per group were a chain through store forwarding: Gemma head Q4 g32
   M = 1, Zen 4, AVX2 build, 0.98x the time); group_out is the same through memory. */
static inline void group_acc(const job_t* j, int64_t nb, int64_t gi, float xsum, __m256 s0, __m256 s1,
                             __m256 t0, __m256 t1, __m256* o0, __m256* o1) {
    if (j->z) {
        const __m256 xv = _mm256_set1_ps(xsum);
        const int8_t* zz = j->z + (nb * j->G + gi) * RB;
        t0 = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)zz))), xv, t0);
        t1 = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(zz + 8)))), xv, t1);
    }
    if (gi == 0) { *o0 = _mm256_mul_ps(t0, s0); *o1 = _mm256_mul_ps(t1, s1); }
    else { *o0 = _mm256_fmadd_ps(t0, s0, *o0); *o1 = _mm256_fmadd_ps(t1, s1, *o1); }
}

static inline void group_out(const job_t* j, int64_t nb, int64_t gi, float xsum, __m256 s0, __m256 s1,
                             __m256 t0, __m256 t1, float* o) {
    __m256 o0 = gi ? _mm256_loadu_ps(o) : _mm256_setzero_ps(), o1 = gi ? _mm256_loadu_ps(o + 8) : o0;
    group_acc(j, nb, gi, xsum, s0, s1, t0, t1, &o0, &o1);
    _mm256_storeu_ps(o, o0);
    _mm256_storeu_ps(o + 8, o1);
}

/* int8: the stored pairs [r c0, r c1] stay interleaved in the lanes (vpmovsxbd straight
   from memory, no shuffle) and meet a broadcast (x[2p], x[2p+1]); a horizontal add per
   group folds the column parity. acc[i][q]: rows 4q..4q+3, both parities. */
static inline __attribute__((always_inline)) void direct8(const int nm, const job_t* j, int64_t nb,
        const float* xs, float* o /* [nm][16] */) {
    const int64_t KP = j->K / 2, PG = j->g / 2, G = j->G, K = j->K;
    const int8_t* wq = (const int8_t*)j->w + nb * KP * 32;
    for (int64_t gi = 0; gi < G; gi++) {
        __m256 acc[2][4];
        for (int i = 0; i < 2; i++) for (int q = 0; q < 4; q++) acc[i][q] = _mm256_setzero_ps();
        /* one row (nm == 1): even and odd pairs into two accumulator sets, 8 FMA chains
           (one set leaves 4, and FMA latency would bound the loop) */
#define PAIR8(P, I, A) do {                                                                       \
            const int8_t* c = wq + (P) * 32;                                                      \
            EQ_PREFETCH(c); /* Xeon, AVX-512F build: int8 g64 M = 1 13.2 -> 9.7 ms */           \
            const __m256 xd = _mm256_castpd_ps(_mm256_broadcast_sd((const double*)(j->x + (I) * K + 2 * (P)))); \
            for (int q = 0; q < 4; q++)                                                           \
                A[q] = _mm256_fmadd_ps(xd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(               \
                           _mm_loadl_epi64((const __m128i*)(c + 8 * q)))), A[q]);                 \
        } while (0)
        int64_t p = gi * PG;
        const int64_t pe = (gi + 1) * PG;
        if (nm == 1)
            for (; p + 1 < pe; p += 2) { PAIR8(p, 0, acc[0]); PAIR8(p + 1, 0, acc[1]); }
        for (; p < pe; p++) {
            if (nm == 1) { PAIR8(p, 0, acc[0]); continue; }
            /* two rows: each decoded code serves both (decode once, 8 chains) */
            const int8_t* c = wq + p * 32;
            EQ_PREFETCH(c);  /* M = 2 19.0 -> 10.1 ms */
            const __m256 x0 = _mm256_castpd_ps(_mm256_broadcast_sd((const double*)(j->x + 2 * p)));
            const __m256 x1 = _mm256_castpd_ps(_mm256_broadcast_sd((const double*)(j->x + K + 2 * p)));
            for (int q = 0; q < 4; q++) {
                __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(c + 8 * q))));
                acc[0][q] = _mm256_fmadd_ps(x0, w, acc[0][q]);
                acc[1][q] = _mm256_fmadd_ps(x1, w, acc[1][q]);
            }
        }
#undef PAIR8
        if (nm == 1)
            for (int q = 0; q < 4; q++) acc[0][q] = _mm256_add_ps(acc[0][q], acc[1][q]);
        __m256 s0, s1;
        scales16(j, (nb * G + gi) * RB, &s0, &s1);
        for (int i = 0; i < nm; i++) {
            /* hadd: rows [0 1 4 5 | 2 3 6 7] -> permute to 0..7 */
            __m256 t0 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(acc[i][0], acc[i][1])), 0xD8));
            __m256 t1 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(acc[i][2], acc[i][3])), 0xD8));
            group_out(j, nb, gi, j->z ? xs[i * G + gi] : 0.0f, s0, s1, t0, t1, o + i * RB);
        }
    }
}

/* 4-bit: low nibbles = column 2p of the 16 rows, high = 2p+1; q = u - 8 in int8 (exact)
   before the conversion, so the dot is x . q as in the reference (no 8 * sum(x) to cancel).
   acc[i][c][h]: column parity c, rows 8h..8h+7. */
static inline __attribute__((always_inline)) void direct4(const int nm, const job_t* j, int64_t nb,
        const float* xs, float* o) {
    const int64_t KP = j->K / 2, PG = j->g / 2, G = j->G, K = j->K;
    const uint8_t* wb = j->w + nb * KP * 16;
    const __m128i m4 = _mm_set1_epi8(0x0f), e8 = _mm_set1_epi8(8);
    const __m256i e8w = _mm256_set1_epi32(8), m15 = _mm256_set1_epi32(15);
    (void)m4; (void)e8; (void)e8w; (void)m15; (void)wb;
    for (int64_t gi = 0; gi < G; gi++) {
        __m256 acc[2][2][2];
        for (int i = 0; i < 2; i++) for (int c = 0; c < 2; c++) acc[i][c][0] = acc[i][c][1] = _mm256_setzero_ps();
        /* nm == 1: even/odd pairs into acc[0] / acc[1] (8 FMA chains, as in direct8) */
#define PAIR4_W(P)                                                                                \
            EQ_PREFETCH(wb + (P) * 16);  /* Q4 g32 M = 2 19.8 -> 6.0 ms */                       \
            __m128i b = _mm_loadu_si128((const __m128i*)(wb + (P) * 16));                         \
            __m128i lo = _mm_sub_epi8(_mm_and_si128(b, m4), e8);                                  \
            __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m4), e8);               \
            __m256 w00 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));                            \
            __m256 w01 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));         \
            __m256 w10 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));                            \
            __m256 w11 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
/* the dword layout (EQ_Q4D): pair SUB (a constant) of the chunk in d0 / d1, the same values */
#define PAIR4_DW(SUB)                                                                             \
            __m256 w00 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(d0, 8 * (SUB)), m15), e8w)); \
            __m256 w01 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(d1, 8 * (SUB)), m15), e8w)); \
            __m256 w10 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(d0, 8 * (SUB) + 4), m15), e8w)); \
            __m256 w11 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(d1, 8 * (SUB) + 4), m15), e8w));
#define PAIR4_ACC(P, NM, A0)                                                                      \
            for (int i = 0; i < (NM); i++) {                                                      \
                const __m256 x0 = _mm256_broadcast_ss(j->x + i * K + 2 * (P));                    \
                const __m256 x1 = _mm256_broadcast_ss(j->x + i * K + 2 * (P) + 1);                \
                acc[(A0) + i][0][0] = _mm256_fmadd_ps(x0, w00, acc[(A0) + i][0][0]);              \
                acc[(A0) + i][0][1] = _mm256_fmadd_ps(x0, w01, acc[(A0) + i][0][1]);              \
                acc[(A0) + i][1][0] = _mm256_fmadd_ps(x1, w10, acc[(A0) + i][1][0]);              \
                acc[(A0) + i][1][1] = _mm256_fmadd_ps(x1, w11, acc[(A0) + i][1][1]);              \
            }
#define PAIR4(P, NM, A0) do { PAIR4_W(P) PAIR4_ACC(P, NM, A0) } while (0)
        int64_t p = gi * PG;
        const int64_t pe = (gi + 1) * PG;
#if EQ_Q4DW  /* whole chunks of 4 pairs, in the pair layout's order (so its sums, bit for bit) */
        for (; p < pe; p += 4) {
            const uint32_t* dw = (const uint32_t*)j->w + (nb * (K / 8) + p / 4) * RB;
            EQ_PREFETCH(dw);
            const __m256i d0 = _mm256_loadu_si256((const __m256i*)dw), d1 = _mm256_loadu_si256((const __m256i*)(dw + 8));
            if (nm == 1) {
                { PAIR4_DW(0) PAIR4_ACC(p, 1, 0) } { PAIR4_DW(1) PAIR4_ACC(p + 1, 1, 1) }
                { PAIR4_DW(2) PAIR4_ACC(p + 2, 1, 0) } { PAIR4_DW(3) PAIR4_ACC(p + 3, 1, 1) }
            } else {
                { PAIR4_DW(0) PAIR4_ACC(p, nm, 0) } { PAIR4_DW(1) PAIR4_ACC(p + 1, nm, 0) }
                { PAIR4_DW(2) PAIR4_ACC(p + 2, nm, 0) } { PAIR4_DW(3) PAIR4_ACC(p + 3, nm, 0) }
            }
        }
#else
        if (nm == 1)
            for (; p + 1 < pe; p += 2) { PAIR4(p, 1, 0); PAIR4(p + 1, 1, 1); }
        for (; p < pe; p++) PAIR4(p, nm, 0);
#endif
#undef PAIR4
#undef PAIR4_W
#undef PAIR4_DW
#undef PAIR4_ACC
        if (nm == 1)
            for (int c = 0; c < 2; c++) for (int h = 0; h < 2; h++) acc[0][c][h] = _mm256_add_ps(acc[0][c][h], acc[1][c][h]);
        __m256 s0, s1;
        scales16(j, (nb * G + gi) * RB, &s0, &s1);
        for (int i = 0; i < nm; i++) {
            __m256 t0 = _mm256_add_ps(acc[i][0][0], acc[i][1][0]), t1 = _mm256_add_ps(acc[i][0][1], acc[i][1][1]);
            group_out(j, nb, gi, j->z ? xs[i * G + gi] : 0.0f, s0, s1, t0, t1, o + i * RB);
        }
    }
}

#endif
