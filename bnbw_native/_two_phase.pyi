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
def apply_sums(
    x: ArrayLike,
    dy: ArrayLike,
    mean: ArrayLike,
    variance: ArrayLike,
    gamma: ArrayLike | None,
    partial: ArrayLike,
    count: int,
    *,
    epsilon: float | np.floating[Any],
    data_format: Literal["NXC", "NCX"],
    out: tuple[Any, ...] | None,
    num_threads: int | None,
    relu_dst: ArrayLike | None,
    diff_residual: Any | None,
    mean_low: Any | None = None,
) -> BackwardResult: ...

FORWARD_PHASES: Convention

def forward_reduce(
    x: ArrayLike, shift: ArrayLike, *, data_format: str, num_threads: int | None = None
) -> tuple[NDArray[np.float64], int]: ...
def forward_apply(
    x: ArrayLike,
    shift: ArrayLike,
    gamma: ArrayLike | None,
    beta: ArrayLike | None,
    sums: ArrayLike,
    count: int,
    *,
    epsilon: float,
    data_format: str,
    relu: bool = False,
    out: Any = None,
    num_threads: int | None = None,
    mean_low: Any = None,
) -> tuple[NDArray[Any], ...]: ...
