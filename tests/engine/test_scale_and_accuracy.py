"""Scale, accuracy and special values (contract 1, 7): 64-bit offsets, counts past 2^31, NaN and
inf kept in their channel, constant channels, and the parameter gradients' sums accurate for
2^24 elements with |mean| >> std in every storage type.

Tensors of more than 2^31 logical elements are built from small arrays with zero strides
(np.broadcast_to), so they cost no memory as inputs; their exact sums follow from the small
array (every value is repeated the same number of times), and with integer-valued data the
float64 sums are exact, so the check is bit for bit.  Those runs take tens of seconds and are
marked slow.  The default run checks 64-bit byte offsets cheaply, with views whose strides span
gigabytes of a lazily zeroed (never touched) buffer.
"""

import functools

import numpy as np
import pytest

import bnbw_native
from bnbw_native import dml, ngraph, intel_spec, reference
from error_bounds import BF16, F16, F32, assert_close, assert_within, expected, same_bits

EPS = 1e-3
GiB = 2 ** 30


def sparse(nbytes):
    """A zero-filled buffer whose pages exist only once written (calloc / mmap)."""
    return np.zeros(nbytes, np.uint8)


def view(buf, dtype, shape, offset, strides):
    return np.ndarray(shape, dtype, buf, offset=offset, strides=strides)


# ---- 64-bit offsets and counts, cheap -------------------------------------------------------

def test_byte_offsets_beyond_4_gib():
    """x, dy and dx spread over gigabytes (strides > 2^31 bytes, offsets > 2^32, a negative
    stride too): every element where it should be."""
    rng = np.random.default_rng(0)
    shape = (3, 2, 5)                                   # NCX, C = 2, M = 15
    a, b = sparse(8 * GiB), sparse(8 * GiB)
    strides = (2 * GiB + 4096, GiB + 512, 12)
    x = view(a, F32, shape, GiB, strides)
    dy = view(a, F32, shape, GiB + 64, strides)
    dx = view(b, F32, shape, 5 * GiB, (-(2 * GiB + 8192), GiB + 64, 4))
    assert max(abs(s) for s in dx.strides) > 2 ** 31
    x[...] = rng.normal(3, 2, shape)
    dy[...] = rng.normal(0, 1, shape)
    mean = np.array([3.0, 2.5], F32)
    var = np.array([4.0, 3.0], F32)
    gamma = np.array([1.5, -0.5], F32)
    out = (dx, np.empty(2, F32), np.empty(2, F32))
    result = bnbw_native.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS,
                                                     data_format="NCX", out=out)
    assert result.diff_src is dx
    k = (1, 2, 1)
    ref, bounds = expected(np.array(x), np.array(dy), mean.reshape(k), var.reshape(k),
                           gamma.reshape(k), epsilon=EPS, axes=(0, 2), formula="training")
    assert_within(dx, ref[0], bounds[0], F32, "dx")
    assert_within(out[1], ref[1].ravel(), bounds[1].ravel(), F32, "dgamma")
    assert_within(out[2], ref[2].ravel(), bounds[2].ravel(), F32, "dbeta")


def test_dml_element_strides_beyond_2_31():
    """A DirectML descriptor whose element strides exceed 2^31 (bytes beyond 2^33), bound by
    address."""
    rng = np.random.default_rng(1)
    a, b = sparse(12 * GiB), sparse(12 * GiB)
    sizes, strides = (3, 2, 4), (2 ** 31 + 16, 2 ** 29, 4)       # elements (f16: 2 bytes)
    span = sum((n - 1) * s for n, s in zip(sizes, strides)) + 1
    assert 2 * span < 12 * GiB
    x = view(a, F16, sizes, 0, tuple(2 * s for s in strides))
    dy = view(a, F16, sizes, 2, tuple(2 * s for s in strides))
    dx = view(b, F16, sizes, 0, tuple(2 * s for s in strides))
    x[...] = rng.normal(3, 1, sizes)
    dy[...] = rng.normal(0, 1, sizes)
    st = (1, 2, 1)
    mean, var, scale = (np.full(st, v, F16) for v in (3.0, 2.0, 1.25))
    big = dml.TensorDesc("float16", sizes, strides)
    small = dml.TensorDesc("float16", st)
    op = dml.BatchNormalizationTrainingGrad(
        input=big, input_gradient=big, mean=small, variance=small, scale=small,
        output_gradient=big, output_scale_gradient=small, output_bias_gradient=small,
        epsilon=EPS)
    ds, db = np.empty(st, F16), np.empty(st, F16)
    op.execute(input=x.ctypes.data, input_gradient=dy.ctypes.data, mean=mean, variance=var,
               scale=scale, output_gradient=dx.ctypes.data, output_scale_gradient=ds,
               output_bias_gradient=db)
    ref, bounds = expected(np.array(x), np.array(dy), mean, var, scale, epsilon=EPS,
                           axes=(0, 2), formula="training")
    for got, r, bd, what in zip((dx, ds, db), ref, bounds, ("dx", "dscale", "dbias")):
        assert_within(got, r, bd, F16, what)


def test_apply_with_a_global_count_beyond_2_32():
    """backward_apply with the sums and count of 2^33 + 3 elements per channel (other ranks)."""
    rng = np.random.default_rng(2)
    x = rng.normal(3, 2, (64, 4)).astype(F32)
    dy = rng.normal(0, 1, (64, 4)).astype(F32)
    mean, var, gamma = (np.full(4, v, F32) for v in (3.0, 4.0, 1.5))
    count = 2 ** 33 + 3
    partial = np.stack([np.full(4, 1e6), np.full(4, -3e6)])
    res = bnbw_native.backward_apply(x, dy, mean, var, gamma, partial, count, epsilon=EPS)
    r = 1 / np.sqrt(4.0 + float(np.float32(EPS)))
    want = 1.5 * r * (dy - 1e6 / count - (x.astype(np.float64) - 3.0) * r * r * -3e6 / count)
    assert_close(res.diff_src, want, F32, "dx")
    assert_close(res.diff_gamma, np.full(4, r * -3e6), F32, "dgamma")
    np.testing.assert_array_equal(res.diff_beta, np.float32(1e6))       # the given sum, rounded


# ---- more than 2^31 logical elements (slow) ------------------------------------------------

def integer_base(shape, seed):
    """Small integers: every product and partial sum below 2^53 is exact in float64."""
    rng = np.random.default_rng(seed)
    return rng.integers(-8, 9, shape).astype(F32), rng.integers(-4, 5, shape).astype(F32)


@pytest.mark.slow
def test_reduce_over_more_than_2_31_elements_per_channel():
    """backward_reduce (NCX, C = 2) over 2^31 + 5362 logical elements per channel, bit-exact:
    per-channel counts and block indices past 32 bits."""
    L = 4099
    N = 2 ** 31 // L + 2                       # N * L = 2^31 + 5362
    xb, gb = integer_base((1, 2, L), 3)
    x, dy = np.broadcast_to(xb, (N, 2, L)), np.broadcast_to(gb, (N, 2, L))
    mean = np.array([0.5, -1.0], F32)
    partial, count = bnbw_native.backward_reduce(x, dy, mean, data_format="NCX")
    assert count == N * L and count > 2 ** 31
    g64, c64 = gb.astype(np.float64), xb.astype(np.float64) - mean.reshape(1, 2, 1)
    want = np.stack([g64.sum(axis=(0, 2)), (c64 * g64).sum(axis=(0, 2))]) * N
    np.testing.assert_array_equal(partial, want)


@pytest.mark.slow
def test_reduce_channel_last_over_more_than_2_31_elements():
    """backward_reduce (NXC, C = 512) over (2^19 + 1) x 8 rows: 2^31 + 4096 logical elements,
    bit-exact: element offsets and block sums past 32 bits on the channel-last plan."""
    C, L = 512, 8
    N = 2 ** 19 + 1
    xb, gb = integer_base((1, L, C), 5)
    x, dy = np.broadcast_to(xb, (N, L, C)), np.broadcast_to(gb, (N, L, C))
    assert x.size > 2 ** 31
    mean = ((np.arange(C) % 16 - 8) / 4).astype(F32)     # quarters: every sum exact
    partial, count = bnbw_native.backward_reduce(x, dy, mean, data_format="NXC")
    assert count == N * L
    g64, c64 = gb.astype(np.float64), xb.astype(np.float64) - mean.astype(np.float64)
    want = np.stack([g64.sum(axis=(0, 1)), (c64 * g64).sum(axis=(0, 1))]) * N
    np.testing.assert_array_equal(partial, want)


@pytest.mark.slow
def test_training_dx_of_more_than_2_31_elements():
    """batchnorm_training_backward over (N, 1, L) with N * L = 2^31 + 32768: float16 diff_src
    of 4 GiB.  x and dy vary along N only (stride 0 along L), so dx is constant along L and the
    statistics are those of the (N, 1, 1) base with the same M ratio."""
    L = 2 ** 16
    N = 2 ** 15 + 1
    rng = np.random.default_rng(4)
    xb = rng.normal(3, 2, (N, 1, 1)).astype(F16)
    gb = (0.75 * (xb.astype(np.float64) - 3) + rng.normal(0.5, 1, (N, 1, 1))).astype(F16)
    x, dy = np.broadcast_to(xb, (N, 1, L)), np.broadcast_to(gb, (N, 1, L))
    mean, var, gamma = (np.array([v], F32) for v in (3.0, 4.0, 1.25))
    dx, dgamma, dbeta = bnbw_native.batchnorm_training_backward(
        x, dy, mean, var, gamma, epsilon=EPS, data_format="NCX")
    assert dx.size > 2 ** 31 and dx.dtype == F16
    k = (1, 1, 1)
    ref, bounds = expected(xb, gb, mean.reshape(k), var.reshape(k), gamma.reshape(k),
                           epsilon=EPS, axes=(0, 2), formula="training")
    first = dx[:, :, :1]
    assert_within(first, ref[0], bounds[0], F16, "dx[..., 0]")
    for start in range(0, L, 4096):                   # every column equals the first
        assert (dx[:, :, start:start + 4096] == first).all(), start
    assert_within(dgamma, ref[1].ravel() * L, bounds[1].ravel() * L, F32, "dgamma")
    assert_within(dbeta, ref[2].ravel() * L, bounds[2].ravel() * L, F32, "dbeta")


# ---- NaN and inf stay in their channel -------------------------------------------------------

POISON_LAYOUTS = {
    # name: (shape, channel axis): several reduction blocks, channel groups past TILE
    "ncx-2-blocks": ((3, 3, 11000), 1),         # M = 33000 > BLOCK
    "nxc-2-blocks": ((12000, 3), 1),            # 1024 rows per block: 12 blocks
    "nxc-2-groups": ((20, 2100), 1),            # C > TILE: two channel groups
}
FRONT_OF = ["graph3", "graph1", "intel", "ngraph", "two-phase", "dml-frozen", "dml-training"]


def _poisoned_call(front, layout, t1, where, value):
    shape, _ = POISON_LAYOUTS[layout]
    nxc = layout.startswith("nxc")
    axis = len(shape) - 1 if nxc else 1
    axes = tuple(d for d in range(len(shape)) if d != axis)
    C = shape[axis]
    bad = C - 3 if C > 2048 else 2
    rng = np.random.default_rng(7)
    t2 = t1 if front in ("ngraph", "dml-frozen", "dml-training") else (
        BF16 if t1 == BF16 else F32)
    x = rng.normal(3, 2, shape).astype(t1)
    dy = (0.5 + rng.normal(0, 1, shape)).astype(t1)
    if t2 == F16:
        dy = (dy.astype(F32) / 8).astype(t1)       # f16 parameter gradients stay finite
    stats = [rng.normal(3, 0.1, C), rng.uniform(3, 5, C), rng.normal(1, 0.5, C)]
    mean, var, gamma = (s.astype(F32).astype(t2) for s in stats)
    args = dict(x=x, dy=dy, mean=mean, var=var, gamma=gamma)
    if where is not None:
        target = args[where]
        if target.ndim == 1:
            target[bad] = value
        else:
            index = [n - 1 for n in shape]                # in the last block
            index[axis] = bad
            target[tuple(index)] = value
    keep = [1] * len(shape)
    keep[axis] = C
    fmt = "NXC" if nxc else "NCX"
    if front in ("graph3", "graph1"):
        got = bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPS, data_format=fmt,
            num_outputs=3 if front == "graph3" else 1)
    elif front == "intel":
        got = intel_spec.batch_norm_training_backprop(x, dy, mean, var, gamma, epsilon=EPS,
                                                  data_format=fmt)
    elif front == "ngraph":
        xs, dys = (np.moveaxis(a, axis, 1) for a in (x, dy))
        got = ngraph.batch_norm_training_backprop(xs, gamma, mean, mean, var, dys, epsilon=EPS)
        got = (np.moveaxis(got[0], 1, axis),) + tuple(got[1:])
    elif front == "two-phase":
        partial, count = bnbw_native.backward_reduce(x, dy, mean, data_format=fmt)
        got = bnbw_native.backward_apply(x, dy, mean, var, gamma, partial, count,
                                         epsilon=EPS, data_format=fmt)
    else:
        function = (dml.batch_normalization_grad if front == "dml-frozen"
                    else dml.batch_normalization_training_grad)
        got = function(x, dy, mean.reshape(keep), var.reshape(keep), gamma.reshape(keep), EPS)
        got = (got[0], got[1].ravel(), got[2].ravel())
    formula = "frozen" if front in ("graph1", "dml-frozen") else "training"
    scale = None if front == "graph1" else gamma.reshape(keep)
    ref, bounds = expected(x, dy, mean.reshape(keep), var.reshape(keep), scale, epsilon=EPS,
                           axes=axes, formula=formula)
    return got, ref, bounds, axis, bad, (t1, t2)


POISONS = [("x", np.nan), ("dy", np.inf), ("mean", -np.inf), ("var", np.nan),
           ("gamma", np.inf)]
# what enters no returned output: graph1 returns dy / sqrt(var + eps) only; frozen dx has no mean
UNUSED = {("graph1", "x"), ("graph1", "mean"), ("graph1", "gamma"), ("dml-frozen", "mean")}
LOW = [F16] + ([BF16] if BF16 is not None else [])
POISON_CASES = [
    (front, layout, where, value, F32)
    for front in FRONT_OF for layout in POISON_LAYOUTS for where, value in POISONS
    if (front, where) not in UNUSED
] + [
    (front, sorted(POISON_LAYOUTS)[i % len(POISON_LAYOUTS)], where, value, t1)
    for i, front in enumerate(FRONT_OF) for where, value in POISONS for t1 in LOW
    if (front, where) not in UNUSED
]


@pytest.mark.parametrize("front, layout, where, value, t1", POISON_CASES,
                         ids=[f"{f}-{lay}-{w}-{v}-{np.dtype(t).name}"
                              for f, lay, w, v, t in POISON_CASES])
def test_non_finite_values_stay_in_their_channel(front, layout, where, value, t1):
    got, ref, bounds, axis, bad, (t1, t2) = _poisoned_call(front, layout, t1, where, value)
    clean, _, _, _, _, _ = _poisoned_call(front, layout, t1, None, None)
    returned = [r for r, g in zip(ref, got) if g is not None]
    assert not all(np.isfinite(r).all() for r in returned), "the case poisons nothing"
    # the poisoned channel: non-finite exactly where IEEE arithmetic puts it
    assert_within(got[0], ref[0], bounds[0], t1, "dx")
    # every other channel: the very same bits as without the poison
    others = [c for c in range(got[0].shape[axis]) if c != bad]
    assert same_bits(np.take(got[0], others, axis=axis), np.take(clean[0], others, axis=axis))
    if got[1] is not None:
        for g, r, bd, cl, what in ((got[1], ref[1], bounds[1], clean[1], "dscale"),
                                   (got[2], ref[2], bounds[2], clean[2], "dbias")):
            assert_within(g, r.ravel(), bd.ravel(), t2, what)
            assert same_bits(np.delete(g, bad), np.delete(cl, bad)), what


# ---- constant channels: variance 0, tiny epsilon --------------------------------------------

CONSTANT_CASES = [
    # (front, t1, epsilon): epsilon as small as the output type allows finite results
    ("graph", F32, 1.4e-45), ("graph", F32, 1.2e-38), ("graph", F16, 1e-7),
    ("ngraph", F16, 1e-7), ("dml", F32, 1.4e-45), ("dml", F16, 1e-7), ("two-phase", F32, 1e-30),
] + ([("graph", BF16, 1.4e-45), ("dml", BF16, 1.4e-45)] if BF16 is not None else [])


@pytest.mark.parametrize("front, t1, epsilon", CONSTANT_CASES,
                         ids=[f"{f}-{np.dtype(t).name}-{e:g}" for f, t, e in CONSTANT_CASES])
@pytest.mark.parametrize("shape, axis", [((50, 4, 9), 1), ((900, 4), 1)], ids=["ncx", "nxc"])
def test_constant_channels_give_finite_results(front, t1, epsilon, shape, axis):
    """Channels 0 and 2 hold one value everywhere (variance 0, mean = that value): with the
    tiniest epsilon the results stay finite and match the reference; channel 1 has dy constant
    too; channel 3 is ordinary."""
    rng = np.random.default_rng(9)
    C = shape[axis]
    t2 = t1 if front in ("ngraph", "dml") else (BF16 if t1 == BF16 else F32)
    x = rng.normal(3, 2, shape).astype(t1)
    dy = rng.normal(0, 1, shape).astype(t1)
    mean = rng.normal(3, 0.1, C).astype(t2)
    var = rng.uniform(3, 5, C).astype(t2)
    gamma = rng.normal(1, 0.5, C).astype(t2)
    index = [slice(None)] * len(shape)
    for c, value in ((0, 2.5), (2, -1.75), (1, 0.5)):
        index[axis] = c
        x[tuple(index)] = value
        mean[c], var[c] = value, 0.0
        if c == 1:
            dy[tuple(index)] = 0.375
    keep = [1] * len(shape)
    keep[axis] = C
    fmt = "NXC" if axis == len(shape) - 1 else "NCX"
    if front == "graph":
        got = bnbw_native.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=epsilon,
                                                      data_format=fmt)
    elif front == "ngraph":
        got = ngraph.batch_norm_training_backprop(x, gamma, mean, mean, var, dy,
                                                  epsilon=epsilon)
    elif front == "two-phase":
        partial, count = bnbw_native.backward_reduce(x, dy, mean, data_format=fmt)
        got = bnbw_native.backward_apply(x, dy, mean, var, gamma, partial, count,
                                         epsilon=epsilon, data_format=fmt)
    else:
        got = dml.batch_normalization_training_grad(x, dy, mean.reshape(keep),
                                                    var.reshape(keep), gamma.reshape(keep),
                                                    epsilon)
    ref, bounds = expected(x, dy, mean.reshape(keep), var.reshape(keep), gamma.reshape(keep),
                           epsilon=epsilon, axes=tuple(d for d in range(len(shape))
                                                       if d != axis), formula="training")
    for g, r, bd, dt, what in zip(got, ref, bounds, (t1, t2, t2), ("dx", "dscale", "dbias")):
        g = np.asarray(g)
        assert np.isfinite(g.astype(np.float64)).all(), f"{what} is not finite"
        assert_within(g, r.reshape(g.shape), bd.reshape(g.shape), dt, what)
    # a constant channel has dscale exactly 0; dx = gamma r (dy - mean(dy)) stays finite
    ds = np.asarray(got[1]).ravel()
    assert ds[0] == 0 and ds[1] == 0 and ds[2] == 0


# ---- accuracy of the sums at M = 2^24 with |mean| >> std (contract 1) -------------------------

M_BIG = 1 << 24


@functools.cache
def accuracy_case(dy_kind, storage):
    """x, dy stored as `storage` (f16/bf16 sums go through f32 blocks: the same bound);
    mean and var those of the stored x."""
    rng = np.random.default_rng(24)
    x = (1000.0 + rng.standard_normal(M_BIG, dtype=np.float32)).astype(storage)
    x64 = x.astype(np.float64)
    mean, var = x64.mean(), x64.var()
    noise = rng.standard_normal(M_BIG, dtype=np.float32)
    if dy_kind == "random":
        dy = noise
    else:  # correlated with x, non-zero mean: both sums are large, no cancellation in the refs
        dy = ((x64 - mean) + 0.1 + 0.5 * noise).astype(np.float32)
    return x, dy.astype(storage), np.float32([mean]), np.float32([var])


@pytest.mark.parametrize("storage", [F32, np.dtype(np.float16)] + ([BF16] if BF16 else []),
                         ids=lambda t: str(t))
@pytest.mark.parametrize("dy_kind", ["random", "correlated"])
@pytest.mark.parametrize("data_format, shape", [("NXC", (M_BIG, 1)), ("NCX", (1, 1, M_BIG))])
def test_parameter_gradients_accurate_for_2_24_elements(data_format, shape, dy_kind, storage):
    x, dy, mean, var = accuracy_case(dy_kind, storage)
    case = dict(src=x.reshape(shape), diff_dst=dy.reshape(shape), mean=mean, variance=var)
    result = bnbw_native.batchnorm_training_backward(**case, epsilon=EPS,
                                                     data_format=data_format)
    _, ref_dgamma, ref_dbeta = reference.batchnorm_training_backward(
        **case, epsilon=EPS, data_format=data_format)

    # Denominator: max(|ref|, 2-norm of the summands).  The 2-norm (sqrt(M) * rms) is the size a
    # sum of M random-signed terms typically has; when the drawn |sum| is much smaller, that is
    # luck of the draw, and any accumulation error scales with the terms, not with the result.
    # Rounding the exact sum to f32 alone costs <= 6e-8 * |ref|; 1e-6 leaves room for careful
    # accumulation but not for a plain f32 running sum or for sum(g*x) - mean*sum(g).
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    r = 1.0 / np.sqrt(float(var[0]) + float(np.float32(EPS)))
    gamma_terms_norm = r * np.sqrt(np.sum(((x64 - float(mean[0])) * dy64) ** 2))
    beta_terms_norm = np.sqrt(np.sum(dy64**2))
    for got, ref, norm in ((result.diff_gamma, ref_dgamma, gamma_terms_norm),
                           (result.diff_beta, ref_dbeta, beta_terms_norm)):
        assert got.dtype == F32 and got.shape == (1,)
        error = abs(float(got[0]) - ref[0]) / max(abs(ref[0]), norm)
        assert error <= 1e-6, f"relative error {error:.3g} (got {got[0]!r}, ref {ref[0]!r})"


@pytest.mark.parametrize("storage", [F32, np.dtype(np.float16)] + ([BF16] if BF16 else []),
                         ids=lambda d: d.name)
@pytest.mark.parametrize("data_format", ["NCX", "NXC"])
def test_a_backward_centred_on_the_forwards_exact_mean(data_format, storage):
    """The torch layers' path: the forward writes the batch mean rounded to float32 and its
    low part (mean_low); a backward given both centres on their sum, so its gradients are as
    exact at a mean of 1e3 standard deviations as at 0 (the float32 mean alone moves dgamma
    by about 1e-4 relative there).  A mean_low of zeros changes no bit."""
    from bnbw_native import _arrays
    from bnbw_native._onednn_graph import FORWARD, GRAPH
    rng = np.random.default_rng(41)
    shape = (32, 12, 9, 9) if data_format == "NCX" else (32, 9, 9, 12)
    axis = 1 if data_format == "NCX" else 3
    reduced = tuple(d for d in range(4) if d != axis)
    C = shape[axis]
    x = (rng.standard_normal(shape) + 1000.0 * rng.standard_normal(C).reshape(
        [C if d == axis else 1 for d in range(4)])).astype(F32).astype(storage)
    dy = rng.standard_normal(shape).astype(F32).astype(storage)
    gamma = (rng.random(C) + 0.5).astype(F32)
    zeros = np.zeros(C, F32)
    out = (np.empty(shape, storage),) + tuple(np.empty(C, F32) for _ in range(4))
    mean_low = np.empty(C, F32)
    _arrays.forward(FORWARD, x, zeros, zeros, gamma, zeros, 1e-5, 0.1, data_format, False,
                    out, 2, mean_low=mean_low)
    mean, var = out[3], out[4]
    exact = x.astype(np.float64).mean(axis=reduced)
    assert np.all(np.abs(mean.astype(np.float64) + mean_low - exact) <= 1e-9 * np.abs(exact))
    assert np.all(np.abs(mean_low) <= np.spacing(np.abs(mean)))

    # the float64 reference centred on the exact mean
    shaped = [C if d == axis else 1 for d in range(4)]
    xc = x.astype(np.float64) - exact.reshape(shaped)
    g = dy.astype(np.float64)
    r = 1.0 / np.sqrt(var.astype(np.float64) + 1e-5)
    M = x.size // C
    dbeta = g.sum(axis=reduced)
    dgamma = r * (xc * g).sum(axis=reduced)
    dx = (gamma * r).reshape(shaped) * (g - dbeta.reshape(shaped) / M
                                        - xc * (r * dgamma).reshape(shaped) / M)

    def backward(low, threads):
        return _arrays.backward(GRAPH, _arrays.TRAINING, x, dy, mean, var, gamma, 1e-5,
                                data_format, None, threads, mean_low=low)

    got = backward(mean_low, 2)
    assert same_bits(got, backward(mean_low, 1))
    # dx rounded once to its storage; the parameter gradients (float32) from sums that 16-bit
    # storage takes in float32 blocks
    tol_dx, tol_params = {F32: (1e-6, 1e-6), F16: (2.0 ** -10, 1e-5)}.get(storage,
                                                                         (2.0 ** -7, 1e-5))
    for ours, want, tol in zip(got, (dx, dgamma, dbeta), (tol_dx, tol_params, tol_params)):
        assert np.abs(ours.astype(np.float64) - want).max() <= tol * np.abs(want).max()
    assert same_bits(backward(zeros, 2),
                     bnbw_native.batchnorm_training_backward(x, dy, mean, var, gamma,
                                                             epsilon=1e-5,
                                                             data_format=data_format))
