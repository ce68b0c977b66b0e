"""bnbw_native: fast, exact CPU batch-normalization training backward.

One strided engine (Cython + OpenMP) behind thin front-ends, one per public convention:

* ``batchnorm_training_backward`` - oneDNN Graph ``BatchNormTrainingBackward``
* ``bnbw_native.reference`` - the float64 NumPy reference every result is checked against
"""
from ._config import __version__, get_num_threads, set_num_threads, show_config
from ._graph import batchnorm_training_backward
from ._pipeline import BackwardResult

__all__ = [
    "BackwardResult",
    "batchnorm_training_backward",
    "get_num_threads",
    "set_num_threads",
    "show_config",
    "__version__",
]
