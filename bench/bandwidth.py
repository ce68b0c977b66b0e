"""The bandwidth probe: STREAM-like loops (bench/stream.c, built at first use, called through
ctypes) with the traffic patterns of the backward's and the forward's passes, run on buffers of a
case's own byte size and thread count, so that every row has a roofline measured in the same
run."""
import ctypes
import hashlib
import os
import subprocess
import tempfile
import warnings

import numpy as np

from timing import measure

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))

# Bytes per f32 element each pattern moves.
PROBE_BYTES_PER_ELEMENT = {"reduce": 8, "apply": 12, "training": 20, "scale": 8, "copy": 8,
                           "forward": 12}


class Probe:
    """STREAM-like kernels over float32 buffers, called through ctypes.

    `reduce` reads 2 arrays, `apply` reads 2 and writes 1, `training` is reduce then apply
    (the two passes of the training backward), `scale` and `copy` read 1 and write 1,
    `forward` reads 1, then reads it again and writes 1 (the training forward's statistics
    pass, then its normalisation)."""

    def __init__(self, build_dir=None):
        self.lib = None
        self.note = ""
        try:
            self.lib = self._load(build_dir)
        except (OSError, subprocess.SubprocessError) as exc:
            self.note = (f"could not build bench/stream.c ({exc}); bandwidth probes fall back "
                         "to NumPy loops (single-threaded, extra traffic: roofline too low)")
            warnings.warn(self.note)
        if self.lib is not None:
            p, n = ctypes.c_void_p, ctypes.c_int64
            self.lib.bw_reduce.argtypes = [p, p, n, ctypes.c_int]
            self.lib.bw_reduce.restype = ctypes.c_double
            self.lib.bw_apply.argtypes = [p, p, p, n, ctypes.c_float, ctypes.c_int]
            self.lib.bw_training.argtypes = [p, p, p, n, ctypes.c_int]
            self.lib.bw_training.restype = ctypes.c_double
            self.lib.bw_scale.argtypes = [p, p, n, ctypes.c_float, ctypes.c_int]
            self.lib.bw_copy.argtypes = [p, p, n, ctypes.c_int]
            self.lib.bw_forward.argtypes = [p, p, n, ctypes.c_int]
            self.lib.bw_forward.restype = ctypes.c_double
        self.kind = "C/OpenMP (bench/stream.c)" if self.lib is not None else "NumPy fallback"

    @staticmethod
    def _load(build_dir):
        source = os.path.join(BENCH_DIR, "stream.c")
        with open(source, "rb") as f:
            code = f.read()
        cc = os.environ.get("CC") or "cc"
        attempts = [["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
                    ["-O3", "-fopenmp", "-fno-math-errno"]]
        build_dir = build_dir or os.path.join(tempfile.gettempdir(),
                                              f"bnbw_bench_build_{os.getuid()}")
        os.makedirs(build_dir, exist_ok=True)
        last = None
        for flags in attempts:
            key = hashlib.sha256(code + " ".join([cc] + flags).encode()).hexdigest()[:16]
            target = os.path.join(build_dir, f"stream-{key}.so")
            if not os.path.exists(target):
                partial = f"{target}.{os.getpid()}.tmp"
                done = subprocess.run([cc, *flags, "-shared", "-fPIC", source, "-o", partial],
                                      capture_output=True, text=True, timeout=120)
                if done.returncode != 0:
                    last = done.stderr.strip().splitlines()[-1:] or ["compiler failed"]
                    continue
                os.replace(partial, target)
            return ctypes.CDLL(target)
        raise OSError(f"{cc}: {last[0] if last else 'no compiler'}")

    def buffers(self, nbytes):
        """Three float32 arrays of `nbytes` each, pages already touched."""
        n = max(1, -(-nbytes // 4))
        return tuple(np.full(n, 1.0, np.float32) for _ in range(3))

    def kernel(self, pattern, bufs, nthreads):
        """A no-argument callable running `pattern` once over `bufs` on `nthreads`."""
        a, b, c = bufs
        n = a.size
        if self.lib is None:
            return self._numpy_kernel(pattern, a, b, c)
        pa, pb, pc = a.ctypes.data, b.ctypes.data, c.ctypes.data
        lib = self.lib
        if pattern == "training":
            return lambda: lib.bw_training(pa, pb, pc, n, nthreads)
        if pattern == "reduce":
            return lambda: lib.bw_reduce(pa, pb, n, nthreads)
        if pattern == "apply":
            return lambda: lib.bw_apply(pa, pb, pc, n, 0.5, nthreads)
        if pattern in ("scale", "frozen"):
            return lambda: lib.bw_scale(pa, pc, n, 0.5, nthreads)
        if pattern == "copy":
            return lambda: lib.bw_copy(pa, pc, n, nthreads)
        if pattern == "forward":
            return lambda: lib.bw_forward(pa, pc, n, nthreads)
        raise ValueError(pattern)

    @staticmethod
    def _numpy_kernel(pattern, a, b, c):
        def reduce():
            return float(np.dot(a, b))

        def apply():
            np.multiply(a, np.float32(0.5), out=c)
            np.add(c, b, out=c)

        def forward():
            total = float(a.sum())
            np.multiply(a, np.float32(0.5 + 0 * total), out=c)

        if pattern == "training":
            return lambda: (reduce(), apply())
        return {"forward": forward,"reduce": reduce, "apply": apply,
                "scale": lambda: np.multiply(a, np.float32(0.5), out=c),
                "frozen": lambda: np.multiply(a, np.float32(0.5), out=c),
                "copy": lambda: np.copyto(c, a)}[pattern]


def bandwidth_table(probe, threads, protocol, quick):
    """GB/s of each probe pattern per thread count for an L2-, an L3- and a DRAM-sized
    array (per-array sizes; 3 arrays are touched by reduce+apply, 2 by forward)."""
    sizes = {"L2": 128 << 10, "L3": 4 << 20, "DRAM": (32 if quick else 128) << 20}
    table = []
    for cls, nbytes in sizes.items():
        bufs = probe.buffers(nbytes)
        n = bufs[0].size
        for nthreads in threads:
            fns = {p: probe.kernel(p, bufs, nthreads) for p in PROBE_BYTES_PER_ELEMENT}
            times = measure(fns, protocol, subjects=tuple(fns))
            entry = {"class": cls, "array_bytes": nbytes, "threads": nthreads}
            for p, t in times.items():
                entry[p] = PROBE_BYTES_PER_ELEMENT[p] * n / t["median"] / 1e9
            table.append(entry)
        del bufs
    return table
