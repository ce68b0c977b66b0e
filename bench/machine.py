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
from bnbw_native import _config


def cache_sizes():
    """(L2 bytes per core, L3 bytes) from sysfs; falls back to this project's machine."""
    sizes = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(os.listdir(base)):
            if not entry.startswith("index"):
                continue
            with open(os.path.join(base, entry, "level")) as f:
                level = int(f.read())
            with open(os.path.join(base, entry, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
            value = int(text.rstrip("KMG")) * mult
            if kind != "Instruction":
                sizes[level] = value
    except OSError:
        pass
    return sizes.get(2, 1 << 20), sizes.get(3, 36 << 20)


L2_BYTES, L3_BYTES = cache_sizes()

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


def source_version():
    """`git describe --always --dirty` of the checkout bnbw_native was imported from, if any."""
    where = os.path.dirname(os.path.dirname(os.path.abspath(bnbw_native.__file__)))
    try:
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
        "kernel_body": _config.kernel_body(),
        "perf_counters": perf_counters_available(),
    }
