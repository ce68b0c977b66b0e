from typing import Any, ClassVar, Literal

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

__all__ = [
    "TensorDesc",
    "BatchNormalizationGrad",
    "BatchNormalizationTrainingGrad",
    "BatchNormalizationTraining",
    "batch_normalization_grad",
    "batch_normalization_training_grad",
]

MEMBERS: tuple[str, ...]
DATA_TYPES: tuple[str, ...]

_DataType = Literal["float32", "float16", "bfloat16"]
# what execute() binds: a buffer-protocol object (bytes, bytearray, memoryview, ctypes, NumPy)
# or an integer address
_Buffer = Any

class TensorDesc:
    """``DML_BUFFER_TENSOR_DESC``: a data type, 1 to 8 sizes, strides in elements."""

    def __init__(
        self,
        data_type: _DataType | DTypeLike,
        sizes: tuple[int, ...] | list[int],
        strides: tuple[int, ...] | list[int] | None = None,
        total_tensor_size_in_bytes: int | None = None,
    ) -> None: ...
    @classmethod
    def from_array(
        cls, array: NDArray[Any], data_type: _DataType | DTypeLike | None = None
    ) -> TensorDesc: ...
    @property
    def data_type(self) -> _DataType: ...
    @property
    def sizes(self) -> tuple[int, ...]: ...
    @property
    def strides(self) -> tuple[int, ...] | None: ...
    @property
    def element_strides(self) -> tuple[int, ...]: ...
    @property
    def dimension_count(self) -> int: ...
    @property
    def total_tensor_size_in_bytes(self) -> int: ...
    @property
    def minimum_size_in_bytes(self) -> int: ...
    @property
    def itemsize(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class _Operator:
    """An operator compiled once; execute() binds memory and runs it (GIL released)."""

    feature_level: ClassVar[str | None]
    @property
    def epsilon(self) -> float: ...
    @property
    def plan_kind(self) -> Literal["channel-last", "channel-major", "empty"]: ...
    @property
    def count(self) -> int: ...

class _GradOperator(_Operator):
    input: TensorDesc
    input_gradient: TensorDesc
    mean: TensorDesc
    variance: TensorDesc
    scale: TensorDesc
    output_gradient: TensorDesc
    output_scale_gradient: TensorDesc
    output_bias_gradient: TensorDesc
    def __init__(
        self,
        *,
        input: TensorDesc,
        input_gradient: TensorDesc,
        mean: TensorDesc,
        variance: TensorDesc,
        scale: TensorDesc,
        output_gradient: TensorDesc,
        output_scale_gradient: TensorDesc,
        output_bias_gradient: TensorDesc,
        epsilon: float | np.floating[Any],
    ) -> None: ...
    def execute(
        self,
        *,
        input: _Buffer,
        input_gradient: _Buffer,
        mean: _Buffer,
        variance: _Buffer,
        scale: _Buffer,
        output_gradient: _Buffer,
        output_scale_gradient: _Buffer,
        output_bias_gradient: _Buffer,
        num_threads: int | None = None,
    ) -> None: ...

class BatchNormalizationTraining(_Operator):
    input: TensorDesc
    mean: TensorDesc
    variance: TensorDesc
    scale: TensorDesc | None
    bias: TensorDesc | None
    output: TensorDesc
    output_running_mean: TensorDesc
    output_running_variance: TensorDesc
    output_batch_mean: TensorDesc
    output_batch_variance: TensorDesc
    def __init__(
        self,
        *,
        input: TensorDesc,
        mean: TensorDesc,
        variance: TensorDesc,
        output: TensorDesc,
        output_running_mean: TensorDesc,
        output_running_variance: TensorDesc,
        output_batch_mean: TensorDesc,
        output_batch_variance: TensorDesc,
        scale: TensorDesc | None = None,
        bias: TensorDesc | None = None,
        epsilon: float | np.floating[Any],
        momentum: float | np.floating[Any] = 0.5,
        fuse_relu: bool | np.bool_ = False,
    ) -> None: ...
    def execute(
        self,
        *,
        input: _Buffer,
        mean: _Buffer,
        variance: _Buffer,
        output: _Buffer,
        output_running_mean: _Buffer,
        output_running_variance: _Buffer,
        output_batch_mean: _Buffer,
        output_batch_variance: _Buffer,
        scale: _Buffer | None = None,
        bias: _Buffer | None = None,
        num_threads: int | None = None,
    ) -> None: ...
    @property
    def momentum(self) -> float: ...
    @property
    def fuse_relu(self) -> bool: ...

class BatchNormalizationGrad(_GradOperator):
    """``DML_OPERATOR_BATCH_NORMALIZATION_GRAD`` (DML_FEATURE_LEVEL_3_1): frozen statistics."""

class BatchNormalizationTrainingGrad(_GradOperator):
    """``DML_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD`` (DML_FEATURE_LEVEL_4_1): training."""

def batch_normalization_grad(
    input: ArrayLike,
    input_gradient: ArrayLike,
    mean: ArrayLike,
    variance: ArrayLike,
    scale: ArrayLike,
    epsilon: float | np.floating[Any],
    *,
    num_threads: int | None = None,
) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]: ...
def batch_normalization_training_grad(
    input: ArrayLike,
    input_gradient: ArrayLike,
    mean: ArrayLike,
    variance: ArrayLike,
    scale: ArrayLike,
    epsilon: float | np.floating[Any],
    *,
    num_threads: int | None = None,
) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]: ...
