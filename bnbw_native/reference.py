"""Float64 NumPy reference for batch-normalization training: the backward and the forward.

This module is the slow, obviously correct twin of the native kernels: tests compare against it
and benchmarks time against it.  Everything is computed in float64 from inputs converted exactly
to float64 (float16 and bfloat16 values are exactly representable in float64).

Per statistics element c (a "channel"), the sums run over the M elements of x that map to c.
With g = dy, mu = mean, sigma^2 = variance (biased), r = 1 / sqrt(sigma^2 + eps) and
gamma = scale (1 where absent)::

    dbias  = sum(g)
    dscale = r * sum((x - mu) * g)          # around mu, never sum(g*x) - mu*sum(g)
    training:  dx = gamma * r * (g - dbias / M - (x - mu) * r * dscale / M)
    frozen:    dx = gamma * r * g

``eps`` is used as the float32 value nearest to ``epsilon``, because the native operators take it
as f32.  M = 0 (an empty batch) gives an empty dx and zero dscale, dbias.

The training forward (oneDNN Graph's convention: momentum m weighs the old running statistics)::

    mu = sum(x) / M,  sigma^2 = sum((x - mu)^2) / M,  r = 1 / sqrt(sigma^2 + eps)
    y = gamma * r * (x - mu) + beta                 # max(y, 0) with the ReLU, NaN kept
    running_mean = m * mean + (1 - m) * mu,  running_variance = m * variance + (1 - m) * sigma^2

with m the float32 value nearest to ``momentum``.

Validation is minimal on purpose: this is a reference, not a front-end.
"""
import math

import numpy as np

__all__ = ["backward", "batchnorm_training_backward", "batchnorm_training_forward", "forward"]

_FORMULAS = ("training", "frozen")


def _to_float64(a, name):
    """`a` as a float64 array, refusing anything that is not a floating-point type."""
    a = np.asarray(a)
    # bfloat16 (ml_dtypes) is not a NumPy floating subtype; recognise it by name.
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise TypeError(f"{name}: expected a floating-point array, got dtype {a.dtype}")
    return a.astype(np.float64)


def _stats_to_float64(a, name, ndim, axes):
    """A per-channel tensor (rank `ndim`, size 1 on every reduced axis) as float64."""
    a = _to_float64(a, name)
    if a.ndim != ndim or any(a.shape[i] != 1 for i in axes):
        raise ValueError(f"{name}: expected rank {ndim} with size 1 on axes {axes}, "
                         f"got shape {a.shape}")
    return a


def _channel_layout(src, data_format):
    """The reduced axes of an array convention's src, and the reshaping of its 1-D statistics
    to src's rank (size 1 on the reduced axes)."""
    if data_format not in ("NXC", "NCX"):
        raise ValueError(f"data_format: expected 'NXC' or 'NCX', got {data_format!r}")
    if src.ndim < 2:
        raise ValueError(f"src: expected rank 2 to 8, got rank {src.ndim}")
    channel_axis = 1 if data_format == "NCX" else src.ndim - 1
    reduce_axes = tuple(i for i in range(src.ndim) if i != channel_axis)
    stats_shape = tuple(n if i == channel_axis else 1 for i, n in enumerate(src.shape))

    def as_stats(a):
        return None if a is None else np.asarray(a).reshape(stats_shape)

    return reduce_axes, as_stats


def backward(x, dy, mean, variance, scale=None, *, epsilon, reduce_axes, formula="training",
             count=None):
    """Batch-norm backward in float64; returns ``(dx, dscale, dbias)``.

    ``x`` and ``dy`` have the same shape.  ``mean``, ``variance`` and ``scale`` have the rank of
    ``x`` with size 1 on every axis of ``reduce_axes`` (DirectML style, broadcastable to ``x``);
    ``dscale`` and ``dbias`` come back in that keepdims shape.  ``scale=None`` means 1.
    ``formula`` is ``"training"`` or ``"frozen"``.  ``count`` replaces M, the number of reduced
    elements per channel (the two-phase API sums over ranks, so the global M can exceed the local).
    """
    if formula not in _FORMULAS:
        raise ValueError(f"formula: expected one of {_FORMULAS}, got {formula!r}")
    x = _to_float64(x, "x")
    dy = _to_float64(dy, "dy")
    if dy.shape != x.shape:
        raise ValueError(f"dy: shape {dy.shape} differs from x's {x.shape}")
    axes = tuple(sorted({int(a) % x.ndim for a in reduce_axes}))
    mu = _stats_to_float64(mean, "mean", x.ndim, axes)
    var = _stats_to_float64(variance, "variance", x.ndim, axes)
    gamma = 1.0 if scale is None else _stats_to_float64(scale, "scale", x.ndim, axes)
    m = math.prod(x.shape[i] for i in axes) if count is None else int(count)

    # NaN and inf follow IEEE arithmetic within their channel: no warnings for them.
    with np.errstate(invalid="ignore", over="ignore"):
        r = 1.0 / np.sqrt(var + float(np.float32(epsilon)))
        centered = x - mu
        dbias = dy.sum(axis=axes, keepdims=True)
        dscale = r * (centered * dy).sum(axis=axes, keepdims=True)
        if formula == "frozen":
            dx = gamma * r * dy
        elif m == 0:
            dx = np.zeros(x.shape)  # an empty batch: nothing to differentiate (and no 0/0)
        else:
            dx = gamma * r * (dy - dbias / m - centered * r * dscale / m)
    return dx, dscale, dbias


def batchnorm_training_backward(src, diff_dst, mean, variance, gamma=None, *, epsilon,
                                data_format="NXC", num_outputs=3):
    """Slow twin of ``bnbw_native.batchnorm_training_backward`` (oneDNN Graph).

    Returns ``(diff_src, diff_gamma, diff_beta)`` in float64.  ``mean``, ``variance`` and
    ``gamma`` are 1-D of length C; the channel axis is 1 for ``"NCX"`` and the last for ``"NXC"``.
    ``num_outputs=3`` is the training gradient; ``num_outputs=1`` is what oneDNN Graph computes
    when only diff_src is requested: ``diff_dst / sqrt(variance + epsilon)``, gamma ignored, and
    diff_gamma, diff_beta are None.
    """
    if num_outputs not in (1, 3):
        raise ValueError(f"num_outputs: expected 1 or 3, got {num_outputs!r}")
    src = np.asarray(src)
    reduce_axes, as_stats = _channel_layout(src, data_format)

    if num_outputs == 1:
        dx, _, _ = backward(src, diff_dst, as_stats(mean), as_stats(variance), None,
                            epsilon=epsilon, reduce_axes=reduce_axes, formula="frozen")
        return dx, None, None
    dx, dgamma, dbeta = backward(src, diff_dst, as_stats(mean), as_stats(variance),
                                 as_stats(gamma), epsilon=epsilon, reduce_axes=reduce_axes)
    return dx, dgamma.reshape(-1), dbeta.reshape(-1)


def forward(x, mean, variance, scale=None, bias=None, *, epsilon, momentum, reduce_axes,
            relu=False):
    """Batch-norm training forward in float64; returns ``(y, running_mean, running_variance,
    batch_mean, batch_variance)``, the statistics in the keepdims shape of ``mean`` (which, like
    ``variance``, ``scale`` and ``bias``, has size 1 on every axis of ``reduce_axes``).
    ``scale=None`` means 1, ``bias=None`` 0.  M = 0 gives an empty y, zero batch statistics and
    the running statistics unchanged."""
    x = _to_float64(x, "x")
    axes = tuple(sorted({int(a) % x.ndim for a in reduce_axes}))
    old_mean = _stats_to_float64(mean, "mean", x.ndim, axes)
    old_var = _stats_to_float64(variance, "variance", x.ndim, axes)
    gamma = 1.0 if scale is None else _stats_to_float64(scale, "scale", x.ndim, axes)
    beta = 0.0 if bias is None else _stats_to_float64(bias, "bias", x.ndim, axes)
    m = float(np.float32(momentum))
    if math.prod(x.shape[i] for i in axes) == 0:
        zero = np.zeros(old_mean.shape)
        return np.zeros(x.shape), old_mean, old_var, zero, zero
    with np.errstate(invalid="ignore", over="ignore"):
        mu = x.mean(axis=axes, keepdims=True)
        var = ((x - mu) ** 2).mean(axis=axes, keepdims=True)
        y = gamma / np.sqrt(var + float(np.float32(epsilon))) * (x - mu) + beta
        if relu:
            y = np.where(np.isnan(y) | (y > 0), y, 0.0)
        return y, m * old_mean + (1 - m) * mu, m * old_var + (1 - m) * var, mu, var


def batchnorm_training_forward(src, mean, variance, gamma=None, beta=None, *, epsilon,
                               momentum=0.5, data_format="NXC", fuse_relu=False):
    """Slow twin of ``bnbw_native.batchnorm_training_forward`` (oneDNN Graph).

    Returns ``(dst, running_mean, running_variance, batch_mean, batch_variance)`` in float64,
    the statistics 1-D of length C; the channel axis is 1 for ``"NCX"`` and the last for
    ``"NXC"``."""
    src = np.asarray(src)
    reduce_axes, as_stats = _channel_layout(src, data_format)

    y, *stats = forward(src, as_stats(mean), as_stats(variance), as_stats(gamma),
                        as_stats(beta), epsilon=epsilon, momentum=momentum,
                        reduce_axes=reduce_axes, relu=fuse_relu)
    return (y, *(s.reshape(-1) for s in stats))
