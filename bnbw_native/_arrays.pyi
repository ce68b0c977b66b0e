# Array calls: marshal, check, allocate, run (compiled from _arrays.pyx).
from typing import Any

from ._rules import Convention

TRAINING: int
FROZEN: int
FROZEN_DX: int
REDUCE: int
APPLY: int
FORWARD: int
FORWARD_REDUCE: int
FORWARD_APPLY: int
PARAMS: int
PARAMS_FROM_SUMS: int

def register_tensor_types(types: Any, dtypes: dict[Any, str], strided: Any) -> None: ...
def backward(
    conv: Convention,
    formula: int,
    x: Any,
    dy: Any,
    mean: Any,
    var: Any,
    scale: Any,
    epsilon: Any = None,
    data_format: str = "NXC",
    out: Any = None,
    num_threads: int | None = None,
    *,
    beta: Any = None,
    relu_dst: Any = None,
    diff_residual: Any = None,
    partial: Any = None,
    count: Any = None,
    exact_sums: bool = False,
    tensors: bool = False,
    mean_low: Any = None,
) -> Any: ...
def describe(
    conv: Convention,
    formula: int,
    x: Any,
    dy: Any,
    mean: Any,
    var: Any,
    scale: Any,
    epsilon: Any = None,
    data_format: str = "NXC",
    num_threads: int | None = None,
    *,
    beta: Any = None,
    relu_dst: Any = None,
    diff_residual: Any = None,
    partial: Any = None,
    count: Any = None,
    exact_sums: bool = False,
    momentum: Any = 0.5,
) -> dict[str, Any]: ...
def forward(
    conv: Convention,
    src: Any,
    mean: Any,
    variance: Any,
    gamma: Any,
    beta: Any,
    epsilon: Any,
    momentum: Any,
    data_format: str = "NXC",
    relu: bool = False,
    out: Any = None,
    num_threads: int | None = None,
    *,
    formula: int = ...,
    partial: Any = None,
    count: Any = None,
    torch_running: bool = False,
    tensors: bool = False,
    residual: Any = None,
    mean_low: Any = None,
) -> Any: ...
