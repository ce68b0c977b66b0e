# cython: language_level=3
"""The C API: the function table include/bnbw_native.h declares, exported in a capsule.

Each entry is a thin shell over the DirectML operator functions of bnbw_native._directml (which
bnbw_native.dml uses too), reporting through a per-thread message buffer that error_message()
reads back.  Nothing here needs the GIL or touches a Python object.
"""
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.string cimport strncpy
from cpython.pycapsule cimport PyCapsule_New

from bnbw_native._vocabulary cimport N_SLOTS, OP_FORWARD
from bnbw_native._headers cimport (
    bnbw_data_type, bnbw_operator_type, bnbw_batch_normalization_grad_desc,
    bnbw_batch_normalization_training_desc, bnbw_bindings, bnbw_training_bindings, bnbw_status,
    BNBW_OK, BNBW_ERROR_NULL_POINTER, BNBW_ERROR_OPERATOR_TYPE, bnbw_operator, bnbw_api_table,
    BNBW_API_VERSION, BNBW_CAPSULE_NAME)
from bnbw_native._rules cimport Epsilon, Momentum, real_of_float
from bnbw_native._directml cimport (Tensor, OperatorImpl, layout_check, default_total,
                                    op_create, op_create_training, op_bind, op_execute,
                                    op_destroy)

cdef extern from *:
    """
    #if defined(_MSC_VER)
    #define BNBW_TLS __declspec(thread)
    #else
    #define BNBW_TLS __thread
    #endif
    #define BNBW_MESSAGE_CAP 512
    static BNBW_TLS char bnbw_tls_message[BNBW_MESSAGE_CAP];
    static char *bnbw_thread_message(void) { return bnbw_tls_message; }
    static char bnbw_version_text[32];
    """
    enum: BNBW_MESSAGE_CAP
    char *bnbw_thread_message() nogil
    char bnbw_version_text[32]


cdef const char *c_library_version() noexcept nogil:
    return bnbw_version_text


cdef bnbw_status c_calc_buffer_tensor_size(bnbw_data_type data_type, uint32_t dimension_count,
                                           const int64_t *sizes, const int64_t *strides,
                                           uint64_t *minimum_size,
                                           uint64_t *total_size) noexcept nogil:
    cdef Tensor t
    cdef bnbw_status rc = layout_check(<int> data_type, dimension_count, sizes, strides, "",
                                       &t, bnbw_thread_message(), BNBW_MESSAGE_CAP)
    if rc != BNBW_OK:
        return rc
    if minimum_size != NULL:
        minimum_size[0] = <uint64_t> t.minimum
    if total_size != NULL:
        total_size[0] = default_total(t.minimum)
    return BNBW_OK


cdef bnbw_status c_create_operator(bnbw_operator_type type,
                                   const bnbw_batch_normalization_grad_desc *desc,
                                   bnbw_operator **op) noexcept nogil:
    cdef Epsilon eps
    real_of_float(desc.epsilon if desc != NULL else 0, &eps)
    return op_create(<int> type, desc, &eps, <OperatorImpl **> op, bnbw_thread_message(),
                     BNBW_MESSAGE_CAP)


cdef bnbw_status _execute(const bnbw_operator *op, bint training, const void *bindings,
                          int num_threads) noexcept nogil:
    """Run `op` on its family's bindings struct, after checking that it is of the kind this
    execute runs (a NULL op is op_execute's to refuse)."""
    cdef const OperatorImpl *impl = <const OperatorImpl *> op
    cdef const void *ptr[N_SLOTS]
    if bindings == NULL:
        snprintf(bnbw_thread_message(), BNBW_MESSAGE_CAP, "bindings: the pointer is NULL")
        return BNBW_ERROR_NULL_POINTER
    if impl != NULL and (impl.op & OP_FORWARD != 0) != training:
        snprintf(bnbw_thread_message(), BNBW_MESSAGE_CAP, "op: a %s operator; run it with %s",
                 "gradient" if training else "training-forward",
                 "execute" if training else "execute_training")
        return BNBW_ERROR_OPERATOR_TYPE
    op_bind(impl, bindings, ptr)
    return op_execute(impl, ptr, num_threads, bnbw_thread_message(), BNBW_MESSAGE_CAP)


cdef bnbw_status c_execute(const bnbw_operator *op, const bnbw_bindings *b,
                           int num_threads) noexcept nogil:
    return _execute(op, False, b, num_threads)


cdef bnbw_status c_create_training_operator(const bnbw_batch_normalization_training_desc *desc,
                                            bnbw_operator **op) noexcept nogil:
    cdef Epsilon eps
    cdef Momentum momentum
    real_of_float(desc.epsilon if desc != NULL else 0, &eps)
    real_of_float(desc.momentum if desc != NULL else 0, &momentum)
    return op_create_training(desc, &eps, &momentum, <OperatorImpl **> op,
                              bnbw_thread_message(), BNBW_MESSAGE_CAP)


cdef bnbw_status c_execute_training(const bnbw_operator *op, const bnbw_training_bindings *b,
                                    int num_threads) noexcept nogil:
    return _execute(op, True, b, num_threads)


cdef void c_destroy_operator(bnbw_operator *op) noexcept nogil:
    op_destroy(<OperatorImpl *> op)


cdef const char *c_error_message() noexcept nogil:
    return bnbw_thread_message()


# The statuses' names without the prefix, by value (include/bnbw_native.h numbers them from 0).
cdef enum:
    N_STATUSES = 14
cdef const char *STATUS_NAMES[N_STATUSES]
STATUS_NAMES[:] = [b"OK", b"ERROR_NULL_POINTER", b"ERROR_DATA_TYPE", b"ERROR_DIMENSION_COUNT",
                   b"ERROR_SIZES", b"ERROR_STRIDES", b"ERROR_TOTAL_SIZE", b"ERROR_OVERLAP",
                   b"ERROR_EPSILON", b"ERROR_NUM_THREADS", b"ERROR_ALIGNMENT",
                   b"ERROR_OPERATOR_TYPE", b"ERROR_OUT_OF_MEMORY", b"ERROR_ADDRESS"]


cdef const char *c_status_name(bnbw_status status) noexcept nogil:
    if <unsigned int> status < N_STATUSES:
        return STATUS_NAMES[<int> status]
    return "UNKNOWN_STATUS"


cdef bnbw_api_table TABLE = bnbw_api_table(
    version=BNBW_API_VERSION, size=sizeof(bnbw_api_table), library_version=c_library_version,
    calc_buffer_tensor_size=c_calc_buffer_tensor_size, create_operator=c_create_operator,
    execute=c_execute, destroy_operator=c_destroy_operator, error_message=c_error_message,
    status_name=c_status_name, create_training_operator=c_create_training_operator,
    execute_training=c_execute_training)

from bnbw_native._config import __version__ as _version
strncpy(bnbw_version_text, _version.encode()[:31], 31)

STATUS = {c_status_name(<bnbw_status> code).decode(): code for code in range(N_STATUSES)}

_C_API = PyCapsule_New(<void *> &TABLE, BNBW_CAPSULE_NAME, NULL)
