"""bnbw_native: fast, exact CPU batch-normalization training, forward and backward.

One strided engine (Cython + OpenMP) behind thin front-ends, one per public convention:

* ``batchnorm_training_forward`` - oneDNN Graph ``BatchNormForwardTraining``
* ``batchnorm_training_backward`` - oneDNN Graph ``BatchNormTrainingBackward``
* ``bnbw_native.intel_spec.batch_norm_training_backprop`` - Intel spec
  ``BatchNormTrainingBackprop-1`` (also reachable under its first name, ``bnbw_native.onednn``)
* ``bnbw_native.ngraph.batch_norm_training_backprop`` - nGraph ``BatchNormTrainingBackprop``
* ``bnbw_native.dml`` - DirectML ``DML_BATCH_NORMALIZATION_GRAD`` descriptors and operators
* ``backward_reduce`` / ``backward_apply`` - the two phases of data-parallel training
* ``bnbw_native.half`` - f32 <-> f16 / bf16 conversion helpers
* ``bnbw_native.reference`` - the float64 NumPy reference every result is checked against
"""
import types as _types
import typing as _typing


def _unbuilt_source_tree() -> "str | None":
    """The package directory when it is a checkout whose extension modules are not built
    (typically: Python started in the checkout after `pip install .`), else None."""
    import importlib.machinery
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    if not os.path.exists(os.path.join(os.path.dirname(here), "setup.py")):
        return None
    built = any(os.path.exists(os.path.join(here, "_engine" + suffix))
                for suffix in importlib.machinery.EXTENSION_SUFFIXES)
    return None if built else here


try:
    from ._config import __version__, get_num_threads, set_num_threads, show_config
except ImportError as exc:
    _tree = _unbuilt_source_tree()
    if _tree is None:
        raise
    raise ImportError(
        f"bnbw_native is being imported from its source tree ({_tree}), where the extension "
        "modules are not built. Either build them there (python setup.py build_ext --inplace) "
        "or start Python from another directory so that the installed bnbw_native is "
        "imported.") from exc
from ._rules import DataFormatWarning
from ._onednn_graph import (BackwardResult, ForwardResult, batchnorm_training_backward,
                            batchnorm_training_forward)
from ._two_phase import backward_apply, backward_reduce

if _typing.TYPE_CHECKING:
    # what type checkers see; at run time these load on first use (__getattr__ below)
    from . import dml, half, intel_spec, ngraph, onednn, reference, tuning

_SUBMODULES = ("autograd", "distributed", "dml", "half", "intel_spec", "ngraph", "onednn",
               "reference", "tuning")
# The C API's module: PyCapsule_Import("bnbw_native._capi._C_API"), behind every C caller's
# bnbw_import(), imports only "bnbw_native" and then looks "_capi" up as an attribute, so the
# attribute must exist even when nothing imported the submodule yet.
_LAZY = _SUBMODULES + ("_capi",)


def __getattr__(name: str) -> _types.ModuleType:
    """Submodules load on first use, so `import bnbw_native` stays light."""
    if name in _LAZY:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_include() -> str:
    """The directory holding bnbw_native.h, the C API's header, for C extensions."""
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(here, "include")
    return installed if os.path.isdir(installed) else os.path.join(os.path.dirname(here),
                                                                   "include")


__all__ = [
    "BackwardResult",
    "DataFormatWarning",
    "ForwardResult",
    "backward_apply",
    "backward_reduce",
    "get_include",
    "batchnorm_training_backward",
    "batchnorm_training_forward",
    "get_num_threads",
    "set_num_threads",
    "show_config",
    "__version__",
]
