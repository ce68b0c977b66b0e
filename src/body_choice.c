/* Which kernel body runs: the best the CPU and the OS support, at most the cap (see
 * bnbw_kernels.h).  One copy of this state per process: only the engine's extension module
 * links it, and the other modules ask the engine. */
#include <stddef.h>

#include "bnbw_kernels.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>

/* XCR0: which register state the OS saves and restores on a context switch. */
static unsigned long long bnbw__xcr0(void)
{
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

static int bnbw__detect(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return BNBW_BODY_PORTABLE;
    const int osxsave = c >> 27 & 1, avx = c >> 28 & 1, fma = c >> 12 & 1, f16c = c >> 29 & 1;
    if (!(osxsave && avx && fma && f16c))
        return BNBW_BODY_PORTABLE;
    const unsigned long long xcr0 = bnbw__xcr0();
    if ((xcr0 & 0x6) != 0x6)       /* SSE and AVX state */
        return BNBW_BODY_PORTABLE;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b >> 5 & 1))   /* AVX2 */
        return BNBW_BODY_PORTABLE;
    const int avx512 = (b >> 16 & 1) && (b >> 17 & 1) && (b >> 30 & 1) && (b >> 31 & 1)
                       && (b >> 8 & 1);                 /* F, DQ, BW, VL; BMI2 */
    if (avx512 && (xcr0 & 0xe0) == 0xe0)                /* opmask, upper ZMM, ZMM16-31 state */
        return bnbw_kernels_avx512 != NULL ? BNBW_BODY_AVX512 : BNBW_BODY_AVX2;
    return bnbw_kernels_avx2 != NULL ? BNBW_BODY_AVX2 : BNBW_BODY_PORTABLE;
}
#elif defined(__aarch64__)
#if defined(__linux__)
#include <sys/auxv.h>
#endif

/* AdvSIMD is part of every AArch64 Linux system; the auxiliary vector says so where it can. */
static int bnbw__detect(void)
{
    if (bnbw_kernels_neon == NULL)
        return BNBW_BODY_PORTABLE;
#if defined(__linux__) && defined(AT_HWCAP) && defined(HWCAP_ASIMD)
    if (!(getauxval(AT_HWCAP) & HWCAP_ASIMD))
        return BNBW_BODY_PORTABLE;
#endif
    return BNBW_BODY_NEON;
}
#else
static int bnbw__detect(void) { return BNBW_BODY_PORTABLE; }
#endif

/* Relaxed atomics keep the lazy detection race-free when OpenMP threads ask first. */
static int bnbw__cpu_body = -1;
static int bnbw__cap = BNBW_N_BODIES - 1;

int bnbw_cpu_body(void)
{
    int body = __atomic_load_n(&bnbw__cpu_body, __ATOMIC_RELAXED);
    if (body < 0) {
        body = bnbw__detect();
        __atomic_store_n(&bnbw__cpu_body, body, __ATOMIC_RELAXED);
    }
    return body;
}

int bnbw_body(void)
{
    int cap = __atomic_load_n(&bnbw__cap, __ATOMIC_RELAXED), body = bnbw_cpu_body();
    return body < cap ? body : cap;
}

void bnbw_set_body_cap(int cap)
{
    cap = cap < 0 ? 0 : cap >= BNBW_N_BODIES ? BNBW_N_BODIES - 1 : cap;
    __atomic_store_n(&bnbw__cap, cap, __ATOMIC_RELAXED);
}

const char *bnbw_body_name(int body)
{
    if (body == BNBW_BODY_PORTABLE)
        return "portable";
#if defined(__aarch64__)
    return "NEON";                 /* the only vector level here */
#else
    return body == BNBW_BODY_AVX512 ? "AVX-512" : "AVX2";
#endif
}

/* At most one table per level is not NULL in a build: the other architecture's are. */
const bnbw_kernel_table *bnbw_kernels_of(int body)
{
    if (body >= BNBW_BODY_AVX512 && bnbw_kernels_avx512 != NULL)
        return bnbw_kernels_avx512;
    if (body >= BNBW_BODY_AVX2 && bnbw_kernels_avx2 != NULL)
        return bnbw_kernels_avx2;
    if (body >= BNBW_BODY_NEON && bnbw_kernels_neon != NULL)
        return bnbw_kernels_neon;
    return &bnbw_kernels_portable;
}

const bnbw_kernel_table *bnbw_kernels(void) { return bnbw_kernels_of(bnbw_body()); }
