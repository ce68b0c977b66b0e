"""The array front-ends beside oneDNN Graph's call: the Intel spec (contract 3.2), nGraph (3.3)
and the two phases (7); and what every array front-end shares, since all go through the one
entry into the engine (bnbw_native._engine): the same problem gives the same bits (or, through
another plan, the same values), every kind of array argument gives the bits of plain NumPy, and
an empty batch gives zero parameter gradients.  Their refusals are in test_refusals.py."""
import numpy as np
import pytest

import bnbw_native
import bnbw_native as bn
from bnbw_native import backward_apply, dml, ngraph, intel_spec, reference
from error_bounds import assert_close, same_bits

try:
    import ml_dtypes
except ImportError:  # bf16 cases need ml_dtypes arrays
    ml_dtypes = None

BF16 = ml_dtypes.bfloat16 if ml_dtypes is not None else None

try:
    import torch
except ImportError:
    torch = None

needs_bf16 = pytest.mark.skipif(ml_dtypes is None, reason="bfloat16 arrays need ml_dtypes")

# (T1, T2) combinations the oneDNN conventions accept.
GRAPH_COMBOS = [
    pytest.param(np.float32, np.float32, id="f32-f32"),
    pytest.param(np.float16, np.float32, id="f16-f32"),
    pytest.param("bf16", np.float32, id="bf16-f32", marks=needs_bf16),
    pytest.param("bf16", "bf16", id="bf16-bf16", marks=needs_bf16),
]


def dtype(t):
    return BF16 if isinstance(t, str) else t


def make(shape, axis, t1=np.float32, t2=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2 + 5).astype(dtype(t1))
    dy = rng.standard_normal(shape).astype(dtype(t1))
    axes = tuple(d for d in range(len(shape)) if d != axis)
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=axes).astype(dtype(t2))
    var = x64.var(axis=axes).astype(dtype(t2))
    gamma = rng.uniform(0.5, 1.5, shape[axis]).astype(dtype(t2))
    beta = rng.standard_normal(shape[axis]).astype(dtype(t2))
    return x, dy, mean, var, gamma, beta


def assert_matches(got, ref, t1, t2):
    """dx of storage type t1, the parameter gradients of t2, against the float64 reference."""
    assert len(got) == 3
    for g, r, t, what in zip(got, ref, (t1, t2, t2), ("dx", "dgamma", "dbeta")):
        assert_close(g, r, dtype(t), what)


# ---- Intel spec BatchNormTrainingBackprop-1 ---------------------------------------------

@pytest.mark.parametrize("t1,t2", GRAPH_COMBOS)
@pytest.mark.parametrize("data_format,shape", [("NCX", (4, 6, 5, 7)), ("NXC", (4, 5, 7, 6)),
                                               ("NXC", (30, 9))])
@pytest.mark.parametrize("with_gamma", [True, False])
def test_intel_spec_matches_reference(t1, t2, data_format, shape, with_gamma):
    axis = 1 if data_format == "NCX" else len(shape) - 1
    x, dy, mean, var, gamma, _ = make(shape, axis, t1, t2)
    gamma = gamma if with_gamma else None
    got = intel_spec.batch_norm_training_backprop(x, dy, mean, var, gamma, epsilon=1e-3,
                                              data_format=data_format)
    assert isinstance(got, tuple) and len(got) == 3
    ref = reference.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3,
                                                data_format=data_format)
    assert_matches(got, ref, t1, t2)


def test_intel_spec_is_the_graph_training_result():
    x, dy, mean, var, gamma, _ = make((5, 8, 9), 2)
    a = intel_spec.batch_norm_training_backprop(x, dy, mean, var, gamma, epsilon=1e-5)
    b = bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5)
    assert same_bits(a, b)


# ---- nGraph BatchNormTrainingBackprop -------------------------------------------------

NGRAPH_TYPES = [pytest.param(np.float32, id="f32"), pytest.param(np.float16, id="f16"),
                pytest.param("bf16", id="bf16", marks=needs_bf16)]


@pytest.mark.parametrize("t", NGRAPH_TYPES)
@pytest.mark.parametrize("shape", [(4, 6, 5, 7), (7, 3), (2, 3, 4, 5, 6)])
def test_ngraph_matches_reference(t, shape):
    x, dy, mean, var, gamma, beta = make(shape, 1, t, t)
    got = ngraph.batch_norm_training_backprop(x, gamma, beta, mean, var, dy, epsilon=1e-3)
    ref = reference.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3,
                                                data_format="NCX")
    assert_matches(got, ref, t, t)


def test_ngraph_beta_does_not_enter_the_result():
    x, dy, mean, var, gamma, beta = make((4, 6, 5), 1)
    a = ngraph.batch_norm_training_backprop(x, gamma, beta, mean, var, dy, epsilon=1e-3)
    b = ngraph.batch_norm_training_backprop(x, gamma, beta * 7 + 1, mean, var, dy,
                                            epsilon=1e-3)
    assert same_bits(a, b)


# ---- two phases (contract 7) ----------------------------------------------------------------

LAYOUTS = [("NCX", (3, 5, 70000)), ("NXC", (70000, 7)), ("NCX", (2, 64, 9, 9)),
           ("NXC", (4, 9, 9, 33)), ("NXC", (1 << 17, 1))]


@pytest.mark.parametrize("data_format,shape", LAYOUTS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_reduce_then_apply_is_training_bit_for_bit(data_format, shape, threads):
    axis = 1 if data_format == "NCX" else len(shape) - 1
    x, dy, mean, var, gamma, _ = make(shape, axis)
    whole = bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                           data_format=data_format, num_threads=1)
    partial, count = bn.backward_reduce(x, dy, mean, data_format=data_format,
                                        num_threads=threads)
    assert partial.dtype == np.float64 and partial.shape == (2, shape[axis])
    assert partial.flags.c_contiguous
    assert isinstance(count, int) and count == x.size // shape[axis]
    split = bn.backward_apply(x, dy, mean, var, gamma, partial, count, epsilon=1e-5,
                              data_format=data_format, num_threads=threads)
    assert isinstance(split, bn.BackwardResult)
    assert same_bits(whole, split)


def test_partial_holds_the_documented_sums():
    x, dy, mean, _, _, _ = make((40, 3, 6), 1)
    partial, count = bn.backward_reduce(x, dy, mean, data_format="NCX")
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    m = mean.astype(np.float64)[None, :, None]
    np.testing.assert_allclose(partial[0], dy64.sum(axis=(0, 2)), rtol=1e-12, atol=1e-12)
    # x - mean is formed in float32 (exact near the mean), its product with dy in float64
    d = (x - mean[None, :, None]).astype(np.float64)
    np.testing.assert_allclose(partial[1], (d * dy64).sum(axis=(0, 2)), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(partial[1], ((x64 - m) * dy64).sum(axis=(0, 2)), rtol=1e-6)
    assert count == 40 * 6


@pytest.mark.parametrize("data_format", ["NCX", "NXC"])
def test_uneven_shards_equal_the_whole_batch(data_format):
    shape = (23, 6, 11) if data_format == "NCX" else (23, 11, 6)
    axis = 1 if data_format == "NCX" else 2
    x, dy, mean, var, gamma, _ = make(shape, axis)
    want = reference.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                                 data_format=data_format)
    shards = [slice(0, 5), slice(5, 6), slice(6, 23)]
    reduced = [bn.backward_reduce(x[s], dy[s], mean, data_format=data_format) for s in shards]
    total = sum(p for p, _ in reduced)
    count = sum(c for _, c in reduced)
    assert count == 23 * 11
    parts = [bn.backward_apply(x[s], dy[s], mean, var, gamma, total, count, epsilon=1e-5,
                               data_format=data_format) for s in shards]
    dx = np.concatenate([p.diff_src for p in parts])
    # the shards' sums add up in another order than the whole batch's: close, not the same bits
    assert_matches((dx, parts[0].diff_gamma, parts[0].diff_beta), want, np.float32, np.float32)
    for p in parts[1:]:       # every shard derives its parameter gradients from the same sums
        assert same_bits((p.diff_gamma, p.diff_beta), (parts[0].diff_gamma, parts[0].diff_beta))


def test_apply_with_a_larger_global_count_is_accepted():
    """Twice the sums and twice the count: what a second rank holding the same rows sends, so
    the result is the whole batch's on the rows doubled."""
    x, dy, mean, var, gamma, _ = make((3, 4, 4), 1)
    partial, count = bn.backward_reduce(x, dy, mean, data_format="NCX")
    res = bn.backward_apply(x, dy, mean, var, gamma, partial * 2, count * 2, epsilon=1e-5,
                            data_format="NCX")
    want = reference.batchnorm_training_backward(np.concatenate([x, x]), np.concatenate([dy, dy]),
                                                 mean, var, gamma, epsilon=1e-5,
                                                 data_format="NCX")
    assert_matches(res, (want[0][:3], want[1], want[2]), np.float32, np.float32)


# ---- every front-end, one computation -------------------------------------------------

def _front_end_results():
    """The same NCX problem through every front-end, by name."""
    x, dy, mean, var, gamma, beta = make((6, 5, 8, 7), 1)
    k = (1, 5, 1, 1)

    def two_phase():
        partial, count = bn.backward_reduce(x, dy, mean, data_format="NCX")
        return bn.backward_apply(x, dy, mean, var, gamma, partial, count, epsilon=1e-4,
                                 data_format="NCX")

    def nxc_view():        # NXC view of the same data: another plan, the same values
        got = bn.batchnorm_training_backward(np.moveaxis(x, 1, -1), np.moveaxis(dy, 1, -1), mean,
                                             var, gamma, epsilon=1e-4, data_format="NXC")
        return (np.moveaxis(got[0], -1, 1),) + tuple(got[1:])

    def directml():
        got = dml.batch_normalization_training_grad(x, dy, mean.reshape(k), var.reshape(k),
                                                    gamma.reshape(k), 1e-4)
        return (got[0], got[1].ravel(), got[2].ravel())

    calls = {
        "graph": lambda: bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-4,
                                                        data_format="NCX"),
        "intel": lambda: intel_spec.batch_norm_training_backprop(x, dy, mean, var, gamma,
                                                             epsilon=1e-4, data_format="NCX"),
        "ngraph": lambda: ngraph.batch_norm_training_backprop(x, gamma, beta, mean, var, dy,
                                                              epsilon=1e-4),
        "two-phase": two_phase, "nxc-view": nxc_view, "dml": directml,
    }
    want = reference.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-4,
                                                 data_format="NCX")
    return calls, want


@pytest.mark.parametrize("front", ["intel", "ngraph", "two-phase"])
def test_front_end_gives_the_graph_bits(front):
    """The same layout through another front-end: the same plan, the very same bits."""
    calls, _ = _front_end_results()
    assert same_bits(tuple(calls[front]()), tuple(calls["graph"]()))


@pytest.mark.parametrize("front", ["graph", "nxc-view", "dml"])
def test_front_end_matches_the_reference(front):
    """Every plan of the same values (NCX, its NXC view, DirectML) against the reference."""
    calls, want = _front_end_results()
    assert_matches(calls[front](), want, np.float32, np.float32)


# ---- every kind of array argument takes the one path into the engine --------------------------
# Plain NumPy arrays and every other kind of array argument take the same path
# (bnbw_native._engine), so they give the same bits (and the same refusals: test_refusals.py).

def random_arrays(rng, shape=(8, 16), dtype=np.float32, stat=np.float32, axis=-1):
    C = shape[axis]
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype),
            rng.standard_normal(C).astype(stat), (rng.random(C) + 0.5).astype(stat),
            rng.standard_normal(C).astype(stat))


def _bits(results):
    return [None if r is None else np.asarray(r).view(np.uint8).tobytes() for r in results]


def _misaligned(a):
    raw = np.zeros(a.nbytes + 1, np.uint8)
    view = raw[1:].view(a.dtype).reshape(a.shape)
    view[...] = a
    assert not view.flags.aligned
    return view


class Sub(np.ndarray):
    pass


KINDS = {
    "subclass": lambda a: a.view(Sub),
    "byte-swapped": lambda a: a.astype(a.dtype.newbyteorder()),
    "misaligned": _misaligned,
    "read-only": lambda a: np.lib.stride_tricks.as_strided(a, writeable=False),
    "memoryview": lambda a: memoryview(a),
}
if torch is not None:
    KINDS["torch (DLPack)"] = lambda a: torch.from_numpy(a)


ROLES = ["src", "diff_dst", "mean", "variance", "gamma"]


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
def test_every_kind_of_array_gives_the_bits_of_plain_numpy(rng, kind, dtype, role):
    args = list(random_arrays(rng, (6, 5, 16), dtype))
    want = bnbw_native.batchnorm_training_backward(*args, epsilon=1e-3, data_format="NXC")
    i = ROLES.index(role)
    args[i] = KINDS[kind](args[i].copy())
    got = bnbw_native.batchnorm_training_backward(*args, epsilon=1e-3, data_format="NXC")
    assert _bits(got) == _bits(want)


# ---- an empty batch gives zero parameter gradients in every front-end, whatever the statistics
# hold (a DirectML operator, the C API's path, has no empty batch: its sizes are >= 1)

def _empty_stats(C=3):
    var = np.array([1.0, np.nan, -2.0], np.float32)[:C]     # r is NaN for two channels
    return np.zeros(C, np.float32), var, np.ones(C, np.float32)


EMPTY_CALLS = {
    "graph": lambda x, m, v, g: bnbw_native.batchnorm_training_backward(
        x, x, m, v, g, epsilon=1e-5, data_format="NCX"),
    "intel": lambda x, m, v, g: intel_spec.batch_norm_training_backprop(
        x, x, m, v, g, epsilon=1e-5, data_format="NCX"),
    "ngraph": lambda x, m, v, g: ngraph.batch_norm_training_backprop(x, g, g, m, v, x,
                                                                     epsilon=1e-5),
    "apply": lambda x, m, v, g: backward_apply(x, x, m, v, g, np.zeros((2, 3)), 0, epsilon=1e-5,
                                               data_format="NCX"),
    "dml-frozen": lambda x, m, v, g: dml.batch_normalization_grad(
        x, x, m.reshape(1, 3, 1), v.reshape(1, 3, 1), g.reshape(1, 3, 1), 1e-5),
    "dml-training": lambda x, m, v, g: dml.batch_normalization_training_grad(
        x, x, m.reshape(1, 3, 1), v.reshape(1, 3, 1), g.reshape(1, 3, 1), 1e-5),
}


@pytest.mark.parametrize("front", sorted(EMPTY_CALLS))
def test_empty_batch_gives_zero_parameter_gradients_in_every_array_front_end(front):
    x = np.zeros((0, 3, 4), np.float32)
    dx, dgamma, dbeta = EMPTY_CALLS[front](x, *_empty_stats())
    assert dx.shape == x.shape
    np.testing.assert_array_equal(np.ravel(dgamma), 0)
    np.testing.assert_array_equal(np.ravel(dbeta), 0)
    assert not np.signbit(np.ravel(dgamma)).any()


def test_empty_batch_gives_zero_parameter_gradients_through_an_operator():
    big = dml.TensorDesc("float32", (1, 3, 4))
    stats = dml.TensorDesc("float32", (1, 3, 1))
    op = dml.BatchNormalizationTrainingGrad(input=big, input_gradient=big, mean=stats,
                                            variance=stats, scale=stats, output_gradient=big,
                                            output_scale_gradient=stats,
                                            output_bias_gradient=stats, epsilon=1e-5)
    assert op.count == 4      # DirectML sizes are >= 1: an operator's batch is never empty
    x = np.zeros((1, 3, 4), np.float32)
    mean, var, gamma = _empty_stats()
    outs = [np.full((1, 3, 1), 7.0, np.float32) for _ in range(2)]
    op.execute(input=x, input_gradient=x, mean=mean, variance=var, scale=gamma,
               output_gradient=np.empty_like(x), output_scale_gradient=outs[0],
               output_bias_gradient=outs[1])
    # a real batch: dgamma = r * 0 is NaN where r is, by IEEE arithmetic within the channel
    assert np.isnan(outs[0].ravel()[1]) and outs[0].ravel()[0] == 0
