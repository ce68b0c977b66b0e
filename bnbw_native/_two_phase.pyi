from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._rules import Convention
from ._onednn_graph import BackwardResult

TWO_PHASE: Convention

def backward_reduce(
    x: ArrayLike,
    dy: ArrayLike,
    mean: ArrayLike,
    *,
    data_format: Literal["NXC", "NCX"] = "NXC",
    num_threads: int | None = None,
    exact_sums: bool = False,
    relu_dst: ArrayLike | None = None,
) -> tuple[NDArray[np.float64], int]: ...
def backward_apply(
    x: ArrayLike,
    dy: ArrayLike,
    mean: ArrayLike,
    variance: ArrayLike,
    gamma: ArrayLike | None,
    partial: ArrayLike,
    count: int,
    *,
    epsilon: float | np.floating[Any],
    data_format: Literal["NXC", "NCX"] = "NXC",
    out: tuple[Any, ...] | None = None,
    num_threads: int | None = None,
    relu_dst: ArrayLike | None = None,
    diff_residual: Any | None = None,
) -> BackwardResult: ...
