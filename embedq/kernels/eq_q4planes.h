/* 4-bit codes, one or two activation rows (M <= 2, the decode step): integer dot products.

   Part of native_f32.c (included in its AVX2 section: uses job_t, RB, scales16, group_out).

   Why: the float path spends ~19 vector instructions on 32 codes (widen, convert, FMA per
   column); the 4-bit head at M == 1 was bound by that, not by memory. Here the codes stay
   bytes and meet the activations in vpmaddubsw (unsigned code x signed byte, two products
   and their sum per 16-bit lane): ~13 instructions per 64 codes; the codes unpacked once
   serve two planes (of one row or of both).

   Exact: an activation x_k = M_k 2^f_k (M_k odd). Within a group, columns whose values fit
   a 15-bit integer over one base exponent B share a "plane": m'_k = M_k 2^(f_k - B), an
   exact integer, |m'_k| < 2^15, stored as two signed bytes m' = 256 h + l (l in -128..127;
   h in -128..127, which excludes m' >= 32640: a plane whose largest value would reach it
   takes B + 1). Every column of the group lies in exactly one plane (greedy, from the
   largest value down; a bf16 or f16 activation always fits: 8 / 11 significant bits).
   Per plane and row sum_k u_k l_k and sum_k u_k h_k are exact 16-bit sums over up to 8
   column pairs (8 x 2 x 15 x 128 < 2^15), widened to int32 as l + 256 h; minus the offset
   binary's 8 sum m' the dot  sum_k m'_k (u_k - 8)  is an exact int32 (|.| < 2^24), so it
   converts to float exactly, and times 2^B it is the exact sum of that plane's products.
   The only roundings: one per plane added, then the scale, as in direct4 - fewer than the
   reference's float32 sum, so within the same summation-order bound. An activation row
   with a value that fits no plane (a float32 with more than 15 significant bits or 15
   from 32640 up, inf, NaN) makes q4planes_build return 0 and the call takes direct4. */

#define Q4P_BITS 15   /* |m'| < 2^15 */
#define Q4P_HMAX 32640 /* 256 x 127 + 128: the first m' whose h would not be a signed byte */
#define Q4P_RUN 8     /* column-pair steps a 16-bit sum takes: 8 x 2 x 15 x 128 = 30720 < 2^15 */

typedef struct q4planes {
    int8_t* x;     /* [plane][PG / 2][2][32]: l then h; per 128-bit lane (l_2p, l_2p+1) x 8 of one pair */
    int32_t* corr; /* [plane] 8 * sum m' (the offset-binary 8 of u - 8, folded in exactly) */
    float* mul;    /* [plane] 2^B */
    int* row;      /* [plane] the activation row it belongs to */
    int* off;      /* [G + 1]: group gi's planes (every row's) are off[gi] .. off[gi + 1] - 1 */
} q4planes_t;

static void q4planes_free(q4planes_t* P) { free(P->x); free(P->corr); free(P->mul); free(P->row); free(P->off); }

/* x [M, K]: 1 when every activation fits a plane (then P is filled), 0 otherwise (P freed). */
static int q4planes_build(const float* x, int64_t M, int64_t K, int64_t g, q4planes_t* P) {
    const int64_t G = K / g, PG = g / 2, nmax = M * K; /* at most one plane per value */
    memset(P, 0, sizeof *P);
    if (g % 4 || g > 64) return 0; /* g <= 64: |sum m' (u - 8)| <= 64 * 2^15 * 8 = 2^24 */
    P->x = calloc((size_t)nmax * (PG / 2) * 64, 1);
    P->corr = malloc(sizeof(int32_t) * nmax);
    P->mul = malloc(sizeof(float) * nmax);
    P->row = malloc(sizeof(int) * nmax);
    P->off = malloc(sizeof(int) * (G + 1));
    int32_t mk[64], fk[64], top[64];
    unsigned char left[64];
    if (!P->x || !P->corr || !P->mul || !P->row || !P->off) goto fail;
    int np = 0;
    for (int64_t gi = 0; gi < G; gi++) {
      P->off[gi] = np;
      for (int64_t mi = 0; mi < M; mi++) {
        for (int64_t k = 0; k < g; k++) {
            uint32_t u;
            memcpy(&u, x + mi * K + gi * g + k, 4);
            const uint32_t e = (u >> 23) & 255, frac = u & 0x7fffff;
            left[k] = 0;
            if (e == 255) goto fail;                      /* inf, NaN */
            if (e == 0 && frac == 0) continue;            /* a zero adds nothing */
            uint32_t m = e ? frac | 0x800000u : frac;     /* |x| = m 2^(max(e, 1) - 150) */
            const int tz = __builtin_ctz(m);
            m >>= tz;
            const int bl = 32 - __builtin_clz(m);
            if (bl > Q4P_BITS) goto fail;                 /* too many significant bits */
            if (bl == Q4P_BITS && m >= Q4P_HMAX) goto fail; /* fits no plane (h would be 128) */
            mk[k] = (u >> 31) ? -(int32_t)m : (int32_t)m;
            fk[k] = (int)(e ? e : 1) - 150 + tz;
            top[k] = fk[k] + bl;
            left[k] = 1;
        }
        for (;;) {
            int T = INT32_MIN;
            for (int64_t k = 0; k < g; k++) if (left[k] && top[k] > T) T = top[k];
            if (T == INT32_MIN) break;
            int B = T - Q4P_BITS < -149 ? -149 : T - Q4P_BITS; /* 2^B stays a float */
            for (int64_t k = 0; k < g; k++)
                if (left[k] && fk[k] >= B && mk[k] * (1 << (fk[k] - B)) >= Q4P_HMAX) { B++; break; }
            int8_t* xp = P->x + (int64_t)np * (PG / 2) * 64;
            int32_t sum = 0;
            for (int64_t k = 0; k < g; k++) {
                if (!left[k] || fk[k] < B) continue;
                const int32_t v = mk[k] * (1 << (fk[k] - B));  /* -2^15 < v < Q4P_HMAX */
                const int32_t l = ((v + 128) & 255) - 128;
                const int64_t pr = k / 2, it = pr / 2, lane = pr % 2, c = k % 2;
                for (int r = 0; r < 8; r++) {
                    xp[it * 64 + lane * 16 + 2 * r + c] = (int8_t)l;
                    xp[it * 64 + 32 + lane * 16 + 2 * r + c] = (int8_t)((v - l) / 256);
                }
                sum += v;
                left[k] = 0;
            }
            P->corr[np] = 8 * sum;
            uint32_t mb = B >= -126 ? (uint32_t)(B + 127) << 23 : 1u << (B + 149);
            memcpy(&P->mul[np], &mb, 4);
            P->row[np] = (int)mi;
            np++;
        }
      }
    }
    P->off[G] = np;
    return 1;
fail:
    q4planes_free(P);
    memset(P, 0, sizeof *P);
    return 0;
}

/* Plane sums of one chunk of <= Q4P_RUN column-pair steps, widened: q[0..3] += int32
   l + 256 h for rows 0-3, 4-7, 8-11, 12-15, each [pair A | pair B] by 128-bit lane. */
static inline void q4p_widen(__m256i al0, __m256i ah0, __m256i al1, __m256i ah1, __m256i q[4]) {
    const __m256i w = _mm256_set1_epi32(1 | (256 << 16));
    q[0] = _mm256_add_epi32(q[0], _mm256_madd_epi16(_mm256_unpacklo_epi16(al0, ah0), w));
    q[1] = _mm256_add_epi32(q[1], _mm256_madd_epi16(_mm256_unpackhi_epi16(al0, ah0), w));
    q[2] = _mm256_add_epi32(q[2], _mm256_madd_epi16(_mm256_unpacklo_epi16(al1, ah1), w));
    q[3] = _mm256_add_epi32(q[3], _mm256_madd_epi16(_mm256_unpackhi_epi16(al1, ah1), w));
}

/* One plane's exact dot (minus corr) times 2^B added to the group's float sums t0, t1. */
static inline void q4p_out(const __m256i q[4], int32_t corr, float mul, __m256* t0, __m256* t1) {
    const __m256i c = _mm256_set1_epi32(corr);
    const __m256 m = _mm256_set1_ps(mul);
    const __m256i r0 = _mm256_add_epi32(_mm256_permute2x128_si256(q[0], q[1], 0x20), _mm256_permute2x128_si256(q[0], q[1], 0x31));
    const __m256i r1 = _mm256_add_epi32(_mm256_permute2x128_si256(q[2], q[3], 0x20), _mm256_permute2x128_si256(q[2], q[3], 0x31));
    *t0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(r0, c)), m, *t0);
    *t1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(r1, c)), m, *t1);
}

/* Column pairs 2it (128-bit lane 0) and 2it+1 (lane 1) of the group's 16 rows as bytes
   (c0, c1) per row: u0 rows 0-7, u1 rows 8-15. */
static inline void q4p_codes(const uint8_t* b0, int64_t it, __m256i* u0, __m256i* u1) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), b = _mm256_loadu_si256((const __m256i*)(b0 + it * 32));
    const __m256i lo = _mm256_and_si256(b, m4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
    *u0 = _mm256_unpacklo_epi8(lo, hi);
    *u1 = _mm256_unpackhi_epi8(lo, hi);
}

/* One step of a plane's 16-bit sums: its (l, h) bytes of the two pairs against the codes. */
static inline void q4p_step(__m256i u0, __m256i u1, const int8_t* X, int64_t it, __m256i a[4]) {
    const __m256i l = _mm256_loadu_si256((const __m256i*)(X + it * 64)), h = _mm256_loadu_si256((const __m256i*)(X + it * 64 + 32));
    a[0] = _mm256_add_epi16(a[0], _mm256_maddubs_epi16(u0, l));
    a[1] = _mm256_add_epi16(a[1], _mm256_maddubs_epi16(u0, h));
    a[2] = _mm256_add_epi16(a[2], _mm256_maddubs_epi16(u1, l));
    a[3] = _mm256_add_epi16(a[3], _mm256_maddubs_epi16(u1, h));
}

/* The 16 rows of block nb: o[M][16] = x . dequant(W)^T, from the planes (see above). */
static void direct4i(const job_t* j, const q4planes_t* P, int64_t nb, const float* xs, float* o) {
    const int64_t KP = j->K / 2, PG = j->g / 2, G = j->G, IT = PG / 2;
    const uint8_t* wb = j->w + nb * KP * 16;
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t gi = 0; gi < G; gi++) {
        __m256 t[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
        const uint8_t* b0 = wb + gi * PG * 16;
        for (int q0 = P->off[gi]; q0 < P->off[gi + 1]; q0 += 2) {
            const int two = q0 + 1 < P->off[gi + 1]; /* two planes: the codes unpacked once for both */
            const int8_t* X0 = P->x + (int64_t)q0 * IT * 64;
            const int8_t* X1 = X0 + IT * 64;
            __m256i qa[4] = {zero, zero, zero, zero}, qb[4] = {zero, zero, zero, zero};
            for (int64_t i0 = 0; i0 < IT; i0 += Q4P_RUN) {
                const int64_t i1 = IT - i0 < Q4P_RUN ? IT : i0 + Q4P_RUN;
                __m256i a[4] = {zero, zero, zero, zero}, b[4] = {zero, zero, zero, zero};
                __m256i u0, u1;
                if (two)
                    for (int64_t it = i0; it < i1; it++) { q4p_codes(b0, it, &u0, &u1); q4p_step(u0, u1, X0, it, a); q4p_step(u0, u1, X1, it, b); }
                else
                    for (int64_t it = i0; it < i1; it++) { q4p_codes(b0, it, &u0, &u1); q4p_step(u0, u1, X0, it, a); }
                q4p_widen(a[0], a[1], a[2], a[3], qa);
                if (two) q4p_widen(b[0], b[1], b[2], b[3], qb);
            }
            q4p_out(qa, P->corr[q0], P->mul[q0], &t[P->row[q0]][0], &t[P->row[q0]][1]);
            if (two) q4p_out(qb, P->corr[q0 + 1], P->mul[q0 + 1], &t[P->row[q0 + 1]][0], &t[P->row[q0 + 1]][1]);
        }
        __m256 s0, s1;
        scales16(j, (nb * G + gi) * RB, &s0, &s1);
        for (int64_t m = 0; m < j->M; m++)
            group_out(j, nb, gi, j->z ? xs[m * G + gi] : 0.0f, s0, s1, t[m][0], t[m][1], o + m * RB);
    }
}
