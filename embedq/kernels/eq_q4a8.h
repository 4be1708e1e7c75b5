/* 4-bit codes x int8 activations: the opt-in of EMBEDQ_ACTIVATIONS=int8 (not exact).

   Part of native_f32.c (included after its AVX2 section: uses job_t, RB, scale_at, and with
   AVX2 scales16, group_out, store_row). Four bodies: AVX512-VNNI (vpdpbusd, the avx512vnni
   build), AVX-VNNI (vpdpbusd 256 bits wide, the avx2vnni build), AVX2 (vpmaddubsw; also the
   avx512f build) and portable C.

   Why: the exact 4-bit kernels spend ~18 vector instructions per 64 codes at M == 1 and are
   bound by them, not by memory (docs/performance.md). With the activations as int8, a column
   pair's codes (unsigned bytes) meet them in vpmaddubsw: ~9 per 64 codes.

   Activations: per row and block of 32 columns (llama.cpp's Q8_0, ORT's accuracy level 4),
   d = amax / 127, q = round-half-even(x * (127 / amax)) in float32; amax == 0: d = 0, q = 0.
   embedq/kernels/actquant.py is the same rule in torch (the tests' reference). Per row and
   block the dot  sum q (u - 8)  is an exact int32 (|.| <= 32 * 15 * 127 + 8 * 32 * 127 < 2^24),
   so it converts to float exactly; d is applied per block, the scale (and z * sum d q) per
   group as in direct4. The only error against x . dequant(W) is the activations' rounding:
   on Gemma 3 270M +0.0003 mean KLD for Q4 g32, 0.25 % of that table's own (performance.md). */

enum { A8B = 32, A8MR = 4 };

typedef struct {
    job_t j;             /* the table, output, rows [nb0, nb1) (j.x unused) */
    const int8_t* xr;    /* [M][K/4][32]: per column quad (q0 q1) x 8 | (q2 q3) x 8 */
    const float* d;      /* [M][K/32] */
    const int32_t* corr; /* [M][K/32]: 8 * sum q (the offset binary's 8, folded in exactly) */
    const float* xs;     /* [M][G]: sum over the group of d * sum q (asymmetric tables) or NULL */
    const int8_t* q;     /* [M][K] (the portable build) */
    const int32_t* xt;   /* AVX512-VNNI, per 16-row pass and block of 32: A8XT int32 (a8_xt) */
} a8job_t;

/* A pass of 16 activation rows, one block kb of 32 columns, as a8_block_vnni16 reads it:
   [8 column quads][16 rows] (4 int8 each), [16] -corr, [16] d: one base pointer, constant
   offsets (16 row pointers a stride K apart left GCC short of registers: spills, 1.35x). */
enum { A8XT = 10 * 16 };

static void a8_xt(const int8_t* q, const int32_t* corr, const float* d, int64_t K, int32_t* xt) {
    const int64_t KB = K / A8B;
    for (int64_t kb = 0; kb < KB; kb++) {
        int32_t* X = xt + kb * A8XT;
        for (int i = 0; i < 16; i++) {
            for (int c = 0; c < 8; c++) memcpy(X + c * 16 + i, q + i * K + kb * A8B + c * 4, 4);
            X[128 + i] = -corr[i * KB + kb];
            memcpy(X + 144 + i, d + i * KB + kb, 4);
        }
    }
}

/* Row m's activations -> q, xr, d, corr (and xs). 0, or 1 when a value is not finite. */
static int a8_quantize(const float* x, int64_t K, int64_t g, int8_t* q, int8_t* xr, float* d, int32_t* corr,
                       float* xs) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: v + magic - magic rounds |v| < 2^22 half-even */
    for (int64_t b = 0; b < K / A8B; b++) {
        float amax = 0.0f;
        for (int k = 0; k < A8B; k++) {
            const float a = x[b * A8B + k] < 0 ? -x[b * A8B + k] : x[b * A8B + k];
            if (!(a <= 3.4028234663852886e38f)) return 1; /* inf, NaN */
            if (a > amax) amax = a;
        }
        const float id = amax > 0 ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int k = 0; k < A8B; k++) {
            /* volatile: the product is rounded on its own (GCC would contract x * id + magic
               into one FMA, which rounds ties differently from torch's x * id, then round) */
            volatile float v = x[b * A8B + k] * id;
            int32_t r = (int32_t)((v + magic) - magic);
            r = r > 127 ? 127 : r < -127 ? -127 : r;
            q[b * A8B + k] = (int8_t)r;
            sum += r;
        }
        d[b] = amax / 127.0f;
        corr[b] = 8 * sum;
    }
    for (int64_t c = 0; c < K / 4; c++)
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < 8; r++) {
                xr[c * 32 + h * 16 + 2 * r] = q[4 * c + 2 * h];
                xr[c * 32 + h * 16 + 2 * r + 1] = q[4 * c + 2 * h + 1];
            }
    if (xs)
        for (int64_t gi = 0; gi < K / g; gi++) {
            float a = 0.0f;
            for (int64_t b = gi * (g / A8B); b < (gi + 1) * (g / A8B); b++) {
                /* volatile: a product rounded on its own, then the sum, in every build (GCC fused
                   them where the target has FMA, unrolled differently per build: the AVX2 and
                   AVX512-VNNI builds' asymmetric outputs differed in the last bits at g = 128) */
                volatile float p = d[b] * (float)(corr[b] / 8);
                a += p;
            }
            xs[gi] = a;
        }
    return 0;
}

#if EQ_AVX2
/* Rows m0 .. m0 + nm - 1 (nm <= A8MR) of the 16 table rows of block nb into o [nm][16]. */
static inline __attribute__((always_inline)) void a8_block(const a8job_t* A, const int nm, int64_t nb,
                                                           int64_t m0, float* o) {
    const job_t* j = &A->j;
    const int64_t K = j->K, KB = K / A8B, G = j->G, BPG = j->g / A8B;
    const uint8_t* wb = j->w + nb * (K / 2) * 16;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t gi = 0; gi < G; gi++) {
        __m256 t[A8MR][2];
        for (int i = 0; i < nm; i++) t[i][0] = t[i][1] = _mm256_setzero_ps();
        for (int64_t kb = gi * BPG; kb < (gi + 1) * BPG; kb++) {
            /* s16 sums per row and pair (lane 0: pair 2it, lane 1: 2it + 1): 8 x 3810 < 2^15 */
            __m256i acc[A8MR][2];
            for (int i = 0; i < nm; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
            const uint8_t* b0 = wb + kb * 256;
            for (int it = 0; it < 8; it++) {
                const __m256i w = _mm256_loadu_si256((const __m256i*)(b0 + it * 32));
                const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                /* (c0, c1) byte pairs: rows 0-7 (u0) and 8-15 (u1) of both pairs */
                const __m256i u0 = _mm256_unpacklo_epi8(lo, hi), u1 = _mm256_unpackhi_epi8(lo, hi);
                for (int i = 0; i < nm; i++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i*)(A->xr + ((m0 + i) * (K / 4) + kb * 8 + it) * 32));
                    acc[i][0] = _mm256_add_epi16(acc[i][0], _mm256_maddubs_epi16(u0, xv));
                    acc[i][1] = _mm256_add_epi16(acc[i][1], _mm256_maddubs_epi16(u1, xv));
                }
                /* EQ_KEEP: else GCC 12 reassociates the 8 steps' int16 sums and spills (AVX2 build,
                   Gemma head Q4 g32 from memory, Zen 4, interleaved: M = 1 / 4 / 8 / 16 0.97 / 0.94
                   / 0.90 / 0.88x the time; the AVX-512F build, same code, 0.97-0.99x) */
                for (int i = 0; i < nm; i++) { EQ_KEEP(acc[i][0]); EQ_KEEP(acc[i][1]); }
            }
            for (int i = 0; i < nm; i++) {
                const int64_t mb = (m0 + i) * KB + kb;
                const __m256i c = _mm256_set1_epi32(A->corr[mb]);
                const __m256 dd = _mm256_set1_ps(A->d[mb]);
                __m256i r[2];
                for (int h = 0; h < 2; h++)
                    r[h] = _mm256_sub_epi32(_mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[i][h])),
                                                             _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[i][h], 1))), c);
                t[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(r[0]), dd, t[i][0]);
                t[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(r[1]), dd, t[i][1]);
            }
        }
        __m256 s0, s1;
        scales16(j, (nb * G + gi) * RB, &s0, &s1);
        for (int i = 0; i < nm; i++)
            group_out(j, nb, gi, A->xs ? A->xs[(m0 + i) * G + gi] : 0.0f, s0, s1, t[i][0], t[i][1], o + i * RB);
    }
}
#endif

#if EQ_AVX2 && !EQ_AVX512 && (defined(__AVXVNNI__) || defined(EQ_SIMDE_VNNI))
#define EQ_A8_AVXVNNI 1
#if defined(__AVXVNNI__)
#define EQ_DPBUSD256(acc, u, x) _mm256_dpbusd_avx_epi32(acc, u, x)
#else  /* tests only: the AVX-VNNI body on SIMDe, on CPUs without it */
#include <simde/x86/avx512/dpbusd.h>
#define EQ_DPBUSD256(acc, u, x) simde_mm256_dpbusd_epi32(acc, u, x)
#endif
/* AVX-VNNI (the avx2vnni build): a quad of columns (4c .. 4c+3) of 8 rows per vpdpbusd. The
   pairs 2c (lane 0) and 2c+1 (lane 1) of the 32 loaded bytes -> (column 4c, 4c+1) byte pairs
   per row (nibble unpack), the lanes regrouped by row (two vperm2i128), then dword r = (its
   pair-2c word, pair-2c+1 word) = columns 4c .. 4c+3 in order (vpunpck[lh]wd): rows 0-3 | 8-11
   and 4-7 | 12-15. 6 shuffles per 64 codes for all rows, then 2 instructions per activation
   row where a8_block takes ~5 (vpmaddubsw, vpaddw, the widening). The int32 sums per block
   are a8_block's, so the outputs are its bits. */
static inline __attribute__((always_inline)) void a8_block_avxvnni(const a8job_t* A, const int nm, int64_t nb,
                                                                   int64_t m0, float* o) {
    const job_t* j = &A->j;
    const int64_t K = j->K, KB = K / A8B, G = j->G, BPG = j->g / A8B;
    const uint8_t* wb = j->w + nb * (K / 2) * 16;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t gi = 0; gi < G; gi++) {
        __m256 t[A8MR][2];
        for (int i = 0; i < nm; i++) t[i][0] = t[i][1] = _mm256_setzero_ps();
        for (int64_t kb = gi * BPG; kb < (gi + 1) * BPG; kb++) {
            __m256i acc[A8MR][2];
            for (int i = 0; i < nm; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
            const uint8_t* b0 = wb + kb * 256;
            for (int c = 0; c < 8; c++) {
                const __m256i w = _mm256_loadu_si256((const __m256i*)(b0 + c * 32));
                const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);
                const __m256i px = _mm256_permute2x128_si256(a, b, 0x20), py = _mm256_permute2x128_si256(a, b, 0x31);
                const __m256i u0 = _mm256_unpacklo_epi16(px, py), u1 = _mm256_unpackhi_epi16(px, py);
                for (int i = 0; i < nm; i++) {
                    int32_t xq;
                    memcpy(&xq, A->q + (m0 + i) * K + kb * A8B + c * 4, 4);
                    const __m256i xv = _mm256_set1_epi32(xq);
                    acc[i][0] = EQ_DPBUSD256(acc[i][0], u0, xv);
                    acc[i][1] = EQ_DPBUSD256(acc[i][1], u1, xv);
                }
            }
            for (int i = 0; i < nm; i++) {
                const int64_t mb = (m0 + i) * KB + kb;
                const __m256i c = _mm256_set1_epi32(A->corr[mb]);
                const __m256 dd = _mm256_set1_ps(A->d[mb]);
                /* rows 0-7: the low lanes of both sums; rows 8-15: the high ones */
                const __m256i r0 = _mm256_sub_epi32(_mm256_permute2x128_si256(acc[i][0], acc[i][1], 0x20), c);
                const __m256i r1 = _mm256_sub_epi32(_mm256_permute2x128_si256(acc[i][0], acc[i][1], 0x31), c);
                t[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(r0), dd, t[i][0]);
                t[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(r1), dd, t[i][1]);
            }
        }
        __m256 s0, s1;
        scales16(j, (nb * G + gi) * RB, &s0, &s1);
        for (int i = 0; i < nm; i++)
            group_out(j, nb, gi, A->xs ? A->xs[(m0 + i) * G + gi] : 0.0f, s0, s1, t[i][0], t[i][1], o + i * RB);
    }
}
#else
#define EQ_A8_AVXVNNI 0
#endif

#if EQ_VNNI
/* AVX512-VNNI: a quad of columns (4c .. 4c+3) of 16 rows per vpdpbusd, summed into int32.
   Pairs 2c and 2c+1 of the block (32 bytes: row r's byte in each) -> words r = X_r, 16 + r =
   Y_r (vpmovzxbw) -> dword r = X_r | Y_r << 16 (vpermw) -> bytes (X_r & 15, X_r >> 4,
   Y_r & 15, Y_r >> 4) = columns 4c .. 4c+3 in order (v | v << 4, & 0x0f), so each activation
   row's quad is 4 consecutive int8 of q, broadcast as one int32. Up to 8 activation rows
   per pass here; passes of 16 in a8_block_vnni16 below (the decode, 4 of every ~12 vector
   operations at 8 rows, then shared by twice the rows). */
enum { A8MV = 8 };

/* Column quad c of a block (its 32 code bytes at p) as vpdpbusd's unsigned operand (above). */
static inline __attribute__((always_inline)) __m512i a8_quad512(const uint8_t* p) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i v = _mm512_permutexvar_epi16(idx, _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p)));
    /* (v | v << 4) & 0x0f per byte: 0xA8 = (a | b) & c */
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(v, 4), _mm512_set1_epi8(0x0f), 0xA8);
}

/* The 16 rows' scales / zero points of group index si (= (nb * G + gi) * RB) as float32. */
static inline __m512 a8_scales512(const job_t* j, int64_t si) {
    if (j->skind == 0) return _mm512_loadu_ps((const float*)j->s + si);
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)j->s + si));
    return j->skind == 2 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 a8_zeros512(const job_t* j, int64_t si) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(j->z + si))));
}

static inline __attribute__((always_inline)) void a8_block_vnni(const a8job_t* A, const int nm, int64_t nb,
                                                                int64_t m0, float* o) {
    const job_t* j = &A->j;
    const int64_t K = j->K, KB = K / A8B, G = j->G, BPG = j->g / A8B;
    const uint8_t* wb = j->w + nb * (K / 2) * 16;
    __m512 out[A8MV];
    for (int64_t gi = 0; gi < G; gi++) {
        __m512 t[A8MV];
        for (int i = 0; i < nm; i++) t[i] = _mm512_setzero_ps();
        for (int64_t kb = gi * BPG; kb < (gi + 1) * BPG; kb++) {
            __m512i acc[A8MV];
            for (int i = 0; i < nm; i++) acc[i] = _mm512_setzero_si512();
            const uint8_t* b0 = wb + kb * 256;
            for (int c = 0; c < 8; c++) {
                const __m512i u = a8_quad512(b0 + c * 32);
                for (int i = 0; i < nm; i++) {
                    int32_t xq;
                    memcpy(&xq, A->q + (m0 + i) * K + kb * A8B + c * 4, 4);
                    acc[i] = _mm512_dpbusd_epi32(acc[i], u, _mm512_set1_epi32(xq));
                }
            }
            for (int i = 0; i < nm; i++) {
                const int64_t mb = (m0 + i) * KB + kb;
                const __m512i r = _mm512_sub_epi32(acc[i], _mm512_set1_epi32(A->corr[mb]));
                t[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(r), _mm512_set1_ps(A->d[mb]), t[i]);
            }
        }
        const int64_t si = (nb * G + gi) * RB;
        const __m512 sv = a8_scales512(j, si);
        for (int i = 0; i < nm; i++) {
            __m512 ti = t[i];
            if (j->z) {
                const __m512 zv = a8_zeros512(j, si);
                ti = _mm512_fnmadd_ps(zv, _mm512_set1_ps(A->xs[(m0 + i) * G + gi]), ti);
            }
            out[i] = gi == 0 ? _mm512_mul_ps(ti, sv) : _mm512_fmadd_ps(ti, sv, out[i]);
        }
    }
    for (int i = 0; i < nm; i++) _mm512_storeu_ps(o + i * RB, out[i]);
}

/* 16 activation rows per pass (M >= 16): the codes decoded once for all 16 (a8_block_vnni:
   once per 8), the int32 sums in 16 registers starting at -corr (the same integer as
   subtracting it after), t (groups of 64 and more) and the output in L1. The same float
   operations per value as a8_block_vnni: the same bits. The activations come from a8_xt's
   layout (one pointer, constant offsets; 16 row pointers spilled: 1.35x slower). AMD EPYC
   Zen 4, Gemma head Q4 g32, real hidden states, interleaved, against the 8-row passes:
   M = 16 / 32 / 64 0.67 / 0.81 / 0.86 of the time; against vdpbf16ps (exact) 0.76-0.82 at
   M = 16-256, so on AVX512-VNNI CPUs without AMX the opt-in serves every M with it. */
static inline __attribute__((always_inline)) void a8_block_vnni16(const a8job_t* A, int64_t nb, int64_t m0, float* o) {
    const job_t* j = &A->j;
    const int64_t K = j->K, KB = K / A8B, G = j->G, BPG = j->g / A8B;
    const uint8_t* wb = j->w + nb * (K / 2) * 16;
    const int32_t* XP = A->xt + (m0 / 16) * KB * A8XT;
    float tb[16 * RB] __attribute__((aligned(64)));
    for (int64_t gi = 0; gi < G; gi++) {
        const int64_t si = (nb * G + gi) * RB;
        const __m512 sv = a8_scales512(j, si);
        const __m512 zv = j->z ? a8_zeros512(j, si) : _mm512_setzero_ps();
        for (int64_t kb = gi * BPG; kb < (gi + 1) * BPG; kb++) {
            const int32_t* X = XP + kb * A8XT;
            const float* D = (const float*)(X + 144);
            __m512i acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_epi32(X[128 + i]);
            const uint8_t* b0 = wb + kb * 256;
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                const __m512i u = a8_quad512(b0 + c * 32);
                for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], u, _mm512_set1_epi32(X[c * 16 + i]));
            }
            const int first = kb == gi * BPG, last = kb == (gi + 1) * BPG - 1;
            for (int i = 0; i < 16; i++) {
                __m512 ti = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), _mm512_set1_ps(D[i]),
                                            first ? _mm512_setzero_ps() : _mm512_load_ps(tb + i * RB));
                if (!last) { _mm512_store_ps(tb + i * RB, ti); continue; }
                if (j->z) ti = _mm512_fnmadd_ps(zv, _mm512_set1_ps(A->xs[(m0 + i) * G + gi]), ti);
                _mm512_storeu_ps(o + i * RB, gi == 0 ? _mm512_mul_ps(ti, sv) : _mm512_fmadd_ps(ti, sv, _mm512_loadu_ps(o + i * RB)));
            }
        }
    }
}

static void a8_rest(const a8job_t* A, int nm, int64_t nb, int64_t m0, float* o) {
    switch (nm) {
        case 1: a8_block_vnni(A, 1, nb, m0, o); break;
        case 2: a8_block_vnni(A, 2, nb, m0, o); break;
        case 3: a8_block_vnni(A, 3, nb, m0, o); break;
        case 4: a8_block_vnni(A, 4, nb, m0, o); break;
        case 5: a8_block_vnni(A, 5, nb, m0, o); break;
        case 6: a8_block_vnni(A, 6, nb, m0, o); break;
        case 7: a8_block_vnni(A, 7, nb, m0, o); break;
        default: a8_block_vnni(A, 8, nb, m0, o); break;
    }
}
#endif

static void* a8_run(void* arg) {
    const a8job_t* A = (const a8job_t*)arg;
    const job_t* j = &A->j;
    const int64_t K = j->K, G = j->G, KB = K / A8B, BPG = j->g / A8B;
#if EQ_VNNI
    enum { MR8 = 2 * A8MV };
#else
    enum { MR8 = A8MR };
#endif
    float o[MR8 * RB];
    for (int64_t nb = j->nb0; nb < j->nb1; nb++) {
        const int64_t r0 = nb * RB;
        const int nr = j->V - r0 < RB ? (int)(j->V - r0) : RB;
        for (int64_t m0 = 0; m0 < j->M; m0 += MR8) {
            const int nm = j->M - m0 < MR8 ? (int)(j->M - m0) : MR8;
#if EQ_VNNI
            if (nm == 2 * A8MV) a8_block_vnni16(A, nb, m0, o);
            else if (nm > A8MV) { a8_rest(A, A8MV, nb, m0, o); a8_rest(A, nm - A8MV, nb, m0 + A8MV, o + A8MV * RB); }
            else a8_rest(A, nm, nb, m0, o);
#elif EQ_A8_AVXVNNI
            /* one row: the AVX2 body (its 2 shuffles per 64 codes against 6 here win when no
               other row shares them: Gemma head from memory, M = 1 4.1-4.2 vs 4.7-5.0 ms) */
            switch (nm) {
                case 1: a8_block(A, 1, nb, m0, o); break;
                case 2: a8_block_avxvnni(A, 2, nb, m0, o); break;
                case 3: a8_block_avxvnni(A, 3, nb, m0, o); break;
                default: a8_block_avxvnni(A, 4, nb, m0, o); break;
            }
#elif EQ_AVX2
            switch (nm) {
                case 1: a8_block(A, 1, nb, m0, o); break;
                case 2: a8_block(A, 2, nb, m0, o); break;
                case 3: a8_block(A, 3, nb, m0, o); break;
                default: a8_block(A, 4, nb, m0, o); break;
            }
#else
            const uint8_t* wb = j->w + nb * (K / 2) * 16;
            for (int i = 0; i < nm; i++) {
                const int8_t* q = A->q + (m0 + i) * K;
                for (int r = 0; r < RB; r++) {
                    float acc = 0.0f;
                    for (int64_t gi = 0; gi < G; gi++) {
                        float t = 0.0f;
                        for (int64_t kb = gi * BPG; kb < (gi + 1) * BPG; kb++) {
                            int32_t dot = 0;
                            for (int p = 0; p < A8B / 2; p++) {
                                const uint8_t c = wb[(kb * (A8B / 2) + p) * RB + r];
                                dot += (c & 15) * q[kb * A8B + 2 * p] + (c >> 4) * q[kb * A8B + 2 * p + 1];
                            }
                            t += (float)(dot - A->corr[(m0 + i) * KB + kb]) * A->d[(m0 + i) * KB + kb];
                        }
                        const int64_t si = (nb * G + gi) * RB + r;
                        if (j->z) t -= (float)j->z[si] * A->xs[(m0 + i) * G + gi];
                        acc += t * scale_at(j->s, j->skind, si);
                    }
                    o[i * RB + r] = acc;
                }
            }
#endif
            for (int i = 0; i < nm; i++) store_row(o + i * RB, j->out, j->okind, (m0 + i) * j->ldo + r0, nr);
        }
    }
    return NULL;
}

/* logits[M, V] = int8(x)[M, K] @ dequant(W)^T for a 4-bit table with groups of 32k columns,
   A8MC activation rows at a time (the rounded rows take 9 bytes per value: a bounded buffer
   however long the prefill). 0 on success; 2 bad shape; 3 a value of x is not finite (the
   caller takes the exact kernel). */
enum { A8MC = 256 };

int head_q4a8(const uint8_t* w, const void* s, int skind, const int8_t* z, int64_t V, int64_t K, int64_t g,
              const void* x0, int xkind, int64_t M, void* out, int okind, int64_t ldo, int nthreads) {
    const int64_t NB = (V + RB - 1) / RB, KB = K / A8B, G = K / g, MC = M < A8MC ? M : A8MC;
    const size_t osz = okind == 0 ? 4 : 2;
    if (g % A8B || K % g) return 2;
    float* xbuf;
    const float* x = eq_x_f32(x0, xkind, M * K, &xbuf);  /* (x as head_f32 takes it) */
    if (!x) return 1;
    for (int64_t m = 0; m < M * K; m++)  /* all rows checked before any output is written */
        if (!(x[m] <= 3.4028234663852886e38f && x[m] >= -3.4028234663852886e38f)) { free(xbuf); return 3; }
    int8_t* q = malloc((size_t)MC * K);
    int8_t* xr = malloc((size_t)MC * K * 8);
    float* d = malloc(sizeof(float) * MC * KB);
    int32_t* corr = malloc(sizeof(int32_t) * MC * KB);
    float* xs = z ? malloc(sizeof(float) * MC * G) : NULL;
#if EQ_VNNI
    int32_t* xt = malloc(sizeof(int32_t) * (MC / 16 + 1) * KB * A8XT);
#else
    int32_t* xt = NULL;
#endif
    int rc = 1;
    if (!q || !xr || !d || !corr || (z && !xs) || (EQ_VNNI && !xt)) goto done;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > NB) nthreads = (int)NB;
    if (nthreads > EQ_MAX_THREADS) nthreads = EQ_MAX_THREADS;
    rc = 0;
    for (int64_t m0 = 0; m0 < M && !rc; m0 += MC) {
        const int64_t mc = M - m0 < MC ? M - m0 : MC;
        for (int64_t m = 0; m < mc; m++)
            a8_quantize(x + (m0 + m) * K, K, g, q + m * K, xr + m * K * 8, d + m * KB, corr + m * KB,
                        xs ? xs + m * G : NULL);
        if (xt)
            for (int64_t m = 0; m + 16 <= mc; m += 16)
                a8_xt(q + m * K, corr + m * KB, d + m * KB, K, xt + (m / 16) * KB * A8XT);
        a8job_t jobs[EQ_MAX_THREADS];
        for (int t = 0; t < nthreads; t++) {
            job_t jj = {w, s, z, NULL, NULL, (char*)out + (size_t)(m0 * ldo) * osz, ldo, mc, K, G, g, V,
                        NB * t / nthreads, NB * (t + 1) / nthreads, 4, skind, okind, NULL};
            a8job_t a = {jj, xr, d, corr, xs, q, xt};
            jobs[t] = a;
        }
        rc = eq_fanout(a8_run, jobs, sizeof(a8job_t), nthreads);
    }
done:
    free(q); free(xr); free(d); free(corr); free(xs); free(xt); free(xbuf);
    return rc;
}
