"""The implementations timed beside ours: the package's float64 reference, a float32 NumPy
backward and forward (what a NumPy user writes), PyTorch's own kernels (optional), the same ops
compiled by torch.compile (optional), and, for the fused ReLU rows, PyTorch's ReLU backward
followed by our unfused call.  oneDNN is in onednn_peer.py."""
import numpy as np

from bnbw_native import reference as _reference

from cases import EPSILON, MOMENTUM

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

try:
    import torch
except ImportError:      # torch columns are skipped with a note
    torch = None

reference = _reference.batchnorm_training_backward
reference_forward = _reference.batchnorm_training_forward
REFERENCE_NAME = "bnbw_native.reference"


def numpy_f32_backward(x, dy, mean, var, gamma, epsilon, data_format, num_outputs,
                       relu_dst=None):
    """Batch-norm backward the way a NumPy user writes it: float32, vectorised (ReLU's
    backward first, as its own pass, when `relu_dst` is given)."""
    axis = 1 if data_format == "NCX" else x.ndim - 1
    red = tuple(d for d in range(x.ndim) if d != axis)
    bshape = [1] * x.ndim
    bshape[axis] = -1
    x32 = x.astype(np.float32, copy=False)
    dy32 = dy.astype(np.float32, copy=False)
    if relu_dst is not None:
        dy32 = np.where(relu_dst > 0, dy32, np.float32(0))
    r = (1 / np.sqrt(var + np.float32(epsilon))).astype(np.float32)
    if num_outputs == 1:
        dx = dy32 * r.reshape(bshape)
        return dx.astype(x.dtype, copy=False), None, None
    M = x.size // x.shape[axis]
    xm = x32 - mean.reshape(bshape)
    dbeta = dy32.sum(axis=red)
    dgamma = (xm * dy32).sum(axis=red) * r
    g = gamma if gamma is not None else np.ones_like(r)
    dx = (g * r).reshape(bshape) * (dy32 - (dbeta / M).reshape(bshape)
                                    - xm * (r * dgamma / M).reshape(bshape))
    return dx.astype(x.dtype, copy=False), dgamma, dbeta


def numpy_f32_forward(x, run_mean, run_var, gamma, beta, epsilon, momentum, data_format, relu):
    """Batch-norm training forward the way a NumPy user writes it: float32, vectorised, the
    biased variance, running statistics with `momentum` weighing the old ones (ours)."""
    axis = 1 if data_format == "NCX" else x.ndim - 1
    red = tuple(d for d in range(x.ndim) if d != axis)
    bshape = [1] * x.ndim
    bshape[axis] = -1
    x32 = x.astype(np.float32, copy=False)
    mean = x32.mean(axis=red)
    xm = x32 - mean.reshape(bshape)
    var = np.square(xm).mean(axis=red)
    k = gamma / np.sqrt(var + np.float32(epsilon))
    y = xm * k.reshape(bshape) + beta.reshape(bshape)
    if relu:
        np.maximum(y, 0, out=y)
    m = np.float32(momentum)
    return (y.astype(x.dtype, copy=False), m * run_mean + (1 - m) * mean,
            m * run_var + (1 - m) * var, mean, var)


def torch_view(arr):
    """A torch tensor viewing `arr` (bf16 through its 16-bit patterns)."""
    if ml_dtypes is not None and arr.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def torch_to_numpy(t, dtype):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dtype)
    return t.numpy()


def torch_inputs(arrays, layout):
    """Logical NCX torch views of the layout's arrays (no copies)."""
    out = []
    for arr in arrays:
        t = torch_view(arr)
        if layout == "NXC":
            order = (0, arr.ndim - 1) + tuple(range(1, arr.ndim - 1))
            t = t.permute(*order)
            fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(arr.ndim)
            if fmt is not None:
                t = t.contiguous(memory_format=fmt)
        assert t.data_ptr() == arr.ctypes.data, "torch copied"
        out.append(t)
    return out


def from_torch(t, dtype, layout):
    """A torch result (logical NCX) as a NumPy array arranged like `layout`'s arrays."""
    if layout == "NXC":
        t = t.permute(0, *range(2, t.dim()), 1)
    return torch_to_numpy(t.contiguous(), dtype)


def torch_call(X, DY, problem, num_outputs, Y=None, grad_buf=None):
    """aten.native_batch_norm_backward on the views X, DY, as a callable returning its
    (dx, dgamma, dbeta).  With Y (the forward's output), ReLU's backward first, as PyTorch runs
    a BatchNorm followed by ReLU: aten.threshold_backward, a new tensor, or with `grad_buf`
    (laid out like DY) threshold_backward.grad_input into that buffer, which it fills in place.
    The batch-norm op itself always allocates its outputs (its .out overload is generated from
    it: it allocates as well, then copies): the runner gives it reused blocks instead
    (torch_cache.py)."""
    aten = torch.ops.aten
    mean = torch.from_numpy(problem["mean"])
    var = torch.from_numpy(problem["var"])
    if Y is None:
        grad = lambda: DY  # noqa: E731
    elif grad_buf is None:
        grad = lambda: aten.threshold_backward(DY, Y, 0)  # noqa: E731
    else:
        grad = lambda: aten.threshold_backward.grad_input(  # noqa: E731
            DY, Y, 0, grad_input=grad_buf)
    if num_outputs == 3:
        weight = torch.from_numpy(problem["gamma"])
        invstd = torch.from_numpy(
            (1 / np.sqrt(problem["var"] + np.float32(EPSILON))).astype(np.float32))
        mask = [True, True, True]
        return lambda: aten.native_batch_norm_backward(grad(), X, weight, None, None, mean,
                                                       invstd, True, EPSILON, mask)
    # frozen: eval mode with the statistics as running stats, gamma ignored as ours does
    mask = [True, False, False]
    return lambda: aten.native_batch_norm_backward(grad(), X, None, mean, var, None, None, False,
                                                   EPSILON, mask)


def torch_result(t, x, layout, num_outputs):
    """torch's (dx, dgamma, dbeta) as NumPy arrays, dx arranged like `layout`'s arrays."""
    dx = from_torch(t[0], x.dtype, layout)
    if num_outputs == 3:
        return dx, t[1].numpy(), t[2].numpy()
    return dx, None, None


def torch_forward_call(X, problem, relu):
    """aten.native_batch_norm in training mode on the view X, as a callable returning its
    (y, save_mean, save_invstd); with `relu`, torch.relu_ on y in place afterwards, as
    BatchNorm2d followed by ReLU(inplace=True) runs.  torch's running statistics (tensors of
    their own, updated in place on every call) take momentum 1 - MOMENTUM, the same update as
    ours, but torch keeps the unbiased variance there: they are not compared.  The op
    allocates y (the runner gives it reused blocks for the fair column, torch_cache.py)."""
    aten = torch.ops.aten
    weight = torch.from_numpy(problem["gamma"])
    bias = torch.from_numpy(problem["beta"])
    run_mean = torch.from_numpy(problem["run_mean"].copy())
    run_var = torch.from_numpy(problem["run_var"].copy())
    momentum = 1 - MOMENTUM

    def call():
        result = aten.native_batch_norm(X, weight, bias, run_mean, run_var, True, momentum,
                                        EPSILON)
        if relu:
            torch.relu_(result[0])
        return result
    return call


def torch_forward_result(t, x, layout):
    """torch's forward as (dst, None, None, batch_mean, batch_variance) NumPy arrays, dst
    arranged like `layout`'s arrays, the variance from save_invstd in float64.  The statistics
    are float32 from eager torch; torch.compile's gives them in x's dtype (f16, bf16 too)."""
    dst = from_torch(t[0], x.dtype, layout)
    invstd = t[2].double().numpy()
    return (dst, None, None, t[1].float().numpy(),
            1 / (invstd * invstd) - float(np.float32(EPSILON)))


def compile_unavailable():
    """Why the torch-compiled column cannot run in this process, or None."""
    if torch is None:
        return "torch is not importable"
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    from torch import _dynamo
    try:
        _dynamo.eval_frame.check_if_dynamo_supported()
    except Exception as exc:      # its message says which platform or Python is missing
        return f"torch.compile is not supported here: {exc}"
    return None


def compiled_now(graph, args):
    """torch.compile(graph) with the default (inductor) backend, compiled by a first call on
    `args`, as a callable without arguments that calls it on them again.

    Called inside the row's thread limit, before the timing: inductor writes its C++ loops for
    torch.get_num_threads() at compile time (serial code for one thread).  dynamo is reset
    first: it keeps what it compiled on graph's code object, at most 8 variants
    (config.recompile_limit), and past them runs the function eagerly with no more than a
    warning in the log; reset, every case and thread count gets code of its own and the
    previous cases' is freed.  dynamic=False: the row's sizes and strides are constants of the
    code, as they are of every call; fullgraph=True: a graph break would leave part of the work
    to eager torch, so it fails the compilation instead."""
    from torch import _dynamo
    _dynamo.reset()
    compiled = torch.compile(graph, dynamic=False, fullgraph=True)
    compiled(*args)
    return lambda: compiled(*args)


def torch_compiled_call(X, DY, problem, num_outputs, Y=None):
    """The torch-compiled peer's backward, compiled now (`compiled_now`): the op of
    `torch_call` - aten.native_batch_norm_backward on the views X, DY with the row's saved
    statistics, after ReLU's aten.threshold_backward when Y is given (inductor fuses the two)
    - in a function of tensors handed to torch.compile, as a callable returning
    (dx, dgamma, dbeta).

    The backward op is compiled on its own because it is what a compiled training step runs
    for a batch norm's backward: AOTAutograd's backward graph of a training-mode batch norm is
    this op, and inductor makes the same C++ kernel of it either way (the per-channel sums,
    then the dx loop: the generated code compared, torch 2.13, f32 NCX), while the row times a
    backward from saved statistics, as ours and every peer do.  Compiling the forward and
    calling backward on its output would add autograd's bookkeeping on a retained graph and
    differentiate inductor's own batch statistics instead of the row's; torch.autograd.grad
    inside the compiled function is a graph break (dynamo's trace_autograd_ops is off by
    default), which comes down to the same."""
    aten = torch.ops.aten
    mean = torch.from_numpy(problem["mean"])
    if num_outputs == 1:       # frozen: eval mode with the statistics as running stats
        var = torch.from_numpy(problem["var"])

        def frozen(dy, x, mean, var):
            return aten.native_batch_norm_backward(dy, x, None, mean, var, None, None, False,
                                                   EPSILON, [True, False, False])
        return compiled_now(frozen, (DY, X, mean, var))
    weight = torch.from_numpy(problem["gamma"])
    invstd = torch.from_numpy(
        (1 / np.sqrt(problem["var"] + np.float32(EPSILON))).astype(np.float32))

    def training(dy, x, weight, mean, invstd, *relu_y):
        grad = aten.threshold_backward(dy, relu_y[0], 0) if relu_y else dy
        return aten.native_batch_norm_backward(grad, x, weight, None, None, mean, invstd, True,
                                               EPSILON, [True, True, True])
    return compiled_now(training, (DY, X, weight, mean, invstd) + (() if Y is None else (Y,)))


def torch_compiled_forward_call(X, problem, relu):
    """The torch-compiled peer's forward, compiled now (`compiled_now`): the op of
    `torch_forward_call` (aten.native_batch_norm in training mode on the view X, its running
    statistics updated in place, momentum 1 - MOMENTUM), then torch.relu with `relu`, which
    inductor fuses into the normalisation loop; a callable returning (y, save_mean,
    save_invstd)."""
    aten = torch.ops.aten
    weight = torch.from_numpy(problem["gamma"])
    bias = torch.from_numpy(problem["beta"])
    run_mean = torch.from_numpy(problem["run_mean"].copy())
    run_var = torch.from_numpy(problem["run_var"].copy())

    def forward(x, weight, bias, run_mean, run_var):
        y, save_mean, save_invstd = aten.native_batch_norm(x, weight, bias, run_mean, run_var,
                                                           True, 1 - MOMENTUM, EPSILON)
        return (torch.relu(y) if relu else y), save_mean, save_invstd
    return compiled_now(forward, (X, weight, bias, run_mean, run_var))
