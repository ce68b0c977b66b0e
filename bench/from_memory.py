"""Kernel calls on data that comes from memory, as a layer's does inside a model: ours against
torch's aten kernels, training forward and backward, float32, NCX and NXC.

    python bench/from_memory.py                                   # RESNET50 shapes, 1 thread
    python bench/from_memory.py --shapes r50-conv4,cache-4d --threads 1,2 --bytes 2e9

`bench/run.py` calls each row on the same arrays again and again, so a tensor of a few MiB is
read from the caches; inside a model each layer's tensors were last touched many layers ago
(docs/benchmark-history.md, 7e: a ResNet-50 batch norm ran 2-2.5x slower in the model than
the same call repeated). Here every call takes the next of K copies of (x, dy, y or dx) in
turn, K chosen so that the copies hold --bytes together (default: twice the L3 the machine
reports, at least 256 MiB): no call finds its tensors in a cache. Both sides read and write
the very same buffers: ours through `out=` on NumPy arrays, torch through tensors sharing
their memory, its outputs in reused blocks (bench/torch_cache.cpp, when it builds). The
implementations are timed interleaved (timing.measure); a figure is a median per call.

Columns: ms per call, ours and torch's; x = torch / ours (> 1: ours is faster); K; err = the
largest relative difference of ours from torch's y and dx on the first copy, checked before
the timing (a row beyond 1e-3 stops the run).
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bnbw_native  # noqa: E402
import bnbw_native.tuning  # noqa: E402

import shapes as shape_lists  # noqa: E402
import torch_cache  # noqa: E402
from machine import cpu_model  # noqa: E402
from timing import FULL, QUICK, measure  # noqa: E402

try:
    import torch
except ImportError:             # ours alone
    torch = None

EPSILON = 1e-5
MOMENTUM = 0.1
TOLERANCE = 1e-3      # float32 kernels on unit-variance data agree far closer than this
LAYOUTS = ("NCX", "NXC")


MAX_COPIES = 4096     # tiny shapes: the call's own cost rules there, not where data lie


def copies_for(nbytes_each, budget):
    """How many copies of a case's buffers fill `budget` bytes (2 to MAX_COPIES)."""
    return min(MAX_COPIES, max(2, int(budget // max(nbytes_each, 1))))


def default_budget():
    """Twice the L3 the schedules read for this machine, and at least 256 MiB."""
    _, l3, _ = bnbw_native.tuning.cache_model()
    return max(2 * l3, 256 << 20)


def case(shape, layout, copies, seed=0):
    """K copies of x, dy and an output in `layout` (NCX: as given; NXC: channels moved last),
    and the per-channel arrays."""
    rng = np.random.default_rng(seed)
    dims = shape if layout == "NCX" else (shape[0], *shape[2:], shape[1])
    make = lambda: rng.standard_normal(dims, dtype=np.float32)  # noqa: E731
    C = shape[1]
    return {"x": [make() for _ in range(copies)], "dy": [make() for _ in range(copies)],
            "out": [np.empty(dims, np.float32) for _ in range(copies)],
            "mean": np.zeros(C, np.float32), "var": np.ones(C, np.float32),
            "gamma": np.ones(C, np.float32), "beta": np.zeros(C, np.float32), "C": C}


def rotating(calls, copies):
    """A callable that runs calls(k) for k = 0, 1, ... K-1, 0, ... one per call."""
    state = [0]

    def run():
        k = state[0]
        state[0] = (k + 1) % copies
        calls(k)
    return run


def ours(c, layout, threads):
    """Our forward and backward of copy k, written into its output."""
    C = c["C"]
    params = [np.empty(C, np.float32) for _ in range(4)]
    grads = [np.empty(C, np.float32) for _ in range(2)]

    def forward(k):
        bnbw_native.batchnorm_training_forward(
            c["x"][k], c["mean"], c["var"], c["gamma"], c["beta"], epsilon=EPSILON,
            momentum=MOMENTUM, data_format=layout, out=(c["out"][k], *params),
            num_threads=threads)

    def backward(k):
        bnbw_native.batchnorm_training_backward(
            c["x"][k], c["dy"][k], c["mean"], c["var"], c["gamma"], epsilon=EPSILON,
            data_format=layout, out=(c["out"][k], *grads), num_threads=threads)
    return forward, backward


def theirs(c, layout):
    """aten's forward and backward on tensors over the same buffers (NXC: channels_last
    views of the (N, C, *) shape)."""
    def view(a):
        t = torch.from_numpy(a)
        if layout == "NXC":
            t = t.permute(0, a.ndim - 1, *range(1, a.ndim - 1))
        return t
    X = [view(a) for a in c["x"]]
    DY = [view(a) for a in c["dy"]]
    w, b = torch.from_numpy(c["gamma"]), torch.from_numpy(c["beta"])
    rm, rv = torch.zeros(c["C"]), torch.ones(c["C"])
    # the statistics ours is given (mean 0, variance 1), as aten's backward takes them
    save_mean = torch.from_numpy(c["mean"])
    save_invstd = torch.from_numpy(1 / np.sqrt(c["var"].astype(np.float64) + EPSILON)).float()

    def forward(k):
        return torch.ops.aten.native_batch_norm(X[k], w, b, rm, rv, True, MOMENTUM,
                                                EPSILON)[0]

    def backward(k):
        return torch.ops.aten.native_batch_norm_backward(DY[k], X[k], w, rm, rv, save_mean,
                                                         save_invstd, True, EPSILON,
                                                         [True, True, True])[0]
    return forward, backward


def disagreement(c, layout, mine, peer):
    """The largest relative difference between ours and torch's y and dx on the first copy
    (each pass's output compared in NCX order): a row whose sides compute different things
    must not be timed."""
    worst = 0.0
    for ours_pass, torch_pass in zip(mine, peer):
        ours_pass(0)
        got = c["out"][0] if layout == "NCX" else np.moveaxis(c["out"][0], -1, 1)
        want = torch_pass(0).numpy()
        worst = max(worst, float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)))
    return worst


def rows(names, layouts, threads, protocol, budget, echo=None):
    """One row per (threads, shape, layout, pass): {"ours_ms", "torch_ms", "vs_torch", ...}."""
    out = []
    cache = torch_cache.load() if torch is not None else None
    was = torch.get_num_threads() if torch is not None else None
    try:
        for nt in threads:
            if torch is not None:
                torch.set_num_threads(nt)
            for name in names:
                shape = shape_lists.ALL[name]
                for layout in layouts:
                    nbytes = 3 * 4 * int(np.prod(shape))
                    copies = copies_for(nbytes, budget)
                    c = case(shape, layout, copies)
                    mine = ours(c, layout, nt)
                    fns = {"ours forward": rotating(mine[0], copies),
                           "ours backward": rotating(mine[1], copies)}
                    err = None
                    if torch is not None:
                        peer = theirs(c, layout)
                        err = disagreement(c, layout, mine, peer)
                        if not err <= TOLERANCE:
                            raise RuntimeError(f"{name} {layout}: ours and torch's differ by "
                                               f"{err:.1e} relative (> {TOLERANCE:.0e})")
                        fns["torch forward"] = rotating(peer[0], copies)
                        fns["torch backward"] = rotating(peer[1], copies)
                    installed = cache is not None and cache.on()
                    try:
                        # every copy once, untimed: no page is first touched while timed
                        for fn in fns.values():
                            for _ in range(copies):
                                fn()
                        times = measure(fns, protocol, subjects=tuple(fns))
                    finally:
                        if installed:
                            cache.off()
                            cache.flush()
                    for what in ("forward", "backward"):
                        ours_ms = times[f"ours {what}"]["median"] * 1e3
                        peer_ms = (times[f"torch {what}"]["median"] * 1e3
                                   if f"torch {what}" in times else None)
                        row = {"threads": nt, "shape": name, "dims": list(shape),
                               "layout": layout, "pass": what, "copies": copies,
                               "ours_ms": ours_ms, "torch_ms": peer_ms, "err": err,
                               "vs_torch": None if peer_ms is None else peer_ms / ours_ms}
                        out.append(row)
                        if echo is not None:
                            echo(row)
                    del c, fns, mine
    finally:
        if was is not None:
            torch.set_num_threads(was)
    return out


def format_row(r):
    peer = "      -" if r["torch_ms"] is None else f"{r['torch_ms']:7.3f}"
    ratio = "    -" if r["vs_torch"] is None else f"{r['vs_torch']:5.2f}"
    err = "      -" if r["err"] is None else f"{r['err']:7.1e}"
    return (f"{r['threads']:3} {r['shape']:14} {r['layout']:4} {r['pass']:8} "
            f"{r['ours_ms']:8.3f} {peer} {ratio} {r['copies']:5} {err}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(shape_lists.RESNET50),
                    help="comma list of shape names (bench/shapes.py; default RESNET50)")
    ap.add_argument("--layouts", default="NCX,NXC", help="comma list of NCX,NXC")
    ap.add_argument("--threads", default="1", help="comma list of thread counts")
    ap.add_argument("--bytes", type=float, default=None,
                    help="bytes the copies hold together (default: twice the L3, >= 256 MiB)")
    ap.add_argument("--quick", action="store_true", help="short measurements")
    args = ap.parse_args(argv)
    names = [s for s in args.shapes.split(",") if s]
    for n in names:
        if n not in shape_lists.ALL:
            raise SystemExit(f"unknown shape {n!r}; known: {', '.join(shape_lists.ALL)}")
    layouts = [s for s in args.layouts.split(",") if s]
    for lay in layouts:
        if lay not in LAYOUTS:
            raise SystemExit(f"unknown layout {lay!r}; known: NCX, NXC")
    threads = [int(t) for t in args.threads.split(",") if t]
    budget = default_budget() if args.bytes is None else args.bytes
    print(f"machine: {cpu_model()}; copies hold {budget / 2**20:.0f} MiB per case; "
          f"torch {'absent' if torch is None else torch.__version__}")
    print("thr shape          lay  pass      ours ms torch ms   x   copies     err")
    rows(names, layouts, threads, QUICK if args.quick else FULL, budget,
         echo=lambda r: print(format_row(r), flush=True))


if __name__ == "__main__":
    main()
