"""Channels innermost but not at unit stride: x and dy gathered into channel-last temporaries.

A view of every other (or every third) channel of a dense layer's input or of a channel-last
image, or its channels reversed, has its channels as its innermost dim, a few elements apart.
Visited in place, such a call would walk each channel's elements a whole row apart, one cache
line read per element; the plan instead reads x, and dy unless its channels already lie at unit
stride, from dense channel-last temporaries (`describe`'s via_temp names them).  The sums then
run as in a dense channel-last call, so every result must be that call's, bit for bit: the
forward (no ReLU, ReLU, the residual added), the training backward with ReLU masks of the
storage type and bool and the residual's gradient, the frozen backward and the two phases, with
blocked and exact sums; on every kernel body, at 1, 2 and 3 threads, in f32, f16 and bf16,
with rows on both sides of a channel-last block's edge.  Outputs given as strided views keep
their gaps, and a float64 reference checks the results are right, not only equal.

The other way round, an output (or a mask) whose elements lie a cache line or more apart along
the rows the kernels walk (an NXC dx of an NCX x, an NCX y of an NXC x) goes through a
temporary laid out like x, copied out in its own memory order: the same bits again.
"""
import itertools

import numpy as np
import pytest

from bnbw_native import _arrays, backward_apply, backward_reduce, tuning
from bnbw_native._onednn_graph import FORWARD, GRAPH
from conftest import BF16, bodies, kernels

EPS = 1e-5
DTYPES = [np.float32, np.float16] + ([BF16] if BF16 is not None else [])
DTYPE_IDS = [np.dtype(d).name for d in DTYPES]
# (logical NXC shape with the channels last, what each of x and dy is a view of): every other
# channel, every third, reversed, or dense channel-last ("dense")
VIEWS = {"step2": np.s_[..., ::2], "step3": np.s_[..., 1::3], "reversed": np.s_[..., ::-1],
         "dense": np.s_[...]}
# rows of one block (the slab) and of several (the split, by items and by whole rows); 2050 rows
# of 64 channels and 130 of 1040 end just past a block's edge (blocks of 1024 and 128 rows)
SHAPES = [(40, 24), (2, 3, 171, 16), (2050, 64), (1100, 300), (130, 1040)]


def test_the_shapes_reach_every_channel_last_schedule():
    seen = set()
    for shape in SHAPES:
        x = np.zeros(shape[:-1] + (2 * shape[-1],), np.float32)[..., ::2]
        for formula, threads in itertools.product(("forward", "training", "frozen"), (1, 2, 3)):
            d = tuning.describe(x, _fmt(x), formula=formula, num_threads=threads)
            seen.add((d["schedule"], d["threads"] > 1, d["apply_rows"]))
    assert {("last-slab", False, False), ("last-split", True, False),
            ("last-split", True, True)} <= seen
PAIRS = [("step2", "step2"), ("step3", "dense"), ("dense", "reversed"), ("reversed", "step2")]


@pytest.fixture(autouse=True)
def every_team():
    """Small calls reach every thread count (the work floor would keep them on one thread)."""
    before = tuning.set_thread_work_floor(0)
    yield
    tuning.set_thread_work_floor(before)


def _view(a, how, fill=np.nan):
    """a's values in a view of kind `how` into a wider buffer (its gaps hold `fill`)."""
    if how == "dense":
        return a.copy()
    widen = {"step2": 2, "step3": 3, "reversed": 1}[how]
    base = np.full(a.shape[:-1] + (a.shape[-1] * widen + (widen > 1),), fill, a.dtype)
    view = base[VIEWS[how]][..., :a.shape[-1]]
    view[...] = a
    return view


def _fmt(a):
    return "NXC" if a.ndim > 2 else "NCX"


def _same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def _problem(rng, shape, dtype):
    C = shape[-1]
    x = (rng.standard_normal(shape) * 2 + 3).astype(np.float32).astype(dtype)
    dy = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    residual = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    stats = [rng.standard_normal(C).astype(np.float32), (rng.random(C) + 0.5).astype(np.float32),
             rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)]
    return x, dy, residual, stats


def _forward(x, stats, relu, threads, residual=None, out=None):
    return _arrays.forward(FORWARD, x, *stats, EPS, 0.1, _fmt(x), relu, out, threads,
                           torch_running=True, residual=residual)


def _backward(formula, x, dy, stats, threads, mask=None, dres=None, exact=False, out=None):
    mean, var, gamma = stats[3], stats[1], stats[2]
    return _arrays.backward(GRAPH, formula, x, dy, mean, var, gamma, EPS, _fmt(x), out, threads,
                            relu_dst=mask, diff_residual=dres, exact_sums=exact)


def test_describe_names_the_gathered_inputs():
    x = np.zeros((64, 48), np.float32)
    for formula, want in (("forward", ["x"]), ("training", ["x", "dy"])):
        d = tuning.describe(x[:, ::2], "NCX", formula=formula, num_threads=1)
        assert d["layout"] == "channel-last" and d["via_temp"] == want
    stat = np.ones(24, np.float32)
    dense_x = _arrays.describe(GRAPH, _arrays.TRAINING, x[:, :24], x[:, ::2], stat, stat, stat,
                               EPS, "NCX", 1)
    assert dense_x["layout"] == "channel-last" and dense_x["via_temp"] == ["dy"]
    # channels that are not the innermost dim stay where they lie (rows of a channel-major call)
    image = np.zeros((4, 8, 6, 10), np.float32)
    for view in (image[..., ::2], image[:, ::2]):
        d = tuning.describe(view, "NCX", formula="training", num_threads=1)
        assert d["layout"] == "channel-major" and d["via_temp"] == []
    d = tuning.describe(np.zeros((64, 1), np.float32)[:, ::1], "NCX", formula="training",
                        num_threads=1)
    assert d["via_temp"] == []


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_forward_of_gathered_inputs_is_the_dense_call(rng, dtype, shape):
    x, _, residual, stats = _problem(rng, shape, dtype)
    for body in bodies():
        with kernels(body):
            for threads, how in itertools.product((1, 2, 3), ("step2", "reversed")):
                for relu, res in ((False, None), (True, None), (True, residual)):
                    want = _forward(x, stats, relu, threads, res)
                    y = _view(np.zeros_like(x), how)
                    out = (y,) + tuple(np.empty_like(s) for s in stats[:2]) + \
                        tuple(np.empty_like(s) for s in stats[:2])
                    got = _forward(_view(x, how), stats, relu, threads,
                                   None if res is None else _view(res, how), out=out)
                    for a, b in zip(got, want):
                        _same(a, b)
                    assert np.isnan(y.base).sum() == y.base.size - y.size   # gaps kept


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_backward_of_gathered_inputs_is_the_dense_call(rng, dtype, shape):
    x, dy, _, stats = _problem(rng, shape, dtype)
    y = _forward(x, stats, True, 1)[0]
    for body in bodies():
        with kernels(body):
            for threads, (hx, hdy) in itertools.product((1, 2, 3), PAIRS):
                for formula, mask, exact in itertools.product(
                        (_arrays.TRAINING, _arrays.FROZEN), (None, y, y > 0), (False, True)):
                    dres = [None, None] if mask is None else [np.empty_like(dy),
                                                              _view(np.zeros_like(dy), hx)]
                    want = _backward(formula, x, dy, stats, threads, mask, dres[0], exact)
                    dx = _view(np.zeros_like(x), hx)
                    out = (dx, np.empty_like(stats[0]), np.empty_like(stats[0]))
                    got = _backward(formula, _view(x, hx), _view(dy, hdy), stats, threads,
                                    None if mask is None else _view(mask, hdy, False), dres[1],
                                    exact, out=out)
                    for a, b in zip(got, want):
                        if a is not None:
                            _same(a, b)
                    if mask is not None:
                        _same(dres[1], dres[0])
                    if hx != "dense":
                        assert np.isnan(dx.base).sum() == dx.base.size - dx.size


def test_the_two_phases_of_gathered_inputs_are_the_dense_call(rng):
    x, dy, _, stats = _problem(rng, (300, 40), np.float32)
    mean, var, gamma = stats[3], stats[1], stats[2]
    for threads in (1, 2, 3):
        want_sums = backward_reduce(x, dy, mean, data_format="NCX", num_threads=threads)
        got_sums = backward_reduce(_view(x, "step2"), _view(dy, "step3"), mean,
                                   data_format="NCX", num_threads=threads)
        _same(got_sums[0], want_sums[0])
        assert got_sums[1] == want_sums[1]
        want = backward_apply(x, dy, mean, var, gamma, *want_sums, epsilon=EPS,
                              data_format="NCX", num_threads=threads)
        got = backward_apply(_view(x, "reversed"), _view(dy, "step2"), mean, var, gamma,
                             *got_sums, epsilon=EPS, data_format="NCX", num_threads=threads)
        for a, b in zip(got, want):
            _same(a, b)


def test_gathered_inputs_match_the_float64_reference(rng):
    x, dy, _, stats = _problem(rng, (6, 5, 7, 24), np.float32)
    xs, dys = _view(x, "step2"), _view(dy, "reversed")
    y, _, _, mean, var = _forward(xs, stats, False, 2)
    x64 = x.astype(np.float64)
    axes = (0, 1, 2)
    mu, sigma2 = x64.mean(axis=axes), x64.var(axis=axes)
    np.testing.assert_allclose(mean, mu, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(var, sigma2, rtol=1e-5)
    np.testing.assert_allclose(y, (x64 - mu) / np.sqrt(sigma2 + EPS) * stats[2] + stats[3],
                               rtol=1e-4, atol=1e-4)
    dx, dgamma, dbeta = _backward(_arrays.TRAINING, xs, dys, [None, var, stats[2], mean], 2)
    g = dy.astype(np.float64)
    r = 1 / np.sqrt(var.astype(np.float64) + EPS)
    xhat = (x64 - mean) * r
    m = x.size // x.shape[-1]
    np.testing.assert_allclose(dbeta, g.sum(axis=axes), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dgamma, (g * xhat).sum(axis=axes), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(
        dx, stats[2] * r * (g - g.sum(axis=axes) / m - xhat * (g * xhat).sum(axis=axes) / m),
        rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hx, hdy", [("step2", "step2"), ("dense", "step2"), ("step2", "dense")])
def test_outputs_in_place_over_gathered_inputs(rng, hx, hdy):
    """dx written over dy, and the forward's y over x, where either is gathered: the inputs are
    read whole before any output reaches the caller's memory, so the results are the
    out-of-place call's."""
    x, dy, _, stats = _problem(rng, (1100, 40), np.float32)
    for threads in (1, 2, 3):
        want = _backward(_arrays.TRAINING, x, dy, stats, threads)
        held = _view(dy, hdy)
        got = _backward(_arrays.TRAINING, _view(x, hx), held, stats, threads,
                        out=(held, np.empty_like(stats[0]), np.empty_like(stats[0])))
        for a, b in zip(got, want):
            _same(a, b)
        want = _forward(x, stats, True, threads)
        held = _view(x, hx)
        out = (held,) + tuple(np.empty_like(s) for s in stats[:2] + stats[:2])
        for a, b in zip(_forward(held, stats, True, threads, out=out), want):
            _same(a, b)


def _other_layout(a, data_format):
    """A zeroed array of a's logical shape whose memory puts the channels the other way:
    channels last for NCX, first for NXC (as a transposed view of a dense array)."""
    perm = (0,) + tuple(range(2, a.ndim)) + (1,) if data_format == "NCX" else \
        (0, a.ndim - 1) + tuple(range(1, a.ndim - 1))
    return np.zeros(tuple(a.shape[i] for i in perm), a.dtype).transpose(np.argsort(perm))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape, data_format", [((3, 40, 5, 7), "NCX"), ((2, 33, 130), "NCX"),
                                                ((3, 5, 7, 40), "NXC"), ((2, 130, 33), "NXC")],
                         ids=str)
def test_scattered_outputs_are_the_dense_call(rng, dtype, shape, data_format):
    C = shape[1] if data_format == "NCX" else shape[-1]
    x = (rng.standard_normal(shape) * 2 + 3).astype(np.float32).astype(dtype)
    dy = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    stats = [rng.standard_normal(C).astype(np.float32), (rng.random(C) + 0.5).astype(np.float32),
             rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)]
    mean, var, gamma = stats[3], stats[1], stats[2]
    for body in bodies():
        with kernels(body):
            for threads in (1, 2, 3):
                want = _arrays.forward(FORWARD, x, *stats, EPS, 0.1, data_format, True, None,
                                       threads, torch_running=True)
                y = _other_layout(x, data_format)
                out = (y,) + tuple(np.empty_like(s) for s in stats[:2] + stats[:2])
                got = _arrays.forward(FORWARD, x, *stats, EPS, 0.1, data_format, True, out,
                                      threads, torch_running=True)
                for a, b in zip(got, want):
                    _same(a, b)
                mask = _other_layout(x, data_format).astype(bool)
                mask[...] = want[0] > 0
                dres = [np.empty_like(dy), _other_layout(dy, data_format)]
                want = _arrays.backward(GRAPH, _arrays.TRAINING, x, dy, mean, var, gamma, EPS,
                                        data_format, None, threads, relu_dst=want[0] > 0,
                                        diff_residual=dres[0])
                dx = _other_layout(x, data_format)
                got = _arrays.backward(GRAPH, _arrays.TRAINING, x, dy, mean, var, gamma, EPS,
                                       data_format, (dx, np.empty(C, np.float32),
                                                     np.empty(C, np.float32)),
                                       threads, relu_dst=mask, diff_residual=dres[1])
                for a, b in zip(got, want):
                    _same(a, b)
                _same(dres[1], dres[0])
