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
(a plain batch norm), else a key from `group_key` (operators take strings, not groups); the
forward then runs in two phases with the sums all-reduced in between, as the backward does.
`num_threads` None means torch's own thread count (torch.get_num_threads()).
`relu`: y = max(bn(x), 0); the backward then takes y itself as `relu_out` and masks the
gradient with it.
"""
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._arrays import PARAMS, PARAMS_FROM_SUMS, backward, forward
from ._onednn_graph import FORWARD, batchnorm_training_backward
from ._two_phase import TWO_PHASE, forward_apply, forward_reduce
from ._engine import RECENTRE

STORAGE = (torch.float32, torch.float16, torch.bfloat16)


# ---- zero-copy views ---------------------------------------------------------------------

def np_view(t):
    """A NumPy view of a CPU tensor's memory, no copy (bfloat16 through an int16 view).
    tensor.numpy() shares the memory as DLPack does, at a third of the cost per call.  A
    tensor with the negative or conjugate bit is read as its values (a copy), as the array
    front-ends read it; the tensors the operators write are their own, never such views."""
    t = t.detach()
    if t.is_neg() or t.is_conj():
        t = t.resolve_conj().resolve_neg()
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


# ---- threads -----------------------------------------------------------------------------

def threads(num_threads):
    """A layer's thread count: its own, else torch's (what a torch user sets and expects)."""
    return torch.get_num_threads() if num_threads is None else num_threads


# ---- statistics across ranks ----------------------------------------------------------------

def _all_reduce(arrays, group):
    """Every rank's float64 / int64 NumPy arrays summed in place over `group` (all in flight at
    once); every rank gets the same bits."""
    from .distributed import _check_group
    _, dist = _check_group(group)
    pending = [dist.all_reduce(torch.from_numpy(a), group=group, async_op=True) for a in arrays]
    for p in pending:
        p.wait()


def _sync_sums(xs, data_format, channels, group, num_threads):
    """The global forward sums of a process group: around 0 first, then - on every rank alike,
    since they decide from the same global sums - around the global mean where the first ones
    cancel too much.  Returns (shift, sums, count)."""
    shift = np.zeros(channels, np.float32)
    for _ in range(2):
        sums, local = forward_reduce(xs, shift, data_format=data_format,
                                     num_threads=num_threads)
        count = np.array([local], np.int64)
        _all_reduce([sums, count], group)
        total = int(count[0])
        if total <= 1:      # the same on every rank: all of them raise
            raise ValueError(f"expected more than 1 value per channel when training, got "
                             f"{total} over the process group")
        off = sums[0] / total
        far = off * off > RECENTRE * np.maximum((sums[1] - sums[0] * off) / total, 0.0)
        if not far.any():
            break
        shift = np.where(far, (shift + off).astype(np.float32), shift)
    return shift, sums, total


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
    """Training-mode batch norm of (N, C, *) by the engine's forward: y (ReLU applied when
    relu), the batch mean and biased variance (float32) and the element count per channel
    (int64, all ranks of the group)."""
    _check_params(x, weight, bias)
    perm, data_format = channel_order(x)
    channels = x.shape[1]
    y = torch.empty_like(x)
    mean = torch.empty(channels, dtype=torch.float32)
    var = torch.empty_like(mean)
    running = np.empty((2, channels), np.float32)     # the operator's, dropped (below)
    xs = np_view(x.permute(perm))
    out = (np_view(y.permute(perm)), running[0], running[1], np_view(mean), np_view(var))
    gamma, beta = (None if p is None else np_view(_f32(p)) for p in (weight, bias))
    nt = threads(num_threads)
    if group:
        shift, sums, count = _sync_sums(xs, data_format, channels, _group(group), nt)
        forward_apply(xs, shift, gamma, beta, sums, count, epsilon=eps,
                      data_format=data_format, relu=relu, out=out, num_threads=nt)
    else:
        count = x.numel() // channels if channels else 0
        if count == 0:
            raise ValueError("batch norm in training mode needs at least one value per "
                             f"channel; got input of shape {tuple(x.shape)}")
        # the layer keeps its own running statistics (PyTorch's momentum, unbiased variance):
        # the operator's old ones are placeholders, its new ones (momentum 0) are dropped
        placeholder = np.zeros(channels, np.float32)
        forward(FORWARD, xs, placeholder, placeholder, gamma, beta, eps, 0.0, data_format, relu,
                out, nt)
    return y, mean, var, torch.tensor(count, dtype=torch.int64)


batch_norm_train = torch.library.custom_op("bnbw_native::batch_norm_train", forward_impl,
                                           mutates_args=())


@batch_norm_train.register_fake
def _(x, weight, bias, eps, relu, group, num_threads):
    _check_params(x, weight, bias)
    mean = x.new_empty(x.shape[1], dtype=torch.float32)
    return torch.empty_like(x), mean, torch.empty_like(mean), x.new_empty((), dtype=torch.int64)


# ---- backward ----------------------------------------------------------------------------

def backward_impl(grad_y: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor,
                  var: Tensor, relu_out: Optional[Tensor], eps: float, group: str,
                  num_threads: Optional[int], input_grad: bool
                  ) -> Tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_weight, grad_bias) of batch_norm_train; grad_x is empty unless
    input_grad.  The parameter gradients are this rank's (float32, whatever weight's type).
    With relu_out (the layer's output), the engine masks the gradient with it in both
    passes."""
    perm, data_format = channel_order(x)
    channels = x.shape[1]
    relu_dst = None if relu_out is None else np_view(relu_out.permute(perm))
    xs, dys = np_view(x.permute(perm)), np_view(grad_y.permute(perm))
    stats = np_view(mean), np_view(var)
    gamma = None if weight is None else np_view(_f32(weight))
    nt = threads(num_threads)
    dgamma = torch.empty(channels, dtype=torch.float32)
    dbeta = torch.empty_like(dgamma)
    params = (np_view(dgamma), np_view(dbeta))
    if not input_grad:
        # parameters only: the sums and their coefficients, no dx pass
        backward(TWO_PHASE, PARAMS, xs, dys, *stats, gamma, eps, data_format, params, nt,
                 relu_dst=relu_dst)
        return x.new_empty(0), dgamma, dbeta
    dx = torch.empty_like(x)
    out = (np_view(dx.permute(perm)), *params)
    if group:
        from .distributed import _torch_sync
        _, local = _torch_sync(xs, dys, *stats, gamma, epsilon=eps, group=_group(group),
                               out=out, keep_local=True, data_format=data_format,
                               num_threads=nt, relu_dst=relu_dst)
        # DistributedDataParallel averages parameter gradients: this rank's, from its sums
        backward(TWO_PHASE, PARAMS_FROM_SUMS, xs, dys, *stats, gamma, eps, data_format, params,
                 nt, relu_dst=relu_dst, partial=local, count=x.numel() // channels)
    else:
        batchnorm_training_backward(xs, dys, *stats, gamma, epsilon=eps, out=out,
                                    data_format=data_format, num_threads=nt, relu_dst=relu_dst)
    return dx, dgamma, dbeta


batch_norm_train_backward = torch.library.custom_op("bnbw_native::batch_norm_train_backward",
                                                    backward_impl, mutates_args=())


@batch_norm_train_backward.register_fake
def _(grad_y, x, weight, mean, var, relu_out, eps, group, num_threads, input_grad):
    dx = torch.empty_like(x) if input_grad else x.new_empty(0)
    dgamma = x.new_empty(x.shape[1], dtype=torch.float32)
    return dx, dgamma, torch.empty_like(dgamma)


# ---- vmap ----------------------------------------------------------------------------------

def _vmap_by_loop(op):
    """A vmap rule for `op`: one call per batch entry, outputs stacked on dim 0.  Each entry is
    a batch norm of its own (what torch's BatchNorm2d computes under vmap); the batched dims
    of the inputs go to the front first."""
    def rule(info, in_dims, *args):
        batched = [a.movedim(d, 0) if d is not None else a for a, d in zip(args, in_dims)]
        results = [op(*(a[b] if d is not None else a for a, d in zip(batched, in_dims)))
                   for b in range(info.batch_size)]
        outputs = tuple(torch.stack(parts) for parts in zip(*results))
        return outputs, (0,) * len(outputs)
    return rule


batch_norm_train.register_vmap(_vmap_by_loop(torch.ops.bnbw_native.batch_norm_train))
batch_norm_train_backward.register_vmap(
    _vmap_by_loop(torch.ops.bnbw_native.batch_norm_train_backward))


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
    wrapper has no setup_context in this PyTorch, which they require.  vmap runs the
    operators' own rule (one batch norm per entry)."""

    generate_vmap_rule = True

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
