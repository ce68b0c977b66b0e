/* TEMPORARY portable stand-in; the real header (F16C fast paths) replaces this file. */
#ifndef BNBW_HALF_H
#define BNBW_HALF_H
#include <stdint.h>
#include <string.h>
#include <math.h>
typedef struct { uint16_t bits; } bnbw_f16;
typedef struct { uint16_t bits; } bnbw_bf16;
static inline float bnbw_f16_to_f32(bnbw_f16 h) {
    uint32_t s = (uint32_t)(h.bits & 0x8000) << 16, e = (h.bits >> 10) & 0x1f, m = h.bits & 0x3ff, u;
    if (e == 0x1f) u = s | 0x7f800000 | (m << 13);
    else if (e) u = s | ((e + 112) << 23) | (m << 13);
    else { float f = (float)m * 5.9604644775390625e-08f; memcpy(&u, &f, 4); u |= s; }
    float f; memcpy(&f, &u, 4); return f;
}
static inline bnbw_f16 bnbw_f64_to_f16(double d) {
    bnbw_f16 r; uint16_t s = signbit(d) ? 0x8000 : 0; double a = fabs(d);
    if (isnan(d)) { r.bits = s | 0x7e00; return r; }
    if (a >= 65520.0) { r.bits = s | 0x7c00; return r; }
    int e; frexp(a, &e);            /* a = f * 2^e, f in [0.5,1) */
    if (a < 6.103515625e-05) e = -13; /* subnormal: fixed quantum 2^-24 */
    double q = ldexp(1.0, e - 11), k = nearbyint(a / q);
    double v = k * q; uint32_t u; float fv = (float)v; memcpy(&u, &fv, 4);
    if (v == 0) { r.bits = s; return r; }
    if (v < 6.103515625e-05) { r.bits = s | (uint16_t)(v / 5.9604644775390625e-08); return r; }
    uint32_t ee = ((u >> 23) & 0xff) - 112, mm = (u >> 13) & 0x3ff;
    r.bits = s | (uint16_t)((ee << 10) | mm); return r;
}
static inline bnbw_f16 bnbw_f32_to_f16(float f) { return bnbw_f64_to_f16((double)f); }
static inline float bnbw_bf16_to_f32(bnbw_bf16 h) { uint32_t u = (uint32_t)h.bits << 16; float f; memcpy(&f, &u, 4); return f; }
static inline bnbw_bf16 bnbw_f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4); bnbw_bf16 r;
    if (isnan(f)) { r.bits = (uint16_t)((u >> 16) | 0x40); return r; }
    u += 0x7fff + ((u >> 16) & 1); r.bits = (uint16_t)(u >> 16); return r;
}
static inline bnbw_bf16 bnbw_f64_to_bf16(double d) { return bnbw_f32_to_bf16((float)d); }
static void bnbw_load_f32(const char *s, int64_t st, int64_t n, float *d) { for (int64_t i = 0; i < n; ++i) memcpy(d + i, s + i * st, 4); }
static void bnbw_store_f32(const float *s, int64_t n, char *d, int64_t st) { for (int64_t i = 0; i < n; ++i) memcpy(d + i * st, s + i, 4); }
static void bnbw_load_f16(const char *s, int64_t st, int64_t n, float *d) { for (int64_t i = 0; i < n; ++i) { bnbw_f16 h; memcpy(&h, s + i * st, 2); d[i] = bnbw_f16_to_f32(h); } }
static void bnbw_store_f16(const float *s, int64_t n, char *d, int64_t st) { for (int64_t i = 0; i < n; ++i) { bnbw_f16 h = bnbw_f32_to_f16(s[i]); memcpy(d + i * st, &h, 2); } }
static void bnbw_load_bf16(const char *s, int64_t st, int64_t n, float *d) { for (int64_t i = 0; i < n; ++i) { bnbw_bf16 h; memcpy(&h, s + i * st, 2); d[i] = bnbw_bf16_to_f32(h); } }
static void bnbw_store_bf16(const float *s, int64_t n, char *d, int64_t st) { for (int64_t i = 0; i < n; ++i) { bnbw_bf16 h = bnbw_f32_to_bf16(s[i]); memcpy(d + i * st, &h, 2); } }
static const char *bnbw_half_simd_path(void) { return "portable"; }
#endif
