/* 4-bit codes, one activation row (M == 1, the decode step): integer dot products.

   Part of native_f32.c (included in its AVX2 section: uses job_t, RB, scales16, group_out).

   Why: the float path spends ~19 vector instructions on 32 codes (widen, convert, FMA per
   column); the 4-bit head at M == 1 was bound by that, not by memory. Here a column pair's
   codes stay 16-bit integers and meet the activations in vpmaddwd (two products and their
   sum per instruction; with VNNI, vpdpwssd adds them to the sums too): ~15 (VNNI ~11)
   instructions per 64 codes.

   Exact: an activation x_k = M_k 2^f_k (M_k odd). Within a group, columns whose values fit
   a 15-bit integer over one base exponent B share a "plane": m'_k = M_k 2^(f_k - B), an
   exact int16. Every column of the group lies in exactly one plane (greedy, from the
   largest value down; a bf16 or f16 activation always fits: 8 / 11 significant bits).
   Per plane and row the dot  sum_k m'_k (u_k - 8)  is an exact int32 (|.| < 2^24), so it
   converts to float exactly, and times 2^B it is the exact sum of that plane's products.
   The only roundings: one per plane added, then the scale, as in direct4 - fewer than the
   reference's float32 sum, so within the same summation-order bound. An activation row
   with a value that fits no int16 plane (a float32 with more than 15 significant bits,
   inf, NaN) makes q4planes_build return 0 and the call takes direct4. */

#define Q4P_BITS 15 /* |m'| < 2^15: an int16 */
/* int16 per plane: the pair layout's [PG / 2][16]; the dword layout's (EQ_Q4D) [g / 8][4][2], the
   dwords (m'_8ch+k, m'_8ch+k+4), k = 0..3, each broadcast to the 8 rows of a half block */
#define Q4P_STRIDE(g) (EQ_Q4DW ? (g) : 4 * (g))

typedef struct q4planes {
    int16_t* x;    /* [plane][PG / 2][16]: per two column pairs, (m'_2p, m'_2p+1) x 4 | (m'_2p+2, m'_2p+3) x 4 */
    int32_t* corr; /* [plane] 8 * sum m' (the offset-binary 8 of u - 8, folded in exactly) */
    float* mul;    /* [plane] 2^B */
    int* off;      /* [K / chunk + 1]: chunk ci's planes are off[ci] .. off[ci + 1] - 1 */
    uint32_t* nz;  /* [plane] bit i: columns unit i .. unit (i + 1) - 1 of the chunk hold a value of this plane */
    int64_t chunk; /* columns per chunk of planes (4-bit: the group; int8: eq_i8planes.h) */
} q4planes_t;

static void q4planes_free(q4planes_t* P) { free(P->x); free(P->corr); free(P->mul); free(P->off); free(P->nz); }

/* The planes of c (<= 64) activations, shared by the 4-bit and int8 builders: eqp_scan reads
   each value as M 2^f (M odd; 0 when a value fits no plane: inf, NaN, > 15 significant bits),
   eqp_next then yields the planes greedily from the largest value down (0: none left). */
typedef struct { int32_t mk[64], fk[64], top[64]; unsigned char left[64]; int64_t c; } eqp_scan_t;

static int eqp_scan(const float* x, int64_t c, eqp_scan_t* S) {
    S->c = c;
    for (int64_t k = 0; k < c; k++) {
        uint32_t u;
        memcpy(&u, x + k, 4);
        const uint32_t e = (u >> 23) & 255, frac = u & 0x7fffff;
        S->left[k] = 0;
        if (e == 255) return 0;                       /* inf, NaN */
        if (e == 0 && frac == 0) continue;            /* a zero adds nothing */
        uint32_t m = e ? frac | 0x800000u : frac;     /* |x| = m 2^(max(e, 1) - 150) */
        const int tz = __builtin_ctz(m);
        m >>= tz;
        const int bl = 32 - __builtin_clz(m);
        if (bl > Q4P_BITS) return 0;                  /* too many significant bits */
        S->mk[k] = (u >> 31) ? -(int32_t)m : (int32_t)m;
        S->fk[k] = (int)(e ? e : 1) - 150 + tz;
        S->top[k] = S->fk[k] + bl;
        S->left[k] = 1;
    }
    return 1;
}

/* The next plane: v[k] = m'_k (0 for the columns of other planes), *mul = 2^B. */
static int eqp_next(eqp_scan_t* S, int32_t v[64], float* mul) {
    int T = INT32_MIN;
    for (int64_t k = 0; k < S->c; k++) if (S->left[k] && S->top[k] > T) T = S->top[k];
    if (T == INT32_MIN) return 0;
    const int B = T - Q4P_BITS < -149 ? -149 : T - Q4P_BITS; /* 2^B stays a float */
    for (int64_t k = 0; k < S->c; k++) {
        v[k] = 0;
        if (!S->left[k] || S->fk[k] < B) continue;
        v[k] = S->mk[k] * (1 << (S->fk[k] - B));     /* |v| < 2^(T - B) <= 2^15 */
        S->left[k] = 0;
    }
    const uint32_t mb = B >= -126 ? (uint32_t)(B + 127) << 23 : 1u << (B + 149);
    memcpy(mul, &mb, 4);
    return 1;
}

/* The planes of x[0 .. K) in chunks of c columns: chunk ci's planes are P->off[ci] ..
   P->off[ci + 1] - 1, each laid out by lay() in `stride` int16 (corr = 8 * sum m', the 4-bit
   offset's term; nz per `unit` columns, c / unit <= 32). 1 when every activation fits a plane,
   0 otherwise (P freed). */
static int planes_build(const float* x, int64_t K, int64_t c, int64_t stride, int64_t unit,
                        void (*lay)(int16_t* xp, const int32_t* v, int64_t c), q4planes_t* P) {
    const int64_t NC = K / c;  /* at most one plane per column */
    memset(P, 0, sizeof *P);
    P->chunk = c;
    P->x = calloc((size_t)K * stride, sizeof(int16_t));
    P->corr = malloc(sizeof(int32_t) * K);
    P->mul = malloc(sizeof(float) * K);
    P->off = malloc(sizeof(int) * (NC + 1));
    P->nz = malloc(sizeof(uint32_t) * K);
    eqp_scan_t S;
    int32_t v[64];
    if (!P->x || !P->corr || !P->mul || !P->off || !P->nz) goto fail;
    int np = 0;
    for (int64_t ci = 0; ci < NC; ci++) {
        P->off[ci] = np;
        if (!eqp_scan(x + ci * c, c, &S)) goto fail;
        while (eqp_next(&S, v, &P->mul[np])) {
            int32_t sum = 0;
            uint32_t nz = 0;
            for (int64_t k = 0; k < c; k++) { sum += v[k]; if (v[k]) nz |= 1u << (k / unit); }
            P->nz[np] = nz;
            lay(P->x + (int64_t)np * stride, v, c);
            P->corr[np++] = 8 * sum;
        }
    }
    P->off[NC] = np;
    return 1;
fail:
    q4planes_free(P);
    memset(P, 0, sizeof *P);
    return 0;
}

/* One 4-bit plane in the layout its dots read (Q4P_STRIDE). */
static void q4_lay(int16_t* xp, const int32_t* v, int64_t g) {
    for (int64_t k = 0; k < g; k++) {
        if (EQ_Q4DW) {
            const int64_t ch = k / 8, q = k % 4, half = k % 8 / 4;
            xp[(ch * 4 + q) * 2 + half] = (int16_t)v[k];
        } else {
            const int64_t pr = k / 2, it = pr / 2, lane = pr % 2, c = k % 2;
            for (int r = 0; r < 4; r++) xp[it * 16 + lane * 8 + 2 * r + c] = (int16_t)v[k];
        }
    }
}

/* 1 when every activation fits a plane (then P is filled, one chunk per group), 0 otherwise. */
static int q4planes_build(const float* x, int64_t K, int64_t g, q4planes_t* P) {
    memset(P, 0, sizeof *P);
    /* g <= 64: |sum m' (u - 8)| <= 64 * 2^15 * 8 < 2^24; g % 8 (every stored group, format/scheme.py):
       the zmm pass takes two steps of 4 columns at a time */
    if (g % 8 || g > 64) return 0;
    return planes_build(x, K, g, Q4P_STRIDE(g), 4, q4_lay, P);
}

/* acc + (the pair sums of c * x): one vpdpwssd with VNNI (the avx2vnni build: Xeon with AMX,
   synthetic Gemma head Q4 g32 / g64, warm, 2 threads: 2.92 / 2.59 vs 3.89 / 3.25 ms), else
   vpmaddwd + vpaddd. Integer sums, so the same bits either way. */
#if defined(__AVXVNNI__)
#define Q4I_DP(acc, c, x) _mm256_dpwssd_avx_epi32(acc, c, x)
#elif defined(EQ_SIMDE_VNNI)  /* tests only: the VNNI form on SIMDe, on CPUs without VNNI */
#include <simde/x86/avx512/dpwssd.h>
#define Q4I_DP(acc, c, x) simde_mm256_dpwssd_epi32(acc, c, x)
#else
#define Q4I_DP(acc, c, x) _mm256_add_epi32(acc, _mm256_madd_epi16(c, x))
#endif
/* One step of a plane's dots: the codes of column pairs 2it (128-bit lane 0) and 2it + 1 (lane 1)
   of 16 rows times the plane X into a[4] = int32 sums for rows 0-3, 4-7, 8-11, 12-15, each
   [pair A | pair B] by 128-bit lane. */
static inline __attribute__((always_inline)) void q4i_step(const uint8_t* b0, const int16_t* X, const int64_t it,
                                                           __m256i a[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), zero = _mm256_setzero_si256();
    const __m256i w = _mm256_loadu_si256((const __m256i*)(b0 + it * 32));
    const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
    const __m256i u0 = _mm256_unpacklo_epi8(lo, hi), u1 = _mm256_unpackhi_epi8(lo, hi);
    /* int16 (c0, c1) per row: rows 0-3, 4-7, 8-11, 12-15 of both pairs */
    const __m256i c[4] = {_mm256_unpacklo_epi8(u0, zero), _mm256_unpackhi_epi8(u0, zero),
                          _mm256_unpacklo_epi8(u1, zero), _mm256_unpackhi_epi8(u1, zero)};
    const __m256i x = _mm256_loadu_si256((const __m256i*)(X + it * 16));
    for (int r = 0; r < 4; r++) a[r] = Q4I_DP(a[r], c[r], x);
}

/* The dots of one group's first plane, every step. Inlined with IT a constant (g32: 8, g64:
   16) the loop unrolls (a runtime-length loop: 12-13 % slower on the Gemma head). */
static inline __attribute__((always_inline)) void q4i_dots(const uint8_t* b0, const int16_t* X, const int64_t IT,
                                                           __m256i a[4]) {
    for (int r = 0; r < 4; r++) a[r] = _mm256_setzero_si256();
    for (int64_t it = 0; it < IT; it++) {
        q4i_step(b0, X, it, a);
        /* EQ_KEEP (eq_convert.h): at g32 (IT = 8, unrolled) GCC 12 otherwise computes the 32
           products first and spills ~24 (AVX2 build). Gemma head Q4 g32 M = 1 from memory, Zen 4,
           interleaved: 0.92-0.95x the time; at g64 (not unrolled) and in the zmm loop no gain */
        if (IT == 8) for (int r = 0; r < 4; r++) EQ_KEEP(a[r]);
    }
}

/* The dots of a later plane (values below ~2^-7 of the group's largest): only the steps whose
   four columns hold one of its values (nz), the codes decoded again. On Gemma 3 270M's hidden
   states 36 % of g32 groups have a second plane, and it touches one step of 8 in 71 % of them,
   two in 18 %; the dense form (both planes in one pass) spent 8 steps on it. Integer sums of
   the same products, so the same bits. */
static inline __attribute__((always_inline)) void q4i_sparse(const uint8_t* b0, const int16_t* X, uint32_t nz,
                                                             __m256i a[4]) {
    for (int r = 0; r < 4; r++) a[r] = _mm256_setzero_si256();
    for (; nz; nz &= nz - 1) q4i_step(b0, X, __builtin_ctz(nz), a);
}

#if EQ_AVX512
#ifdef EQ_SIMDE  /* SIMDe's native alias of this one takes the masked form's 4 arguments */
#define EQ_MADD512 simde_mm512_madd_epi16
#else
#define EQ_MADD512 _mm512_madd_epi16
#endif
#if EQ_VNNI /* the avx512vnni build: the same fusion, 512 bits wide */
#define Q4I_DP512(acc, c, x) _mm512_dpwssd_epi32(acc, c, x)
#elif defined(EQ_SIMDE_VNNI)
#define Q4I_DP512(acc, c, x) simde_mm512_dpwssd_epi32(acc, c, x)
#else
#define Q4I_DP512(acc, c, x) _mm512_add_epi32(acc, EQ_MADD512(c, x))
#endif
/* The same dots four pairs per zmm (pairs 2it .. 2it+3 in the four 128-bit lanes, the
   activation chunks it and it + 1 side by side: the layout is already that), IT even (g % 8);
   the two 256-bit halves added at the end. Integer sums, so the result is the ymm version's bit
   for bit. Half the instructions per code: the AVX-512 builds (and with them 4-bit M = 1 on
   AMX and AVX512-BF16 CPUs, which take the AVX-512F row there) were bound by them. */
static inline __attribute__((always_inline)) void q4i_dots512(const uint8_t* b0, const int16_t* X0,
                                                              const int16_t* X1, const int64_t IT,
                                                              __m256i a[4], __m256i b[4]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
    __m512i A[4], B[4];
    for (int r = 0; r < 4; r++) A[r] = B[r] = zero;
    for (int64_t it = 0; it < IT; it += 2) {
        const __m512i w = _mm512_loadu_si512((const void*)(b0 + it * 32));
        const __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
        const __m512i u0 = _mm512_unpacklo_epi8(lo, hi), u1 = _mm512_unpackhi_epi8(lo, hi);
        const __m512i c[4] = {_mm512_unpacklo_epi8(u0, zero), _mm512_unpackhi_epi8(u0, zero),
                              _mm512_unpacklo_epi8(u1, zero), _mm512_unpackhi_epi8(u1, zero)};
        const __m512i x0 = _mm512_loadu_si512((const void*)(X0 + it * 16));
        for (int r = 0; r < 4; r++) A[r] = Q4I_DP512(A[r], c[r], x0);
        if (X1) {
            const __m512i x1 = _mm512_loadu_si512((const void*)(X1 + it * 16));
            for (int r = 0; r < 4; r++) B[r] = Q4I_DP512(B[r], c[r], x1);
        }
    }
    for (int r = 0; r < 4; r++) {
        a[r] = _mm256_add_epi32(_mm512_castsi512_si256(A[r]), _mm512_extracti64x4_epi64(A[r], 1));
        b[r] = _mm256_add_epi32(_mm512_castsi512_si256(B[r]), _mm512_extracti64x4_epi64(B[r], 1));
    }
}
#endif

/* One plane's exact dot (minus corr) times 2^B added to the group's float sums t0, t1. */
static inline void q4i_out(const __m256i a[4], int32_t corr, float mul, __m256* t0, __m256* t1) {
    const __m256i c = _mm256_set1_epi32(corr);
    const __m256 m = _mm256_set1_ps(mul);
    const __m256i r0 = _mm256_add_epi32(_mm256_permute2x128_si256(a[0], a[1], 0x20), _mm256_permute2x128_si256(a[0], a[1], 0x31));
    const __m256i r1 = _mm256_add_epi32(_mm256_permute2x128_si256(a[2], a[3], 0x20), _mm256_permute2x128_si256(a[2], a[3], 0x31));
    *t0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(r0, c)), m, *t0);
    *t1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(r1, c)), m, *t1);
}

/* The planes q0 .. qe - 1 of one group of the pair layout into t0, t1: the first dense, the
   later ones sparse (q4i_sparse). */
static inline __attribute__((always_inline)) void q4i_group(const q4planes_t* P, const uint8_t* b0, int q0, int qe,
                                                            const int64_t IT, __m256* t0, __m256* t1) {
    if (q0 >= qe) return;
    __m256i a[4];
    q4i_dots(b0, P->x + (int64_t)q0 * IT * 16, IT, a);
    q4i_out(a, P->corr[q0], P->mul[q0], t0, t1);
    for (int q = q0 + 1; q < qe; q++) {
        q4i_sparse(b0, P->x + (int64_t)q * IT * 16, P->nz[q], a);
        q4i_out(a, P->corr[q], P->mul[q], t0, t1);
    }
}

#if EQ_Q4DW
/* The dword layout's dots (-DEQ_Q4D): 8 rows (one half of the block, a dword per row and 8
   columns) x one or two planes over NCH chunks. Per 16-bit lane a dword holds columns k and
   k + 4, so (d & 0x000f), (d & 0x00f0), (d & 0x0f00) and (d >> 12) are columns (0, 4) x 1,
   (1, 5) x 16, (2, 6) x 256 and (3, 7) x 1: 4 operations decode 64 codes, no permute. The x16
   and x256 sums are multiples of 16 / 256, so the arithmetic shifts that fold them are exact
   (|x256 sum| <= 16 products of 3840 x 32767 < 2^31 for g <= 64): the integer per row is the
   pair layout's, and so is every bit of the output. Three sums per plane and half block
   (weights 1, 16, 256), as the prototype's B2 (scripts/ab_q4_dword_layout.c). */
static inline __attribute__((always_inline)) __m256i q4d_fold(__m256i a0, __m256i a1, __m256i a2) {
    return _mm256_add_epi32(a0, _mm256_add_epi32(_mm256_srai_epi32(a1, 4), _mm256_srai_epi32(a2, 8)));
}
#define Q4D_MASKS const __m256i f0 = _mm256_set1_epi16(0x000f), f1 = _mm256_set1_epi16(0x00f0), f2 = _mm256_set1_epi16(0x0f00)
/* d's 64 codes times one plane's dwords x0..x3 into the sums a0 (weights 1), a1 (16), a2 (256) */
#define Q4D_STEP(d, x0, x1, x2, x3, a0, a1, a2) do {                                              \
        a0 = Q4I_DP(Q4I_DP(a0, _mm256_and_si256(d, f0), x0), _mm256_srli_epi16(d, 12), x3);        \
        a1 = Q4I_DP(a1, _mm256_and_si256(d, f1), x1);                                              \
        a2 = Q4I_DP(a2, _mm256_and_si256(d, f2), x2);                                              \
    } while (0)
#define Q4D_X(X, ch, q) _mm256_set1_epi32(((const int32_t*)(X))[(ch) * 4 + (q)])

/* One plane: both halves of the block per chunk (each broadcast serves 16 rows). r0 / r1:
   the integer sums of rows 0-7 / 8-15. */
static inline __attribute__((always_inline)) void q4d_one(const uint32_t* b0, const int16_t* X, const int64_t NCH,
                                                          __m256i* r0, __m256i* r1) {
    Q4D_MASKS;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, c0 = a0, c1 = a0, c2 = a0;
    for (int64_t ch = 0; ch < NCH; ch++) {
        const __m256i x0 = Q4D_X(X, ch, 0), x1 = Q4D_X(X, ch, 1), x2 = Q4D_X(X, ch, 2), x3 = Q4D_X(X, ch, 3);
        const __m256i d0 = _mm256_loadu_si256((const __m256i*)(b0 + ch * RB));
        const __m256i d1 = _mm256_loadu_si256((const __m256i*)(b0 + ch * RB + 8));
        Q4D_STEP(d0, x0, x1, x2, x3, a0, a1, a2);
        Q4D_STEP(d1, x0, x1, x2, x3, c0, c1, c2);
        /* (the same spills as q4i_dots without it; M = 1 0.89x the time) */
        EQ_KEEP(a0); EQ_KEEP(a1); EQ_KEEP(a2); EQ_KEEP(c0); EQ_KEEP(c1); EQ_KEEP(c2);
    }
    *r0 = q4d_fold(a0, a1, a2);
    *r1 = q4d_fold(c0, c1, c2);
}

/* Two planes over one half h of the block (the codes decoded once for both). */
static inline __attribute__((always_inline)) void q4d_two(const uint32_t* b0, const int16_t* X0, const int16_t* X1,
                                                          const int64_t NCH, __m256i* ra, __m256i* rb) {
    Q4D_MASKS;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, c0 = a0, c1 = a0, c2 = a0;
    for (int64_t ch = 0; ch < NCH; ch++) {
        const __m256i d = _mm256_loadu_si256((const __m256i*)(b0 + ch * RB));
        Q4D_STEP(d, Q4D_X(X0, ch, 0), Q4D_X(X0, ch, 1), Q4D_X(X0, ch, 2), Q4D_X(X0, ch, 3), a0, a1, a2);
        Q4D_STEP(d, Q4D_X(X1, ch, 0), Q4D_X(X1, ch, 1), Q4D_X(X1, ch, 2), Q4D_X(X1, ch, 3), c0, c1, c2);
        EQ_KEEP(a0); EQ_KEEP(a1); EQ_KEEP(a2); EQ_KEEP(c0); EQ_KEEP(c1); EQ_KEEP(c2);
    }
    *ra = q4d_fold(a0, a1, a2);
    *rb = q4d_fold(c0, c1, c2);
}

static inline void q4d_out(__m256i r, int32_t corr, float mul, __m256* t) {
    *t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(r, _mm256_set1_epi32(corr))), _mm256_set1_ps(mul), *t);
}

/* The 16 rows of block nb: o[16] = x . dequant(W)^T, from the planes, dword layout. */
static void direct4i(const job_t* j, const q4planes_t* P, int64_t nb, const float* xs, float* o) {
    const int64_t NCH = j->g / 8, G = j->G, S = Q4P_STRIDE(j->g);
    const uint32_t* wb = (const uint32_t*)j->w + nb * (j->K / 8) * RB;
    __m256 o0 = _mm256_setzero_ps(), o1 = o0;  /* the block's sums (group_acc) */
    for (int64_t gi = 0; gi < G; gi++) {
        __m256 t[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        const uint32_t* b0 = wb + gi * NCH * RB;
        for (int64_t c = 0; c < NCH * RB * 4; c += 64) EQ_PREFETCH((const char*)b0 + c);
        for (int q0 = P->off[gi]; q0 < P->off[gi + 1]; q0 += 2) {
            const int16_t* X0 = P->x + (int64_t)q0 * S;
            __m256i r0, r1;
            if (q0 + 1 < P->off[gi + 1]) {  /* two planes: as q4i_out, plane q0 then q0 + 1 */
                for (int h = 0; h < 2; h++) {
                    if (NCH == 4) q4d_two(b0 + 8 * h, X0, X0 + S, 4, &r0, &r1);
                    else if (NCH == 8) q4d_two(b0 + 8 * h, X0, X0 + S, 8, &r0, &r1);
                    else q4d_two(b0 + 8 * h, X0, X0 + S, NCH, &r0, &r1);
                    q4d_out(r0, P->corr[q0], P->mul[q0], &t[h]);
                    q4d_out(r1, P->corr[q0 + 1], P->mul[q0 + 1], &t[h]);
                }
            } else {
                if (NCH == 4) q4d_one(b0, X0, 4, &r0, &r1);
                else if (NCH == 8) q4d_one(b0, X0, 8, &r0, &r1);
                else q4d_one(b0, X0, NCH, &r0, &r1);
                q4d_out(r0, P->corr[q0], P->mul[q0], &t[0]);
                q4d_out(r1, P->corr[q0], P->mul[q0], &t[1]);
            }
        }
        __m256 s0, s1;
        scales16(j, (nb * G + gi) * RB, &s0, &s1);
        group_acc(j, nb, gi, j->z ? xs[gi] : 0.0f, s0, s1, t[0], t[1], &o0, &o1);
    }
    _mm256_storeu_ps(o, o0);
    _mm256_storeu_ps(o + 8, o1);
}
#else
/* The 16 rows of block nb: o[16] = x . dequant(W)^T, from the planes (see above). */
static void direct4i(const job_t* j, const q4planes_t* P, int64_t nb, const float* xs, float* o) {
    const int64_t KP = j->K / 2, PG = j->g / 2, G = j->G, IT = PG / 2;
    const uint8_t* wb = j->w + nb * KP * 16;
    __m256 o0 = _mm256_setzero_ps(), o1 = o0;  /* the block's sums (group_acc) */
    for (int64_t gi = 0; gi < G; gi++) {
        __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps();
        const uint8_t* b0 = wb + gi * PG * 16;
        for (int64_t c = 0; c < PG * 16; c += 64) EQ_PREFETCH(b0 + c);  /* M = 1 7.2 -> 3.5 ms */
        const int q0 = P->off[gi], qe = P->off[gi + 1];
#if EQ_AVX512
        /* both planes of a group in one pass, four pairs per zmm: a second plane costs four
           vpdpwssd here (sparse, as the ymm pass: ~1.05x the time, Zen 4) */
        for (int q = q0; q < qe; q += 2) {
            const int two = q + 1 < qe;
            const int16_t* X0 = P->x + (int64_t)q * IT * 16;
            const int16_t* X1 = X0 + IT * 16;
            __m256i a[4], b[4];
            if (IT == 8) { if (two) q4i_dots512(b0, X0, X1, 8, a, b); else q4i_dots512(b0, X0, NULL, 8, a, b); }
            else if (IT == 16) { if (two) q4i_dots512(b0, X0, X1, 16, a, b); else q4i_dots512(b0, X0, NULL, 16, a, b); }
            else q4i_dots512(b0, X0, two ? X1 : NULL, IT, a, b);
            q4i_out(a, P->corr[q], P->mul[q], &t0, &t1);
            if (two) q4i_out(b, P->corr[q + 1], P->mul[q + 1], &t0, &t1);
        }
#else
        if (IT == 8) q4i_group(P, b0, q0, qe, 8, &t0, &t1);
        else if (IT == 16) q4i_group(P, b0, q0, qe, 16, &t0, &t1);
        else q4i_group(P, b0, q0, qe, IT, &t0, &t1);
#endif
        __m256 s0, s1;
        scales16(j, (nb * G + gi) * RB, &s0, &s1);
        group_acc(j, nb, gi, j->z ? xs[gi] : 0.0f, s0, s1, t0, t1, &o0, &o1);
    }
    _mm256_storeu_ps(o, o0);
    _mm256_storeu_ps(o + 8, o1);
}
#endif
