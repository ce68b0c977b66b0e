# The C API's table and the DirectML layer under bnbw_native.dml (compiled from _capi.pyx).
# C callers: include/bnbw_native.h, bnbw_import() fetches _C_API.
from collections.abc import Sequence
from typing import Any

from ._call import Convention

_C_API: Any  # a PyCapsule named "bnbw_native._capi._C_API"
MEMBERS: tuple[str, ...]
CONVENTION: Convention
POINTER_MAX: int
STATUS: dict[str, int]
DATA_TYPES: dict[str, int]
OPERATOR_TYPES: dict[str, int]

class Error(Exception):
    status: int
    def __init__(self, status: int, message: str) -> None: ...

# spec: (data type code, sizes, strides or None, total size or None)
_Spec = tuple[int, tuple[int, ...], tuple[int, ...] | None, int | None]

def tensor_sizes(spec: _Spec) -> tuple[int, int]: ...

class Operator:
    def __init__(self, type: str, specs: Sequence[_Spec], epsilon: float) -> None: ...
    @property
    def kind(self) -> str: ...
    @property
    def count(self) -> int: ...
    @property
    def channels(self) -> int: ...
    @property
    def minimum_sizes(self) -> tuple[int, ...]: ...
    def execute(self, buffers: Sequence[Any], num_threads: int) -> None: ...
