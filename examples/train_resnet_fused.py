"""Train a small ResNet-like network with fused batch norm + ReLU layers.

    python examples/train_resnet_fused.py                   # ResNet-ish on 32 x 64 x 56 x 56
    python examples/train_resnet_fused.py --channels-last --threads 2
    python examples/train_resnet_fused.py --short           # seconds: what the tests run

The network is built from plain torch modules; convert_batchnorm(net, fuse_relu=True) turns
every BatchNorm2d followed by a ReLU inside an nn.Sequential into a BatchNormReLU (the ReLU
becomes nn.Identity, so parameter names and state-dict keys stay), and - tracing the blocks'
forward with torch.fx - each block's last batch norm, whose output goes to the residual add and
then to the block's ReLU, into a BatchNormAddReLU (the network comes back as a GraphModule
with the same state-dict keys).  The batch norms of the projections stay BatchNorm.

1. Gradients: one training step of the fused network and of plain torch on the same batch,
   both float32, against plain torch in float64 on that batch.  The float64 run takes its ReLU
   masks from the float32 run it checks: an activation within rounding of 0 may fall on
   either side in float32 and float64, and one such element moves a whole weight gradient by
   up to ~1e-3 in a network this size, in plain torch as much as in the fused one.
2. Training: a few SGD steps of both copies from the same start, losses side by side.
3. Time per training step (forward, backward, optimizer), fused vs plain torch, interleaved.
"""
import argparse
import copy
import time

import torch

import bnbw_native
from bnbw_native.autograd import BatchNorm, BatchNormAddReLU, BatchNormReLU, convert_batchnorm


class Block(torch.nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN, plus the (projected) input, then ReLU."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False), torch.nn.BatchNorm2d(cout),
            torch.nn.ReLU(inplace=True),
            torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(cout))
        self.skip = torch.nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            torch.nn.BatchNorm2d(cout))

        self.act = torch.nn.ReLU()

    def forward(self, x):
        return self.act(self.body(x) + self.skip(x))


def resnet(width, classes=10):
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, width, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(width),
        torch.nn.ReLU(inplace=True),
        Block(width, width, 1), Block(width, 2 * width, 2), Block(2 * width, 4 * width, 2),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4 * width, classes))


def batch(n, size, memory_format, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 3, size, size, generator=g) + 0.2 * labels.view(-1, 1, 1, 1)
    return images.contiguous(memory_format=memory_format), labels


class Masked(torch.nn.Module):
    """A ReLU whose mask is given: what the float64 reference runs."""

    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, x):
        return torch.where(self.mask, x, torch.zeros((), dtype=x.dtype))


def relu_site(name, module):
    """The name of the plain network's ReLU a module stands for: a ReLU's own; for a
    BatchNormReLU the next name in its Sequential (where the ReLU was); for a
    BatchNormAddReLU ("<block>.body.4") its block's ReLU ("<block>.act")."""
    if isinstance(module, BatchNormAddReLU):
        return name.split(".")[0] + ".act"
    if isinstance(module, BatchNormReLU):
        parent, _, index = name.rpartition(".")
        return f"{parent}.{int(index) + 1}" if parent else str(int(index) + 1)
    return name


def gradients(net, images, labels):
    """Parameter gradients of one step, and where every ReLU was active (by plain name)."""
    masks = {}
    hooks = [m.register_forward_hook(
        lambda mod, inp, out, site=relu_site(name, m): masks.__setitem__(site, out > 0))
        for name, m in net.named_modules()
        if isinstance(m, (torch.nn.ReLU, BatchNormReLU, BatchNormAddReLU))]
    net.zero_grad()
    torch.nn.functional.cross_entropy(net(images), labels).backward()
    for hook in hooks:
        hook.remove()
    return {name: p.grad.detach().double().clone() for name, p in net.named_parameters()}, masks


def float64_error(net, plain, images, labels):
    """The worst parameter gradient error of `net` (each norm-wise: max |got - ref| / max |ref|)
    against plain torch in float64 with the same ReLU masks."""
    got, masks = gradients(net, images, labels)
    ref_net = copy.deepcopy(plain).double()
    for site, mask in masks.items():
        parent, _, child = site.rpartition(".")
        ref_net.get_submodule(parent).add_module(child, Masked(mask))
    ref, _ = gradients(ref_net, images.double(), labels)
    return max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--size", type=int, default=56, help="image height and width")
    parser.add_argument("--width", type=int, default=64, help="channels of the first stage")
    parser.add_argument("--steps", type=int, default=5, help="training steps per copy")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--channels-last", action="store_true",
                        help="channels-last memory for the model and its input")
    parser.add_argument("--short", action="store_true", help="a tiny run (seconds)")
    args = parser.parse_args()
    if args.short:
        args.batch, args.size, args.width, args.steps = 8, 12, 8, 3
    torch.set_num_threads(args.threads)
    bnbw_native.set_num_threads(args.threads)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format

    torch.manual_seed(0)
    plain = resnet(args.width).to(memory_format=fmt)
    fused = convert_batchnorm(copy.deepcopy(plain), fuse_relu=True)
    kinds = [type(m).__name__ for m in fused.modules() if isinstance(m, BatchNorm)]
    print(f"network: {sum(p.numel() for p in plain.parameters())} parameters, "
          f"{kinds.count('BatchNormReLU')} BatchNormReLU + {kinds.count('BatchNormAddReLU')} "
          f"BatchNormAddReLU + {kinds.count('BatchNorm')} BatchNorm layers; "
          f"input {args.batch} x 3 x {args.size} x {args.size}, "
          f"{'channels-last' if args.channels_last else 'NCHW'}, {args.threads} thread(s)")
    assert sum(isinstance(m, BatchNormReLU) for m in fused.modules()) == 4
    assert sum(isinstance(m, BatchNormAddReLU) for m in fused.modules()) == 3

    # 1. gradients of one step against plain torch in float64
    images, labels = batch(args.batch, args.size, fmt, seed=1)
    start = copy.deepcopy(plain)            # both copies see the same running statistics
    err_fused = float64_error(fused, start, images, labels)
    err_plain = float64_error(plain, start, images, labels)
    print(f"gradients vs float64 torch: fused {err_fused:.1e}, plain torch float32 "
          f"{err_plain:.1e}")
    # the convolutions' float32 sums dominate both errors: no worse than torch's own
    if err_fused > 2 * err_plain + 1e-6:
        raise SystemExit(f"gradients differ from float64 torch by {err_fused:.1e}, plain "
                         f"torch float32 by {err_plain:.1e}")
    print("gradients match plain torch")

    # 2. a few SGD steps of both copies from the same start
    losses = {}
    for name, net in (("plain", plain), ("fused", fused)):
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        losses[name] = []
        for step in range(args.steps):
            images, labels = batch(args.batch, args.size, fmt, seed=100 + step)
            loss = torch.nn.functional.cross_entropy(net(images), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    for step, (a, b) in enumerate(zip(losses["plain"], losses["fused"])):
        print(f"step {step + 1}: loss plain {a:.4f}  fused {b:.4f}")

    # 3. time per training step, the two copies interleaved
    images, labels = batch(args.batch, args.size, fmt, seed=7)
    times = {"plain": [], "fused": []}
    opts = {name: torch.optim.SGD(net.parameters(), lr=1e-3)
            for name, net in (("plain", plain), ("fused", fused))}
    for _ in range(max(args.steps, 3)):
        for name, net in (("plain", plain), ("fused", fused)):
            start = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(net(images), labels)
            opts[name].zero_grad()
            loss.backward()
            opts[name].step()
            times[name].append(time.perf_counter() - start)
    t_plain, t_fused = (sorted(times[k])[len(times[k]) // 2] * 1e3 for k in ("plain", "fused"))
    print(f"time per training step (median): plain torch {t_plain:.1f} ms, fused "
          f"{t_fused:.1f} ms ({t_plain / t_fused:.2f}x)")


if __name__ == "__main__":
    main()
