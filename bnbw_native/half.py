"""float16 / bfloat16 <-> float32 conversions, bit-exact with NumPy and ml_dtypes.

Why it is shaped this way:

* Every check happens before anything is written, so a refused call leaves ``out`` untouched;
  the native module only converts.  Wrong kind of object or dtype raises TypeError, a right
  type with a wrong value (shape, read-only, overlap) raises ValueError, each naming ``a`` or
  ``out``.
* The source type is never guessed: ``float32_to_float16`` refuses float64 input with a
  TypeError instead of casting, because float64 -> float32 -> float16 rounds twice and can
  differ from NumPy's single-rounded float64 -> float16.
* A 1-d input of any stride goes to the native row converters as it is; other non-contiguous
  inputs are copied to C order first.  ``out`` is never copied: if its layout cannot be
  written directly the result goes through a temporary and ``np.copyto``.
* ml_dtypes is optional: without it bfloat16 data travels as uint16 bit patterns.
"""
import numpy as np

from . import _half, _rules
from ._dlpack import TooLarge, as_array

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - exercised by monkeypatching in the tests
    ml_dtypes = None

__all__ = ["float32_to_float16", "float16_to_float32", "float32_to_bfloat16", "bfloat16_to_float32"]

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
_U16 = np.dtype(np.uint16)
_F32_ONLY = (" (the source type must be float32; wider floats are refused rather than cast, "
             "since rounding them through float32 can differ from rounding them once)")


def _bf16_dtypes():
    """Accepted bfloat16 dtypes, the preferred one (used for new outputs) first."""
    if ml_dtypes is None:
        return (_U16,)
    return (np.dtype(ml_dtypes.bfloat16), _U16)


def _names(dtypes):
    return " or ".join(str(d) for d in dtypes)


def _source(func, a, dtypes, hint=""):
    """`a` as an ndarray holding one of `dtypes` (in either byte order), without copying; a
    DLPack producer (a torch tensor, bfloat16 too) through the engine's calls' door."""
    try:
        arr = (as_array(a, f"{func}(): argument 'a'")
               if hasattr(a, "__dlpack__") and not isinstance(a, np.ndarray) else np.asarray(a))
    except TooLarge:
        raise
    except Exception as exc:
        raise TypeError(f"{func}(): argument 'a' must be an array-like of {_names(dtypes)}, "
                        f"got {type(a).__name__} that NumPy cannot convert ({exc})") from exc
    if arr.dtype.newbyteorder("=") not in dtypes:
        raise TypeError(f"{func}(): argument 'a' must hold {_names(dtypes)} values, "
                        f"got dtype {arr.dtype}{hint if arr.dtype.kind == 'f' else ''}")
    return arr


def _native(arr):
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def _check_out(func, out, dtypes, arr):
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{func}(): argument 'out' must be None or a numpy.ndarray of "
                        f"{_names(dtypes)}, got {type(out).__name__}")
    if out.dtype not in dtypes or not out.dtype.isnative:
        raise TypeError(f"{func}(): argument 'out' must have dtype {_names(dtypes)} "
                        f"(native byte order), got {out.dtype}")
    if out.shape != arr.shape:
        raise ValueError(f"{func}(): argument 'out' must have the shape of a, {arr.shape}, "
                         f"got {out.shape}")
    if not out.flags.writeable:
        raise ValueError(f"{func}(): argument 'out' must be writable, got a read-only array")
    if np.may_share_memory(arr, out):
        try:
            overlap = np.shares_memory(arr, out, max_work=1 << 16)
        except np.exceptions.TooHardError:
            overlap = True
        if overlap:
            raise ValueError(f"{func}(): argument 'out' must not overlap a in memory")


def _flat(arr):
    """A 1-d view of a C-contiguous (or at most 1-d) array."""
    return arr.reshape(-1)


def _threads(num_threads):
    return _rules.requested_threads(num_threads)


def _narrow(func, kind, a, out, num_threads, out_dtypes):
    """float32 -> 16-bit: the float side must be contiguous and aligned, the 16-bit side may stride."""
    arr = _source(func, a, (_F32,), _F32_ONLY)
    if out is not None:
        _check_out(func, out, out_dtypes, arr)
    src = _flat(np.require(_native(arr), requirements=["C", "A"]))
    threads = _threads(num_threads)
    if out is None:
        result = np.empty(arr.shape, out_dtypes[0])
        _half.store(kind, src, _flat(result), num_threads=threads)
        return result
    target = out.view(np.ndarray)
    # (an out whose elements share memory - a 0 stride - is written in order, as NumPy writes
    # it: threads writing one element at once would leave any of their values)
    if target.flags.c_contiguous or (target.ndim == 1
                                     and abs(target.strides[0]) >= target.itemsize):
        _half.store(kind, src, _flat(target), num_threads=threads)
    else:
        tmp = np.empty(arr.shape, out.dtype)
        _half.store(kind, src, _flat(tmp), num_threads=threads)
        np.copyto(target, tmp)
    return out


def _widen(func, kind, a, out, num_threads, src_dtypes):
    """16-bit -> float32: the 16-bit side may stride, the float side must be contiguous and aligned."""
    arr = _source(func, a, src_dtypes)
    if out is not None:
        _check_out(func, out, (_F32,), arr)
    arr = _native(arr)
    src = _flat(arr if arr.ndim <= 1 else np.ascontiguousarray(arr))
    threads = _threads(num_threads)
    if out is None:
        result = np.empty(arr.shape, _F32)
        _half.load(kind, src, _flat(result), num_threads=threads)
        return result
    target = out.view(np.ndarray)
    if target.flags.c_contiguous and target.flags.aligned:
        _half.load(kind, src, _flat(target), num_threads=threads)
    else:
        tmp = np.empty(arr.shape, _F32)
        _half.load(kind, src, _flat(tmp), num_threads=threads)
        np.copyto(target, tmp)
    return out


def float32_to_float16(a, out=None, *, num_threads=None):
    """Round float32 `a` to float16 exactly as ``a.astype(np.float16)``.

    Returns a new C-contiguous float16 array of a's shape, or `out` (float16, same shape,
    writable, not overlapping `a`) filled in.  Float64 input is refused with TypeError: the
    source type must be float32.  `num_threads` defaults to bnbw_native.get_num_threads().
    """
    return _narrow("float32_to_float16", "f16", a, out, num_threads, (_F16,))


def float16_to_float32(a, out=None, *, num_threads=None):
    """Widen float16 `a` to float32 exactly as ``a.astype(np.float32)``; NaN payloads are kept.

    Returns a new C-contiguous float32 array of a's shape, or `out` (float32, same shape,
    writable, not overlapping `a`) filled in.
    """
    return _widen("float16_to_float32", "f16", a, out, num_threads, (_F16,))


def float32_to_bfloat16(a, out=None, *, num_threads=None):
    """Round float32 `a` to bfloat16 exactly as ``a.astype(ml_dtypes.bfloat16)``.

    Every NaN becomes the quiet NaN 0x7fc0 with its sign, as in ml_dtypes.  Returns a new
    C-contiguous ml_dtypes.bfloat16 array (uint16 bit patterns when ml_dtypes is absent), or
    `out` (bfloat16 or uint16, same shape, writable, not overlapping `a`) filled in.
    """
    return _narrow("float32_to_bfloat16", "bf16", a, out, num_threads, _bf16_dtypes())


def bfloat16_to_float32(a, out=None, *, num_threads=None):
    """Widen bfloat16 `a` (ml_dtypes.bfloat16 values or uint16 bit patterns) to float32.

    Returns a new C-contiguous float32 array of a's shape, or `out` (float32, same shape,
    writable, not overlapping `a`) filled in.
    """
    return _widen("bfloat16_to_float32", "bf16", a, out, num_threads, _bf16_dtypes())
