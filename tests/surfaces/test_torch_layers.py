"""bnbw_native.autograd (issue 7): the PyTorch layer against torch.nn.BatchNorm*d.

Gradient checks compare float32 results with torch's float32 layer and with torch's layer in
float64 on the same (float32) data: gradcheck itself needs float64 inputs, which the kernel
does not take.  A short training run checks that the layer trains like torch's.
"""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from bnbw_native import autograd as bag  # noqa: E402  (after the importorskip)
from bnbw_native import _torch_ops as ops  # noqa: E402


def rel_err(got, ref):
    """max |got - ref| / max |ref|, in float64."""
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max())


TORCH_BN = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d,
            5: torch.nn.BatchNorm3d}


def run(layer, x, g, dtype=None, relu=False):
    """y, dx, dweight, dbias for the loss sum(y * g) (y = relu(layer(x)) when relu); x is
    copied, its layout kept."""
    x = x.detach().clone(memory_format=torch.preserve_format)
    if dtype is not None:
        x, g = x.to(dtype), g.to(dtype)
    x.requires_grad_()
    y = layer(x)
    if relu:
        y = torch.relu(y)
    (y * g).sum().backward()
    grads = [x.grad]
    if layer.weight is not None:
        grads += [layer.weight.grad, layer.bias.grad]
    return [y] + grads


def pair(num_features, ndim=4, **kw):
    """Our layer and torch's, with the same non-trivial parameters."""
    ours = bag.BatchNorm(num_features, **kw)
    ref = TORCH_BN[ndim](num_features, **kw)
    if ours.weight is not None:
        with torch.no_grad():
            ours.weight.copy_(torch.linspace(0.5, 1.5, num_features))
            ours.bias.copy_(torch.linspace(-1, 1, num_features))
        ref.load_state_dict(ours.state_dict())
    return ours, ref


def data(shape, seed=0, channels_last=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2 + 0.5
    dy = torch.randn(shape, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, dy


# ---- gradients --------------------------------------------------------------------------

@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "channels_last"])
def test_gradients_match_batchnorm2d(channels_last):
    x, g = data((8, 16, 12, 10), channels_last=channels_last)
    ours, ref = pair(16)
    ref64 = copy.deepcopy(ref).double()
    got, want, exact = run(ours, x, g), run(ref, x, g), run(ref64, x, g, torch.float64)
    for name, a, b, c in zip(("y", "dx", "dweight", "dbias"), got, want, exact):
        assert a.dtype == torch.float32
        assert rel_err(a, b) <= 1e-5, name          # torch's float32 layer
        assert rel_err(a, c) <= 1e-6, name          # the float64 layer on the same data
    assert got[1].is_contiguous(memory_format=torch.channels_last) == channels_last
    for buf in ("running_mean", "running_var"):
        assert rel_err(getattr(ours, buf), getattr(ref64, buf)) <= 1e-6
    assert int(ours.num_batches_tracked) == 1


def test_parametrized_weight_is_read_as_an_attribute():
    # a parametrization takes the weight out of the module's parameter dict (a property
    # computes it): the layer reads it so, as torch's does, and the gradient reaches the
    # original through it
    from torch.nn.utils import parametrize

    class Doubled(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    x, g = data((6, 5, 4, 3), seed=3)
    ours, ref = pair(5)
    for layer in (ours, ref):
        parametrize.register_parametrization(layer, "weight", Doubled())
    got, want = run(ours, x, g), run(ref, x, g)
    for name, a, b in zip(("y", "dx"), got, want):
        assert rel_err(a, b) <= 1e-5, name
    assert rel_err(ours.parametrizations.weight.original.grad,
                   ref.parametrizations.weight.original.grad) <= 1e-5
    assert rel_err(ours.running_var, ref.running_var) <= 1e-6
    assert int(ours.num_batches_tracked) == 1


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "channels_last"])
@pytest.mark.parametrize("offset", [0.0, 1e3, 1e5])
def test_batch_statistics_are_float64_accurate(channels_last, offset):
    # |mean| >> std: Sum x^2 - (Sum x)^2 / n alone would cancel; the result must still be the
    # float64 statistics rounded once to float32 (momentum 1: running stats = batch stats)
    x, _ = data((16, 8, 9, 9), seed=8, channels_last=channels_last)
    x = x + offset
    layer = bag.BatchNorm(8, momentum=1.0)
    layer(x)
    var64, mean64 = torch.var_mean(x.double(), dim=(0, 2, 3), correction=1)
    assert rel_err(layer.running_mean, mean64) <= 1e-7
    assert rel_err(layer.running_var, var64) <= 2e-7


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "channels_last"])
@pytest.mark.parametrize("offset", [1e3, 1e5])
@pytest.mark.parametrize("relu", [False, True], ids=["BatchNorm", "BatchNormReLU"])
def test_gradients_are_float64_accurate_far_from_zero(channels_last, offset, relu):
    # the backward centres on the forward's exact mean (its float32 rounding plus the rest):
    # on the float32 mean alone dweight was off by 1e-4 (offset 1e3) to 1e-3 (1e5) relative,
    # as torch's float32 layer is; the operators (compiled) take the same path, the same bits
    x, g = data((16, 8, 9, 9), seed=9, channels_last=channels_last)
    x = x + offset * torch.linspace(-1, 1, 8).reshape(1, 8, 1, 1)
    ours, ref = pair(8)
    if relu:
        ours = bag.BatchNormReLU(8)
        ours.load_state_dict(ref.state_dict())
    compiled = copy.deepcopy(ours)
    got, exact = run(ours, x, g), run(ref.double(), x, g, torch.float64, relu=relu)
    for name, a, c in zip(("y", "dx", "dweight", "dbias"), got, exact):
        assert rel_err(a, c) <= 1e-6, name
    torch._dynamo.reset()
    fn = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    for a, c in zip(got, run(fn, x, g)):
        assert torch.equal(a, c)


@pytest.mark.parametrize("shape", [(64, 5), (9, 4, 11), (3, 4, 5, 3, 6)],
                         ids=["1d-NC", "1d-NCL", "3d"])
def test_other_ranks_match_torch(shape):
    x, g = data(shape, seed=1)
    ours, ref = pair(shape[1], ndim=len(shape))
    ref64 = copy.deepcopy(ref).double()
    for name, a, c in zip(("y", "dx", "dw", "db"), run(ours, x, g),
                          run(ref64, x, g, torch.float64)):
        assert rel_err(a, c) <= 1e-6, name


def test_channels_last_3d_is_read_in_place():
    x, g = data((3, 4, 5, 3, 6), seed=2)
    x = x.contiguous(memory_format=torch.channels_last_3d)
    ours, ref = pair(4, ndim=5)
    got, want = run(ours, x, g), run(copy.deepcopy(ref).double(), x, g, torch.float64)
    assert got[1].is_contiguous(memory_format=torch.channels_last_3d)
    assert all(rel_err(a, c) <= 1e-6 for a, c in zip(got, want))


@pytest.mark.parametrize("kw", [dict(affine=False), dict(track_running_stats=False),
                                dict(momentum=None)], ids=["no-affine", "no-running",
                                                           "cumulative"])
def test_options_match_batchnorm2d(kw):
    x, g = data((6, 3, 5, 5), seed=3)
    ours, ref = pair(3, **kw)
    ref64 = copy.deepcopy(ref).double()
    for step in range(2):
        x = x + step
        for a, c in zip(run(ours, x, g), run(ref64, x, g, torch.float64)):
            assert rel_err(a, c) <= 1e-6
    ours.eval()
    ref64.eval()
    assert rel_err(ours(x), ref64(x.double())) <= 1e-6
    if ours.running_mean is not None:
        assert rel_err(ours.running_var, ref64.running_var) <= 1e-6


def _within_half_ulp(got, want64):
    """|got - want| <= half a float32 ulp of want (float64 reference, float32 result)."""
    want = want64.numpy()
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    return bool(np.all(np.abs(got.double().numpy() - want) <= 0.5 * ulp * (1 + 1e-9)))


@pytest.mark.parametrize("momentum", [0.1, None, 0.0, 1.0], ids=["0.1", "cumulative", "0", "1"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "channels_last"])
def test_running_statistics_are_pytorchs_update_rounded_once(momentum, channels_last):
    # (1 - f) * old + f * batch, the variance unbiased, from the exact batch statistics: each
    # running value within half a float32 ulp of the float64 reference, in place (version
    # counted), every step
    g = torch.Generator().manual_seed(11)
    layer = bag.BatchNorm(5, momentum=momentum)
    with torch.no_grad():
        layer.running_mean.copy_(torch.randn(5, generator=g))
        layer.running_var.copy_(torch.rand(5, generator=g) + 0.5)
    where = (layer.running_mean.data_ptr(), layer.running_var.data_ptr())
    for step in range(3):
        x = torch.randn(7, 5, 3, 4, generator=g) * 3 + 100 * step
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        old = (layer.running_mean.double(), layer.running_var.double())
        versions = (layer.running_mean._version, layer.running_var._version)
        layer(x.requires_grad_()).sum().backward()
        f = momentum if momentum is not None else 1.0 / (step + 1)
        x64 = x.detach().double()
        mean = x64.mean(dim=(0, 2, 3))
        var = x64.var(dim=(0, 2, 3), unbiased=True)
        assert _within_half_ulp(layer.running_mean, (1 - f) * old[0] + f * mean)
        assert _within_half_ulp(layer.running_var, (1 - f) * old[1] + f * var)
        assert layer.running_mean._version > versions[0]
        assert layer.running_var._version > versions[1]
        assert int(layer.num_batches_tracked) == step + 1
    assert (layer.running_mean.data_ptr(), layer.running_var.data_ptr()) == where


@pytest.mark.parametrize("momentum", [0.1, 0.0, 1.0])
def test_a_process_groups_running_statistics_are_one_process_bits(momentum):
    # SyncBatchNorm's ranks update their running statistics from the all-reduced forward sums
    # (_engine.torch_running_statistics).  Given the sums one process takes - around each
    # channel's first element, on the same plan - the rule gives exactly the one-process layer's
    # bits, far from zero too (where an update in float32 torch ops loses them)
    from bnbw_native import _engine
    from bnbw_native._two_phase import forward_reduce
    g = torch.Generator().manual_seed(13)
    x = torch.randn(9, 6, 5, 7, generator=g) * 0.5 + 40
    old = (torch.randn(6, generator=g) * 3, torch.rand(6, generator=g) + 0.5)
    layer = bag.BatchNorm(6, momentum=momentum)
    with torch.no_grad():
        layer.running_mean.copy_(old[0])
        layer.running_var.copy_(old[1])
    layer(x)
    xs = x.numpy()
    shift = np.ascontiguousarray(xs[0, :, 0, 0])
    sums, count = forward_reduce(xs, shift, data_format="NCX")
    new = _engine.torch_running_statistics(shift, sums, count, old[0].double().numpy(),
                                           old[1].double().numpy(), momentum)
    for got, want in zip((layer.running_mean, layer.running_var), new):
        np.testing.assert_array_equal(got.numpy().view(np.uint32),
                                      want.astype(np.float32).view(np.uint32))


def test_running_statistics_of_another_dtype_are_updated_through_float32():
    # a layer made in float16 keeps float16 buffers: the float32 update, stored back
    ours = bag.BatchNorm(4, dtype=torch.float16)
    x = (torch.randn(6, 4, 3, 3, generator=torch.Generator().manual_seed(12)) * 2 + 1).half()
    ours(x)
    x64 = x.double()
    want_m = 0.1 * x64.mean(dim=(0, 2, 3))
    want_v = 0.9 + 0.1 * x64.var(dim=(0, 2, 3), unbiased=True)
    assert ours.running_mean.dtype == ours.running_var.dtype == torch.float16
    for got, want in ((ours.running_mean, want_m), (ours.running_var, want_v)):
        assert bool(((got.double() - want).abs() <= want.abs() * 2.0 ** -11).all())


def test_a_momentum_outside_0_1_is_refused_with_the_buffers_untouched():
    layer = bag.BatchNorm(3, momentum=1.5)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ValueError, match=r"momentum must be None or in \[0, 1\], got 1.5"):
        layer(torch.randn(4, 3, 2, 2))
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_eval_mode_is_torch_eval():
    x, g = data((6, 3, 5, 5), seed=4)
    ours, ref = pair(3)
    run(ours, x, g)
    ref.load_state_dict(ours.state_dict())
    ours.eval()
    ref.eval()
    assert torch.equal(ours(x), ref(x))


def test_parameters_only_match_the_full_backward():
    # x without requires_grad: the layer takes the reduce-only path
    x, g = data((8, 6, 7, 7), seed=5)
    full, _ = pair(6)
    params, _ = pair(6)
    run(full, x, g)
    (params(x) * g).sum().backward()
    assert rel_err(params.weight.grad, full.weight.grad) <= 1e-6
    assert rel_err(params.bias.grad, full.bias.grad) <= 1e-6


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCX", "NXC"])
def test_each_pass_hands_the_tensors_themselves_to_one_native_call(monkeypatch, channels_last):
    calls = {"forward": [], "backward": []}
    for name in calls:
        native = getattr(ops, name)

        def spy(*args, _native=native, _seen=calls[name], _out=10 if name == "forward" else 9,
                **kw):
            # addresses, not the tensors: holding dx would stop autograd taking it as x.grad
            _seen.append(([a.data_ptr() if torch.is_tensor(a) else a for a in args[:_out]],
                          [t.data_ptr() if torch.is_tensor(t) else t.ctypes.data
                           for t in args[_out]], kw))     # (eager statistics: NumPy)
            return _native(*args, **kw)

        monkeypatch.setattr(ops, name, spy)
    x, g = data((4, 8, 6, 5), channels_last=channels_last)
    g = g.contiguous(memory_format=torch.channels_last if channels_last else
                     torch.contiguous_format)
    layer = bag.BatchNorm(8)
    xin = x.clone(memory_format=torch.preserve_format).requires_grad_()
    y = layer(xin)
    y.backward(g)
    assert len(calls["forward"]) == 1 and len(calls["backward"]) == 1
    (f_args, f_out, f_kw), (b_args, b_out, b_kw) = calls["forward"][0], calls["backward"][0]
    assert f_kw["tensors"] and f_kw["torch_running"] and b_kw["tensors"]
    assert f_args[1] == xin.data_ptr()                # x as it is: no view, no copy
    assert f_args[2] == f_out[1] == layer.running_mean.data_ptr()     # updated in place
    assert f_args[3] == f_out[2] == layer.running_var.data_ptr()
    assert f_out[0] == y.data_ptr()                   # y written where autograd gets it
    assert b_args[2] == xin.data_ptr() and b_args[3] == g.data_ptr()
    assert b_out[0] == xin.grad.data_ptr()
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last else
                           torch.contiguous_format)


@pytest.mark.parametrize("dtype,tol", [
    (torch.float16, 2e-3),
    (torch.bfloat16, 1.6e-2),       # read in place: no ml_dtypes needed
], ids=["f16", "bf16"])
def test_half_inputs(dtype, tol):
    x, g = data((6, 4, 5, 5), seed=6)
    x, g = x.to(dtype), g.to(dtype)
    ours, ref = pair(4)
    got = run(ours, x, g)
    want = run(copy.deepcopy(ref).double(), x, g, torch.float64)
    assert got[0].dtype == dtype and got[1].dtype == dtype
    assert got[2].dtype == torch.float32
    for a, c in zip(got, want):
        assert rel_err(a, c) <= tol


def test_functional_batch_norm():
    x, g = data((5, 3, 4, 4), seed=7)
    w = torch.rand(3, requires_grad=True)
    b = torch.rand(3, requires_grad=True)
    xin = x.clone().requires_grad_()
    (bag.batch_norm(xin, w, b, eps=1e-3) * g).sum().backward()
    x64 = x.double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    y64 = torch.nn.functional.batch_norm(x64, None, None, w64, b64, True, 0.0, 1e-3)
    (y64 * g.double()).sum().backward()
    for a, c in ((xin.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert rel_err(a, c) <= 1e-6


@pytest.mark.parametrize("cls", [bag.BatchNorm, bag.BatchNormReLU])
def test_float64_runs_torch_and_gradchecks(cls):
    # float64 input runs torch's own kernels (the bnbw_native kernels take no float64):
    # the same bits as torch's layers, and torch.autograd.gradcheck applies
    x, g = data((5, 3, 4, 4), seed=9)
    ours, ref = pair(3)
    ours = cls(3).double()
    ours.load_state_dict(ref.state_dict())
    ref = ref.double()
    got = run(ours, x, g, torch.float64)
    want = run(ref, x, g, torch.float64, relu=cls is bag.BatchNormReLU)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(ours.running_var, ref.running_var)
    layer = cls(3, track_running_stats=False).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([0.5, 1.0, 2.0]))
        layer.bias.copy_(torch.tensor([0.3, -0.2, 0.1]))   # keeps ReLU inputs off 0
    inputs = (x[:3, :, :2, :3].double().requires_grad_(),)
    assert torch.autograd.gradcheck(layer, inputs)


def test_float64_functional():
    x, g = data((5, 3, 4), seed=10)
    x64 = x.double().requires_grad_()
    w = torch.rand(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: bag.batch_norm(x, w, None, relu=True),
                                    (x64[:3, :, :2].detach().requires_grad_(), w))
    with pytest.raises(TypeError, match="weight must be float64"):
        bag.batch_norm(x64, w.float())


# ---- modules ------------------------------------------------------------------------------

def tiny_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(16, 4))


def test_convert_keeps_state_and_mode():
    net = tiny_net()
    net[1].eval()
    before = net.state_dict()
    converted = bag.convert_batchnorm(copy.deepcopy(net))
    assert isinstance(converted[1], bag.BatchNorm) and isinstance(converted[4], bag.BatchNorm)
    assert not converted[1].training and converted[4].training
    after = converted.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert isinstance(bag.convert_batchnorm(net, sync=True)[1], bag.SyncBatchNorm)


def train(net, channels_last, steps=50):
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 3, 1, 1, generator=g) * 0.8
    labels = torch.arange(64) % 4
    images = centres[labels] + torch.randn(64, 3, 12, 12, generator=g)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
        images = images.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        batch = slice(16 * (step % 4), 16 * (step % 4) + 16)
        loss = torch.nn.functional.cross_entropy(net(images[batch]), labels[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "channels_last"])
def test_training_follows_batchnorm2d(channels_last):
    ref = tiny_net()
    ours = bag.convert_batchnorm(copy.deepcopy(ref))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # the same torch kernels for both runs
    try:
        want = train(ref, channels_last)
        got = train(ours, channels_last)
    finally:
        torch.set_num_threads(threads)
    assert got[-10:].mean() < 0.5 * got[:5].mean()          # it learns
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


# ---- the forward in the engine, threads ---------------------------------------

def test_the_layers_follow_torchs_thread_count(monkeypatch):
    """Without num_threads, the forward and the backward run on torch.get_num_threads()
    threads, read at every call."""
    from bnbw_native import _torch_ops
    seen = []
    real = _torch_ops.threads
    monkeypatch.setattr(_torch_ops, "threads", lambda n: seen.append(real(n)) or real(n))
    before = torch.get_num_threads()
    layer = bag.BatchNorm(3)
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            x = torch.randn(8, 3, 5, 5, requires_grad=True)
            layer(x).sum().backward()
            assert seen[-2:] == [n, n]
    finally:
        torch.set_num_threads(before)
    assert real(5) == 5


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_layer_forward_is_the_engines_forward(relu, channels_last):
    """y and the batch statistics come from bnbw_native.batchnorm_training_forward, bit for
    bit; the running statistics follow PyTorch's momentum and unbiased variance."""
    import numpy as np
    import bnbw_native as bn
    torch.manual_seed(3)
    layer = (bag.BatchNormReLU if relu else bag.BatchNorm)(4, momentum=0.3)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(0.5, 1.5, 4))
        layer.bias.copy_(torch.linspace(-1, 1, 4))
    x = torch.randn(6, 4, 5, 7) * 3 + 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = layer(x)
    xs = x.permute(0, 2, 3, 1).numpy() if channels_last else x.numpy()
    want = bn.batchnorm_training_forward(
        xs, np.zeros(4, np.float32), np.ones(4, np.float32), layer.weight.detach().numpy(),
        layer.bias.detach().numpy(), epsilon=1e-5, data_format="NXC" if channels_last else "NCX",
        fuse_relu=relu)
    got = y.detach().permute(0, 2, 3, 1).numpy() if channels_last else y.detach().numpy()
    assert np.array_equal(got, want.dst)
    assert y.is_contiguous(memory_format=torch.channels_last) == channels_last
    M = 6 * 5 * 7
    expect_var = 0.7 * 1.0 + 0.3 * want.batch_variance.astype(np.float64) * M / (M - 1)
    assert np.allclose(layer.running_var.numpy(), expect_var, rtol=1e-6)
    assert np.allclose(layer.running_mean.numpy(), 0.3 * want.batch_mean, rtol=1e-6)


# ---- torch's own edges: empty batches, negative-bit inputs, vmap ----------------------------

@pytest.mark.parametrize("cls", [bag.BatchNorm, bag.BatchNormReLU])
@pytest.mark.parametrize("shape", [(0, 4, 3, 3), (2, 4, 0, 3)])
def test_an_empty_batch_follows_batchnorm2d(cls, shape):
    """torch.nn.BatchNorm2d returns an empty y for an empty batch, counts the batch and leaves
    the running statistics; the parameter gradients are zero."""
    ours, ref = cls(4), torch.nn.BatchNorm2d(4)
    with torch.no_grad():
        ours.running_mean.fill_(0.25)
        ref.running_mean.fill_(0.25)
    x = torch.empty(shape, requires_grad=True)
    y = ours(x)
    assert y.shape == x.shape
    y.sum().backward()
    ref(x.detach())
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert torch.equal(ours.weight.grad, torch.zeros(4))
    assert bag.batch_norm(x.detach(), relu=cls is bag.BatchNormReLU).shape == x.shape


def test_negative_bit_inputs_are_read_as_their_values():
    """x and the incoming gradient held negated (torch._neg_view) give the bits of the plain
    tensors: the layers read them as their values, as the array front-ends do."""
    x, dy = data((3, 4, 5, 5))
    ours, _ = pair(4)
    results = []
    for held in (False, True):
        layer, leaf = copy.deepcopy(ours), (-x if held else x).clone().requires_grad_()
        y = layer(torch._neg_view(leaf) if held else leaf)
        y.backward(torch._neg_view(-dy) if held else dy)
        results.append((y.detach(), -leaf.grad if held else leaf.grad, layer.weight.grad))
    for u, v in zip(*results):
        assert torch.equal(u, v)


def test_an_output_over_the_memory_of_a_negative_bit_input_is_refused():
    """A negated view is read through a copy; an output placed over its memory would overwrite
    the caller's tensor, so it is refused as any overlap is, every output untouched."""
    from bnbw_native._arrays import TRAINING, backward
    from bnbw_native._onednn_graph import GRAPH
    x, dy = data((3, 4, 5, 5))
    held = -x
    stats = torch.zeros(4), torch.ones(4)
    params = torch.full((4,), 7.0), torch.full((4,), 7.0)
    before = held.clone()
    with pytest.raises(ValueError, match=r"out\[0\] \(diff_src\) overlaps the input src"):
        backward(GRAPH, TRAINING, torch._neg_view(held), dy, *stats, None, 1e-5, "NCX",
                 (held, *params), 1, tensors=True)
    assert torch.equal(held, before) and all(torch.equal(p, torch.full((4,), 7.0))
                                             for p in params)
    dx = torch.empty_like(x)                      # apart from it: accepted, x's own bits
    backward(GRAPH, TRAINING, torch._neg_view(held), dy, *stats, None, 1e-5, "NCX",
             (dx, *params), 1, tensors=True)
    want = backward(GRAPH, TRAINING, x.numpy(), dy.numpy(), *(t.numpy() for t in stats), None,
                    1e-5, "NCX", None, 1)
    assert torch.equal(dx, torch.from_numpy(want[0]))


def test_a_negative_bit_input_too_large_to_copy_is_refused_by_name():
    """A negated view read in place by the layers' path (tensors=True) is copied first; when
    its values cannot be copied (expanded past memory), the call is the ValueError naming the
    input, as on the array path, and no output is written."""
    from bnbw_native._arrays import TRAINING, backward
    from bnbw_native._onednn_graph import GRAPH
    huge = torch._neg_view(torch.zeros(1, 4, 5, 5)).expand(2 ** 55, 4, 5, 5)
    stats = torch.zeros(4), torch.ones(4)
    outs = torch.full((3, 4, 5, 5), 7.0), torch.full((4,), 7.0), torch.full((4,), 7.0)
    with pytest.raises(ValueError, match=r"src is too large to copy"):
        backward(GRAPH, TRAINING, huge, torch.zeros(1, 4, 5, 5), *stats, None, 1e-5, "NCX",
                 outs, 1, tensors=True)
    assert all(torch.equal(o, torch.full_like(o, 7.0)) for o in outs)


def test_vmap_runs_one_batch_norm_per_entry_and_its_gradients():
    """torch.func.vmap (and per-sample gradients, vmap of grad) over a layer without running
    statistics gives what it gives over torch's BatchNorm2d; a layer with running statistics
    is refused with a message, as torch's is."""
    from torch.func import functional_call, grad, vmap
    ours, ref = pair(4, track_running_stats=False)
    x = torch.randn(3, 5, 4, 6, 6) + 2
    assert rel_err(vmap(ours)(x), vmap(ref)(x)) < 1e-6

    def loss(params, xi, module):
        return functional_call(module, params, (xi,)).square().mean()     # y's weights: 1/N

    for name in ("weight", "bias"):
        got = vmap(grad(loss), in_dims=(None, 0, None))(dict(ours.named_parameters()), x, ours)
        want = vmap(grad(loss), in_dims=(None, 0, None))(dict(ref.named_parameters()), x, ref)
        assert got[name].shape == (3, 4) and rel_err(got[name], want[name]) < 1e-5
    g = torch.randn(5, 4, 6, 6)
    dx = vmap(grad(lambda xi: (ours(xi) * g).sum()))(x)
    assert rel_err(dx, vmap(grad(lambda xi: (ref(xi) * g).sum()))(x)) < 1e-5
    with pytest.raises(RuntimeError, match="track_running_stats=False"):
        vmap(bag.BatchNorm(4))(x)


@pytest.mark.parametrize("cls", [bag.BatchNorm, bag.BatchNormReLU, bag.BatchNormAddReLU])
def test_a_tensor_left_over_from_a_finished_transform_is_read_as_its_value(cls):
    """Inputs kept from inside a finished torch.func transform (functorch's wrappers of a
    level that has ended) give the bits of the plain tensors, forward and backward, as
    torch.autograd.Function.apply gives them: the eager layers skip that apply's Python layer
    and unwrap such tensors themselves (a wrapper has no memory of its own to read)."""
    x, dy = data((4, 3, 5, 5), channels_last=True)
    residual = torch.randn(x.shape).contiguous(memory_format=torch.channels_last)
    kept = []

    def keep(t, r):
        kept.extend((t, r))
        return (t * r).sum()

    torch.func.grad(keep, argnums=(0, 1))(x.clone(), residual.clone())
    assert all(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in kept)
    results = []
    for t, r in (kept, (x.detach().requires_grad_(), residual)):
        layer = cls(3)
        y = layer(t, r) if cls is bag.BatchNormAddReLU else layer(t)
        y.backward(dy)
        results.append((y.detach(), layer.weight.grad, layer.bias.grad, layer.running_var))
    for u, v in zip(*results):
        assert torch.equal(u, v)


def test_without_the_private_apply_the_layers_take_the_public_one(monkeypatch):
    """A PyTorch without functorch's unwrap_if_dead (or the C base of autograd functions)
    gets torch.autograd.Function.apply itself, and the same bits."""
    x, dy = data((4, 3, 5, 5))
    monkeypatch.delattr(torch._C._functorch, "unwrap_if_dead")
    assert ops._eager_apply() == ops.EagerLayerStep.apply
    results = []
    for step in (ops._eager_apply(), ops._eager_layer_step):
        monkeypatch.setattr(ops, "_eager_layer_step", step)
        layer, leaf = bag.BatchNorm(3), x.clone().requires_grad_()
        y = layer(leaf)
        y.backward(dy)
        results.append((y.detach(), leaf.grad, layer.weight.grad, layer.running_mean))
    for u, v in zip(*results):
        assert torch.equal(u, v)
