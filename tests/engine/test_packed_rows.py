"""Packed short rows: channel-major rows of 2, 4, 8 or 16 elements (a 2 x 2 or 4 x 4 image) go
16 / n rows to a vector when every operand lays a run's rows end to end, and give the row
kernels' bits.

The same values are passed twice: dense, whose runs pack, and as a view with one element of
padding after every row, whose runs cannot (a row's operands are not end to end) and which the
plan visits in the same order (the padding is not a dim).  Every result must agree bit for bit:
the forward's statistics and y (no ReLU, ReLU, residual added before the ReLU), the training
backward with and without a ReLU mask (of the storage type and bool) and the residual's
gradient, and the frozen backward, with blocked and exact sums; on every kernel body, at 1, 2
and 3 threads, in f32, f16 and bf16, with channel counts that leave rows over after the last
whole vector (they take the row kernels).  A float64 reference checks the packed results are
right, not only equal.
"""
import itertools

import numpy as np
import pytest

from bnbw_native import _arrays, tuning
from bnbw_native._onednn_graph import FORWARD, GRAPH
from bnbw_native._plan import BLOCK_ELEMENTS
from conftest import BF16, bodies, kernels

EPS = 1e-5
DTYPES = [np.float32, np.float16] + ([BF16] if BF16 is not None else [])
DTYPE_IDS = [np.dtype(d).name for d in DTYPES]
# (N, C, n): rows of n elements; C = 16 / n rows per vector times k, and k plus some rows over
# (C = 1 would not do: its dim is dropped and the dense rows merge into one, the padded not)
SHAPES = [(5, 16, 2), (3, 9, 2), (4, 12, 4), (7, 7, 4), (3, 10, 8), (6, 3, 8), (2, 2, 4),
          (3, 5, 16), (2, 2, 16)]
# channels of just over and just under two reduction blocks (and of a block and a row), so that
# packed runs start and end at a block's edge; for every kind of schedule, a cache too small
# for fused groups and one large enough
BLOCK_SHAPES = [(2 * BLOCK_ELEMENTS // 4 + 1, 3, 4), (2 * BLOCK_ELEMENTS // 4 - 1, 3, 4),
                (BLOCK_ELEMENTS // 8 + 1, 5, 8), (BLOCK_ELEMENTS // 16 + 1, 3, 16)]
CACHE_MODELS = [(1 << 10, 1 << 12, 64), (8 << 20, 1 << 30, 2)]


@pytest.fixture(autouse=True)
def every_team():
    """Small calls reach every thread count (the work floor would keep them on one thread)."""
    before = tuning.set_thread_work_floor(0)
    cache = tuning.cache_model()
    yield
    tuning.set_thread_work_floor(before)
    tuning.set_cache_model(*cache)


def _padded(a):
    """a's values in a view whose rows (last dim) are each followed by one unused element."""
    base = np.full(a.shape[:-1] + (a.shape[-1] + 1,), np.nan, a.dtype)
    view = base[..., :-1]
    view[...] = a
    return view


def _same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def _problem(rng, shape, dtype):
    C = shape[1]
    x = (rng.standard_normal(shape) * 2 + 3).astype(np.float32).astype(dtype)
    dy = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    residual = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    stats = [rng.standard_normal(C).astype(np.float32), (rng.random(C) + 0.5).astype(np.float32),
             rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)]
    return x, dy, residual, stats


def _forward(x, stats, relu, threads, residual=None):
    return _arrays.forward(FORWARD, x, *stats, EPS, 0.1, "NCX", relu, None, threads,
                           torch_running=True, residual=residual)


def _backward(formula, x, dy, stats, threads, mask=None, dres=None, exact_sums=False):
    mean, var, gamma = stats[3], stats[1], stats[2]
    return _arrays.backward(GRAPH, formula, x, dy, mean, var, gamma, EPS, "NCX", None, threads,
                            relu_dst=mask, diff_residual=dres, exact_sums=exact_sums)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_forward_of_packed_rows_is_the_row_kernels(rng, dtype, shape):
    x, _, residual, stats = _problem(rng, shape, dtype)
    for body in bodies():
        with kernels(body):
            for threads in (1, 2, 3):
                for relu, res in ((False, None), (True, None), (True, residual)):
                    packed = _forward(x, stats, relu, threads, res)
                    rows = _forward(_padded(x), stats, relu, threads,
                                    None if res is None else _padded(res))
                    for a, b in zip(packed, rows):
                        _same(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_backward_of_packed_rows_is_the_row_kernels(rng, dtype, shape):
    x, dy, residual, stats = _problem(rng, shape, dtype)
    y = _forward(x, stats, True, 1)[0]
    for body in bodies():
        with kernels(body):
            for threads in (1, 2, 3):
                for formula, mask, exact in itertools.product(
                        (_arrays.TRAINING, _arrays.FROZEN), (None, y, y > 0), (False, True)):
                    dres = [None, None] if mask is None else [np.empty_like(dy),
                                                              np.empty_like(dy)]
                    packed = _backward(formula, x, dy, stats, threads, mask, dres[0], exact)
                    rows = _backward(formula, _padded(x), _padded(dy), stats, threads,
                                     None if mask is None else _padded(mask), dres[1], exact)
                    for a, b in zip(packed, rows):
                        if a is not None:
                            _same(a, b)
                    if mask is not None:
                        _same(dres[0], dres[1])


def test_packed_rows_match_the_float64_reference(rng):
    x, dy, _, stats = _problem(rng, (64, 24, 4), np.float32)
    y, _, _, mean, var = _forward(x, stats, False, 2)
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=(0, 2))
    sigma2 = x64.var(axis=(0, 2))
    np.testing.assert_allclose(mean, mu, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(var, sigma2, rtol=1e-5)
    want = ((x64 - mu[:, None]) / np.sqrt(sigma2[:, None] + EPS) * stats[2][:, None]
            + stats[3][:, None])
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
    dx, dgamma, dbeta = _backward(_arrays.TRAINING, x, dy, [None, var, stats[2], mean], 2)
    g = dy.astype(np.float64)
    r = 1 / np.sqrt(var.astype(np.float64) + EPS)
    xhat = (x64 - mean[:, None]) * r[:, None]
    np.testing.assert_allclose(dbeta, g.sum(axis=(0, 2)), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dgamma, (g * xhat).sum(axis=(0, 2)), rtol=1e-5, atol=1e-4)
    m = x.shape[0] * x.shape[2]
    want_dx = (stats[2][:, None] * r[:, None]
               * (g - g.sum(axis=(0, 2))[:, None] / m
                  - xhat * (g * xhat).sum(axis=(0, 2))[:, None] / m))
    np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-4)


def _outliers_at_block_edges(x):
    """x with one far value at the first and last element of each channel and of its second
    block: a sum folded across the wrong lanes or blocks moves visibly."""
    n = x.shape[0] * x.shape[2]
    for c in range(x.shape[1]):
        flat = x[:, c].reshape(-1)
        for at in (0, BLOCK_ELEMENTS - 1, BLOCK_ELEMENTS, n - 1):
            if at < n:
                flat[at] = 5003.0
        x[:, c] = flat.reshape(x.shape[0], x.shape[2])
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=str)
def test_packed_rows_across_reduction_blocks_are_the_row_kernels(rng, dtype, shape):
    x, dy, residual, stats = _problem(rng, shape, dtype)
    x = _outliers_at_block_edges(x)
    y = _forward(x, stats, True, 1)[0]
    schedules = set()
    for model in CACHE_MODELS:
        tuning.set_cache_model(*model)
        for body in bodies():
            with kernels(body):
                for threads in (1, 2, 3):
                    for formula in ("forward", "training"):
                        schedules.add(tuning.describe(x, "NCX", formula=formula,
                                                      num_threads=threads)["schedule"])
                    for relu, res in ((False, None), (True, residual)):
                        packed = _forward(x, stats, relu, threads, res)
                        rows = _forward(_padded(x), stats, relu, threads,
                                        None if res is None else _padded(res))
                        for a, b in zip(packed, rows):
                            _same(a, b)
                    for formula, mask, exact in itertools.product(
                            (_arrays.TRAINING, _arrays.FROZEN), (None, y > 0), (False, True)):
                        dres = [None, None] if mask is None else [np.empty_like(dy),
                                                                  np.empty_like(dy)]
                        packed = _backward(formula, x, dy, stats, threads, mask, dres[0], exact)
                        rows = _backward(formula, _padded(x), _padded(dy), stats, threads,
                                         None if mask is None else _padded(mask), dres[1],
                                         exact)
                        for a, b in zip(packed, rows):
                            if a is not None:
                                _same(a, b)
                        if mask is not None:
                            _same(dres[0], dres[1])
    assert {"major-sweep", "major-sweep-fused"} <= schedules
