from collections.abc import Iterable
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["backward", "batchnorm_training_backward", "batchnorm_training_forward", "forward"]

def backward(
    x: ArrayLike,
    dy: ArrayLike,
    mean: ArrayLike,
    variance: ArrayLike,
    scale: ArrayLike | None = None,
    *,
    epsilon: float | np.floating[Any],
    reduce_axes: Iterable[int],
    formula: Literal["training", "frozen"] = "training",
    count: int | None = None,
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]: ...
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
) -> tuple[NDArray[np.float64], NDArray[np.float64] | None, NDArray[np.float64] | None]: ...
def forward(
    x: ArrayLike,
    mean: ArrayLike,
    variance: ArrayLike,
    scale: ArrayLike | None = None,
    bias: ArrayLike | None = None,
    *,
    epsilon: float | np.floating[Any],
    momentum: float | np.floating[Any],
    reduce_axes: Iterable[int],
    relu: bool = False,
) -> tuple[NDArray[np.float64], ...]: ...
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
    fuse_relu: bool = False,
) -> tuple[NDArray[np.float64], ...]: ...
