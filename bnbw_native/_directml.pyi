# DirectML's operators: descriptors, operators, bound buffers (compiled from _directml.pyx).
from collections.abc import Sequence
from typing import Any

from ._rules import Convention

# rows of (name, slot, role), role "input", "optional" or "output", in descriptor order
GRAD_TABLE: tuple[tuple[str, int, str], ...]
TRAINING_TABLE: tuple[tuple[str, int, str], ...]
MEMBERS: tuple[str, ...]
TRAINING_MEMBERS: tuple[str, ...]
CONVENTION: Convention
TRAINING_CONVENTION: Convention
POINTER_MAX: int
DATA_TYPES: dict[str, int]
ITEMSIZES: dict[str, int]
OPERATOR_TYPES: dict[str, int]
OPERATOR_KINDS: tuple[str, ...]

# spec: (data type code, sizes, strides or None, total size or None)
_Spec = tuple[int, tuple[int, ...], tuple[int, ...] | None, int | None]

def tensor_sizes(spec: _Spec) -> tuple[int, int, tuple[int, ...]]: ...

class Operator:
    def __init__(
        self,
        type: str,
        specs: Sequence[_Spec | None],
        epsilon: Any,
        momentum: Any = None,
        fuse_relu: bool = False,
    ) -> None: ...
    @property
    def kind(self) -> str: ...
    @property
    def count(self) -> int: ...
    @property
    def channels(self) -> int: ...
    @property
    def epsilon(self) -> float: ...
    @property
    def momentum(self) -> float: ...
    def execute(self, buffers: Sequence[Any], num_threads: Any) -> None: ...
