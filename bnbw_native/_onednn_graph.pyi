from typing import Any, Literal, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._rules import Convention

GRAPH: Convention
FORWARD: Convention

class ForwardResult(NamedTuple):
    """dst (like src), then the running and the batch statistics (length C)."""

    dst: NDArray[Any]
    running_mean: NDArray[Any]
    running_variance: NDArray[Any]
    batch_mean: NDArray[Any]
    batch_variance: NDArray[Any]

def batchnorm_training_forward(
    src: ArrayLike,
    mean: ArrayLike,
    variance: ArrayLike,
    gamma: ArrayLike | None = None,
    beta: ArrayLike | None = None,
    *,
    epsilon: float | np.floating[Any],
    momentum: float | np.floating[Any] = 0.5,
    data_format: Literal["NXC", "NCX"] = "NXC",
    fuse_relu: bool | np.bool_ = False,
    out: tuple[Any, ...] | list[Any] | None = None,
    num_threads: int | None = None,
) -> ForwardResult: ...

class BackwardResult(NamedTuple):
    """diff_src (like src), diff_gamma and diff_beta (length C; None when not computed)."""

    diff_src: NDArray[Any]
    diff_gamma: NDArray[Any] | None
    diff_beta: NDArray[Any] | None

def batchnorm_training_backward(
    src: ArrayLike,
    diff_dst: ArrayLike,
    mean: ArrayLike,
    variance: ArrayLike,
    gamma: ArrayLike | None = None,
    *,
    epsilon: float | np.floating[Any],
    data_format: Literal["NXC", "NCX"] = "NXC",
    num_outputs: Literal[1, 3] = 3,
    out: tuple[Any, ...] | None = None,
    num_threads: int | None = None,
    relu_dst: ArrayLike | None = None,
    diff_residual: Any | None = None,
) -> BackwardResult: ...
