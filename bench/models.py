"""Training steps of whole models, plain against `convert_batchnorm(model, fuse_relu=True)`:
ResNet-18 and ResNet-50 with torchvision's structure (written here: no torchvision needed)
and a three-block CNN, eager and under torch.compile, NCHW and channels-last, 1 and 2 threads.

    python bench/models.py                                    # every case (long)
    python bench/models.py --models resnet18 --modes eager --threads 1 --rounds 11

One step is forward, cross-entropy, backward and an SGD step (momentum 0.9) on a fixed batch
(--batch images of 3 x --size x --size, 10 classes, float32).  Per case the copies start from
the same weights - plain, converted, and (for the batch norms' share) the plain model with
every batch norm an nn.Identity, and a second plain copy (the control) - are compiled when
asked (the first step's time is the compile time, reported), warmed up, then timed step by
step, alternating, for --rounds rounds, each round starting one copy later than the last;
the figures are medians.  While they are timed, torch's CPU allocator is
bench/torch_cache.cpp for all of them (when it builds here), so no copy pays page faults for
memory another just freed.

Columns: plain and converted ms per step; plain / converted (> 1: converting is faster);
bn% = 1 - (step without batch norms) / (plain step), what the batch norms (and the ReLUs
fused into them) cost; gain% = the share of that cost converting saved, (plain - converted) /
(plain - without); fused = batch norms that became BatchNormReLU, of all; plain/ctl = the
plain step over the control's, the same model timed twice: how far apart two copies of one
model run in this process, the noise floor under plain/conv (on a 2-core guest 0.96-1.02
eager, 0.91-1.02 compiled).  --losses N trains both copies N steps on fresh batches from one
seed and prints the two loss curves.
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch_cache  # noqa: E402
from bnbw_native.autograd import BatchNorm, convert_batchnorm  # noqa: E402

CLASSES = 10


# ---- the models (torchvision's structure: ReLU called in forward, `out += identity`) ------

class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _downsample(cin, planes, stride)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(cin, planes * 4, stride)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


def _downsample(cin, cout, stride):
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    def __init__(self, block, layers):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, stages = 64, []
        for i, (planes, count) in enumerate(zip((64, 128, 256, 512), layers)):
            blocks = []
            for j in range(count):
                blocks.append(block(cin, planes, 2 if i > 0 and j == 0 else 1))
                cin = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, CLASSES)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def cnn3():
    layers, cin = [], 3
    for cout, stride in ((32, 1), (64, 2), (128, 2)):
        layers += [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                   nn.ReLU(inplace=True)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, CLASSES))


MODELS = {"resnet18": lambda: ResNet(BasicBlock, (2, 2, 2, 2)),
          "resnet50": lambda: ResNet(Bottleneck, (3, 4, 6, 3)), "cnn3": cnn3}
LAYOUTS = {"NCHW": torch.contiguous_format, "channels_last": torch.channels_last}


# ---- one case --------------------------------------------------------------------------------

def without_batch_norms(model):
    """`model` with every batch norm an nn.Identity (the batch norms' share of a step)."""
    for name, child in model.named_children():
        if isinstance(child, (nn.modules.batchnorm._BatchNorm, BatchNorm)):
            setattr(model, name, nn.Identity())
        else:
            without_batch_norms(child)
    return model


def fused_count(model):
    """(batch norms fused with their ReLU - and residual add -, batch norms)."""
    bns = [m for m in model.modules() if isinstance(m, (nn.modules.batchnorm._BatchNorm,
                                                        BatchNorm))]
    return sum(getattr(m, "_relu", False) for m in bns), len(bns)


def batch(args, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g)
    return x, torch.randint(0, CLASSES, (args.batch,), generator=g)


def trainer(model, layout, compiled):
    """A step function on (x, labels) of `model` in `layout`, compiled when asked."""
    model = model.to(memory_format=LAYOUTS[layout]).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    run = torch.compile(model) if compiled else model

    def step(x, labels):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(run(x), labels)
        loss.backward()
        opt.step()
        return float(loss.detach())
    return step


def race(args, name, layout, mode, threads):
    """Timings of one case: {copy: median s}, {copy: first step s}, the fused count."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    plain = MODELS[name]()
    converted = convert_batchnorm(copy.deepcopy(plain), fuse_relu=True)
    copies = {"plain": plain, "converted": converted}
    if args.share:
        copies["without"] = without_batch_norms(copy.deepcopy(plain))
    if args.control:
        copies["control"] = copy.deepcopy(plain)
    x, labels = batch(args, 0)
    x = x.contiguous(memory_format=LAYOUTS[layout])
    steps = {k: trainer(m, layout, mode == "compiled") for k, m in copies.items()}
    first = {}
    for k, step in steps.items():
        t = time.perf_counter()
        step(x, labels)
        first[k] = time.perf_counter() - t
        for _ in range(args.warmup):
            step(x, labels)
    cache = torch_cache.load()
    installed = cache is not None and cache.on()
    times = {k: [] for k in steps}
    order = list(steps)
    try:
        for r in range(args.rounds):     # (no copy always runs after the same other copy)
            for k in order[r % len(order):] + order[:r % len(order)]:
                t = time.perf_counter()
                steps[k](x, labels)
                times[k].append(time.perf_counter() - t)
    finally:
        if installed:
            cache.off()
            cache.flush()
    return ({k: statistics.median(v) for k, v in times.items()}, first,
            fused_count(converted), installed)


def losses(args, name, layout, threads):
    """The loss curves of the plain and the converted copy over --losses fresh batches."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    plain = MODELS[name]()
    curves = {}
    for k, model in (("plain", plain),
                     ("converted", convert_batchnorm(copy.deepcopy(plain), fuse_relu=True))):
        step = trainer(model, layout, False)
        curves[k] = [step(x.contiguous(memory_format=LAYOUTS[layout]), y)
                     for x, y in (batch(args, 1 + i) for i in range(args.losses))]
    return curves


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,resnet50",
                    help=f"comma list of {', '.join(MODELS)} (default resnet18,resnet50)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS),
                    help="comma list of NCHW, channels_last (default both)")
    ap.add_argument("--modes", default="eager,compiled",
                    help="comma list of eager, compiled (default both)")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts (default 1,2)")
    ap.add_argument("--batch", type=int, default=32, help="images per batch (default 32)")
    ap.add_argument("--size", type=int, default=64, help="image side (default 64)")
    ap.add_argument("--rounds", type=int, default=11, help="interleaved rounds (default 11)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per copy (default 2)")
    ap.add_argument("--no-share", dest="share", action="store_false",
                    help="skip the copy without batch norms (no bn%% and gain%% columns)")
    ap.add_argument("--no-control", dest="control", action="store_false",
                    help="skip the second plain copy (no plain/ctl column)")
    ap.add_argument("--losses", type=int, default=0,
                    help="also print N steps of both copies' losses per model and layout "
                         "(eager, the first thread count)")
    args = ap.parse_args(argv)
    was = torch.get_num_threads()
    print(f"torch {torch.__version__}; batch {args.batch} x 3 x {args.size} x {args.size}, "
          f"float32, SGD; median of {args.rounds} interleaved steps")
    print(f"{'model':<9} {'layout':<13} {'mode':<8} {'thr':>3} {'plain ms':>9} {'conv ms':>9} "
          f"{'plain/conv':>10} {'plain/ctl':>9} {'bn%':>5} {'gain%':>6} {'fused':>6} "
          f"{'compile s p/c':>14}")
    try:
        for threads in (int(t) for t in args.threads.split(",")):
            for name in args.models.split(","):
                for layout in args.layouts.split(","):
                    for mode in args.modes.split(","):
                        med, first, (fused, bns), cached = race(args, name, layout, mode,
                                                                threads)
                        p, c = med["plain"], med["converted"]
                        share = gain = ""
                        control = f"{p / med['control']:9.3f}" if "control" in med else ""
                        if "without" in med:
                            share = f"{100 * (1 - med['without'] / p):5.0f}"
                            gain = f"{100 * (p - c) / (p - med['without']):6.0f}"
                        comp = (f"{first['plain']:6.1f}/{first['converted']:<6.1f}"
                                if mode == "compiled" else "")
                        print(f"{name:<9} {layout:<13} {mode:<8} {threads:>3} {p * 1e3:9.1f} "
                              f"{c * 1e3:9.1f} {p / c:10.3f} {control:>9} {share:>5} {gain:>6} "
                              f"{fused:>2}/{bns:<3} {comp:>14}"
                              + ("" if cached else "  (torch's own allocator)"), flush=True)
        if args.losses:
            threads = int(args.threads.split(",")[0])
            for name in args.models.split(","):
                for layout in args.layouts.split(","):
                    curves = losses(args, name, layout, threads)
                    print(f"losses {name} {layout}: plain     "
                          + " ".join(f"{v:.4f}" for v in curves["plain"]))
                    print(f"losses {name} {layout}: converted "
                          + " ".join(f"{v:.4f}" for v in curves["converted"]))
    finally:
        torch.set_num_threads(was)


if __name__ == "__main__":
    main()
