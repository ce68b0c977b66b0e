"""Thread counts (contract 1 and 4): a result is bit-identical for every num_threads, under
the package default (`set_num_threads`) and under OpenMP's (threadpoolctl), on calls big enough
to be split into several reduction blocks, every storage type and layout; and what
`set_num_threads` / `get_num_threads` say.

The calls are oneDNN Graph calls (conftest.graph_case); other surfaces' thread-count checks sit
with them (surfaces/test_directml.py, surfaces/test_front_ends.py, surfaces/test_half.py), and
which schedule each count takes is in test_schedules.py.
"""
import functools

import numpy as np
import pytest

import bnbw_native
from bnbw_native import _engine, tuning
from conftest import BF16, GRAPH_EPSILON as EPSILON, check_graph_result as check_result
from conftest import graph_case as make_case, graph_reference as expected, make_layout
from conftest import requires_bf16

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)


# Big enough to be split into several reduction blocks.
THREAD_CASES = [
    pytest.param((3, 5, 70000), "NCX", F32, "contiguous", id="ncx-3x5x70000"),
    pytest.param((70000, 7), "NXC", F32, "contiguous", id="nxc-70000x7"),
    pytest.param((1 << 18, 1), "NXC", F32, "contiguous", id="nxc-one-channel"),
    pytest.param((70000, 7), "NXC", F32, "transposed", id="nxc-70000x7-transposed"),
    pytest.param((3, 5, 70000), "NCX", F32, "negative", id="ncx-3x5x70000-negative"),
    pytest.param((70000, 7), "NXC", F16, "contiguous", id="nxc-70000x7-f16"),
    pytest.param((3, 5, 70000), "NCX", BF16, "contiguous", id="ncx-3x5x70000-bf16",
                 marks=requires_bf16),
]


@functools.cache
def big_case(shape, data_format, t1, layout="contiguous"):
    case = make_case(np.random.default_rng(sum(shape)), shape, data_format, t1,
                     BF16 if t1 == BF16 else F32)
    return {k: make_layout(v, layout) for k, v in case.items()}


@functools.cache
def one_thread_bytes(shape, data_format, t1, layout="contiguous"):
    result = bnbw_native.batchnorm_training_backward(
        **big_case(shape, data_format, t1, layout), epsilon=EPSILON, data_format=data_format,
        num_threads=1)
    return [a.tobytes() for a in result]


@pytest.fixture
def default_threads():
    """Start and end with the initial setting: follow OpenMP."""
    bnbw_native.set_num_threads(None)
    yield
    bnbw_native.set_num_threads(None)


@pytest.mark.parametrize("num_threads", [2, 3, 4, None])
@pytest.mark.parametrize("shape, data_format, t1, layout", THREAD_CASES)
def test_bit_identical_for_every_thread_count(default_threads, shape, data_format, t1, layout,
                                              num_threads):
    result = bnbw_native.batchnorm_training_backward(
        **big_case(shape, data_format, t1, layout), epsilon=EPSILON, data_format=data_format,
        num_threads=num_threads)
    assert [a.tobytes() for a in result] == one_thread_bytes(shape, data_format, t1, layout)


@pytest.mark.parametrize("package_default", [1, 3])
def test_set_num_threads_result_is_bit_identical(default_threads, package_default):
    shape, data_format = (70000, 7), "NXC"
    bnbw_native.set_num_threads(package_default)
    result = bnbw_native.batchnorm_training_backward(
        **big_case(shape, data_format, F32), epsilon=EPSILON, data_format=data_format)
    assert [a.tobytes() for a in result] == one_thread_bytes(shape, data_format, F32)


@pytest.mark.parametrize("shape, data_format, t1, layout", THREAD_CASES)
def test_large_shapes_match_reference(shape, data_format, t1, layout):
    case = big_case(shape, data_format, t1, layout)
    t2 = BF16 if t1 == BF16 else F32
    result = bnbw_native.batchnorm_training_backward(**case, epsilon=EPSILON,
                                                     data_format=data_format)
    check_result(result, expected(case, data_format=data_format), t1, t2)


def test_set_num_threads_sets_the_default(default_threads):
    bnbw_native.set_num_threads(2)
    assert bnbw_native.get_num_threads() == 2


def test_set_num_threads_none_restores_following_openmp(default_threads):
    following = bnbw_native.get_num_threads()
    bnbw_native.set_num_threads(following + 1)
    bnbw_native.set_num_threads(None)
    assert bnbw_native.get_num_threads() == following


def test_get_num_threads_follows_threadpool_limits(default_threads):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    with threadpoolctl.threadpool_limits(1):
        assert bnbw_native.get_num_threads() == 1


def test_set_num_threads_wins_over_openmp(default_threads):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    bnbw_native.set_num_threads(2)
    with threadpoolctl.threadpool_limits(1):
        assert bnbw_native.get_num_threads() == 2


def test_threads_above_the_cpus_run_on_the_cpus():
    """A call runs on at most the CPUs the process may use (tests otherwise plan as on 64)."""
    tuning.set_cpu_model(0)
    try:
        assert bnbw_native.get_num_threads() <= _engine.cpu_count()
        assert _engine.threads_for(10 ** 4) == _engine.cpu_count()
    finally:
        tuning.set_cpu_model(64)
