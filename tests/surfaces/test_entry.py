"""The one way into the engine (bnbw_native._engine): every front-end goes through it.

Plain NumPy arrays and every other kind of array argument take the same path, so they give the
same bits and the same refusals; the edge-case rules (an empty batch) hold in every front-end,
the C API included; and the layer can say which plan and schedule a call gets.
"""
import numpy as np
import pytest

import bnbw_native
from bnbw_native import _arrays, _schedules, backward_apply, dml, ngraph, intel_spec
from bnbw_native._onednn_graph import GRAPH
from conftest import BF16

try:
    import torch
except ImportError:
    torch = None


def make(rng, shape=(8, 16), dtype=np.float32, stat=np.float32, axis=-1):
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
    args = list(make(rng, (6, 5, 16), dtype))
    want = bnbw_native.batchnorm_training_backward(*args, epsilon=1e-3)
    i = ROLES.index(role)
    args[i] = KINDS[kind](args[i].copy())
    got = bnbw_native.batchnorm_training_backward(*args, epsilon=1e-3)
    assert _bits(got) == _bits(want)


# ---- an empty batch gives zero parameter gradients, whatever the statistics hold -------------

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


# ---- the plan and schedule a call gets ----------------------------------------------------

def describe(x, data_format, formula=_arrays.TRAINING, num_threads=1, **kw):
    C = x.shape[-1 if data_format == "NXC" else 1]
    mean, var = np.zeros(C, np.float32), np.ones(C, np.float32)
    return _arrays.describe(GRAPH, formula, x, x, mean, var, None, 1e-5, data_format,
                          num_threads, **kw)


SMALL_CACHE = (1 << 20, 32 << 20, 16)    # L2, L3, CPUs sharing the L3


@pytest.fixture
def cache_model():
    """Sets the caches the schedules assume for the test, then restores the machine's."""
    before = _schedules.cache_model()
    yield _schedules.set_cache_model
    _schedules.set_cache_model(*before)


@pytest.mark.parametrize("shape, data_format, threads, formula, cache, schedule", [
    ((32, 14, 14, 64), "NXC", 2, _arrays.TRAINING, SMALL_CACHE, "last-split"),
    ((32, 14, 14, 64), "NXC", 2, _arrays.FROZEN_DX, SMALL_CACHE, "last-split"),
    ((32, 64, 14, 14), "NCX", 2, _arrays.TRAINING, SMALL_CACHE, "major-sweep-fused"),
    ((1, 4, 70000), "NCX", 2, _arrays.TRAINING, SMALL_CACHE, "major-channel-fused"),
    ((32, 64, 14, 14), "NCX", 2, _arrays.FROZEN_DX, SMALL_CACHE, "major-sweep"),
    ((1, 2, 70000), "NCX", 2, _arrays.FROZEN_DX, SMALL_CACHE, "major-blocks"),
    ((0, 4, 3), "NCX", 2, _arrays.TRAINING, SMALL_CACHE, "nothing"),
])
def test_describe_names_the_schedule(cache_model, shape, data_format, threads, formula, cache,
                                     schedule):
    cache_model(*cache)
    facts = describe(np.zeros(shape, np.float32), data_format, formula, threads)
    assert facts["schedule"] == schedule
    assert facts["layout"] == ("empty" if 0 in shape else
                               "channel-last" if data_format == "NXC" else "channel-major")


def test_describe_reports_threads_sums_and_temporaries():
    x = np.zeros((4, 3, 8, 8), np.float16)
    facts = describe(x, "NCX", num_threads=2)
    assert facts["sums"] == "blocked" and facts["threads"] == 1     # too small for threads
    assert facts["channels"] == 3 and facts["count"] == 256
    assert describe(x.astype(np.float32), "NCX")["sums"] == "exact"
    if BF16 is not None:
        assert describe(x.astype(BF16), "NCX")["sums"] == "blocked-even-odd"
    like_nhwc = np.zeros((4, 8, 8, 3), bool).transpose(0, 3, 1, 2)  # same rows as x
    assert describe(x, "NCX", relu_dst=like_nhwc)["via_temp"] == []
    swapped = np.zeros((4, 3, 8, 8), bool).transpose(0, 1, 3, 2)     # H and W swapped
    assert describe(x, "NCX", relu_dst=swapped)["via_temp"] == ["relu_dst"]
