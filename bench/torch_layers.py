"""Training-step rows of the PyTorch layers: a forward and a backward of bnbw_native.autograd's
BatchNorm, BatchNormReLU and BatchNormAddReLU against torch.nn.BatchNorm2d and the ReLU and the
residual add around it, the only place that times them (`bench/run.py --layers` and
examples/bench_torch_layers.py both call `layer_rows`).

Pairs, in NCHW and channels-last, at each shape and thread count:
    BatchNorm              ours BatchNorm        vs torch.nn.BatchNorm2d
    BatchNormReLU          ours BatchNormReLU    vs Sequential(BatchNorm2d, ReLU())
    BatchNormReLU/inplace  ours BatchNormReLU    vs Sequential(BatchNorm2d, ReLU(inplace=True))
    BatchNormAddReLU       ours BatchNormAddReLU vs BatchNorm2d, `y += r`, relu_ (torchvision's
                                                    residual block's end)
One step is `layer(x.detach().requires_grad_()).backward(dy)` (the add layers: with a residual
r of x's shape and layout that requires grad too): the forward in training mode (batch
statistics, running statistics updated), the backward to x (and r), weight and bias.  The six
steps of a case are timed interleaved, round by round, by timing.measure (the protocol of every
bench row), with the page faults of each timed step counted.  Both sides allocate their
tensors through torch; while they are timed, torch's CPU allocator is bench/torch_cache.cpp
(when it builds here), which hands a dropped block out again as a caching allocator does:
under glibc's own, a step's 25 MiB tensors came from fresh pages or from reused ones by the
history of the heap (4000 page faults on one step, none on the next), which decided the
ratio more than the layers did.  Before the timing, one step
of each side on the same x and dy is compared: y, x.grad, weight.grad and bias.grad of ours
against torch's.

Threads: torch.set_num_threads(n), restored afterwards; our layers follow torch's count
(num_threads=None reads torch.get_num_threads() at every call).
"""
import os
from dataclasses import dataclass, field

import numpy as np

from checks import PEER_SLACK, SEMANTICS_LIMIT, TOLERANCE, CheckFailed, relative_error
import torch_cache
from procmem import minor_faults
from timing import measure

try:
    import torch
except ImportError:      # the layer rows need torch
    torch = None

SHAPES = ((32, 64, 56, 56), (32, 256, 14, 14))    # ResNet-50's conv2 and conv4 batch norms
QUICK_SHAPES = ((8, 16, 10, 10),)
# ResNet-18's batch norms at batch 32 on 64 x 64 images, stage by stage: where a layer's fixed
# cost shows
RESNET18_64PX = ((32, 64, 32, 32), (32, 64, 16, 16), (32, 128, 8, 8), (32, 256, 4, 4),
                 (32, 512, 2, 2))
# ResNet-50's (torchvision's Bottleneck) at batch 32 on 64 x 64 images, each shape once
RESNET50_64PX = ((32, 64, 32, 32), (32, 64, 16, 16), (32, 256, 16, 16), (32, 128, 16, 16),
                 (32, 128, 8, 8), (32, 512, 8, 8), (32, 256, 8, 8), (32, 256, 4, 4),
                 (32, 1024, 4, 4), (32, 512, 4, 4), (32, 512, 2, 2), (32, 2048, 2, 2))
# --layer-shapes names: the module attribute each one reads when the rows run
SHAPE_SETS = {"default": "SHAPES", "quick": "QUICK_SHAPES", "resnet18-64px": "RESNET18_64PX",
              "resnet50-64px": "RESNET50_64PX"}
FORMATS = ("NCHW", "channels-last")
# (name, our layer class, torch's ReLU after its BatchNorm2d: None, "ReLU" or "ReLU/inplace")
PAIRS = (("BatchNorm", "BatchNorm", None),
         ("BatchNormReLU", "BatchNormReLU", "ReLU"),
         ("BatchNormReLU/inplace", "BatchNormReLU", "ReLU/inplace"),
         ("BatchNormAddReLU", "BatchNormAddReLU", "add+ReLU"))
CHECKED = ("y", "x.grad", "weight.grad", "bias.grad")


@dataclass
class LayerRow:
    layer: str                 # a PAIRS name
    shape: tuple
    memory_format: str         # NCHW or channels-last
    threads: int
    ours_ms: float             # median ms per training step
    torch_ms: float
    vs_torch: float            # torch's median / ours (> 1: ours is faster)
    ours_min_ms: float
    torch_min_ms: float
    vs_torch_min: float        # torch's fastest step / ours
    ours_iqr_ms: float
    torch_iqr_ms: float
    ours_impl: str             # the timing names of the two steps
    torch_impl: str
    err: dict = field(default_factory=dict)   # {CHECKED name: ours against torch's}
    faults_per_call: dict = None  # {"ours": .., "torch": ..}: page faults per timed step
    notes: list = field(default_factory=list)
    load1: float = None


def _adds(layer):
    """Whether `layer` is called as layer(x, residual)."""
    from bnbw_native.autograd import BatchNormAddReLU
    return isinstance(layer, (BatchNormAddReLU, TorchAddReLU))


def _call(layer, adds, x, residual):
    """layer's y on a fresh leaf (and a fresh residual leaf when it adds one)."""
    leaf = x.detach().requires_grad_()
    if not adds:
        return layer(leaf), leaf, None
    r = residual.detach().requires_grad_()
    return layer(leaf, r), leaf, r


def step(layer, x, dy, residual):
    """One training step of `layer`: forward on a fresh leaf, backward of dy."""
    adds = _adds(layer)

    def run():
        _call(layer, adds, x, residual)[0].backward(dy)
    return run


class TorchAddReLU(torch.nn.Module if torch is not None else object):
    """torch.nn.BatchNorm2d, then the residual added in place and an in-place ReLU, as
    torchvision's residual blocks end (`out = bn(out); out += identity; out = relu(out)`)."""

    def __init__(self, channels):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(channels)

    def forward(self, x, residual):
        y = self.bn(x)
        y += residual
        return torch.relu_(y)


def make_layers(channels):
    """{timing name: module}: ours (BatchNorm, BatchNormReLU, BatchNormAddReLU) and torch's
    four."""
    from bnbw_native.autograd import BatchNorm, BatchNormAddReLU, BatchNormReLU
    ours = {"BatchNorm": BatchNorm, "BatchNormReLU": BatchNormReLU,
            "BatchNormAddReLU": BatchNormAddReLU}
    nn = torch.nn
    relu = {None: (), "ReLU": (nn.ReLU(),), "ReLU/inplace": (nn.ReLU(inplace=True),)}
    layers = {}
    for name, our_class, after in PAIRS:
        layers.setdefault(f"{our_class} ours", ours[our_class](channels))
        if our_class == "BatchNormAddReLU":
            layers[f"{name} torch"] = TorchAddReLU(channels)
        else:
            layers[f"{name} torch"] = (nn.Sequential(nn.BatchNorm2d(channels), *relu[after])
                                       if after else nn.BatchNorm2d(channels))
    return layers


def outputs(layer, x, dy, residual):
    """y, x.grad, weight.grad, bias.grad (and the residual's gradient, for the add layers) of
    one step (parameter gradients cleared first)."""
    layer.zero_grad(set_to_none=True)
    y, leaf, r = _call(layer, _adds(layer), x, residual)
    y.backward(dy)
    params = [p for p in layer.parameters()]
    return [y.detach(), leaf.grad] + [p.grad for p in params[:2]] + ([] if r is None
                                                                       else [r.grad])


def compare(ours, theirs, x, dy, residual):
    """({CHECKED name: max |ours - torch's| / max |torch's|}, flips) over one step of each.
    Where a ReLU's input lies within rounding of 0, one side's y can be 0 and the other's
    positive; that element's gradients are then 0 on one side and dy on the other.  Such
    elements (`flips`, counted) are left out of the gradients' comparison; more than one in
    10^5 fails the check."""
    mine, theirs_ = outputs(ours, x, dy, residual), outputs(theirs, x, dy, residual)
    flipped = (mine[0] > 0) != (theirs_[0] > 0)
    flips = int(flipped.sum())
    if flips > max(1, x.numel() // 100000):
        raise CheckFailed(f"layer {type(ours).__name__}: {flips} of {x.numel()} elements are "
                          "positive on one side only")
    errs = {}
    for name, a, b in zip(CHECKED + ("residual.grad",), mine, theirs_):
        if name != "y" and flips and a.shape == x.shape:
            a, b = a.masked_fill(flipped, 0), b.masked_fill(flipped, 0)
        errs[name] = relative_error(a.float().numpy(), b.double().numpy())
    return errs, flips


def case_inputs(shape, memory_format):
    g = torch.Generator().manual_seed(0)
    fmt = torch.channels_last if memory_format == "channels-last" else torch.contiguous_format
    x = torch.randn(shape, generator=g).contiguous(memory_format=fmt)
    dy = torch.randn(shape, generator=g).contiguous(memory_format=fmt)
    residual = torch.randn(shape, generator=g).contiguous(memory_format=fmt)
    return x, dy, residual


def layer_rows(shapes, threads, protocol, echo=None):
    """LayerRows for every thread count, shape, memory format and pair (PAIRS order), each
    case's five steps timed interleaved with `protocol`; `echo(row)` after each row.  Raises
    CheckFailed when ours differs from torch's layer beyond checks.SEMANTICS_LIMIT; a row
    beyond PEER_SLACK x the f32 tolerance gets a note."""
    if torch is None:
        raise ImportError("the layer rows need torch")
    rows = []
    cache = torch_cache.load()
    was = torch.get_num_threads()
    try:
        for nthreads in threads:
            torch.set_num_threads(nthreads)
            for shape in shapes:
                for memory_format in FORMATS:
                    x, dy, residual = case_inputs(shape, memory_format)
                    layers = make_layers(shape[1])
                    checks = {name: compare(layers[f"{ours} ours"], layers[f"{name} torch"], x,
                                            dy, residual)
                              for name, ours, _ in PAIRS}
                    for layer in layers.values():
                        layer.zero_grad(set_to_none=True)
                    fns = {name: step(layer, x, dy, residual) for name, layer in layers.items()}
                    installed = cache is not None and cache.on()
                    try:
                        times = measure(fns, protocol, subjects=tuple(fns),
                                        count=lambda: {"faults": minor_faults()})
                    finally:
                        if installed:
                            cache.off()
                            cache.flush()
                    for name, ours, _ in PAIRS:
                        row = make_row(name, shape, memory_format, nthreads, times,
                                       f"{ours} ours", f"{name} torch", *checks[name])
                        rows.append(row)
                        if echo is not None:
                            echo(row)
    finally:
        torch.set_num_threads(was)
    return rows


def make_row(name, shape, memory_format, nthreads, times, ours, theirs, errs, flips=0):
    o, t = times[ours], times[theirs]
    row = LayerRow(
        layer=name, shape=tuple(shape), memory_format=memory_format, threads=nthreads,
        ours_ms=o["median"] * 1e3, torch_ms=t["median"] * 1e3,
        vs_torch=t["median"] / o["median"], ours_min_ms=o["min"] * 1e3,
        torch_min_ms=t["min"] * 1e3, vs_torch_min=t["min"] / o["min"],
        ours_iqr_ms=(o["q3"] - o["q1"]) * 1e3, torch_iqr_ms=(t["q3"] - t["q1"]) * 1e3,
        ours_impl=ours, torch_impl=theirs, err=errs,
        faults_per_call={who: (times[n].get("per_call") or {}).get("faults")
                         for who, n in (("ours", ours), ("torch", theirs))},
        load1=os.getloadavg()[0])
    worst = max(errs.values())
    where = f"{name} {tuple(shape)} {memory_format} threads={nthreads}"
    if not worst <= SEMANTICS_LIMIT:
        raise CheckFailed(f"layer {where}: ours differs from torch's by {worst:.2g} "
                          f"({errs})")
    if worst > PEER_SLACK * TOLERANCE["f32"][0]:
        row.notes.append(f"err {worst:.0e}")
    if flips:
        row.notes.append(f"{flips} ReLU flip{'s' if flips > 1 else ''}")
    return row


HEADER = (f"{'thr':>3} {'shape':<18} {'format':<13} {'layer':<22} {'ours ms':>9} "
          f"{'torch ms':>9} {'x torch':>7} {'(min)':>6} {'err':>8} {'faults o/t':>11}")


def format_row(row):
    faults = row.faults_per_call or {}
    count = "/".join("-" if faults.get(w) is None else f"{faults[w]:.0f}"
                     for w in ("ours", "torch"))
    return (f"{row.threads:>3} {str(row.shape):<18} {row.memory_format:<13} {row.layer:<22} "
            f"{row.ours_ms:9.3f} {row.torch_ms:9.3f} {row.vs_torch:7.2f} "
            f"{row.vs_torch_min:6.2f} {max(row.err.values()):8.1e} {count:>11}"
            + (" " + ",".join(row.notes) if row.notes else ""))


def spread(row):
    """The larger interquartile range over median of the row's two steps (how noisy)."""
    return max(row.ours_iqr_ms / row.ours_ms, row.torch_iqr_ms / row.torch_ms)


def noise(rows):
    return float(np.max([spread(r) for r in rows])) if rows else 0.0
