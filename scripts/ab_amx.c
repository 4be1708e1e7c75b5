/* A/B harness for two builds of embedq/kernels/native_amx.c (not part of the package): both
   shared objects dlopen'ed in one process, so a noisy host slows both alike.

     check: every output of B equal to A's, bit for bit (4/8-bit, g32/64/128, sym/asym, float32 /
            bf16 / float16 activations - bf16 and float16 both as raw patterns down to subnormal
            and bf16 also moderate, so the int8 kernel's scaled and unscaled decodes both run -,
            M = 1 .. 130 across every sum loop, odd block counts)
     time:  a synthetic Gemma-size table (262,144 x 640), bf16 activations, 21 rounds alternating
            A and B; prints both medians and the paired ratio B/A, median [quartiles]

   Build the two variants with the package's flags (native_head.FLAGS + AMX), e.g. the kernel at
   HEAD against a working copy:

     F="-O3 -march=native -mprefer-vector-width=512 -ffp-contract=off -shared -fPIC -fopenmp -mamx-tile -mamx-bf16"
     git show HEAD:embedq/kernels/native_amx.c > /tmp/a.c; cp embedq/kernels/eq_*.h /tmp/
     gcc $F /tmp/a.c -o /tmp/a.so && gcc $F embedq/kernels/native_amx.c -o /tmp/b.so
     gcc -O2 scripts/ab_amx.c -o /tmp/ab_amx -ldl
     /tmp/ab_amx /tmp/a.so /tmp/b.so check
     /tmp/ab_amx /tmp/a.so /tmp/b.so time 4 32 64       # bits, group, M

   Both builds must share head_amx's signature (builds before the fifteenth session took a 15th
   argument, `pre`: compare those with a harness that passes it). An ablation: a copy of the
   source with one part compiled out (e.g. the tile dots) timed against the full kernel
   (docs/performance.md, "AMX: one activation tile per sweep"). */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>

typedef int (*head_t)(const uint8_t*, const void*, int, const int8_t*, int, int64_t, int64_t, int64_t,
                      const void*, int, int64_t, void*, int64_t, int);

static head_t load(const char* path) {
    void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    head_t f = h ? (head_t)dlsym(h, "head_amx") : NULL;
    if (!f) { fprintf(stderr, "%s: %s\n", path, h ? "no head_amx" : dlerror()); exit(2); }
    return f;
}

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int cmpd(const void* a, const void* b) { double x = *(const double*)a, y = *(const double*)b; return (x > y) - (x < y); }

static int check(head_t A, head_t B) {
    static const int Ms[] = {1, 2, 3, 8, 9, 16, 17, 31, 32, 33, 64, 100, 130};
    int bad = 0;
    for (int bits = 4; bits <= 8; bits += 4) for (int g = 32; g <= 128; g *= 2) for (int zi = 0; zi < 2; zi++)
    for (int mi = 0; mi < (int)(sizeof Ms / sizeof *Ms); mi++) for (int xv = 0; xv < 4; xv++) {
        const int xk = xv == 3 ? 1 : xv;  /* 3: bf16 of the float32 values (normal, moderate) */
        const int64_t M = Ms[mi], V = 1000 + 8 + 16 * mi, K = 384, VP = (V + 15) / 16 * 16;
        const int64_t wb = bits == 8 ? VP * K : VP * K / 2, ns = VP * K / g;
        uint8_t* w = malloc(wb);
        uint16_t* s = malloc(2 * ns);
        int8_t* z = zi ? malloc(ns) : NULL;
        float* x = malloc(4 * M * K);
        for (int64_t i = 0; i < wb; i++) w[i] = rand();
        for (int64_t i = 0; i < ns; i++) { s[i] = 0x3c00 + (rand() & 1023); if (z) z[i] = rand() % 7 - 3; }
        for (int64_t k = 0; k < M * K; k++) x[k] = (rand() % 20001 - 10000) / 1234.567f;
        if (xv == 1 || xv == 2) for (int64_t k = 0; k < M * K; k++) ((uint16_t*)x)[k] = rand() & 0x3fff;
        if (xv == 3) for (int64_t k = 0; k < M * K; k++) { uint32_t u; memcpy(&u, x + k, 4); ((uint16_t*)x)[k] = u >> 16; }
        const int es = xk == 0 ? 4 : 2;
        char* o1 = calloc(V * M, es), * o2 = calloc(V * M, es);
        int ra = A(w, s, 2, z, bits, V, K, g, x, xk, M, o1, V, 2), rb = B(w, s, 2, z, bits, V, K, g, x, xk, M, o2, V, 2);
        if (ra || rb || memcmp(o1, o2, V * M * es)) {
            printf("DIFF bits %d g %d z %d M %ld x %d (rc %d %d)\n", bits, g, zi, (long)M, xv, ra, rb);
            bad = 1;
        }
        free(w); free(s); free(z); free(x); free(o1); free(o2);
    }
    printf(bad ? "differences\n" : "identical\n");
    return bad;
}

/* the output as the package allocates it (hugepages.huge_empty): 2 MiB-aligned and madvised
   MADV_HUGEPAGE from 32 MiB, else 64-byte aligned like torch's allocator. A plain malloc's
   16-byte offset turned off the kernel's streaming stores (they need 64-byte lines), which
   distorted every timing at M >= 16 before the seventeenth session. */
static void* alloc_out(size_t n) {
    if (n < (32u << 20)) return aligned_alloc(64, (n + 63) & ~(size_t)63);
    const size_t hp = 2u << 20, r = (n + hp - 1) & ~(hp - 1);
    void* p = aligned_alloc(hp, r);
    if (p) madvise(p, r, MADV_HUGEPAGE);
    return p;
}

static int timing(head_t A, head_t B, int bits, int64_t g, int64_t M) {
    enum { R = 21 };
    const int64_t V = 262144, K = 640, wb = bits == 8 ? V * K : V * K / 2;
    /* the table in 2 MiB pages, madvised before the first touch, as the package prepares it
       (hugepages.py). Calls still run in one of two modes, per process or window (Q4 g32 M = 64:
       ~23 or ~37-40 ms, both builds alike; not the page size): compare paired ratios within a mode. */
    const size_t wr = ((size_t)wb + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    uint8_t* w = aligned_alloc(2 << 20, wr);
    if (w) madvise(w, wr, MADV_HUGEPAGE);
    uint16_t* s = malloc(2 * V * K / g), * x = malloc(2 * M * K), * out = alloc_out(2 * V * M);
    for (int64_t i = 0; i < wb; i++) w[i] = rand() & (bits == 8 ? 0x3f : 0x77);
    for (int64_t i = 0; i < V * K / g; i++) s[i] = 0x3c00 + (rand() & 255);
    for (int64_t k = 0; k < M * K; k++) x[k] = 0x3f80 + (rand() & 127);
    double ta[R], tb[R], r[R];
    for (int i = 0; i < R; i++) {
        double t = now();
        A(w, s, 2, NULL, bits, V, K, g, x, 1, M, out, V, 2);
        ta[i] = now() - t;
        t = now();
        B(w, s, 2, NULL, bits, V, K, g, x, 1, M, out, V, 2);
        tb[i] = now() - t;
        r[i] = tb[i] / ta[i];
    }
    qsort(ta, R, 8, cmpd); qsort(tb, R, 8, cmpd); qsort(r, R, 8, cmpd);
    printf("bits %d g %ld M %ld: A %.2f ms, B %.2f ms, paired B/A %.3f [%.3f-%.3f]\n", bits, (long)g, (long)M,
           1e3 * ta[R / 2], 1e3 * tb[R / 2], r[R / 2], r[R / 4], r[3 * R / 4]);
    return 0;
}

int main(int argc, char** argv) {
    if (argc < 4 || (strcmp(argv[3], "check") && (strcmp(argv[3], "time") || argc < 7))) {
        fprintf(stderr, "usage: %s A.so B.so check | time BITS GROUP M\n", argv[0]);
        return 2;
    }
    head_t A = load(argv[1]), B = load(argv[2]);
    if (!strcmp(argv[3], "check")) return check(A, B);
    return timing(A, B, atoi(argv[4]), atoll(argv[5]), atoll(argv[6]));
}
