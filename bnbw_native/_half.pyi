# f16/bf16 <-> f32 row conversions (compiled from _half.pyx); bnbw_native.half is the public API.
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

PARALLEL_MIN: int

def simd_path() -> str: ...
def load(
    kind: Literal["f16", "bf16", "f32"],
    src: NDArray[Any],
    dst: NDArray[np.float32],
    *,
    num_threads: int = 0,
) -> None: ...
def store(
    kind: Literal["f16", "bf16", "f32"],
    src: NDArray[np.float32],
    dst: NDArray[Any],
    *,
    num_threads: int = 0,
) -> None: ...
def _f64_to_f16_bits(src: NDArray[np.float64]) -> NDArray[np.uint16]: ...
def _f64_to_bf16_bits(src: NDArray[np.float64]) -> NDArray[np.uint16]: ...
