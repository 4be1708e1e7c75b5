/* C-level check of embedq/kernels/native_f32.c (compiled with it; run natively for both x86
   builds and under qemu-aarch64 for the portable build: tests/perf/test_aarch64.py).

   For every scheme (int8 / 4-bit, per row and groups 32/64/128, sym and asym, scales f32 /
   bf16 / f16), M in {1, 2, 3, 8, 17} and odd shapes (vocab not a multiple of 16 nor of the
   128-row super-block, 3 groups): random codes are packed as the overlay stores them
   (pack-quantized int32 words, element 0 in the low bits, offset binary u = q + 2^(b-1)),
   decoded by the C reference below (the arithmetic of embedq/format/codec.py:
   (q - z) * s in float32), repacked into the native blocked layout as native_head.pack
   does, and the kernel's logits are compared with the reference dot in double.

   Bound per output (float32 output): |got - ref| <= (K + 2) * 2^-24 * A + tiny, with
   A = sum_k |x_k| |w_k| (float32 summation in any order: K roundings of partial sums
   bounded by A; scale-after and z * sum(x) add two more), plus one output rounding
   (2^-8 for bf16 outputs). The 4-bit grouped cases also run head_q4a8 (int8 activations,
   eq_q4a8.h) against the same dot over the activations as round_activations() rounds them.
   Exit status 0 = all passed; failures are printed. */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int head_f32(const uint8_t* w, const void* s, int skind, const int8_t* z, int bits, int64_t V, int64_t K,
             int64_t g, const void* x, int xkind, int64_t M, void* out, int okind, int64_t ldo, int nthreads);
int head_q4a8(const uint8_t* w, const void* s, int skind, const int8_t* z, int64_t V, int64_t K, int64_t g,
              const void* x, int xkind, int64_t M, void* out, int okind, int64_t ldo, int nthreads);

/* int8 activations (the opt-in, eq_q4a8.h), written independently: per row and block of 32,
   d = amax / 127, q = rint(x * (127 / amax)) (round half to even), into x itself as q * d */
static void round_activations(float* x, int64_t n) {
    for (int64_t b = 0; b < n; b += 32) {
        float amax = 0.0f, id, v;
        for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(x[b + k]));
        id = amax > 0 ? 127.0f / amax : 0.0f;
        for (int k = 0; k < 32; k++) { v = x[b + k] * id; x[b + k] = rintf(v) * (amax / 127.0f); }
    }
}

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (uint32_t)rng; }
static float frand(void) { return (float)((rnd() >> 8) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }

static uint16_t to_bf16(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16); }
static float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
/* f16 of small normal values only (scales here are in [2^-8, 2)): exact construction */
static uint16_t make_f16(int e, int m) { return (uint16_t)(((e + 15) << 10) | m); }
static float from_f16(uint16_t h) { int e = (h >> 10) & 31, m = h & 1023; return ldexpf(1.0f + m / 1024.0f, e - 15); }

/* the C reference decoder: one element of the overlay's packed rows */
static float ref_weight(const int32_t* packed, int64_t wpr, int bits, int64_t r, int64_t c,
                        const float* sc, const int8_t* zp, int64_t G, int64_t g) {
    int pf = 32 / bits;
    uint32_t word = (uint32_t)packed[r * wpr + c / pf];
    int u = (int)((word >> ((c % pf) * bits)) & ((1u << bits) - 1));
    int q = u - (1 << (bits - 1));
    int64_t gi = c / g;
    float z = zp ? (float)zp[r * G + gi] : 0.0f;
    return ((float)q - z) * sc[r * G + gi];
}

static int check(int bits, int64_t g0, int asym, int skind, int64_t V, int64_t K, int64_t M, int okind, int a8) {
    const int64_t g = g0 ? g0 : K, G = K / g, pf = 32 / bits, wpr = K / pf, NB = (V + 15) / 16, KP = K / 2;
    int32_t* packed = calloc(V * wpr, 4);
    float* sc = malloc(sizeof(float) * V * G);
    int8_t* zp = asym ? malloc(V * G) : NULL;
    uint16_t* s16 = calloc(NB * G * 16, 2);
    float* s32 = calloc(NB * G * 16, 4);
    int8_t* zb = asym ? calloc(NB * G * 16, 1) : NULL;
    uint8_t* w = calloc(NB * KP * (bits == 8 ? 32 : 16), 1);
    float* x = malloc(sizeof(float) * M * K);
    float* out = malloc(sizeof(float) * M * V);
    int bad = 0;
    const int qmax = (1 << (bits - 1)) - 1, qmin = -(1 << (bits - 1));
    for (int64_t r = 0; r < V; r++)
        for (int64_t c = 0; c < K; c++) {
            int q = qmin + (int)(rnd() % (uint32_t)(qmax - qmin + 1));
            uint32_t u = (uint32_t)(q - qmin);
            packed[r * wpr + c / pf] |= (int32_t)(u << ((c % pf) * bits));
        }
    for (int64_t r = 0; r < V; r++)
        for (int64_t gi = 0; gi < G; gi++) {
            /* a scale exactly representable in every scale dtype: 1.m (7 bits) x 2^e */
            int e = -8 + (int)(rnd() % 9), m = (int)(rnd() % 128);
            float s = ldexpf(1.0f + m / 128.0f, e) * ((rnd() & 1) ? 1.0f : -1.0f);
            sc[r * G + gi] = s;
            int64_t i = ((r / 16) * G + gi) * 16 + r % 16;
            s32[i] = s;
            s16[i] = skind == 1 ? to_bf16(s) : (uint16_t)(make_f16(e, m * 8) | (s < 0 ? 0x8000 : 0));
            if (skind == 2 && from_f16(s16[i] & 0x7fff) != fabsf(s)) { printf("f16 scale construction\n"); return 1; }
            if (skind == 1 && from_bf16(s16[i]) != s) { printf("bf16 scale construction\n"); return 1; }
            if (asym) { zp[r * G + gi] = (int8_t)(qmin + (int)(rnd() % (uint32_t)(qmax - qmin + 1))); zb[i] = zp[r * G + gi]; }
        }
    /* native layout (native_head.pack): int8 [NB][K/2][16][2] signed; 4-bit [NB][K/2][16] bytes */
    for (int64_t r = 0; r < V; r++)
        for (int64_t c = 0; c < K; c++) {
            uint32_t word = (uint32_t)packed[r * wpr + c / pf];
            uint32_t u = (word >> ((c % pf) * bits)) & ((1u << bits) - 1);
            int64_t nb = r / 16, lane = r % 16, p = c / 2;
            if (bits == 8) w[((nb * KP + p) * 16 + lane) * 2 + c % 2] = (uint8_t)(u ^ 0x80);
            else w[(nb * KP + p) * 16 + lane] |= (uint8_t)(u << (4 * (c % 2)));
        }
    for (int64_t i = 0; i < M * K; i++) x[i] = frand();
    const void* sp = skind == 0 ? (const void*)s32 : (const void*)s16;
    if (a8 ? head_q4a8(w, sp, skind, zb, V, K, g, x, 0, M, out, okind, V, 2)
           : head_f32(w, sp, skind, zb, bits, V, K, g, x, 0, M, out, okind, V, 2)) { printf("kernel error\n"); return 1; }
    if (a8) round_activations(x, M * K);  /* the reference multiplies what the kernel rounded */
    for (int64_t m = 0; m < M; m++)
        for (int64_t r = 0; r < V; r++) {
            double ref = 0, a = 0;
            for (int64_t c = 0; c < K; c++) {
                float wv = ref_weight(packed, wpr, bits, r, c, sc, zp, G, g);
                double zs = asym ? fabs((double)zp[r * G + c / g] * sc[r * G + c / g]) : 0;
                ref += (double)x[m * K + c] * wv;
                a += fabs((double)x[m * K + c]) * (fabs((double)wv) + zs);
            }
            double got = okind == 0 ? ((float*)out)[m * V + r] : from_bf16(((uint16_t*)out)[m * V + r]);
            double bound = (K + 2) * ldexp(1.0, -24) * a + (okind ? ldexp(1.0, -8) * fabs(ref) * 1.01 : 0) + 1e-30;
            if (fabs(got - ref) > bound) {
                if (bad < 3) printf("FAIL a8=%d bits=%d g=%lld asym=%d skind=%d V=%lld K=%lld M=%lld okind=%d m=%lld r=%lld got=%g ref=%g bound=%g\n",
                                    a8, bits, (long long)g0, asym, skind, (long long)V, (long long)K, (long long)M, okind,
                                    (long long)m, (long long)r, got, ref, bound);
                bad++;
            }
        }
    free(packed); free(sc); free(zp); free(s16); free(s32); free(zb); free(w); free(x); free(out);
    return bad != 0;
}

int main(void) {
    static const int64_t groups[] = {0, 32, 64, 128};
    static const int64_t ms[] = {1, 2, 3, 8, 17};
    int fails = 0, n = 0;
    for (int bits = 4; bits <= 8; bits += 4)
        for (int gi = 0; gi < 4; gi++)
            for (int asym = 0; asym < 2; asym++)
                for (int mi = 0; mi < 5; mi++) {
                    int64_t g = groups[gi], K = g ? 3 * g : 200, V = 16 * 9 + 5;  /* 3 groups; odd vocab */
                    int skind = (int)((gi + asym + mi) % 3), okind = mi % 2;
                    fails += check(bits, g, asym, skind, V, K, ms[mi], okind, 0);
                    n++;
                    if (bits == 4 && g) { fails += check(bits, g, asym, skind, V, K, ms[mi], okind, 1); n++; }
                }
    printf("%d of %d cases failed\n", fails, n);
    return fails != 0;
}
