"""Concurrency (contract 4): many Python threads at once, the GIL released while kernels run, OpenMP
inside Python threads, and calls from forked children.

Everything that could deadlock runs in a subprocess or behind a timeout, so a deadlock fails
the test instead of hanging the run.
"""
import concurrent.futures
import ctypes
import json
import os
import subprocess
import tempfile
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import bnbw_native
from bnbw_native import dml, ngraph, intel_spec
from conftest import graph_case as make_case
from error_bounds import same_bits

EPS = 1e-3


def problem(seed, shape, axis, dtype=np.float32, read_only=True):
    rng = np.random.default_rng(seed)
    x = rng.normal(3.0, 2.0, shape).astype(dtype)
    dy = (0.75 * (x.astype(np.float64) - 3.0) + rng.normal(0.5, 1.0, shape)).astype(dtype)
    c = shape[axis]
    stat = np.float32 if dtype == np.float16 else dtype
    mean = rng.normal(3.0, 0.1, c).astype(stat)
    var = rng.uniform(3.0, 5.0, c).astype(stat)
    gamma = rng.normal(1.0, 0.5, c).astype(stat)
    arrays = [x, dy, mean, var, gamma]
    if read_only:
        for a in arrays:
            a.flags.writeable = False
    return arrays


def child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


# ---- many threads -------------------------------------------------------------------------

def _jobs():
    """(name, call(num_threads)) over every entry point, on shared read-only inputs and on
    per-job inputs."""
    shared_ncx = problem(1, (32, 24, 40), 1)
    shared_nxc = problem(2, (48, 20, 33), 2)
    half = problem(3, (16, 40, 50), 1, np.float16)
    own = [problem(10 + i, (40, 7, 60), 1) for i in range(4)]
    k = (1, 24, 1)

    def graph(a, fmt):
        return lambda nt: bnbw_native.batchnorm_training_backward(
            *a, epsilon=EPS, data_format=fmt, num_threads=nt)

    def two_phase(a):
        def run(nt):
            partial, count = bnbw_native.backward_reduce(a[0], a[1], a[2], data_format="NCX",
                                                         num_threads=nt)
            return (partial,) + tuple(bnbw_native.backward_apply(
                *a, partial, count, epsilon=EPS, data_format="NCX", num_threads=nt))
        return run

    op = dml.BatchNormalizationTrainingGrad(
        **{m: dml.TensorDesc.from_array(a) for m, a in zip(
            dml.MEMBERS, [shared_ncx[0], shared_ncx[1]] + [s.reshape(k) for s in shared_ncx[2:]]
            + [shared_ncx[0], shared_ncx[2].reshape(k), shared_ncx[2].reshape(k)])},
        epsilon=EPS)

    def execute(nt):
        outs = (np.empty_like(shared_ncx[0]), np.empty(k, np.float32), np.empty(k, np.float32))
        op.execute(**dict(zip(dml.MEMBERS, [shared_ncx[0], shared_ncx[1]]
                              + [s.reshape(k) for s in shared_ncx[2:]] + list(outs))),
                   num_threads=nt)
        return outs

    jobs = [
        ("graph-ncx-shared", graph(shared_ncx, "NCX")),
        ("graph-nxc-shared", graph(shared_nxc, "NXC")),
        ("graph-f16", graph(half, "NCX")),
        ("graph1", lambda nt: bnbw_native.batchnorm_training_backward(
            *shared_nxc, epsilon=EPS, num_outputs=1, num_threads=nt)),
        ("intel", lambda nt: intel_spec.batch_norm_training_backprop(
            *shared_ncx, epsilon=EPS, data_format="NCX", num_threads=nt)),
        ("ngraph", lambda nt: ngraph.batch_norm_training_backprop(
            shared_ncx[0], shared_ncx[4], shared_ncx[2], shared_ncx[2], shared_ncx[3],
            shared_ncx[1], epsilon=EPS, num_threads=nt)),
        ("two-phase", two_phase(shared_ncx)),
        ("dml-convenience", lambda nt: dml.batch_normalization_grad(
            shared_ncx[0], shared_ncx[1], *[s.reshape(k) for s in shared_ncx[2:]], EPS,
            num_threads=nt)),
        ("dml-execute-shared-operator", execute),
    ] + [(f"graph-own-{i}", graph(a, "NCX")) for i, a in enumerate(own)]
    return jobs


def test_many_threads_agree_with_serial():
    """24 Python threads, each running every entry point 3 times with its own thread count
    (1, 2, 3 or the default), on shared read-only inputs and on inputs of their own: every
    result equals the serial one bit for bit."""
    jobs = _jobs()
    serial = {name: run(1) for name, run in jobs}
    n_threads, counts = 24, [1, 2, 3, None]

    def worker(i):
        mismatches = []
        for rep in range(3):
            for j, (name, run) in enumerate(jobs):
                nt = counts[(i + j + rep) % len(counts)]
                if not same_bits(run(nt), serial[name]):
                    mismatches.append((name, nt))
        return mismatches

    with concurrent.futures.ThreadPoolExecutor(max_workers=n_threads) as pool:
        futures = [pool.submit(worker, i) for i in range(n_threads)]
        results = [f.result(timeout=300) for f in futures]
    assert all(not r for r in results), [r for r in results if r]


def test_concurrent_graph_calls_agree_with_serial():
    """8 oneDNN Graph calls of their own on 4 Python threads, each with a team of 2."""
    cases = [make_case(np.random.default_rng(seed), (20000, 5)) for seed in range(8)]

    def run(case):
        result = bnbw_native.batchnorm_training_backward(**case, epsilon=EPS, num_threads=2)
        return [a.tobytes() for a in result]

    serial = [run(case) for case in cases]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        assert list(pool.map(run, cases)) == serial


# ---- the GIL is released while kernels run ------------------------------------------------

def progress_during(call):
    """Run call() while a pure-Python thread counts; return (duration, largest stretch of the
    call in which the counter did not advance, number of counter stamps inside the call)."""
    stamps = []
    stop = threading.Event()
    started = threading.Event()

    def counter():
        n = 0
        started.set()
        while not stop.is_set():
            n += 1
            if n % 64 == 0:
                stamps.append(time.perf_counter())

    thread = threading.Thread(target=counter, daemon=True)
    thread.start()
    started.wait()
    time.sleep(0.02)
    t0 = time.perf_counter()
    call()
    t1 = time.perf_counter()
    stop.set()
    thread.join()
    inside = [s for s in stamps if t0 <= s <= t1]
    points = [t0] + inside + [t1]
    return t1 - t0, max(b - a for a, b in zip(points, points[1:])), len(inside)


def assert_overlaps(call, attempts=5):
    """The counter advanced through the call: no stretch longer than half of it without
    progress.  A call holding the GIL shows one stretch as long as the call itself.  A busy
    machine may stall the counter thread once; every attempt must fail to fail.  The call must
    last 10 ms at least, long enough for thousands of counter stamps."""
    seen = []
    for _ in range(attempts):
        duration, gap, n = progress_during(call)
        seen.append((round(duration, 3), round(gap, 3), n))
        if duration >= 0.01 and gap < 0.5 * duration and n >= 20:
            return
    raise AssertionError(f"the counter thread stalled during the call (duration, longest "
                         f"stall, stamps): {seen}")


def test_detector_sees_a_call_that_holds_the_gil():
    """The negative control: ctypes.PyDLL keeps the GIL through usleep(300 ms)."""
    holding, releasing = ctypes.PyDLL(None).usleep, ctypes.CDLL(None).usleep
    duration, gap, n = progress_during(lambda: holding(300_000))
    assert gap >= 0.8 * duration, (duration, gap, n)
    assert_overlaps(lambda: releasing(300_000))          # CDLL releases it


BIG = (1024, 4, 4096)         # 2^24 elements, NCX, C = 4: ~0.1-0.2 s per call on one core


def _gil_calls():
    small = problem(5, (1, 4, 4096), 1)
    x, dy = np.empty(BIG, np.float32), np.empty(BIG, np.float32)
    np.copyto(x, np.broadcast_to(small[0], BIG))
    np.copyto(dy, np.broadcast_to(small[1], BIG))
    mean, var, gamma = small[2:]
    k = (1, 4, 1)
    partial, count = bnbw_native.backward_reduce(x, dy, mean, data_format="NCX")
    dx = np.empty(BIG, np.float32)
    op = dml.BatchNormalizationGrad(
        **{m: dml.TensorDesc.from_array(a) for m, a in zip(
            dml.MEMBERS, [x, dy, mean.reshape(k), var.reshape(k), gamma.reshape(k), dx,
                          mean.reshape(k), mean.reshape(k)])},
        epsilon=EPS)
    return {
        "batchnorm_training_backward": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPS, data_format="NCX", num_threads=1),
        "onednn": lambda: intel_spec.batch_norm_training_backprop(
            x, dy, mean, var, gamma, epsilon=EPS, data_format="NCX", num_threads=1),
        "ngraph": lambda: ngraph.batch_norm_training_backprop(
            x, gamma, mean, mean, var, dy, epsilon=EPS, num_threads=1),
        "backward_reduce": lambda: bnbw_native.backward_reduce(   # 2^26, zero strides
            np.broadcast_to(small[0], (4 * BIG[0],) + BIG[1:]),
            np.broadcast_to(small[1], (4 * BIG[0],) + BIG[1:]), mean, data_format="NCX",
            num_threads=1),
        "backward_apply": lambda: bnbw_native.backward_apply(
            x, dy, mean, var, gamma, partial, count, epsilon=EPS, data_format="NCX",
            num_threads=1),
        "dml_convenience": lambda: dml.batch_normalization_training_grad(
            x, dy, mean.reshape(k), var.reshape(k), gamma.reshape(k), EPS, num_threads=1),
        "dml_execute": lambda: op.execute(
            input=x, input_gradient=int(dy.ctypes.data), mean=mean, variance=var,
            scale=gamma, output_gradient=dx, output_scale_gradient=np.empty(4, np.float32),
            output_bias_gradient=np.empty(4, np.float32), num_threads=1),
    }


@pytest.fixture(scope="module")
def gil_calls():
    return _gil_calls()


@pytest.mark.parametrize("entry", ["batchnorm_training_backward", "onednn", "ngraph",
                                   "backward_reduce", "backward_apply", "dml_convenience",
                                   "dml_execute"])
def test_gil_is_released_during_kernels(gil_calls, entry):
    assert_overlaps(gil_calls[entry])


# ---- OpenMP inside Python threads -------------------------------------------------------------

OPENMP_IN_THREADS = textwrap.dedent("""
    import threading, numpy as np, bnbw_native
    rng = np.random.default_rng(0)
    x = rng.normal(3, 2, (2048, 64)).astype(np.float32)     # past the serial threshold
    dy = rng.normal(0, 1, x.shape).astype(np.float32)
    m, v = np.full(64, 3, np.float32), np.full(64, 4, np.float32)
    want = bnbw_native.batchnorm_training_backward(x, dy, m, v, epsilon=1e-3, num_threads=1)
    bad = []
    def work(i):
        for rep in range(40):
            nt = (None, 2, 3, 4)[(i + rep) % 4]
            r = bnbw_native.batchnorm_training_backward(x, dy, m, v, epsilon=1e-3,
                                                        num_threads=nt)
            if any(a.tobytes() != b.tobytes() for a, b in zip(r, want)):
                bad.append((i, nt))
    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts: t.start()
    for t in ts: t.join()
    print("ok" if not bad else f"mismatch {bad[:5]}")
""")


def test_openmp_teams_inside_python_threads_do_not_deadlock():
    """8 Python threads each opening OpenMP teams of 2 to 4 threads, 320 calls, in a child
    process with a deadline."""
    proc = subprocess.run(cwd=tempfile.gettempdir(), args=[sys.executable, "-c", OPENMP_IN_THREADS], capture_output=True,
                          text=True, timeout=120, env=child_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok", proc.stdout


# ---- calls from forked children -----------------------------------------------------------

FORKS = textwrap.dedent("""
    import json, multiprocessing, os, signal, sys, time
    import numpy as np, bnbw_native
    from bnbw_native import dml
    DEADLINE = float(sys.argv[1])
    rng = np.random.default_rng(0)
    x = rng.normal(3, 2, (4096, 64)).astype(np.float32)     # 262144 elements: OpenMP runs
    dy = rng.normal(0, 1, x.shape).astype(np.float32)
    m, v, g = np.full(64, 3, np.float32), np.full(64, 4, np.float32), np.ones(64, np.float32)
    # the parent uses OpenMP with 2 threads before any fork
    want = bnbw_native.batchnorm_training_backward(x, dy, m, v, g, epsilon=1e-3, num_threads=2)
    want = b"".join(a.tobytes() for a in want)
    k = (1, 64)
    op = dml.BatchNormalizationTrainingGrad(
        **{n: dml.TensorDesc.from_array(a) for n, a in zip(
            dml.MEMBERS, [x, dy, m.reshape(k), v.reshape(k), g.reshape(k), x, m.reshape(k),
                          m.reshape(k)])}, epsilon=1e-3)

    def graph(nt):
        r = bnbw_native.batchnorm_training_backward(x, dy, m, v, g, epsilon=1e-3,
                                                    num_threads=nt)
        return b"".join(a.tobytes() for a in r) == want

    def execute(nt):
        outs = [np.empty_like(x), np.empty(k, np.float32), np.empty(k, np.float32)]
        op.execute(**dict(zip(dml.MEMBERS, [x, dy, m.reshape(k), v.reshape(k), g.reshape(k)]
                              + outs)), num_threads=nt)
        return b"".join(a.tobytes() for a in outs) == want

    CHILDREN = {"fork-num_threads-1": (graph, 1), "fork-num_threads-2": (graph, 2),
                "fork-default-threads": (graph, None), "fork-dml-execute-2": (execute, 2)}
    status, pids = {}, {}
    for name, (fn, nt) in CHILDREN.items():
        pid = os.fork()
        if pid == 0:
            try:
                code = 0 if fn(nt) else 3
            except BaseException:
                code = 4
            os._exit(code)
        pids[pid] = name
    ctx = multiprocessing.get_context("fork")
    pool = ctx.Pool(2)
    pending = pool.map_async(graph, [2, 2, None, 1])
    end = time.monotonic() + DEADLINE
    while pids and time.monotonic() < end:
        pid, st = os.waitpid(-1, os.WNOHANG)
        if pid in pids:
            code = os.waitstatus_to_exitcode(st)
            status[pids.pop(pid)] = {0: "ok", 3: "wrong result", 4: "raised"}.get(code, code)
        elif pid == 0:
            time.sleep(0.02)
    for pid, name in pids.items():
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        status[name] = "deadlock"
    try:
        status["multiprocessing-fork-pool"] = (
            "ok" if all(pending.get(timeout=max(0.1, end - time.monotonic())))
            else "wrong result")
    except multiprocessing.TimeoutError:
        status["multiprocessing-fork-pool"] = "deadlock"
    pool.terminate()
    print(json.dumps(status))
""")



@pytest.fixture(scope="module")
def fork_status():
    """Run every fork scenario at once in one child process (children killed after 6 s)."""
    env = child_env()
    env["OMP_NUM_THREADS"] = "2"          # "default threads" means a team of 2 everywhere
    proc = subprocess.run(cwd=tempfile.gettempdir(), args=[sys.executable, "-c", FORKS, "6"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scenario", [
    "fork-num_threads-1",
    "fork-num_threads-2",
    "fork-default-threads",
    "fork-dml-execute-2",
    "multiprocessing-fork-pool",
])
def test_call_from_forked_child(fork_status, scenario):
    assert fork_status[scenario] == "ok", fork_status
