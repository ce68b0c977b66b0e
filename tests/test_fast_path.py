"""The fast path of a call (_core.fast_backward) against the general path.

Plain NumPy calls skip the Python checks: a Cython function proves them valid and runs them, or
declines (returns None) and the general path runs or refuses the call.  Two things must hold:
whatever the fast path runs gives the general path's bits, and it never runs a call the general
path would refuse.
"""
import numpy as np
import pytest

from bnbw_native import _config, _core, _pipeline, batchnorm_training_backward, onednn
from conftest import BF16

TRAINING = _pipeline.FORMULAS["training"]
FROZEN_DX = _pipeline.FORMULAS["frozen_dx"]


def fast(x, dy, mean, var, gamma, epsilon=1e-5, *, channel_last=True, op=TRAINING,
         out=None, num_threads=None, graph_rule=True):
    return _core.fast_backward(x, dy, mean, var, gamma, epsilon, channel_last, op,
                               op == FROZEN_DX, out, num_threads, _config.resolve_threads,
                               graph_rule, 2, 8)


@pytest.fixture
def general_only(monkeypatch):
    """Calls through the public API take the general path."""
    monkeypatch.setattr(_pipeline, "FAST_FORMULAS", ())


def make(rng, shape=(8, 16), dtype=np.float32, stat=np.float32, axis=-1):
    C = shape[axis]
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype),
            rng.standard_normal(C).astype(stat), (rng.random(C) + 0.5).astype(stat),
            rng.standard_normal(C).astype(stat))


@pytest.mark.parametrize("shape,data_format", [((8, 16), "NXC"), ((8, 16), "NCX"),
                                               ((2, 3, 5, 7), "NCX"), ((4, 5, 6, 9), "NXC"),
                                               ((3, 0, 4), "NCX"), ((0, 5), "NXC")])
@pytest.mark.parametrize("dtype,stat", [(np.float32, np.float32), (np.float16, np.float32)]
                         + ([(BF16, np.float32), (BF16, BF16)] if BF16 is not None else []),
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("num_outputs", [3, 1])
def test_fast_path_runs_plain_calls_with_the_general_paths_bits(rng, monkeypatch, shape,
                                                                 data_format, dtype, stat,
                                                                 num_outputs):
    axis = 1 if data_format == "NCX" else -1
    x, dy, mean, var, gamma = make(rng, shape, dtype, stat, axis=axis)
    op = TRAINING if num_outputs == 3 else FROZEN_DX
    got = fast(x, dy, mean, var, gamma, 1e-3, channel_last=data_format == "NXC", op=op)
    assert got is not None, "a plain call must take the fast path"
    monkeypatch.setattr(_pipeline, "FAST_FORMULAS", ())
    want = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3,
                                       data_format=data_format, num_outputs=num_outputs)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.dtype == w.dtype and g.shape == w.shape and g.strides == w.strides
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


def test_fast_path_writes_out_and_in_place(rng, general_only):
    x, dy, mean, var, gamma = make(rng, (6, 10))
    want = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5)
    outs = (np.empty_like(x), np.empty(10, np.float32), np.empty(10, np.float32))
    assert fast(x, dy, mean, var, gamma, out=outs) is not None
    buf = dy.copy()
    in_place = fast(x, buf, mean, var, gamma, out=[buf, outs[1].copy(), outs[2].copy()])
    assert in_place is not None and in_place[0] is buf
    wide = np.full((6, 20), np.nan, np.float32)
    strided = fast(x, dy, mean, var, gamma, out=(wide[:, ::2],) + outs[1:])
    assert strided is not None and np.isnan(wide[:, 1::2]).all()
    for got in (outs, in_place, strided):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def _declined_cases(rng):
    x, dy, mean, var, gamma = make(rng)
    C = 16
    good_out = lambda: (np.empty_like(x), np.empty(C, np.float32), np.empty(C, np.float32))
    ro = np.empty_like(x)
    ro.flags.writeable = False
    shared = np.ascontiguousarray(dy.T)        # (16, 8); .T is dy again, F-ordered

    class Sub(np.ndarray):
        pass

    base = dict(x=x, dy=dy, mean=mean, var=var, gamma=gamma)
    cases = {
        "x float64": dict(x=x.astype(np.float64)),
        "dy float16": dict(dy=dy.astype(np.float16)),
        "dy shape": dict(dy=dy[:, :8]),
        "mean float16 (graph rule)": dict(mean=mean.astype(np.float16)),
        "x, dy float16 with float16 statistics (graph rule)": dict(
            x=x.astype(np.float16), dy=dy.astype(np.float16), mean=mean.astype(np.float16),
            var=var.astype(np.float16), gamma=gamma.astype(np.float16)),
        "var length": dict(var=var[:8]),
        "gamma 2-D": dict(gamma=gamma[None, :]),
        "mean missing": dict(mean=None),
        "var missing": dict(var=None),
        "x rank 1": dict(x=x[0], dy=dy[0]),
        "x a list": dict(x=x.tolist()),
        "x a subclass": dict(x=x.view(Sub)),
        "x byte-swapped": dict(x=x.astype(x.dtype.newbyteorder())),
        **({"statistics bfloat16 with float32 x (graph rule)": dict(
            mean=mean.astype(BF16), var=var.astype(BF16), gamma=gamma.astype(BF16))}
           if BF16 is not None else {}),
        "epsilon 0": dict(epsilon=0.0),
        "epsilon negative": dict(epsilon=-1e-5),
        "epsilon underflows f32": dict(epsilon=1e-50),
        "epsilon overflows f32": dict(epsilon=1e39),
        "epsilon nan": dict(epsilon=float("nan")),
        "epsilon inf": dict(epsilon=float("inf")),
        "epsilon a string": dict(epsilon="1e-5"),
        "num_threads 0": dict(num_threads=0),
        "num_threads bool": dict(num_threads=True),
        "num_threads float": dict(num_threads=2.0),
        "out too short": dict(out=good_out()[:2]),
        "out not a sequence": dict(out=np.empty_like(x)),
        "out dx dtype": dict(out=(np.empty(x.shape, np.float16),) + good_out()[1:]),
        "out dx read-only": dict(out=(ro,) + good_out()[1:]),
        "out dx zero strides": dict(out=(np.lib.stride_tricks.as_strided(
            np.empty(16, np.float32), x.shape, (0, 4)),) + good_out()[1:]),
        "out dx overlaps x": dict(out=(x,) + good_out()[1:]),
        "out dx overlaps mean": dict(out=(np.empty_like(x),) + (mean, np.empty(C, np.float32))),
        "out dgamma is dbeta": dict(out=(np.empty_like(x),) + (lambda a: (a, a))(
            np.empty(C, np.float32))),
        "out dx another view of dy's memory": dict(dy=shared.T, out=(shared.reshape(8, 16),)
                                                   + good_out()[1:]),
    }
    for name, change in cases.items():
        yield name, {**base, **change}


def test_fast_path_declines_whatever_it_cannot_prove(rng):
    """None, with every output left untouched; the general path then decides."""
    for name, args in _declined_cases(rng):
        out = args.get("out")
        before = [np.array(o, copy=True) for o in out] if isinstance(out, (tuple, list)) else []
        result = fast(args["x"], args["dy"], args["mean"], args["var"], args["gamma"],
                      args.get("epsilon", 1e-5), out=out, num_threads=args.get("num_threads"))
        assert result is None, name
        if isinstance(out, (tuple, list)):
            for o, b in zip(out, before):
                np.testing.assert_array_equal(o, b, err_msg=name)


def test_fast_path_never_runs_what_the_general_path_refuses(rng, general_only):
    """Every declined case that the general path refuses: the fast path must not be what
    decides it, so each must raise the general path's TypeError/ValueError."""
    refused = 0
    for name, args in _declined_cases(rng):
        if name in ("x a subclass", "x byte-swapped", "x a list"):
            continue            # valid calls the fast path leaves to the general path
        with pytest.raises((TypeError, ValueError)):
            batchnorm_training_backward(args["x"], args["dy"], args["mean"], args["var"],
                                        args["gamma"], epsilon=args.get("epsilon", 1e-5),
                                        out=args.get("out"),
                                        num_threads=args.get("num_threads"))
        refused += 1
    assert refused >= 25


def test_same_dtype_rule_takes_float16_statistics(rng):
    x, dy, mean, var, gamma = make(rng, (4, 6, 5), np.float16, np.float16, axis=1)
    assert fast(x, dy, mean, var, gamma, channel_last=False, graph_rule=False) is not None
    assert fast(x, dy, mean, var, gamma, channel_last=False, graph_rule=True) is None
    got = onednn.batch_norm_training_backprop(x, dy, mean.astype(np.float32),
                                              var.astype(np.float32), gamma.astype(np.float32),
                                              epsilon=1e-5, data_format="NCX")
    assert got[0].dtype == np.float16 and got[1].dtype == np.float32
