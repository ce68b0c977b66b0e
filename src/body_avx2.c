/* The kernels for x86 AVX2 + FMA + F16C (see bnbw_kernels.h); NULL where the compiler cannot
 * target them. */
#include "bnbw_kernels.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif
#include "bnbw_simd_avx2.h"

#define K__NAME(name) bnbw_avx2_##name
#include "bnbw_kernels_impl.h"

static const bnbw_kernel_table table = K__TABLE_ENTRIES;
const bnbw_kernel_table *const bnbw_kernels_avx2 = &table;
#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
const bnbw_kernel_table *const bnbw_kernels_avx2 = 0;
#endif
