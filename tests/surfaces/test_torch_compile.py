"""The PyTorch layers as custom operators: torch.compile (aot_eager and inductor), torch.func
and torch.library.opcheck, each against eager mode, torch's own layers or float64.

Every compiled run uses fullgraph=True, so a graph break around the layers (which would run
them eagerly and prove nothing) fails the test, and the fast test also checks that the
operators are in the forward and backward graphs AOTAutograd produced.
"""
import copy

import pytest

torch = pytest.importorskip("torch")
from bnbw_native import _torch_ops  # noqa: E402  (after the importorskip)
from bnbw_native import autograd as bag  # noqa: E402


def rel_err(got, ref):
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max())


def small_net(seed=0):
    """conv-BN-ReLU twice (one ReLU in place), pooled to 3 logits; torch layers."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(inplace=True), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(8, 3))


def step(net, x):
    """Loss, gradients of every parameter, and the buffers after one forward/backward."""
    net.zero_grad()
    loss = net(x).square().mean()
    loss.backward()
    return (loss.detach(), [p.grad.clone() for p in net.parameters()],
            [b.clone() for b in net.buffers()])


def compare(got, want, tol):
    (loss_g, grads_g, bufs_g), (loss_w, grads_w, bufs_w) = got, want
    if tol == 0:
        assert torch.equal(loss_g, loss_w)
        assert all(torch.equal(a, b) for a, b in zip(grads_g, grads_w))
        assert all(torch.equal(a, b) for a, b in zip(bufs_g, bufs_w))
    else:
        assert rel_err(loss_g, loss_w) <= tol
        for a, b in zip(grads_g + bufs_g, grads_w + bufs_w):
            assert rel_err(a, b) <= tol


def recording_backend(graphs):
    """aot_eager that keeps the forward and backward graphs' text."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = graphs.get(kind, "") + gm.code
            return make_boxed_func(gm.forward)
        return compiler
    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


@pytest.mark.parametrize("fuse_relu", [False, True], ids=["BatchNorm", "BatchNormReLU"])
def test_aot_eager_runs_the_operators_and_equals_eager(fuse_relu):
    torch._dynamo.reset()
    eager = bag.convert_batchnorm(small_net(), fuse_relu=fuse_relu)
    assert isinstance(eager[1], bag.BatchNormReLU if fuse_relu else bag.BatchNorm)
    compiled = copy.deepcopy(eager)
    graphs = {}
    fn = torch.compile(compiled, backend=recording_backend(graphs), fullgraph=True)
    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):            # running statistics move: the second step reads them
        compare(step(fn, x), step(eager, x), tol=0)
    assert graphs["forward"].count("bnbw_native.batch_norm_train.default") == 2
    assert graphs["backward"].count("bnbw_native.batch_norm_train_backward.default") == 2


def test_a_cumulative_average_compiles_once_and_equals_eager():
    # momentum None: the factor 1 / num_batches_tracked changes every step; read as a float
    # it became a constant of the graph and every step recompiled (then fell back to eager)
    torch._dynamo.reset()
    eager = bag.convert_batchnorm(small_net(), fuse_relu=True)
    for layer in (eager[1], eager[3]):
        layer.momentum = None
    compiled = copy.deepcopy(eager)
    fn = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(7)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(4):
            x = torch.randn(6, 3, 8, 8, generator=g)
            compare(step(fn, x), step(eager, x), tol=0)
    assert int(compiled[1].num_batches_tracked) == 4


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")   # (the layers' checks)
@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_torch_jit_trace_records_the_operators_and_equals_eager(momentum):
    # the eager path's Python autograd Function cannot be traced ("unordered_map::at");
    # tracing takes the operators, as compiling does
    eager = bag.convert_batchnorm(small_net(), fuse_relu=True)
    for layer in (eager[1], eager[3]):
        layer.momentum = momentum
    g = torch.Generator().manual_seed(8)
    x0 = torch.randn(6, 3, 8, 8, generator=g)
    traced_from = copy.deepcopy(eager)
    traced = torch.jit.trace(traced_from, x0, check_trace=False)
    eager.load_state_dict(traced_from.state_dict())     # the trace ran one training step
    assert str(traced.inlined_graph).count("bnbw_native::batch_norm_train(") == 2
    for _ in range(2):
        x = torch.randn(6, 3, 8, 8, generator=g)
        compare(step(traced, x), step(eager, x), tol=0)
    assert torch.equal(traced_from[1].running_var, eager[1].running_var)


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_torch_jit_script_is_refused_with_a_clear_error():
    model = bag.convert_batchnorm(small_net(), fuse_relu=True)
    with pytest.raises(RuntimeError, match="BatchNormReLU cannot be compiled by torch.jit.script"):
        torch.jit.script(model)


class Block(torch.nn.Module):
    """A residual block as torchvision writes it: ReLU called in forward, `out += x`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.bn2 = torch.nn.BatchNorm2d(4)
        self.relu = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv(x)))
        out = self.bn2(self.conv(out))
        out += x
        return self.relu(out).mean(dim=(2, 3))


def test_aot_eager_of_a_model_fused_in_its_forward_equals_eager():
    # the traced model's BatchNormReLU and BatchNormAddReLU compiled: the operators give
    # eager's bits, the residual's add and its ReLU inside the second (nothing left around
    # it for a compiler to fuse: no add, ReLU or mask of the ReLU in either graph)
    torch._dynamo.reset()
    eager = bag.convert_batchnorm(Block(), fuse_relu=True)
    assert type(eager.bn1) is bag.BatchNormReLU and type(eager.bn2) is bag.BatchNormAddReLU
    compiled = copy.deepcopy(eager)
    graphs = {}
    fn = torch.compile(compiled, backend=recording_backend(graphs), fullgraph=True)
    x = torch.randn(5, 4, 6, 6, generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        compare(step(fn, x), step(eager, x), tol=0)
    assert graphs["forward"].count("bnbw_native.batch_norm_train.default") == 2
    assert graphs["backward"].count("bnbw_native.batch_norm_train_backward.default") == 2
    for op in ("aten.relu", "aten.threshold_backward", "aten.where"):
        assert op not in graphs["forward"] + graphs["backward"], op
    assert graphs["forward"].count("aten.add") == 2        # num_batches_tracked, twice


def test_aot_eager_channels_last_and_dynamic_batch():
    torch._dynamo.reset()
    eager = bag.convert_batchnorm(small_net(1), fuse_relu=True).to(
        memory_format=torch.channels_last)
    compiled = torch.compile(copy.deepcopy(eager), backend="aot_eager", fullgraph=True,
                             dynamic=True)
    g = torch.Generator().manual_seed(2)
    for n in (4, 7, 5):
        x = torch.randn(n, 3, 6, 6, generator=g).contiguous(memory_format=torch.channels_last)
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        compiled(xc).sum().backward()
        eager(xe).sum().backward()
        assert xc.grad.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(xc.grad, xe.grad)
    for a, b in zip(compiled.state_dict().values(), eager.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fuse_relu", [
    pytest.param(False, marks=pytest.mark.slow),      # ~20 s with a cold inductor cache
    True], ids=["BatchNorm", "BatchNormReLU"])
def test_inductor_equals_eager(fuse_relu):
    # inductor generates and compiles C++ for everything around the operators; it must run
    # here (a missing compiler fails the test, not skips it)
    torch._dynamo.reset()
    eager = bag.convert_batchnorm(small_net(2), fuse_relu=fuse_relu)
    compiled = torch.compile(copy.deepcopy(eager), backend="inductor", fullgraph=True)
    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        # the operators give the same bits; inductor's own fused kernels (pooling, loss)
        # round differently from eager
        compare(step(compiled, x), step(eager, x), tol=1e-5)


def test_torch_func_grad_matches_batchnorm2d():
    # functional_call with the buffers passed in, as torch's own BatchNorm2d needs under
    # torch.func; the layers give torch.func.grad the gradient of torch's layers
    from torch.func import functional_call, grad
    x = torch.randn(8, 4, 5, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for ours, ref in ((bag.BatchNorm(4), torch.nn.BatchNorm2d(4)),
                      (bag.BatchNormReLU(4),
                       torch.nn.Sequential(torch.nn.BatchNorm2d(4), torch.nn.ReLU()))):
        with torch.no_grad():
            ours.weight.copy_(torch.linspace(0.5, 1.5, 4))
            ours.bias.copy_(torch.linspace(-0.5, 0.5, 4))
        ref.load_state_dict(ours.state_dict() if isinstance(ref, torch.nn.BatchNorm2d) else
                            {f"0.{k}": v for k, v in ours.state_dict().items()})
        ref = ref.double()

        def loss(module, params, buffers, x):
            y = functional_call(module, (params, buffers), (x,))
            return (y * torch.cos(x)).sum()

        params = dict(ours.named_parameters())
        got = grad(loss, argnums=(1, 3))(ours, params, dict(ours.named_buffers()), x.float())
        want = grad(loss, argnums=(1, 3))(ref, dict(ref.named_parameters()),
                                         dict(ref.named_buffers()), x)
        assert rel_err(got[1], want[1]) <= 1e-6
        for a, b in zip(got[0].values(), want[0].values()):
            assert rel_err(a, b) <= 1e-6


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "channels_last"])
@pytest.mark.parametrize("relu", [False, True], ids=["bn", "bn-relu"])
def test_opcheck(channels_last, relu):
    # schema, fake implementations (shapes, strides, dtypes) and autograd registration
    # against the real operators
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 5, 6, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w, b = torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g)
    running = (torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5)
    args = (x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), *running, 0.1, 1e-5,
            relu, "", None)
    torch.library.opcheck(torch.ops.bnbw_native.batch_norm_train.default, args)
    torch.library.opcheck(torch.ops.bnbw_native.batch_norm_train.default,
                          args[:3] + (None, None) + args[5:])
    torch.library.opcheck(torch.ops.bnbw_native.batch_norm_train.default,   # momentum None
                          args + (None, torch.tensor(3)))
    y, mean, var, *_ = torch.ops.bnbw_native.batch_norm_train(*(a.detach() if torch.is_tensor(a)
                                                                else a for a in args))
    for input_grad in (True, False):
        torch.library.opcheck(torch.ops.bnbw_native.batch_norm_train_backward.default,
                              (torch.randn(y.shape, generator=g), x.detach(), w.detach(),
                               mean, var, y if relu else None, 1e-5, "", None, input_grad))
    if relu:                      # the residual added before the ReLU, and its gradient
        residual = torch.randn(x.shape, generator=g).contiguous(
            memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        torch.library.opcheck(torch.ops.bnbw_native.batch_norm_train.default,
                              args + (residual.requires_grad_(),))
        y = torch.ops.bnbw_native.batch_norm_train(*(a.detach() if torch.is_tensor(a) else a
                                                     for a in args), residual.detach())[0]
        for input_grad in (True, False):
            torch.library.opcheck(torch.ops.bnbw_native.batch_norm_train_backward.default,
                                  (torch.randn(y.shape, generator=g), x.detach(), w.detach(),
                                   mean, var, y, 1e-5, "", None, input_grad, True))


def test_operators_refuse_tensors_off_the_cpu_and_a_count_below_one():
    # a 0-dim meta tensor among CPU ones sent the call to the fake implementation (outputs of
    # empty memory); a count of 0 raised a bare ZeroDivisionError
    x = torch.randn(4, 3, 2, 2)
    w, b, rm, rv = torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3)
    op = torch.ops.bnbw_native.batch_norm_train
    back = torch.ops.bnbw_native.batch_norm_train_backward
    with pytest.raises(ValueError, match=r"batches_tracked must be on x's device \(cpu\), got meta"):
        op(x, w, b, rm, rv, 0.0, 1e-5, False, "", 1, None, torch.tensor(3, device="meta"))
    with pytest.raises(ValueError, match="running_mean must be on x's device"):
        op(x, w, b, rm.to("meta"), rv, 0.1, 1e-5, False, "", 1)
    for count in (torch.tensor(0), torch.tensor(2.0), torch.tensor([1, 2])):
        with pytest.raises(ValueError, match="batches_tracked must be one integer >= 1"):
            op(x, w, b, rm, rv, 0.0, 1e-5, False, "", 1, None, count)
    assert torch.equal(rm, torch.zeros(3)) and torch.equal(rv, torch.ones(3))
    y, mean, var, *_ = op(x, w, b, None, None, 0.0, 1e-5, False, "", 1)
    with pytest.raises(ValueError, match="mean_low must be on x's device"):
        back(torch.ones_like(x), x, w, mean, var, None, 1e-5, "", 1, True, False,
             torch.zeros(3, device="meta"))


def test_operator_autograd_equals_the_layer():
    # the operator's registered autograd formula (direct callers of torch.ops) gives the
    # layer's gradients bit for bit
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 4, 3, 3, generator=g)
    dy = torch.randn(x.shape, generator=g)
    layer = bag.BatchNormReLU(4, track_running_stats=False)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    (layer(x1) * dy).sum().backward()
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    y = torch.ops.bnbw_native.batch_norm_train(x2, w, b, None, None, 0.0, layer.eps, True, "",
                                               None)[0]
    (y * dy).sum().backward()
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(layer.weight.grad, w.grad) and torch.equal(layer.bias.grad, b.grad)


def test_double_backward_is_refused():
    x = torch.randn(6, 3, 4, 4, requires_grad=True)
    y = bag.BatchNorm(3)(x)
    (dx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dx.sum().backward()


@pytest.mark.parametrize("outer", ["x", "w"])
def test_a_second_derivative_through_torch_func_is_refused(outer):
    """grad of grad (over x again, or over a weight of the inner loss): once_differentiable does
    not stop torch.func, whose outer grad would take the gradients for constants (zeros)."""
    from torch.func import grad, vmap
    layer = bag.BatchNorm(8, track_running_stats=False)
    x, w = torch.randn(4, 8, 5, 5), torch.randn(4, 8, 5, 5)

    def inner(x, w):
        return grad(lambda x: (layer(x) ** 3 * w).sum())(x)

    twice = (grad(lambda x: (inner(x, w) * w).sum()) if outer == "x" else
             grad(lambda w: inner(x, w).sum(), argnums=0))
    with pytest.raises(RuntimeError, match="no second derivative"):
        twice(x if outer == "x" else w)
    # one derivative, also under vmap, still runs: torch's float64 layer agrees
    ref = torch.nn.BatchNorm2d(8, track_running_stats=False).double()
    want = grad(lambda x: (ref(x) ** 3 * w.double()).sum())(x.double())
    assert ((inner(x, w).double() - want).norm() / want.norm()) <= 1e-5
    assert vmap(lambda x: inner(x, w))(x.expand(2, *x.shape)).shape == (2, *x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16-stats"])
def test_an_exported_layer_saves_loads_and_runs(dtype):
    import io
    layer = bag.BatchNormReLU(8).to(dtype)
    x = torch.randn(4, 8, 6, 6, dtype=dtype)
    program = torch.export.export(copy.deepcopy(layer), (x,))
    saved = io.BytesIO()
    torch.export.save(program, saved)
    saved.seek(0)
    loaded = torch.export.load(saved).module()
    assert torch.equal(loaded(x), layer(x))
    assert torch.equal(loaded.running_var, layer.running_var)


def test_operators_live_in_the_package_namespace():
    assert torch.ops.bnbw_native.batch_norm_train.default.name() == \
        "bnbw_native::batch_norm_train"
    assert _torch_ops.batch_norm_train._qualname == "bnbw_native::batch_norm_train"


def test_operators_take_any_layout_a_compiler_chooses():
    # inductor lays convolutions' outputs channels-last; without the tag it copies every
    # input of the operators into eager mode's strides and every output back (four passes
    # over each batch norm's tensors per step); the kernels read and write any strides
    if not hasattr(torch.Tag, "flexible_layout"):
        pytest.skip("this torch has no flexible_layout tag")
    for op in (torch.ops.bnbw_native.batch_norm_train.default,
               torch.ops.bnbw_native.batch_norm_train_backward.default):
        assert torch.Tag.flexible_layout in op.tags
