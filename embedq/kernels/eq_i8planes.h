/* int8 codes, one activation row (M == 1, the decode step): integer dot products.

   Part of native_f32.c (included after eq_q4planes.h in its AVX2 section: uses job_t, RB,
   scales16, group_out and the plane builder eqp_scan / eqp_next).

   Why: direct8 spends 13 vector instructions on a column pair of 16 rows (four widenings to
   int32 on the shuffle port, four conversions, four FMAs) and the int8 head at M == 1 did not
   keep the memory stream busy (Xeon with AMX, Gemma head: 165 MiB in ~8 ms where a plain read
   takes ~6). Here the pair's 32 codes widen to int16 in one instruction and meet the
   activation planes in vpmaddwd (vpdpwssd with VNNI): 16 rows x 2 columns per instruction.

   Exact as in eq_q4planes.h: each chunk of c <= 64 columns (c divides the group) is split into
   planes of int16 values m' over one power of two 2^B; per plane and row the chunk's integer
   sum  sum_k m'_k q_k  is exact in int32 (|.| <= 64 * 2^15 * 2^7 = 2^28). Its conversion to
   float rounds once (above 2^24), then times 2^B (exact) it is added to the group's float sum:
   one rounding per plane and chunk where direct8 rounds once per column pair, so within the
   same summation-order bound. A row with a value that fits no plane takes direct8. */

/* The chunk for group size g: the largest of 64, 32, ... 2 that divides it. */
static inline int64_t i8_chunk(int64_t g) {
    int64_t c = 64;
    while (g % c) c /= 2;
    return c;
}

/* One int8 plane: [c] int16, so pair p is the dword (m'_2p, m'_2p+1). */
static void i8_lay(int16_t* xp, const int32_t* v, int64_t c) {
    for (int64_t k = 0; k < c; k++) xp[k] = (int16_t)v[k];
}

/* 1 when every activation fits a plane (then P is filled; corr unused), 0 otherwise. */
static int i8planes_build(const float* x, int64_t K, int64_t g, q4planes_t* P) {
    return planes_build(x, K, i8_chunk(g), i8_chunk(g), 2, i8_lay, P);
}

/* One plane over CP column pairs of a block's codes b0 ([CP][16][2]): a[2] = the int32 sums of
   rows 0-7 and 8-15. nz: the pairs to take (all for the chunk's first plane; a later plane's
   values, below ~2^-7 of the chunk's largest, sit in 1-3 pairs of 32 mostly: Gemma 3 270M's
   hidden states need a second plane in 63 % of 64-column chunks). Integer sums of the same
   products whichever pairs are skipped, so the same bits. */
static inline __attribute__((always_inline)) void i8i_dots(const int8_t* b0, const int32_t* X, const int64_t CP,
                                                           const int dense, uint32_t nz, __m256i a[2]) {
#if EQ_AVX512 && !defined(EQ_SIMDE)
    /* a pair's 16 rows in one zmm (dword r: row r's two codes); even and odd pairs in two sums.
       Integer sums, so the ymm loop's values exactly. */
    __m512i A0 = _mm512_setzero_si512(), A1 = A0;
#define I8I_PAIR(P, A) A = Q4I_DP512(A, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(b0 + (P) * 32))), \
                                     _mm512_set1_epi32(X[P]))
    if (dense) {
        int64_t p = 0;
        for (; p + 1 < CP; p += 2) { I8I_PAIR(p, A0); I8I_PAIR(p + 1, A1); }
        if (p < CP) I8I_PAIR(p, A0);
        A0 = _mm512_add_epi32(A0, A1);
    } else for (; nz; nz &= nz - 1) I8I_PAIR(__builtin_ctz(nz), A0);
#undef I8I_PAIR
    a[0] = _mm512_castsi512_si256(A0); a[1] = _mm512_extracti64x4_epi64(A0, 1);
#else
    a[0] = a[1] = _mm256_setzero_si256();
#define I8I_PAIR(P) do {                                                                          \
        const __m256i x = _mm256_set1_epi32(X[P]);                                                \
        a[0] = Q4I_DP(a[0], _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b0 + (P) * 32))), x);      \
        a[1] = Q4I_DP(a[1], _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b0 + (P) * 32 + 16))), x); \
    } while (0)
    if (dense) for (int64_t p = 0; p < CP; p++) I8I_PAIR(p);
    else for (; nz; nz &= nz - 1) I8I_PAIR(__builtin_ctz(nz));
#undef I8I_PAIR
#endif
}

/* The 16 rows of block nb: o[16] = x . dequant(W)^T, from the planes. */
static void direct8i(const job_t* j, const q4planes_t* P, int64_t nb, const float* xs, float* o) {
    const int64_t KP = j->K / 2, G = j->G, c = P->chunk, CP = c / 2, NCG = j->g / c;
    const int8_t* wq = (const int8_t*)j->w + nb * KP * 32;
    __m256 o0 = _mm256_setzero_ps(), o1 = o0;  /* the block's sums (group_acc) */
    for (int64_t gi = 0; gi < G; gi++) {
        __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps();
        for (int64_t ci = gi * NCG; ci < (gi + 1) * NCG; ci++) {
            const int8_t* b0 = wq + ci * CP * 32;
            /* the chunk 4 KiB ahead (without: 1.27x the time from memory) */
            for (int64_t k = 0; k < CP * 32; k += 64) EQ_PREFETCH(b0 + k);
            for (int q = P->off[ci]; q < P->off[ci + 1]; q++) {
                const int32_t* X = (const int32_t*)(P->x + (int64_t)q * c);
                __m256i a[2];
                if (q > P->off[ci]) i8i_dots(b0, X, CP, 0, P->nz[q], a);
                else if (CP == 32) i8i_dots(b0, X, 32, 1, 0, a);  /* unrolled */
                else i8i_dots(b0, X, CP, 1, 0, a);
                const __m256 m = _mm256_set1_ps(P->mul[q]);
                t0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[0]), m, t0);
                t1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[1]), m, t1);
            }
        }
        __m256 s0, s1;
        scales16(j, (nb * G + gi) * RB, &s0, &s1);
        group_acc(j, nb, gi, j->z ? xs[gi] : 0.0f, s0, s1, t0, t1, &o0, &o1);
    }
    _mm256_storeu_ps(o, o0);
    _mm256_storeu_ps(o + 8, o1);
}
