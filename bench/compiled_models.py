"""Training steps of small channels-last CNNs under torch.compile: the model as torch builds it
against the same model after `convert_batchnorm(model, fuse_relu=True)`, both compiled.

    python bench/compiled_models.py                 # 1 and 2 threads, both models
    python bench/compiled_models.py --threads 1 --rounds 15

Models (float32, channels-last, batch 16 of 3 x 64 x 64, 10 classes):
    cnn3      three Conv-BN-ReLU blocks (32, 64, 128 channels, the last two stride 2), pool,
              linear
    resnet    examples/train_resnet_fused.py's ResNet-style network at width 32 (basic
              blocks: the batch norms before a residual add stay unfused)
One step is forward, cross-entropy, backward and an SGD step.  The two copies start from the
same weights, are compiled once (warm-up steps untimed), then timed step by step, alternating,
for `--rounds` rounds; the figure is the median step time of each and their ratio.  While they
are timed, torch's CPU allocator is bench/torch_cache.cpp for both (when it builds here), so
neither pays page faults for memory the other just freed.  Prints one line per model and
thread count: plain ms, converted ms, plain / converted (> 1: the converted model is faster).
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import torch_cache  # noqa: E402
from bnbw_native.autograd import convert_batchnorm  # noqa: E402
from train_resnet_fused import resnet  # noqa: E402

BATCH, SIZE, CLASSES = 16, 64, 10


def cnn3():
    layers, cin = [], 3
    for cout, stride in ((32, 1), (64, 2), (128, 2)):
        layers += [torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                   torch.nn.BatchNorm2d(cout), torch.nn.ReLU(inplace=True)]
        cin = cout
    return torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(cin, CLASSES))


MODELS = {"cnn3": cnn3, "resnet": lambda: resnet(32, CLASSES)}


def trainer(model):
    """One compiled training step of `model` (channels-last) on a fixed batch."""
    model = model.to(memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 3, SIZE, SIZE, generator=g).contiguous(
        memory_format=torch.channels_last)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=g)

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(compiled(x), labels).backward()
        opt.step()
    return step


def race(name, threads, rounds, warmup=3):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    plain = MODELS[name]()
    converted = convert_batchnorm(copy.deepcopy(plain), fuse_relu=True)
    steps = {"plain": trainer(plain), "converted": trainer(converted)}
    for step in steps.values():
        for _ in range(warmup):
            step()
    cache = torch_cache.load()
    installed = cache is not None and cache.on()
    times = {k: [] for k in steps}
    try:
        for _ in range(rounds):
            for k, step in steps.items():
                t = time.perf_counter()
                step()
                times[k].append(time.perf_counter() - t)
    finally:
        if installed:
            cache.off()
            cache.flush()
    p, c = (statistics.median(times[k]) * 1e3 for k in ("plain", "converted"))
    return p, c, installed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts (default 1,2)")
    ap.add_argument("--models", default=",".join(MODELS),
                    help="comma list of the models to race (default: all)")
    ap.add_argument("--rounds", type=int, default=21, help="interleaved rounds (default 21)")
    args = ap.parse_args(argv)
    was = torch.get_num_threads()
    print(f"torch {torch.__version__}; batch {BATCH} x 3 x {SIZE} x {SIZE}, channels-last, "
          f"float32, torch.compile; median of {args.rounds} interleaved steps")
    print(f"{'model':<8} {'thr':>3} {'plain ms':>9} {'converted ms':>13} {'plain/conv':>10}")
    try:
        for threads in (int(t) for t in args.threads.split(",")):
            for name in args.models.split(","):
                p, c, cached = race(name, threads, args.rounds)
                print(f"{name:<8} {threads:>3} {p:9.2f} {c:13.2f} {p / c:10.2f}"
                      + ("" if cached else "  (torch's own allocator)"), flush=True)
    finally:
        torch.set_num_threads(was)


if __name__ == "__main__":
    main()
