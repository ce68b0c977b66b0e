"""Shared fixtures and helpers for the bnbw_native tests.

Test modules import the helpers by name (``from conftest import assert_close, make_layout``):
pytest puts this directory on ``sys.path`` (rootdir conftest, default import mode).
"""
import zlib
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import pytest

try:
    import ml_dtypes
except ImportError:  # ml_dtypes is optional (SPEC section 2)
    ml_dtypes = None

#: ``ml_dtypes.bfloat16``, or None without ml_dtypes.
BF16 = None if ml_dtypes is None else np.dtype(ml_dtypes.bfloat16)
requires_bf16 = pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed")

LAYOUTS = ("contiguous", "transposed", "sliced", "negative")


@contextmanager
def kernels(cap):
    """Runs the block on the best kernel body up to `cap` ("portable", "avx2", "avx512"), in
    every module of the package, then restores the previous cap."""
    from bnbw_native import _config
    previous = _config.use_kernels(cap)
    try:
        yield
    finally:
        _config.use_kernels(previous)


def bodies():
    """The kernel bodies this CPU runs, as BNBW_KERNELS names them, most portable first."""
    from bnbw_native import _call, _config
    best = {"portable": 0, "AVX2": 1, "AVX-512": 2}[_call.build_info()["cpu_kernels"]]
    return list(_config.KERNEL_CAPS[:best + 1])


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


# --------------------------------------------------------------------------------------------
# Tolerances


class Tolerance(NamedTuple):
    """Allowed |got - ref| per element: ``rtol * |ref| + ntol * max|ref|``.

    `ntol` is the norm-wise part: f32 arithmetic error scales with the largest terms of a
    channel, not with each result.  For f32, ``ntol = 1e-5`` is tight enough that the tests catch
    small formula errors (M - 1 instead of M moves dx by about 1/M of its size; the tests keep
    M below ~5000 where they compare).
    `rtol` is the element-wise part.  A 16-bit output rounded once to nearest from an f32 value v
    that is within the f32 arithmetic error of ref is off by at most half an ulp of v, and half an
    ulp is at most ``2**-(p+1) * |v|`` with p stored mantissa bits (10 for f16, 7 for bf16); the
    f32 error, also when it moves v across a rounding boundary, is covered by `ntol`.  Truncation
    instead of rounding (up to a whole ulp) fails.
    """

    rtol: float
    ntol: float


TOLERANCES = {
    np.dtype(np.float32): Tolerance(rtol=1e-6, ntol=1e-5),
    np.dtype(np.float16): Tolerance(rtol=2.0**-11, ntol=1e-5),  # half an f16 ulp at 1
}
if BF16 is not None:
    TOLERANCES[BF16] = Tolerance(rtol=2.0**-8, ntol=1e-5)  # half a bf16 ulp at 1


def assert_close(got, ref, dtype):
    """Check a result of storage type `dtype` against a float64 reference.

    `got` must have exactly `dtype` and the shape of `ref`.  Non-finite values must sit where the
    reference has them (NaN and inf are not told apart: IEEE results of different but equivalent
    evaluation orders may differ there); finite values must satisfy the `TOLERANCES` criterion.
    """
    dtype = np.dtype(dtype)
    got = np.asarray(got)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.dtype == dtype, f"dtype {got.dtype}, expected {dtype}"
    assert got.shape == ref.shape, f"shape {got.shape}, expected {ref.shape}"
    got = got.astype(np.float64)
    finite = np.isfinite(ref)
    mismatch = np.isfinite(got) != finite
    assert not mismatch.any(), (
        f"{mismatch.sum()} element(s) finite in one of got/ref only, first at "
        f"{np.argwhere(mismatch)[0].tolist()}")
    if not finite.any():
        return
    tol = TOLERANCES[dtype]
    scale = np.abs(ref[finite]).max()
    error = np.abs(got[finite] - ref[finite])
    allowed = tol.rtol * np.abs(ref[finite]) + tol.ntol * scale
    bad = error > allowed
    if bad.any():
        worst = np.argmax(error - allowed)
        raise AssertionError(
            f"{bad.sum()} of {bad.size} element(s) out of tolerance ({dtype}: {tol}); worst: "
            f"got {got[finite][worst]!r}, ref {ref[finite][worst]!r}, error {error[worst]:.3g} "
            f"> allowed {allowed[worst]:.3g} (max|ref| = {scale:.3g})")
