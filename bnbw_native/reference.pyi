from collections.abc import Iterable
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["backward", "batchnorm_training_backward"]

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
