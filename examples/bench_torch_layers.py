"""Time a training step (forward + backward) of the PyTorch layers against torch's own.

    python examples/bench_torch_layers.py                  # ResNet-50 shapes, 1 and 2 threads
    python examples/bench_torch_layers.py --threads 1 --rounds 15
    python examples/bench_torch_layers.py --quick          # a tiny shape, seconds

Pairs: BatchNorm vs torch.nn.BatchNorm2d, BatchNormReLU vs
torch.nn.Sequential(BatchNorm2d, ReLU()) (and with ReLU(inplace=True)), and BatchNormAddReLU
vs BatchNorm2d, `y += residual` and an in-place ReLU, in NCHW and channels-last.  The timing is the benchmark's (bench/torch_layers.py, the same rows as
`python bench/run.py --layers`): the layers of a case take turns round by round, each round
one sample per layer (a batch of steps when a step is shorter than 2 ms), so a busy machine
slows them alike.  Printed: the median step time and the fastest sample, and torch's time over
ours for both (> 1: ours is faster); the spread (interquartile range over median) says how
noisy the run was.  `--rounds N` takes exactly N rounds; without it each layer gets about
0.3 s per case.  Ours is checked against torch's layer (y and the three gradients) first.
"""
import argparse
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))     # the benchmark's modules, beside examples/ in a checkout

import timing  # noqa: E402
import torch_layers  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="thread counts (default 1 2)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="exactly this many interleaved rounds per case")
    parser.add_argument("--quick", action="store_true", help="one tiny shape, 3 rounds")
    args = parser.parse_args()
    shapes = torch_layers.SHAPES
    if args.quick:
        shapes, args.rounds = torch_layers.QUICK_SHAPES, args.rounds or 3
    protocol = timing.FULL if args.rounds is None else timing.Protocol(
        target=0.0, min_rounds=args.rounds, min_rounds_peer=args.rounds,
        max_rounds=args.rounds)
    print("ms per training step: median / fastest sample; x = torch / ours")
    case = []

    def echo(row):
        if not case or case[-1][0] != (row.threads, row.shape, row.memory_format):
            case.append(((row.threads, row.shape, row.memory_format), []))
        rows = case[-1][1]
        rows.append(row)
        if len(rows) == len(torch_layers.PAIRS):
            print(f"\n{row.threads} thread(s), {row.shape}, {row.memory_format} "
                  f"(max spread {torch_layers.noise(rows):.0%})")
            for r in rows:
                print(f"  {r.layer:22s} ours {r.ours_ms:7.3f} / {r.ours_min_ms:7.3f}   torch "
                      f"{r.torch_ms:7.3f} / {r.torch_min_ms:7.3f}   x {r.vs_torch:.2f} / "
                      f"{r.vs_torch_min:.2f}" + (f"   {', '.join(r.notes)}" if r.notes else ""))

    torch_layers.layer_rows(shapes, args.threads, protocol, echo=echo)


if __name__ == "__main__":
    main()
