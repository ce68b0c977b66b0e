# cython: language_level=3
"""Foreign array objects as NumPy arrays: DLPack producers, buffers, array interfaces.

The array calls (bnbw_native._arrays) read NumPy arrays directly; anything else comes through
here once, an input as `as_array`, a DLPack producer given as an output as `output_array`.
NumPy's own `np.from_dlpack` does most of it; two kinds of object need more:

* A torch tensor with the negative bit (`is_neg()`, e.g. the `.imag` of a conjugated complex
  tensor) or the conjugate bit is a lazy view: its memory holds -x (or conj(x)) and DLPack
  exports that memory as it is.  As an input it is resolved first (`resolve_conj()`,
  `resolve_neg()`: a copy); as an output it is refused (outputs are written in place, and
  writing the raw memory would store the negated result).  Recognised by duck typing (the
  object has `is_neg` and `is_conj`), so torch is never imported here.
* NumPy has no bfloat16 for DLPack's kDLBfloat.  When `np.from_dlpack` refuses a producer, the
  producer's capsule is read here: a 16-bit kDLBfloat tensor (any producer: torch, JAX, ...) is
  relabelled kDLUInt 16 in its own capsule, viewed by NumPy as uint16 - the same memory,
  writable when the producer allows - and that view is viewed as ml_dtypes.bfloat16.  Without
  ml_dtypes such a tensor is refused with a TypeError that says to install it.
"""
import numbers

import numpy as np

from cpython.pycapsule cimport PyCapsule_IsValid, PyCapsule_GetPointer
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t


# ---- the capsule's own structs (dlpack.h, ABI 0.x and 1.x), to read its dtype ----

ctypedef struct DLDevice:
    int32_t device_type
    int32_t device_id

ctypedef struct DLDataType:
    uint8_t code
    uint8_t bits
    uint16_t lanes

ctypedef struct DLTensor:
    void *data
    DLDevice device
    int32_t ndim
    DLDataType dtype
    int64_t *shape
    int64_t *strides
    uint64_t byte_offset

ctypedef struct DLManagedTensor:                 # capsule "dltensor" (0.x)
    DLTensor dl_tensor
    void *manager_ctx
    void *deleter

ctypedef struct DLPackVersion:
    uint32_t major
    uint32_t minor

ctypedef struct DLManagedTensorVersioned:        # capsule "dltensor_versioned" (1.x)
    DLPackVersion version
    void *manager_ctx
    void *deleter
    uint64_t flags
    DLTensor dl_tensor

cdef enum:
    DL_CPU = 1          # DLDeviceType kDLCPU
    DL_UINT = 1         # DLDataTypeCode kDLUInt
    DL_BFLOAT = 4       # DLDataTypeCode kDLBfloat


class _NeedsMlDtypes(TypeError):
    """A bfloat16 tensor met without ml_dtypes: the message says to install it."""


class _Relabelled:
    """A DLPack producer handing NumPy one capsule that was already exported (and relabelled)."""

    def __init__(self, capsule, device):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


cdef DLTensor *_capsule_tensor(capsule):
    """The DLTensor of an unconsumed DLPack capsule, or NULL."""
    if PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        return &(<DLManagedTensorVersioned *> PyCapsule_GetPointer(
            capsule, b"dltensor_versioned")).dl_tensor
    if PyCapsule_IsValid(capsule, b"dltensor"):
        return &(<DLManagedTensor *> PyCapsule_GetPointer(capsule, b"dltensor")).dl_tensor
    return NULL


def _bfloat16_from_dlpack(obj, name):
    """obj's memory as an ml_dtypes.bfloat16 array when obj exports a 16-bit kDLBfloat tensor
    (the same memory: NumPy reads it as uint16), else None."""
    cdef DLTensor *t
    try:
        try:
            capsule = obj.__dlpack__(max_version=(1, 0))
        except TypeError:                       # a producer from before DLPack 1.0
            capsule = obj.__dlpack__()
        device = obj.__dlpack_device__()
    except Exception:  # the export itself fails: the caller reports NumPy's own refusal
        return None
    t = _capsule_tensor(capsule)
    if t == NULL or t.device.device_type != DL_CPU or t.dtype.code != DL_BFLOAT \
            or t.dtype.bits != 16 or t.dtype.lanes != 1:
        return None
    try:
        import ml_dtypes
    except ImportError:
        raise _NeedsMlDtypes(f"{name} is a bfloat16 tensor; reading bfloat16 needs "
                             "ml_dtypes: install it (pip install ml_dtypes, or "
                             "bnbw_native[bf16])") from None
    t.dtype.code = DL_UINT                      # same bits, a type NumPy knows
    return np.from_dlpack(_Relabelled(capsule, device)).view(ml_dtypes.bfloat16)


def _from_dlpack(obj, name):
    """np.from_dlpack(obj), bfloat16 producers included (through ml_dtypes)."""
    try:
        return np.from_dlpack(obj)
    except Exception:
        arr = _bfloat16_from_dlpack(obj, name)
        if arr is None:
            raise
        return arr


cdef str _lazy_bit(obj):
    """Which bit makes a torch tensor's memory differ from its values: "negative" (is_neg())
    or "conjugate" (is_conj()); None for everything else."""
    is_neg = getattr(obj, "is_neg", None)
    is_conj = getattr(obj, "is_conj", None)
    if is_neg is None or is_conj is None:
        return None
    if is_neg():
        return "negative"
    if is_conj():
        return "conjugate"
    return None


# ---- what the array calls use ----

class TooLarge(ValueError):
    """An array too large for NumPy to view (a torch tensor expanded past the address space):
    the right kind of object with a wrong size."""


def _refuse_too_big(exc, name):
    """... except an array too large for NumPy to view (TooLarge)."""
    if isinstance(exc, ValueError) and "too big" in str(exc):
        raise TooLarge(f"{name} is too large: {exc}") from exc


def resolved_values(tensor, name):
    """A copy of the values of `tensor`, a torch tensor with the negative or conjugate bit
    (its memory holds -x or conj(x)); TooLarge naming `name` when there is no memory for it."""
    try:
        return tensor.detach().resolve_conj().resolve_neg()
    except RuntimeError as exc:   # torch cannot make the copy: no memory for its size
        raise TooLarge(f"{name} is too large to copy (its memory holds -x or conj(x), so "
                       f"its values are read through a copy): {exc}") from exc


def as_array(obj, name):
    """An ndarray viewing `obj` (ndarray, DLPack producer, buffer or array interface), without
    a copy where NumPy can avoid one; TypeError naming `name` for anything that is not an
    array of numbers.  A torch tensor with the negative or conjugate bit is resolved (a copy):
    its memory does not hold its values."""
    if isinstance(obj, np.ndarray):
        return obj
    if obj is None or isinstance(obj, (str, bytes, numbers.Number)):
        raise TypeError(f"{name} must be an array, got {type(obj).__name__}")
    if _lazy_bit(obj) is not None:
        obj = resolved_values(obj, name)
    try:
        if hasattr(obj, "__dlpack__"):
            return _from_dlpack(obj, name)
        arr = np.asarray(obj)
    except _NeedsMlDtypes:
        raise
    except Exception as exc:  # any failure to view the object is a wrong kind of object...
        _refuse_too_big(exc, name)
        raise TypeError(f"{name} must be an array (NumPy, buffer or DLPack), "
                        f"got {type(obj).__name__} ({exc})") from exc
    if arr.dtype == object:
        raise TypeError(f"{name} must be an array of numbers, got {type(obj).__name__}")
    return arr


def output_array(obj, label):
    """An ndarray viewing the memory of `obj`, a DLPack producer given as an output (written in
    place).  A torch tensor with the negative or conjugate bit is refused: its memory holds -x
    (or conj(x)), so results written there would read back wrong."""
    bit = _lazy_bit(obj)
    if bit is not None:
        method = "is_neg" if bit == "negative" else "is_conj"
        raise ValueError(f"{label} is a tensor with the {bit} bit set ({method}() is "
                         "True): its memory does not hold its values, and outputs are "
                         "written in place; pass a tensor without it (e.g. a new "
                         "torch.empty_like) and copy the result over")
    try:
        return _from_dlpack(obj, label)
    except _NeedsMlDtypes:
        raise
    except Exception as exc:  # requires grad, a read-only legacy capsule, GPU
        _refuse_too_big(exc, label)
        if "readonly" in str(exc).replace("-", "").replace(" ", "").lower():
            raise ValueError(f"{label} is read-only; outputs must be writable") from exc
        raise TypeError(f"{label} must be a writable CPU array; its DLPack export "
                        f"failed: {exc}") from exc
