"""The README's first command: run the fast kernels next to the float64 NumPy reference on
ResNet-50-sized batch norms (and next to PyTorch's own CPU backward when PyTorch is
importable), check the results and print timings (``bnbw-demo``)."""
import argparse
import os
import time

import numpy as np

from . import batchnorm_training_backward, get_num_threads, show_config
from ._engine import cpu_count
from .reference import batchnorm_training_backward as reference

# logical (N, C, *spatial) sizes; each case runs channels-first (NCX) and channels-last (NXC)
DEMO_SHAPES = {"resnet50-conv2": (32, 64, 56, 56),
               "resnet50-conv4": (32, 256, 14, 14),
               "dense": (256, 2048)}
EPSILON = 1e-5
TOLERANCE = 1e-5          # max-relative error our results must stay within


def make_case(shape, data_format, rng):
    """NCX shapes laid out for `data_format`; statistics from the data, as a forward saves."""
    if data_format == "NXC":
        shape = (shape[0],) + shape[2:] + (shape[1],)
    axis = 1 if data_format == "NCX" else len(shape) - 1
    x = (rng.standard_normal(shape, dtype=np.float32) * 2 + 3).astype(np.float32)
    dy = rng.standard_normal(shape, dtype=np.float32)
    reduce_axes = tuple(d for d in range(len(shape)) if d != axis)
    mean = x.mean(axis=reduce_axes, dtype=np.float64).astype(np.float32)
    var = x.var(axis=reduce_axes, dtype=np.float64).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, shape[axis]).astype(np.float32)
    return x, dy, mean, var, gamma


def best_time(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def max_relative_error(got, ref):
    scale = np.abs(ref).max() or 1.0
    return float(np.abs(np.asarray(got).astype(np.float64) - ref).max() / scale)


def import_torch():
    """torch, or None when it is not importable (the demo then compares with NumPy only)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


class TorchPeer:
    """PyTorch's CPU training backward, aten.native_batch_norm_backward, on the same data.

    Timed both ways it can be called: the functional op (allocates its three outputs) and its
    .out overload into outputs allocated once; the faster counts.  torch sees the channels-last
    case as an (N, C, H, W) view with channels_last strides, the memory our call reads."""

    def __init__(self, torch):
        self.torch = torch
        self.op = torch.ops.aten.native_batch_norm_backward
        self.has_out = "out" in self.op.overloads()

    def bind(self, x, dy, mean, var, gamma, data_format):
        torch = self.torch
        perm = list(range(x.ndim))
        if data_format == "NXC" and x.ndim > 2:            # (N, *X, C) memory, (N, C, *X) view
            perm = [0, x.ndim - 1, *range(1, x.ndim - 1)]
        self.back = np.argsort(perm)
        gx, gdy = (torch.from_numpy(a).permute(perm) for a in (x, dy))
        invstd = (1.0 / np.sqrt(var.astype(np.float64) + EPSILON)).astype(np.float32)
        self.args = (gdy, gx, torch.from_numpy(gamma), None, None, torch.from_numpy(mean),
                     torch.from_numpy(invstd), True, EPSILON, [True, True, True])
        self.outs = (torch.empty_like(gx), torch.empty_like(self.args[2]),
                     torch.empty_like(self.args[2]))

    def run(self):
        return self.op(*self.args)

    def run_out(self):
        o0, o1, o2 = self.outs
        return self.op.out(*self.args, out0=o0, out1=o1, out2=o2)

    def time(self, threads, repeat):
        torch = self.torch
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            runs = [self.run] + ([self.run_out] if self.has_out else [])
            for run in runs:
                run()                                          # warm-up
            return min(best_time(run, repeat) for run in runs)
        finally:
            torch.set_num_threads(before)

    def results(self):
        dx, dgamma, dbeta = self.run()
        return dx.permute(*self.back).numpy(), dgamma.numpy(), dbeta.numpy()


def busy_note(load, cpus, threads):
    """A warning when other work holds the CPUs the demo times on (the 1-minute load average
    `load`, before the demo starts, against `cpus`), else None.  OpenMP threads that find
    their core taken spin and wait at every pass's end: on a busy machine more threads can be
    many times slower than one."""
    idle = cpus - load
    if threads <= 1 or load < 0.5:
        return None
    return (f"NOTE: this machine is busy (load average {load:.2f} over {cpus} CPUs before the "
            f"demo started, about {max(idle, 0):.1f} idle): timings on {threads} threads can "
            f"be far slower than on 1 while other work runs; time on an idle machine, or pass "
            f"num_threads= no larger than the idle CPUs (README, \"Threads\").")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed calls per case and thread count, the best kept (default 5)")
    parser.add_argument("--no-torch", action="store_true",
                        help="skip the PyTorch comparison even when torch is importable")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    show_config()
    note = busy_note(load, cpu_count(), get_num_threads())
    if note:
        print("\n" + note)
    torch = None if args.no_torch else import_torch()
    peer = TorchPeer(torch) if torch is not None else None
    rng = np.random.default_rng(2024)
    threads = sorted({1, get_num_threads()})

    per_thread = " ".join(f"{f'{t} thr ms':>9} {'x ref':>6}" + (f" {'torch ms':>9}" if peer else "")
                          for t in threads)
    header = (f"{'case':15} {'layout':6} {'shape':18} {'reference ms':>12} {per_thread} "
              f"{'max rel err':>11}" + (f" {'torch err':>9}" if peer else ""))
    print("\n" + header + "\n" + "-" * len(header))
    worst = worst_torch = 0.0
    thread_times = []          # (case, 1-thread time, all-threads time)
    for name, shape in DEMO_SHAPES.items():
        for data_format in ("NCX", "NXC"):
            x, dy, mean, var, gamma = make_case(shape, data_format, rng)
            call = dict(epsilon=EPSILON, data_format=data_format)
            ref = reference(x, dy, mean, var, gamma, **call)
            t_ref = best_time(lambda: reference(x, dy, mean, var, gamma, **call), 2)
            out = tuple(np.empty_like(a) for a in (x, gamma, gamma))
            if peer:
                peer.bind(x, dy, mean, var, gamma, data_format)
            cells, times = [], []
            for t in threads:
                run = lambda: batchnorm_training_backward(  # noqa: E731
                    x, dy, mean, var, gamma, out=out, num_threads=t, **call)
                run()
                t_ours = best_time(run, args.repeat)
                times.append(t_ours)
                cell = f"{t_ours * 1e3:9.2f} {t_ref / t_ours:5.1f}x"
                if peer:
                    cell += f" {peer.time(t, args.repeat) * 1e3:9.2f}"
                cells.append(cell)
            if len(times) > 1:
                thread_times.append((f"{name} {data_format}", times[0], times[-1]))
            err = max(max_relative_error(o, r) for o, r in zip(out, ref))
            worst = max(worst, err)
            line = (f"{name:15} {data_format:6} {str(x.shape):18} {t_ref * 1e3:12.1f} "
                    f"{' '.join(cells)} {err:11.1e}")
            if peer:
                err_torch = max(max_relative_error(o, r) for o, r in zip(peer.results(), ref))
                worst_torch = max(worst_torch, err_torch)
                line += f" {err_torch:9.1e}"
            print(line)
    slower = [name for name, one, many in thread_times if many > one]
    if slower:
        print(f"\nNOTE: {len(slower)} of {len(thread_times)} cases ran slower on "
              f"{threads[-1]} threads than on 1 ({', '.join(slower)}): the machine may be busy "
              f"(load average now {os.getloadavg()[0] if hasattr(os, 'getloadavg') else 0:.2f})"
              f", or these calls are too small to pay for a team of threads.")
    ok = worst < TOLERANCE
    print(f"\nresults {'agree' if ok else 'DISAGREE'} with the float64 reference "
          f"(worst max-relative error {worst:.1e})")
    if peer:
        how = ("the faster of the op (allocates its outputs) and its .out overload (outputs "
               "allocated once)" if peer.has_out else "the op allocates its outputs: no .out "
               "overload in this torch")
        print(f"PyTorch {torch.__version__}: aten.native_batch_norm_backward on the same arrays, "
              f"worst max-relative error {worst_torch:.1e}; its time is {how}; ours writes into "
              "outputs allocated once (out=)")
    else:
        print("PyTorch is not importable (or --no-torch): compared with the float64 reference "
              "only")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
