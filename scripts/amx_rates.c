/* AMX rates on this CPU (not part of the package): the time of one TDPBF16PS (16 x 16 x 32),
   with its tile loads from L1- or L2-sized working sets, and with a tile store after each dot.
   The facts behind native_amx.c's loop choices (docs/performance.md, eighteenth session).

     gcc -O2 -march=native -mamx-tile -mamx-bf16 scripts/amx_rates.c -o amx_rates && ./amx_rates

   Run it alone: one thread, so it measures one core. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) cfg_t;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

/* 6 tile loads (2 A, 2 x 2 B) per 8 dots, the tiles cycling through two kb-KiB regions */
static double loads_and_dots(long kb, long n) {
    char* A = aligned_alloc(4096, kb * 1024), * B = aligned_alloc(4096, kb * 1024);
    memset(A, 0, kb * 1024); memset(B, 0, kb * 1024);
    long ia = 0, ib = 0;
    double t = now();
    for (long i = 0; i < n; i++) {
        _tile_loadd(4, A + ia * 1024, 64); _tile_loadd(5, A + (ia + 1) * 1024, 64);
        _tile_loadd(6, B + ib * 1024, 64); _tile_loadd(7, B + (ib + 1) * 1024, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(6, B + (ib + 2) * 1024, 64); _tile_loadd(7, B + (ib + 3) * 1024, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        ia += 2; if (ia + 2 > kb) ia = 0;
        ib += 4; if (ib + 4 > kb) ib = 0;
    }
    t = now() - t;
    free(A); free(B);
    return t / (8.0 * n) * 1e9;
}

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { fprintf(stderr, "no AMX tile permission\n"); return 1; }
    cfg_t c; memset(&c, 0, sizeof c); c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
    static char buf[4096] __attribute__((aligned(64)));
    memset(buf, 0, sizeof buf);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);  /* tile numbers are immediates */
    _tile_loadd(4, buf, 64); _tile_loadd(5, buf, 64); _tile_loadd(6, buf, 64); _tile_loadd(7, buf, 64);
    const long N = 2000000;
    for (int rep = 0; rep < 3; rep++) {  /* the first round warms the unit up */
        double t = now();
        for (long i = 0; i < N; i++) {
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
        const double dot = (now() - t) / (4.0 * N) * 1e9;
        t = now();
        for (long i = 0; i < N; i++) { _tile_dpbf16ps(0, 4, 6); _tile_stored(0, buf, 64); _tile_zero(0); }
        const double st = (now() - t) / N * 1e9;
        printf("ns per dot: dots only %.2f | dot + tile store %.2f | 6 loads per 8 dots, 8 KiB (L1) %.2f, "
               "80 KiB (L2) %.2f, 1 MiB %.2f\n", dot, st, loads_and_dots(8, N / 5), loads_and_dots(80, N / 5),
               loads_and_dots(1024, N / 5));
    }
    _tile_release();
    return 0;
}
