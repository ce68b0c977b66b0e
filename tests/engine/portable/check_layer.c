/*
 * check_layer.c - the portable vector layer (src/bnbw_simd_portable.h) against the scalar
 * definitions it implements:
 *
 *   vf_fma          fmaf (libm), on special values, constructed near-midpoint sums, cancellations
 *                   and random operands; and v__fmaf_exact, the scalar emulation, alike
 *   v_load          bnbw_f16_to_f32 / bnbw_bf16_to_f32 on all 65,536 patterns, every lane order,
 *                   contiguous, strided and partial
 *   v_store         bnbw_f32_to_f16 / bnbw_f32_to_bf16 on f32 patterns around every half's
 *                   rounding points and random ones (all 2^32 with --exhaustive)
 *   v_active, v_copy_active, vm_finite2, vd_fold, vd_select   their scalar meaning
 *
 * tests/engine/test_portable_layer.py builds it twice - with the layer's GNU C vectors and with its
 * plain C (-DBNBW_PORTABLE_SCALAR) - with the package's flags, and runs it; it can also be
 * cross-built and run under qemu.  Inputs come from a fixed integer generator, so every run
 * checks the same cases.
 *
 *   check_layer [--exhaustive] [--scale N]
 *
 * prints one line per check, and exits 1 after printing the first differences it met.
 */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bnbw_simd_portable.h"

static long failures;

static uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint64_t bits_of_double(double d) { uint64_t u; memcpy(&u, &d, 8); return u; }

static void fail(const char *check, const char *fmt, ...)
{
    if (++failures <= 20) {
        va_list ap;
        va_start(ap, fmt);
        printf("FAIL %s: ", check);
        vprintf(fmt, ap);
        printf("\n");
        va_end(ap);
    }
}

/* splitmix64: a fixed sequence on every platform */
static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint64_t next64(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static uint32_t next32(void) { return (uint32_t)(next64() >> 32); }
/* a float in [2^exponent, 2^(exponent + 1)) (the exponent clamped to [-149, 127]: subnormal
 * binades too), a random significand and sign */
static float random_float(int exponent)
{
    uint32_t m = next32() & 0x7fffff, s = next32() & 0x80000000u;
    int e = exponent + 127;
    if (e <= 0) {                  /* a subnormal: the leading bit 1 - e places down */
        int shift = 1 - e > 23 ? 23 : 1 - e;
        return float_of(s | (0x800000u | m) >> shift);
    }
    if (e >= 255)
        e = 254;
    return float_of(s | (uint32_t)e << 23 | m);
}

/* ---- fma --------------------------------------------------------------------------------- */

static long fma_cases;

/* up to 16 triples through vf_fma and v__fmaf_exact, each compared with fmaf: the same bits,
 * or both NaN (which NaN an operation returns is unspecified) */
static void check_fma16(const float *a, const float *b, const float *c, int n)
{
    float pa[16] = {0}, pb[16] = {0}, pc[16] = {0}, got[16];
    memcpy(pa, a, (size_t)n * 4);
    memcpy(pb, b, (size_t)n * 4);
    memcpy(pc, c, (size_t)n * 4);
    vf_storeu(got, vf_fma(vf_loadu(pa), vf_loadu(pb), vf_loadu(pc)));
    for (int l = 0; l < n; ++l) {
        float want = fmaf(a[l], b[l], c[l]), scalar = v__fmaf_exact(a[l], b[l], c[l]);
        int want_nan = want != want;
        if (want_nan ? got[l] == got[l] : bits_of(got[l]) != bits_of(want))
            fail("vf_fma", "fmaf(%a, %a, %a) = %a, vf_fma lane %d gives %a", a[l], b[l], c[l],
                 want, l, got[l]);
        if (want_nan ? scalar == scalar : bits_of(scalar) != bits_of(want))
            fail("v__fmaf_exact", "fmaf(%a, %a, %a) = %a, v__fmaf_exact gives %a", a[l], b[l],
                 c[l], want, scalar);
    }
    fma_cases += n;
}

/* Triples one at a time, batched 16 to a vector (each lane a different case). */
static float batch_a[16], batch_b[16], batch_c[16];
static int batch_n;
static void fma_case(float a, float b, float c)
{
    batch_a[batch_n] = a, batch_b[batch_n] = b, batch_c[batch_n] = c;
    if (++batch_n == 16) {
        check_fma16(batch_a, batch_b, batch_c, 16);
        batch_n = 0;
    }
}
static void fma_flush(void)
{
    if (batch_n)
        check_fma16(batch_a, batch_b, batch_c, batch_n);
    batch_n = 0;
}

static const float specials[] = {
    0.0f, -0.0f, 0x1p-149f, -0x1p-149f, 0x1.fffffcp-127f, 0x1p-126f, -0x1p-126f, 0x1p-75f,
    1.0f, -1.0f, 1.5f, 0x1.000002p0f, 0x1.fffffep-1f, 3.0f, -7.0f, 0x1p64f, 0x1p100f,
    FLT_MAX, -FLT_MAX, INFINITY, -INFINITY, NAN, -NAN,
};
#define N_SPECIALS ((int)(sizeof specials / sizeof specials[0]))

/* p + c lands within a hair of the midpoint between c and its neighbour: a and b are
 * 2^ka (1 + sa 2^-m) and 2^kb (1 + sb 2^-m), whose product 2^(ka+kb) (1 + (sa+sb) 2^-m
 * + sa sb 2^-2m) is half of c's unit, off by +-2^-2m of it or by nothing (m = 0: exact
 * halves, a tie for the f32 rounding).  Rounding such sums to f64 first lands on the midpoint
 * exactly: the case that double rounding gets wrong. */
static void fma_near_midpoints(long count)
{
    for (long i = 0; i < count; ++i) {
        int e = (int)(next32() % 280) - 150;          /* subnormal to overflowing c */
        float c = random_float(e);
        if (!isfinite(c))
            continue;
        int ulp_exp = (fabsf(c) < 0x1p-126f ? -149 : ilogbf(c) - 23) - 1;   /* half a unit */
        if (next32() & 1)                           /* half a unit of the binade below */
            ulp_exp -= 1;
        int m = (int)(next32() % 24);
        int ka = ulp_exp / 2, kb = ulp_exp - ka;
        if (ka < -149 || kb < -149 || ka > 127 || kb > 127)
            continue;
        float sa = (next32() & 1) ? 1.0f : -1.0f, sb = (next32() & 1) ? 1.0f : -1.0f;
        float a = ldexpf(m ? 1.0f + sa * ldexpf(1.0f, -m) : 1.0f, ka);
        float b = ldexpf(m ? 1.0f + sb * ldexpf(1.0f, -m) : 1.0f, kb);
        if (m == 0 && (next32() & 1))
            b = -b;
        if (next32() & 1)
            a = -a, b = -b;                         /* the same product, other operands */
        fma_case(a, b, c);
        fma_case(a, -b, c);                         /* towards the neighbour on the other side */
        fma_case(-a, b, -c);
    }
}

static void fma_checks(long scale)
{
    for (int i = 0; i < N_SPECIALS; ++i)
        for (int j = 0; j < N_SPECIALS; ++j)
            for (int k = 0; k < N_SPECIALS; ++k)
                fma_case(specials[i], specials[j], specials[k]);
    fma_near_midpoints(200000 * scale);
    for (long i = 0; i < 200000 * scale; ++i) {
        /* cancellation: c is minus the product rounded (and a unit either side), so the
           result is the product's rounding error, tiny and exact */
        float a = random_float((int)(next32() % 200) - 100);
        float b = random_float((int)(next32() % 200) - 100);
        float p = a * b;
        if (!isfinite(p))
            continue;
        fma_case(a, b, -p);
        fma_case(a, b, -nextafterf(p, INFINITY));
        fma_case(a, b, -nextafterf(p, -INFINITY));
    }
    for (long i = 0; i < 400000 * scale; ++i) {
        /* operands of nearby magnitudes, c near the product: long carries and borrows */
        int ea = (int)(next32() % 60) - 30, eb = (int)(next32() % 60) - 30;
        fma_case(random_float(ea), random_float(eb), random_float(ea + eb + (int)(next32() % 61) - 30));
        /* anywhere, subnormals, overflow, infinities and NaNs included */
        fma_case(float_of(next32()), float_of(next32()), float_of(next32()));
        /* results around the subnormal range */
        int et = (int)(next32() % 40) - 150;
        fma_case(random_float(et / 2), random_float(et - et / 2), random_float(et + (int)(next32() % 5)));
    }
    fma_flush();
    printf("vf_fma and v__fmaf_exact against fmaf: %ld cases\n", fma_cases);
}

/* ---- halves ------------------------------------------------------------------------------ */

static float half_to_float(uint16_t h, int dt)
{
    return dt == BNBW_F16 ? bnbw_f16_to_f32((bnbw_f16){h}) : bnbw_bf16_to_f32((bnbw_bf16){h});
}
static uint16_t float_to_half(float f, int dt)
{
    return dt == BNBW_F16 ? bnbw_f32_to_f16(f).bits : bnbw_f32_to_bf16(f).bits;
}
static const char *dt_name(int dt)
{
    return dt == BNBW_F16 ? "f16" : dt == BNBW_BF16 ? "bf16" : dt == BNBW_BOOL ? "bool" : "f32";
}

/* Element e of a vector loaded in lane order eo sits in lane ... */
static int lane_of(int e, int eo) { return eo ? (e % 2 ? 8 + e / 2 : e / 2) : e; }

/* All 65,536 patterns loaded: contiguous in both lane orders, every 3rd element, and partial
 * loads of every length; the f32 bits exactly (NaN payloads are kept). */
static void check_half_loads(int dt)
{
    static uint16_t row[65536], strided[3 * 65536];
    long cases = 0;
    for (uint32_t i = 0; i < 65536; ++i) {
        row[i] = (uint16_t)i;
        strided[3 * i] = (uint16_t)i;
    }
    for (uint32_t i = 0; i < 65536; i += 16) {
        for (int eo = 0; eo < 2; ++eo) {
            float got[16];
            vf_storeu(got, v_load(row, i, 1, dt, eo));
            for (int e = 0; e < 16; ++e, ++cases)
                if (bits_of(got[lane_of(e, eo)]) != bits_of(half_to_float((uint16_t)(i + e), dt)))
                    fail("v_load", "%s %#x (eo %d) gives %#x", dt_name(dt), i + e, eo,
                         bits_of(got[lane_of(e, eo)]));
        }
        float got[16];
        vf_storeu(got, v_load(strided, i, 3, dt, 0));
        for (int e = 0; e < 16; ++e, ++cases)
            if (bits_of(got[e]) != bits_of(half_to_float((uint16_t)(i + e), dt)))
                fail("v_load", "%s %#x (step 3) gives %#x", dt_name(dt), i + e, bits_of(got[e]));
        int t = (int)(i / 16 % 16);
        vf_storeu(got, v_load_part(row, i, t, 1, dt));
        for (int e = 0; e < 16; ++e, ++cases) {
            uint32_t want = e < t ? bits_of(half_to_float((uint16_t)(i + e), dt)) : 0;
            if (bits_of(got[e]) != want)
                fail("v_load_part", "%s %#x (t %d, lane %d) gives %#x", dt_name(dt), i + e, t, e,
                     bits_of(got[e]));
        }
    }
    printf("v_load %s: %ld cases\n", dt_name(dt), cases);
}

/* 16 f32 patterns stored as dt: contiguous, every 2nd element (the elements between must keep
 * their bits) and partial stores of length t; each half as the scalar function gives it. */
static long store_cases;
static void check_store16(const uint32_t *x, int dt, int t)
{
    float in[16];
    uint16_t row[16], strided[33], part[17];
    for (int l = 0; l < 16; ++l)
        in[l] = float_of(x[l]);
    memset(strided, 0xa5, sizeof strided);
    memset(part, 0xa5, sizeof part);
    v_store(row, 0, 1, vf_loadu(in), dt, 0);
    v_store(strided, 0, 2, vf_loadu(in), dt, 0);
    v_store_part(part, 0, t, 1, vf_loadu(in), dt);
    for (int l = 0; l < 16; ++l, ++store_cases) {
        uint16_t want = float_to_half(in[l], dt);
        if (row[l] != want || strided[2 * l] != want || strided[2 * l + 1] != 0xa5a5)
            fail("v_store", "%s of %#x: %#x (step 2: %#x), scalar %#x", dt_name(dt), x[l], row[l],
                 strided[2 * l], want);
        if (part[l] != (l < t ? want : 0xa5a5))
            fail("v_store_part", "%s of %#x (t %d, lane %d): %#x", dt_name(dt), x[l], t, l, part[l]);
    }
    if (part[16] != 0xa5a5)
        fail("v_store_part", "%s wrote past its 16 elements", dt_name(dt));
}

static void check_half_stores(int dt, int exhaustive, long scale)
{
    /* the low 16 bits around every rounding point of a half (f16: 13 bits cut, more for its
       subnormals, whose points then lie in the high 16 bits, which run through all values) */
    static const uint32_t lows[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x2000,
                                    0x2001, 0x2fff, 0x3000, 0x3001, 0x4000, 0x7fff, 0x8000,
                                    0x8001, 0xbfff, 0xc000, 0xefff, 0xf000, 0xf001, 0xffff};
    const int nlows = (int)(sizeof lows / sizeof lows[0]);
    uint32_t x[16];
    int n = 0;
    store_cases = 0;
    if (exhaustive) {
        for (uint64_t v = 0; v < (1ull << 32); v += 16) {
            for (int l = 0; l < 16; ++l)
                x[l] = (uint32_t)(v + (uint64_t)l);
            check_store16(x, dt, (int)(v >> 4 & 15));
        }
    } else {
        for (uint32_t hi = 0; hi < 65536; ++hi)
            for (int k = 0; k < nlows; ++k) {
                x[n++] = hi << 16 | lows[k];
                if (n == 16) {
                    check_store16(x, dt, (int)(hi & 15));
                    n = 0;
                }
            }
        for (long i = 0; i < 100000 * scale; ++i) {
            for (int l = 0; l < 16; ++l)
                x[l] = next32();
            check_store16(x, dt, (int)(i & 15));
        }
    }
    printf("v_store %s: %ld cases%s\n", dt_name(dt), store_cases, exhaustive ? " (all f32)" : "");
}

/* ---- masks, folds ------------------------------------------------------------------------ */

static int scalar_active(const void *mask, int64_t e, int mdt)
{
    if (mdt == BNBW_BOOL)
        return ((const unsigned char *)mask)[e] != 0;
    if (mdt == BNBW_F32) {
        float f;
        memcpy(&f, (const char *)mask + 4 * e, 4);
        return f > 0.0f;
    }
    uint16_t h;
    memcpy(&h, (const char *)mask + 2 * e, 2);
    return half_to_float(h, mdt) > 0.0f;
}

/* 1.0f where lane l of m is true, 0 elsewhere (through the layer itself) */
static void lanes_of(vm m, float out[16]) { vf_storeu(out, vf_keep(vf_set1(1.0f), m)); }

static void check_masks(void)
{
    static uint16_t halves[65536 + 16];
    static unsigned char bools[4096];
    static uint32_t f32s[4096];
    long cases = 0;
    for (uint32_t i = 0; i < 65536; ++i)
        halves[i] = (uint16_t)i;
    for (int i = 0; i < 4096; ++i) {
        bools[i] = (unsigned char)(i % 7 == 0 ? 0 : next32() % 3 == 0 ? 0 : next32());
        f32s[i] = next32();
    }
    f32s[0] = 0x80000000u, f32s[1] = 0x7fc00000u, f32s[2] = 0x00000001u, f32s[3] = 0x7f800000u;
    const int mdts[] = {BNBW_BOOL, BNBW_F32, BNBW_F16, BNBW_BF16};
    for (int k = 0; k < 4; ++k) {
        const int mdt = mdts[k];
        const void *mask = mdt == BNBW_BOOL ? (const void *)bools
                           : mdt == BNBW_F32 ? (const void *)f32s : (const void *)halves;
        const int64_t total = mdt == BNBW_F16 || mdt == BNBW_BF16 ? 65536 : 4096;
        for (int64_t i = 0; i + 16 <= total; i += 16) {
            float on[16];
            for (int eo = 0; eo < 2; ++eo) {
                lanes_of(v_active(mask, i, 1, mdt, eo), on);
                for (int e = 0; e < 16; ++e, ++cases)
                    if ((on[lane_of(e, eo)] != 0) != scalar_active(mask, i + e, mdt))
                        fail("v_active", "%s element %ld (eo %d)", dt_name(mdt), (long)(i + e), eo);
            }
            if (3 * (i + 16) <= total) {
                lanes_of(v_active(mask, i, 3, mdt, 0), on);
                for (int e = 0; e < 16; ++e, ++cases)
                    if ((on[e] != 0) != scalar_active(mask, 3 * (i + e), mdt))
                        fail("v_active", "%s element %ld (step 3)", dt_name(mdt), (long)(3 * (i + e)));
            }
            int t = (int)(i / 16 % 16);
            lanes_of(v_active_part(mask, i, t, 1, mdt), on);
            for (int e = 0; e < 16; ++e, ++cases)
                if ((on[e] != 0) != (e < t && scalar_active(mask, i + e, mdt)))
                    fail("v_active_part", "%s element %ld (t %d)", dt_name(mdt), (long)(i + e), t);
        }
        /* v_copy_active: the source's bits where active, +0 elsewhere, nothing else written */
        const int msz = mdt == BNBW_BOOL ? 1 : mdt == BNBW_F32 ? 4 : 2;
        for (int dt = BNBW_F32; dt <= BNBW_BF16; ++dt) {
            if (mdt != BNBW_BOOL && mdt != dt)
                continue;
            const int isz = dt == BNBW_F32 ? 4 : 2;
            for (int64_t base = 0; base + 48 <= total; base += 16)
                for (int variant = 0; variant < 3; ++variant) {
                    const int t = variant == 0 ? 16 : (int)(base / 16 % 17);
                    const int64_t step = variant == 2 ? 2 : 1, i = variant;   /* i = 0, 1, 2 */
                    const void *m = (const char *)mask + base * msz;
                    unsigned char src[48 * 4], dst[48 * 4];
                    for (int k = 0; k < 48 * 4; ++k)
                        src[k] = (unsigned char)next32();
                    memset(dst, 0xa5, sizeof dst);
                    v_copy_active(dst, step, src, step, m, step, i, t, dt, mdt);
                    for (int64_t e = 0; e < 48; ++e, ++cases) {
                        const int64_t l = e / step - i;     /* element e is lane l of the call */
                        unsigned char want[4];
                        memset(want, 0xa5, sizeof want);
                        if (e % step == 0 && l >= 0 && l < t) {
                            if (scalar_active(m, e, mdt))
                                memcpy(want, src + e * isz, (size_t)isz);
                            else
                                memset(want, 0, (size_t)isz);
                        }
                        if (memcmp(dst + e * isz, want, (size_t)isz))
                            fail("v_copy_active", "%s with %s mask: element %ld (t %d, step %ld)",
                                 dt_name(dt), dt_name(mdt), (long)e, t,
                                 (long)step);
                    }
                }
        }
    }
    printf("v_active, v_active_part, v_copy_active: %ld cases\n", cases);
}

static void check_folds(void)
{
    long cases = 0;
    for (long it = 0; it < 20000; ++it) {
        double v[16];
        for (int l = 0; l < 16; ++l) {
            /* magnitudes far apart, so the order of the additions shows in the result */
            v[l] = ldexp((double)(int32_t)next32(), (int)(next32() % 120) - 60);
        }
        double want[16];
        memcpy(want, v, sizeof v);
        for (int w = 8; w > 0; w /= 2)
            for (int l = 0; l < w; ++l)
                want[l] += want[l + w];
        double got = vd_fold(vd_loadu(v));
        if (bits_of_double(got) != bits_of_double(want[0]))
            fail("vd_fold", "%a instead of %a", got, want[0]);
        /* vd_select and vm_finite2 lane by lane */
        float a[16], b[16];
        double o[16];
        for (int l = 0; l < 16; ++l) {
            uint32_t r = next32();
            a[l] = r % 5 == 0 ? INFINITY : r % 7 == 0 ? NAN : (float)v[l];
            b[l] = r % 11 == 0 ? -INFINITY : 1.0f;
            o[l] = -(double)l;
        }
        vm ok = vm_finite2(vf_loadu(a), vf_loadu(b));
        double sel[16];
        vd_storeu(sel, vd_select(ok, vd_loadu(v), vd_loadu(o)));
        int all = 1;
        for (int l = 0; l < 16; ++l, ++cases) {
            int fin = isfinite(a[l]) && isfinite(b[l]);
            all &= fin;
            if (bits_of_double(sel[l]) != bits_of_double(fin ? v[l] : o[l]))
                fail("vm_finite2/vd_select", "lane %d", l);
        }
        if (vm_all(ok) != all)
            fail("vm_all", "%d instead of %d", vm_all(ok), all);
    }
    printf("vd_fold, vd_select, vm_finite2, vm_all: %ld cases\n", cases);
}

int main(int argc, char **argv)
{
    int exhaustive = 0;
    long scale = 1;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--exhaustive"))
            exhaustive = 1;
        else if (!strcmp(argv[i], "--scale") && i + 1 < argc)
            scale = atol(argv[++i]);
    }
    printf("layer: %s, fma: %s, %s-endian\n", BNBW__GNU_VECTORS ? "GNU C vectors" : "plain C",
           BNBW__FMA_INSTRUCTION ? "instruction" : "emulated",
           __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ ? "little" : "big");
    fma_checks(scale);
    check_half_loads(BNBW_F16);
    check_half_loads(BNBW_BF16);
    check_half_stores(BNBW_F16, exhaustive, scale);
    check_half_stores(BNBW_BF16, exhaustive, scale);
    check_masks();
    check_folds();
    printf("%s\n", failures ? "FAILED" : "all equal");
    return failures ? 1 : 0;
}
