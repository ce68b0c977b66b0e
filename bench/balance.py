"""How a call's work splits over threads, computed from the schedules (no timing).

For every shape of a group (default: the ResNet-50 and MobileNet-v2 batch norms at batch 50),
each memory layout and thread count, prints the schedule the engine picks, its work items and
the busiest thread's share of the work relative to the mean (1.00 = perfectly even): the
elements of its run of items where the schedule reports them (the split schedules), else
ceil(items / threads) equal items.
The cache model is this machine's unless --l2/--l3/--sharers say otherwise.

    python bench/balance.py --threads 8,16,64 [--shapes RESNET50_B50] [--l2 1M --l3 32M]
"""
import argparse

import numpy as np

import shapes
from bnbw_native import tuning


def size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].isalpha() else int(text)


def describe(shape, data_format, threads):
    return tuning.describe(np.empty(shape, np.float32), data_format, num_threads=threads)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="8,16,64",
                        help="comma list of thread counts (default %(default)s)")
    parser.add_argument("--shapes", default="RESNET50_B50,MOBILENETV2_B50",
                        help="comma list of shape groups of bench/shapes.py (default %(default)s)")
    parser.add_argument("--l2", type=size, help="L2 bytes per core to assume (default: this machine's)")
    parser.add_argument("--l3", type=size, help="L3 bytes to assume (default: this machine's)")
    parser.add_argument("--sharers", type=int,
                        help="CPUs sharing the L3 to assume (default: this machine's)")
    args = parser.parse_args(argv)
    l2, l3, sharers = tuning.cache_model()
    tuning.set_cache_model(args.l2 or l2, args.l3 or l3, args.sharers or sharers)
    print("cache model: L2 %d KiB, L3 %d MiB shared by %d CPUs" % (
        (args.l2 or l2) >> 10, (args.l3 or l3) >> 20, args.sharers or sharers))
    threads = [int(t) for t in args.threads.split(",")]
    print(f"{'shape':16s} {'layout':6s} " + " ".join(f"{'thr ' + str(t):>30s}" for t in threads))
    worst = {t: 1.0 for t in threads}
    for group in args.shapes.split(","):
        for name, nchw in shapes.GROUPS[group].items():
            for data_format in ("NCX", "NXC"):
                shape = nchw if data_format == "NCX" else (nchw[0], *nchw[2:], nchw[1])
                cells = []
                for t in threads:
                    facts = describe(shape, data_format, t)
                    items, used = facts["items"], facts["threads"]
                    runs = facts.get("thread_elements")
                    share = (max(runs) * used / sum(runs) if runs
                             else -(-items // used) / (items / used))
                    worst[t] = max(worst[t], share)
                    cells.append(f"{facts['schedule']:>17s} {items:5d} {used:3d} {share:4.2f}")
                print(f"{name:16s} {data_format:6s} " + " ".join(cells))
    print("columns per thread count: schedule, items, threads used, busiest / mean")
    print("worst busiest / mean: " + ", ".join(f"{t} threads {w:.2f}" for t, w in worst.items()))


if __name__ == "__main__":
    main()
