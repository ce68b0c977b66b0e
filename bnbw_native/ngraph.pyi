from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._rules import Convention

NGRAPH: Convention

def batch_norm_training_backprop(
    input: ArrayLike,
    gamma: ArrayLike,
    beta: ArrayLike,
    mean: ArrayLike,
    variance: ArrayLike,
    normalized_delta: ArrayLike,
    *,
    epsilon: float | np.floating[Any],
    out: tuple[Any, ...] | None = None,
    num_threads: int | None = None,
) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]: ...
