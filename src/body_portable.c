/* The kernels in plain C: the body that defines every result (see bnbw_kernels.h). */
#include "bnbw_simd_portable.h"

#define K__NAME(name) bnbw_portable_##name
#include "bnbw_kernels_impl.h"

const bnbw_kernel_table bnbw_kernels_portable = K__TABLE_ENTRIES;
