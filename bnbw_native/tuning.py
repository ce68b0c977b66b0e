"""The engine's knobs for tests and benchmarks, in one place.  None of them changes a result
bit: they change which schedule runs, how wide its items are, which kernel body runs and what
the engine assumes of the machine, and the results are the same bits in every case (contract,
section 1).

    from bnbw_native import tuning
    tuning.set_cache_model(1 << 20, 32 << 20, 2)   # plan for other caches
    tuning.use_kernels("portable")                  # cap the kernel body
    tuning.describe(x, "NXC", num_threads=8)        # the schedule a call would get

The knobs live beside what they tune (the schedules, the engine entry, the configuration); this
module is their one public door, so that nothing outside the package imports a private module
for them.
"""
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _arrays, _engine, _execute, _schedules
from ._config import KERNEL_CAPS, kernel_body, use_kernels
from ._onednn_graph import FORWARD, GRAPH

#: The schedules' names, as describe() reports them.
SCHEDULES = tuple(_schedules.SCHEDULE_NAMES.values())
#: Channel-major rows reach the kernels in pieces of at most this many elements.
TILE_ELEMENTS = _schedules.TILE_ELEMENTS


def cache_model() -> Tuple[int, int, int]:
    """(L2 bytes per core, L3 bytes, CPUs sharing the L3) as the schedules assume them."""
    l2, l3, sharers = _schedules.cache_model()
    return int(l2), int(l3), int(sharers)


def set_cache_model(l2: int, l3: int, sharers: int) -> None:
    """Make the schedules assume other caches (fused groups and slice widths follow)."""
    _schedules.set_cache_model(l2, l3, sharers)


def set_stream_policy(policy: str) -> str:
    """Whether float32 dx is written past the caches: "auto", "never" or "always"; returns the
    previous policy."""
    return str(_schedules.set_stream_policy(policy))


def set_scratch_poison(on: bool) -> bool:
    """Fill every call's scratch (block sums, per-channel floats) with NaN before its passes,
    so that a pass reading what it did not write shows; returns the previous setting."""
    return bool(_execute.set_scratch_poison(on))


def set_thread_work_floor(nbytes: int) -> int:
    """Bytes of x (and dy) a call reads per thread below which it runs on fewer threads than
    given (the default, 128 KiB, is what a thread's share must bring to pay for its parallel
    regions); 0: every call past the engine's serial floor on the threads it was given
    (channel-last rows shared however thinly).
    Returns the previous setting."""
    return int(_schedules.set_thread_work_floor(nbytes))


def set_cpu_model(n: int) -> None:
    """Plan as if this process could use n CPUs (0: the machine's own)."""
    _engine.set_cpu_model(n)


def describe(x: Any, data_format: str, *, formula: str = "training",
             num_threads: Optional[int] = None) -> Dict[str, Any]:
    """The plan and schedule a call on `x` (its dtype, shape and strides) would get, without
    running it: layout, schedule, threads, items, sums, temporaries.  formula: "training"
    (the backward), "frozen" (diff_src only) or "forward" (the training forward)."""
    channels = x.shape[-1 if data_format == "NXC" else 1]
    stat = np.ones(channels, np.float32)
    if formula == "forward":
        return dict(_arrays.describe(FORWARD, _arrays.FORWARD, x, None, stat, stat, None, 1e-5,
                                     data_format, num_threads))
    formulas = {"training": _arrays.TRAINING, "frozen": _arrays.FROZEN_DX}
    if formula not in formulas:
        raise ValueError(f"formula must be one of training, frozen, forward, got {formula!r}")
    return dict(_arrays.describe(GRAPH, formulas[formula], x, x, stat, stat, stat, 1e-5,
                                 data_format, num_threads))


__all__ = ["KERNEL_CAPS", "SCHEDULES", "TILE_ELEMENTS", "cache_model", "describe",
           "kernel_body", "set_cache_model", "set_cpu_model", "set_scratch_poison",
           "set_stream_policy", "set_thread_work_floor", "use_kernels"]
