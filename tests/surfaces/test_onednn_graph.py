"""``bnbw_native.batchnorm_training_backward``, oneDNN Graph's call (contract §3.1): results,
storage types, out=, inputs left alone, empty tensors, NaN and inf, the result type.  Its
refusals (§6) are in test_refusals.py, its thread counts (§4) in engine/test_thread_counts.py,
its accuracy at 2^24 elements in engine/test_scale_and_accuracy.py.

Every result is compared with the float64 reference computed from the very same (already
rounded) inputs.  Test data have statistics computed from x and a dy with a component along the
normalised x and a non-zero mean, so both correction terms of the training dx are as large as dy
itself: a kernel off by a small formula error (M - 1 for M, a missing term) fails.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bnbw_native
from conftest import BF16, LAYOUTS, make_layout, requires_bf16
from conftest import GRAPH_EPSILON as EPSILON, channel_axis
from conftest import check_graph_result as check_result, graph_case as make_case
from conftest import graph_reference as expected

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)

# One shape per rank; NXC reduces all but the last axis, NCX all but axis 1.  Odd sizes and
# size-1 axes on purpose; at most ~1500 elements, well-conditioned data for assert_close
# (error_bounds.py).
SHAPES = {
    2: (301, 3),
    3: (7, 4, 61),
    4: (3, 5, 6, 7),
    5: (2, 3, 5, 4, 6),
    6: (2, 3, 1, 5, 4, 6),
    7: (2, 3, 2, 1, 5, 3, 4),
    8: (2, 3, 2, 2, 1, 3, 5, 4),
}


def snapshot(arrays):
    return [a.tobytes() for a in arrays]


def dtype_id(dtype):
    return "none" if dtype is None else np.dtype(dtype).name


# ---------------------------------------------------------------------------------------------
# Results against the reference


@pytest.mark.parametrize("num_outputs", [3, 1])
@pytest.mark.parametrize("with_gamma", [True, False], ids=["gamma", "no_gamma"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
@pytest.mark.parametrize("rank", sorted(SHAPES))
def test_matches_reference(rng, rank, data_format, layout, with_gamma, num_outputs):
    case = make_case(rng, SHAPES[rank], data_format, with_gamma=with_gamma)
    strided = {k: None if v is None else make_layout(v, layout) for k, v in case.items()}
    result = bnbw_native.batchnorm_training_backward(
        **strided, epsilon=EPSILON, data_format=data_format, num_outputs=num_outputs)
    check_result(result, expected(case, data_format=data_format, num_outputs=num_outputs),
                 F32, F32, num_outputs)


@pytest.mark.parametrize("dy_layout", LAYOUTS)
@pytest.mark.parametrize("src_layout", LAYOUTS)
def test_src_and_diff_dst_may_have_different_layouts(rng, src_layout, dy_layout):
    case = make_case(rng, (6, 5, 7), "NCX")
    call = dict(case, src=make_layout(case["src"], src_layout),
                diff_dst=make_layout(case["diff_dst"], dy_layout))
    result = bnbw_native.batchnorm_training_backward(**call, epsilon=EPSILON, data_format="NCX")
    check_result(result, expected(case, data_format="NCX"), F32, F32)


def test_default_data_format_is_nxc(rng):
    case = make_case(rng, (4, 5, 3), "NXC")
    default = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON)
    explicit = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON, data_format="NXC")
    assert [a.tobytes() for a in default] == [a.tobytes() for a in explicit]


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_shapes_match_reference(data):
    # Axis 0 is reduced in both formats; at least 8 along it keeps M >= 8, so dx is not mere
    # cancellation noise (for M = 2 the exact dx is 0 and the norm-wise criterion means nothing).
    ndim = data.draw(st.integers(2, 8), label="ndim")
    shape = (data.draw(st.integers(8, 30), label="batch"),) + tuple(
        data.draw(st.lists(st.integers(1, 5), min_size=ndim - 1, max_size=ndim - 1),
                  label="shape"))
    data_format = data.draw(st.sampled_from(["NXC", "NCX"]), label="data_format")
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    case = make_case(np.random.default_rng(seed), shape, data_format)
    strided = {k: make_layout(v, layout) for k, v in case.items()}
    result = bnbw_native.batchnorm_training_backward(**strided, epsilon=EPSILON,
                                                     data_format=data_format)
    check_result(result, expected(case, data_format=data_format), F32, F32)


@pytest.mark.parametrize("epsilon", [1e-3, np.float32(1e-3), np.float64(1e-3), 1],
                         ids=["float", "np.float32", "np.float64", "int"])
def test_epsilon_accepts_real_numbers(rng, epsilon):
    case = make_case(rng, (40, 3))
    result = bnbw_native.batchnorm_training_backward(**case, epsilon=epsilon)
    check_result(result, expected(case, epsilon=epsilon), F32, F32)


def test_epsilon_is_rounded_to_float32(rng):
    # The op takes epsilon as f32: 0.1 and float32(0.1) are the same attribute.
    case = make_case(rng, (40, 3))
    a = bnbw_native.batchnorm_training_backward(**case, epsilon=0.1)
    b = bnbw_native.batchnorm_training_backward(**case, epsilon=np.float32(0.1))
    assert [x.tobytes() for x in a] == [x.tobytes() for x in b]


def test_num_outputs_1_ignores_gamma(rng):
    case = make_case(rng, (30, 4))
    with_gamma = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON, num_outputs=1)
    without = bnbw_native.batchnorm_training_backward(**dict(case, gamma=None), epsilon=EPSILON,
                                                      num_outputs=1)
    assert with_gamma.diff_src.tobytes() == without.diff_src.tobytes()


# ---------------------------------------------------------------------------------------------
# Storage types (contract §2, §3.1)

ACCEPTED_DTYPES = [
    (F32, F32),
    (F16, F32),
    pytest.param(BF16, F32, marks=requires_bf16),
    pytest.param(BF16, BF16, marks=requires_bf16),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
@pytest.mark.parametrize("t1, t2", ACCEPTED_DTYPES, ids=dtype_id)
def test_dtype_combinations(rng, t1, t2, data_format, layout):
    case = make_case(rng, (9, 4, 35), data_format, t1, t2)
    strided = {k: make_layout(v, layout) for k, v in case.items()}
    result = bnbw_native.batchnorm_training_backward(**strided, epsilon=EPSILON,
                                                     data_format=data_format)
    check_result(result, expected(case, data_format=data_format), t1, t2)


@pytest.mark.parametrize("t1, t2", ACCEPTED_DTYPES, ids=dtype_id)
def test_dtype_combinations_num_outputs_1(rng, t1, t2):
    case = make_case(rng, (40, 5), "NXC", t1, t2)
    result = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON, num_outputs=1)
    check_result(result, expected(case, num_outputs=1), t1, t2, num_outputs=1)


# ---------------------------------------------------------------------------------------------
# out= (contract §3.1)


def make_out(case, num_outputs=3, layout="contiguous", fill=7.0):
    """Preallocated outputs filled with a sentinel, in memory layout `layout`."""
    t2 = case["mean"].dtype
    arrays = [np.full(case["src"].shape, fill, case["src"].dtype),
              np.full(case["mean"].shape, fill, t2), np.full(case["mean"].shape, fill, t2)]
    return tuple(make_layout(a, layout) for a in arrays[:num_outputs])


@pytest.mark.parametrize("num_outputs", [3, 1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_is_written_and_returned(rng, layout, num_outputs):
    case = make_case(rng, (7, 4, 9), "NCX")
    fresh = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON, data_format="NCX",
                                                    num_outputs=num_outputs)
    out = make_out(case, num_outputs, layout)
    result = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON, data_format="NCX",
                                                     num_outputs=num_outputs, out=out)
    for got, given_out, want in zip(result, out, fresh):
        assert got is given_out and np.shares_memory(got, given_out)
        assert got.tobytes() == want.tobytes()


def test_out_may_be_a_list(rng):
    case = make_case(rng, (30, 4))
    out = list(make_out(case))
    result = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON, out=out)
    assert all(got is given_out for got, given_out in zip(result, out))
    check_result(result, expected(case), F32, F32)


@pytest.mark.parametrize("num_outputs", [3, 1])
@pytest.mark.parametrize("alias", ["same_object", "identical_view"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "negative"])
def test_in_place_diff_src_over_diff_dst(rng, layout, alias, num_outputs):
    # In place: the same address, dtype, shape and strides, whether or not the same object.
    case = make_case(rng, (5, 6, 11), "NCX")
    case["diff_dst"] = make_layout(case["diff_dst"], layout)
    fresh = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON, data_format="NCX",
                                                    num_outputs=num_outputs)
    diff_src = case["diff_dst"] if alias == "same_object" else case["diff_dst"].view()
    out = (diff_src,) + make_out(case, num_outputs)[1:]
    result = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON, data_format="NCX",
                                                     num_outputs=num_outputs, out=out)
    assert result.diff_src is diff_src
    assert [a.tobytes() for a in result if a is not None] == [
        a.tobytes() for a in fresh if a is not None]


@pytest.mark.parametrize("layout", ["contiguous", "sliced"])
def test_disjoint_interleaved_outputs_are_accepted(rng, layout):
    # "Must not overlap" is about memory actually shared: diff_gamma and diff_beta interleaved
    # in one buffer (even and odd elements) share none.
    case = make_case(rng, (40, 5))
    buffer = make_layout(np.full(10, 7.0, np.float32), layout)
    out = (make_out(case)[0], buffer[0::2], buffer[1::2])
    result = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON, out=out)
    check_result(result, expected(case), F32, F32)


def test_diff_src_interleaved_with_diff_dst_is_accepted(rng):
    case = make_case(rng, (40, 5))
    buffer = np.empty((40, 10), np.float32)
    buffer[:, 0::2] = case["diff_dst"]
    buffer[:, 1::2] = 7.0
    case["diff_dst"] = buffer[:, 0::2]
    out = (buffer[:, 1::2],) + make_out(case)[1:]
    result = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON, out=out)
    check_result(result, expected(case), F32, F32)


# ---------------------------------------------------------------------------------------------
# Inputs


@pytest.mark.parametrize("layout", ["contiguous", "negative"])
@pytest.mark.parametrize("writeable", [False, True], ids=["read_only", "writeable"])
def test_inputs_are_never_modified(rng, writeable, layout):
    case = make_case(rng, (6, 4, 9), "NCX")
    case = {k: make_layout(v, layout) for k, v in case.items()}
    for a in case.values():
        a.flags.writeable = writeable
    before = snapshot(case.values())
    result = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON, data_format="NCX")
    assert snapshot(case.values()) == before
    check_result(result, expected(case, data_format="NCX"), F32, F32)


# ---------------------------------------------------------------------------------------------
# Empty tensors (contract §1: M = 0 gives an empty dx and zero parameter gradients)

EMPTY_CASES = [
    pytest.param((0, 4), "NXC", id="M0-nxc"),
    pytest.param((2, 0, 4), "NXC", id="M0-nxc-rank3"),
    pytest.param((0, 4, 5), "NCX", id="M0-ncx"),
    pytest.param((3, 4, 0), "NCX", id="M0-ncx-spatial"),
    pytest.param((5, 0), "NXC", id="C0-nxc"),
    pytest.param((5, 0, 3), "NCX", id="C0-ncx"),
]


def empty_case(shape, data_format):
    c = shape[channel_axis(len(shape), data_format)]
    return dict(src=np.zeros(shape, np.float32), diff_dst=np.zeros(shape, np.float32),
                mean=np.zeros(c, np.float32), variance=np.ones(c, np.float32),
                gamma=np.ones(c, np.float32))


@pytest.mark.parametrize("num_outputs", [3, 1])
@pytest.mark.parametrize("shape, data_format", EMPTY_CASES)
def test_empty_tensors(shape, data_format, num_outputs):
    case = empty_case(shape, data_format)
    result = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON,
                                                     data_format=data_format,
                                                     num_outputs=num_outputs)
    assert result.diff_src.shape == shape and result.diff_src.dtype == F32
    if num_outputs == 3:
        c = len(case["mean"])
        for grad in (result.diff_gamma, result.diff_beta):
            assert grad.dtype == F32
            np.testing.assert_array_equal(grad, np.zeros(c, np.float32))


@pytest.mark.parametrize("shape, data_format", EMPTY_CASES)
def test_empty_batch_writes_zero_gradients_into_out(shape, data_format):
    case = empty_case(shape, data_format)
    out = make_out(case)
    result = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON,
                                                     data_format=data_format, out=out)
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(out[2], 0.0)
    assert result.diff_gamma is out[1] and result.diff_beta is out[2]


# ---------------------------------------------------------------------------------------------
# NaN and inf stay in their channel (contract §1)


@pytest.mark.parametrize("num_outputs", [3, 1])
@pytest.mark.parametrize("argument, value", [
    ("src", np.nan), ("src", np.inf), ("diff_dst", np.nan), ("diff_dst", -np.inf),
    ("mean", np.nan), ("variance", np.nan), ("variance", np.inf), ("gamma", np.nan),
], ids=lambda v: str(v))
@pytest.mark.parametrize("shape, data_format", [((64, 4), "NXC"), ((8, 4, 8), "NCX")])
def test_non_finite_values_stay_in_their_channel(rng, shape, data_format, argument, value,
                                                 num_outputs):
    bad = 2
    case = make_case(rng, shape, data_format)
    if case[argument].ndim == 1:
        case[argument][bad] = value
    else:
        index = [3] * len(shape)
        index[channel_axis(len(shape), data_format)] = bad
        case[argument][tuple(index)] = value
    result = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON,
                                                     data_format=data_format,
                                                     num_outputs=num_outputs)
    ref = expected(case, data_format=data_format, num_outputs=num_outputs)
    # assert_close requires non-finite results exactly where the reference has them.
    check_result(result, ref, F32, F32, num_outputs)
    good = np.delete(result.diff_src, bad, axis=channel_axis(len(shape), data_format))
    assert np.isfinite(good).all()
    if num_outputs == 3:
        assert np.isfinite(np.delete(result.diff_gamma, bad)).all()
        assert np.isfinite(np.delete(result.diff_beta, bad)).all()


# ---------------------------------------------------------------------------------------------
# Result type


def test_result_is_a_named_tuple(rng):
    result = bnbw_native.batchnorm_training_backward(**make_case(rng, (10, 3)), epsilon=EPSILON)
    assert isinstance(result, bnbw_native.BackwardResult) and isinstance(result, tuple)
    assert bnbw_native.BackwardResult._fields == ("diff_src", "diff_gamma", "diff_beta")
    diff_src, diff_gamma, diff_beta = result
    assert diff_src is result.diff_src and diff_gamma is result.diff_gamma
    assert diff_beta is result.diff_beta


def test_num_outputs_1_result_has_none_gradients(rng):
    result = bnbw_native.batchnorm_training_backward(**make_case(rng, (10, 3)), epsilon=EPSILON,
                                                     num_outputs=1)
    assert isinstance(result, bnbw_native.BackwardResult) and len(result) == 3
    assert result.diff_gamma is None and result.diff_beta is None


def test_an_infinite_gamma_times_r_gives_no_finite_dx_in_its_channel_only():
    """Where gamma * r is not finite (gamma = +-inf, or variance + epsilon rounding to 0) dx is
    not finite in that channel (NaN or +-inf: the engine adds the infinite terms of
    gamma*r*dy + k2*(x - mean) + k3 one by one; docs/contract.md).  dgamma and dbeta follow
    IEEE; other channels are unaffected."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 3)).astype(np.float32)
    dy = rng.standard_normal((6, 3)).astype(np.float32)
    mean, var = x.mean(0), x.var(0)
    gamma = np.array([np.inf, 1, -np.inf], np.float32)
    got = bnbw_native.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPSILON)
    assert not np.isfinite(got.diff_src[:, [0, 2]]).any()
    assert np.isfinite(got.diff_src[:, 1]).all()
    assert np.isfinite(got.diff_gamma).all() and np.isfinite(got.diff_beta).all()
    var[1] = -np.float32(EPSILON)            # variance + epsilon == 0: r = inf
    got = bnbw_native.batchnorm_training_backward(x, dy, mean, var, epsilon=EPSILON)
    assert not np.isfinite(got.diff_src[:, 1]).any()
    assert np.isfinite(got.diff_src[:, [0, 2]]).all()
    assert np.isinf(got.diff_gamma[1])
