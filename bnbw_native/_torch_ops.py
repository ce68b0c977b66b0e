"""The PyTorch custom operators behind bnbw_native.autograd.

    torch.ops.bnbw_native.batch_norm_train(x, weight, bias, eps, relu, group, num_threads)
        -> (y, mean, variance, count)
    torch.ops.bnbw_native.batch_norm_train_backward(grad_y, x, weight, mean, variance,
        relu_out, eps, group, num_threads, input_grad) -> (grad_x, grad_weight, grad_bias)

Registered with torch.library.custom_op, with fake (meta) implementations and an autograd
formula, so eager mode, torch.compile (the graph holds the operators as opaque calls) and
torch.func transforms all run the same kernels.  The real implementations read x and dy in
place through NumPy views of the tensors' memory and write grad_x straight into the tensor
they return.

`group` names the torch.distributed group whose statistics and sums are merged: "" for none
(a plain batch norm), else a key from `group_key` (operators take strings, not groups).
`relu`: y = max(bn(x), 0); the backward then takes y itself as `relu_out` and masks the
gradient with it.
"""
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._onednn_graph import batchnorm_training_backward
from ._two_phase import backward_reduce

STORAGE = (torch.float32, torch.float16, torch.bfloat16)

# The engine masks the gradient itself (relu_dst=: the layer's output, read in both passes)
# rather than after torch's threshold_backward, which costs a pass and a tensor of its own.
# False: threshold_backward, then the plain kernel writes dx over the masked gradient.
ENGINE_RELU = True


# ---- zero-copy views ---------------------------------------------------------------------

def np_view(t):
    """A NumPy view of a CPU tensor's memory, no copy (bfloat16 through an int16 view).
    tensor.numpy() shares the memory as DLPack does, at a third of the cost per call."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        try:
            import ml_dtypes
        except ImportError as exc:
            raise TypeError("bfloat16 tensors need ml_dtypes: pip install "
                            "'bnbw_native[bf16]'") from exc
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def channel_order(x):
    """(permutation, data_format): the (N, *spatial, C) view for channels-last memory,
    the tensor as it is (channel axis 1) otherwise."""
    ndim = x.dim()
    if ndim > 2 and not x.is_contiguous():
        perm = (0, *range(2, ndim), 1)
        if x.permute(perm).is_contiguous():
            return perm, "NXC"
    return tuple(range(ndim)), "NCX"


# ---- process groups ------------------------------------------------------------------------

_GROUPS = {}
_DEFAULT_GROUP = "default"


def group_key(group):
    """The string the operators carry for a torch.distributed group (None: the default
    group, looked up when the operator runs)."""
    if group is None:
        return _DEFAULT_GROUP
    key = f"pg:{group.group_name}"
    _GROUPS[key] = group
    return key


def _group(key):
    return None if key == _DEFAULT_GROUP else _GROUPS[key]


# ---- statistics --------------------------------------------------------------------------

# One pass gives Sum x and Sum x*x; M2 = Sum x*x - (Sum x)^2 / n then loses about
# log10(mean^2 / var) of float64's 16 digits.  Past this ratio a second pass sums around the
# mean instead (a ratio of 1e4 leaves ~1e-12 relative, far below float32's 6e-8).
_CANCELLATION = 1e4


def _moments(xs, data_format, channels, num_threads):
    """(count, mean, M2 = Sum (x - mean)^2) per channel, float64, from the kernel's sums.

    backward_reduce(x, dy=x, mean=c, exact_sums=True) returns [Sum x, Sum (x - c) * x] with
    exact float64 products and float64 accumulation, for any layout and storage type, without
    copies (the default f32 blocks of f16/bf16 sums would not survive the cancellation)."""
    sums, count = backward_reduce(xs, xs, np.zeros(channels, np.float32),
                                  data_format=data_format, num_threads=num_threads,
                                  exact_sums=True)
    if count == 0:
        return 0, np.zeros(channels), np.zeros(channels)
    total = sums[0]
    mean = total / count
    m2 = sums[1] - total * mean
    if np.any(mean * mean > _CANCELLATION * np.maximum(m2 / count, 0.0)):
        shift = mean.astype(np.float32)
        sums, _ = backward_reduce(xs, xs, shift, data_format=data_format,
                                  num_threads=num_threads, exact_sums=True)
        # Sum (x - c) x = M2 + mean * (Sum x - n c): exact algebra, a small correction
        m2 = sums[1] - mean * (total - count * shift.astype(np.float64))
    return count, mean, np.maximum(m2, 0.0)


def _merge_ranks(count, mean, m2, group):
    """Every rank's (count, mean, M2), merged in rank order in float64 (Chan et al.), so every
    rank gets the same bits; one all_gather of 3*C float64."""
    from .distributed import _check_group
    _, dist = _check_group(group)
    mine = torch.from_numpy(np.stack([np.full_like(mean, count), mean, m2]))
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    parts = [p.numpy() for p in parts]
    total = int(sum(p[0, 0] for p in parts))
    if total == 0:
        return 0, mean, m2
    mu = sum(p[0] * p[1] for p in parts) / total
    return total, mu, sum(p[2] + p[0] * (p[1] - mu) ** 2 for p in parts)


def _check_params(x, weight, bias):
    channels = x.shape[1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.dim() != 1 or p.shape[0] != channels):
            raise ValueError(f"{name} must be 1-D of length {channels} (the input's channels), "
                             f"got shape {tuple(p.shape)}")
        if p is not None and not p.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {p.dtype}")


def _f32(t):
    return None if t is None else t.detach().to(torch.float32)


# ---- forward -----------------------------------------------------------------------------

def forward_impl(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                 relu: bool, group: str, num_threads: Optional[int]
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Training-mode batch norm of (N, C, *): y (ReLU applied when relu), the batch mean and
    biased variance (float32) and the element count per channel (int64, all ranks of the
    group)."""
    _check_params(x, weight, bias)
    perm, data_format = channel_order(x)
    channels = x.shape[1]
    count, mean, m2 = _moments(np_view(x.permute(perm)), data_format, channels, num_threads)
    if group:
        count, mean, m2 = _merge_ranks(count, mean, m2, _group(group))
        if count <= 1:      # the same on every rank: all of them raise
            raise ValueError(f"expected more than 1 value per channel when training, got "
                             f"{count} over the process group")
    if count == 0:
        raise ValueError("batch norm in training mode needs at least one value per channel; "
                         f"got input of shape {tuple(x.shape)}")
    mean = torch.from_numpy(mean.astype(np.float32))
    var = torch.from_numpy((m2 / count).astype(np.float32))
    y = torch.nn.functional.batch_norm(x, mean, var, _f32(weight), _f32(bias), False, 0.0, eps)
    if relu:
        y.relu_()
    return y, mean, var, torch.tensor(count, dtype=torch.int64)


batch_norm_train = torch.library.custom_op("bnbw_native::batch_norm_train", forward_impl,
                                           mutates_args=())


@batch_norm_train.register_fake
def _(x, weight, bias, eps, relu, group, num_threads):
    _check_params(x, weight, bias)
    mean = x.new_empty(x.shape[1], dtype=torch.float32)
    var = torch.empty_like(mean)
    # torch's own batch_norm on fake tensors: the layout the real one gives
    y = torch.nn.functional.batch_norm(x, mean, var, _f32(weight), _f32(bias), False, 0.0, eps)
    return y, mean, var, x.new_empty((), dtype=torch.int64)


# ---- backward ----------------------------------------------------------------------------

def backward_impl(grad_y: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor,
                  var: Tensor, relu_out: Optional[Tensor], eps: float, group: str,
                  num_threads: Optional[int], input_grad: bool
                  ) -> Tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_weight, grad_bias) of batch_norm_train; grad_x is empty unless
    input_grad.  The parameter gradients are this rank's (float32, whatever weight's type)."""
    perm, data_format = channel_order(x)
    channels = x.shape[1]
    relu_dst = None
    if relu_out is not None and not ENGINE_RELU:
        # the masked gradient, laid out like x; the kernel then writes dx over it
        dy = torch.empty_like(x)
        torch.ops.aten.threshold_backward.grad_input(grad_y, relu_out, 0, grad_input=dy)
    else:
        dy = grad_y
        if relu_out is not None:
            relu_dst = np_view(relu_out.permute(perm))
    xs, dys = np_view(x.permute(perm)), np_view(dy.permute(perm))
    stats = np_view(mean), np_view(var)
    gamma = None if weight is None else np_view(_f32(weight))
    kw = dict(data_format=data_format, num_threads=num_threads, relu_dst=relu_dst)
    dgamma = torch.empty(channels, dtype=torch.float32)
    dbeta = torch.empty_like(dgamma)
    if not input_grad:
        # parameters only: their (local) gradients need the sums, not a second pass
        local, _ = backward_reduce(xs, dys, stats[0], **kw)
        _param_grads(local, var, eps, dgamma, dbeta)
        return x.new_empty(0), dgamma, dbeta
    dx = dy if dy is not grad_y else torch.empty_like(x)
    out = (np_view(dx.permute(perm)), np_view(dgamma), np_view(dbeta))
    if group:
        from .distributed import _torch_sync
        _, local = _torch_sync(xs, dys, *stats, gamma, epsilon=eps, group=_group(group),
                               out=out, keep_local=True, **kw)
        _param_grads(local, var, eps, dgamma, dbeta)
    else:
        batchnorm_training_backward(xs, dys, *stats, gamma, epsilon=eps, out=out, **kw)
    return dx, dgamma, dbeta


batch_norm_train_backward = torch.library.custom_op("bnbw_native::batch_norm_train_backward",
                                                    backward_impl, mutates_args=())


@batch_norm_train_backward.register_fake
def _(grad_y, x, weight, mean, var, relu_out, eps, group, num_threads, input_grad):
    dx = torch.empty_like(x) if input_grad else x.new_empty(0)
    dgamma = x.new_empty(x.shape[1], dtype=torch.float32)
    return dx, dgamma, torch.empty_like(dgamma)


def _param_grads(sums, var, eps, dgamma, dbeta):
    """diff_gamma = r * Sum (x - mean) dy and diff_beta = Sum dy from (2, C) float64 sums."""
    r = 1.0 / np.sqrt(np_view(var).astype(np.float64) + float(np.float32(eps)))
    dgamma.copy_(torch.from_numpy(sums[1] * r))
    dbeta.copy_(torch.from_numpy(sums[0]))


# ---- autograd ----------------------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    x, weight, bias, eps, relu, group, num_threads = inputs
    y, mean, var, _ = output
    ctx.save_for_backward(x, weight, mean, var, y if relu else None)
    ctx.eps, ctx.group, ctx.num_threads = eps, group, num_threads
    ctx.param_types = (None if weight is None else weight.dtype,
                       None if bias is None else bias.dtype)
    ctx.mark_non_differentiable(mean, var)


def _grads(ctx, grad_y, backward):
    """The autograd formula: `backward` is the operator, or its implementation in eager mode."""
    x, weight, mean, var, y = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    if not (need_x or need_w or need_b):
        return None, None, None, None, None, None, None
    dx, dgamma, dbeta = backward(grad_y, x, weight, mean, var, y, ctx.eps, ctx.group,
                                 ctx.num_threads, need_x)
    w_type, b_type = ctx.param_types
    return (dx if need_x else None, dgamma.to(w_type) if need_w else None,
            dbeta.to(b_type) if need_b else None, None, None, None, None)


@once_differentiable
def _backward(ctx, grad_y, _mean, _var, _count):
    return _grads(ctx, grad_y, torch.ops.bnbw_native.batch_norm_train_backward)


batch_norm_train.register_autograd(_backward, setup_context=_setup_context)


class BatchNormTrain(torch.autograd.Function):
    """batch_norm_train with the same formula, for torch.func transforms: register_autograd's
    wrapper has no setup_context in this PyTorch, which they require."""

    @staticmethod
    def forward(x, weight, bias, eps, relu, group, num_threads):
        return torch.ops.bnbw_native.batch_norm_train(x, weight, bias, eps, relu, group,
                                                      num_threads)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)


class EagerBatchNormTrain(torch.autograd.Function):
    """The same again for plain eager mode, calling the implementations without the
    dispatcher and the custom-op wrappers (about 60 us less per layer and step)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = forward_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, _mean, _var, _count):
        return _grads(ctx, grad_y, backward_impl)


def train(x, weight, bias, eps, relu, group, num_threads):
    """batch_norm_train with its autograd formula: the operator when compiling (the graph
    holds it), BatchNormTrain under torch.func transforms, EagerBatchNormTrain otherwise."""
    args = (x, weight, bias, eps, relu, group, num_threads)
    if torch.compiler.is_compiling():
        return torch.ops.bnbw_native.batch_norm_train(*args)
    if torch._C._are_functorch_transforms_active():
        return BatchNormTrain.apply(*args)
    return EagerBatchNormTrain.apply(*args)
