"""bnbw_native: fast, exact CPU batch-normalization training backward.

One strided engine (Cython + OpenMP) behind thin front-ends, one per public convention:

* ``batchnorm_training_backward`` - oneDNN Graph ``BatchNormTrainingBackward``
* ``bnbw_native.onednn.batch_norm_training_backprop`` - Intel spec ``BatchNormTrainingBackprop-1``
* ``bnbw_native.ngraph.batch_norm_training_backprop`` - nGraph ``BatchNormTrainingBackprop``
* ``bnbw_native.dml`` - DirectML ``DML_BATCH_NORMALIZATION_GRAD`` descriptors and operators
* ``backward_reduce`` / ``backward_apply`` - the two phases of data-parallel training
* ``bnbw_native.half`` - f32 <-> f16 / bf16 conversion helpers
* ``bnbw_native.reference`` - the float64 NumPy reference every result is checked against
"""
from ._config import __version__, get_num_threads, set_num_threads, show_config
from ._graph import batchnorm_training_backward
from ._pipeline import BackwardResult
from ._twophase import backward_apply, backward_reduce

__all__ = [
    "BackwardResult",
    "backward_apply",
    "backward_reduce",
    "batchnorm_training_backward",
    "get_num_threads",
    "set_num_threads",
    "show_config",
    "__version__",
]
