/* Scalar float conversions of embedq's C kernels: exact, round-to-nearest-even, NaN kept
   quiet - the same results as torch's casts. */
#ifndef EQ_CONVERT_H
#define EQ_CONVERT_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The kernels' code stream read 4 KiB ahead: on an Intel Xeon (Sapphire Rapids class) the
   hardware prefetchers left their code loads stalled (perf: most samples on one load).
   Measured per kernel in docs/performance.md ("seventh session"). A hint: never faults. */
#define EQ_PREFETCH(p) __builtin_prefetch((const char*)(p) + 4096, 0, 3)
/* Running integer sums stay running sums: an empty asm that may "change" v, so GCC cannot
   reassociate the additions across it. Without it GCC 12 turns an unrolled loop of sums (the
   4-bit M = 1 planes at g32, the AVX2 int8-activation body) into all the products first and a
   tree of additions after, spilling most products to the stack. Where it is used and what it
   measured: eq_q4planes.h, eq_q4a8.h. */
#if defined(__GNUC__) && defined(__AVX2__)
#define EQ_KEEP(v) __asm__("" : "+x"(v))
#else  /* (SIMDe's emulated vectors are structs, not registers) */
#define EQ_KEEP(v) ((void)0)
#endif

static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

static inline float f16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 0x3ff, u;
    if (e == 0) { float f = (float)m * (1.0f / 16777216.0f); memcpy(&u, &f, 4); u |= s; } /* m * 2^-24 */
    else if (e == 31) u = s | 0x7f800000u | (m << 13);
    else u = s | ((e + 112) << 23) | (m << 13);
    float f; memcpy(&f, &u, 4); return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t x; memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000); x &= 0x7fffffffu;
    if (x >= 0x7f800000u) return sign | 0x7c00 | (x > 0x7f800000u ? 0x200 : 0);
    if (x >= 0x477ff000u) return sign | 0x7c00;          /* rounds to >= 65536: inf */
    if (x < 0x38800000u) {                                /* |f| < 2^-14: subnormal half */
        float a; memcpy(&a, &x, 4);
        volatile float t = a * 16777216.0f + 12582912.0f; /* RNE to an integer (< 2^10) */
        return sign | (uint16_t)(int)(t - 12582912.0f);
    }
    return sign | (uint16_t)((x - 0x38000000u + 0xfffu + ((x >> 13) & 1)) >> 13);
}

/* x[i] as float32; kind: 0 float32, 1 bf16, 2 float16 (build.SCALE_KIND's codes) */
static inline float eq_x_at(const void* x, int kind, int64_t i) {
    if (kind == 0) return ((const float*)x)[i];
    const uint16_t h = ((const uint16_t*)x)[i];
    return kind == 1 ? bf16_to_f32(h) : f16_to_f32(h);
}

/* x[0 .. n) as float32: x itself (kind 0), else a converted copy in *buf (bf16 / float16: exact)
   that the caller frees. The C kernels take activations in their own dtype: a torch cast before
   the call cost ~60 us per decode step with the caches cold (the body streamed through them).
   NULL: out of memory. */
static inline const float* eq_x_f32(const void* x, int kind, int64_t n, float** buf) {
    *buf = NULL;
    if (kind == 0) return (const float*)x;
    float* b = malloc(sizeof(float) * (n ? n : 1));
    if (!b) return NULL;
    const uint16_t* h = (const uint16_t*)x;
    if (kind == 1) for (int64_t i = 0; i < n; i++) b[i] = bf16_to_f32(h[i]);
    else for (int64_t i = 0; i < n; i++) b[i] = f16_to_f32(h[i]);
    *buf = b;
    return b;
}

/* Per-group sums of the activations, xs[m][K/g] = sum of x[m][gi*g .. gi*g+g) in float32,
   left to right: the zero-point term z * sum(x) of asymmetric rows (every kernel's). */
static inline void eq_group_sums(const void* x, int kind, int64_t M, int64_t K, int64_t g, float* xs) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t gi = 0; gi < K / g; gi++) {
            float a = 0;
            for (int64_t k = 0; k < g; k++) a += eq_x_at(x, kind, m * K + gi * g + k);
            xs[m * (K / g) + gi] = a;
        }
}

#endif
