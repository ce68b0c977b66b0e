"""The training forward, oneDNN Graph's BatchNormForwardTraining (contract section 9):
`bnbw_native.batchnorm_training_forward` against the float64 reference
(`bnbw_native.reference.batchnorm_training_forward`), its accuracy bounds, determinism,
special inputs, in-place outputs and refusals."""
import numpy as np
import pytest

import bnbw_native as bn
from bnbw_native import reference, tuning
from conftest import BF16, bodies, kernels, make_layout, requires_bf16

EPS = 1e-5
ARITH = 2.0 ** -20          # the contract's bound on dst, relative to |gamma r (x - mu)| + |beta|

STORAGE = [np.float32, np.float16] + ([BF16] if BF16 is not None else [])
STORAGE_IDS = [np.dtype(d).name for d in STORAGE]


def channel_axis(ndim, data_format):
    return 1 if data_format == "NCX" else ndim - 1


def problem(rng, shape, data_format, dtype, stat_dtype=np.float32, spread=1.0, offset=2.0):
    """x per channel ~ N(offset_c, spread * s_c) rounded to dtype, and previous running
    statistics, gamma and beta in stat_dtype."""
    axis = channel_axis(len(shape), data_format)
    C = shape[axis]
    bshape = [1] * len(shape)
    bshape[axis] = C
    centre = (offset * rng.standard_normal(C)).reshape(bshape)
    scale = (spread * (0.5 + rng.random(C))).reshape(bshape)
    x = (centre + scale * rng.standard_normal(shape)).astype(dtype)
    stats = [rng.standard_normal(C), 0.5 + rng.random(C), rng.standard_normal(C),
             rng.standard_normal(C)]
    return x, [s.astype(stat_dtype) for s in stats]


def ulp(values, dtype):
    """The spacing of `dtype` at |values| (its smallest normal spacing at 0)."""
    v = np.abs(np.asarray(values, np.float64)).astype(dtype)
    return np.spacing(v).astype(np.float64)


def check_statistics(got, want, stat_dtype):
    """Each statistic within one ulp of stat_dtype of the float64 value."""
    for name, g, w in zip(("running_mean", "running_variance", "batch_mean", "batch_variance"),
                          got, want):
        assert g.dtype == np.dtype(stat_dtype), name
        err = np.abs(g.astype(np.float64) - w)
        bad = ~(err <= ulp(w, stat_dtype))
        assert not bad.any(), (name, g[bad][:4], w[bad][:4])


def check_dst(dst, x, stats, want_dst, batch_mean, batch_var, axis, relu):
    """|dst - dst64| <= 2^-20 (|gamma r (x - mu)| + |beta|), plus the one rounding of a 16-bit
    dst; with the ReLU, the bound of the value it was taken of."""
    shape = [1] * x.ndim
    shape[axis] = -1
    gamma, beta = (np.asarray(s, np.float64).reshape(shape) for s in stats[2:])
    r = 1 / np.sqrt(batch_var.reshape(shape) + float(np.float32(EPS)))
    terms = np.abs(gamma * r * (x.astype(np.float64) - batch_mean.reshape(shape))) + np.abs(beta)
    bound = ARITH * terms
    if dst.dtype != np.float32:
        bound = bound + ulp(np.abs(want_dst) + bound, dst.dtype) / 2
    err = np.abs(dst.astype(np.float64) - want_dst)
    bad = ~(err <= bound)
    assert not bad.any(), (dst[bad][:4], want_dst[bad][:4], bound[bad][:4])
    if relu:
        assert not (dst.astype(np.float64) < 0).any() and not np.signbit(dst[dst == 0]).any()


def run_and_reference(x, stats, data_format, relu=False, momentum=0.9, **kw):
    got = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, momentum=momentum,
                                        data_format=data_format, fuse_relu=relu, **kw)
    want = reference.batchnorm_training_forward(x, *stats, epsilon=EPS, momentum=momentum,
                                                data_format=data_format, fuse_relu=relu)
    return got, want


# ---------------------------------------------------------------------------- accuracy

SHAPES = [((8, 5, 7, 16), "NXC"), ((8, 16, 5, 7), "NCX"), ((3, 33), "NXC"), ((3, 33), "NCX"),
          ((2, 7, 3, 5, 19), "NCX"), ((4, 6, 3, 5, 20), "NXC"), ((64, 24, 9, 9), "NCX"),
          ((1, 3, 70000), "NCX"), ((257, 3, 130), "NXC")]


@pytest.mark.parametrize("dtype", STORAGE, ids=STORAGE_IDS)
@pytest.mark.parametrize("shape, data_format", SHAPES, ids=str)
@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu"])
def test_matches_the_float64_reference(rng, dtype, shape, data_format, relu):
    x, stats = problem(rng, shape, data_format, dtype)
    got, want = run_and_reference(x, stats, data_format, relu=relu)
    assert got.dst.dtype == x.dtype and got.dst.shape == x.shape
    check_statistics(got[1:], want[1:], np.float32)
    check_dst(got.dst, x, stats, want[0], want[3], want[4], channel_axis(x.ndim, data_format),
              relu)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "negative"])
@pytest.mark.parametrize("data_format", ["NCX", "NXC"])
def test_any_strides_give_the_contiguous_values(rng, layout, data_format):
    shape = (6, 9, 5, 11) if data_format == "NCX" else (6, 5, 11, 9)
    x, stats = problem(rng, shape, data_format, np.float32)
    strided = make_layout(x, layout)
    got, want = run_and_reference(strided, stats, data_format)
    check_statistics(got[1:], want[1:], np.float32)
    check_dst(got.dst, x, stats, want[0], want[3], want[4], channel_axis(4, data_format), False)
    assert got.dst.strides == np.empty_like(strided).strides       # src's memory order


@requires_bf16
def test_bfloat16_statistics(rng):
    x, stats = problem(rng, (16, 12, 6, 6), "NCX", BF16, stat_dtype=BF16)
    got, want = run_and_reference(x, stats, "NCX")
    check_statistics(got[1:], want[1:], BF16)


@pytest.mark.parametrize("dtype", STORAGE, ids=STORAGE_IDS)
def test_gamma_and_beta_absent_mean_one_and_zero(rng, dtype):
    x, (mean, var, gamma, beta) = problem(rng, (5, 8, 4, 4), "NCX", dtype)
    ones, zeros = np.ones_like(gamma), np.zeros_like(beta)
    for g, b, g1, b1 in ((None, beta, ones, beta), (gamma, None, gamma, zeros),
                         (None, None, ones, zeros)):
        a = bn.batchnorm_training_forward(x, mean, var, g, b, epsilon=EPS, data_format="NCX")
        e = bn.batchnorm_training_forward(x, mean, var, g1, b1, epsilon=EPS, data_format="NCX")
        for u, v in zip(a, e):
            assert np.array_equal(u.view(np.uint8), v.view(np.uint8))


@pytest.mark.parametrize("data_format", ["NCX", "NXC"])
def test_two_to_the_24_elements_around_a_large_mean(data_format):
    """One channel of M = 2^24, mean 1000, std 1: the batch statistics to the f32 rounding
    (2^-23 relative), where f32 accumulators lose three to four digits; dst within its bound."""
    rng = np.random.default_rng(24)
    M = 1 << 24
    x = (1000 + rng.standard_normal(M)).astype(np.float32)
    x = x.reshape(1 << 12, 1 << 12, 1) if data_format == "NXC" else x.reshape(1 << 12, 1, 1 << 12)
    stats = [np.zeros(1, np.float32), np.ones(1, np.float32), np.ones(1, np.float32),
             np.zeros(1, np.float32)]
    got = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, data_format=data_format)
    x64 = x.astype(np.float64).ravel()
    mu = x64.mean()
    var = np.mean((x64 - mu) ** 2)
    assert abs(float(got.batch_mean[0]) - mu) <= 2.0 ** -23 * mu
    assert abs(float(got.batch_variance[0]) - var) <= 2.0 ** -23 * var
    r = 1 / np.sqrt(var + float(np.float32(EPS)))
    want = r * (x64 - mu)
    err = np.abs(got.dst.astype(np.float64).ravel() - want)
    assert (err <= ARITH * np.abs(want) + 2.0 ** -30).all()
    assert err.max() < 1e-6            # f32 accumulators would be off by ~1e-3 of the std


def test_mean_far_from_the_first_element_is_taken_again(rng):
    """The sums start around each channel's first element; where it lies far from the mean
    (an outlier), they are taken again around the mean: still within one ulp, with the same
    bits on every schedule and thread count."""
    x = rng.standard_normal((4, 3, 64, 64)).astype(np.float32)
    x[0, :, 0, 0] = (1e6, -3e5, 7.0)             # first elements: two outliers, one not
    stats = [np.zeros(3, np.float32), np.ones(3, np.float32), np.ones(3, np.float32),
             np.zeros(3, np.float32)]
    got, want = run_and_reference(x, stats, "NCX")
    check_statistics(got[1:], want[1:], np.float32)
    check_dst(got.dst, x, stats, want[0], want[3], want[4], 1, False)
    for threads in (1, 2, 3, 8):
        again = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, momentum=0.9,
                                              data_format="NCX", num_threads=threads)
        assert all(np.array_equal(a, b) for a, b in zip(got, again))


# ---------------------------------------------------------------------------- determinism

def bits(result):
    return [np.ascontiguousarray(r).view(np.uint8).tobytes() for r in result]


@pytest.mark.parametrize("dtype", STORAGE, ids=STORAGE_IDS)
@pytest.mark.parametrize("shape, data_format", [((32, 20, 14, 14), "NCX"),
                                                ((32, 14, 14, 40), "NXC"),
                                                ((2, 6, 40000), "NCX"),
                                                ((3, 40, 7, 7), "NCX")], ids=str)
def test_the_same_bits_on_every_thread_count_schedule_and_body(rng, dtype, shape, data_format):
    x, stats = problem(rng, shape, data_format, dtype)
    want = bits(bn.batchnorm_training_forward(x, *stats, epsilon=EPS, data_format=data_format,
                                              fuse_relu=True, num_threads=1))
    before = tuning.cache_model()
    try:
        for model in [(1 << 12, 1 << 14, 1), before, (1 << 30, 1 << 30, 1)]:
            tuning.set_cache_model(*model)
            for body in bodies():
                with kernels(body):
                    for threads in (1, 2, 3, 7):
                        got = bn.batchnorm_training_forward(x, *stats, epsilon=EPS,
                                                            data_format=data_format,
                                                            fuse_relu=True, num_threads=threads)
                        assert bits(got) == want, (model, body, threads)
    finally:
        tuning.set_cache_model(*before)


@pytest.mark.parametrize("dtype", STORAGE, ids=STORAGE_IDS)
def test_the_relu_is_the_relu_of_the_plain_dst(rng, dtype):
    x, stats = problem(rng, (9, 12, 8, 8), "NCX", dtype, offset=0.1)
    plain = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, data_format="NCX")
    fused = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, data_format="NCX",
                                          fuse_relu=True)
    d = plain.dst.astype(np.float64)
    relu = np.where(d > 0, plain.dst, np.zeros((), dtype))
    assert np.array_equal(fused.dst.view(np.uint8), np.asarray(relu, dtype).view(np.uint8))
    assert (d <= 0).any() and (d > 0).any()
    assert bits(fused[1:]) == bits(plain[1:])


def test_each_channel_depends_on_its_own_inputs_only(rng):
    x, stats = problem(rng, (6, 5, 9, 9), "NCX", np.float32)
    a = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, data_format="NCX")
    y = x.copy()
    y[:, 2] = 7 * y[:, 2] - 3
    b = bn.batchnorm_training_forward(y, *stats, epsilon=EPS, data_format="NCX")
    keep = [0, 1, 3, 4]
    assert np.array_equal(a.dst[:, keep], b.dst[:, keep])
    for u, v in zip(a[1:], b[1:]):
        assert np.array_equal(u[keep], v[keep]) and not np.array_equal(u[2], v[2])


# ---------------------------------------------------------------------------- special inputs

def test_nan_and_inf_stay_in_their_channel(rng):
    x, stats = problem(rng, (4, 4, 5, 5), "NCX", np.float32)
    x[1, 0, 2, 2] = np.nan
    x[0, 1, 0, 0] = np.inf             # the first element: the sums start around 0 instead
    x[2, 2, 1, 1] = -np.inf
    got, want = run_and_reference(x, stats, "NCX")
    for g, w in zip(got, want):
        g = g.astype(np.float64)
        assert np.array_equal(np.isnan(g), np.isnan(w))
        ok = ~np.isnan(w)
        assert np.array_equal(np.isinf(g[ok]), np.isinf(w[ok]))
    assert np.isnan(got.batch_mean[0]) and got.batch_mean[1] == np.inf
    assert np.isfinite(got.dst[:, 3]).all()
    check_statistics([s[3:] for s in got[1:]], [s[3:] for s in want[1:]], np.float32)


def test_the_fused_relu_keeps_nan(rng):
    x, stats = problem(rng, (3, 2, 4, 4), "NCX", np.float32)
    x[0, 1, 0, 1] = np.nan
    got = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, data_format="NCX",
                                        fuse_relu=True)
    assert np.isnan(got.dst[:, 1]).all() and not np.isnan(got.dst[:, 0]).any()


@pytest.mark.parametrize("dtype", STORAGE, ids=STORAGE_IDS)
def test_one_element_per_channel(rng, dtype):
    """M = 1: variance 0 and dst = beta exactly."""
    x, stats = problem(rng, (1, 6), "NXC", dtype)
    got = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, momentum=0.25)
    assert (got.batch_variance == 0).all()
    assert np.array_equal(got.batch_mean, x[0].astype(np.float32))
    assert np.array_equal(got.dst[0], stats[3].astype(dtype))


@pytest.mark.parametrize("dtype", STORAGE, ids=STORAGE_IDS)
@pytest.mark.parametrize("x_value, M, gamma, eps", [
    (3.0, 4, 1e37, 1e-5),       # gamma * r = 3.2e39: past float32, every x the mean
    (-2.5, 1, 1e17, 1e-44),     # M = 1 with r = 1e22
    (0.0, 7, -3e38, 1e-45),     # a negative gamma, the smallest epsilon
], ids=["constant", "one", "negative-gamma"])
def test_a_channel_of_one_value_gives_beta_even_where_gamma_r_overflows(dtype, x_value, M,
                                                                           gamma, eps):
    """Contract §10: var = 0 (every element the mean) gives dst = beta exactly; gamma * r
    rounding to inf in float32 made it inf * 0 = NaN."""
    x = np.full((M, 3), x_value, np.float32).astype(dtype)
    stats = (np.zeros(3, np.float32), np.ones(3, np.float32),
             np.array([gamma, 1.0, gamma], np.float32), np.array([0.5, -1.5, 0.0], np.float32))
    got = bn.batchnorm_training_forward(x, *stats, epsilon=eps)
    assert (got.batch_variance == 0).all()
    want = np.broadcast_to(stats[3].astype(dtype), x.shape)
    np.testing.assert_array_equal(got.dst.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


def test_gamma_r_past_float32_with_spread_is_not_finite_and_an_inf_gamma_is_ieee():
    """Contract §10: where gamma * r exceeds float32 and the channel's elements differ, dst is
    not finite there (its k cannot be represented); an infinite gamma follows IEEE: inf * 0 is
    NaN even at the mean."""
    x = np.array([[1.0, 3.0], [1.0, 3.0], [2.0, 3.0], [2.0, 3.0]], np.float32)
    gamma = np.array([3e38, np.inf], np.float32)      # r = 2: gamma * r = 6e38
    got = bn.batchnorm_training_forward(x, np.zeros(2, np.float32), np.ones(2, np.float32),
                                        gamma, None, epsilon=1e-45)
    assert not np.isfinite(got.dst[:, 0]).any()
    assert np.isnan(got.dst[:, 1]).all()


def test_momentum_one_keeps_old_statistics_only_for_finite_batches(rng):
    """Contract §10: momentum 1 gives the old running statistics bit for bit when the batch
    statistics are finite; a channel whose batch holds NaN or inf follows IEEE arithmetic
    (1 * old + 0 * NaN is NaN), as PyTorch's momentum 0 does."""
    x, stats = problem(rng, (6, 4, 5), "NCX", np.float32)
    x[2, 1, 3] = np.nan
    x[4, 2, 0] = np.inf
    got = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, momentum=1.0,
                                        data_format="NCX")
    for running, old in ((got.running_mean, stats[0]), (got.running_variance, stats[1])):
        assert np.isnan(running[1]) and np.isnan(running[2])
        assert np.array_equal(running[[0, 3]].view(np.uint32), old[[0, 3]].view(np.uint32))


def test_an_empty_batch_leaves_the_running_statistics(rng):
    x = np.empty((0, 5, 3), np.float32)
    stats = [s.astype(np.float32) for s in (rng.standard_normal(5), rng.random(5),
                                            rng.standard_normal(5), rng.standard_normal(5))]
    stats[0][1] = np.nan
    got = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, data_format="NCX")
    assert got.dst.shape == (0, 5, 3)
    assert (got.batch_mean == 0).all() and (got.batch_variance == 0).all()
    assert np.array_equal(got.running_mean.view(np.uint32), stats[0].view(np.uint32))
    assert np.array_equal(got.running_variance, stats[1])


@pytest.mark.parametrize("stat_dtype", [np.float32] + ([BF16] if BF16 is not None else []),
                         ids=lambda d: np.dtype(d).name)
def test_momentum_zero_and_one_give_batch_and_old_statistics_exactly(rng, stat_dtype):
    dtype = np.float32 if stat_dtype == np.float32 else BF16
    x, stats = problem(rng, (7, 10, 6), "NCX", dtype, stat_dtype=stat_dtype)
    zero = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, momentum=0.0,
                                         data_format="NCX")
    assert bits(zero[1:3]) == bits(zero[3:5])
    one = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, momentum=1.0,
                                        data_format="NCX")
    assert bits(one[1:3]) == bits(stats[:2])


def test_the_default_momentum_is_one_half(rng):
    x, stats = problem(rng, (5, 6, 7), "NCX", np.float32)
    a = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, data_format="NCX")
    b = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, momentum=0.5, data_format="NCX")
    assert bits(a) == bits(b)
    old, batch = stats[0].astype(np.float64), a.batch_mean.astype(np.float64)
    want = 0.5 * old + 0.5 * batch          # batch_mean is rounded: allow its half ulp too
    assert (np.abs(a.running_mean - want) <= 2.0 ** -23 * (0.5 * np.abs(old) + np.abs(batch))).all()


# ---------------------------------------------------------------------------- outputs

def test_outputs_in_place_give_the_same_bits(rng):
    x, (mean, var, gamma, beta) = problem(rng, (6, 8, 5, 5), "NCX", np.float32)
    want = bn.batchnorm_training_forward(x, mean, var, gamma, beta, epsilon=EPS,
                                         data_format="NCX")
    src, m, v = x.copy(), mean.copy(), var.copy()
    bm, bv = np.empty_like(mean), np.empty_like(var)
    got = bn.batchnorm_training_forward(src, m, v, gamma, beta, epsilon=EPS, data_format="NCX",
                                        out=(src, m, v, bm, bv))
    assert got.dst is src and got.running_mean is m and got.running_variance is v
    assert bits(got) == bits(want)


def test_preallocated_outputs_of_any_strides(rng):
    x, stats = problem(rng, (6, 8, 5, 5), "NCX", np.float32)
    want = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, data_format="NCX")
    dst = np.full((6, 5, 5, 8), np.nan, np.float32).transpose(0, 3, 1, 2)
    stat_out = [np.full(16, np.nan, np.float32)[::2] for _ in range(4)]
    got = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, data_format="NCX",
                                        out=[dst, *stat_out])
    assert got.dst is dst
    assert bits(got) == bits(want)


def test_works_with_the_backward(rng):
    """batch_mean and batch_variance are what the backward takes; with the ReLU, dst is its
    relu_dst."""
    x, (mean, var, gamma, beta) = problem(rng, (8, 6, 5, 5), "NCX", np.float32, offset=0.1)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    f = bn.batchnorm_training_forward(x, mean, var, gamma, beta, epsilon=EPS, data_format="NCX",
                                      fuse_relu=True)
    fused = bn.batchnorm_training_backward(x, dy, f.batch_mean, f.batch_variance, gamma,
                                           epsilon=EPS, data_format="NCX", relu_dst=f.dst)
    masked = np.where(f.dst > 0, dy, np.float32(0))
    plain = bn.batchnorm_training_backward(x, masked, f.batch_mean, f.batch_variance, gamma,
                                           epsilon=EPS, data_format="NCX")
    assert bits(fused) == bits(plain)



# ---------------------------------------------------------------------------- DirectML descriptors

def _training_operator(sizes, strides, C, **kw):
    from bnbw_native import dml
    big = dml.TensorDesc("float32", sizes, strides=strides)
    stat = dml.TensorDesc("float32", (1, C) + (1,) * (len(sizes) - 2))
    members = dict(input=big, mean=stat, variance=stat, output=big, output_running_mean=stat,
                   output_running_variance=stat, output_batch_mean=stat,
                   output_batch_variance=stat)
    members.update(kw.pop("members", {}))
    return dml.BatchNormalizationTraining(**members, epsilon=EPS, **kw)


@pytest.mark.parametrize("affine", [True, False])
def test_the_descriptor_operator_runs_the_same_forward(rng, affine):
    """dml.BatchNormalizationTraining (the C API's training operator) on NCHW sizes over NHWC
    memory gives the bits of the array front-end."""
    from bnbw_native import dml
    N, C, H, W = 4, 6, 5, 7
    x, (mean, var, gamma, beta) = problem(rng, (N, H, W, C), "NXC", np.float32)
    extra = {}
    if affine:
        stat = dml.TensorDesc("float32", (1, C, 1, 1))
        extra = dict(members=dict(scale=stat, bias=stat))
    op = _training_operator((N, C, H, W), (H * W * C, 1, W * C, C), C, momentum=0.8,
                            fuse_relu=True, **extra)
    assert op.plan_kind == "channel-last" and op.count == N * H * W
    assert op.momentum == float(np.float32(0.8)) and op.fuse_relu
    out = [np.empty_like(x)] + [np.empty(C, np.float32) for _ in range(4)]
    op.execute(input=x, mean=mean, variance=var, scale=gamma if affine else None,
               bias=beta if affine else None, output=out[0], output_running_mean=out[1],
               output_running_variance=out[2], output_batch_mean=out[3],
               output_batch_variance=out[4])
    want = bn.batchnorm_training_forward(x, mean, var, gamma if affine else None,
                                         beta if affine else None, epsilon=EPS, momentum=0.8,
                                         fuse_relu=True)
    assert bits(out) == bits(want)


# ------------------------------------------------ per-channel statistics, plain or strided

def strided(values):
    """values in every other element of a larger buffer (the per-channel loops' slow path)."""
    wide = np.full(2 * values.size, np.nan, values.dtype)
    wide[::2] = values
    return wide[::2]


@pytest.mark.parametrize("C", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("data_format", ["NCX", "NXC"])
def test_statistics_of_any_strides_and_in_place_give_the_plain_bits(rng, C, data_format):
    """The per-channel loops read and write plain float32 statistics as arrays, others one
    channel at a time, in runs of 64 channels: both sides of each run boundary, both ways,
    the running statistics written over the old ones (in place) or not, forward and backward
    give the same bits."""
    shape = (3, C, 4) if data_format == "NCX" else (3, 4, C)
    x, stats = problem(rng, shape, data_format, np.float32)
    want = bn.batchnorm_training_forward(x, *stats, epsilon=EPS, data_format=data_format)
    got = bn.batchnorm_training_forward(x, *map(strided, stats), epsilon=EPS,
                                        data_format=data_format)
    assert bits(got) == bits(want)
    mean, var = stats[0].copy(), stats[1].copy()
    got = bn.batchnorm_training_forward(x, mean, var, *stats[2:], epsilon=EPS,
                                        data_format=data_format,
                                        out=(np.empty_like(x), mean, var, np.empty_like(mean),
                                             np.empty_like(var)))
    assert got.running_mean is mean and bits(got) == bits(want)
    mean, var = strided(stats[0]), strided(stats[1])
    got = bn.batchnorm_training_forward(x, mean, var, *stats[2:], epsilon=EPS,
                                        data_format=data_format,
                                        out=(np.empty_like(x), mean, var, strided(stats[2]),
                                             strided(stats[3])))
    assert got.running_mean is mean and bits(got) == bits(want)

    dy = rng.standard_normal(shape).astype(np.float32)
    bstats = (want.batch_mean, want.batch_variance, stats[2])
    want_b = bn.batchnorm_training_backward(x, dy, *bstats, epsilon=EPS,
                                            data_format=data_format)
    out = (np.empty_like(x), strided(np.zeros(C, np.float32)),
           strided(np.zeros(C, np.float32)))
    got_b = bn.batchnorm_training_backward(x, dy, *map(strided, bstats), epsilon=EPS,
                                           data_format=data_format, out=out)
    assert bits(got_b) == bits(want_b)
