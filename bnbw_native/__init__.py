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
from ._graph import BackwardResult, batchnorm_training_backward
from ._twophase import backward_apply, backward_reduce

_SUBMODULES = ("autograd", "distributed", "dml", "half", "ngraph", "onednn", "reference")


def __getattr__(name):
    """Submodules load on first use, so `import bnbw_native` stays light."""
    if name in _SUBMODULES:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_include():
    """The directory holding bnbw_native.h and bnbw_half.h, for C extensions."""
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(here, "include")
    return installed if os.path.isdir(installed) else os.path.join(os.path.dirname(here),
                                                                   "include")


__all__ = [
    "BackwardResult",
    "backward_apply",
    "backward_reduce",
    "get_include",
    "batchnorm_training_backward",
    "get_num_threads",
    "set_num_threads",
    "show_config",
    "__version__",
]
