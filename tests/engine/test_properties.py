"""Property-based tests (hypothesis): every convention, dtype and memory layout against the float64
reference, and bit-identical for every thread count (contract 1, 3, 4, 7).

Shapes: rank 1 to 8 (2 to 8 for the oneDNN-style fronts), sizes 1 and primes, now and then one
large prime dim so that the work is split across threads and into several reduction blocks.
Layouts: any memory order, steps (negative too, except where a DirectML descriptor cannot
express them), offsets into NaN-filled buffers (a stray read shows), zero strides from
np.broadcast_to (read-only inputs).  Outputs, when preallocated, sit in sentinel-filled buffers
whose gaps must stay untouched.  Each example runs twice with two random thread counts and must
give the same bytes; results are checked with the rigorous bounds of error_bounds.py.

Profiles: "fast" (the default run) and "thorough" (thousands of examples), chosen with
BNBW_HYPOTHESIS_PROFILE=thorough; every test has a slow-marked twin named ``..._thorough`` that
always runs "thorough"::

    BNBW_HYPOTHESIS_PROFILE=thorough pytest tests/engine/test_properties.py     # every test, thorough
    pytest -m slow tests/engine/test_properties.py                              # the thorough twins
"""
import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bnbw_native
from bnbw_native import dml, ngraph, intel_spec
from error_bounds import (ARITH, BF16, BLOCKED_SUMS, F16, F32, SUMS, Sentinel, assert_within,
                          expected, same_bits, strided)

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
          HealthCheck.large_base_example]
settings.register_profile("fast", max_examples=40, deadline=None, suppress_health_check=_QUIET,
                          print_blob=True)
settings.register_profile("thorough", max_examples=2500, deadline=None,
                          suppress_health_check=_QUIET, print_blob=True)
PROFILE = os.environ.get("BNBW_HYPOTHESIS_PROFILE", "fast")
if PROFILE not in ("fast", "thorough"):
    raise ValueError(f"BNBW_HYPOTHESIS_PROFILE must be 'fast' or 'thorough', got {PROFILE!r}")

SIZES = st.sampled_from([1, 1, 2, 3, 5, 7, 11, 13])      # 1 and primes
BIG_SIZES = st.sampled_from([127, 1031, 4099, 65539])     # past TILE, BLOCK, SERIAL_BELOW
THREADS = st.sampled_from([None, 1, 2, 3, 4, 7])
EPSILONS = st.sampled_from([1e-5, 1e-3, 0.5, 2.0])
SMALL_LIMIT, BIG_LIMIT = 3000, 140_000

GRAPH_TYPES = [(F32, F32), (F16, F32)] + ([(BF16, F32), (BF16, BF16)] if BF16 else [])
SAME_TYPES = [F32, F16] + ([BF16] if BF16 else [])


# the settings of the default tests and of their slow "_thorough" twins
SELECTED = settings(settings.get_profile(PROFILE))
THOROUGH = settings(settings.get_profile("thorough"))


# ---- strategies -------------------------------------------------------------------------

@st.composite
def shapes(draw, min_rank, max_rank):
    rank = draw(st.integers(min_rank, max_rank))
    shape = [draw(SIZES) for _ in range(rank)]
    big = None
    if draw(st.integers(0, 3)) == 0:
        big = draw(st.integers(0, rank - 1))
        shape[big] = draw(BIG_SIZES)
    limit = BIG_LIMIT if big is not None else SMALL_LIMIT
    while math.prod(shape) > limit:
        others = [d for d in range(rank) if d != big and shape[d] > 1]
        if others:
            shape[max(others, key=lambda d: shape[d])] = 1
        else:
            shape[big] = 1031
    return tuple(shape)


@st.composite
def layouts(draw, ndim, negative=True, broadcast=True):
    """A recipe for error_bounds.strided: memory order, steps, broadcast dims."""
    perm = tuple(draw(st.permutations(range(ndim))))
    step_choices = [1, 1, 1, 2, 3] + ([-1, -1, -2] if negative else [])
    steps = tuple(draw(st.sampled_from(step_choices)) for _ in range(ndim))
    bcast = tuple(draw(st.sampled_from([False] * 5 + [True])) if broadcast else False
                  for _ in range(ndim))
    return dict(perm=perm, steps=steps, broadcast=bcast)


def out_layouts(ndim, negative=True):
    """A recipe for an output view (error_bounds.Sentinel): no broadcast dims."""
    return layouts(ndim, negative=negative, broadcast=False).map(
        lambda r: {k: v for k, v in r.items() if k != "broadcast"})


# ---- data ----------------------------------------------------------------------------------

def big_values(rng, shape, t1, axis_shape):
    """x ~ N(3, 2); dy correlated with x (so the training correction terms matter)."""
    x = rng.normal(3.0, 2.0, shape)
    dy = 1.5 * (x - 3.0) / 2.0 + 0.5 + rng.normal(0.0, 1.0, shape)
    return x.astype(np.float32).astype(t1), dy.astype(np.float32).astype(t1)


def stats_for(rng, x, axes, t2, keepdims):
    """mean near x's mean, variance near x's (never 0), gamma ~ N(1, 0.5), beta ~ N(0, 1)."""
    x64 = np.asarray(x).astype(np.float64)
    mu = x64.mean(axis=axes, keepdims=True)
    sd = x64.std(axis=axes, keepdims=True)
    mean = mu + 0.1 * sd * rng.normal(size=mu.shape)
    var = sd ** 2 * rng.uniform(0.5, 1.5, size=mu.shape) + 0.05
    gamma = rng.normal(1.0, 0.5, size=mu.shape)
    beta = rng.normal(0.0, 1.0, size=mu.shape)
    out = [a.astype(np.float32).astype(t2) for a in (mean, var, gamma, beta)]
    return out if keepdims else [a.reshape(-1) for a in out]


def f16_safe(dy, count, t2):
    """Keep f16 parameter gradients (up to ~M in size) below f16's 65504."""
    if t2 == F16 and count > 8192:
        return (np.asarray(dy).astype(np.float32) * (8192.0 / count)).astype(dy.dtype)
    return dy


def snapshot(*arrays):
    return [None if a is None else np.asarray(a).tobytes() for a in arrays]


def stat_layout(draw, vec):
    """A 1-D statistics vector as a random view (stride 0 when it has one element)."""
    return strided(vec, steps=(draw(st.sampled_from([1, 2, -1, -3])),))


# ---- oneDNN Graph, Intel spec, nGraph -------------------------------------------------------

FRONTS = ["graph3", "graph1", "intel", "ngraph"]


def _array_front_case(data, front):
    shape = data.draw(shapes(2, 8), label="shape")
    nd = len(shape)
    if front == "ngraph":
        t = data.draw(st.sampled_from(SAME_TYPES), label="dtype")
        t1 = t2 = t
        data_format = "NCX"
    else:
        t1, t2 = data.draw(st.sampled_from(GRAPH_TYPES), label="t1, t2")
        data_format = data.draw(st.sampled_from(["NXC", "NCX"]), label="data_format")
    axis = 1 if data_format == "NCX" else nd - 1
    axes = tuple(d for d in range(nd) if d != axis)
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    xv, dyv = big_values(rng, shape, t1, axis)
    x = strided(xv, **data.draw(layouts(nd), label="x layout"))
    dy = strided(dyv, **data.draw(layouts(nd), label="dy layout"))
    count = math.prod(shape) // shape[axis]
    dy = f16_safe(dy, count, t2) if t2 == F16 else dy
    mean, var, gamma, beta = stats_for(rng, x, axes, t2, keepdims=False)
    mean, var, gamma, beta = (stat_layout(data.draw, v) for v in (mean, var, gamma, beta))
    if front != "ngraph" and data.draw(st.booleans(), label="gamma None"):
        gamma = None
    return dict(shape=shape, t1=t1, t2=t2, data_format=data_format, axis=axis, axes=axes,
                x=x, dy=dy, mean=mean, var=var, gamma=gamma, beta=beta)


def _call_front(front, c, out, num_threads, eps):
    if front in ("graph3", "graph1"):
        return bnbw_native.batchnorm_training_backward(
            c["x"], c["dy"], c["mean"], c["var"], c["gamma"], epsilon=eps,
            data_format=c["data_format"], num_outputs=3 if front == "graph3" else 1, out=out,
            num_threads=num_threads)
    if front == "intel":
        return intel_spec.batch_norm_training_backprop(
            c["x"], c["dy"], c["mean"], c["var"], c["gamma"], epsilon=eps,
            data_format=c["data_format"], out=out, num_threads=num_threads)
    return ngraph.batch_norm_training_backprop(c["x"], c["gamma"], c["beta"], c["mean"],
                                               c["var"], c["dy"], epsilon=eps, out=out,
                                               num_threads=num_threads)


def _check_array_front(front, data):
    c = _array_front_case(data, front)
    eps = data.draw(EPSILONS, label="epsilon")
    nd, axis = len(c["shape"]), c["axis"]
    out_mode = data.draw(st.sampled_from(["none", "out", "in_place"]), label="out")
    if out_mode == "in_place" and not c["dy"].flags.writeable:
        out_mode = "out"
    dx_recipe = data.draw(out_layouts(nd), label="dx layout")
    n_out = 1 if front == "graph1" else 3
    C = c["shape"][axis]
    dy_values = np.array(c["dy"])
    ref_in = [np.array(c[k]) if c[k] is not None else None
              for k in ("x", "dy", "mean", "var", "gamma")]
    keep = [1] * nd
    keep[axis] = C
    stats = [None if a is None else a.reshape(keep) for a in ref_in[2:]]
    formula = "frozen" if front == "graph1" else "training"
    scale = None if front == "graph1" else stats[2]
    (rdx, rds, rdb), (bdx, bds, bdb) = expected(ref_in[0], ref_in[1], stats[0], stats[1], scale,
                                                epsilon=eps, axes=c["axes"], formula=formula)
    inputs_before = snapshot(c["x"], c["mean"], c["var"], c["gamma"], c["beta"])

    def run(num_threads):
        sentinels = []
        out = None
        if out_mode == "out":
            sentinels = [Sentinel(c["shape"], c["t1"], **dx_recipe)]
            sentinels += [Sentinel((C,), c["t2"], steps=(s,)) for s in (2, -1)][:n_out - 1]
            out = tuple(s.view for s in sentinels)
        elif out_mode == "in_place":
            c["dy"][...] = dy_values
            out = (c["dy"],) + tuple(np.empty(C, c["t2"]) for _ in range(n_out - 1))
        result = _call_front(front, c, out, num_threads, eps)
        if out is not None:
            assert all(r is o for r, o in zip(result, out)), "out= not returned"
        for s in sentinels:
            assert s.gaps_untouched(), "a write landed outside an output view"
        return tuple(None if r is None else r.copy() for r in result)

    threads = (data.draw(THREADS, label="threads a"), data.draw(THREADS, label="threads b"))
    first, second = run(threads[0]), run(threads[1])
    assert same_bits(first, second), f"results differ between num_threads {threads}"
    assert snapshot(c["x"], c["mean"], c["var"], c["gamma"], c["beta"]) == inputs_before
    if out_mode != "in_place":
        assert np.array(c["dy"]).tobytes() == dy_values.tobytes(), "diff_dst was modified"
    assert_within(first[0], rdx, bdx, c["t1"], "dx")
    if n_out == 3:
        assert_within(first[1], rds.reshape(-1), bds.reshape(-1), c["t2"], "dscale")
        assert_within(first[2], rdb.reshape(-1), bdb.reshape(-1), c["t2"], "dbias")
    else:
        assert first[1] is None and first[2] is None


@pytest.mark.parametrize("front", FRONTS)
@SELECTED
@given(data=st.data())
def test_array_front_matches_reference(front, data):
    _check_array_front(front, data)


@pytest.mark.slow
@pytest.mark.parametrize("front", FRONTS)
@THOROUGH
@given(data=st.data())
def test_array_front_matches_reference_thorough(front, data):
    _check_array_front(front, data)


# ---- two phases (contract 7): shards along axis 0, global sums, per-shard apply -----------------

def _check_two_phase(data):
    c = _array_front_case(data, "graph3")
    eps = data.draw(EPSILONS, label="epsilon")
    shape, axis = c["shape"], c["axis"]
    split = data.draw(st.integers(0, shape[0]), label="split")
    threads = (data.draw(THREADS, label="threads a"), data.draw(THREADS, label="threads b"))
    shards = [slice(0, split), slice(split, shape[0])]
    keep = [1] * len(shape)
    keep[axis] = shape[axis]
    ref_in = [None if c[k] is None else np.array(c[k]) for k in ("x", "dy", "mean", "var",
                                                                 "gamma")]
    stats = [None if a is None else a.reshape(keep) for a in ref_in[2:]]
    (rdx, rds, rdb), (bdx, bds, bdb) = expected(ref_in[0], ref_in[1], *stats, epsilon=eps,
                                                axes=c["axes"], formula="training")

    def run(nt):
        parts = [bnbw_native.backward_reduce(c["x"][s], c["dy"][s], c["mean"],
                                             data_format=c["data_format"], num_threads=nt)
                 for s in shards]
        for p, _ in parts:
            assert p.dtype == np.float64 and p.shape == (2, shape[axis]) and p.flags.c_contiguous
        total = parts[0][0] + parts[1][0]
        count = parts[0][1] + parts[1][1]
        assert count == math.prod(shape) // shape[axis]
        results = [bnbw_native.backward_apply(c["x"][s], c["dy"][s], c["mean"], c["var"],
                                              c["gamma"], total, count, epsilon=eps,
                                              data_format=c["data_format"], num_threads=nt)
                   for s in shards]
        return total, results

    (total_a, res_a), (total_b, res_b) = run(threads[0]), run(threads[1])
    assert same_bits(total_a, total_b) and same_bits(res_a, res_b), threads
    # the sums themselves: Sum dy and Sum (x - mean) dy around the given mean
    x64, g64 = ref_in[0], ref_in[1].astype(np.float64)
    centered = x64.astype(np.float64) - stats[0].astype(np.float64)
    want_g = g64.sum(axis=c["axes"]).reshape(-1)
    want_xg = (centered * g64).sum(axis=c["axes"]).reshape(-1)
    # f64 sums of f32 terms; f16/bf16 storage sums f32 blocks first (error_bounds.BLOCKED_SUMS),
    # and (x - mean) is rounded to f32 before its product
    blocked = c["t1"] != F32
    tol_g = ((BLOCKED_SUMS if blocked else SUMS) * np.abs(g64).sum(axis=c["axes"]).reshape(-1)
             + 1e-300)
    tol_xg = ((ARITH + (BLOCKED_SUMS if blocked else 0.0))
              * np.abs(centered * g64).sum(axis=c["axes"]).reshape(-1) + 1e-300)
    assert np.all(np.abs(total_a[0] - want_g) <= tol_g), (total_a[0], want_g)
    assert np.all(np.abs(total_a[1] - want_xg) <= tol_xg), (total_a[1], want_xg)
    dx = np.concatenate([r.diff_src for r in res_a], axis=0)
    assert_within(dx, rdx, bdx, c["t1"], "dx")
    for r in res_a:
        assert_within(r.diff_gamma, rds.reshape(-1), bds.reshape(-1), c["t2"], "dscale")
        assert_within(r.diff_beta, rdb.reshape(-1), bdb.reshape(-1), c["t2"], "dbias")


@SELECTED
@given(data=st.data())
def test_two_phase_matches_reference(data):
    _check_two_phase(data)


@pytest.mark.slow
@THOROUGH
@given(data=st.data())
def test_two_phase_matches_reference_thorough(data):
    _check_two_phase(data)


# ---- DirectML: conveniences (any strides) and operators (descriptors) ------------------------

def _dml_case(data, negative):
    shape = data.draw(shapes(1, 8), label="shape")
    nd = len(shape)
    reduced = tuple(data.draw(st.lists(st.booleans(), min_size=nd, max_size=nd),
                              label="reduced dims"))
    t = data.draw(st.sampled_from(SAME_TYPES), label="dtype")
    axes = tuple(d for d in range(nd) if reduced[d])
    stats_shape = tuple(1 if r else n for r, n in zip(reduced, shape))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    xv, dyv = big_values(rng, shape, t, None)
    x = strided(xv, **data.draw(layouts(nd, negative=negative), label="x layout"))
    dy = strided(dyv, **data.draw(layouts(nd, negative=negative), label="dy layout"))
    count = math.prod(shape[d] for d in axes)
    dy = f16_safe(dy, count, t)
    if axes:
        mean, var, scale, _ = stats_for(rng, x, axes, t, keepdims=True)
    else:      # nothing reduced: every element is its own statistics element
        mean = (np.asarray(x).astype(np.float64) + rng.normal(0, 0.1, shape)).astype(
            np.float32).astype(t)
        var = rng.uniform(0.1, 2.0, shape).astype(np.float32).astype(t)
        scale = rng.normal(1.0, 0.5, shape).astype(np.float32).astype(t)
    stats = [strided(a, **data.draw(layouts(nd, negative=negative), label=f"{n} layout"))
             for n, a in (("mean", mean), ("variance", var), ("scale", scale))]
    return dict(shape=shape, stats_shape=stats_shape, t=t, axes=axes, x=x, dy=dy,
                mean=stats[0], var=stats[1], scale=stats[2])


def _check_dml_convenience(formula, data):
    c = _dml_case(data, negative=True)
    eps = data.draw(EPSILONS, label="epsilon")
    function = {"frozen": dml.batch_normalization_grad,
                "training": dml.batch_normalization_training_grad}[formula]
    args = [c[k] for k in ("x", "dy", "mean", "var", "scale")]
    before = snapshot(*args)
    ref, bounds = expected(*[np.array(a) for a in args], epsilon=eps, axes=c["axes"],
                           formula=formula)
    threads = (data.draw(THREADS, label="threads a"), data.draw(THREADS, label="threads b"))
    first = function(*args, eps, num_threads=threads[0])
    second = function(*args, eps, num_threads=threads[1])
    assert same_bits(first, second), threads
    assert snapshot(*args) == before
    assert first[0].shape == c["shape"]
    assert first[1].shape == first[2].shape == c["stats_shape"]
    for got, want, bound, what in zip(first, ref, bounds, ("dx", "dscale", "dbias")):
        assert_within(got, want, bound, c["t"], what)


def _check_dml_operator(formula, data):
    c = _dml_case(data, negative=False)
    eps = data.draw(EPSILONS, label="epsilon")
    nd = len(c["shape"])
    cls = {"frozen": dml.BatchNormalizationGrad,
           "training": dml.BatchNormalizationTrainingGrad}[formula]
    in_place = data.draw(st.booleans(), label="in place") and c["dy"].flags.writeable
    dx_recipe = data.draw(out_layouts(nd, negative=False), label="dx layout")
    ds_recipe = data.draw(out_layouts(nd, negative=False), label="dscale layout")
    inputs = [c[k] for k in ("x", "dy", "mean", "var", "scale")]
    dy_values = np.array(c["dy"])
    before = snapshot(c["x"], c["mean"], c["var"], c["scale"])
    ref, bounds = expected(*[np.array(a) for a in inputs], epsilon=eps, axes=c["axes"],
                           formula=formula)
    probe = Sentinel(c["shape"], c["t"], **dx_recipe)
    dstat = Sentinel(c["stats_shape"], c["t"], **ds_recipe)
    descs = [dml.TensorDesc.from_array(a) for a in inputs]
    out_descs = [dml.TensorDesc.from_array(c["dy"] if in_place else probe.view),
                 dml.TensorDesc.from_array(dstat.view),
                 dml.TensorDesc.from_array(np.empty(c["stats_shape"], c["t"]))]
    op = cls(**dict(zip(dml.MEMBERS, descs + out_descs)), epsilon=eps)
    assert op.count == math.prod(c["shape"][d] for d in c["axes"])

    def bind(a):
        return a if a.flags.c_contiguous or a.flags.f_contiguous else a.ctypes.data

    def run(nt):
        if in_place:
            c["dy"][...] = dy_values
            dx = c["dy"]
        else:
            out = Sentinel(c["shape"], c["t"], **dx_recipe)
            dx = out.view
        ds = Sentinel(c["stats_shape"], c["t"], **ds_recipe)
        db = np.full(c["stats_shape"], np.nan, c["t"])
        op.execute(**dict(zip(dml.MEMBERS, [bind(a) for a in inputs]
                              + [dx.ctypes.data, ds.view.ctypes.data, db])),
                   num_threads=nt)
        assert ds.gaps_untouched() and (in_place or out.gaps_untouched())
        return dx.copy(), ds.view.copy(), db

    threads = (data.draw(THREADS, label="threads a"), data.draw(THREADS, label="threads b"))
    first, second = run(threads[0]), run(threads[1])
    assert same_bits(first, second), threads
    assert snapshot(c["x"], c["mean"], c["var"], c["scale"]) == before
    for got, want, bound, what in zip(first, ref, bounds, ("dx", "dscale", "dbias")):
        assert_within(got, want, bound, c["t"], what)


FORMULAS = ["frozen", "training"]


@pytest.mark.parametrize("formula", FORMULAS)
@SELECTED
@given(data=st.data())
def test_dml_convenience_matches_reference(formula, data):
    _check_dml_convenience(formula, data)


@pytest.mark.slow
@pytest.mark.parametrize("formula", FORMULAS)
@THOROUGH
@given(data=st.data())
def test_dml_convenience_matches_reference_thorough(formula, data):
    _check_dml_convenience(formula, data)


@pytest.mark.parametrize("formula", FORMULAS)
@SELECTED
@given(data=st.data())
def test_dml_operator_matches_reference(formula, data):
    _check_dml_operator(formula, data)


@pytest.mark.slow
@pytest.mark.parametrize("formula", FORMULAS)
@THOROUGH
@given(data=st.data())
def test_dml_operator_matches_reference_thorough(formula, data):
    _check_dml_operator(formula, data)
