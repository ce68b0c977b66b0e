/* The kernels for x86 AVX-512 (F, BW, VL, DQ) with FMA, F16C and BMI2 (see bnbw_kernels.h);
 * NULL where the compiler cannot target them. */
#include "bnbw_kernels.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
#endif
#include "bnbw_simd_avx512.h"

#define K__NAME(name) bnbw_avx512_##name
#include "bnbw_kernels_impl.h"

static const bnbw_kernel_table table = K__TABLE_ENTRIES;
const bnbw_kernel_table *const bnbw_kernels_avx512 = &table;
#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
const bnbw_kernel_table *const bnbw_kernels_avx512 = 0;
#endif
