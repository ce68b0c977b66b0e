/*
 * bnbw_native.h - the C API of bnbw_native.
 *
 * The DirectML batch-normalization gradient operators for C callers:
 *
 *   BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD           DML_OPERATOR_BATCH_NORMALIZATION_GRAD
 *       (DML_FEATURE_LEVEL_3_1): frozen statistics, per the DirectML formulas
 *       output_gradient       = input_gradient * scale / sqrt(variance + epsilon)
 *       output_scale_gradient = sum(input_gradient * (input - mean)) / sqrt(variance + epsilon)
 *       output_bias_gradient  = sum(input_gradient)
 *   BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD  DML_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD
 *       (DML_FEATURE_LEVEL_4_1): the full training gradient; with r = 1/sqrt(variance + epsilon),
 *       M elements summed per statistics element, and the two parameter gradients as above,
 *       output_gradient = scale * r * (input_gradient - output_bias_gradient / M
 *                                      - (input - mean) * r * output_scale_gradient / M)
 *
 * and, over the same kind of descriptors, the training forward (oneDNN Graph's
 * BatchNormForwardTraining; create_training_operator, execute_training): with M elements summed
 * per statistics element, m = momentum (the weight of the OLD running statistics),
 *       output_batch_mean       = sum(input) / M
 *       output_batch_variance   = sum((input - batch_mean)^2) / M            (biased)
 *       output                  = scale * (input - batch_mean) / sqrt(batch_variance + epsilon)
 *                                 + bias                      (then max(., 0), NaN kept, if fused)
 *       output_running_mean     = m * mean + (1 - m) * batch_mean
 *       output_running_variance = m * variance + (1 - m) * batch_variance
 *
 * Sums run over the dims where the mean/variance/scale sizes are 1 (any set of dims).
 *
 * The library is the Python extension module bnbw_native._capi; it exports a table of function
 * pointers in a capsule, fetched once with bnbw_import() (as NumPy's import_array() does):
 *
 *     #include <Python.h>
 *     #include "bnbw_native.h"
 *     ...
 *     if (bnbw_import() < 0) return NULL;     // a Python exception is set
 *     bnbw_operator *op;
 *     if (bnbw_api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &desc, &op))
 *         fprintf(stderr, "%s\n", bnbw_api->error_message());
 *
 * bnbw_import() needs the GIL.  Every function of the table runs without the GIL, never
 * touches a Python object and may be called from any thread; one operator may be executed
 * from many threads at once.  Results are bit-identical for every thread count.
 *
 * Define BNBW_NATIVE_NO_IMPORT before including this header to get the types only (no
 * Python.h, no bnbw_import).  `bnbw_api` is static: each translation unit that calls through
 * it calls bnbw_import() once (cheap after the first time), or receives the table pointer.
 */
#ifndef BNBW_NATIVE_H
#define BNBW_NATIVE_H

#ifndef BNBW_NATIVE_NO_IMPORT
#include <Python.h>
#endif
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Version of the table layout.  Fields are only ever appended; bnbw_import() refuses a library
 * whose table is older than the header. */
#define BNBW_API_VERSION 2
#define BNBW_MAX_DIMENSIONS 8
#define BNBW_CAPSULE_NAME "bnbw_native._capi._C_API"

typedef enum bnbw_data_type {
    BNBW_DATA_TYPE_UNKNOWN = 0,
    BNBW_DATA_TYPE_FLOAT32 = 1,
    BNBW_DATA_TYPE_FLOAT16 = 2,   /* IEEE binary16 */
    BNBW_DATA_TYPE_BFLOAT16 = 3   /* bfloat16 (beyond DirectML); uint16_t bit patterns */
} bnbw_data_type;

/* Mirrors DML_BUFFER_TENSOR_DESC.  Sizes and strides are int64_t (DirectML: UINT32) so that a
 * dimension may exceed 2^32; negative values are refused.
 * minimum size = (sum (sizes[i] - 1) * strides[i] + 1) * item size  bytes
 * (packed: product of sizes * item size); see calc_buffer_tensor_size. */
typedef struct bnbw_tensor_desc {
    bnbw_data_type data_type;
    uint32_t dimension_count;            /* 1 to 8 */
    const int64_t *sizes;                /* dimension_count entries, each >= 1 */
    const int64_t *strides;              /* in elements, >= 0 (0 = broadcast); NULL = packed */
    uint64_t total_tensor_size_in_bytes; /* >= the minimum size */
} bnbw_tensor_desc;

typedef enum bnbw_operator_type {
    BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD = 1,          /* frozen statistics */
    BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD = 2  /* training gradient */
} bnbw_operator_type;

/* Mirrors DML_BATCH_NORMALIZATION_GRAD_OPERATOR_DESC (and ..._TRAINING_GRAD_...).  All eight
 * tensors share data_type and dimension_count; input, input_gradient and output_gradient share
 * sizes; mean, variance, scale and both parameter gradients share sizes, each 1 (a summed dim)
 * or the input's.  Output descriptors must not make two elements share memory. */
typedef struct bnbw_batch_normalization_grad_desc {
    const bnbw_tensor_desc *input;
    const bnbw_tensor_desc *input_gradient;
    const bnbw_tensor_desc *mean;
    const bnbw_tensor_desc *variance;
    const bnbw_tensor_desc *scale;
    const bnbw_tensor_desc *output_gradient;
    const bnbw_tensor_desc *output_scale_gradient;
    const bnbw_tensor_desc *output_bias_gradient;
    float epsilon;                       /* finite and > 0 */
} bnbw_batch_normalization_grad_desc;

/* The training forward.  All tensors share data_type and dimension_count; input and output share
 * sizes; mean, variance, scale, bias and the four statistics outputs share sizes, each 1 (a
 * summed dim) or the input's.  scale and bias may be NULL (1 and 0).  Output descriptors must
 * not make two elements share memory. */
typedef struct bnbw_batch_normalization_training_desc {
    const bnbw_tensor_desc *input;
    const bnbw_tensor_desc *mean;                    /* the running mean before this step */
    const bnbw_tensor_desc *variance;                /* the running variance before this step */
    const bnbw_tensor_desc *scale;                   /* NULL: 1 */
    const bnbw_tensor_desc *bias;                    /* NULL: 0 */
    const bnbw_tensor_desc *output;
    const bnbw_tensor_desc *output_running_mean;
    const bnbw_tensor_desc *output_running_variance;
    const bnbw_tensor_desc *output_batch_mean;
    const bnbw_tensor_desc *output_batch_variance;
    float epsilon;                                   /* finite and > 0 */
    float momentum;                                  /* in [0, 1] */
    int fuse_relu;                                   /* nonzero: a ReLU after the output */
} bnbw_batch_normalization_training_desc;

/* The memory of one execution: each pointer is the first byte of its tensor, aligned to the
 * item size, holding at least the descriptor's minimum size.  Output buffers must not overlap
 * each other nor any input buffer, except output_gradient == input_gradient with identical
 * descriptors (in place). */
typedef struct bnbw_bindings {
    const void *input;
    const void *input_gradient;
    const void *mean;
    const void *variance;
    const void *scale;
    void *output_gradient;
    void *output_scale_gradient;
    void *output_bias_gradient;
} bnbw_bindings;

/* ... of the training forward: scale and bias NULL exactly when the operator was made without
 * them.  Outputs may not overlap each other nor any input, except output over input,
 * output_running_mean over mean and output_running_variance over variance, each at the same
 * address with identical descriptors (in place). */
typedef struct bnbw_training_bindings {
    const void *input;
    const void *mean;
    const void *variance;
    const void *scale;
    const void *bias;
    void *output;
    void *output_running_mean;
    void *output_running_variance;
    void *output_batch_mean;
    void *output_batch_variance;
} bnbw_training_bindings;

typedef enum bnbw_status {
    BNBW_OK = 0,
    BNBW_ERROR_NULL_POINTER = 1,      /* a required pointer is NULL */
    BNBW_ERROR_DATA_TYPE = 2,         /* unknown data type, or types differ between tensors */
    BNBW_ERROR_DIMENSION_COUNT = 3,   /* not 1 to 8, or counts differ between tensors */
    BNBW_ERROR_SIZES = 4,             /* a size < 1, sizes that do not match, or too large */
    BNBW_ERROR_STRIDES = 5,           /* a negative stride, or strides too large */
    BNBW_ERROR_TOTAL_SIZE = 6,        /* total_tensor_size_in_bytes below the minimum size */
    BNBW_ERROR_OVERLAP = 7,           /* an output overlapping itself or another buffer */
    BNBW_ERROR_EPSILON = 8,           /* not finite and > 0; a momentum outside [0, 1] */
    BNBW_ERROR_NUM_THREADS = 9,       /* negative */
    BNBW_ERROR_ALIGNMENT = 10,        /* a buffer address not a multiple of the item size */
    BNBW_ERROR_OPERATOR_TYPE = 11,    /* not a bnbw_operator_type, or the other kind's execute */
    BNBW_ERROR_OUT_OF_MEMORY = 12,
    BNBW_ERROR_ADDRESS = 13           /* a buffer's bytes run past the end of the address space */
} bnbw_status;

typedef struct bnbw_operator bnbw_operator;   /* opaque: an operator compiled once */

typedef struct bnbw_api_table {
    uint32_t version;                 /* BNBW_API_VERSION of the library */
    uint32_t size;                    /* sizeof(bnbw_api_table) in the library */
    /* The package version, e.g. "0.1.0". */
    const char *(*library_version)(void);
    /* DMLCalcBufferTensorSize: the minimum size and the default total size (the minimum rounded
     * up to 4 bytes) of a tensor; either output pointer may be NULL.  Validates the arguments. */
    bnbw_status (*calc_buffer_tensor_size)(bnbw_data_type data_type, uint32_t dimension_count,
                                           const int64_t *sizes, const int64_t *strides,
                                           uint64_t *minimum_size, uint64_t *total_size);
    /* Validate `desc` completely and plan the work.  On success *op is a new operator, to be
     * released with destroy_operator; on failure *op is NULL. */
    bnbw_status (*create_operator)(bnbw_operator_type type,
                                   const bnbw_batch_normalization_grad_desc *desc,
                                   bnbw_operator **op);
    /* Run the operator on `bindings`; num_threads 0 = OpenMP's current default.  A refused call
     * writes nothing. */
    bnbw_status (*execute)(const bnbw_operator *op, const bnbw_bindings *bindings,
                           int num_threads);
    /* Release an operator (NULL is a no-op). */
    void (*destroy_operator)(bnbw_operator *op);
    /* What went wrong in the latest failed call on this thread, naming the member, e.g.
     * "mean: sizes[1] must be 1 (a summed dim) or input's 64, got 3". */
    const char *(*error_message)(void);
    /* The enumerator's name without the prefix, e.g. "ERROR_OVERLAP". */
    const char *(*status_name)(bnbw_status status);
    /* Version 2: the training forward.  As create_operator and execute; destroy_operator
     * releases it too. */
    bnbw_status (*create_training_operator)(const bnbw_batch_normalization_training_desc *desc,
                                            bnbw_operator **op);
    bnbw_status (*execute_training)(const bnbw_operator *op,
                                    const bnbw_training_bindings *bindings, int num_threads);
} bnbw_api_table;

#ifndef BNBW_NATIVE_NO_IMPORT
#if defined(__GNUC__) || defined(__clang__)
#define BNBW_MAYBE_UNUSED __attribute__((unused))
#else
#define BNBW_MAYBE_UNUSED
#endif

/* The table, after bnbw_import() succeeded in this translation unit. */
static const bnbw_api_table *bnbw_api BNBW_MAYBE_UNUSED = NULL;

/* Import bnbw_native._capi and fetch its table.  Call with the GIL held.  Returns 0, or -1 with
 * a Python exception set (ImportError when the library is older than this header). */
BNBW_MAYBE_UNUSED static int bnbw_import(void)
{
    const bnbw_api_table *table;
    if (bnbw_api != NULL)
        return 0;
    table = (const bnbw_api_table *)PyCapsule_Import(BNBW_CAPSULE_NAME, 0);
    if (table == NULL)
        return -1;
    if (table->version < BNBW_API_VERSION) {
        PyErr_Format(PyExc_ImportError,
                     "bnbw_native C API version %u is older than this header's %d; "
                     "upgrade bnbw_native", (unsigned)table->version, BNBW_API_VERSION);
        return -1;
    }
    bnbw_api = table;
    return 0;
}
#endif

#ifdef __cplusplus
}
#endif

#endif /* BNBW_NATIVE_H */
