from libc.stdint cimport int64_t, uint32_t, uint64_t

from bnbw_native._vocabulary cimport (MAX_DIMS, N_SLOTS, Plan, bnbw_status,
                                      bnbw_batch_normalization_grad_desc)
from bnbw_native._rules cimport Epsilon

ctypedef struct Tensor:
    int dtype                    # bnbw_data_type
    int ndim
    int64_t itemsize
    int64_t sizes[MAX_DIMS]
    int64_t strides[MAX_DIMS]    # elements, packed ones filled in
    int64_t minimum              # bytes
    uint64_t total

ctypedef struct OperatorImpl:
    int op                       # DO_FROZEN or DO_TRAINING
    Epsilon eps
    bint in_place_ok             # output_gradient may be bound over input_gradient
    Tensor t[N_SLOTS]            # by slot: the members' descriptors
    Plan plan

cdef bnbw_status layout_check(int dtype, uint32_t ndim, const int64_t *sizes,
                              const int64_t *strides, const char *m, Tensor *t, char *msg,
                              size_t cap) noexcept nogil
cdef uint64_t default_total(int64_t minimum) noexcept nogil
cdef bnbw_status op_create(int type, const bnbw_batch_normalization_grad_desc *desc,
                           const Epsilon *eps, OperatorImpl **out, char *msg,
                           size_t cap) noexcept nogil
cdef bnbw_status op_execute(const OperatorImpl *op, const void **ptr, int num_threads,
                            char *msg, size_t cap) noexcept nogil
cdef void op_destroy(OperatorImpl *op) noexcept nogil
