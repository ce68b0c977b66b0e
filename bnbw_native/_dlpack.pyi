# Foreign array objects as NumPy arrays: DLPack, buffers (compiled from _dlpack.pyx).
from typing import Any

from numpy.typing import NDArray

def as_array(obj: Any, name: str) -> NDArray[Any]: ...
def output_array(obj: Any, label: str) -> NDArray[Any]: ...
