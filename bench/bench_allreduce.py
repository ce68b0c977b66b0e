"""Time the phases of sync_batchnorm_backward on gloo ranks on this machine.

    python bench/bench_allreduce.py [--world 2] [--shape 32 64 56 56] [--repeats 15]
                                         [--threads 1]

Starts `world` ranks on 127.0.0.1; the batch (N, C, H, W) is split by rows over them.  For
channels-first (NCX) and channels-last (NXC) storage, every rank times backward_reduce, the
all-reduce of (partial, count), backward_apply and the whole sync_batchnorm_backward, with a
barrier before each repetition, and rank 0 prints the medians (the slowest rank's value per
repetition).  "allreduce" includes waiting for the slower rank's reduce; "allreduce_alone"
times the collectives right after a barrier.  Each rank also checks its rows against the
single-process result on the whole batch and prints the largest relative difference.
Not a test: run it by hand.
"""
import argparse
import datetime
import os
import socket
import sys
import time

import numpy as np


def rank_main(rank, args):
    import torch
    import torch.distributed as dist

    import bnbw_native as bn
    from bnbw_native.distributed import sync_batchnorm_backward

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=120))
    n, c, h, w = args.shape
    rng = np.random.default_rng(0)                     # every rank builds the same batch
    x_all = (rng.standard_normal((n, c, h, w), np.float32) * 2 + 3)
    dy_all = rng.standard_normal((n, c, h, w), np.float32)
    x64 = x_all.astype(np.float64)
    mean = x64.mean(axis=(0, 2, 3)).astype(np.float32)
    var = x64.var(axis=(0, 2, 3)).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, c).astype(np.float32)
    bounds = np.linspace(0, n, args.world + 1).astype(int)
    lo, hi = bounds[rank], bounds[rank + 1]
    kw = dict(num_threads=args.threads)

    for data_format in ("NCX", "NXC"):
        if data_format == "NCX":
            x, dy = x_all[lo:hi].copy(), dy_all[lo:hi].copy()
            whole_x, whole_dy = x_all, dy_all
        else:
            x = np.ascontiguousarray(np.moveaxis(x_all[lo:hi], 1, -1))
            dy = np.ascontiguousarray(np.moveaxis(dy_all[lo:hi], 1, -1))
            whole_x = np.ascontiguousarray(np.moveaxis(x_all, 1, -1))
            whole_dy = np.ascontiguousarray(np.moveaxis(dy_all, 1, -1))
        out = (np.empty_like(x), np.empty(c, np.float32), np.empty(c, np.float32))
        times = {"reduce": [], "allreduce": [], "apply": [], "total": [],
                 "allreduce_alone": []}
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            partial, count = bn.backward_reduce(x, dy, mean, data_format=data_format, **kw)
            t1 = time.perf_counter()
            counts = torch.tensor([count], dtype=torch.int64)
            works = [dist.all_reduce(torch.from_numpy(partial), async_op=True),
                     dist.all_reduce(counts, async_op=True)]
            for work in works:
                work.wait()
            t2 = time.perf_counter()
            bn.backward_apply(x, dy, mean, var, gamma, partial, int(counts[0]), epsilon=1e-5,
                              data_format=data_format, out=out, **kw)
            t3 = time.perf_counter()
            dist.barrier()
            t4 = time.perf_counter()
            sync_batchnorm_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                    data_format=data_format, out=out, **kw)
            t5 = time.perf_counter()
            dist.barrier()                 # the collectives alone, the ranks in step
            t6 = time.perf_counter()
            works = [dist.all_reduce(torch.from_numpy(partial), async_op=True),
                     dist.all_reduce(counts, async_op=True)]
            for work in works:
                work.wait()
            t7 = time.perf_counter()
            for key, dt in (("reduce", t1 - t0), ("allreduce", t2 - t1),
                            ("apply", t3 - t2), ("total", t5 - t4),
                            ("allreduce_alone", t7 - t6)):
                times[key].append(dt)
        # the slowest rank sets the pace: max over ranks, then the median over repetitions
        table = torch.tensor([times[k] for k in times], dtype=torch.float64)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        whole = bn.batchnorm_training_backward(whole_x, whole_dy, mean, var, gamma,
                                               epsilon=1e-5, data_format=data_format,
                                               num_threads=args.threads)
        res = sync_batchnorm_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                      data_format=data_format, **kw)
        ref_dx = whole.diff_src[lo:hi]
        errs = torch.tensor([
            np.abs(res.diff_src - ref_dx).max() / np.abs(ref_dx).max(),
            np.max(np.abs(res.diff_gamma - whole.diff_gamma) / np.abs(whole.diff_gamma)),
            np.max(np.abs(res.diff_beta - whole.diff_beta) / np.abs(whole.diff_beta)),
            float(not np.array_equal(res.diff_src, ref_dx))], dtype=torch.float64)
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
        if rank == 0:
            med = {k: float(np.median(table[i].numpy())) * 1e3 for i, k in enumerate(times)}
            print(f"{data_format} local {tuple(x.shape)} x {args.world} ranks, "
                  f"{args.threads} thread(s)/rank, median of {args.repeats} (ms): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in med.items())
                  + f"; all-reduce share of total {med['allreduce'] / med['total']:.1%}")
            print(f"    vs single process: max rel dx {errs[0]:.2e}, dgamma {errs[1]:.2e}, "
                  f"dbeta {errs[2]:.2e}, dx bits differ: {bool(errs[3])}")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--shape", type=int, nargs=4, default=[32, 64, 56, 56],
                        help="the whole batch's N C H W (default 32 64 56 56)")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls (default 15)")
    parser.add_argument("--threads", type=int, default=1, help="threads per rank (default 1)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        return rank_main(args.rank, args)
    import subprocess
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank", str(r)],
                              env=env) for r in range(args.world)]
    codes = [p.wait(timeout=1800) for p in procs]
    sys.exit(max(codes))


if __name__ == "__main__":
    main()
