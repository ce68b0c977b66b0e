"""The f32 blocks of the f16/bf16 sums (include/bnbw_kernels.h, "Blocked sums").

float16 and bfloat16 storage sums (x - mean) * dy and dy in short f32 blocks per lane before the
f64 lanes take them.  These tests pin that scheme down bit for bit with an independent NumPy
model of it, check that a block whose f32 sum overflows (or meets inf/NaN) is redone in f64 on
every kernel body, that exact_sums=True widens every term, and that the blocks keep the error
within the documented ~2^-20 of the sum of |terms|.  Accuracy at M = 2^24 with a large mean is
in test_scale_and_accuracy.py, for every storage type.
"""
import math

import numpy as np
import pytest

from bnbw_native import backward_reduce
from conftest import BF16, bodies, kernels
from error_bounds import BLOCKED_SUMS

HALVES = [np.float16] + ([BF16] if BF16 is not None else [])
LANES, RUNS, BLOCK_ROWS = 16, 16, 16    # bnbw_kernels.h: BNBW_LANES, _BLOCK_RUNS, _BLOCK_ROWS
BOUND = BLOCKED_SUMS      # a block's RUNS + 1 roundings, relative to its sum of |terms|
assert BOUND == (RUNS + 1) * 2.0 ** -24
# BNBW_BLOCKS_EVEN_ODD (bf16): the element of a run that lane l of a block sums
EVEN_ODD = np.r_[0:LANES:2, 1:LANES:2]


def _f64(a):
    return np.asarray(a, dtype=np.float64)


def _row_model(x, dy, mean):
    """One channel-major row (one kernel call): Sum dy, Sum (x - mean) * dy as the kernels take
    them - blocks of RUNS runs of LANES in f32 (bf16: lanes in EVEN_ODD order), the last block
    the whole runs left, the tail's terms in f64, lanes folded pairwise."""
    order = EVEN_ODD if BF16 is not None and x.dtype == BF16 else np.arange(LANES)
    x32, g32 = x.astype(np.float32), dy.astype(np.float32)
    d32 = x32 - np.float32(mean)
    n = x32.size
    sg, sxg = np.zeros(LANES), np.zeros(LANES)
    i = 0
    while i + LANES <= n:
        runs = min(RUNS, (n - i) // LANES)
        fg, fp = np.zeros(LANES, np.float32), np.zeros(LANES, np.float32)
        for k in range(runs):
            s = i + k * LANES + order
            fg = fg + g32[s]
            fp = fp + d32[s] * g32[s]
        assert np.all(np.isfinite(fg)) and np.all(np.isfinite(fp))   # the model's data only
        sg += fg
        sxg += fp
        i += runs * LANES
    t = n - i                                           # the tail's lanes
    sg[:t] += _f64(g32[i:])
    sxg[:t] += _f64(d32[i:]) * _f64(g32[i:])            # exact products
    width = LANES // 2
    while width:
        sg[:width] += sg[width:2 * width]
        sxg[:width] += sxg[width:2 * width]
        width //= 2
    return sg[0], sxg[0]


def _rows_model(x, dy, mean):
    """Channel-last rows (R, C) in one call: per channel, blocks of BLOCK_ROWS rows in f32,
    added in row order."""
    x32, g32 = x.astype(np.float32), dy.astype(np.float32)
    d32 = x32 - mean.astype(np.float32)
    sg, sxg = np.zeros(x.shape[1]), np.zeros(x.shape[1])
    for r in range(0, x.shape[0], BLOCK_ROWS):
        fg = np.zeros(x.shape[1], np.float32)
        fp = np.zeros(x.shape[1], np.float32)
        for j in range(r, min(r + BLOCK_ROWS, x.shape[0])):
            fg = fg + g32[j]
            fp = fp + d32[j] * g32[j]
        sg += fg
        sxg += fp
    return sg, sxg


@pytest.fixture(params=bodies())
def body(request):
    """Every kernel body the CPU runs."""
    with kernels(request.param):
        yield request.param


def _terms(rng, shape, dtype):
    """Values whose f32 block sums round: an exponent spread of 2^-12..2^12."""
    mag = np.exp2(rng.integers(-12, 13, size=shape)).astype(np.float32)
    x = (rng.standard_normal(shape).astype(np.float32) * mag + 3).astype(dtype)
    dy = (rng.standard_normal(shape).astype(np.float32) * mag[::-1]).astype(dtype)
    return x, dy


@pytest.mark.parametrize("strided", [False, True], ids=["unit", "strided"])
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("n", [256, 1000, 2047])
def test_channel_major_sums_are_the_documented_blocks(rng, body, dtype, n, strided):
    """Strided rows (every other element) must block like contiguous ones."""
    x, dy = _terms(rng, (1, 1, n), dtype)
    if strided:
        x, dy = (np.repeat(a, 2, axis=2)[..., ::2] for a in (x, dy))
    mean = np.float32([0.75])
    sums, count = backward_reduce(x, dy, mean, data_format="NCX")
    want = _row_model(x.ravel(), dy.ravel(), mean[0])
    assert count == n
    assert sums[0, 0].tobytes() == np.float64(want[0]).tobytes()
    assert sums[1, 0].tobytes() == np.float64(want[1]).tobytes()


@pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed")
@pytest.mark.parametrize("strided", [False, True], ids=["unit", "strided"])
def test_bf16_blocks_take_even_and_odd_elements(body, strided):
    """Which lane a run's element goes to only shows in the f64 fold (lane l + lane l + 8
    first), so cancel there: +2^60 and -2^60 at elements 0 and 8, and 1 at element 1.  Element
    order pairs 0 with 8 (exact, Sum = 1); even/odd order pairs 0 with 1, and 2^60 + 1 rounds
    (Sum = 0).  The kernels must give what the EVEN_ODD model gives, on every path."""
    dy = np.zeros(300, np.float32)
    dy[[0, 8, 1]] = [2.0 ** 60, -(2.0 ** 60), 1.0]
    dy = dy.astype(BF16).reshape(1, 1, -1)
    x = np.ones_like(dy)
    if strided:
        x, dy = (np.repeat(a, 2, axis=2)[..., ::2] for a in (x, dy))
    sums, _ = backward_reduce(x, dy, np.float32([0.0]), data_format="NCX")
    want = _row_model(x.ravel(), dy.ravel(), 0.0)
    assert want == (0.0, 0.0)
    assert np.array_equal(sums[:, 0], want)
    global EVEN_ODD
    keep, EVEN_ODD = EVEN_ODD, np.arange(LANES)
    try:
        assert _row_model(x.ravel(), dy.ravel(), 0.0) == (1.0, 1.0)   # the order matters here
    finally:
        EVEN_ODD = keep


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("rows, channels", [(1001, 3), (64, 40), (7, 17),
                                            (50, 200), (33, 2100)])   # rows wider than 128 B
def test_channel_last_sums_are_the_documented_blocks(rng, body, dtype, rows, channels):
    x, dy = _terms(rng, (rows, channels), dtype)
    mean = rng.standard_normal(channels).astype(np.float32)
    sums, _ = backward_reduce(x, dy, mean, data_format="NXC")
    want_g, want_xg = _rows_model(x, dy, mean)
    np.testing.assert_array_equal(sums[0].view(np.uint64), want_g.view(np.uint64))
    np.testing.assert_array_equal(sums[1].view(np.uint64), want_xg.view(np.uint64))


@pytest.mark.parametrize("data_format", ["NCX", "NXC"])
@pytest.mark.parametrize("dtype", HALVES)
def test_exact_sums_widen_every_term(rng, dtype, data_format):
    """1 + tiny in an f32 block loses the tiny terms (2^-24 for f16, 2^-30 for bf16); with
    exact_sums=True they are all there, as in float64."""
    tiny = 2.0 ** -24 if dtype == np.float16 else 2.0 ** -30
    n = 4096
    lane_step = LANES if data_format == "NCX" else 1       # alternate within each lane
    dy = np.where((np.arange(n) // lane_step) % 2 == 0, 1.0, tiny).astype(dtype)
    # channel-last needs C > 1 (one channel is a channel-major row): two equal channels
    dy = dy.reshape(1, 1, n) if data_format == "NCX" else np.repeat(dy[:, None], 2, axis=1)
    x = np.ones_like(dy)
    mean = np.zeros(dy.shape[1], np.float32)
    exact, _ = backward_reduce(x, dy, mean, data_format=data_format, exact_sums=True)
    blocked, _ = backward_reduce(x, dy, mean, data_format=data_format)
    want = math.fsum(_f64(dy).ravel() if data_format == "NCX" else _f64(dy)[:, 0])
    assert exact[0, 0] == want and exact[1, 0] == want
    assert blocked[0, 0] < want                           # the blocks did round...
    assert want - blocked[0, 0] <= BOUND * want            # ...within the documented bound


def test_exact_sums_is_a_flag():
    x = np.ones((4, 2), np.float16)
    with pytest.raises(TypeError, match="exact_sums"):
        backward_reduce(x, x, np.zeros(2, np.float32), exact_sums=1)


@pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed")
@pytest.mark.parametrize("data_format, lanes", [("NCX", 16), ("NXC", 16), ("NXC", 80)])
def test_blocks_that_overflow_f32_are_redone_in_f64(body, data_format, lanes):
    """bf16 holds f32's range: four terms of 3e38 overflow an f32 block, not an f64 lane.
    Lanes 0 and 5 (channel-major) or channels 0 and 5 (channel-last; 80 channels make rows
    wider than 128 B) overflow; the others stay in f32 blocks; every sum must be the exact
    finite one."""
    big = float(np.float32(BF16.type(3e38)))
    n = 2 * RUNS * LANES if data_format == "NCX" else 2 * BLOCK_ROWS * lanes   # two blocks
    if data_format == "NCX":
        dy = np.full(n, 0.5, np.float32)
        for lane in (0, 5):                  # +big, +big, -big, -big into one lane's block
            dy[[lane, lane + 16, lane + 32, lane + 48]] = [big, big, -big, -big]
            dy[lane + RUNS * LANES + 16 * np.arange(8)] = big   # a block that does not cancel
        shape, mean = (1, 1, n), np.float32([0.0])
    else:
        dy = np.full((n // lanes, lanes), 0.5, np.float32)
        for ch in (0, 5):
            dy[0:4, ch] = [big, big, -big, -big]
            dy[BLOCK_ROWS:BLOCK_ROWS + 2, ch] = [big, -big]     # cancels in f32: stays blocked
        shape, mean = dy.shape, np.zeros(lanes, np.float32)
    x = np.ones(shape, BF16)
    g = dy.reshape(shape).astype(BF16)
    sums, _ = backward_reduce(x, g, mean, data_format=data_format)
    want = np.array([math.fsum(v) for v in np.moveaxis(_f64(g), 1, 0).reshape(shape[1], -1)])
    assert np.all(np.isfinite(want))
    np.testing.assert_array_equal(sums[0], want)
    np.testing.assert_array_equal(sums[1], want)          # x - mean = 1


@pytest.mark.parametrize("data_format", ["NCX", "NXC"])
@pytest.mark.parametrize("dtype", HALVES)
def test_blocked_error_within_documented_bound(rng, dtype, data_format):
    """Sum (x - mean) * dy and Sum dy within BOUND of the sum of |terms| (17 f32 roundings of a
    block, 2^-24 each, plus f64's) on data whose blocks do round."""
    shape = (8, 5, 3000) if data_format == "NCX" else (24000, 5)
    x, dy = _terms(rng, shape, dtype)
    mean = rng.standard_normal(5).astype(np.float32)
    sums, _ = backward_reduce(x, dy, mean, data_format=data_format)
    axes = (0, 2) if data_format == "NCX" else (0,)
    m = mean.reshape((1, 5, 1) if data_format == "NCX" else (1, 5))
    d = _f64(x.astype(np.float32) - m)                  # x - mean as the kernels round it
    terms = (d * _f64(dy), _f64(dy))
    for got, t in zip(sums[::-1], terms):
        want = np.array([math.fsum(v) for v in np.moveaxis(t, 1, 0).reshape(5, -1)])
        scale = np.abs(t).sum(axis=axes)
        assert np.all(np.abs(got - want) <= BOUND * scale)
