"""Memory: no leaks over 10,000 calls, no buffer export left behind by a refused call, and no
scratch proportional to the input inside the kernels.

Three meters: tracemalloc (Python objects and NumPy data), glibc's mallinfo2 (every malloc,
including the kernels' C scratch, which tracemalloc cannot see) and the resident set size.
Peak memory of one call is read from VmHWM after resetting it through /proc/self/clear_refs.
Sanitizer builds (.ci/sanitizers.sh) skip this module: ASan's allocator and quarantine make
these figures meaningless.
"""
import ctypes
import gc
import json
import os
import re
import subprocess
import tempfile
import sys
import tracemalloc

import numpy as np
import pytest

import bnbw_native
from bnbw_native import dml, ngraph, intel_spec
from conftest import bench_module

procmem = bench_module("procmem")       # the benchmark's memory readings

EPS = 1e-3
CALLS = 10_000


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo():
    try:
        libc = ctypes.CDLL(None)
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


MALLINFO = _mallinfo()


def malloc_heap():
    """Bytes of heap (non-mmapped) blocks malloc has handed out (glibc), or None elsewhere."""
    return None if MALLINFO is None else MALLINFO().uordblks


def malloc_maps():
    """Bytes of mmapped blocks malloc has handed out (glibc), or None elsewhere."""
    return None if MALLINFO is None else MALLINFO().hblkhd


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _status(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


reset_peak = procmem.reset_rss_peak     # VmHWM back to the current RSS (Linux >= 4.0)


# ---- 10,000 calls --------------------------------------------------------------------------

def _threaded_call():
    """A call past SERIAL_BELOW with a team of 2: block partials, one tile set per thread."""
    rng = np.random.default_rng(1)
    big = rng.normal(3, 2, (128, 3, 200)).astype(np.float32)
    m, v = np.full(3, 3, np.float32), np.full(3, 4, np.float32)
    return lambda: bnbw_native.batchnorm_training_backward(big, big, m, v, epsilon=EPS,
                                                           data_format="NCX", num_threads=2)


def _call_mix():
    """Callables over every entry point, refused calls included (their error paths must free
    what they took too)."""
    rng = np.random.default_rng(0)
    x = rng.normal(3, 2, (8, 3, 5)).astype(np.float32)
    dy = rng.normal(0, 1, x.shape).astype(np.float32)
    h = x.astype(np.float16)
    m, v, g = np.full(3, 3, np.float32), np.full(3, 4, np.float32), np.ones(3, np.float32)
    k = (1, 3, 1)
    out = (np.empty_like(x), np.empty(3, np.float32), np.empty(3, np.float32))
    partial, count = bnbw_native.backward_reduce(x, dy, m, data_format="NCX")
    bufs = dict(input=x, input_gradient=dy, mean=m.reshape(k), variance=v.reshape(k),
                scale=g.reshape(k), output_gradient=np.empty_like(x),
                output_scale_gradient=np.empty(k, np.float32),
                output_bias_gradient=np.empty(k, np.float32))
    descs = {name: dml.TensorDesc.from_array(a) for name, a in bufs.items()}
    op = dml.BatchNormalizationTrainingGrad(**descs, epsilon=EPS)
    # kept dims that do not merge: the plan mallocs a table of channel offsets per slot
    wide = rng.normal(size=(4, 3, 5, 6)).astype(np.float32)[:, :, ::2, :]
    st = np.ones((1, 3, 3, 1), np.float32)

    def refused(call, error):
        def run():
            try:
                call()
            except error:
                return
            raise AssertionError("the call was not refused")
        return run

    def new_operator():
        d = {name: dml.TensorDesc.from_array(a) for name, a in
             zip(dml.MEMBERS, [wide, wide, st, st, st, np.empty_like(wide), st, st])}
        dml.BatchNormalizationGrad(**d, epsilon=EPS)

    return [
        lambda: bnbw_native.batchnorm_training_backward(x, dy, m, v, g, epsilon=EPS,
                                                        data_format="NCX"),
        lambda: bnbw_native.batchnorm_training_backward(x, dy, m, v, g, epsilon=EPS,
                                                        data_format="NCX", out=out),
        lambda: bnbw_native.batchnorm_training_backward(h, h, m, v, epsilon=EPS,
                                                        data_format="NCX", num_outputs=1),
        lambda: intel_spec.batch_norm_training_backprop(x, dy, m, v, g, epsilon=EPS,
                                                    data_format="NCX"),
        lambda: ngraph.batch_norm_training_backprop(x, g, m, m, v, dy, epsilon=EPS),
        lambda: bnbw_native.backward_reduce(x, dy, m, data_format="NCX"),
        lambda: bnbw_native.backward_apply(x, dy, m, v, g, partial, count, epsilon=EPS,
                                           data_format="NCX"),
        lambda: dml.batch_normalization_grad(x, dy, m.reshape(k), v.reshape(k), g.reshape(k),
                                             EPS),
        lambda: dml.batch_normalization_training_grad(wide, wide, st, st, st, EPS),
        lambda: op.execute(**bufs, num_threads=2),
        new_operator,
        refused(lambda: bnbw_native.batchnorm_training_backward(x, dy, m, v, g, epsilon=0.0),
                ValueError),
        refused(lambda: bnbw_native.batchnorm_training_backward(
            x, dy, m, v, g, epsilon=EPS, data_format="NCX", out=(x, out[1], out[2])),
            ValueError),
        refused(lambda: op.execute(**dict(bufs, output_bias_gradient=bytearray(4))),
                ValueError),
        refused(lambda: op.execute(**dict(bufs, mean=0)), ValueError),
        refused(lambda: dml.BatchNormalizationGrad(**dict(descs, mean=descs["input"]),
                                                   epsilon=EPS), ValueError),
        refused(lambda: dml.TensorDesc("float32", (2 ** 40, 2 ** 40)), ValueError),
    ]


LEAK_SCRIPT = """
import gc, json, sys, tracemalloc
sys.path.insert(0, sys.argv[1])
import test_memory as tm

calls, threaded = tm._call_mix(), tm._threaded_call()
for _ in range(30):                    # warm caches, pools, lazy imports
    for call in calls:
        call()
    threaded()


def meters():
    gc.collect()
    return dict(objects=sys.getallocatedblocks(), heap=tm.malloc_heap() or 0,
                maps=tm.malloc_maps() or 0, rss=tm.rss())


def run(n, offset=0):
    before = meters()
    for i in range(offset, offset + n):
        calls[i % len(calls)]()
    after = meters()
    return {k: after[k] - before[k] for k in before}


def small(snapshot):
    # one-off blocks of 256 KiB and more are CPython's own address maps (obmalloc's radix tree
    # grows when an arena lands in a new address range), allocated at random moments
    traces = [t for t in snapshot.traces if t.size < 256 * 1024]
    return sum(t.size for t in traces), len(traces)


half = int(sys.argv[2]) // 2
first, second, third = run(half), run(half, half), run(half, half)
before = meters()
for _ in range(int(sys.argv[3])):
    threaded()
after = meters()
teams = {k: after[k] - before[k] for k in before}
tracemalloc.start()                    # 10x slower: two windows of 1,000 calls
windows = []
for w in range(3):
    gc.collect()
    b0, n0 = small(tracemalloc.take_snapshot())
    for i in range(1000):
        calls[i % len(calls)]()
    gc.collect()
    b1, n1 = small(tracemalloc.take_snapshot())
    windows.append(dict(bytes=b1 - b0, traces=n1 - n0))
tracemalloc.stop()
print(json.dumps(dict(first=first, second=second, third=third, teams=teams,
                      traced=windows[1:])))
"""


def test_no_leak_over_10000_calls():
    """10,000 calls over every entry point (refused calls included), 100 calls that open
    OpenMP teams, then 3,000 under tracemalloc, in a fresh process with glibc's mmap threshold
    pinned at 128 KiB (small C blocks stay in the heap meter).  Warm-up growth is allowed; what
    the second half of the calls adds must be nil: a leak of one object or C block in any one
    entry point adds ~290 blocks to the second half (the strict meter: allocated blocks and
    glibc's heap); tracemalloc's windows bound what NumPy data and Python objects add.
    Python's block count is read over two such halves: a leak grows both, while a one-off
    (a dict or free list resized at some moment, ~100 blocks now and then) lands in one."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(cwd=tempfile.gettempdir(), args=[sys.executable, "-c", LEAK_SCRIPT, os.path.dirname(__file__),
                           str(CALLS), "100"], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    grew = json.loads(proc.stdout.strip().splitlines()[-1])
    second, teams = grew["second"], grew["teams"]
    assert min(second["objects"], grew["third"]["objects"]) < 100, \
        f"Python objects accumulate: {grew}"
    assert second["heap"] < 8 * 1024 and teams["heap"] < 8 * 1024, f"malloc'd heap grows: {grew}"
    assert second["maps"] < 4 * 2 ** 20 and teams["maps"] < 4 * 2 ** 20, grew
    for window in grew["traced"]:        # NumPy's own caches still settle: a few dozen blocks
        assert window["traces"] < 150 and window["bytes"] < 16 * 1024, f"tracemalloc: {grew}"
    total_rss = grew["first"]["rss"] + second["rss"] + teams["rss"]
    assert total_rss < 16 * 2 ** 20, f"RSS grew: {grew}"


@pytest.mark.parametrize("spoil", ["too-small", "read-only", "misaligned", "overlap",
                                   "bad-threads", "success"])
def test_execute_releases_every_buffer_export(spoil):
    """A bytearray bound to execute() can be resized afterwards: no Py_buffer is left held,
    on any path out of execute()."""
    x = np.ones((2, 3), np.float32)
    m = np.zeros((1, 3), np.float32)
    d = {name: dml.TensorDesc.from_array(a) for name, a in
         zip(dml.MEMBERS, [x, x, m, m, m, x, m, m])}
    op = dml.BatchNormalizationGrad(**d, epsilon=EPS)
    raw = {name: bytearray(a.tobytes()) for name, a in
           zip(dml.MEMBERS, [x, x, m, m, m, x, m, m])}
    kwargs = dict(raw)
    if spoil == "too-small":
        kwargs["output_bias_gradient"] = bytearray(8)
    elif spoil == "read-only":
        kwargs["output_bias_gradient"] = bytes(12)
    elif spoil == "misaligned":
        kwargs["variance"] = memoryview(bytearray(13))[1:]
    elif spoil == "overlap":
        kwargs["output_scale_gradient"] = kwargs["mean"]
    kwargs["num_threads"] = 0 if spoil == "bad-threads" else 1
    if spoil == "success":
        op.execute(**kwargs)
    else:
        with pytest.raises(ValueError):
            op.execute(**kwargs)
    for name, buf in raw.items():
        try:
            buf.extend(b"\0" * 4)       # refused while a buffer export is still held
        except BufferError:
            pytest.fail(f"{name}: execute() left its buffer export held ({spoil})")


# ---- peak memory of one call ------------------------------------------------------------------

def _release_free_heap():
    """Give freed heap pages back to the system (glibc), so that memory a kernel reuses from an
    earlier call shows up as growth again."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_growth(call):
    """Bytes the resident set grew to at its peak during call(), above its level before; None
    when the peak cannot be reset here."""
    gc.collect()
    _release_free_heap()
    base = _status("VmRSS")
    if not reset_peak():
        return None
    call()
    return _status("VmHWM") - base


def touched(a):
    a[...] = 0
    return a


# name: (shape, data_format, dtype); 64 MiB per input
SCRATCH_CASES = {
    "ncx-f32": ((16, 16, 2 ** 16), "NCX", np.float32),
    "ncx-f16-strided": ((64, 16, 2 ** 15), "NCX", np.float16),
    "nxc-c8": ((2 ** 21, 8), "NXC", np.float32),
    "nxc-c1024": ((2 ** 14, 1024), "NXC", np.float32),
    "nxc-c4096": ((2 ** 12, 4096), "NXC", np.float32),
}
SCRATCH_RUNS = [(name, entry) for name in SCRATCH_CASES for entry in ("training", "reduce", "dml")
                if not (entry == "dml" and SCRATCH_CASES[name][2] != np.float32)]


def _scratch_problem(name):
    shape, fmt, dtype = SCRATCH_CASES[name]
    axis = 1 if fmt == "NCX" else len(shape) - 1
    C = shape[axis]
    x = np.empty(shape, dtype)
    x[...] = np.arange(shape[-1], dtype=np.float32) % 7
    dy = np.empty(shape, dtype)
    dy[...] = np.arange(shape[-1], dtype=np.float32) % 5 - 2
    if name.endswith("strided"):
        x, dy = x[::2], dy[::2]
    stats = [np.full(C, v, np.float32) for v in (3.0, 4.0, 1.0)]
    return x, dy, stats, fmt, C


def measure_scratch(name, entry, problem):
    """(peak RSS growth of one call with preallocated, touched outputs, input bytes)."""
    x, dy, (mean, var, gamma), fmt, C = problem
    if entry == "training":
        out = (touched(np.empty_like(x)), touched(np.empty(C, np.float32)),
               touched(np.empty(C, np.float32)))
        grew = peak_growth(lambda: bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPS, data_format=fmt, out=out, num_threads=2))
    elif entry == "reduce":
        grew = peak_growth(lambda: bnbw_native.backward_reduce(x, dy, mean, data_format=fmt,
                                                               num_threads=2))
    else:
        k = [1] * x.ndim
        k[1 if fmt == "NCX" else -1] = C
        st = [a.reshape(k) for a in (mean, var, gamma)]
        outs = [touched(np.empty_like(x)), touched(np.empty(k, np.float32)),
                touched(np.empty(k, np.float32))]
        op = dml.BatchNormalizationTrainingGrad(**{
            n: dml.TensorDesc.from_array(a)
            for n, a in zip(dml.MEMBERS, [x, dy] + st + outs)}, epsilon=EPS)
        grew = peak_growth(lambda: op.execute(**dict(zip(dml.MEMBERS, [x, dy] + st + outs)),
                                              num_threads=2))
    return grew, x.nbytes


SCRATCH_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import test_memory as tm
results, problem = {}, (None, None)
for name, entry in tm.SCRATCH_RUNS:
    if problem[0] != name:
        problem = (None, None)
        problem = (name, tm._scratch_problem(name))
    results[f"{name}-{entry}"] = tm.measure_scratch(name, entry, problem[1])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def scratch_growth():
    """Every case measured in one fresh process whose glibc mmap threshold is pinned at 128 KiB:
    each large block is mapped when allocated and unmapped when freed, so what a call allocates
    and touches shows in the peak whatever ran before."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(cwd=tempfile.gettempdir(), args=[sys.executable, "-c", SCRATCH_SCRIPT, os.path.dirname(__file__)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name, entry", SCRATCH_RUNS,
                         ids=[f"{name}-{entry}" for name, entry in SCRATCH_RUNS])
def test_kernels_allocate_no_input_sized_scratch(scratch_growth, name, entry):
    """Peak RSS growth of one call with preallocated, touched outputs stays within 4 MiB +
    1/1024 of the input: per-thread tiles, O(C) tables and the block sums of fixed BLOCK-element
    blocks fit; scratch that grows with the input does not."""
    grew, input_bytes = scratch_growth[f"{name}-{entry}"]
    if grew is None:
        pytest.skip("/proc/self/clear_refs is not writable here: peak RSS cannot be reset")
    allowed = 4 * 2 ** 20 + input_bytes // 1024
    assert grew <= allowed, (f"peak RSS grew by {grew / 2 ** 20:.1f} MiB during one call on "
                             f"{input_bytes / 2 ** 20:.0f} MiB inputs (allowed "
                             f"{allowed / 2 ** 20:.2f} MiB)")


@pytest.mark.parametrize("front", ["graph", "intel", "ngraph", "apply", "graph-f16-negative"])
def test_python_layer_copies_no_input(front):
    """With outputs given, tracemalloc's peak during a call (NumPy data included) stays O(C):
    the Python layer neither copies nor converts any input (aligned, native byte order)."""
    rng = np.random.default_rng(3)
    shape, C = (64, 16, 2048), 16
    dtype = np.float16 if front.endswith("negative") else np.float32
    x = rng.normal(3, 2, shape).astype(dtype)
    dy = rng.normal(0, 1, shape).astype(dtype)
    if front.endswith("negative"):
        x, dy = x[::-1, :, ::-1], dy[:, ::-1]
    m, v, g = (np.full(C, val, np.float32) for val in (3.0, 4.0, 1.0))
    out = (np.empty(shape, dtype), np.empty(C, np.float32), np.empty(C, np.float32))
    partial, count = bnbw_native.backward_reduce(x, dy, m, data_format="NCX")
    calls = {
        "graph": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, m, v, g, epsilon=EPS, data_format="NCX", out=out),
        "graph-f16-negative": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, m, v, g, epsilon=EPS, data_format="NCX", out=out),
        "intel": lambda: intel_spec.batch_norm_training_backprop(
            x, dy, m, v, g, epsilon=EPS, data_format="NCX", out=out),
        "ngraph": lambda: ngraph.batch_norm_training_backprop(
            x, g, m, m, v, dy, epsilon=EPS, out=out),
        "apply": lambda: bnbw_native.backward_apply(
            x, dy, m, v, g, partial, count, epsilon=EPS, data_format="NCX", out=out),
    }
    calls[front]()
    gc.collect()
    tracemalloc.start()
    try:
        calls[front]()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024 + 64 * C, f"{peak} bytes allocated for {x.nbytes}-byte inputs"
