# The validation layer every front-end goes through (compiled from _call.pyx).
from collections.abc import Mapping, Sequence
from typing import Any

from numpy.typing import NDArray

MAX_THREADS_PY: int
TRAINING: int
FROZEN: int
FROZEN_DX: int
REDUCE: int
APPLY: int
ROLES: dict[str, int]

def set_default_threads(n: int) -> None: ...
def default_threads() -> int: ...
def threads_for(requested: int) -> int: ...
def after_fork_in_child() -> None: ...
def omp_max_threads() -> int: ...
def build_info() -> dict[str, Any]: ...
def _set_body_cap(cap: int) -> None: ...

class Convention:
    def __init__(
        self,
        names: Mapping[str, str],
        *,
        family: str = "arrays",
        dtype_rule: str = "graph",
        ranks: tuple[int, int] = (2, 8),
        data_format: bool = True,
        scale_required: bool = False,
    ) -> None: ...
    def name(self, role: str) -> str: ...

def as_array(obj: Any, name: str) -> NDArray[Any]: ...
def requested_threads(value: object) -> int: ...
def check_choice(value: object, name: str, choices: Sequence[str]) -> str: ...
def check_int_choice(value: object, name: str, choices: Sequence[int]) -> int: ...
def check_epsilon(value: object, name: str = "epsilon") -> float: ...
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
) -> dict[str, Any]: ...
