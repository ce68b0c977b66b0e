/*
 * One kernel call of one body, for bench/insn_counts.py, which runs this program under QEMU
 * user-mode emulation with its execution log and counts the instructions executed.
 *
 *   insn_driver KERNEL DTYPE SUMS SIZE BODY
 *
 * KERNEL: reduce_row, apply_row, scale_row (one contiguous channel-major row of SIZE elements)
 * or reduce_rows, apply_rows, scale_rows (SIZE contiguous rows of CHANNELS channels).
 * DTYPE: f32, f16, bf16.  SUMS: exact, blocks, even_odd (the reductions' sum mode).
 * BODY: the level asked of bnbw_kernels_of (0 portable, 1 AVX2 or NEON, 2 AVX-512).
 *
 * The buffers are sized and filled for the largest SIZE whatever SIZE is, so two runs that
 * differ only in SIZE differ only in the kernel's work.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bnbw_half.h"
#include "bnbw_kernels.h"

#define MAX_ELEMENTS (1 << 16)
#define CHANNELS 256

static float x32[MAX_ELEMENTS], dy32[MAX_ELEMENTS], dx32[MAX_ELEMENTS];
static uint16_t x16[MAX_ELEMENTS], dy16[MAX_ELEMENTS], dx16[MAX_ELEMENTS];
static float mean[CHANNELS], k1[CHANNELS], k2[CHANNELS], k3[CHANNELS];
static double sum_g[CHANNELS], sum_xg[CHANNELS];

static uint32_t state = 12345;
static float uniform(void)          /* in [-2, 2) */
{
    state = state * 1664525u + 1013904223u;
    return (float)(state >> 8) / (float)(1 << 22) - 2.0f;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: %s KERNEL DTYPE SUMS SIZE BODY\n", argv[0]);
        return 2;
    }
    const char *kernel = argv[1], *dtype = argv[2], *sums_name = argv[3];
    const int64_t size = atoll(argv[4]);
    const int body = atoi(argv[5]);
    const int dt = !strcmp(dtype, "f32") ? BNBW_F32 : !strcmp(dtype, "f16") ? BNBW_F16 : BNBW_BF16;
    const int sums = !strcmp(sums_name, "exact") ? BNBW_EXACT_SUMS
                     : !strcmp(sums_name, "blocks") ? BNBW_BLOCKS : BNBW_BLOCKS_EVEN_ODD;
    const int rows_kernel = strstr(kernel, "_rows") != NULL;
    if (size <= 0 || size * (rows_kernel ? CHANNELS : 1) > MAX_ELEMENTS) {
        fprintf(stderr, "SIZE out of range\n");
        return 2;
    }
    for (int64_t e = 0; e < MAX_ELEMENTS; ++e) {
        x32[e] = uniform() + 0.5f;
        dy32[e] = uniform();
        x16[e] = dt == BNBW_F16 ? bnbw_f32_to_f16(x32[e]).bits : bnbw_f32_to_bf16(x32[e]).bits;
        dy16[e] = dt == BNBW_F16 ? bnbw_f32_to_f16(dy32[e]).bits : bnbw_f32_to_bf16(dy32[e]).bits;
    }
    for (int c = 0; c < CHANNELS; ++c) {
        mean[c] = 0.5f + uniform() / 8;
        k1[c] = uniform();
        k2[c] = uniform();
        k3[c] = uniform();
    }
    if (bnbw_cpu_body() < body) {
        fprintf(stderr, "this CPU does not run body level %d\n", body);
        return 3;
    }
    const bnbw_kernel_table *t = bnbw_kernels_of(body);
    const int64_t step = rows_kernel ? CHANNELS : 1;
    bnbw_io io = {dt == BNBW_F32 ? (const void *)x32 : (const void *)x16,
                  dt == BNBW_F32 ? (const void *)dy32 : (const void *)dy16, NULL,
                  dt == BNBW_F32 ? (void *)dx32 : (void *)dx16, NULL,
                  step, step, 0, step, 0, dt, BNBW_NO_MASK};
    double out[2] = {0, 0};
    if (!strcmp(kernel, "reduce_row"))
        t->reduce_row(&io, size, mean[0], out, sums);
    else if (!strcmp(kernel, "apply_row"))
        t->apply_row(&io, size, mean[0], k1[0], k2[0], k3[0]);
    else if (!strcmp(kernel, "scale_row"))
        t->scale_row(&io, size, k1[0]);
    else if (!strcmp(kernel, "reduce_rows"))
        t->reduce_rows(&io, size, CHANNELS, mean, sum_g, sum_xg, 0, sums);
    else if (!strcmp(kernel, "apply_rows"))
        t->apply_rows(&io, size, CHANNELS, mean, k1, k2, k3);
    else if (!strcmp(kernel, "scale_rows"))
        t->scale_rows(&io, size, CHANNELS, k1);
    else {
        fprintf(stderr, "unknown kernel %s\n", kernel);
        return 2;
    }
    /* keep the results live */
    double check = out[0] + out[1] + sum_g[0] + sum_xg[CHANNELS - 1];
    for (int64_t e = 0; e < 16; ++e)
        check += dt == BNBW_F32 ? dx32[e] : dx16[e];
    printf("%s %s %s %lld on %s: %g\n", kernel, dtype, sums_name, (long long)size,
           bnbw_body_name(body), check);
    return 0;
}
