"""Time one kernel body against another on the same calls, interleaved round by round.

    python bench/body_ratio.py                       # portable vs avx2, 1 thread, 41 rounds
    python bench/body_ratio.py --bodies portable,avx512 --rounds 61 --threads 2

Each round runs every body once per call (the order alternating between rounds), so load from
other processes on a shared machine hits both alike; the table shows each body's median time
and the median of the per-round ratios, which is the steadier figure on a noisy host.  Times
are CPU time of the process (time.process_time_ns: the time its threads ran, not the time they
waited for a core another process held), and wall-clock time with --wall.  The
calls are the f32 training backward of issue 25's four shapes (NCX is channels first, NXC
channels last), C-contiguous, on inputs made once.
"""
import argparse
from time import perf_counter_ns, process_time_ns

import numpy as np

import bnbw_native as bn
from bnbw_native import tuning

CASES = [  # (shape, data_format)
    ((50, 64, 56, 56), "NCX"),
    ((50, 56, 56, 64), "NXC"),
    ((50, 14, 14, 1024), "NXC"),
    ((32, 256, 14, 14), "NCX"),
]


def inputs(shape, data_format, dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32)
    dy = rng.standard_normal(shape, dtype=np.float32)
    axes = tuple(i for i in range(len(shape)) if i != (1 if data_format == "NCX" else len(shape) - 1))
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    gamma = np.ones(mean.shape, np.float32)
    return [a.astype(dtype) for a in (x, dy)] + [mean, var, gamma]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bodies", default="portable,avx2",
                    help="comma list of kernel body caps to time (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=41, help="interleaved rounds (default 41)")
    ap.add_argument("--threads", type=int, default=1, help="threads per call (default 1)")
    ap.add_argument("--dtype", default="float32",
                    help="storage type: float32, float16 or bfloat16 (default %(default)s)")
    ap.add_argument("--wall", action="store_true", help="wall-clock time instead of CPU time")
    args = ap.parse_args()
    bodies = args.bodies.split(",")
    dtype = np.dtype(args.dtype) if args.dtype != "bfloat16" else __import__("ml_dtypes").bfloat16
    print(f"{'shape':20s} {'fmt':4s} " + " ".join(f"{b + ' ms':>12s}" for b in bodies)
          + f" {'ratio ' + bodies[0] + '/' + bodies[1]:>22s}  (median of {args.rounds} rounds, "
          f"{args.threads} thread(s), {'wall' if args.wall else 'CPU'} time)")
    for shape, fmt in CASES:
        x, dy, mean, var, gamma = inputs(shape, fmt, dtype)
        dx = np.empty_like(x)
        dg, db = np.empty_like(gamma), np.empty_like(gamma)

        def call():
            bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                           data_format=fmt, num_threads=args.threads,
                                           out=(dx, dg, db))
        times = {b: [] for b in bodies}
        for b in bodies:            # warm-up
            tuning.use_kernels(b)
            call()
        clock = perf_counter_ns if args.wall else process_time_ns
        for r in range(args.rounds):
            for b in (bodies if r % 2 == 0 else bodies[::-1]):
                tuning.use_kernels(b)
                t0 = clock()
                call()
                times[b].append((clock() - t0) * 1e-9)
        tuning.use_kernels(None)
        ratio = np.median(np.array(times[bodies[0]]) / np.array(times[bodies[1]]))
        print(f"{str(shape):20s} {fmt:4s} "
              + " ".join(f"{np.median(times[b]) * 1e3:12.3f}" for b in bodies)
              + f" {ratio:22.2f}")


if __name__ == "__main__":
    main()
