"""Time a training step (forward + backward) of the PyTorch layers against torch's own.

    python examples/bench_torch_layers.py                  # ResNet-50 shapes, 1 and 2 threads
    python examples/bench_torch_layers.py --threads 1 --rounds 15
    python examples/bench_torch_layers.py --quick          # a tiny shape, seconds

Pairs: BatchNorm vs torch.nn.BatchNorm2d, and BatchNormReLU vs
torch.nn.Sequential(BatchNorm2d, ReLU()) (and with ReLU(inplace=True)), in NCHW and
channels-last.  Every round times each layer `--reps` times and keeps its best; the layers
take turns within a round, so a busy machine slows them alike.  Printed: the median over
rounds of those bests, the best of all, and torch's time over ours for both (> 1: ours is
faster).  The interquartile spread over rounds says how noisy the run was.
"""
import argparse
import statistics
import time

import torch

import bnbw_native
from bnbw_native.autograd import BatchNorm, BatchNormReLU

SHAPES = [(32, 64, 56, 56), (32, 256, 14, 14)]


def step(layer, x, dy):
    def run():
        leaf = x.detach().requires_grad_()
        layer(leaf).backward(dy)
    return run


def measure(cases, rounds, reps):
    for run in cases.values():
        run()                                    # warm-up: allocations, first calls
    best = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            best[name].append(min(times) * 1e3)
    return best


def spread(values):
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / statistics.median(values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one tiny shape, 3 rounds")
    args = parser.parse_args()
    shapes = SHAPES
    if args.quick:
        shapes, args.rounds = [(8, 16, 10, 10)], 3
    print("ms per training step: median of round bests / best of all; x = torch / ours")
    for threads in args.threads:
        torch.set_num_threads(threads)
        bnbw_native.set_num_threads(threads)
        for shape in shapes:
            for fmt, fmt_name in ((torch.contiguous_format, "NCHW"),
                                  (torch.channels_last, "channels-last")):
                g = torch.Generator().manual_seed(0)
                x = torch.randn(shape, generator=g).contiguous(memory_format=fmt)
                dy = torch.randn(shape, generator=g).contiguous(memory_format=fmt)
                c = shape[1]
                pairs = {
                    "BatchNorm": (BatchNorm(c), torch.nn.BatchNorm2d(c)),
                    "BatchNormReLU": (BatchNormReLU(c), torch.nn.Sequential(
                        torch.nn.BatchNorm2d(c), torch.nn.ReLU())),
                    "BatchNormReLU/inplace": (None, torch.nn.Sequential(
                        torch.nn.BatchNorm2d(c), torch.nn.ReLU(inplace=True))),
                }
                cases = {}
                for name, (ours, ref) in pairs.items():
                    if ours is not None:
                        cases[f"{name} ours"] = step(ours, x, dy)
                    cases[f"{name} torch"] = step(ref, x, dy)
                best = measure(cases, args.rounds, args.reps)
                noise = max(spread(v) for v in best.values()) if args.rounds >= 2 else 0.0
                print(f"\n{threads} thread(s), {shape}, {fmt_name} (max spread {noise:.0%})")
                for name in pairs:
                    ours = best[f"{name.split('/')[0]} ours"]
                    ref = best[f"{name} torch"]
                    med_o, med_r = statistics.median(ours), statistics.median(ref)
                    print(f"  {name:22s} ours {med_o:7.3f} / {min(ours):7.3f}   torch "
                          f"{med_r:7.3f} / {min(ref):7.3f}   x {med_r / med_o:.2f} / "
                          f"{min(ref) / min(ours):.2f}")


if __name__ == "__main__":
    main()
