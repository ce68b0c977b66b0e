"""bnbw_native.autograd.BatchNormReLU, SyncBatchNormReLU and convert_batchnorm(fuse_relu=True)
against torch.nn.Sequential(BatchNorm*d, ReLU): in float64 on the same data, in torch's
float32, in half precision, channels-last, with inplace ReLUs, across gloo ranks, through
state dicts, and the conversions themselves.  The example that trains with them
(examples/train_resnet_fused.py) runs in package/test_examples.py; what they refuse is in
test_refusals.py.
"""
import copy
import operator
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from bnbw_native import _torch_ops as ops  # noqa: E402  (after the importorskip)
from bnbw_native import autograd as bag  # noqa: E402

TORCH_BN = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d,
            5: torch.nn.BatchNorm3d}


def rel_err(got, ref):
    """max |got - ref| / max |ref|, in float64."""
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max())


def data(shape, seed=0, memory_format=torch.contiguous_format):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).contiguous(memory_format=memory_format)
    return x, torch.randn(shape, generator=g)


def pair(num_features, ndim=4, **kw):
    """Our fused layer and torch's Sequential(BatchNorm*d, ReLU), same non-trivial state."""
    ours = bag.BatchNormReLU(num_features, **kw)
    if ours.weight is not None:
        with torch.no_grad():
            ours.weight.copy_(torch.linspace(0.5, 1.5, num_features))
            ours.bias.copy_(torch.linspace(-1, 1, num_features))
    ref = TORCH_BN[ndim](num_features, **kw)
    ref.load_state_dict(ours.state_dict())
    return ours, torch.nn.Sequential(ref, torch.nn.ReLU())


def run(layer, x, g, dtype=None):
    """y, dx, and the parameter gradients for the loss sum(y * g); x copied, layout kept."""
    x = x.detach().clone(memory_format=torch.preserve_format)
    if dtype is not None:
        x, g = x.to(dtype), g.to(dtype)
    x.requires_grad_()
    layer.zero_grad()
    y = layer(x)
    (y * g).sum().backward()
    return [y, x.grad] + [p.grad for p in layer.parameters()]


def check_against_float64(ours, ref, x, g, tol=1e-6):
    got = run(ours, x, g)
    want = run(copy.deepcopy(ref).double(), x, g, torch.float64)
    for name, a, c in zip(("y", "dx", "dweight", "dbias"), got, want):
        assert rel_err(a, c) <= tol, name
    return got, want


# ---- gradients ----------------------------------------------------------------------------

@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last],
                         ids=["NCHW", "channels_last"])
def test_gradients_match_batchnorm2d_relu(memory_format):
    x, g = data((8, 16, 12, 10), memory_format=memory_format)
    ours, ref = pair(16)
    got, _ = check_against_float64(ours, ref, x, g)
    want32 = run(ref, x, g)                             # torch's float32 layers
    for a, b in zip(got, want32):
        assert a.dtype == torch.float32 and rel_err(a, b) <= 1e-5
    assert (got[0] == 0).float().mean() > 0.3           # the ReLU masks a good part
    assert got[1].is_contiguous(memory_format=memory_format)
    for buf in ("running_mean", "running_var", "num_batches_tracked"):
        assert rel_err(getattr(ours, buf), getattr(ref[0], buf)) <= 1e-6


@pytest.mark.parametrize("shape", [(64, 5), (9, 4, 11), (3, 4, 5, 3, 6)],
                         ids=["1d-NC", "1d-NCL", "3d"])
def test_other_ranks_match_torch(shape):
    x, g = data(shape, seed=1)
    ours, ref = pair(shape[1], ndim=len(shape))
    check_against_float64(ours, ref, x, g)


@pytest.mark.parametrize("kw", [dict(affine=False), dict(track_running_stats=False),
                                dict(momentum=None)], ids=["no-affine", "no-running",
                                                           "cumulative"])
def test_options_match_torch(kw):
    x, g = data((6, 3, 5, 5), seed=2)
    ours, ref = pair(3, **kw)
    for step in range(2):
        check_against_float64(ours, ref, x + step, g)
        run(ref, x + step, g)               # keeps ref's running statistics in step
    if ours.running_mean is not None:
        # ours: float64 rounded once from the exact batch statistics; torch: float32 steps
        for name in ("running_mean", "running_var"):
            assert rel_err(getattr(ours, name), getattr(ref[0], name)) <= 1e-6
        assert torch.equal(ours.num_batches_tracked, ref[0].num_batches_tracked)
        ours.load_state_dict(ref[0].state_dict())
    ours.eval()
    ref.eval()
    assert torch.equal(ours(x), ref(x))     # eval mode is torch's, bit for bit


def test_parameters_only():
    # x without requires_grad: the reduce-only path, masked
    x, g = data((8, 6, 7, 7), seed=3)
    ours, ref = pair(6)
    (ours(x) * g).sum().backward()
    ref64 = copy.deepcopy(ref).double()
    (ref64(x.double()) * g.double()).sum().backward()
    assert rel_err(ours.weight.grad, ref64[0].weight.grad) <= 1e-6
    assert rel_err(ours.bias.grad, ref64[0].bias.grad) <= 1e-6


@pytest.mark.parametrize("dtype,tol", [
    (torch.float16, 2e-3),
    (torch.bfloat16, 1.6e-2),       # read in place: no ml_dtypes needed
], ids=["f16", "bf16"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last],
                         ids=["NCHW", "channels_last"])
def test_half_inputs(dtype, tol, memory_format):
    x, g = data((6, 4, 5, 5), seed=4, memory_format=memory_format)
    x, g = x.to(dtype), g.to(dtype)
    ours, ref = pair(4)
    got = run(ours, x, g)
    want = run(copy.deepcopy(ref).double(), x, g, torch.float64)
    assert got[0].dtype == dtype and got[1].dtype == dtype
    assert got[2].dtype == torch.float32
    assert got[1].is_contiguous(memory_format=memory_format)
    for a, c in zip(got, want):
        assert rel_err(a, c) <= tol


def test_zero_outputs_are_inactive():
    # a channel whose outputs are all <= 0 (bias far below) gets no gradient at all: dx = 0,
    # dweight = dbias = 0, exactly
    x, g = data((6, 3, 4, 4), seed=5)
    ours, ref = pair(3)
    with torch.no_grad():
        ours.bias[1] = -100.0
    ref[0].load_state_dict(ours.state_dict())
    got, want = check_against_float64(ours, ref, x, g)
    assert torch.all(got[0][:, 1] == 0) and torch.all(got[1][:, 1] == 0)
    assert got[2][1] == 0 and got[3][1] == 0


def test_backward_hands_the_tensors_to_the_kernel(monkeypatch):
    # x, the incoming gradient and the layer's output (the ReLU mask) read in place, dx written
    # in place into the tensor handed back to autograd
    seen = {}
    native = ops.backward

    def spy(conv, formula, x, dy, mean, var, gamma, eps, data_format, out, nt, **kw):
        seen.update(x=x.data_ptr(), dy=dy.data_ptr(), out=out[0].data_ptr(),
                    relu_dst=kw["relu_dst"].data_ptr(), tensors=kw["tensors"])
        return native(conv, formula, x, dy, mean, var, gamma, eps, data_format, out, nt, **kw)

    monkeypatch.setattr(ops, "backward", spy)
    x, g = data((4, 8, 6, 5), memory_format=torch.channels_last)
    xin = x.clone(memory_format=torch.preserve_format).requires_grad_()
    y = bag.BatchNormReLU(8)(xin)
    grad = g.contiguous(memory_format=torch.channels_last)
    y.backward(grad)
    assert seen["tensors"]
    assert seen["x"] == xin.data_ptr() and seen["dy"] == grad.data_ptr()
    assert seen["relu_dst"] == y.data_ptr()
    assert seen["out"] == xin.grad.data_ptr()


def test_the_fused_layer_is_the_plain_layer_then_relu_bit_for_bit():
    """The fused layer's y is the ReLU of the plain layer's (the engine's forward), and its
    backward - the engine masking the gradient with y - equals the plain layer's backward on
    the masked gradient (what torch's threshold_backward would pass it)."""
    x, g = data((5, 6, 7, 3), seed=6, memory_format=torch.channels_last)
    fused, _ = pair(6)
    plain = bag.BatchNorm(6)
    plain.load_state_dict(fused.state_dict())
    y, dx, dw, db = run(fused, x, g)
    y_plain = plain(x.detach().clone(memory_format=torch.preserve_format))
    assert torch.equal(y, torch.relu(y_plain))
    masked = torch.where(y > 0, g, torch.zeros(()))
    _, dx_plain, dw_plain, db_plain = run(plain, x, masked)
    for a, b in ((dx, dx_plain), (dw, dw_plain), (db, db_plain)):
        assert torch.equal(a, b)


def test_output_kept_for_the_backward_must_not_change():
    # as with torch's ReLU: the backward reads the layer's output
    x, _ = data((4, 3, 4, 4), seed=7)
    x.requires_grad_()
    y = bag.BatchNormReLU(3)(x)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# ---- state dicts and conversion ------------------------------------------------------------

def test_state_dict_round_trip_with_batchnorm2d():
    x, g = data((6, 5, 4, 4), seed=8)
    ref = torch.nn.BatchNorm2d(5)
    run(ref, x, g)                                      # non-trivial running statistics
    with torch.no_grad():
        ref.weight.mul_(1.5)
        ref.bias.add_(0.25)
    ours = bag.BatchNormReLU(5)
    ours.load_state_dict(ref.state_dict())
    assert list(ours.state_dict()) == list(ref.state_dict())
    back = torch.nn.BatchNorm2d(5)
    back.load_state_dict(ours.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v) and torch.equal(ours.state_dict()[k], v)
    ours.eval(), ref.eval()
    assert torch.equal(ours(x), torch.relu(ref(x)))


def torch_net(inplace=True, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(inplace=inplace),
        torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1, bias=False),
                            torch.nn.BatchNorm2d(8), torch.nn.ReLU()),    # nested
        torch.nn.Conv2d(8, 4, 1, bias=False), torch.nn.BatchNorm2d(4),    # no ReLU after
        torch.nn.Flatten(), torch.nn.Linear(4 * 36, 6), torch.nn.BatchNorm1d(6),
        torch.nn.ReLU(inplace=inplace))                                   # 1d, last


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "not-inplace"])
def test_convert_fuses_relus_and_keeps_keys(inplace):
    ref = torch_net(inplace)
    ref[5].eval()
    net = bag.convert_batchnorm(copy.deepcopy(ref), fuse_relu=True)
    assert type(net[1]) is bag.BatchNormReLU and type(net[2]) is torch.nn.Identity
    assert type(net[3][1]) is bag.BatchNormReLU and type(net[3][2]) is torch.nn.Identity
    assert type(net[5]) is bag.BatchNorm and not net[5].training
    assert type(net[8]) is bag.BatchNormReLU and type(net[9]) is torch.nn.Identity
    assert list(net.state_dict()) == list(ref.state_dict())
    assert all(torch.equal(net.state_dict()[k], v) for k, v in ref.state_dict().items())
    # the converted net computes what torch's does
    x, _ = data((5, 3, 6, 6), seed=9)
    x64 = x.double().requires_grad_()
    ref64 = copy.deepcopy(ref).double()
    x32 = x.clone().requires_grad_()
    net(x32).square().sum().backward()
    ref64(x64).square().sum().backward()
    assert rel_err(x32.grad, x64.grad) <= 1e-5
    # norm-wise over the net: some gradients are 0 in exact arithmetic (the last batch norm
    # cancels a constant shift of its input), float32 noise there
    scale = max(float(b.grad.abs().max()) for b in ref64.parameters())
    for (name, a), b in zip(net.named_parameters(), ref64.parameters()):
        assert float((a.grad.double() - b.grad).abs().max()) <= 1e-5 * scale, name
    for a, b in zip(net.buffers(), ref64.buffers()):
        torch.testing.assert_close(a.to(b.dtype), b, rtol=1e-6, atol=1e-7)


def test_convert_fuses_batchnorm3d():
    torch.manual_seed(1)
    ref = torch.nn.Sequential(torch.nn.Conv3d(2, 4, 3, padding=1), torch.nn.BatchNorm3d(4),
                              torch.nn.ReLU(inplace=True))
    net = bag.convert_batchnorm(copy.deepcopy(ref), fuse_relu=True)
    assert type(net[1]) is bag.BatchNormReLU and type(net[2]) is torch.nn.Identity
    x = torch.randn(3, 2, 4, 5, 6, generator=torch.Generator().manual_seed(2))
    x = x.contiguous(memory_format=torch.channels_last_3d)
    x32, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    net(x32).square().sum().backward()
    copy.deepcopy(ref).double()(x64).square().sum().backward()
    assert x32.grad.is_contiguous(memory_format=torch.channels_last_3d)
    assert rel_err(x32.grad, x64.grad) <= 1e-5


def test_convert_without_fuse_keeps_relus():
    net = bag.convert_batchnorm(torch_net())
    assert type(net[1]) is bag.BatchNorm and type(net[2]) is torch.nn.ReLU


def test_convert_leaves_what_it_cannot_fuse():
    hooked = torch.nn.ReLU()
    hooked.register_forward_hook(lambda *args: None)
    net = torch.nn.Sequential(
        torch.nn.BatchNorm2d(3), torch.nn.ReLU6(),           # not a ReLU
        torch.nn.BatchNorm2d(3), torch.nn.LeakyReLU(),
        torch.nn.BatchNorm2d(3), hooked,                      # someone watches it
        torch.nn.ModuleDict({"bn": torch.nn.BatchNorm2d(3), "relu": torch.nn.ReLU()}),
        torch.nn.ReLU(), torch.nn.BatchNorm2d(3))            # ReLU before, BN last
    net = bag.convert_batchnorm(net, fuse_relu=True)
    assert [type(m) for m in net[:6]] == [bag.BatchNorm, torch.nn.ReLU6, bag.BatchNorm,
                                          torch.nn.LeakyReLU, bag.BatchNorm, torch.nn.ReLU]
    assert type(net[6]["bn"]) is bag.BatchNorm and type(net[6]["relu"]) is torch.nn.ReLU
    assert type(net[7]) is torch.nn.ReLU and type(net[8]) is bag.BatchNorm


def test_convert_sync_and_already_converted():
    net = bag.convert_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.ReLU()),
                                sync=True, fuse_relu=True, num_threads=1)
    assert type(net[0]) is bag.SyncBatchNormReLU and net[0].num_threads == 1
    # a layer converted earlier (BatchNorm) and its ReLU fuse too; a fused one stays as it is
    net = torch.nn.Sequential(bag.BatchNorm(3, num_threads=2), torch.nn.ReLU(),
                              bag.BatchNormReLU(3), torch.nn.ReLU())
    weight = net[0].weight
    net = bag.convert_batchnorm(net, fuse_relu=True)
    assert type(net[0]) is bag.BatchNormReLU and net[0].weight is weight
    assert net[0].num_threads == 2
    assert type(net[2]) is bag.BatchNormReLU and type(net[3]) is torch.nn.ReLU
    # a bare batch norm comes back converted, unfused
    assert type(bag.convert_batchnorm(torch.nn.BatchNorm3d(2), fuse_relu=True)) is bag.BatchNorm


# ---- gloo ranks ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """Three gloo ranks (one of them empty) running dist/torch_worker.py."""
    from test_distributed import BOUNDS, launch_gloo, make_batch
    tmp = tmp_path_factory.mktemp("gloo_relu")
    data = make_batch(tmp / "data.npz")
    data["bounds"] = np.array(BOUNDS[3])
    np.savez(tmp / "data.npz", **data)
    return data, launch_gloo(3, tmp)


@pytest.mark.parametrize("tag", ["modrelu_cf", "modrelu_cl"])
def test_sync_batchnorm_relu_equals_the_whole_batch(three_ranks, tag):
    data, ranks = three_ranks
    ref = torch.nn.BatchNorm2d(data["x"].shape[-1], eps=float(data["eps"])).double()
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(data["gamma"]))
        ref.bias.copy_(torch.from_numpy(data["beta"]))
    x = torch.from_numpy(np.moveaxis(data["x"], -1, 1).astype(np.float64)).requires_grad_()
    dy = torch.from_numpy(np.moveaxis(data["dy"], -1, 1).astype(np.float64))
    y = torch.relu(ref(x))
    (y * dy).sum().backward()
    assert (y == 0).double().mean() > 0.05
    bounds = data["bounds"]
    for r, res in enumerate(ranks):
        lo, hi = bounds[r], bounds[r + 1]
        assert bool(res[f"{tag}_dx_format"]), "dx keeps the input's memory format"
        if hi > lo:
            assert rel_err(torch.from_numpy(res[f"{tag}_y"]), y[lo:hi]) <= 1e-5
            assert rel_err(torch.from_numpy(res[f"{tag}_dx"]), x.grad[lo:hi]) <= 1e-5
        assert rel_err(torch.from_numpy(res[f"{tag}_rm"]), ref.running_mean) <= 1e-5
        assert rel_err(torch.from_numpy(res[f"{tag}_rv"]), ref.running_var) <= 1e-5
    # parameter gradients are this rank's: their sum is the whole batch's
    dw = sum(torch.from_numpy(res[f"{tag}_dw"]).double() for res in ranks)
    db = sum(torch.from_numpy(res[f"{tag}_db"]).double() for res in ranks)
    assert rel_err(dw, ref.weight.grad) <= 1e-5
    assert rel_err(db, ref.bias.grad) <= 1e-5


def test_sync_batchnorm_relu_compiles_to_the_same_bits(three_ranks):
    # torch.compile(fullgraph=True) with the group inside the operators; the ranks compare
    # compiled and eager results bit for bit
    _, ranks = three_ranks
    assert all(bool(res["compiled_equal"]) for res in ranks)


# ---- fusing what a model's forward computes (torch.fx) ---------------------------------------

class BasicBlock(torch.nn.Module):
    """torchvision's BasicBlock: one nn.ReLU module called twice in forward, after bn1 and
    after the residual add."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.relu = torch.nn.ReLU(inplace=True)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class SmallResNet(torch.nn.Module):
    def __init__(self, seed=0):
        torch.manual_seed(seed)
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)
        self.layer = torch.nn.Sequential(BasicBlock(8), BasicBlock(8))
        self.head_bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        x = torch.nn.functional.relu(self.bn(self.conv(x)))
        x = self.layer(x)
        y = self.head_bn(x)
        x = y + y.relu()                  # used twice: not fusable
        return self.fc(x.mean(dim=(2, 3)))


def _step(net, x):
    x = x.clone(memory_format=torch.preserve_format).requires_grad_()
    net.zero_grad(set_to_none=True)
    y = net(x)
    y.square().sum().backward()
    return [y, x.grad] + [p.grad for p in net.parameters()]


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last],
                         ids=["NCHW", "channels_last"])
def test_convert_fuses_the_relus_a_forward_calls(memory_format):
    ref = SmallResNet().to(memory_format=memory_format)
    unfused = bag.convert_batchnorm(copy.deepcopy(ref))
    net = bag.convert_batchnorm(copy.deepcopy(ref), fuse_relu=True)
    assert isinstance(net, torch.fx.GraphModule)
    kinds = {name: type(m) for name, m in net.named_modules()
             if isinstance(m, bag.BatchNorm)}
    assert kinds == {"bn": bag.BatchNormReLU, "layer.0.bn1": bag.BatchNormReLU,
                     "layer.0.bn2": bag.BatchNormAddReLU, "layer.1.bn1": bag.BatchNormReLU,
                     "layer.1.bn2": bag.BatchNormAddReLU, "head_bn": bag.BatchNorm}
    assert list(net.state_dict()) == list(ref.state_dict())
    assert all(torch.equal(net.state_dict()[k], v) for k, v in ref.state_dict().items())
    targets = [n.target for n in net.graph.nodes]
    assert [t for t in targets if str(t).endswith("relu")] == ["relu"]  # the head's alone
    assert targets.count(operator.add) == 1                          # the head's y + relu(y)
    # fused, the same bits as our unfused layers and torch's ReLUs; both near float64 torch
    x = data((6, 3, 7, 7), seed=13, memory_format=memory_format)[0]
    got, want = _step(net, x), _step(unfused, x)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    ref64 = copy.deepcopy(ref).double()
    exact = _step(ref64, x.double())
    assert rel_err(got[1], exact[1]) <= 1e-5
    for name in ("running_mean", "running_var"):
        assert rel_err(getattr(net.bn, name), getattr(ref64.bn, name)) <= 1e-6


@pytest.mark.parametrize("spelling", [
    lambda y: torch.nn.functional.relu(y), lambda y: torch.nn.functional.relu(y, inplace=True),
    lambda y: torch.relu(y), lambda y: torch.relu_(y), lambda y: y.relu(),
    lambda y: y.relu_(), torch.nn.ReLU(), torch.nn.ReLU(inplace=True)],
    ids=["F.relu", "F.relu-inplace", "torch.relu", "torch.relu_", "relu", "relu_",
         "nn.ReLU", "nn.ReLU-inplace"])
def test_every_spelling_of_relu_fuses(spelling):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm2d(4)
            self.act = spelling if isinstance(spelling, torch.nn.Module) else None

        def forward(self, x):
            return (self.act or spelling)(self.bn(x)) * 2

    net = bag.convert_batchnorm(Net(), fuse_relu=True)
    assert type(net.bn) is bag.BatchNormReLU
    assert [n.op for n in net.graph.nodes] == ["placeholder", "call_module", "call_function",
                                               "output"]
    x = torch.randn(5, 4, 3, 3)
    assert torch.equal(net(x), bag.convert_batchnorm(Net())(x))    # our bn, then the ReLU


def test_a_batch_norm_whose_output_is_used_elsewhere_is_not_fused():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.bn(x)
            return torch.relu(y) + y

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net = bag.convert_batchnorm(Net(), fuse_relu=True)
    assert type(net) is Net and type(net.bn) is bag.BatchNorm


class TwoCalls(torch.nn.Module):
    """One batch norm called at two places, a ReLU (or the residual block's add and ReLU)
    after one of them only."""

    def __init__(self, add):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(4)
        self.add = add

    def forward(self, x, z):
        y = self.bn(x)
        if self.add:
            y += z
        return torch.relu(y), self.bn(z)


@pytest.mark.parametrize("add", [False, True], ids=["relu", "add-relu"])
def test_a_batch_norm_called_at_two_places_is_not_fused(add):
    ref = TwoCalls(add)
    net = bag.convert_batchnorm(copy.deepcopy(ref), fuse_relu=True)
    assert type(net.bn) is bag.BatchNorm
    x, z = torch.randn(3, 4, 5, 5), torch.randn(3, 4, 5, 5)
    got, want = net(x, z), ref(x, z)
    assert bool((got[1] < 0).any())          # the second call has no ReLU
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-5
    assert rel_err(net.bn.running_mean, ref.bn.running_mean) <= 1e-6


def test_a_module_held_twice_in_a_sequential_fuses_only_where_a_relu_follows_it():
    conv, bn = torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4)
    # the same convolution before and after the batch norm: the ReLU follows the convolution
    tied = torch.nn.Sequential(conv, bn, conv, torch.nn.ReLU())
    net = bag.convert_batchnorm(copy.deepcopy(tied), fuse_relu=True)
    assert [type(m) for m in net] == [torch.nn.Conv2d, bag.BatchNorm, torch.nn.Conv2d,
                                      torch.nn.ReLU]
    x = torch.randn(3, 4, 5, 5)
    assert rel_err(net(x), tied(x)) <= 1e-5
    # the same batch norm twice, a ReLU after the second: each place its own layer, one
    # tensor of parameters and statistics
    twice = torch.nn.Sequential(bn, bn, torch.nn.ReLU())
    net = bag.convert_batchnorm(copy.deepcopy(twice), fuse_relu=True)
    assert [type(m) for m in net] == [bag.BatchNorm, bag.BatchNormReLU, torch.nn.Identity]
    assert net[0].weight is net[1].weight and net[0].running_var is net[1].running_var
    assert list(net.state_dict()) == list(twice.state_dict())
    assert rel_err(net(x), twice(x)) <= 1e-5
    assert rel_err(net[0].running_var, twice[0].running_var) <= 1e-6


def test_a_traced_model_keeps_the_order_of_its_parameters_and_keys():
    class Net(torch.nn.Module):       # parts made in another order than the forward calls them
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm2d(4)
            self.head = torch.nn.Sequential(torch.nn.BatchNorm2d(4), torch.nn.Conv2d(4, 4, 1))
            self.conv = torch.nn.Conv2d(4, 4, 1)

        def forward(self, x):
            return self.head(torch.relu(self.bn(self.conv(x))))

    ref = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net = bag.convert_batchnorm(copy.deepcopy(ref), fuse_relu=True)
    assert isinstance(net, torch.fx.GraphModule) and type(net.bn) is bag.BatchNormReLU
    assert list(net.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in net.named_parameters()] == [n for n, _ in ref.named_parameters()]
    x = torch.randn(3, 4, 5, 5)
    assert rel_err(net(x), ref(x)) <= 1e-5


@pytest.mark.parametrize("make", [bag.BatchNorm, bag.BatchNormReLU])
def test_layers_take_torchs_argument_name(make):
    layer, ref = make(4), torch.nn.BatchNorm2d(4)
    x = torch.randn(3, 4, 5, 5)
    want = ref(input=x)
    assert rel_err(layer(input=x), want.relu() if make is bag.BatchNormReLU else want) <= 1e-5
    add = bag.BatchNormAddReLU(4)
    assert rel_err(add(input=x, residual=x), (ref(x) + x).relu()) <= 1e-5


def test_an_untraceable_forward_keeps_the_sequential_rule_and_says_so():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.ReLU())
            self.bn = torch.nn.BatchNorm2d(3)

        def forward(self, x):
            if x.sum() > 0:               # data-dependent: torch.fx cannot trace it
                x = x * 2
            return torch.relu(self.bn(self.seq(x)))

    with pytest.warns(RuntimeWarning, match="cannot be traced by torch.fx"):
        net = bag.convert_batchnorm(Net(), fuse_relu=True)
    assert type(net) is Net
    assert type(net.seq[0]) is bag.BatchNormReLU and type(net.seq[1]) is torch.nn.Identity
    assert type(net.bn) is bag.BatchNorm


class _Double(torch.nn.Module):
    def forward(self, x):
        return x * 2


class _Unfaithful(torch.nn.Module):
    """A forward whose torch.fx graph would not do what it does (`kind` says how), around a
    batch norm and a ReLU the graph rule would fuse."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.inner = _Double()        # (inlined by the trace)
        self.bn = torch.nn.BatchNorm2d(3)
        self.frozen = torch.nn.BatchNorm2d(3)

    def forward(self, x):
        if self.kind == "training":
            x = torch.nn.functional.dropout(x, 0.5, self.training)
        elif self.kind == "no_grad":
            with torch.no_grad():
                x = self.frozen(x)
        elif self.kind == "hooks":
            x = self.inner(x)
        return torch.relu(self.bn(x))


class _Optional(_Unfaithful):
    def forward(self, x, scale=None):
        if scale is not None:
            x = x * scale
        return torch.relu(self.bn(x))


@pytest.mark.parametrize("kind", ["training", "no_grad", "optional", "hooks", "model-hooks"])
def test_a_forward_whose_graph_would_differ_is_not_rewritten(kind):
    """torch.fx keeps the ops a forward runs, not the training flag it read, the grad mode it
    set, the branch an optional argument took or the hooks of what it inlined: such a model
    keeps its own forward (the Sequential rule alone), with a warning that says why."""
    net = _Optional(kind) if kind == "optional" else _Unfaithful(kind)
    if kind == "hooks":
        net.inner.register_forward_hook(lambda m, i, o: None)
    if kind == "model-hooks":
        net.register_forward_pre_hook(lambda m, i: None)
    reason = {"training": "depends on training mode", "no_grad": "switches grad",
              "optional": r"optional argument \(scale\)", "hooks": "_Double has hooks",
              "model-hooks": "the model has hooks"}[kind]
    with pytest.warns(RuntimeWarning, match=reason):
        out = bag.convert_batchnorm(net, fuse_relu=True)
    assert out is net and type(net.bn) is bag.BatchNorm
    net.eval()          # (its training flag is read where the forward reads it)
    x = torch.randn(4, 3, 5, 5)
    assert torch.equal(net(x), net(x))


def test_a_rewritten_model_keeps_its_submodules_modes():
    """Batch norms kept in eval mode in a training model (frozen statistics) stay so."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn1 = torch.nn.BatchNorm2d(3)
            self.bn2 = torch.nn.BatchNorm2d(3)

        def forward(self, x):
            return torch.relu(self.bn2(torch.relu(self.bn1(x))))

    net = Net()
    net.bn2.eval()
    out = bag.convert_batchnorm(net, fuse_relu=True)
    assert isinstance(out, torch.fx.GraphModule) and out.training
    assert out.bn1.training and not out.bn2.training
    before = out.bn2.running_mean.clone()
    out(torch.randn(4, 3, 5, 5) + 3)
    assert torch.equal(out.bn2.running_mean, before)


def test_a_sequential_with_a_forward_of_its_own_is_not_fused_by_the_sequential_rule():
    class Twice(torch.nn.Sequential):
        def forward(self, x):
            a = self[0](x)
            return a + self[1](a)         # the batch norm's output used twice

    torch.manual_seed(0)
    net = Twice(torch.nn.BatchNorm2d(3), torch.nn.ReLU())
    x = torch.randn(4, 3, 5, 5)
    want = copy.deepcopy(net)(x)
    out = bag.convert_batchnorm(net, fuse_relu=True)
    assert type(out[0]) is bag.BatchNorm and type(out[1]) is torch.nn.ReLU
    assert rel_err(out(x), want) <= 1e-5


def test_a_converted_sync_layer_keeps_its_group_when_fused():
    group = object()              # (only kept: a world of one never reads it)
    net = torch.nn.Sequential(bag.SyncBatchNorm(3, process_group=group), torch.nn.ReLU())
    net = bag.convert_batchnorm(net, fuse_relu=True)          # sync=False: stays in its group
    assert type(net[0]) is bag.SyncBatchNormReLU and net[0].process_group is group
    net = torch.nn.Sequential(torch.nn.SyncBatchNorm(3, process_group=group), torch.nn.ReLU())
    net = bag.convert_batchnorm(net, sync=True, fuse_relu=True)
    assert type(net[0]) is bag.SyncBatchNormReLU and net[0].process_group is group


def test_tensor_subclasses_go_through_the_dispatcher():
    """A FakeTensor has no memory for the kernels to read: refused as torch's layer refuses
    it, not read from its address (the running statistics were overwritten with garbage)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    layer = bag.BatchNorm(3)
    before = layer.running_mean.clone()
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(4, 3, 2, 2))
        with pytest.raises(Exception, match="FakeTensor"):
            layer(x)
    assert torch.equal(layer.running_mean, before)


def test_an_integer_weight_is_refused_in_eager_mode_too():
    x = torch.randn(4, 3, 2, 2)
    with pytest.raises(TypeError, match="weight must be a floating-point tensor"):
        bag.batch_norm(x, torch.ones(3, dtype=torch.int32))


def test_a_batch_norm_with_a_forward_of_its_own_is_left_as_it_is():
    class Frozen(torch.nn.BatchNorm2d):       # always its running statistics
        def forward(self, x):
            return torch.nn.functional.batch_norm(x, self.running_mean, self.running_var,
                                                  self.weight, self.bias, False, 0.0, self.eps)

    net = torch.nn.Sequential(Frozen(3), torch.nn.BatchNorm2d(3))
    with pytest.warns(RuntimeWarning, match=r"0 \(Frozen\) has a forward of its own"):
        net = bag.convert_batchnorm(net)
    assert type(net[0]) is Frozen and type(net[1]) is bag.BatchNorm


def test_a_compiled_model_converts():
    """A compiled model (torch.compile's wrapper) comes back converted where its graph allows,
    not with a TypeError from asking the wrapper for its length."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm2d(3)

        def forward(self, x):
            return torch.relu(self.bn(x))

    net = torch.compile(Net())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = bag.convert_batchnorm(net, fuse_relu=True)
    assert out is net and type(net._orig_mod.bn) in (bag.BatchNorm, bag.BatchNormReLU)


def test_old_state_dicts_load_and_statistics_reset_as_in_torch():
    """A state dict from before num_batches_tracked (version 1) loads, as into BatchNorm2d;
    reset_running_stats and reset_parameters do what torch's do."""
    state = torch.nn.BatchNorm2d(3).state_dict()
    del state["num_batches_tracked"]
    state._metadata[""]["version"] = 1
    layer, ref = bag.BatchNorm(3), torch.nn.BatchNorm2d(3)
    layer.num_batches_tracked.fill_(5)
    layer.load_state_dict(state)
    ref.load_state_dict(state)
    assert int(layer.num_batches_tracked) == int(ref.num_batches_tracked) == 0
    layer(torch.randn(4, 3, 2, 2) + 2)
    with torch.no_grad():
        layer.weight.mul_(3)
    layer.reset_running_stats()
    assert torch.equal(layer.running_mean, torch.zeros(3))
    assert torch.equal(layer.running_var, torch.ones(3)) and int(layer.num_batches_tracked) == 0
    assert torch.equal(layer.weight, torch.full((3,), 3.0))
    layer.reset_parameters()
    assert torch.equal(layer.weight, torch.ones(3)) and torch.equal(layer.bias, torch.zeros(3))


def test_a_parameter_on_another_device_is_named():
    layer = bag.BatchNorm(3)
    layer.weight = torch.nn.Parameter(torch.ones(3, device="meta"))
    with pytest.raises(ValueError, match=r"weight must be on x's device \(cpu\), got meta"):
        layer(torch.randn(4, 3, 2, 2))


def test_a_batch_norm_with_hooks_is_left_as_it_is():
    seen = []
    net = torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.ReLU(), torch.nn.BatchNorm2d(3))
    net[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with pytest.warns(RuntimeWarning, match=r"0 \(BatchNorm2d\) has hooks"):
        net = bag.convert_batchnorm(net, fuse_relu=True)
    assert type(net[0]) is torch.nn.BatchNorm2d and type(net[1]) is torch.nn.ReLU
    assert type(net[2]) is bag.BatchNorm
    net(torch.randn(4, 3, 2, 2))
    assert seen == [(4, 3, 2, 2)]


def test_a_lazy_batch_norm_converts_once_it_knows_its_channels():
    net = torch.nn.Sequential(torch.nn.LazyBatchNorm2d(), torch.nn.ReLU())
    with pytest.raises(ValueError, match="num_features is not known yet: run one forward"):
        bag.convert_batchnorm(net)
    net(torch.randn(4, 5, 2, 2))
    net = bag.convert_batchnorm(net, fuse_relu=True)
    assert type(net[0]) is bag.BatchNormReLU and net[0].num_features == 5


@pytest.mark.parametrize("input_grad", [True, False], ids=["x-grad", "parameters-only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("x_format, r_format", [
    (torch.contiguous_format, torch.contiguous_format),
    (torch.channels_last, torch.channels_last),
    (torch.channels_last, torch.contiguous_format)], ids=["nchw", "cl", "cl-r-nchw"])
def test_the_add_layer_is_bn_add_relu_with_the_residuals_gradient(monkeypatch, input_grad, dtype,
                                                                  x_format, r_format):
    # y = max(bn(x) + r, 0) and r's gradient: the bits of our BatchNorm, + r, torch.relu, with
    # the add and the ReLU in the kernel's pass that writes y (r read in x's layout)
    residuals = []
    native = ops.forward

    def spy(*args, residual=None, **kw):
        residuals.append(None if residual is None else residual.stride())
        return native(*args, residual=residual, **kw)

    monkeypatch.setattr(ops, "forward", spy)
    x, g = data((5, 4, 3, 6), seed=21, memory_format=x_format)
    x, g = x.to(dtype), g.to(dtype)
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(22)).to(dtype)
    r = r.contiguous(memory_format=r_format)
    fused, plain = bag.BatchNormAddReLU(4), bag.BatchNorm(4)
    got, want = [], []
    for layer, out in ((fused, got), (plain, want)):
        xs = x.clone().requires_grad_(input_grad)
        rs = r.clone().requires_grad_()
        y = layer(xs, rs) if layer is fused else torch.relu(layer(xs) + rs)
        (y * g).sum().backward()
        out += [y, rs.grad, layer.weight.grad, layer.bias.grad, layer.running_var]
        if input_grad:
            out.append(xs.grad)
    assert residuals == [x.stride(), None]
    for a, b in zip(got, want):
        assert torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())


def test_the_add_layer_keeps_nan_and_inf_of_the_residual():
    x, _ = data((4, 3, 5, 5), seed=23)
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(24))
    r[0, :, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    fused, plain = bag.BatchNormAddReLU(3), bag.BatchNorm(3)
    y = fused(x, r)
    want = torch.relu(plain(x) + r)
    assert torch.equal(y.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(want))
    assert y[0, :, 0, 0].isnan().all() and (y[0, :, 0, 1] == float("inf")).all()


def test_the_add_layer_adds_a_broadcast_residual_as_written():
    layer, plain = bag.BatchNormAddReLU(4), bag.BatchNorm(4)
    x = torch.randn(3, 4, 2, 2)
    r = torch.randn(4, 1, 1)
    assert torch.equal(layer(x, r), torch.relu(plain(x) + r))
    layer.eval()
    plain.eval()
    assert torch.equal(layer(x, r), torch.relu(plain(x) + r))


@pytest.mark.parametrize("layer_type", ["BatchNorm", "BatchNormReLU", "BatchNormAddReLU"])
@pytest.mark.parametrize("x_format, grad_format", [
    (torch.channels_last, torch.contiguous_format),     # what an average pool hands back
    (torch.contiguous_format, torch.channels_last)])
def test_a_gradient_in_another_layout_gives_the_bits_of_one_in_xs(monkeypatch, layer_type,
                                                                   x_format, grad_format):
    # the kernel reads a gradient laid out unlike x after one copy into x's layout (else it
    # would read it strided in both passes), with the bits of the gradient handed over in x's
    # layout (dx, the parameters', the residual's)
    strides = []
    native = ops.backward

    def spy(conv, formula, x, dy, *args, **kw):
        strides.append((x.stride(), dy.stride()))
        return native(conv, formula, x, dy, *args, **kw)

    monkeypatch.setattr(ops, "backward", spy)
    x, g = data((8, 5, 16, 16), seed=31, memory_format=x_format)
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(32))
    results = []
    for layout in (x_format, grad_format):
        layer = getattr(bag, layer_type)(5)
        xs = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
        rs = r.clone().requires_grad_()
        y = layer(xs, rs) if layer_type == "BatchNormAddReLU" else layer(xs)
        y.backward(g.contiguous(memory_format=layout))
        grads = [xs.grad, layer.weight.grad, layer.bias.grad]
        results.append(grads + ([rs.grad] if layer_type == "BatchNormAddReLU" else []))
    assert len(strides) == 2 and all(xs == dys for xs, dys in strides)
    for a, b in zip(*results):
        assert torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())
