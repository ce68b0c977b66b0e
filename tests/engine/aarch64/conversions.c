/*
 * The AArch64 conversion instructions the NEON code uses, against the portable definition
 * (src/bnbw_half.h's scalar functions), on every input:
 *
 *   FCVTL  f16 -> f32   all 65,536 halves: the same bits, except that a signalling NaN comes
 *                       out quiet (the kernels' arithmetic does not keep NaN payloads; the
 *                       row converters send NaNs to the scalar code)
 *   FCVTN  f32 -> f16   the floats below: the same bits for every number (ties to even,
 *                       subnormals, overflow); a NaN gives a NaN
 *   bf16 rounding       the floats below: the integer NEON code gives the same bits, NaNs too
 *   row converters      bnbw_load_f16/store_f16/load_bf16/store_bf16 with simd=1 against
 *                       simd=0 (the portable code) on all halves and the floats below
 *
 * The floats: with the argument "all" every one of the 2^32 (about 5 minutes of CPU under
 * QEMU); by default every float of both signs whose exponent field is 0, 1, 100..144, 254 or
 * 255 - all f32 subnormals, everything from below half a half-subnormal (rounds to 0) to past
 * the largest half (rounds to infinity), infinities and NaNs - and every bf16 rounding case
 * (which depends on the low 17 bits alone), a fifth of the floats.
 *
 * Built and run by .ci/aarch64.sh inside the arm64 root file system (cc -O2 -Isrc); exits 0
 * when everything agrees and prints what it checked.
 */
#include <arm_neon.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bnbw_half.h"

#ifndef BNBW__NEON_DISPATCH
#error "an AArch64 compiler with NEON is needed"
#endif

static int is_nan16(uint16_t h) { return (h & 0x7fff) > 0x7c00; }
static int is_nan32(uint32_t x) { return (x & 0x7fffffffu) > 0x7f800000u; }

static long failures;
static void fail(const char *what, uint32_t in, uint32_t got, uint32_t want)
{
    if (failures++ < 10)
        printf("MISMATCH %s: input 0x%08" PRIx32 " gives 0x%08" PRIx32 ", portable 0x%08" PRIx32 "\n",
               what, in, got, want);
}

#define CHUNK 4096     /* floats per row-converter call */

int main(int argc, char **argv)
{
    const int all = argc > 1 && !strcmp(argv[1], "all");
    int exponents[256], n_exp = 0;
    for (int e = 0; e < 256; ++e)
        if (all || e <= 1 || (e >= 100 && e <= 144) || e >= 254)
            exponents[n_exp++] = e;
    long quieted = 0;
    /* FCVTL, every half */
    for (uint32_t h = 0; h < 0x10000; h += 4) {
        uint16_t in[4] = {(uint16_t)h, (uint16_t)(h + 1), (uint16_t)(h + 2), (uint16_t)(h + 3)};
        uint32_t out[4];
        vst1q_u32(out, vreinterpretq_u32_f32(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(in)))));
        for (int l = 0; l < 4; ++l) {
            uint32_t want = bnbw__f32_bits(bnbw_f16_to_f32((bnbw_f16){in[l]}));
            if (out[l] == want)
                continue;
            if (is_nan16(in[l]) && out[l] == (want | 0x00400000u))
                quieted++;
            else
                fail("FCVTL", in[l], out[l], want);
        }
    }
    printf("FCVTL: 65536 halves checked, %ld signalling NaNs come out quiet (expected 1022)\n",
           quieted);
    if (quieted != 1022)
        failures++;

    /* FCVTN, bf16 rounding and the row converters, every float, a chunk at a time */
    static float src[CHUNK];
    static uint16_t a16[CHUNK], b16[CHUNK];
    static float a32[CHUNK], b32[CHUNK];
    long nan_f16 = 0;
    uint64_t floats = 0;
    for (int block = 0; block < 2 * n_exp; ++block)     /* sign, exponent: 2^23 floats each */
    for (uint64_t x = ((uint64_t)(block / n_exp) << 31) | ((uint64_t)exponents[block % n_exp] << 23),
                  end = x + (UINT64_C(1) << 23); x < end; x += CHUNK) {
        floats += CHUNK;
        for (int k = 0; k < CHUNK; ++k) {
            uint32_t u = (uint32_t)(x + (uint64_t)k);
            memcpy(src + k, &u, 4);
        }
        for (int k = 0; k < CHUNK; k += 4) {
            float32x4_t v = vld1q_f32(src + k);
            uint16_t h[4], b[4];
            vst1_u16(h, vreinterpret_u16_f16(vcvt_f16_f32(v)));
            uint32x4_t q = bnbw__bf16_quiet4(v);
            vst1_u16(b, bnbw__bf16_round4(q));
            for (int l = 0; l < 4; ++l) {
                uint32_t u = bnbw__f32_bits(src[k + l]);
                uint16_t wh = bnbw_f32_to_f16(src[k + l]).bits;
                uint16_t wb = bnbw_f32_to_bf16(src[k + l]).bits;
                if (h[l] != wh) {
                    if (is_nan32(u) && is_nan16(h[l]))
                        nan_f16++;
                    else
                        fail("FCVTN", u, h[l], wh);
                }
                if (b[l] != wb)
                    fail("bf16 rounding", u, b[l], wb);
            }
        }
        /* row converters: every float through store and back, simd against portable */
        bnbw_store_f16(src, CHUNK, (char *)a16, 2, 1);
        bnbw_store_f16(src, CHUNK, (char *)b16, 2, 0);
        if (memcmp(a16, b16, sizeof a16))
            fail("bnbw_store_f16", (uint32_t)x, 0, 0);
        bnbw_store_bf16(src, CHUNK, (char *)a16, 2, 1);
        bnbw_store_bf16(src, CHUNK, (char *)b16, 2, 0);
        if (memcmp(a16, b16, sizeof a16))
            fail("bnbw_store_bf16", (uint32_t)x, 0, 0);
        if (x < 0x10000 * 2) {       /* the first 2^17 floats: their low halves, all patterns */
            uint16_t h[CHUNK];
            for (int k = 0; k < CHUNK; ++k)
                h[k] = (uint16_t)(x + (uint64_t)k);
            bnbw_load_f16((const char *)h, 2, CHUNK, a32, 1);
            bnbw_load_f16((const char *)h, 2, CHUNK, b32, 0);
            if (memcmp(a32, b32, sizeof a32))
                fail("bnbw_load_f16", (uint32_t)x, 0, 0);
            bnbw_load_bf16((const char *)h, 2, CHUNK, a32, 1);
            bnbw_load_bf16((const char *)h, 2, CHUNK, b32, 0);
            if (memcmp(a32, b32, sizeof a32))
                fail("bnbw_load_bf16", (uint32_t)x, 0, 0);
        }
    }
    printf("FCVTN: %" PRIu64 " floats checked, every number rounds as the portable code; %ld "
           "NaNs differ only in payload (expected 8388606: the signalling ones, made quiet)\n",
           floats, nan_f16);
    if (nan_f16 != 8388606)
        failures++;
    printf("bf16 rounding (NEON integer code): %" PRIu64 " floats checked\n", floats);
    printf("row converters (simd=1 against simd=0): %" PRIu64 " floats stored as f16 and bf16, "
           "65,536 halves of each kind loaded\n", floats);
    printf("row converters take the NEON code: %s\n", bnbw_half_simd_path(1));
    if (failures) {
        printf("conversions: %ld mismatches\n", failures);
        return 1;
    }
    printf("conversions: all agree\n");
    return 0;
}
