"""Shared fixtures and helpers for the bnbw_native tests.

Test modules import the helpers by name (``from conftest import kernels, make_layout``): pytest
puts this directory on ``sys.path`` (rootdir conftest, default import mode).  How close a result
must be to the float64 reference is decided in one place, error_bounds.py (its table,
`assert_close` and `assert_within`); `assert_close` and `BF16` are re-exported here.
Section numbers in the tests ("contract §3.1") are those of docs/contract.md.
"""
import zlib
from contextlib import contextmanager

import numpy as np
import pytest

from error_bounds import BF16, assert_close  # noqa: F401  (re-exported)

requires_bf16 = pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed")

LAYOUTS = ("contiguous", "transposed", "sliced", "negative")


@contextmanager
def kernels(cap):
    """Runs the block on the best kernel body up to `cap` ("portable", "avx2", "avx512", "neon"), in
    every module of the package, then restores the previous cap."""
    from bnbw_native import _config
    previous = _config.use_kernels(cap)
    try:
        yield
    finally:
        _config.use_kernels(previous)


def bodies():
    """The kernel bodies this CPU runs, as BNBW_KERNELS names them, most portable first."""
    from bnbw_native import _call
    return {"portable": ["portable"], "AVX2": ["portable", "avx2"],
            "AVX-512": ["portable", "avx2", "avx512"],
            "NEON": ["portable", "neon"]}[_call.build_info()["cpu_kernels"]]


@pytest.fixture
def rng(request):
    """A NumPy Generator seeded from the test's id: reproducible, and different per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# --------------------------------------------------------------------------------------------
# Memory layouts


def _flipped_axes(ndim):
    """Axis 0 and every other axis counting from the last (so the innermost axis is included)."""
    return tuple(sorted({0, *range(ndim - 1, -1, -2)})) if ndim else ()


def make_layout(array, layout):
    """A fresh array with the logical values of `array` stored in the memory layout `layout`.

    - ``"contiguous"``: a C-contiguous copy.
    - ``"transposed"``: stored with the axis order reversed, then transposed back (for rank 2,
      a Fortran-order array).
    - ``"sliced"``: a strided view (step 2 on the innermost axis and every other axis counting
      from it, offset 1 on the rest) into a larger buffer whose other elements are NaN, so a
      kernel that reads outside the view produces NaN.
    - ``"negative"``: negative strides on axis 0 and every other axis from the innermost.
    The result never shares memory with `array`.
    """
    a = np.asarray(array)
    ndim = a.ndim
    if layout == "contiguous":
        view = a.copy(order="C")
    elif layout == "transposed":
        order = tuple(range(ndim))[::-1]
        view = a.transpose(order).copy(order="C").transpose(np.argsort(order))
    elif layout == "sliced":
        stepped = set(range(ndim - 1, -1, -2))
        buffer_shape = tuple(2 * n + 1 if i in stepped else n + 1 for i, n in enumerate(a.shape))
        fill = np.nan if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else 0
        buffer = np.full(buffer_shape, fill, dtype=a.dtype)
        view = buffer[tuple(slice(1, None, 2) if i in stepped else slice(1, None)
                            for i in range(ndim))]
        view[...] = a
    elif layout == "negative":
        axes = _flipped_axes(ndim)
        view = np.flip(np.flip(a, axes).copy(order="C"), axes)
    else:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    assert view.shape == a.shape and view.dtype == a.dtype
    assert np.array_equal(view, a, equal_nan=True)
    return view
