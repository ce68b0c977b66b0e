from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._rules import Convention

INTEL: Convention

def batch_norm_training_backprop(
    input_forward: ArrayLike,
    output_delta: ArrayLike,
    mean: ArrayLike,
    variance: ArrayLike,
    gamma: ArrayLike | None = None,
    *,
    epsilon: float | np.floating[Any],
    data_format: Literal["NXC", "NCX"] = "NXC",
    out: tuple[Any, ...] | None = None,
    num_threads: int | None = None,
) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]: ...
