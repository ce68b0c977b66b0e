"""oneDNN Graph ``BatchNormForwardTraining`` and ``BatchNormTrainingBackward``."""
from typing import NamedTuple, Optional

import numpy as np

from ._arrays import FROZEN_DX, TRAINING, backward, forward
from ._rules import NXC_DEFAULT, Convention, check_data_format, check_flag, check_int_choice

GRAPH = Convention(dict(x="src", dy="diff_dst", mean="mean", var="variance", scale="gamma",
                        dx="diff_src", dscale="diff_gamma", dbias="diff_beta",
                        relu_dst="relu_dst", diff_residual="diff_residual"))


# (residual: the torch layers' BatchNormAddReLU only, in dy's slot)
FORWARD = Convention(dict(x="src", dy="residual", mean="mean", var="variance", scale="gamma",
                          beta="beta", dx="dst", run_mean="running_mean",
                          run_var="running_variance", batch_mean="batch_mean",
                          batch_var="batch_variance"))


class ForwardResult(NamedTuple):
    """dst (like src), then the running and the batch statistics (length C)."""
    dst: np.ndarray
    running_mean: np.ndarray
    running_variance: np.ndarray
    batch_mean: np.ndarray
    batch_variance: np.ndarray


def batchnorm_training_forward(src, mean, variance, gamma=None, beta=None, *, epsilon,
                               momentum=0.5, data_format=NXC_DEFAULT, fuse_relu=False, out=None,
                               num_threads=None):
    """A training-mode batch normalization, as oneDNN Graph's BatchNormForwardTraining.

    Per channel, over the M elements of src that map to it: batch_mean = Sum x / M,
    batch_variance = Sum (x - batch_mean)^2 / M (biased), dst = gamma * (x - batch_mean) /
    sqrt(batch_variance + epsilon) + beta (then ReLU when fuse_relu), running_mean =
    momentum * mean + (1 - momentum) * batch_mean and running_variance = momentum * variance +
    (1 - momentum) * batch_variance: `mean` and `variance` are the previous running statistics
    and momentum weighs them (the reverse of PyTorch's momentum).

    src: T1 (float32, bfloat16, float16), rank 2 to 8, any strides; mean, variance, gamma,
    beta: 1-D of length C, one dtype T2 (float32, or bfloat16 when T1 is bfloat16); gamma
    None means 1, beta None means 0.  data_format "NXC" (channels last, the default) or "NCX".
    out: five preallocated outputs in result order; dst may be src itself, running_mean mean
    and running_variance variance (in place).
    Returns a ForwardResult(dst, running_mean, running_variance, batch_mean, batch_variance).
    """
    data_format = check_data_format(data_format, src)
    check_flag(fuse_relu, "fuse_relu")
    return ForwardResult(*forward(FORWARD, src, mean, variance, gamma, beta, epsilon, momentum,
                                  data_format, bool(fuse_relu), out, num_threads))


class BackwardResult(NamedTuple):
    """diff_src (like src), diff_gamma and diff_beta (length C; None when not computed)."""
    diff_src: np.ndarray
    diff_gamma: Optional[np.ndarray]
    diff_beta: Optional[np.ndarray]


def batchnorm_training_backward(src, diff_dst, mean, variance, gamma=None, *, epsilon,
                                data_format=NXC_DEFAULT, num_outputs=3, out=None, num_threads=None,
                                relu_dst=None, diff_residual=None):
    """Gradients of a training-mode batch normalization, as oneDNN Graph computes them.

    num_outputs=3: diff_src, diff_gamma, diff_beta of the training forward (gamma = 1 when
    None).  num_outputs=1: what oneDNN Graph produces when only diff_src is attached, i.e.
    frozen statistics with gamma ignored: diff_src = diff_dst / sqrt(variance + epsilon);
    diff_gamma and diff_beta are then None.

    src, diff_dst: same dtype T1 (float32, bfloat16, float16), rank 2 to 8, any strides;
    mean, variance, gamma: 1-D of length C, same dtype T2 (float32, or bfloat16 when T1 is
    bfloat16).  data_format "NXC" (channels last, the default) or "NCX" (channel axis 1).
    out: preallocated outputs, one per returned output; diff_src may be diff_dst itself.

    A ReLU after the batch norm (y = max(bn(x), 0), or max(bn(x) + residual, 0)) folds into
    the same passes: relu_dst is the forward's output y (src's shape, its dtype or bool with
    True = active); the gradient used is diff_dst where y > 0, 0 elsewhere (selected, never
    multiplied).  diff_residual: an optional output (src's shape and dtype; it may be diff_dst
    itself) that receives that gradient, the residual's.
    Returns a BackwardResult(diff_src, diff_gamma, diff_beta).
    """
    data_format = check_data_format(data_format, src)
    num_outputs = check_int_choice(num_outputs, "num_outputs", (1, 3))
    formula = TRAINING if num_outputs == 3 else FROZEN_DX
    return BackwardResult(*backward(GRAPH, formula, src, diff_dst, mean, variance, gamma,
                                    epsilon, data_format, out, num_threads, relu_dst=relu_dst,
                                    diff_residual=diff_residual))
