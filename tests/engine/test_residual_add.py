"""The forward's residual add: y = max(bn(x) + residual, 0) in the pass that writes y.

The torch layers' BatchNormAddReLU hands the engine a residual (in dy's slot, laid out like x)
and the engine adds it after y is rounded to its storage type, in f32, then applies the ReLU
(NaN kept, +0 elsewhere): the bits of the plain forward's y, the add and the ReLU as three
steps in that type.  Checked here against exactly that, computed in NumPy from the plain
forward, on every schedule the forward takes (forced by shape, cache model and thread count),
on both sides of the row-block and tile boundaries with outliers at each channel's first
element, its second block's first and its last (past 4096 elements a channel's sums are then
taken again around its mean), on every kernel body, in f32, f16 and bf16;
the statistics and running statistics are the plain call's bits.  Refusals: a residual of
another type, shape or layout, without the ReLU, with the two-phase formula, or overlapping y.
"""
import numpy as np
import pytest

from bnbw_native import _arrays, tuning
from bnbw_native._onednn_graph import FORWARD
from conftest import BF16, bodies, kernels

EPS = 1e-5
NO_CACHE = (1 << 10, 1 << 12, 64)           # nothing fits: split schedules, smallest groups
LARGE_CACHE = (8 << 20, 1 << 30, 2)         # everything fits: widest fused groups, slabs
DTYPES = [np.float32, np.float16] + ([BF16] if BF16 is not None else [])
DTYPE_IDS = [np.dtype(d).name for d in DTYPES]
# (shape, data_format, block): channel-last rows on both sides of a 1024-row block and one
# block of 4100 channels (slabs on both sides of TILE); channel-major rows of 64 (sweeps), rows
# cut by 32768-element blocks, rows crossing a 2048-element tile, short rows (runs of
# channels).  block: a channel's elements per row block (rows for NXC), where the outliers of
# _problem go (past the channel's end: one block)
CASES = [((5 * 1024 - 1, 4), "NXC", 1024), ((5 * 1024 + 1, 4), "NXC", 1024),
         ((3, 4100), "NXC", 3), ((9, 11, 13, 40), "NXC", 3276), ((513, 3, 64), "NCX", 32768),
         ((1, 3, 32769), "NCX", 32768), ((17, 3, 2049), "NCX", 15 * 2049),
         ((16, 48, 9, 9), "NCX", 32768)]
SCHEDULES = {"last-split", "last-slab", "major-sweep", "major-blocks", "major-sweep-fused",
             "major-channel-fused"}


@pytest.fixture(autouse=True)
def restore_cache_model():
    before = tuning.cache_model()
    yield
    tuning.set_cache_model(*before)


def _channels(shape, data_format):
    return shape[-1] if data_format == "NXC" else shape[1]


def _problem(rng, shape, data_format, dtype, block=None):
    """x ~ N(3, 2) - with `block`, each channel's first element, the first of its second row
    block (when it has one) and its last element at 3 + 5000, outliers that make the forward
    sum again in channels of more than 4096 elements -, a residual ~ N(0, 1) and the four statistics of length C."""
    C = _channels(shape, data_format)
    x32 = (rng.standard_normal(shape) * 2 + 3).astype(np.float32)
    if block is not None:
        for c in range(C):
            values = x32[..., c] if data_format == "NXC" else x32[:, c]     # a view
            for pos in (0, block, values.size - 1):
                if pos < values.size:
                    values[np.unravel_index(pos, values.shape)] = 5003.0
    x = x32.astype(dtype)
    residual = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    stats = (rng.standard_normal(C).astype(np.float32), (rng.random(C) + 0.5).astype(np.float32),
             rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32))
    return x, residual, stats


def _forward(x, stats, data_format, threads, residual=None, out=None):
    """(y, running mean, running variance, batch mean, batch variance); with the ReLU and the
    residual when one is given."""
    return _arrays.forward(FORWARD, x, *stats, EPS, 0.1, data_format, residual is not None,
                           out, threads, torch_running=True, residual=residual)


def _added(y, residual):
    """y + residual in f32, rounded to y's type, then max(., +0) keeping NaN."""
    s = (y.astype(np.float32) + residual.astype(np.float32)).astype(y.dtype)
    keep = (s.astype(np.float32) > 0) | np.isnan(s.astype(np.float32))
    return np.where(keep, s, np.zeros((), y.dtype))


def _same(got, want):
    """Bit for bit, NaN for NaN (a NaN's payload is the conversion's own)."""
    g, w = got.astype(np.float32), want.astype(np.float32)
    assert np.array_equal(np.isnan(g), np.isnan(w))
    ok = ~np.isnan(w)
    assert np.array_equal(np.ascontiguousarray(got).view(np.uint8).reshape(got.shape + (-1,))[ok],
                          np.ascontiguousarray(want).view(np.uint8).reshape(want.shape + (-1,))[ok])


def _schedule(x, data_format, threads):
    return tuning.describe(x, data_format, formula="forward", num_threads=threads)["schedule"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape, data_format, block", CASES, ids=str)
def test_the_fused_add_is_bn_then_add_then_relu_on_every_schedule_and_body(rng, dtype, shape,
                                                                           data_format, block):
    x, residual, stats = _problem(rng, shape, data_format, dtype, block)
    plain = _forward(x, stats, data_format, 1)
    want = _added(plain[0], residual)
    assert (want.astype(np.float32) == 0).any() and (want.astype(np.float32) > 0).any()
    for model in (NO_CACHE, LARGE_CACHE):
        tuning.set_cache_model(*model)
        for body in bodies():
            with kernels(body):
                for threads in (1, 2, 3, 7):
                    got = _forward(x, stats, data_format, threads, residual)
                    _same(got[0], want)
                    for a, b in zip(got[1:], plain[1:]):       # the statistics: the plain bits
                        assert a.tobytes() == b.tobytes(), (model, body, threads)


def test_the_cases_reach_every_schedule_the_forward_has():
    seen = set()
    for shape, data_format, _ in CASES:
        x = np.zeros(shape, np.float32)
        for model in (NO_CACHE, LARGE_CACHE):
            tuning.set_cache_model(*model)
            for threads in (1, 2, 3, 7):
                seen.add(_schedule(x, data_format, threads))
    assert seen == SCHEDULES


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_special_values_of_either_side(rng, dtype):
    # NaN and inf in the residual, where bn(x) + residual cancels, ties at 0
    x, residual, stats = _problem(rng, (6, 40, 5, 5), "NCX", dtype)
    plain = _forward(x, stats, "NCX", 1)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32).astype(dtype)
    flat = residual.reshape(-1)
    flat[:5 * 40] = np.tile(specials, 40)
    flat[-300:] = -plain[0].reshape(-1)[-300:]          # exact cancellation: +0
    got = _forward(x, stats, "NCX", 2, residual)
    _same(got[0], _added(plain[0], residual))
    y = got[0].astype(np.float32).reshape(-1)
    assert np.isnan(y[0]) and np.isinf(y[1]) and y[2] == 0 and not np.signbit(y[2])
    assert np.all(y[-300:] == 0) and not np.signbit(y[-300:]).any()


def test_a_strided_x_with_a_residual_of_its_strides():
    # neither is dense: the residual is read in x's visiting order, as x is
    rng = np.random.default_rng(5)
    base = rng.standard_normal((7, 9, 12)).astype(np.float32)
    x = base[:, 1:8, ::2]
    residual = rng.standard_normal((7, 9, 12)).astype(np.float32)[:, 1:8, ::2]
    C = 7
    stats = (np.zeros(C, np.float32), np.ones(C, np.float32), np.ones(C, np.float32),
             np.zeros(C, np.float32))
    plain = _forward(x, stats, "NCX", 1)
    _same(_forward(x, stats, "NCX", 3, residual)[0], _added(plain[0], residual))


def _refused(x, stats, residual, exc, match, relu=True, formula=_arrays.FORWARD, out=None):
    with pytest.raises(exc, match=match):
        _arrays.forward(FORWARD, x, *stats, EPS, 0.1, "NCX", relu, out, 1,
                        formula=formula, torch_running=True, residual=residual)


def test_refusals_name_the_residual_and_leave_the_outputs():
    rng = np.random.default_rng(7)
    x, residual, stats = _problem(rng, (4, 3, 5), "NCX", np.float32)
    C = 3
    out = (np.full_like(x, 7.0),) + tuple(np.full(C, 7.0, np.float32) for _ in range(4))
    _refused(x, stats, residual.astype(np.float16), TypeError, "residual must have the dtype",
             out=out)
    _refused(x, stats, residual[:, :, :4], ValueError, "residual must have the shape", out=out)
    _refused(x, stats, np.asfortranarray(residual), ValueError,
             "residual must be laid out like src", out=out)
    _refused(x, stats, residual, ValueError, "needs relu=True", relu=False, out=out)
    _refused(x, stats, residual, ValueError, "needs relu=True",
             formula=_arrays.FORWARD_APPLY, out=out)
    y = np.empty_like(x)
    _refused(x, stats, y, ValueError, "overlaps the input residual",
             out=(y,) + tuple(np.empty(C, np.float32) for _ in range(4)))
    for o in out:
        assert np.all(o == 7.0)
