"""Benchmark runner for ``bnbw_native.batchnorm_training_backward`` (SPEC 3.1).

    python bench/run.py [--quick] [--threads 1,2] [--dtypes f32,f16,bf16] [--json PATH]
                        [--plot PATH] [--shapes NAMES] [--layouts ...] [--formulas ...]
                        [--peers torch,numpy,reference] [--split]

Each row is one case: a named shape (bench/shapes.py) x a memory layout x a storage dtype x
a formula x a thread count.  For every row, in one interleaved measurement:

* ours       the package, outputs preallocated with ``out=``, ``num_threads=`` passed;
* probe      a STREAM-like loop (bench/stream.c) with the case's traffic pattern, over
             buffers of the case's byte size, on the same thread count: the roofline;
* torch      ``aten.native_batch_norm_backward`` on views of the same data (optional);
* numpy f32  a plain vectorised float32 NumPy implementation, what a user would write;
* reference  the package's float64 NumPy reference ``bnbw_native.reference``.

Traffic model (bytes that must cross the memory interface for one call, two-pass schedule):
training (num_outputs=3) reads x and dy to reduce (8 B per f32 element), then reads x, dy and
writes dx to apply (12 B): 20 B per element.  Frozen (num_outputs=1) reads dy and writes dx:
8 B per element.  f16 and bf16 halve these.  The strided layout touches every cache line of a
2x wider buffer, so its bytes are doubled.  The probe runs that exact pattern (reduce pass then
apply pass, or one scale pass) on the same byte counts, so % of roofline = probe time / our time.

Every row is checked against the float64 reference (fails loudly); torch and the f32 NumPy
results are compared too and reported.  Results go to a terminal table, a JSON file and a PNG.
"""
import argparse
import ctypes
import hashlib
import io
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import tracemalloc
import warnings
import zlib
from dataclasses import asdict, dataclass, field
from time import perf_counter

import numpy as np

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

import shapes as shape_lists  # noqa: E402  (needs BENCH_DIR on the path)

import bnbw_native  # noqa: E402

try:
    import ml_dtypes
except ImportError:      # bf16 rows are skipped with a note
    ml_dtypes = None

try:
    import torch
except ImportError:      # torch columns are skipped with a note
    torch = None

from threadpoolctl import threadpool_info, threadpool_limits  # noqa: E402

EPSILON = 1e-5
LAYOUTS = ("NCX", "NXC", "strided")
FORMULAS = ("training", "frozen")
NUM_OUTPUTS = {"training": 3, "frozen": 1}
# Bytes per element per f32 tensor pass: training reads x, dy (reduce) + x, dy, dx (apply).
PASSES = {"training": 5, "frozen": 2}
TENSORS = {"training": 3, "frozen": 2}        # distinct tensors touched (cache footprint)
STRIDE_FACTOR = {"NCX": 1, "NXC": 1, "strided": 2}

DTYPES = {"f32": np.float32, "f16": np.float16}
if ml_dtypes is not None:
    DTYPES["bf16"] = ml_dtypes.bfloat16

# Largest accepted error (see `relative_error`) of ours against the float64 reference:
# f32 arithmetic with f64 sums, then one rounding to the storage type.  A wrong formula or a
# wrong element is off by O(1).
TOLERANCE = {  # dtype: (dx, diff_gamma / diff_beta, which are f32 for every T1 here)
    "f32": (2e-5, 2e-5),
    "f16": (2e-3, 2e-5),
    "bf16": (1.6e-2, 2e-5),
}

# torch's result differing from the reference by more than this means the arguments we pass
# it do not have our semantics (precision alone stays far below it).
TORCH_SEMANTICS_LIMIT = 0.05

WEAK_DRAM_PCT = 90.0     # DRAM-sized rows below this % of roofline are flagged
WEAK_CACHE_SPEEDUP = 2.0  # cache-sized rows below this speed-up over torch are flagged


class CheckFailed(AssertionError):
    """Our result disagrees with the float64 reference."""


# ---------------------------------------------------------------------------------------
# Machine description
# ---------------------------------------------------------------------------------------

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
        "torch": torch.__version__ if torch is not None else None,
        "ml_dtypes": ml_dtypes.__version__ if ml_dtypes is not None else None,
        "bnbw_native_config": text.getvalue().rstrip(),
        "bnbw_native_file": bnbw_native.__file__,
        "bnbw_native_git": source_version(),
        "perf_counters": perf_counters_available(),
    }


# ---------------------------------------------------------------------------------------
# Bandwidth probe (bench/stream.c, built at first use)
# ---------------------------------------------------------------------------------------

class Probe:
    """STREAM-like kernels over float32 buffers, called through ctypes.

    `reduce` reads 2 arrays, `apply` reads 2 and writes 1, `training` is reduce then apply
    (the two passes of the training backward), `scale` and `copy` read 1 and write 1."""

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
        raise ValueError(pattern)

    @staticmethod
    def _numpy_kernel(pattern, a, b, c):
        def reduce():
            return float(np.dot(a, b))

        def apply():
            np.multiply(a, np.float32(0.5), out=c)
            np.add(c, b, out=c)

        if pattern == "training":
            return lambda: (reduce(), apply())
        return {"reduce": reduce, "apply": apply,
                "scale": lambda: np.multiply(a, np.float32(0.5), out=c),
                "frozen": lambda: np.multiply(a, np.float32(0.5), out=c),
                "copy": lambda: np.copyto(c, a)}[pattern]


SUBJECTS = ("ours", "probe", "probe1", "reduce", "apply", "probe_reduce", "probe_apply")

PROBE_BYTES_PER_ELEMENT = {"reduce": 8, "apply": 12, "training": 20, "scale": 8, "copy": 8}


# ---------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------

@dataclass
class Protocol:
    """How long to measure.  Each implementation gets about `target` seconds per row,
    as `rounds` samples of `number` back-to-back calls, interleaved round by round."""
    target: float = 0.3          # seconds per implementation per row
    min_rounds: int = 5          # for ours and the probe
    min_rounds_peer: int = 3     # for peers whose call is shorter than `target`
    max_rounds: int = 60
    min_sample: float = 2e-3     # a sample lasts at least this long (tiny calls are batched)
    warmup: float = 0.02         # seconds of warm-up calls (at least one call)
    fixed_rounds: int = 0        # > 0: exactly this many rounds of one call (smoke tests)
    slow_peer_once: bool = False  # a peer whose warm-up call exceeds `target` is timed by
    #                               that call alone (quick mode: the f64 reference is slow)


FULL = Protocol(slow_peer_once=True)
QUICK = Protocol(target=0.02, min_rounds=3, min_rounds_peer=1, max_rounds=15,
                 min_sample=1e-3, warmup=0.003, slow_peer_once=True)


def summarise(samples):
    arr = np.asarray(samples)
    q1, med, q3 = np.percentile(arr, [25, 50, 75])
    return {"median": float(med), "min": float(arr.min()), "q1": float(q1), "q3": float(q3),
            "samples": len(samples)}


def measure(fns, protocol, subjects=("ours", "probe"), known=None):
    """Time the callables of `fns` ({name: fn}) interleaved; {name: summary of s/call}.

    Warm-up first (at least one call each), then rounds: in round k every implementation
    that still needs samples runs `number` calls, starting from a rotating position so no
    implementation always follows the same one.  The median per call is the figure used."""
    plan = {}
    warm_times = {}
    for name, fn in fns.items():
        warm = warm_times[name] = []
        if (known and name in known and protocol.slow_peer_once
                and known[name] >= protocol.target):
            warm.append(known[name])     # a slow peer already timed on this data: reuse
            plan[name] = (1, 0, 0)
            continue
        while not warm or (sum(warm) < protocol.warmup and not protocol.fixed_rounds):
            t0 = perf_counter()
            fn()
            warm.append(perf_counter() - t0)
        if protocol.fixed_rounds:
            plan[name] = (1, protocol.fixed_rounds, protocol.fixed_rounds)
            continue
        per_call = max(float(np.median(warm)), 1e-9)
        if protocol.slow_peer_once and name not in subjects and per_call >= protocol.target:
            plan[name] = (1, 0, 0)        # the warm-up call is the sample
            continue
        number = max(1, math.ceil(protocol.min_sample / per_call))
        floor = protocol.min_rounds if name in subjects else (
            protocol.min_rounds_peer if per_call < protocol.target else 1)
        rounds = int(min(protocol.max_rounds,
                         max(floor, round(protocol.target / (number * per_call)))))
        plan[name] = (number, rounds, floor)
    samples = {name: [] if plan[name][1] else warm_times[name] for name in fns}
    spent = dict.fromkeys(fns, 0.0)
    budget = 3 * protocol.target      # a noisy machine can make calls far slower than planned
    names = list(fns)
    k = 0

    def wanted(name):
        _, rounds, floor = plan[name]
        done = len(samples[name])
        return done < rounds and (done < floor or spent[name] < budget)

    while any(wanted(name) for name in names):
        for i in range(len(names)):
            name = names[(i + k) % len(names)]
            if not wanted(name):
                continue
            number = plan[name][0]
            fn = fns[name]
            t0 = perf_counter()
            for _ in range(number):
                fn()
            dt = perf_counter() - t0
            spent[name] += dt
            samples[name].append(dt / number)
        k += 1
    return {name: summarise(samples[name]) for name in names}


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------

def seed_of(name, dtype_key):
    return zlib.crc32(f"{name}/{dtype_key}".encode())


def make_problem(name, shape, dtype_key):
    """Logical NCX inputs (rounded to the storage dtype) and f32 statistics computed from
    them in f64, as a training forward would have saved them."""
    dtype = DTYPES[dtype_key]
    rng = np.random.default_rng(seed_of(name, dtype_key))
    C = shape[1]
    bshape = (1, C) + (1,) * (len(shape) - 2)
    centre = rng.uniform(-2, 2, C).astype(np.float32).reshape(bshape)
    spread = rng.uniform(0.5, 2, C).astype(np.float32).reshape(bshape)
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= spread
    x += centre
    dy = rng.standard_normal(shape, dtype=np.float32)
    x = x.astype(dtype, copy=False)
    dy = dy.astype(dtype, copy=False)
    red = tuple(d for d in range(len(shape)) if d != 1)
    x64 = x.astype(np.float64)
    mean64 = x64.mean(axis=red)
    x64 -= mean64.reshape(bshape)
    np.square(x64, out=x64)
    var64 = x64.mean(axis=red)
    del x64
    return {
        "name": name, "shape": tuple(shape), "dtype_key": dtype_key,
        "x": x, "dy": dy,
        "mean": mean64.astype(np.float32), "var": var64.astype(np.float32),
        "gamma": (1 + 0.25 * rng.standard_normal(C)).astype(np.float32),
        "dy_absmax": float(np.abs(dy).max()) if dy.size else 0.0,
    }


def layout_arrays(problem, layout):
    """(x, dy, dx, data_format, dx_gaps) for one layout.  dx_gaps is the unused half of a
    strided output buffer, filled with NaN to catch stray writes (None otherwise)."""
    x, dy = problem["x"], problem["dy"]
    if layout == "NCX":
        return x, dy, np.zeros_like(x), "NCX", None
    if layout == "NXC":
        x_l = np.ascontiguousarray(np.moveaxis(x, 1, -1))
        dy_l = np.ascontiguousarray(np.moveaxis(dy, 1, -1))
        return x_l, dy_l, np.zeros_like(x_l), "NXC", None
    if layout == "strided":
        wide = x.shape[:-1] + (2 * x.shape[-1],)
        views = []
        for src in (x, dy, None):
            buf = np.full(wide, np.nan, x.dtype)
            if src is not None:
                buf[..., ::2] = src
            views.append((buf[..., ::2], buf[..., 1::2]))
        return views[0][0], views[1][0], views[2][0], "NCX", views[2][1]
    raise ValueError(layout)


def to_layout(logical, layout):
    """A logical NCX array arranged like `layout`'s arrays (NXC moves C last)."""
    return np.moveaxis(logical, 1, -1) if layout == "NXC" else logical


# ---------------------------------------------------------------------------------------
# Implementations: ours, the f32 NumPy peer, torch, the float64 reference
# ---------------------------------------------------------------------------------------

def numpy_f32_backward(x, dy, mean, var, gamma, epsilon, data_format, num_outputs):
    """Batch-norm backward the way a NumPy user writes it: float32, vectorised."""
    axis = 1 if data_format == "NCX" else x.ndim - 1
    red = tuple(d for d in range(x.ndim) if d != axis)
    bshape = [1] * x.ndim
    bshape[axis] = -1
    x32 = x.astype(np.float32, copy=False)
    dy32 = dy.astype(np.float32, copy=False)
    r = (1 / np.sqrt(var + np.float32(epsilon))).astype(np.float32)
    if num_outputs == 1:
        dx = dy32 * r.reshape(bshape)
        return dx.astype(x.dtype, copy=False), None, None
    M = x.size // x.shape[axis]
    xm = x32 - mean.reshape(bshape)
    dbeta = dy32.sum(axis=red)
    dgamma = (xm * dy32).sum(axis=red) * r
    g = gamma if gamma is not None else np.ones_like(r)
    dx = (g * r).reshape(bshape) * (dy32 - (dbeta / M).reshape(bshape)
                                    - xm * (r * dgamma / M).reshape(bshape))
    return dx.astype(x.dtype, copy=False), dgamma, dbeta


def standin_reference(src, diff_dst, mean, variance, gamma=None, *, epsilon,
                      data_format="NXC", num_outputs=3):
    """Float64 stand-in with the signature of ``bnbw_native.reference``; used only when the
    package does not provide its reference yet."""
    x = np.asarray(src).astype(np.float64)
    g = np.asarray(diff_dst).astype(np.float64)
    axis = 1 if data_format == "NCX" else x.ndim - 1
    red = tuple(d for d in range(x.ndim) if d != axis)
    bshape = [1] * x.ndim
    bshape[axis] = -1
    eps = float(np.float32(epsilon))
    r = 1 / np.sqrt(np.asarray(variance, np.float64) + eps)
    if num_outputs == 1:
        return g * r.reshape(bshape), None, None
    M = x.size // x.shape[axis]
    xm = x - np.asarray(mean, np.float64).reshape(bshape)
    dbeta = g.sum(axis=red)
    dgamma = r * (xm * g).sum(axis=red)
    scale = np.ones_like(r) if gamma is None else np.asarray(gamma, np.float64)
    dx = (scale * r).reshape(bshape) * (g - (dbeta / M).reshape(bshape)
                                        - xm * (r * dgamma / M).reshape(bshape))
    return dx, dgamma, dbeta


def load_reference():
    """(function, description): the package's float64 reference, or the stand-in."""
    ref = getattr(bnbw_native, "reference", None)
    if ref is None:
        try:
            import importlib
            ref = importlib.import_module("bnbw_native.reference")
        except ImportError:
            ref = None
    fn = getattr(ref, "batchnorm_training_backward", None) if ref is not None else None
    if fn is None:
        return standin_reference, ("bench stand-in (bnbw_native.reference not found in this "
                                   "build)")
    return fn, "bnbw_native.reference"


def torch_view(arr):
    """A torch tensor viewing `arr` (bf16 through its 16-bit patterns)."""
    if ml_dtypes is not None and arr.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def torch_to_numpy(t, dtype):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dtype)
    return t.numpy()


def torch_inputs(x, dy, layout):
    """Logical NCX torch views of the layout's arrays (no copies)."""
    X, DY = torch_view(x), torch_view(dy)
    if layout == "NXC":
        order = (0, x.ndim - 1) + tuple(range(1, x.ndim - 1))
        X, DY = X.permute(*order), DY.permute(*order)
        fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.ndim)
        if fmt is not None:
            X, DY = X.contiguous(memory_format=fmt), DY.contiguous(memory_format=fmt)
    assert X.data_ptr() == x.ctypes.data and DY.data_ptr() == dy.ctypes.data, "torch copied"
    return X, DY


def torch_call(X, DY, problem, formula):
    aten = torch.ops.aten
    mean = torch.from_numpy(problem["mean"])
    var = torch.from_numpy(problem["var"])
    if formula == "training":
        weight = torch.from_numpy(problem["gamma"])
        invstd = torch.from_numpy(
            (1 / np.sqrt(problem["var"] + np.float32(EPSILON))).astype(np.float32))
        mask = [True, True, True]
        return lambda: aten.native_batch_norm_backward(DY, X, weight, None, None, mean, invstd,
                                                       True, EPSILON, mask)
    # frozen: eval mode with the statistics as running stats, gamma ignored as ours does
    mask = [True, False, False]
    return lambda: aten.native_batch_norm_backward(DY, X, None, mean, var, None, None, False,
                                                   EPSILON, mask)


# ---------------------------------------------------------------------------------------
# Result checks
# ---------------------------------------------------------------------------------------

def absmax(a):
    """max |a| without a temporary (NaN when `a` holds one); 0 for an empty array."""
    a = np.asarray(a)
    return float(max(a.max(), -a.min())) if a.size else 0.0


def relative_error(got, ref, floor=0.0, ref_absmax=None):
    """max |got - ref| / max(max |ref|, floor); 0 when both are exactly equal.  `floor` is
    the size of the terms the result is made of, for results that cancel to ~0."""
    if ref is None or got is None:
        return 0.0
    got = np.asarray(got)
    if got.size == 0:
        return 0.0
    if got.dtype.itemsize < 4:          # f16/bf16: exact in f32, which subtract understands
        got = got.astype(np.float32)
    diff = np.subtract(got, ref, dtype=np.float64)
    np.abs(diff, out=diff)
    worst = float(diff.max())
    if math.isnan(worst):                # NaN must sit exactly where the reference has NaN
        if not np.array_equal(np.isnan(got), np.isnan(ref)):
            return float("inf")
        worst = float(np.nanmax(diff)) if not np.isnan(diff).all() else 0.0
    if worst == 0.0:
        return 0.0
    scale = max(absmax(ref) if ref_absmax is None else ref_absmax, floor)
    return worst / scale if scale > 0 else float("inf")


def ref_scales(ref):
    """max |ref| per output (NaN ignored), computed once per reference result."""
    return [None if a is None else absmax(np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0))
            for a in ref]


def errors(result, ref, scales, problem, formula):
    """Relative errors (dx, dgamma, dbeta) of `result` against the float64 `ref`, whose
    max |.| per output are `scales`."""
    r = 1 / np.sqrt(problem["var"].astype(np.float64) + float(np.float32(EPSILON)))
    lead = r * (np.abs(problem["gamma"]) if formula == "training" else 1)
    floor = float(lead.max()) * problem["dy_absmax"] if lead.size else 0.0
    out = [relative_error(result[0], ref[0], floor, scales[0])]
    if formula == "training":
        out += [relative_error(result[1], ref[1], 0.0, scales[1]),
                relative_error(result[2], ref[2], 0.0, scales[2])]
    else:
        out += [0.0, 0.0]
    return out


# ---------------------------------------------------------------------------------------
# One row
# ---------------------------------------------------------------------------------------

@dataclass
class Row:
    case: str
    shape: tuple
    layout: str
    dtype: str
    formula: str
    threads: int
    elements: int
    size_class: str
    footprint_bytes: int
    model_bytes: int
    ours_ms: float
    ours_min_ms: float
    ours_iqr_ms: float
    gbs: float
    probe_ms: float
    probe_gbs: float
    roofline_pct: float
    probe_threads_ms: float    # the probe on exactly `threads` threads (probe_ms: best of 1, n)
    torch_ms: float = None
    numpy_ms: float = None
    ref_ms: float = None
    vs_torch: float = None
    vs_numpy: float = None
    vs_ref: float = None
    err: list = field(default_factory=list)
    torch_err: list = None
    numpy_err: list = None
    check: str = "pass"
    notes: list = field(default_factory=list)
    load1: float = None        # 1-minute load average when the row was measured
    split: dict = None         # --split: the two phases' times and % of their own roofline


class Runner:
    """The case machinery: shapes x dtypes x layouts x formulas x threads -> Rows."""

    def __init__(self, protocol, threads, dtypes, layouts=LAYOUTS, formulas=FORMULAS,
                 peers=("torch", "numpy", "reference"), probe=None, echo=print, split=False):
        self.protocol = protocol
        self.threads = list(threads)
        self.dtypes = list(dtypes)
        self.layouts = list(layouts)
        self.formulas = list(formulas)
        self.peers = set(peers)
        if torch is None:
            self.peers.discard("torch")
        self.probe = probe or Probe()
        self.reference, self.reference_name = load_reference()
        self.echo = echo
        # --split: time the two phases (backward_reduce, backward_apply) of training rows too
        self.split = split and hasattr(bnbw_native, "backward_reduce")
        self.rows = []

    def run_shapes(self, named_shapes):
        for name, shape in named_shapes.items():
            for dtype_key in self.dtypes:
                problem = make_problem(name, shape, dtype_key)
                probe_bufs = {}
                for layout in self.layouts:
                    arrays = layout_arrays(problem, layout)
                    for formula in self.formulas:
                        self.run_case(problem, layout, arrays, formula, probe_bufs)
                    del arrays
                del problem, probe_bufs
        return self.rows

    def run_case(self, problem, layout, arrays, formula, probe_bufs):
        x, dy, dx, data_format, dx_gaps = arrays
        k = NUM_OUTPUTS[formula]
        C = problem["shape"][1]
        mean, var, gamma = problem["mean"], problem["var"], problem["gamma"]
        out = (dx, np.zeros(C, np.float32), np.zeros(C, np.float32))[:k]
        t0 = perf_counter()
        ref = self.reference(x, dy, mean, var, gamma, epsilon=EPSILON,
                             data_format=data_format, num_outputs=k)
        known = {"reference": perf_counter() - t0}   # single-threaded: any thread count
        ref = [None if a is None else np.asarray(a).astype(np.float64) for a in ref[:3]]
        scales = ref_scales(ref)

        elements = int(np.prod(problem["shape"]))
        itemsize = x.dtype.itemsize
        factor = STRIDE_FACTOR[layout]
        model_bytes = PASSES[formula] * itemsize * elements * factor
        footprint = TENSORS[formula] * itemsize * elements * factor
        array_bytes = itemsize * elements * factor
        if array_bytes not in probe_bufs:
            probe_bufs[array_bytes] = self.probe.buffers(array_bytes)

        X = DY = None
        if "torch" in self.peers:
            X, DY = torch_inputs(x, dy, layout)

        for nthreads in self.threads:
            fns = {
                "ours": lambda: bnbw_native.batchnorm_training_backward(
                    x, dy, mean, var, gamma, epsilon=EPSILON, data_format=data_format,
                    num_outputs=k, out=out, num_threads=nthreads),
                "probe": self.probe.kernel(formula, probe_bufs[array_bytes], nthreads),
            }
            if nthreads > 1:   # the roofline may use fewer threads than it is given
                fns["probe1"] = self.probe.kernel(formula, probe_bufs[array_bytes], 1)
            if self.split and formula == "training":
                fns.update(self.phase_fns(x, dy, mean, var, gamma, data_format, out, nthreads,
                                          probe_bufs[array_bytes]))
            holder = {}
            if "torch" in self.peers:
                call = torch_call(X, DY, problem, formula)
                fns["torch"] = lambda: holder.__setitem__("torch", call())
            if "numpy" in self.peers:
                fns["numpy"] = lambda: holder.__setitem__("numpy", numpy_f32_backward(
                    x, dy, mean, var, gamma, EPSILON, data_format, k))
            if "reference" in self.peers:
                fns["reference"] = lambda: self.reference(
                    x, dy, mean, var, gamma, epsilon=EPSILON, data_format=data_format,
                    num_outputs=k)
            with threadpool_limits(limits=nthreads):
                if torch is not None:
                    torch.set_num_threads(nthreads)
                times = measure(fns, self.protocol, subjects=SUBJECTS, known=known)
            row = self.make_row(problem, layout, formula, nthreads, elements, footprint,
                                model_bytes, times)
            self.check_row(row, out, ref, scales, problem, dx_gaps)
            if "torch" in holder:
                t = holder.pop("torch")
                dx_t = to_layout(torch_to_numpy(t[0], x.dtype), layout)
                got = (dx_t, t[1].numpy() if k == 3 else None, t[2].numpy() if k == 3 else None)
                row.torch_err = errors(got, ref, scales, problem, formula)
                worst = max(row.torch_err)
                if not worst <= TORCH_SEMANTICS_LIMIT:
                    row.check = "FAIL"
                    raise CheckFailed(f"torch differs from the reference by {worst:.2g} on "
                                      f"{row.case} {row.layout} {row.dtype} {row.formula}: "
                                      "the arguments passed to torch do not mean what ours do")
                if not self.within(row.torch_err, row.dtype, slack=10):
                    row.notes.append(f"torch err {worst:.0e}")
            if "numpy" in holder:
                row.numpy_err = errors(holder.pop("numpy"), ref, scales, problem, formula)
            self.rows.append(row)
            self.echo(format_row(row))

    def phase_fns(self, x, dy, mean, var, gamma, data_format, out, nthreads, bufs):
        """The reduce and apply phases of a training call, and their probe patterns."""
        partial, count = bnbw_native.backward_reduce(x, dy, mean, data_format=data_format,
                                                     num_threads=nthreads)
        probe = self.probe
        return {
            "reduce": lambda: bnbw_native.backward_reduce(
                x, dy, mean, data_format=data_format, num_threads=nthreads),
            "apply": lambda: bnbw_native.backward_apply(
                x, dy, mean, var, gamma, partial, count, epsilon=EPSILON,
                data_format=data_format, out=out, num_threads=nthreads),
            "probe_reduce": probe.kernel("reduce", bufs, nthreads),
            "probe_apply": probe.kernel("apply", bufs, nthreads),
        }

    def make_row(self, problem, layout, formula, nthreads, elements, footprint, model_bytes,
                 times):
        ours = times["ours"]["median"]
        probe_n = times["probe"]["median"]
        probe = min(probe_n, times["probe1"]["median"]) if "probe1" in times else probe_n
        row = Row(
            case=problem["name"], shape=problem["shape"], layout=layout,
            dtype=problem["dtype_key"], formula=formula, threads=nthreads, elements=elements,
            size_class=size_class(footprint), footprint_bytes=footprint,
            model_bytes=model_bytes, ours_ms=ours * 1e3,
            ours_min_ms=times["ours"]["min"] * 1e3,
            ours_iqr_ms=(times["ours"]["q3"] - times["ours"]["q1"]) * 1e3,
            gbs=model_bytes / ours / 1e9, probe_ms=probe * 1e3,
            probe_gbs=model_bytes / probe / 1e9, roofline_pct=100 * probe / ours,
            probe_threads_ms=probe_n * 1e3, load1=os.getloadavg()[0])
        for peer, attr in (("torch", "torch_ms"), ("numpy", "numpy_ms"),
                           ("reference", "ref_ms")):
            if peer in times:
                setattr(row, attr, times[peer]["median"] * 1e3)
        if "reduce" in times:
            t = {k: times[k]["median"] for k in ("reduce", "apply", "probe_reduce",
                                                  "probe_apply")}
            row.split = {"reduce_ms": t["reduce"] * 1e3, "apply_ms": t["apply"] * 1e3,
                         "reduce_roofline_pct": 100 * t["probe_reduce"] / t["reduce"],
                         "apply_roofline_pct": 100 * t["probe_apply"] / t["apply"]}
            row.notes.append(f"reduce {row.split['reduce_roofline_pct']:.0f}% "
                             f"apply {row.split['apply_roofline_pct']:.0f}%")
        row.vs_torch = row.torch_ms / row.ours_ms if row.torch_ms else None
        row.vs_numpy = row.numpy_ms / row.ours_ms if row.numpy_ms else None
        row.vs_ref = row.ref_ms / row.ours_ms if row.ref_ms else None
        return row

    @staticmethod
    def within(errs, dtype_key, slack=1.0):
        tol_dx, tol_p = TOLERANCE[dtype_key]
        return errs[0] <= tol_dx * slack and max(errs[1:]) <= tol_p * slack

    def check_row(self, row, out, ref, scales, problem, dx_gaps):
        result = tuple(out) + (None,) * (3 - len(out))
        row.err = errors(result, ref, scales, problem, row.formula)
        problems = []
        if not self.within(row.err, row.dtype):
            problems.append(f"errors {row.err} above tolerance {TOLERANCE[row.dtype]}")
        if dx_gaps is not None and dx_gaps.size and not np.isnan(dx_gaps).all():
            problems.append("wrote between the elements of a strided diff_src")
        if problems:
            row.check = "FAIL"
            self.echo(format_row(row))
            raise CheckFailed(f"{row.case} {row.shape} {row.layout} {row.dtype} {row.formula} "
                              f"threads={row.threads}: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------
# Extra measurements
# ---------------------------------------------------------------------------------------

def bandwidth_table(probe, threads, protocol, quick):
    """GB/s of each probe pattern per thread count for an L2-, an L3- and a DRAM-sized
    array (per-array sizes; 3 arrays are touched by reduce+apply)."""
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


def call_overhead(rounds, number):
    """Median microseconds per call on the tiny shape: ours (out= and not), torch, numpy."""
    problem = make_problem("overhead", shape_lists.OVERHEAD_SHAPE, "f32")
    x, dy, mean, var, gamma = (problem[k] for k in ("x", "dy", "mean", "var", "gamma"))
    C = x.shape[1]
    out = (np.empty_like(x), np.empty(C, np.float32), np.empty(C, np.float32))
    fns = {
        "ours (out=, 1 thread)": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPSILON, data_format="NCX", out=out,
            num_threads=1),
        "ours (allocating, default threads)": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPSILON, data_format="NCX"),
        "ours frozen (out=, 1 thread)": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPSILON, data_format="NCX", num_outputs=1,
            out=out[:1], num_threads=1),
        "numpy f32": lambda: numpy_f32_backward(x, dy, mean, var, gamma, EPSILON, "NCX", 3),
    }
    if torch is not None:
        call = torch_call(*torch_inputs(x, dy, "NCX"), problem, "training")
        fns["torch (1 thread)"] = call
    result = {}
    if torch is not None:
        torch.set_num_threads(1)
    for name, fn in fns.items():   # batches of `number` calls, one implementation at a time
        for _ in range(number):
            fn()
        samples = []
        for _ in range(rounds):
            t0 = perf_counter()
            for _ in range(number):
                fn()
            samples.append((perf_counter() - t0) / number)
        result[name] = float(np.median(samples)) * 1e6
    return {"shape": list(shape_lists.OVERHEAD_SHAPE), "us_per_call": result}


def rss_kib():
    try:
        with open("/proc/self/status") as f:
            return {line.split(":")[0]: int(line.split()[1]) for line in f
                    if line.startswith(("VmRSS", "VmHWM"))}
    except OSError:
        return {}


def release_free_heap():
    """Return freed heap pages to the OS (glibc), so the next call's allocations show up as
    new resident pages instead of reusing pages an earlier call left behind."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_rss_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory(name, shape, reference):
    """Peak extra memory of one call on a large f32 NCX case.

    tracemalloc sees Python and NumPy allocations (not C malloc in the kernels, not torch's
    allocator).  The RSS figure is the growth of the resident high-water mark during the call
    (new pages touched, any allocator), when Linux lets us reset that mark."""
    problem = make_problem(name, shape, "f32")
    x, dy, mean, var, gamma = (problem[k] for k in ("x", "dy", "mean", "var", "gamma"))
    C = x.shape[1]
    out = (np.empty_like(x), np.empty(C, np.float32), np.empty(C, np.float32))
    out[0].fill(0)
    fns = {
        "ours training (out=)": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPSILON, data_format="NCX", out=out),
        "ours frozen (out=)": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPSILON, data_format="NCX", num_outputs=1,
            out=out[:1]),
        "ours training (allocating)": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPSILON, data_format="NCX"),
        "numpy f32 training": lambda: numpy_f32_backward(x, dy, mean, var, gamma, EPSILON,
                                                         "NCX", 3),
        "reference training": lambda: reference(x, dy, mean, var, gamma, epsilon=EPSILON,
                                                data_format="NCX", num_outputs=3),
    }
    if torch is not None:
        fns["torch training"] = torch_call(*torch_inputs(x, dy, "NCX"), problem, "training")
    result = {}
    for label, fn in fns.items():
        fn()                                   # warm: first-call allocations are not the point
        release_free_heap()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        can_reset = reset_rss_peak()
        rss0 = rss_kib().get("VmRSS")
        res = fn()
        traced = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
        rss = rss_kib()
        del res
        growth = (rss["VmHWM"] - rss0) * 1024 if can_reset and rss0 and "VmHWM" in rss else None
        result[label] = {"tracemalloc_bytes": int(traced), "rss_growth_bytes": growth}
    return {"case": name, "shape": list(shape), "tensor_bytes": int(x.nbytes),
            "peak": result}


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------

HEADER = (f"{'case':<10} {'layout':<7} {'dtype':<4} {'formula':<8} {'thr':>3} {'class':<4} "
          f"{'ms':>9} {'GB/s':>6} {'%roof':>6} {'xtorch':>6} {'xnp32':>6} {'xref':>6} "
          f"{'err dx':>8} check")


def fmt_ratio(value):
    return f"{value:6.2f}" if value is not None else "     -"


def format_row(row):
    notes = (" " + ",".join(row.notes)) if row.notes else ""
    return (f"{row.case:<10} {row.layout:<7} {row.dtype:<4} {row.formula:<8} {row.threads:>3} "
            f"{row.size_class:<4} {row.ours_ms:9.4f} {row.gbs:6.1f} {row.roofline_pct:6.1f} "
            f"{fmt_ratio(row.vs_torch)} {fmt_ratio(row.vs_numpy)} {fmt_ratio(row.vs_ref)} "
            f"{row.err[0] if row.err else float('nan'):8.1e} {row.check}{notes}")


def weak_rows(rows):
    """Rows that are input for kernel work: DRAM rows below WEAK_DRAM_PCT of roofline,
    cache-sized rows (tiny, L2, L3) below WEAK_CACHE_SPEEDUP x torch."""
    weak = []
    for row in rows:
        if row.size_class == "DRAM" and row.roofline_pct < WEAK_DRAM_PCT:
            weak.append((row, f"{row.roofline_pct:.0f}% of roofline"))
        elif row.size_class != "DRAM" and row.vs_torch is not None \
                and row.vs_torch < WEAK_CACHE_SPEEDUP:
            weak.append((row, f"{row.vs_torch:.2f}x torch"))
    return weak


def weak_summary(rows, weak):
    """[(class, dtype, formula, layout, threads), stats] for the groups holding weak rows."""
    weak_ids = {id(row) for row, _ in weak}
    groups = {}
    for row in rows:
        key = (row.size_class, row.dtype, row.formula, row.layout, row.threads)
        groups.setdefault(key, []).append(row)
    order = {c: i for i, c in enumerate(("DRAM", "L3", "L2", "tiny"))}
    out = []
    for key in sorted(groups, key=lambda k: (order.get(k[0], 9), k[1:])):
        members = groups[key]
        n_weak = sum(id(r) in weak_ids for r in members)
        if n_weak:
            ratios = [r.vs_torch for r in members if r.vs_torch is not None]
            out.append((key, {"weak": n_weak, "rows": len(members),
                              "roofline_pct": float(np.median([r.roofline_pct
                                                               for r in members])),
                              "vs_torch": float(np.median(ratios)) if ratios else float("nan")}))
    return out


def class_bandwidth(rows):
    """Median probe GB/s (model bytes / probe time) per (size class, formula, threads)."""
    groups = {}
    for row in rows:
        groups.setdefault((row.size_class, row.formula, row.threads), []).append(row.probe_gbs)
    return [{"class": c, "formula": f, "threads": t, "probe_gbs": float(np.median(v)),
             "rows": len(v)} for (c, f, t), v in sorted(groups.items())]


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = []
    for row in rows:
        key = (row.case, row.layout, row.formula)
        if key not in keys:
            keys.append(key)
    variants = sorted({(row.dtype, row.threads) for row in rows},
                      key=lambda v: (list(DTYPES).index(v[0]), v[1]))
    colors = {"f32": "tab:blue", "f16": "tab:orange", "bf16": "tab:green"}
    markers = ["o", "s", "^", "D"]
    thread_list = sorted({row.threads for row in rows})
    width = max(8.0, 0.28 * len(keys) + 2)
    fig, axes = plt.subplots(2, 1, figsize=(width, 8.5), sharex=True)
    spread = 0.6 / max(1, len(variants))
    for vi, (dtype_key, nthreads) in enumerate(variants):
        sel = [r for r in rows if (r.dtype, r.threads) == (dtype_key, nthreads)]
        xs = [keys.index((r.case, r.layout, r.formula)) - 0.3 + spread * (vi + 0.5)
              for r in sel]
        style = dict(color=colors.get(dtype_key, "k"), linestyle="none", markersize=5,
                     marker=markers[thread_list.index(nthreads) % len(markers)],
                     label=f"{dtype_key}, {nthreads} thread{'s' if nthreads > 1 else ''}")
        axes[0].plot(xs, [r.roofline_pct for r in sel], **style)
        torch_sel = [(x, r.vs_torch) for x, r in zip(xs, sel) if r.vs_torch]
        if torch_sel:
            axes[1].plot(*zip(*torch_sel), **style)
    axes[0].axhline(100, color="gray", lw=0.8)
    axes[0].axhline(WEAK_DRAM_PCT, color="gray", lw=0.8, ls=":")
    axes[0].set_ylabel("% of roofline (probe time / our time)")
    axes[0].set_title("bnbw_native.batchnorm_training_backward: % of the two-pass roofline")
    axes[0].legend(fontsize=7, ncol=len(variants))
    axes[1].set_yscale("log")
    axes[1].axhline(1, color="gray", lw=0.8)
    axes[1].axhline(WEAK_CACHE_SPEEDUP, color="gray", lw=0.8, ls=":")
    axes[1].set_ylabel("speed-up vs PyTorch (torch ms / our ms)")
    axes[1].set_title("speed-up vs torch.ops.aten.native_batch_norm_backward")
    axes[1].set_xticks(range(len(keys)))
    axes[1].set_xticklabels([f"{c} {l} {f}" for c, l, f in keys], rotation=90, fontsize=7)
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_xlim(-0.6, len(keys) - 0.4)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(results, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=lambda o: o.tolist()
                  if isinstance(o, np.ndarray) else str(o))


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def parse_list(text, allowed, what):
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (choose from {', '.join(allowed)})")
    return items


def parse_threads(text):
    cores = available_cores()
    out = []
    for t in text.split(","):
        t = t.strip()
        n = cores if t == "all" else int(t)
        if n <= 0:
            raise SystemExit("thread counts must be positive")
        if n not in out:
            out.append(n)
    return out


def select_shapes(text, quick):
    if not text:
        return dict(shape_lists.QUICK if quick else shape_lists.DEFAULT)
    chosen = {}
    for item in text.split(","):
        item = item.strip()
        if item in shape_lists.GROUPS:
            chosen.update(shape_lists.GROUPS[item])
        elif item == "QUICK":
            chosen.update(shape_lists.QUICK)
        elif item in shape_lists.ALL:
            chosen[item] = shape_lists.ALL[item]
        else:
            raise SystemExit(f"unknown shape or group: {item}")
    return chosen


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="QUICK shapes, f32 only unless --dtypes, short measurements")
    parser.add_argument("--threads", default="1,all", help="comma list, 'all' = every core")
    parser.add_argument("--dtypes", default=None, help="comma list of f32,f16,bf16")
    parser.add_argument("--shapes", default=None,
                        help="comma list of shape names or groups (RESNET50, QUICK, ...)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--formulas", default=",".join(FORMULAS))
    parser.add_argument("--peers", default="torch,numpy,reference",
                        help="comma list of torch,numpy,reference ('' for none)")
    parser.add_argument("--split", action="store_true",
                        help="also time backward_reduce and backward_apply of training rows "
                             "against the reduce (r2) and apply (r2w1) probes")
    parser.add_argument("--json", default=os.path.join(BENCH_DIR, "results", "latest.json"))
    parser.add_argument("--plot", default=os.path.join(BENCH_DIR, "results", "latest.png"))
    args = parser.parse_args(argv)

    wall0 = perf_counter()
    protocol = QUICK if args.quick else FULL
    threads = parse_threads(args.threads)
    dtypes = parse_list(args.dtypes or ("f32" if args.quick else ",".join(TOLERANCE)),
                        list(TOLERANCE), "dtype")
    notes = []
    if "bf16" in dtypes and ml_dtypes is None:
        dtypes.remove("bf16")
        notes.append("bf16 rows skipped: ml_dtypes is not installed")
    peers = parse_list(args.peers, ["torch", "numpy", "reference"], "peer")
    if torch is None and "torch" in peers:
        notes.append("torch columns skipped: torch is not importable")
    named = select_shapes(args.shapes, args.quick)

    probe = Probe()
    runner = Runner(protocol, threads, dtypes, parse_list(args.layouts, LAYOUTS, "layout"),
                    parse_list(args.formulas, FORMULAS, "formula"), peers, probe,
                    split=args.split)
    if runner.reference_name != "bnbw_native.reference":
        notes.append(f"reference: {runner.reference_name}")
    if probe.note:
        notes.append(probe.note)

    info = machine_info(threads)
    print(f"machine: {info['cpu']}, {info['cores']} cores, L2 {L2_BYTES >> 10} KiB/core, "
          f"L3 {L3_BYTES >> 20} MiB; load average {info['load_average']}")
    print(f"threads used: {threads}; numpy {info['numpy']}, torch {info['torch']}, "
          f"ml_dtypes {info['ml_dtypes']}, python {info['python']}")
    for lib in info["openmp_and_blas"]:
        print(f"runtime: {lib['user_api']}/{lib['internal_api']} {lib['filepath']} "
              f"(num_threads {lib['num_threads']})")
    print(info["bnbw_native_config"])
    print(f"  imported from:    {info['bnbw_native_file']} (git {info['bnbw_native_git']})")
    print(f"probe: {probe.kind}; reference: {runner.reference_name}; hardware counters "
          f"(perf stat): {'yes' if info['perf_counters'] else 'not available'}")
    for note in notes:
        print(f"NOTE: {note}")

    sections = {"setup": perf_counter() - wall0}
    t0 = perf_counter()
    print("\nbandwidth probes, GB/s (array = size of each of the 2-3 arrays touched):")
    bw = bandwidth_table(probe, threads, protocol, args.quick)
    sections["bandwidth table"] = perf_counter() - t0
    print(f"  {'class':<5} {'array':>9} {'thr':>3} " +
          " ".join(f"{p:>8}" for p in PROBE_BYTES_PER_ELEMENT))
    for e in bw:
        print(f"  {e['class']:<5} {e['array_bytes'] >> 10:>6}KiB {e['threads']:>3} " +
              " ".join(f"{e[p]:8.1f}" for p in PROBE_BYTES_PER_ELEMENT))

    print("\ntraffic model: training 20 B/element for f32 (reduce reads x, dy: 8; apply reads "
          "x, dy, writes dx: 12); frozen 8 B/element (reads dy, writes dx); f16/bf16 half "
          "that; strided layout x2 (whole cache lines of a 2x wider buffer)")
    print("columns: ms = median of our calls; GB/s = model bytes / ms; %roof = probe time / "
          "our time; xtorch, xnp32, xref = peer ms / our ms; err dx = vs float64 reference\n")
    print(HEADER)
    t0 = perf_counter()
    try:
        rows = runner.run_shapes(named)
    except CheckFailed as exc:
        print(f"\nRESULT CHECK FAILED: {exc}", file=sys.stderr)
        write_json({"machine": info, "failure": str(exc),
                    "rows": [asdict(r) for r in runner.rows]}, args.json)
        return 1
    sections["rows"] = perf_counter() - t0
    t0 = perf_counter()

    overhead = call_overhead(rounds=5 if args.quick else 9, number=300 if args.quick else 2000)
    print(f"\nper-call overhead on {tuple(overhead['shape'])} f32 NCX training (median us/call):")
    for name, us in overhead["us_per_call"].items():
        print(f"  {name:<36} {us:8.1f}")

    sections["overhead"] = perf_counter() - t0
    t0 = perf_counter()
    big_name = max(named, key=lambda n: np.prod(named[n]))
    memory = peak_memory(big_name, named[big_name], runner.reference)
    print(f"\npeak extra memory of one call on {big_name} {tuple(memory['shape'])} f32 NCX "
          f"(one tensor = {memory['tensor_bytes'] / 2**20:.1f} MiB):")
    print(f"  {'call':<28} {'tracemalloc':>12} {'RSS growth':>12}")
    for label, m in memory["peak"].items():
        rss = m["rss_growth_bytes"]
        print(f"  {label:<28} {m['tracemalloc_bytes'] / 2**20:9.2f} MiB "
              f"{'-' if rss is None else f'{rss / 2**20:9.2f} MiB':>12}")
    print("  (tracemalloc: Python/NumPy allocations only; RSS growth: new resident pages, any "
          "allocator, torch included)")

    sections["memory"] = perf_counter() - t0
    per_class = class_bandwidth(rows)
    print("\nprobe bandwidth per size class (median over rows, model bytes / probe time):")
    for e in per_class:
        print(f"  {e['class']:<5} {e['formula']:<8} {e['threads']} thread(s): "
              f"{e['probe_gbs']:6.1f} GB/s  ({e['rows']} rows)")

    weak = weak_rows(rows)
    print(f"\nweak rows (DRAM < {WEAK_DRAM_PCT:.0f}% of roofline, tiny/L2/L3 < "
          f"{WEAK_CACHE_SPEEDUP:.0f}x torch): {len(weak)} of {len(rows)}; by group "
          "(weak/rows, median % of roofline, median x torch):")
    for key, group in weak_summary(rows, weak):
        print(f"  {key[0]:<4} {key[1]:<4} {key[2]:<8} {key[3]:<7} thr {key[4]}: "
              f"{group['weak']:>2}/{group['rows']:<2} {group['roofline_pct']:6.1f}% "
              f"{group['vs_torch']:6.2f}x")

    info["load_average_end"] = list(os.getloadavg())
    wall = perf_counter() - wall0
    results = {
        "machine": info, "notes": notes,
        "protocol": asdict(protocol), "quick": args.quick,
        "traffic_model": {"training_bytes_per_f32_element": 20,
                          "frozen_bytes_per_f32_element": 8,
                          "half_precision": "half of f32", "strided_factor": 2},
        "tolerance": TOLERANCE, "bandwidth": bw, "bandwidth_per_class": per_class,
        "rows": [asdict(r) for r in rows], "overhead": overhead, "memory": memory,
        "weak": [{"case": r.case, "layout": r.layout, "dtype": r.dtype, "formula": r.formula,
                  "threads": r.threads, "why": why} for r, why in weak],
        "wall_seconds": wall,
    }
    t0 = perf_counter()
    if args.plot:
        plot(rows, args.plot)
    sections["plot"] = perf_counter() - t0
    results["section_seconds"] = sections
    results["wall_seconds"] = wall = perf_counter() - wall0
    write_json(results, args.json)
    print(f"\nwrote {args.json}" + (f" and {args.plot}" if args.plot else "") +
          f"; wall time {wall:.1f} s (" +
          ", ".join(f"{k} {v:.1f}" for k, v in sections.items()) +
          f"); load average at end {info['load_average_end']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
