# cython: language_level=3
"""Native half-precision row conversion for bnbw_native.half.

Why it is shaped this way: half.py does all argument checking and layout decisions in Python,
where good error messages are cheap; this module re-checks only what memory safety needs (rank,
lengths, element sizes, a contiguous aligned writable float side) so that a bad call from
Python can raise but never crash.  Work is split into fixed chunks handed out dynamically, not
per-thread slices: a thread that the OS delays (2 cores, often shared) holds back one chunk, not
half the array, and results never depend on the thread count.
"""
import numpy as np

cimport numpy as cnp
from cython.parallel cimport prange
from libc.stdint cimport int64_t, uint16_t

cnp.import_array()

from bnbw_native._vocabulary cimport SERIAL_BELOW
from bnbw_native._headers cimport (
    bnbw_load_f16, bnbw_store_f16, bnbw_load_bf16, bnbw_store_bf16, bnbw_load_f32, bnbw_store_f32,
    bnbw_half_simd_path, bnbw_f64_to_f16, bnbw_f64_to_bf16)
from bnbw_native._engine cimport resolve_threads, team_started, simd_converters

# simd (last argument): whether the converters may use their AVX2 code (the kernel body in use)
ctypedef void (*load_fn)(const char *, int64_t, int64_t, float *, int) noexcept nogil
ctypedef void (*store_fn)(const float *, int64_t, char *, int64_t, int) noexcept nogil


cdef void _load_f32(const char *src, int64_t stride, int64_t n, float *dst,
                    int simd) noexcept nogil:
    bnbw_load_f32(src, stride, n, dst)


cdef void _store_f32(const float *src, int64_t n, char *dst, int64_t stride,
                     int simd) noexcept nogil:
    bnbw_store_f32(src, n, dst, stride)

# Arrays shorter than SERIAL_BELOW run on the calling thread; longer ones go out in CHUNK-sized
# pieces (a chunk of float32 is 128 KiB, enough to amortise the scheduling).
cdef int64_t CHUNK = 1 << 15
PARALLEL_MIN = SERIAL_BELOW


def simd_path():
    """Which conversion code runs, e.g. 'f16: F16C, bf16: AVX2' or 'portable'."""
    return bnbw_half_simd_path(simd_converters()).decode("ascii")


cdef int _itemsize(str kind) except -1:
    """The element size of a conversion's narrow side: kind 'f16', 'bf16' or 'f32'."""
    if kind == "f16" or kind == "bf16":
        return 2
    if kind == "f32":
        return 4
    raise ValueError(f"kind: expected 'f16', 'bf16' or 'f32', got {kind!r}")


cdef int _check(cnp.ndarray narrow, int itemsize, cnp.ndarray wide, bint narrow_out) except -1:
    if cnp.PyArray_NDIM(narrow) != 1 or cnp.PyArray_NDIM(wide) != 1:
        raise ValueError("expected 1-d arrays")
    if cnp.PyArray_DIM(narrow, 0) != cnp.PyArray_DIM(wide, 0):
        raise ValueError("expected arrays of equal length")
    if cnp.PyArray_ITEMSIZE(narrow) != itemsize:
        raise TypeError(f"expected {itemsize}-byte elements on the strided side")
    if cnp.PyArray_TYPE(wide) != cnp.NPY_FLOAT32:
        raise TypeError("expected a float32 array on the float side")
    if not (cnp.PyArray_IS_C_CONTIGUOUS(wide) and cnp.PyArray_ISALIGNED(wide)):
        raise ValueError("expected a contiguous, aligned float32 array")
    if not cnp.PyArray_ISWRITEABLE(narrow if narrow_out else wide):
        raise ValueError("expected a writable destination")
    return 0


cdef inline void _convert_piece(load_fn load, store_fn store, char *narrow, int64_t stride,
                                float *wide, int64_t n, int simd) noexcept nogil:
    if load != NULL:
        load(narrow, stride, n, wide, simd)
    else:
        store(wide, n, narrow, stride, simd)


cdef void _convert(load_fn load, store_fn store, char *narrow, int64_t stride, float *wide,
                   int64_t n, int threads) noexcept nogil:
    """n elements between `narrow` (byte step `stride`) and contiguous `wide`: widened by `load`
    when it is given, else narrowed by `store`; on the calling thread, or in CHUNK-sized pieces
    handed out to `threads` threads."""
    cdef int64_t nchunks = (n + CHUNK - 1) // CHUNK
    cdef int64_t c, start
    cdef int simd = simd_converters()
    if n < SERIAL_BELOW or threads == 1:
        _convert_piece(load, store, narrow, stride, wide, n, simd)
        return
    team_started()
    for c in prange(nchunks, schedule="dynamic", num_threads=min(threads, nchunks)):
        start = c * CHUNK
        _convert_piece(load, store, narrow + start * stride, stride, wide + start,
                       min(CHUNK, n - start), simd)


cdef int _convert_arrays(str kind, cnp.ndarray narrow, cnp.ndarray wide, bint narrow_out,
                        int num_threads) except -1:
    """load (narrow_out false) or store (true) between the arrays `narrow` and `wide`."""
    cdef int itemsize = _itemsize(kind)
    cdef load_fn load_f = NULL
    cdef store_fn store_f = NULL
    if narrow_out:
        store_f = (bnbw_store_f16 if kind == "f16" else
                   bnbw_store_bf16 if kind == "bf16" else _store_f32)
    else:
        load_f = (bnbw_load_f16 if kind == "f16" else
                  bnbw_load_bf16 if kind == "bf16" else _load_f32)
    cdef int threads = resolve_threads(num_threads)
    _check(narrow, itemsize, wide, narrow_out)
    cdef char *np_ = <char *>cnp.PyArray_DATA(narrow)
    cdef int64_t stride = cnp.PyArray_STRIDE(narrow, 0)
    cdef int64_t n = cnp.PyArray_DIM(narrow, 0)
    cdef float *wp = <float *>cnp.PyArray_DATA(wide)
    with nogil:
        _convert(load_f, store_f, np_, stride, wp, n, threads)
    return 0


def load(str kind, cnp.ndarray src not None, cnp.ndarray dst not None, *, int num_threads=0):
    """Widen 1-d `src` (kind 'f16', 'bf16' or 'f32'; any byte stride) into contiguous float32
    `dst` on num_threads threads (0: the package default), resolved as every call is."""
    _convert_arrays(kind, src, dst, False, num_threads)


def store(str kind, cnp.ndarray src not None, cnp.ndarray dst not None, *, int num_threads=0):
    """Narrow contiguous float32 `src` into 1-d `dst` (kind 'f16', 'bf16' or 'f32'; any byte
    stride) on num_threads threads (0: the package default)."""
    _convert_arrays(kind, dst, src, True, num_threads)


def _f64_to_f16_bits(const double[::1] src):
    """bnbw_f64_to_f16 over an array, as uint16 bit patterns (exposes the core's scalar rounding to tests)."""
    return _f64_to_16_bits(src, False)


def _f64_to_bf16_bits(const double[::1] src):
    """bnbw_f64_to_bf16 over an array, as uint16 bit patterns."""
    return _f64_to_16_bits(src, True)


cdef _f64_to_16_bits(const double[::1] src, bint bf16):
    out = np.empty(src.shape[0], dtype=np.uint16)
    cdef uint16_t[::1] o = out
    cdef Py_ssize_t i
    with nogil:
        for i in range(src.shape[0]):
            o[i] = bnbw_f64_to_bf16(src[i]).bits if bf16 else bnbw_f64_to_f16(src[i]).bits
    return out
