from typing import Any

from numpy.typing import ArrayLike, NDArray

__all__ = ["float32_to_float16", "float16_to_float32", "float32_to_bfloat16", "bfloat16_to_float32"]

# Results are float16, float32, or bfloat16 (ml_dtypes; uint16 bit patterns without it).
def float32_to_float16(
    a: ArrayLike, out: NDArray[Any] | None = None, *, num_threads: int | None = None
) -> NDArray[Any]: ...
def float16_to_float32(
    a: ArrayLike, out: NDArray[Any] | None = None, *, num_threads: int | None = None
) -> NDArray[Any]: ...
def float32_to_bfloat16(
    a: ArrayLike, out: NDArray[Any] | None = None, *, num_threads: int | None = None
) -> NDArray[Any]: ...
def bfloat16_to_float32(
    a: ArrayLike, out: NDArray[Any] | None = None, *, num_threads: int | None = None
) -> NDArray[Any]: ...
