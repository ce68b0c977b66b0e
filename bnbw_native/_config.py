"""Thread count resolution, the kernel body, and build information.

The package default starts as None, meaning "what OpenMP would use now", read at every call so
that ``threadpoolctl.threadpool_limits`` (which sets OpenMP's max threads) is honoured.

Kernel bodies: every kernel exists as a portable body and as bodies for wider instruction
sets, chosen at run time from what the CPU runs; all give the same bits.  The environment
variable ``BNBW_KERNELS`` (``portable``, ``avx2``, ``avx512`` or ``neon``), read at import, caps
the choice: for tests, benchmarks, and machines where 512-bit code lowers the clock.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import IO, Any, Literal, Optional, overload

import numpy as np

from . import _engine, _rules

__version__ = "0.1.0"

# libgomp's thread pool does not survive fork(): a team of 2+ in the child of a process that
# started one hangs forever.  Such a child runs serial (results never depend on the thread
# count); the child of a process that never started a team keeps its threads.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_engine.after_fork_in_child)

# A thread count above this is refused as a mistake; a call runs on at most the CPUs this
# process may use, whatever it asks for.
MAX_THREADS = _rules.MAX_THREADS


def set_num_threads(n: Optional[int]) -> None:
    """Set the package default thread count; None (the initial state) follows OpenMP.  The
    default serves every call without num_threads=, C API calls with 0 threads included."""
    _engine.set_default_threads(_rules.requested_threads(n, "n"))


def get_num_threads() -> int:
    """The thread count a call without ``num_threads=`` would use now."""
    return int(_engine.threads_for(0))


# BNBW_KERNELS values: each caps the body at its level.  Levels are per architecture: 0 the
# portable body, 1 the first vector body (AVX2 on x86-64, NEON on AArch64), 2 AVX-512; a name
# this CPU cannot run stands for its level (neon on x86-64 runs AVX2, avx2 or avx512 on AArch64
# NEON), at most the best body the CPU runs.
KERNEL_CAPS = ("portable", "avx2", "avx512", "neon")
_CAP_LEVELS = {"portable": 0, "avx2": 1, "neon": 1, "avx512": 2}


def use_kernels(name: Optional[str]) -> Optional[str]:
    """Cap the kernel body at `name` (one of KERNEL_CAPS, or None for no cap) in every module
    and return the previous cap.  A body the CPU cannot run falls back to the best it can."""
    global _kernel_cap
    if name is not None and name not in KERNEL_CAPS:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CAPS)} or None, got {name!r}")
    level = max(_CAP_LEVELS.values()) if name is None else _CAP_LEVELS[name]
    _engine.set_body_cap(level)
    previous, _kernel_cap = _kernel_cap, name
    return previous


def kernel_body() -> str:
    """The kernel body in use: "portable", "AVX2", "AVX-512" or "NEON"."""
    return str(_engine.build_info()["kernels"])


_kernel_cap: Optional[str] = None
_requested = os.environ.get("BNBW_KERNELS")
if _requested is not None and _requested.strip():
    if _requested.strip().lower() in KERNEL_CAPS:
        use_kernels(_requested.strip().lower())
    else:
        warnings.warn(f"BNBW_KERNELS={_requested!r} is not one of {', '.join(KERNEL_CAPS)}; "
                      "ignored (the best body the CPU runs is used)", RuntimeWarning,
                      stacklevel=2)


def _build_record() -> Optional[dict[str, Any]]:
    """What setup.py recorded when it built the extension modules, or None (a build by other
    means)."""
    import importlib
    try:
        record = importlib.import_module(f"{__package__}._build_info")
    except ImportError:
        return None
    return dict(record.BUILD)


def _facts() -> dict[str, Any]:
    info = _engine.build_info()
    build = _build_record() or {}
    omp = info["openmp"]
    return {
        "version": __version__,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "build": {
            # the compiler that built the extension modules, not this interpreter's
            "compiler": build.get("compiler") or None,
            "compile_command": build.get("compile_command"),
            "extension_flags": build.get("extension_flags"),
            "python": build.get("python"),
            "platform": build.get("platform"),
        },
        "openmp": {
            "enabled": bool(omp),
            "version": int(omp) if omp else None,
            "note": build.get("openmp_note") or None,
        },
        "threads": {
            "current": get_num_threads(),
            "default": _engine.default_threads() or None,
        },
        "kernels": {
            "in_use": info["kernels"],
            "cpu": info["cpu_kernels"],
            "cap": _kernel_cap,
        },
        "half_conversion": info["half_path"],
    }


SHOW_CONFIG_MODES = ("stdout", "dicts")


@overload
def show_config(file: Optional[IO[str]] = None, *, mode: Literal["stdout"] = "stdout") -> None:
    ...


@overload
def show_config(file: Optional[IO[str]] = None, *,
                mode: Literal["dicts"]) -> dict[str, Any]:
    ...


def show_config(file: Optional[IO[str]] = None, *,
                mode: str = "stdout") -> Optional[dict[str, Any]]:
    """Print version, compiler, OpenMP, the kernel body in use and the SIMD paths.

    ``mode="dicts"`` returns the same facts as a dict instead of printing them (compiler and
    flags are the build's, from the record setup.py writes; None when the package was built
    another way).
    """
    if mode not in SHOW_CONFIG_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, SHOW_CONFIG_MODES))}, "
                         f"got {mode!r}")
    facts = _facts()
    if mode == "dicts":
        return facts
    build, omp, kernels = facts["build"], facts["openmp"], facts["kernels"]
    if build["compile_command"] is None:
        compiler = "unknown (no build record: not built by this package's setup.py)"
    else:
        compiler = build["compiler"] or build["compile_command"][0]
    if omp["enabled"]:
        openmp = f"on, version {omp['version']}"
    else:
        openmp = "off (serial build" + (f": {omp['note']}" if omp["note"] else "") + ")"
    cap = "" if kernels["cap"] is None else f", capped at {kernels['cap']}"
    lines = [
        f"bnbw_native {facts['version']}",
        f"python:           {facts['python']}, numpy {facts['numpy']}",
        f"compiler:         {compiler}",
    ]
    if build["compile_command"] is not None:
        flags = " ".join(build["compile_command"] + build["extension_flags"])
        lines.append(f"compile command:  {flags}")
    lines += [
        f"OpenMP:           {openmp}",
        f"threads:          {facts['threads']['current']} (default "
        f"{facts['threads']['default'] or 'OpenMP'})",
        f"kernels:          {kernels['in_use']} (this CPU runs up to {kernels['cpu']}{cap})",
        f"half conversion:  {facts['half_conversion']}",
    ]
    print("\n".join(lines), file=file)
    return None
