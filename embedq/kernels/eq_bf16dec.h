/* Codes -> bf16 pairs and scale/zero loads of the native blocked layout (native_head.py),
   shared by the vdpbf16ps kernel (native_bf16.c) and the AMX kernel (native_amx.c).
   int8: codes [NB][K/2][16][2] signed; 4-bit: bytes [NB][K/2][16], low nibble = column 2p,
   high = 2p+1, offset binary (u = q + 8). Every code is exact in bf16. */
#ifndef EQ_BF16DEC_H
#define EQ_BF16DEC_H
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

/* An int8 code has at most 8 significant bits, so its float32 is exact in bf16: the float32's
   upper 16 bits are its bf16. One word permute gathers them (words 0..15 from lo: pair-
   interleaved), where vcvtne2ps2bf16 rounded what needs no rounding (two uops; interleaved
   C A/B in the AMX kernel, int8 g64, Xeon with AMX: M = 8 / 16 0.94-0.96, M = 64 0.98-1.00). */
static inline __m512i dec8(const int8_t* p) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
    const __m512i up = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                        31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_epi16(_mm512_castps_si512(lo), up, _mm512_castps_si512(hi));
}

#ifdef __AVX512FP16__
/* dec8's codes times 2^-112, in four uops where dec8 takes five (three on the shuffle port):
   an int8 code's float16 (vcvtw2ph, exact) shifted right by 3 (arithmetic) and masked to
   0x8FFF is sign | exponent | top 7 mantissa bits with the exponent field left at float16's
   (bias 15, not bf16's 127): the bf16 of q * 2^-112, normal for every q != 0, 0 for 0. The
   caller scales the other operand by 2^56 and the scales by 2^56 (powers of two: the same
   bits wherever nothing leaves the normal range - native_amx.c checks its activations).
   Decode loop alone, Xeon with AMX: 3.2 TSC cycles per 32 codes against dec8's 4.4-4.9. */
static inline __m512i dec8s(const int8_t* p) {
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
    const __m512i h = _mm512_castph_si512(_mm512_cvtepi16_ph(w));
    return _mm512_and_si512(_mm512_srai_epi16(h, 3), _mm512_set1_epi16((short)0x8FFF));
}
#endif

static inline __m512i dec4(const uint8_t* p, __m512i tbl) {
#if defined(__AVX512VBMI__) && !defined(EQ_NO_VBMI_DEC4)
    /* Three uops where the form below takes five: each byte to both words of its row's dword
       (vpermb), the odd words shifted right by 4 (vpsrlvw); vpermw reads an index's low 5 bits,
       and the table repeats its 16 entries (dec4_table), so the bits above the nibble (the
       other nibble, or the byte's bit 0 at bit 4) select the same value. */
    const __m512i spread = _mm512_set_epi32(0x0F0F0F0F, 0x0E0E0E0E, 0x0D0D0D0D, 0x0C0C0C0C, 0x0B0B0B0B,
        0x0A0A0A0A, 0x09090909, 0x08080808, 0x07070707, 0x06060606, 0x05050505, 0x04040404, 0x03030303,
        0x02020202, 0x01010101, 0x00000000);
    const __m512i b = _mm512_permutexvar_epi8(spread, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)p)));
    return _mm512_permutexvar_epi16(_mm512_srlv_epi16(b, _mm512_set1_epi32(0x00040000)), tbl);
#else
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    __m512i idx = _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), _mm512_set1_epi32(0x000F000F));
    return _mm512_permutexvar_epi16(idx, tbl); /* nibble n -> bf16(n - 8) */
#endif
}

/* 16 rows x one column pair (pair = block * K/2 + p) as bf16 pairs */
static inline __m512i dec_pair(const uint8_t* w, int bits, int64_t pair, __m512i tbl) {
    return bits == 8 ? dec8((const int8_t*)w + pair * 32) : dec4(w + pair * 16, tbl);
}

/* the 4-bit lookup: nibble n -> bf16(n - 8) */
static inline __m512i dec4_table(void) {
    uint16_t t[32] = {0};  /* entries 16-31 repeat 0-15 (dec4's VBMI form reads 5 index bits) */
    for (int n = 0; n < 32; n++) { float f = (float)((n & 15) - 8); uint32_t u; memcpy(&u, &f, 4); t[n] = u >> 16; }
    return _mm512_loadu_si512(t);
}

static inline __m512 load_scale(const void* s, int kind, int64_t i) {
    if (kind == 0) return _mm512_loadu_ps((const float*)s + i);
    __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)s + i));
    if (kind == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

static inline __m512 load_zero(const int8_t* z, int64_t i) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(z + i))));
}

#endif
