"""Every check on array arguments, with the messages of SPEC 6, in one place.

Front-ends pass their own argument names, so a message always names the argument as the
caller wrote it.  Nothing here writes to any array: a refused call leaves outputs untouched.
"""
import math
import numbers
import struct

import numpy as np

from ._core import distinct_elements, memory_bounds

FLOAT_TYPES = ("float32", "float16", "bfloat16")
_TYPE_LIST = "float32, float16 or bfloat16 (ml_dtypes)"


def as_array(obj, name):
    """An ndarray viewing `obj` (ndarray, DLPack producer, buffer or array interface), no copy."""
    if isinstance(obj, np.ndarray):
        return obj
    if obj is None or isinstance(obj, (str, bytes, numbers.Number)):
        raise TypeError(f"{name} must be an array, got {type(obj).__name__}")
    try:
        if hasattr(obj, "__dlpack__"):
            return np.from_dlpack(obj)
        arr = np.asarray(obj)
    except Exception as exc:  # any failure to view the object is a wrong kind of object
        raise TypeError(f"{name} must be an array (NumPy, buffer or DLPack), "
                        f"got {type(obj).__name__} ({exc})") from exc
    if arr.dtype == object:
        raise TypeError(f"{name} must be an array of numbers, got {type(obj).__name__}")
    return arr


_DTYPE_NAMES = {}      # dtype -> name; dtype.name is slow enough to matter on tiny calls


def dtype_name(arr):
    """The dtype's name in native byte order ("float32", "bfloat16", ...)."""
    dtype = arr.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = dtype.name if dtype.isnative else dtype.newbyteorder("=").name
        _DTYPE_NAMES[dtype] = name
    return name


def float_input(obj, name, allowed=FLOAT_TYPES):
    """A readable input array of one of the `allowed` dtypes, ready for the engine."""
    arr = as_array(obj, name)
    kind = dtype_name(arr)
    if kind not in allowed:
        hint = ""
        if kind == "uint16":
            hint = ("; bfloat16 bit patterns in uint16 arrays go through bnbw_native.dml "
                    "descriptors or bnbw_native.half")
        raise TypeError(f"{name} must be a {_allowed_text(allowed)} array, got {kind}{hint}")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if not arr.flags.aligned:
        arr = arr.copy()       # the kernels read f32 rows in place: they need aligned data
    return arr


def _allowed_text(allowed):
    if tuple(allowed) == FLOAT_TYPES:
        return _TYPE_LIST
    return " or ".join(allowed)


def check_rank(arr, name, low, high):
    if not low <= arr.ndim <= high:
        raise ValueError(f"{name} must have {low} to {high} dimensions, got {arr.ndim}")


def check_same_shape(arr, name, shape, other):
    if arr.shape != shape:
        raise ValueError(f"{name} must have the shape of {other} {shape}, got {arr.shape}")


def check_vector(arr, name, length):
    if arr.ndim != 1 or arr.shape[0] != length:
        raise ValueError(f"{name} must be 1-D of length C = {length} (the channel count), "
                         f"got shape {arr.shape}")


_F32 = struct.Struct("f")     # packing a float rounds it to f32 (nearest-even), as the ops do


def check_epsilon(value, name="epsilon"):
    """The f32 epsilon as a Python float: a real number, finite and > 0 once in f32."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        as_f32 = _F32.unpack(_F32.pack(float(value)))[0]
    except (OverflowError, ValueError):    # beyond the f32 range
        as_f32 = math.inf
    if not (math.isfinite(as_f32) and as_f32 > 0):
        raise ValueError(f"{name} must be finite and > 0 after conversion to float32, "
                         f"got {value!r}")
    return as_f32


def check_choice(value, name, choices):
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, one of {', '.join(choices)}; "
                        f"got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def check_int_choice(value, name, choices):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, one of {choices}, got {type(value).__name__}")
    if int(value) not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value}")
    return int(value)


# ---- outputs -----------------------------------------------------------------------------

def same_view(a, b):
    """The very same memory, dtype, shape and strides (the one overlap SPEC 3.1 allows)."""
    return (memory_bounds(a) == memory_bounds(b) and a.dtype == b.dtype
            and a.shape == b.shape and a.strides == b.strides)


def overlaps(a, b):
    """True when a and b share a byte of memory (or it cannot be ruled out cheaply)."""
    a_lo, a_hi = memory_bounds(a)
    b_lo, b_hi = memory_bounds(b)
    if a_lo == a_hi or b_lo == b_hi or a_hi <= b_lo or b_hi <= a_lo:
        return False
    try:
        return bool(np.shares_memory(a, b, max_work=100_000))
    except np.exceptions.TooHardError:
        return True            # cannot prove them apart: refuse rather than risk it


def check_out(out, specs):
    """Validate a caller's `out` against specs = [(label, shape, dtype), ...].

    Returns the arrays, or None when out is None.  label is what the message calls the entry
    (e.g. "out[0] (diff_src)")."""
    if out is None:
        return None
    if not isinstance(out, (tuple, list)):
        raise TypeError(f"out must be a tuple of {len(specs)} arrays, got {type(out).__name__}")
    if len(out) != len(specs):
        raise ValueError(f"out must hold {len(specs)} arrays (one per output), got {len(out)}")
    arrays = []
    for entry, (label, shape, dtype) in zip(out, specs):
        if not isinstance(entry, np.ndarray):
            if not hasattr(entry, "__dlpack__"):
                raise TypeError(f"{label} must be a NumPy array, got {type(entry).__name__}")
            try:
                entry = np.from_dlpack(entry)
            except Exception as exc:  # requires grad, a read-only legacy capsule, bf16, GPU
                if "readonly" in str(exc).replace("-", "").replace(" ", "").lower():
                    raise ValueError(f"{label} is read-only; outputs must be writable") from exc
                raise TypeError(f"{label} must be a writable CPU array; its DLPack export "
                                f"failed: {exc}") from exc
        if entry.dtype != dtype:
            raise TypeError(f"{label} must have dtype {np.dtype(dtype).name}, "
                            f"got {entry.dtype.name}")
        if entry.shape != tuple(shape):
            raise ValueError(f"{label} must have shape {tuple(shape)}, got {entry.shape}")
        if not entry.flags.writeable:
            raise ValueError(f"{label} is read-only; outputs must be writable")
        if not entry.flags.aligned:
            raise ValueError(f"{label} must be aligned to its item size")
        if self_overlapping(entry):
            raise ValueError(f"{label} has elements that share memory (zero or overlapping "
                             f"strides {entry.strides}); an output must not overlap itself")
        arrays.append(entry)
    return arrays


def self_overlapping(a):
    """True unless the elements of `a` provably occupy distinct bytes."""
    return not distinct_elements(a)


def check_no_overlap(outputs, inputs, in_place=None):
    """outputs, inputs: [(label, array)].  in_place: (output label, input label) that may be
    the very same view."""
    for i, (label, arr) in enumerate(outputs):
        for other_label, other in outputs[i + 1:]:
            if overlaps(arr, other):
                raise ValueError(f"{label} overlaps {other_label}; outputs must not overlap")
        for in_label, inp in inputs:
            if inp is None:
                continue
            if in_place == (label, in_label) and same_view(arr, inp):
                continue
            if overlaps(arr, inp):
                allowed = ""
                if in_place and in_place[0] == label:
                    allowed = f" (only the very same array as {in_place[1]} is allowed)"
                raise ValueError(f"{label} overlaps the input {in_label}{allowed}")
