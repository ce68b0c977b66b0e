"""Thread count resolution and build information (SPEC 4).

The package default starts as None, meaning "what OpenMP would use now", read at every call so
that ``threadpoolctl.threadpool_limits`` (which sets OpenMP's max threads) is honoured.
"""
import numbers
import os
import sys

import numpy as np

from . import _core

__version__ = "0.1.0"

_default_threads = None
_forked_child = False


def _after_fork_in_child():
    # libgomp's thread pool does not survive fork(): a team of 2+ in the child hangs forever.
    # Results never depend on the thread count, so a forked child simply runs serial.
    global _forked_child
    _forked_child = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

# More threads than this buys nothing on any machine this runs on and risks exhausting the
# process: requests above it are clipped (results never depend on the thread count anyway).
MAX_THREADS = 256


def check_num_threads(value, name="num_threads"):
    """None, or a positive int: the validated request."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be None or a positive int, got {type(value).__name__}")
    value = int(value)
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def set_num_threads(n):
    """Set the package default thread count; None (the initial state) follows OpenMP."""
    global _default_threads
    _default_threads = check_num_threads(n, "n")


def get_num_threads():
    """The thread count a call without ``num_threads=`` would use now."""
    if _default_threads is not None:
        return _default_threads
    return max(1, _core.omp_max_threads())


def resolve_threads(num_threads):
    """The thread count for one call (already validated by check_num_threads)."""
    if _forked_child:
        return 1
    n = get_num_threads() if num_threads is None else num_threads
    return min(n, MAX_THREADS)


def show_config(file=None):
    """Print version, compiler, OpenMP and SIMD paths."""
    import sysconfig

    info = _core.build_info()
    omp = info["openmp"]
    lines = [
        f"bnbw_native {__version__}",
        f"  python:           {sys.version.split()[0]}, numpy {np.__version__}",
        f"  compiler:         {sysconfig.get_config_var('CC')}",
        f"  OpenMP:           {'on, version ' + str(omp) if omp else 'off (serial build)'}",
        f"  threads:          {get_num_threads()} (default "
        f"{'OpenMP' if _default_threads is None else _default_threads})",
        f"  kernels:          {info['kernels']}",
        f"  half conversion:  {info['half_path']}",
    ]
    print("\n".join(lines), file=file)
