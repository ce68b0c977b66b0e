# What the C headers declare, as the native modules see them: the half conversions
# (src/bnbw_half.h), the transposed tiles (src/bnbw_relayout.h), the kernels and their table (src/bnbw_kernels.h), the public C API's
# types and statuses (include/bnbw_native.h) and OpenMP's few queries.
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t


cdef extern from "bnbw_half.h" nogil:
    ctypedef struct bnbw_f16:
        uint16_t bits
    ctypedef struct bnbw_bf16:
        uint16_t bits
    float bnbw_f16_to_f32(bnbw_f16 h)
    float bnbw_bf16_to_f32(bnbw_bf16 h)
    bnbw_f16 bnbw_f64_to_f16(double d)
    bnbw_bf16 bnbw_f64_to_bf16(double d)
    # row converters: simd nonzero when the kernel body in use is a vector one (AVX2 or better, NEON)
    void bnbw_load_f32(const char *src, int64_t stride, int64_t n, float *dst)
    void bnbw_store_f32(const float *src, int64_t n, char *dst, int64_t stride)
    void bnbw_load_f16(const char *src, int64_t stride, int64_t n, float *dst, int simd)
    void bnbw_store_f16(const float *src, int64_t n, char *dst, int64_t stride, int simd)
    void bnbw_load_bf16(const char *src, int64_t stride, int64_t n, float *dst, int simd)
    void bnbw_store_bf16(const float *src, int64_t n, char *dst, int64_t stride, int simd)
    const char *bnbw_half_simd_path(int simd)


cdef extern from "bnbw_relayout.h" nogil:
    # one tile of a (rows, cols) matrix into its transpose: elements (i0.., j0..), one line a
    # side, of size-byte elements (2 or 4)
    void bnbw_tile(const void *src, void *dst, int64_t rows, int64_t cols, int64_t i0,
                   int64_t j0, int size)

# The kernels (linked into bnbw_native._engine only, which owns the choice of body and
# hands its table to the schedules).
cdef extern from "bnbw_kernels.h" nogil:
    enum:
        BNBW_F32
        BNBW_F16
        BNBW_BF16
        BNBW_BOOL
        BNBW_NO_MASK
        BNBW_RELU
        BNBW_ADD_RELU
        BNBW_EXACT_SUMS
        BNBW_BLOCKS
        BNBW_BLOCKS_EVEN_ODD
        BNBW_BLOCK_ROWS
        BNBW_BODY_PORTABLE
        BNBW_BODY_AVX2
        BNBW_BODY_AVX512
    int64_t BNBW_ITEMSIZE(int dt)        # bytes per element of f32, f16, bf16
    ctypedef struct bnbw_io:
        const void *x
        const void *dy
        const void *mask
        void *dx
        void *dres
        int64_t x_step, dy_step, mask_step, dx_step, dres_step
        int dt
        int mask_dt
        int stream_dx
        int from_line
    ctypedef struct bnbw_run:
        int64_t count
        int64_t x, dy, mask, dx, dres
    ctypedef struct bnbw_kernel_table:
        void (*reduce_row)(const bnbw_io *io, int64_t n, float mean, double *out,
                           int sums) noexcept nogil
        void (*apply_row)(const bnbw_io *io, int64_t n, float mean, float k1, float k2,
                          float k3) noexcept nogil
        void (*scale_row)(const bnbw_io *io, int64_t n, float k1) noexcept nogil
        void (*reduce_rows)(const bnbw_io *io, int64_t rows, int64_t n, const float *mean,
                            double *sum_g, double *sum_xg, int streaming,
                            int sums) noexcept nogil
        void (*apply_rows)(const bnbw_io *io, int64_t rows, int64_t n, const float *mean,
                           const float *k1, const float *k2, const float *k3) noexcept nogil
        void (*scale_rows)(const bnbw_io *io, int64_t rows, int64_t n,
                           const float *k1) noexcept nogil
        void (*reduce_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n,
                               const float *mean, double *sums, int64_t sums_step,
                               int sum_mode) noexcept nogil
        void (*apply_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n,
                              const float *mean, const float *k1, const float *k2,
                              const float *k3) noexcept nogil
        void (*scale_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n,
                              const float *k1) noexcept nogil
        void (*stats_row)(const bnbw_io *io, int64_t n, float shift, double *out) noexcept nogil
        void (*normalize_row)(const bnbw_io *io, int64_t n, float mean, float k, float b,
                              int relu) noexcept nogil
        void (*stats_rows)(const bnbw_io *io, int64_t rows, int64_t n, const float *shift,
                           double *sum, double *sum_sq, int streaming) noexcept nogil
        void (*normalize_rows)(const bnbw_io *io, int64_t rows, int64_t n, const float *mean,
                               const float *k, const float *b, int relu) noexcept nogil
        void (*stats_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n,
                              const float *shift, double *sums,
                              int64_t sums_step) noexcept nogil
        void (*normalize_row_run)(const bnbw_io *io, const bnbw_run *run, int64_t n,
                                  const float *mean, const float *k, const float *b,
                                  int relu) noexcept nogil
    int bnbw_cpu_body()
    int bnbw_body()
    void bnbw_set_body_cap(int cap)
    const char *bnbw_body_name(int body)
    const bnbw_kernel_table *bnbw_kernels()

cdef extern from *:
    """
    #define BNBW_NATIVE_NO_IMPORT 1
    """

cdef extern from "bnbw_native.h" nogil:
    ctypedef enum bnbw_data_type:
        BNBW_DATA_TYPE_UNKNOWN
        BNBW_DATA_TYPE_FLOAT32
        BNBW_DATA_TYPE_FLOAT16
        BNBW_DATA_TYPE_BFLOAT16
    ctypedef struct bnbw_tensor_desc:
        bnbw_data_type data_type
        uint32_t dimension_count
        const int64_t *sizes
        const int64_t *strides
        uint64_t total_tensor_size_in_bytes
    ctypedef enum bnbw_operator_type:
        BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD
        BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD
    ctypedef struct bnbw_batch_normalization_grad_desc:
        const bnbw_tensor_desc *input
        const bnbw_tensor_desc *input_gradient
        const bnbw_tensor_desc *mean
        const bnbw_tensor_desc *variance
        const bnbw_tensor_desc *scale
        const bnbw_tensor_desc *output_gradient
        const bnbw_tensor_desc *output_scale_gradient
        const bnbw_tensor_desc *output_bias_gradient
        float epsilon
    ctypedef struct bnbw_batch_normalization_training_desc:
        const bnbw_tensor_desc *input
        const bnbw_tensor_desc *mean
        const bnbw_tensor_desc *variance
        const bnbw_tensor_desc *scale
        const bnbw_tensor_desc *bias
        const bnbw_tensor_desc *output
        const bnbw_tensor_desc *output_running_mean
        const bnbw_tensor_desc *output_running_variance
        const bnbw_tensor_desc *output_batch_mean
        const bnbw_tensor_desc *output_batch_variance
        float epsilon
        float momentum
        int fuse_relu
    ctypedef struct bnbw_training_bindings:
        const void *input
        const void *mean
        const void *variance
        const void *scale
        const void *bias
        void *output
        void *output_running_mean
        void *output_running_variance
        void *output_batch_mean
        void *output_batch_variance
    ctypedef struct bnbw_bindings:
        const void *input
        const void *input_gradient
        const void *mean
        const void *variance
        const void *scale
        void *output_gradient
        void *output_scale_gradient
        void *output_bias_gradient
    # Every refusal of the validation layer is one of these (the C API returns them; Python
    # raises TypeError for BNBW_ERROR_DATA_TYPE, MemoryError for out of memory, else ValueError)
    ctypedef enum bnbw_status:
        BNBW_OK
        BNBW_ERROR_NULL_POINTER
        BNBW_ERROR_DATA_TYPE
        BNBW_ERROR_DIMENSION_COUNT
        BNBW_ERROR_SIZES
        BNBW_ERROR_STRIDES
        BNBW_ERROR_TOTAL_SIZE
        BNBW_ERROR_OVERLAP
        BNBW_ERROR_EPSILON
        BNBW_ERROR_NUM_THREADS
        BNBW_ERROR_ALIGNMENT
        BNBW_ERROR_OPERATOR_TYPE
        BNBW_ERROR_OUT_OF_MEMORY
        BNBW_ERROR_ADDRESS
    ctypedef struct bnbw_operator:
        pass
    ctypedef struct bnbw_api_table:
        uint32_t version
        uint32_t size
        const char *(*library_version)() noexcept nogil
        bnbw_status (*calc_buffer_tensor_size)(bnbw_data_type, uint32_t, const int64_t *,
                                               const int64_t *, uint64_t *,
                                               uint64_t *) noexcept nogil
        bnbw_status (*create_operator)(bnbw_operator_type,
                                       const bnbw_batch_normalization_grad_desc *,
                                       bnbw_operator **) noexcept nogil
        bnbw_status (*execute)(const bnbw_operator *, const bnbw_bindings *,
                               int) noexcept nogil
        void (*destroy_operator)(bnbw_operator *) noexcept nogil
        const char *(*error_message)() noexcept nogil
        const char *(*status_name)(bnbw_status) noexcept nogil
        bnbw_status (*create_training_operator)(
            const bnbw_batch_normalization_training_desc *, bnbw_operator **) noexcept nogil
        bnbw_status (*execute_training)(const bnbw_operator *, const bnbw_training_bindings *,
                                        int) noexcept nogil
    enum: BNBW_API_VERSION
    const char *BNBW_CAPSULE_NAME

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    static int bnbw_omp_max_threads(void) { return omp_get_max_threads(); }
    static int bnbw_omp_num_procs(void) { return omp_get_num_procs(); }
    static int bnbw_openmp_version(void) { return _OPENMP; }
    #else
    static int bnbw_omp_max_threads(void) { return 1; }
    static int bnbw_omp_num_procs(void) { return 1; }
    static int bnbw_openmp_version(void) { return 0; }
    #endif
    """
    int bnbw_omp_max_threads() nogil
    int bnbw_omp_num_procs() nogil       # the CPUs this process may run on (its affinity)
    int bnbw_openmp_version() nogil
