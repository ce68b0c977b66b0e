"""The float64 reference itself, checked against independent computations.

A hand-derived case, central finite differences of the forward loss, and PyTorch's
``native_batch_norm_backward`` in float64.  Everything else in the suite trusts this module.
"""
import numpy as np
import pytest

from bnbw_native import reference
from conftest import BF16, requires_bf16

# ---------------------------------------------------------------------------------------------
# A hand-derived case: two channels, M = 2, every number exact in binary.
#   channel 0: x = [1, 3], dy = [1, 3], mean 2, variance 3.75, gamma 2; eps 0.25 -> r = 1/2
#     dbeta = 4, dgamma = r * ((-1)(1) + (1)(3)) = 1
#     training dx = 2 * 1/2 * (dy - 4/2 - (x - 2) * 1/2 * 1/2) = [-0.75, 0.75]
#     frozen dx = gamma * r * dy = [1, 3]
#   channel 1: x = [4, 4], dy = [1, -1], mean 4, variance 0, gamma -1; r = 2
#     dbeta = 0, dgamma = 0, dx (both formulas) = -2 * dy = [-2, 2]

HAND = dict(
    src=np.array([[1.0, 4.0], [3.0, 4.0]], dtype=np.float32),
    diff_dst=np.array([[1.0, 1.0], [3.0, -1.0]], dtype=np.float32),
    mean=np.array([2.0, 4.0], dtype=np.float32),
    variance=np.array([3.75, 0.0], dtype=np.float32),
    gamma=np.array([2.0, -1.0], dtype=np.float32),
)
HAND_EPSILON = 0.25
HAND_TRAINING = (np.array([[-0.75, -2.0], [0.75, 2.0]]), np.array([1.0, 0.0]),
                 np.array([4.0, 0.0]))
HAND_FROZEN_DX = np.array([[1.0, -2.0], [3.0, 2.0]])
HAND_UNSCALED_FROZEN_DX = np.array([[0.5, 2.0], [1.5, -2.0]])  # num_outputs=1: gamma ignored


def test_hand_case_training_nxc():
    dx, dgamma, dbeta = reference.batchnorm_training_backward(**HAND, epsilon=HAND_EPSILON)
    for got, want in zip((dx, dgamma, dbeta), HAND_TRAINING):
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, want)


def test_hand_case_training_ncx():
    # The same numbers with the channel on axis 1 of a rank-3 tensor (N=2, C=2, W=1).
    ncx = {k: (v.reshape(2, 2, 1) if v.ndim == 2 else v) for k, v in HAND.items()}
    dx, dgamma, dbeta = reference.batchnorm_training_backward(
        **ncx, epsilon=HAND_EPSILON, data_format="NCX")
    np.testing.assert_array_equal(dx, HAND_TRAINING[0].reshape(2, 2, 1))
    np.testing.assert_array_equal(dgamma, HAND_TRAINING[1])
    np.testing.assert_array_equal(dbeta, HAND_TRAINING[2])


def test_hand_case_frozen():
    dx, dscale, dbias = reference.backward(
        HAND["src"], HAND["diff_dst"], HAND["mean"][None], HAND["variance"][None],
        HAND["gamma"][None], epsilon=HAND_EPSILON, reduce_axes=(0,), formula="frozen")
    np.testing.assert_array_equal(dx, HAND_FROZEN_DX)
    np.testing.assert_array_equal(dscale, HAND_TRAINING[1][None])
    np.testing.assert_array_equal(dbias, HAND_TRAINING[2][None])


def test_hand_case_num_outputs_1_ignores_gamma():
    dx, dgamma, dbeta = reference.batchnorm_training_backward(
        **HAND, epsilon=HAND_EPSILON, num_outputs=1)
    np.testing.assert_array_equal(dx, HAND_UNSCALED_FROZEN_DX)
    assert dgamma is None and dbeta is None


def test_hand_case_count_replaces_m():
    # Channel 0 with M = 4 instead of 2: dx = dy - 4/4 - (x - 2) * 1/2 * 1/4 = [0.125, 1.875].
    dx, dscale, dbias = reference.backward(
        HAND["src"][:, :1], HAND["diff_dst"][:, :1], np.float32([[2.0]]),
        np.float32([[3.75]]), np.float32([[2.0]]), epsilon=HAND_EPSILON, reduce_axes=(0,),
        count=4)
    np.testing.assert_array_equal(dx, [[0.125], [1.875]])
    np.testing.assert_array_equal(dscale, [[1.0]])
    np.testing.assert_array_equal(dbias, [[4.0]])


def test_epsilon_is_taken_as_float32():
    # 0.1 is not a float32; the ops take epsilon as f32, so r = 1/sqrt(float32(0.1)).
    dx, _, _ = reference.backward(np.ones((1, 1)), np.ones((1, 1)), np.zeros((1, 1)),
                                  np.zeros((1, 1)), epsilon=0.1, reduce_axes=(0,),
                                  formula="frozen")
    assert dx[0, 0] == 1.0 / np.sqrt(float(np.float32(0.1)))
    assert dx[0, 0] != 1.0 / np.sqrt(0.1)


# ---------------------------------------------------------------------------------------------
# Finite differences of the forward loss L = sum(dy * y), y = gamma * (x - mu(x)) * r(x) + beta,
# mu and the biased variance recomputed from x.  dL/dx is the training dx, dL/dgamma = dscale,
# dL/dbeta = dbias.


def _forward_loss(x, dy, gamma, beta, epsilon, axes):
    mu = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)
    y = gamma * (x - mu) / np.sqrt(var + epsilon) + beta
    return np.sum(dy * y)


def _central_difference(f, a, step):
    """Gradient of the scalar function f at a, fourth-order central differences per element."""
    grad = np.empty_like(a)
    for i in np.ndindex(a.shape):
        def at(t):
            b = a.copy()
            b[i] += t
            return f(b)
        grad[i] = (8 * (at(step) - at(-step)) - (at(2 * step) - at(-2 * step))) / (12 * step)
    return grad


@pytest.mark.parametrize("shape, axes", [
    ((6, 3), (0,)),                # NXC rank 2
    ((3, 2, 5), (0, 2)),           # NCX rank 3
    ((2, 3, 4), (1,)),             # DirectML style: any set of reduced axes
    ((2, 2, 2, 3), (0, 1, 2)),     # NXC rank 4
])
def test_training_formula_is_the_gradient_of_the_forward(rng, shape, axes):
    epsilon = 2.0**-6  # exactly a float32, so the reference and the forward use the same value
    x = rng.normal(5.0, 2.0, shape)
    dy = rng.normal(0.5, 1.0, shape)
    stats_shape = tuple(1 if i in axes else n for i, n in enumerate(shape))
    gamma = rng.normal(1.0, 0.5, stats_shape)
    beta = rng.normal(0.0, 1.0, stats_shape)
    mean = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)

    dx, dscale, dbias = reference.backward(x, dy, mean, var, gamma, epsilon=epsilon,
                                           reduce_axes=axes)

    step = 1e-3
    fd_dx = _central_difference(lambda v: _forward_loss(v, dy, gamma, beta, epsilon, axes), x,
                                step)
    fd_dgamma = _central_difference(lambda g: _forward_loss(x, dy, g, beta, epsilon, axes),
                                    gamma, step)
    fd_dbeta = _central_difference(lambda b: _forward_loss(x, dy, gamma, b, epsilon, axes), beta,
                                   step)
    # Truncation error ~ step^4, rounding ~ 1e-16 * |L| / step: both far below 1e-8.
    np.testing.assert_allclose(dx, fd_dx, rtol=0, atol=1e-8 * np.abs(fd_dx).max())
    np.testing.assert_allclose(dscale, fd_dgamma, rtol=1e-8)
    np.testing.assert_allclose(dbias, fd_dbeta, rtol=1e-8)


def test_frozen_formula_is_the_gradient_with_fixed_statistics(rng):
    shape, axes, epsilon = (5, 3), (0,), 2.0**-6
    x, dy = rng.normal(5.0, 2.0, shape), rng.normal(0.5, 1.0, shape)
    mean, var = rng.normal(5.0, 1.0, (1, 3)), rng.uniform(1.0, 4.0, (1, 3))
    gamma = rng.normal(1.0, 0.5, (1, 3))

    def loss(v, g):
        return np.sum(dy * g * (v - mean) / np.sqrt(var + epsilon))

    dx, dscale, dbias = reference.backward(x, dy, mean, var, gamma, epsilon=epsilon,
                                           reduce_axes=axes, formula="frozen")
    np.testing.assert_allclose(dx, _central_difference(lambda v: loss(v, gamma), x, 1e-3),
                               rtol=1e-8)
    np.testing.assert_allclose(dscale, _central_difference(lambda g: loss(x, g), gamma, 1e-3),
                               rtol=1e-8)
    np.testing.assert_array_equal(dbias, dy.sum(axis=0, keepdims=True))


# ---------------------------------------------------------------------------------------------
# PyTorch, float64, channel axis 1.


@pytest.mark.parametrize("train", [True, False], ids=["training", "frozen"])
@pytest.mark.parametrize("shape", [(7, 3), (4, 5, 6), (2, 3, 4, 5)])
def test_agrees_with_torch_native_batch_norm_backward(rng, shape, train):
    torch = pytest.importorskip("torch")
    epsilon = 1e-5
    eps32 = float(np.float32(epsilon))
    axes = tuple(i for i in range(len(shape)) if i != 1)
    x = rng.normal(5.0, 2.0, shape)
    dy = rng.normal(0.5, 1.0, shape)
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    gamma = rng.normal(1.0, 0.5, shape[1])
    t = torch.from_numpy
    grads = torch.ops.aten.native_batch_norm_backward(
        t(dy), t(x), t(gamma), t(mean), t(var), t(mean), t(1.0 / np.sqrt(var + eps32)),
        train, eps32, [True, True, True])

    dx, dgamma, dbeta = reference.backward(
        x, dy, np.expand_dims(mean, axes), np.expand_dims(var, axes),
        np.expand_dims(gamma, axes), epsilon=epsilon, reduce_axes=axes,
        formula="training" if train else "frozen")
    np.testing.assert_allclose(dx, grads[0].numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dgamma.reshape(-1), grads[1].numpy(), rtol=1e-10)
    np.testing.assert_allclose(dbeta.reshape(-1), grads[2].numpy(), rtol=1e-10)


# ---------------------------------------------------------------------------------------------
# Conventions of the reference.


def test_ncx_and_nxc_agree(rng):
    x = rng.normal(5.0, 2.0, (4, 3, 5)).astype(np.float32)
    dy = rng.normal(0.0, 1.0, x.shape).astype(np.float32)
    mean, var = x.mean(axis=(0, 2)), x.var(axis=(0, 2))
    gamma = rng.normal(1.0, 0.5, 3).astype(np.float32)
    ncx = reference.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3,
                                                data_format="NCX")
    nxc = reference.batchnorm_training_backward(np.moveaxis(x, 1, -1), np.moveaxis(dy, 1, -1),
                                                mean, var, gamma, epsilon=1e-3)
    np.testing.assert_allclose(np.moveaxis(nxc[0], -1, 1), ncx[0], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(nxc[1], ncx[1], rtol=1e-13)
    np.testing.assert_allclose(nxc[2], ncx[2], rtol=1e-13)


def test_scale_none_means_one(rng):
    x, dy = rng.normal(5.0, 2.0, (6, 2)), rng.normal(0.0, 1.0, (6, 2))
    stats = dict(mean=x.mean(0, keepdims=True), variance=x.var(0, keepdims=True))
    without = reference.backward(x, dy, **stats, epsilon=1e-3, reduce_axes=(0,))
    with_ones = reference.backward(x, dy, **stats, scale=np.ones((1, 2)), epsilon=1e-3,
                                   reduce_axes=(0,))
    for a, b in zip(without, with_ones):
        np.testing.assert_array_equal(a, b)


def test_parameter_gradients_keep_the_statistics_shape(rng):
    x = rng.normal(5.0, 2.0, (3, 4, 5))
    stats = dict(mean=x.mean(1, keepdims=True), variance=x.var(1, keepdims=True))
    dx, dscale, dbias = reference.backward(x, x, **stats, epsilon=1e-3, reduce_axes=(1,))
    assert dx.shape == (3, 4, 5)
    assert dscale.shape == dbias.shape == (3, 1, 5)


@pytest.mark.parametrize("dtype", [np.float16, pytest.param(BF16, marks=requires_bf16)],
                         ids=["float16", "bfloat16"])
def test_half_inputs_are_converted_exactly(rng, dtype):
    x = rng.normal(5.0, 2.0, (8, 3)).astype(dtype)
    dy = rng.normal(0.0, 1.0, (8, 3)).astype(dtype)
    mean, var = np.ones((1, 3), dtype), np.full((1, 3), 2.0, dtype)
    half = reference.backward(x, dy, mean, var, epsilon=1e-3, reduce_axes=(0,))
    wide = reference.backward(x.astype(np.float64), dy.astype(np.float64), mean.astype(float),
                              var.astype(float), epsilon=1e-3, reduce_axes=(0,))
    for a, b in zip(half, wide):
        assert a.dtype == np.float64
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("num_outputs", [1, 3])
def test_empty_batch_gives_empty_dx_and_zero_gradients(num_outputs):
    dx, dgamma, dbeta = reference.batchnorm_training_backward(
        np.zeros((0, 4), np.float32), np.zeros((0, 4), np.float32), np.zeros(4, np.float32),
        np.ones(4, np.float32), np.ones(4, np.float32), epsilon=1e-3, num_outputs=num_outputs)
    assert dx.shape == (0, 4)
    if num_outputs == 3:
        np.testing.assert_array_equal(dgamma, np.zeros(4))
        np.testing.assert_array_equal(dbeta, np.zeros(4))


def test_nan_stays_in_its_channel(rng):
    x = rng.normal(5.0, 2.0, (6, 3))
    dy = rng.normal(0.0, 1.0, (6, 3))
    x[2, 1] = np.nan
    dx, dgamma, dbeta = reference.batchnorm_training_backward(
        x.astype(np.float32), dy.astype(np.float32), np.full(3, 5.0, np.float32),
        np.full(3, 4.0, np.float32), epsilon=1e-3)
    assert np.isnan(dx[:, 1]).all() and np.isnan(dgamma[1])
    assert np.isfinite(dx[:, [0, 2]]).all() and np.isfinite(dgamma[[0, 2]]).all()
    assert np.isfinite(dbeta).all()
