"""Facts about the machine and the software a benchmark run measured: caches, cores, CPU model,
versions, the kernel body in use, whether hardware counters can be read."""
import io
import os
import platform
import subprocess
import sys

import numpy as np
from threadpoolctl import threadpool_info

import bnbw_native
from bnbw_native import tuning


# The caches the package's schedules size their work by (read from the OS once, with
# defaults where it does not say): the size classes below use the same figures.
L2_BYTES, L3_BYTES = tuning.cache_model()[:2]

TINY_BYTES = 64 << 10


def size_class(footprint):
    """Where a case's tensors fit: "tiny" (<= 64 KiB: the call overhead is all there is to
    see), "L2" (one core's L2), "L3", or "DRAM"."""
    if footprint <= TINY_BYTES:
        return "tiny"
    if footprint <= L2_BYTES:
        return "L2"
    if footprint <= L3_BYTES:
        return "L3"
    return "DRAM"


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def available_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def perf_counters_available():
    """Whether `perf stat` can count cycles here (it cannot in most VMs)."""
    try:
        done = subprocess.run(["perf", "stat", "-x,", "-e", "cycles,instructions", "true"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and "not supported" not in done.stderr \
        and "<not counted>" not in done.stderr


def source_version(package_file=None):
    """`git describe --always --dirty` of the checkout bnbw_native was imported from, or None
    when it was not imported from one: the folder above the package must be the top of a git
    work tree whose pyproject.toml names bnbw_native (an installed package inside some other
    project's checkout, e.g. a virtual environment there, has no version of ours to name)."""
    package = os.path.dirname(os.path.abspath(package_file or bnbw_native.__file__))
    where = os.path.dirname(package)
    try:
        with open(os.path.join(where, "pyproject.toml"), encoding="utf-8") as f:
            if 'name = "bnbw_native"' not in f.read():
                return None
        top = subprocess.run(["git", "-C", where, "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=20)
        if top.returncode != 0 or not os.path.samefile(top.stdout.strip(), where):
            return None
        done = subprocess.run(["git", "-C", where, "describe", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def module_version(name):
    try:
        return __import__(name).__version__
    except ImportError:
        return None


def machine_info(threads):
    text = io.StringIO()
    bnbw_native.show_config(file=text)
    return {
        "cpu": cpu_model(),
        "cores": available_cores(),
        "threads_used": list(threads),
        "l2_bytes_per_core": L2_BYTES,
        "l3_bytes": L3_BYTES,
        "load_average": list(os.getloadavg()),
        "openmp_and_blas": [
            {k: v for k, v in lib.items() if k in ("user_api", "internal_api", "prefix",
                                                  "filepath", "version", "num_threads")}
            for lib in threadpool_info()],
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "torch": module_version("torch"),
        "ml_dtypes": module_version("ml_dtypes"),
        "bnbw_native_config": text.getvalue().rstrip(),
        "bnbw_native_file": bnbw_native.__file__,
        "bnbw_native_git": source_version(),
        "kernel_body": tuning.kernel_body(),
        "perf_counters": perf_counters_available(),
    }
