"""The ReLU backward folded into the batch-norm backward: relu_dst= and diff_residual=.

The gradient used everywhere is g = diff_dst where the forward's output relu_dst is > 0 (or the
bool mask is True), 0 elsewhere: selected, never multiplied.  Every result must equal the unfused
call on g bit for bit, in every front-end that takes relu_dst, storage type, layout and thread
count; diff_residual receives g itself.  What relu_dst= and diff_residual= refuse is in
test_refusals.py.
"""
import numpy as np
import pytest

from bnbw_native import backward_apply, backward_reduce, batchnorm_training_backward, reference
from conftest import BF16, make_layout

DTYPES = [np.float32, np.float16] + ([BF16] if BF16 is not None else [])
LAYOUTS = ["contiguous", "negative", "sliced", "transposed"]
SHAPES = [((4, 6, 5, 7), "NCX"), ((4, 5, 7, 19), "NXC"), ((300, 40), "NXC"), ((2, 3, 2100), "NCX")]


def _bits(a):
    return None if a is None else np.ascontiguousarray(a).view(np.uint8).tobytes()


def _problem(rng, shape, data_format, dtype):
    C = shape[1] if data_format == "NCX" else shape[-1]
    x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32).astype(dtype)
    dy = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    y = rng.standard_normal(shape).astype(np.float32)
    y.reshape(-1)[::7] = 0.0                 # y == 0: inactive
    y.reshape(-1)[3::11] = np.nan            # NaN: inactive
    y = y.astype(dtype)
    stat = BF16 if dtype == BF16 and rng.random() < 0.5 else np.float32
    mean = rng.standard_normal(C).astype(stat)
    var = (rng.random(C) + 0.5).astype(stat)
    gamma = rng.standard_normal(C).astype(stat)
    return x, dy, y, mean, var, gamma


def _masked(dy, active, layout="contiguous"):
    """g as the unfused caller computes it, stored in `layout` (dy's)."""
    g = make_layout(dy, "contiguous")
    g[~active] = 0
    return make_layout(g, layout)


def _active(y):
    return np.asarray(y.astype(np.float32) > 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape, data_format", SHAPES, ids=str)
@pytest.mark.parametrize("form", ["output", "bool"])
def test_fused_equals_unfused_on_the_masked_gradient(rng, dtype, layout, shape, data_format,
                                                     form):
    x, dy, y, mean, var, gamma = _problem(rng, shape, data_format, dtype)
    active = _active(y)
    relu = y if form == "output" else active
    g = _masked(dy, active, layout)
    x, dy, relu = (make_layout(a, layout) for a in (x, dy, relu))
    for num_outputs in (3, 1):
        want = batchnorm_training_backward(x, g, mean, var, gamma, epsilon=1e-3,
                                           data_format=data_format, num_outputs=num_outputs)
        got = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3,
                                          data_format=data_format, num_outputs=num_outputs,
                                          relu_dst=relu)
        for a, b in zip(got, want):
            assert _bits(a) == _bits(b), num_outputs


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape, data_format", SHAPES, ids=str)
def test_two_phases_with_relu_equal_the_fused_call(rng, dtype, shape, data_format):
    x, dy, y, mean, var, gamma = _problem(rng, shape, data_format, dtype)
    want = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3,
                                       data_format=data_format, relu_dst=y)
    partial, count = backward_reduce(x, dy, mean, data_format=data_format, relu_dst=y)
    got = backward_apply(x, dy, mean, var, gamma, partial, count, epsilon=1e-3,
                         data_format=data_format, relu_dst=y)
    for a, b in zip(got, want):
        assert _bits(a) == _bits(b)
    g = _masked(dy, _active(y))
    assert _bits(partial) == _bits(backward_reduce(x, g, mean, data_format=data_format)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape, data_format", SHAPES, ids=str)
def test_diff_residual_receives_the_masked_gradient(rng, dtype, shape, data_format):
    x, dy, y, mean, var, gamma = _problem(rng, shape, data_format, dtype)
    dy.reshape(-1)[5::13] = np.nan           # NaN payloads pass through active positions
    active = _active(y)
    want_res = np.where(active, dy.view(np.uint16 if dy.itemsize == 2 else np.uint32), 0)
    res = np.full_like(dy, 7)
    got = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3,
                                      data_format=data_format, relu_dst=y, diff_residual=res)
    assert _bits(res) == _bits(want_res)
    want = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3,
                                       data_format=data_format, relu_dst=y)
    for a, b in zip(got, want):
        assert _bits(a) == _bits(b)


@pytest.mark.parametrize("in_place", ["diff_residual", "diff_src"])
@pytest.mark.parametrize("shape, data_format", SHAPES, ids=str)
def test_diff_dst_may_be_overwritten_by_either_output(rng, in_place, shape, data_format):
    x, dy, y, mean, var, gamma = _problem(rng, shape, data_format, np.float32)
    want_res = np.where(_active(y), dy, np.float32(0))
    want = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3,
                                       data_format=data_format, relu_dst=y)
    buf = dy.copy()
    if in_place == "diff_residual":
        res, out = buf, None
    else:
        res = np.empty_like(dy)
        out = (buf, np.empty_like(mean), np.empty_like(mean))
    got = batchnorm_training_backward(x, buf, mean, var, gamma, epsilon=1e-3,
                                      data_format=data_format, relu_dst=y, diff_residual=res,
                                      out=out)
    assert _bits(res) == _bits(want_res)
    for a, b in zip(got, want):
        assert _bits(a) == _bits(b)


def test_inactive_infinities_never_reach_the_sums(rng):
    x, dy, y, mean, var, gamma = _problem(rng, (4, 6, 5, 7), "NCX", np.float32)
    inactive = ~_active(y)
    dy[inactive] = np.where(rng.random(inactive.sum()) < 0.5, np.inf, np.nan)
    dx, dgamma, dbeta = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3,
                                                    data_format="NCX", relu_dst=y)
    assert np.isfinite(dx).all() and np.isfinite(dgamma).all() and np.isfinite(dbeta).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_fused_call_matches_the_float64_reference(rng, dtype):
    x, dy, y, mean, var, gamma = _problem(rng, (8, 6, 9, 5), "NCX", dtype)
    g = np.where(_active(y), dy.astype(np.float64), 0.0)
    want = reference.batchnorm_training_backward(x.astype(np.float64), g, mean.astype(np.float64),
                                                 var.astype(np.float64),
                                                 gamma.astype(np.float64), epsilon=1e-3,
                                                 data_format="NCX")
    got = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3, data_format="NCX",
                                      relu_dst=y)
    tol = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 4e-3}.get(np.dtype(dtype), 2e-2)
    for a, b in zip(got, want):
        a = a.astype(np.float64)
        assert np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(b)))


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_fused_results_do_not_depend_on_threads(rng, threads):
    x, dy, y, mean, var, gamma = _problem(rng, (16, 12, 30, 30), "NCX", np.float16)
    want = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3,
                                       data_format="NCX", relu_dst=y, num_threads=1)
    got = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3, data_format="NCX",
                                      relu_dst=y, num_threads=threads)
    for a, b in zip(got, want):
        assert _bits(a) == _bits(b)


def test_a_mask_in_another_layout_gives_the_same_bits(rng):
    x, dy, y, mean, var, gamma = _problem(rng, (4, 6, 9, 7), "NCX", np.float16)
    swapped = np.ascontiguousarray(y.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    want = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3,
                                       data_format="NCX", relu_dst=y)
    got = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3, data_format="NCX",
                                      relu_dst=swapped)
    for a, b in zip(got, want):
        assert _bits(a) == _bits(b)
