"""Shared fixtures and helpers for the bnbw_native tests.

The tests are grouped by what they test: engine/ (the engine and its kernels), surfaces/ (each
public surface, and surfaces/test_refusals.py: every refused call of every surface) and package/
(build, packaging, documentation, examples, the benchmark's machinery).  This file, the only
conftest.py, sits above them: test modules in every folder import its helpers by name
(``from conftest import kernels, make_layout``), and those of error_bounds.py and cext.py
beside it, because pytest puts this directory on ``sys.path`` (rootdir conftest, default import
mode).  The benchmark's modules (bench/) are reached through `bench_module` or the `bench`
fixture below, nowhere else.  How close a result
must be to the float64 reference is decided in one place, error_bounds.py (its table,
`assert_close` and `assert_within`); `assert_close` and `BF16` are re-exported here.
Section numbers in the tests ("contract §3.1") are those of docs/contract.md.
"""
import importlib
import sys
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from bnbw_native import reference

from error_bounds import BF16, assert_close  # noqa: F401  (re-exported)

requires_bf16 = pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed")

LAYOUTS = ("contiguous", "transposed", "sliced", "negative")

#: The benchmark's directory (a checkout's or an unpacked sdist's bench/).
BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name):
    """The benchmark module bench/<name>.py, imported as the benchmark's own scripts import each
    other (top-level names: ``shapes``, ``procmem``, ...).  bench/ goes on ``sys.path`` here,
    once; no test module edits ``sys.path`` for it."""
    path = str(BENCH_DIR)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


class _Bench:
    """The benchmark's modules as attributes: ``bench.shapes``, ``bench.balance``."""

    def __getattr__(self, name):
        return bench_module(name)


@pytest.fixture(scope="session")
def bench():
    """bench/'s modules for a test: ``def test_x(bench): bench.shapes.RESNET50_B50``."""
    return _Bench()


@contextmanager
def kernels(cap):
    """Runs the block on the best kernel body up to `cap` ("portable", "avx2", "avx512", "neon"), in
    every module of the package, then restores the previous cap."""
    from bnbw_native import tuning
    previous = tuning.use_kernels(cap)
    try:
        yield
    finally:
        tuning.use_kernels(previous)


def bodies():
    """The kernel bodies this CPU runs, as BNBW_KERNELS names them, most portable first."""
    from bnbw_native import _engine
    return {"portable": ["portable"], "AVX2": ["portable", "avx2"],
            "AVX-512": ["portable", "avx2", "avx512"],
            "NEON": ["portable", "neon"]}[_engine.build_info()["cpu_kernels"]]


@pytest.fixture(autouse=True, scope="session")
def cpus_beyond_this_machine():
    """A call runs on at most the CPUs the process may use; the tests plan as on a 64-CPU
    machine instead, so that the thread counts they compare (3, 7, 8, ...) run teams of that
    size here too and every schedule meets them.  Tests of the cap itself set the model back
    (bnbw_native.tuning.set_cpu_model(0)).  Likewise every call past the serial floor runs on
    the threads it is given, however little it reads (tuning.set_thread_work_floor(0)): small
    inputs reach every team; tests of that rule set the default back."""
    from bnbw_native import tuning
    tuning.set_cpu_model(64)
    floor = tuning.set_thread_work_floor(0)
    yield
    tuning.set_cpu_model(0)
    tuning.set_thread_work_floor(floor)


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
# A oneDNN Graph call (contract 3.1) and its check: surfaces/test_onednn_graph.py, and the
# engine tests that run the same call (thread counts, concurrency)

GRAPH_EPSILON = 1e-3
F32 = np.dtype(np.float32)


def channel_axis(ndim, data_format):
    return 1 if data_format == "NCX" else ndim - 1


def graph_case(rng, shape, data_format="NXC", t1=F32, t2=F32, with_gamma=True):
    """Keyword arguments for a call: x ~ N(5, 2); mean and biased variance computed from the
    rounded x in float64, then rounded to `t2`; dy = 1.5 * x_hat + 0.5 + N(0, 1)."""
    axis = channel_axis(len(shape), data_format)
    axes = tuple(i for i in range(len(shape)) if i != axis)
    x = rng.normal(5.0, 2.0, shape).astype(t1)
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=axes, keepdims=True)
    var = x64.var(axis=axes, keepdims=True)
    x_hat = (x64 - mean) / np.sqrt(var + GRAPH_EPSILON)
    dy = (1.5 * x_hat + 0.5 + rng.normal(0.0, 1.0, shape)).astype(t1)
    gamma = rng.normal(1.0, 0.5, shape[axis]).astype(t2) if with_gamma else None
    return dict(src=x, diff_dst=dy, mean=mean.reshape(-1).astype(t2),
                variance=var.reshape(-1).astype(t2), gamma=gamma)


def graph_reference(case, **options):
    """The float64 reference for `case` (options: epsilon, data_format, num_outputs)."""
    options.setdefault("epsilon", GRAPH_EPSILON)
    return reference.batchnorm_training_backward(**case, **options)


def check_graph_result(result, ref, t1, t2, num_outputs=3):
    assert_close(result.diff_src, ref[0], t1)
    if num_outputs == 3:
        assert_close(result.diff_gamma, ref[1], t2)
        assert_close(result.diff_beta, ref[2], t2)
    else:
        assert result.diff_gamma is None and result.diff_beta is None
