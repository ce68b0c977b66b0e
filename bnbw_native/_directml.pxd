from libc.stdint cimport int64_t, uint32_t, uint64_t

from bnbw_native._vocabulary cimport MAX_DIMS, N_SLOTS, Plan
from bnbw_native._headers cimport (
    bnbw_status, bnbw_batch_normalization_grad_desc, bnbw_batch_normalization_training_desc)
from bnbw_native._rules cimport Epsilon, Momentum, Rules

ctypedef struct Tensor:
    int dtype                    # bnbw_data_type
    int ndim
    int64_t itemsize
    int64_t sizes[MAX_DIMS]
    int64_t strides[MAX_DIMS]    # elements, packed ones filled in
    int64_t minimum              # bytes
    uint64_t total

ctypedef struct Member:
    # One row of an operator family's member table, as the nogil code reads it.
    int slot                     # the engine's slot
    bint output                  # the operator writes it
    bint optional                # may be absent: a NULL descriptor, then a NULL buffer

ctypedef struct OperatorImpl:
    int op                       # DO_FROZEN, DO_TRAINING or DO_FORWARD (with OP_RELU)
    const Rules *rules           # its convention: the members' names
    const Member *members        # its family's table, in descriptor order
    int n_members
    Epsilon eps
    Momentum momentum             # the forward's
    Tensor t[N_SLOTS]            # by slot: the members' descriptors (ndim 0: absent)
    Plan plan

cdef bnbw_status layout_check(int dtype, uint32_t ndim, const int64_t *sizes,
                              const int64_t *strides, const char *m, Tensor *t, char *msg,
                              size_t cap) noexcept nogil
cdef uint64_t default_total(int64_t minimum) noexcept nogil
cdef bnbw_status op_create(int type, const bnbw_batch_normalization_grad_desc *desc,
                           const Epsilon *eps, OperatorImpl **out, char *msg,
                           size_t cap) noexcept nogil
cdef bnbw_status op_create_training(const bnbw_batch_normalization_training_desc *desc,
                                    const Epsilon *eps, const Momentum *momentum,
                                    OperatorImpl **out, char *msg, size_t cap) noexcept nogil
cdef void op_bind(const OperatorImpl *op, const void *bindings, const void **ptr) noexcept nogil
cdef bnbw_status op_execute(const OperatorImpl *op, const void **ptr, int num_threads,
                            char *msg, size_t cap) noexcept nogil
cdef void op_destroy(OperatorImpl *op) noexcept nogil
