/* The kernels for AArch64 Advanced SIMD (NEON; see bnbw_kernels.h), base ARMv8.0 only, which
 * every AArch64 compiler targets without flags; NULL on other architectures. */
#include "bnbw_kernels.h"

#if defined(__aarch64__) && defined(__ARM_NEON) && (defined(__GNUC__) || defined(__clang__))
#include "bnbw_simd_neon.h"

#define K__NAME(name) bnbw_neon_##name
#include "bnbw_kernels_impl.h"

static const bnbw_kernel_table table = K__TABLE_ENTRIES;
const bnbw_kernel_table *const bnbw_kernels_neon = &table;
#else
const bnbw_kernel_table *const bnbw_kernels_neon = 0;
#endif
