from libc.stdint cimport int64_t

from bnbw_native._vocabulary cimport Layout, N_ROLES
from bnbw_native._headers cimport bnbw_status

cdef enum:
    ARG_DIMS = 64        # an argument's dims as the caller gave them (NumPy's limit)
    NAME_CAP = 48
    MESSAGE_CAP = 512
    NAME_EPSILON = N_ROLES           # names beyond the roles: options messages mention
    NAME_DATA_FORMAT = N_ROLES + 1   # empty when the convention has no data_format
    NAME_MOMENTUM = N_ROLES + 2
    N_NAMES = N_ROLES + 3
    MAX_REQUEST = 32768              # num_threads above this is a mistake (check_threads)

cdef enum Family:
    FAMILY_ARRAYS = 0    # oneDNN Graph, Intel spec, nGraph, two-phase: statistics 1-D of length C
    FAMILY_DIRECTML = 1  # statistics with the input's rank, size 1 on the summed dims

cdef enum DtypeRule:
    RULE_GRAPH = 0       # T1 in {f32, bf16, f16}, T2 in {f32, bf16}, T2 = bf16 only with T1 = bf16
    RULE_SAME = 1        # one element type for every tensor

ctypedef struct Arg:
    # One tensor argument as the layer checks it: what the caller gave, nothing derived.
    char *data               # element 0 (NULL: absent, or a descriptor not yet bound)
    bint present
    int dtype                # DType
    int ndim
    int64_t shape[ARG_DIMS]
    int64_t strides[ARG_DIMS]    # bytes
    bint writable
    bint aligned
    char type_name[40]       # what messages call its dtype

ctypedef struct Rules:
    # A public convention: what it calls each argument and which rules it follows.
    char names[N_NAMES][NAME_CAP]
    char labels[N_ROLES][NAME_CAP + 16]   # how messages name an output ("out[0] (diff_src)")
    int order[N_ROLES]       # the named roles as the convention lists them (DirectML: its
    int n_named              # members in descriptor order, the order its checks go in)
    bint scale_required      # nGraph: gamma must be given (elsewhere None means 1)
    bint beta_required       # nGraph: beta must be given (and is validated only)
    int family
    int dtype_rule
    int min_rank
    int max_rank

ctypedef struct Real:
    # A real argument as the caller gave it: its value, and its text for messages.
    double value
    char text[48]            # the caller's value as Python prints it

ctypedef Real Epsilon        # finite and > 0 once rounded to float32
ctypedef Real Momentum       # the forward's average weight: in [0, 1] once rounded to float32

cdef bnbw_status check_call(const Rules *r, Arg *a, int op, int axis, const Epsilon *eps,
                            const Momentum *momentum, int64_t count, int64_t *channels,
                            char *msg, size_t cap) noexcept nogil
cdef void layout_of(const Rules *r, const Arg *a, int axis, Layout *l) noexcept nogil
cdef void real_of_float(float value, Real *e) noexcept nogil
cdef int parse_real(object value, Real *e, str name) except -1
cdef bnbw_status check_epsilon_value(const Rules *r, const Epsilon *eps, char *msg,
                                     size_t cap) noexcept nogil
cdef const char *type_text(int dtype) noexcept nogil
cdef int in_place_input(int op, int output) noexcept nogil
cdef bnbw_status check_apart_from_caller(const Rules *r, const Arg *a, int op, int role,
                                         const Arg *caller, char *msg, size_t cap) noexcept nogil
cdef bnbw_status check_threads(int64_t n, bint zero_is_default, const char *name,
                               const char *text, char *msg, size_t cap) noexcept nogil
cdef void copy_name(char *dst, str text, size_t cap)
cdef raise_status(bnbw_status rc, const char *msg)

cdef class Convention:
    cdef Rules rules
