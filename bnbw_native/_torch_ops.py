"""The PyTorch custom operators behind bnbw_native.autograd.

    torch.ops.bnbw_native.batch_norm_train(x, weight, bias, running_mean, running_var,
        factor, eps, relu, group, num_threads, residual=None, batches_tracked=None)
        -> (y, mean, variance, count, new_running_mean, new_running_var, mean_low)
    torch.ops.bnbw_native.batch_norm_train_backward(grad_y, x, weight, mean, variance,
        relu_out, eps, group, num_threads, input_grad, residual_grad=False, mean_low=None)
        -> (grad_x, grad_weight, grad_bias, grad_residual)

Registered with torch.library.custom_op, with fake (meta) implementations and an autograd
formula, so eager mode, torch.compile (the graph holds the operators as opaque calls) and
torch.func transforms all run the same kernels and give the same bits.  `mean` is the batch
mean rounded to float32 and `mean_low` the rest of the exact (float64) one; the backward
centres on their sum, so its gradients are as exact at a large mean as at 0 (a float32 mean
alone moved dgamma by up to 1e-3 relative at a mean of 1e4 standard deviations).  Each pass
is one native call on the tensors themselves (address, sizes, strides): y and grad_x are
written straight into the tensors returned.  In plain eager mode the layers skip the dispatcher and
the custom-op wrappers (EagerLayerStep), about 60 us per layer and step, and
torch.autograd.Function.apply's Python layer (_eager_apply), 3-10 us more.

The new running statistics are PyTorch's update of running_mean and running_var (None: not
tracked, and the new ones are empty): (1 - factor) * old + factor * batch, the variance
unbiased (M / (M - 1)), from the exact batch statistics in float64, rounded once: without a
group in the forward's native call, with one from the all-reduced sums by the same rule
(_engine.torch_running_statistics).  With batches_tracked (torch's momentum None, a
cumulative average) the factor is 1 / batches_tracked, read when the operator runs: a compiled
graph would otherwise hold the count as a constant and recompile at every step.  The operator is
functional (autograd formulas need that) and the layer stores them; EagerLayerStep has the
kernel write them in place, the same bits.

`group` names the torch.distributed group whose statistics and sums are merged: "" for none
(a plain batch norm), else a key from `group_key` (operators take strings, not groups); the
forward then runs in two phases with the sums all-reduced in between, as the backward does.
`num_threads` None means torch's own thread count (torch.get_num_threads()).
`relu`: y = max(bn(x), 0); the backward then takes y itself as `relu_out` and masks the
gradient with it.  `residual` (with relu, no group): y = max(bn(x) + residual, 0), the add in
the pass that writes y (torchvision's residual block's end, inside the operator so that a
compiler has nothing left to fuse around it); the backward's `residual_grad` asks for the
residual's gradient, the masked one, written in the pass that writes grad_x (else it is
empty, as grad_x is unless input_grad).
"""
import inspect
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._arrays import (PARAMS, PARAMS_FROM_SUMS, TRAINING, backward, forward,
                      register_tensor_types)
from ._onednn_graph import FORWARD, GRAPH
from ._relayout import transpose_samples
from ._two_phase import TWO_PHASE, forward_apply, forward_reduce
from ._engine import recentred_shifts, torch_running_statistics

STORAGE = (torch.float32, torch.float16, torch.bfloat16)

# tensors of these types reach the kernels as they are: address, sizes, strides
register_tensor_types((torch.Tensor, torch.nn.Parameter),
                      {torch.float32: "float32", torch.float16: "float16",
                       torch.bfloat16: "bfloat16"}, torch.strided)


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
        moved = recentred_shifts(shift, sums, total)
        if moved is None:
            break
        shift = moved
    return shift, sums, total


def _check_residual(x, relu, group, residual):
    """A residual is added before the ReLU of a plain (ungrouped) batch norm, one of x's shape
    and type."""
    if residual is None:
        return
    if not relu or group:
        raise ValueError("a residual is added before the ReLU: it needs relu=True and no group")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must have the input's shape {tuple(x.shape)} and type "
                         f"{x.dtype}, got {tuple(residual.shape)} {residual.dtype}")


def _check_params(x, weight, bias):
    channels = x.shape[1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.dim() != 1 or p.shape[0] != channels):
            raise ValueError(f"{name} must be 1-D of length {channels} (the input's channels), "
                             f"got shape {tuple(p.shape)}")
        if p is not None and not p.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {p.dtype}")


def _check_device(x, **tensors):
    """Every tensor argument of an operator on x's device: a 0-dim meta tensor among CPU ones
    sends the call to the fake implementation, whose outputs are empty CPU memory."""
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device ({x.device}), got {t.device}")


def _cumulative_factor(batches_tracked):
    """1 / batches_tracked: the cumulative average's weight of the batch (momentum None)."""
    if (batches_tracked.numel() != 1 or batches_tracked.dtype.is_floating_point
            or batches_tracked.dtype == torch.bool or int(batches_tracked) < 1):
        raise ValueError("batches_tracked must be one integer >= 1 (the batches seen, this "
                         f"one included), got {batches_tracked!r}")
    return 1.0 / float(batches_tracked)


def _f32(p):
    """A parameter as the kernels read it: float32 (the layers keep theirs in float32)."""
    return p if p is None or p.dtype == torch.float32 else p.detach().to(torch.float32)


# ---- forward -----------------------------------------------------------------------------

def _forward(x, weight, bias, running, factor, eps, relu, group, num_threads, updated=None,
             residual=None, numpy_statistics=False):
    """(y, batch mean, biased batch variance, element count per channel, the batch mean's low
    part) of a training batch norm; with `running` (running_mean, running_var), their update
    written to `updated` (the same tensors: in place).  residual (relu, no group; x's shape,
    type and strides): y = max(bn(x) + residual, 0) in the pass that writes y.
    numpy_statistics: the three statistics as NumPy arrays, not tensors (no group), for a caller
    that keeps them for its own backward: a tensor costs about 1 us more to make and to read."""
    channels = x.shape[1]
    nt = threads(num_threads)
    if group:
        return _sync_forward(x, weight, bias, running, factor, eps, relu, group, nt, updated)
    count = x.numel() // channels if channels else 0
    if count == 0:
        raise ValueError("batch norm in training mode needs at least one value per "
                         f"channel; got input of shape {tuple(x.shape)}")
    y = torch.empty_like(x)
    if numpy_statistics:
        mean, var, mean_low = (np.empty(channels, np.float32) for _ in range(3))
    else:
        mean = torch.empty(channels, dtype=torch.float32)
        var = torch.empty_like(mean)
        mean_low = torch.empty_like(mean)
    if running is None:       # the old statistics are placeholders, the new ones dropped
        old = np.zeros(channels, np.float32)
        running, updated = (old, old), (np.empty_like(old), np.empty_like(old))
    forward(FORWARD, x, *running, _f32(weight), _f32(bias), eps, factor, "NCX", relu,
            (y, *updated, mean, var), nt, torch_running=True, tensors=True, residual=residual,
            mean_low=mean_low)
    return y, mean, var, count, mean_low


def _sync_forward(x, weight, bias, running, factor, eps, relu, group, nt, updated):
    """_forward over a process group: the sums all-reduced between the two phases; the running
    statistics from the global sums by the rule one process follows."""
    perm, data_format = channel_order(x)
    channels = x.shape[1]
    y = torch.empty_like(x)
    mean = torch.empty(channels, dtype=torch.float32)
    var = torch.empty_like(mean)
    mean_low = torch.empty_like(mean)
    dropped = np.empty((2, channels), np.float32)     # the two-phase apply's running outputs
    xs = np_view(x.permute(perm))
    out = (np_view(y.permute(perm)), dropped[0], dropped[1], np_view(mean), np_view(var))
    gamma, beta = (None if p is None else np_view(_f32(p)) for p in (weight, bias))
    shift, sums, count = _sync_sums(xs, data_format, channels, _group(group), nt)
    forward_apply(xs, shift, gamma, beta, sums, count, epsilon=eps, data_format=data_format,
                  relu=relu, out=out, num_threads=nt, mean_low=np_view(mean_low))
    if running is not None:
        old = [r.detach().to(torch.float32).double().numpy() for r in running]
        new = torch.from_numpy(torch_running_statistics(shift, sums, count, *old, factor))
        with torch.no_grad():
            updated[0].copy_(new[0])
            updated[1].copy_(new[1])
    return y, mean, var, count, mean_low


def _running(running_mean, running_var):
    return None if running_mean is None else (running_mean, running_var)


def _forward_added(x, weight, bias, running, factor, eps, relu, group, num_threads, updated,
                   residual, numpy_statistics=False):
    """_forward, then - with a residual (relu, no group) - max(y + residual, 0): in the pass
    that writes y when the residual can be read in x's layout (copied into it first if x is
    dense), else as torch ops after it."""
    fused = None if residual is None else _in_layout_of(x, residual, num_threads)
    if fused is not None and not _laid_out_like(x, fused):
        fused = None                  # (x not dense, the residual laid out otherwise)
    y, mean, var, count, mean_low = _forward(x, weight, bias, running, factor, eps,
                                             relu and (residual is None or fused is not None),
                                             group, num_threads, updated, fused,
                                             numpy_statistics)
    if residual is not None and fused is None:
        y.add_(residual).relu_()
    return y, mean, var, count, mean_low


def forward_impl(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                 running_mean: Optional[Tensor], running_var: Optional[Tensor], factor: float,
                 eps: float, relu: bool, group: str, num_threads: Optional[int],
                 residual: Optional[Tensor] = None, batches_tracked: Optional[Tensor] = None
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Training-mode batch norm of (N, C, *) by the engine's forward: y (ReLU applied when
    relu, after adding the residual when one is given), the batch mean and biased variance
    (float32), the element count per channel (int64, all ranks of the group), the new
    running statistics (empty when not tracked) and the batch mean's low part."""
    _check_params(x, weight, bias)
    _check_residual(x, relu, group, residual)
    _check_device(x, weight=weight, bias=bias, running_mean=running_mean,
                  running_var=running_var, residual=residual, batches_tracked=batches_tracked)
    if batches_tracked is not None and running_mean is not None:
        factor = _cumulative_factor(batches_tracked)
    running = _running(running_mean, running_var)
    updated = None if running is None else (torch.empty_like(running[0]),
                                            torch.empty_like(running[1]))
    y, mean, var, count, mean_low = _forward_added(x, weight, bias, running, factor, eps, relu,
                                                   group, num_threads, updated, residual)
    if updated is None:
        updated = (mean.new_empty(0), mean.new_empty(0))
    return y, mean, var, torch.tensor(count, dtype=torch.int64), *updated, mean_low


# The operators read and write any strides (y and grad_x take x's layout), so a compiler may
# hand them tensors in the layout it chose (inductor lays convolutions' outputs channels-last):
# without the tag it copies every input into the strides of eager mode and every output back.
_ANY_LAYOUT = ({"tags": (torch.Tag.flexible_layout,)}
               if hasattr(torch.Tag, "flexible_layout")
               and "tags" in inspect.signature(torch.library.custom_op).parameters else {})

batch_norm_train = torch.library.custom_op("bnbw_native::batch_norm_train", forward_impl,
                                           mutates_args=(), **_ANY_LAYOUT)


@batch_norm_train.register_fake
def _(x, weight, bias, running_mean, running_var, factor, eps, relu, group, num_threads,
      residual=None, batches_tracked=None):
    _check_params(x, weight, bias)
    _check_residual(x, relu, group, residual)
    _check_device(x, weight=weight, bias=bias, running_mean=running_mean,
                  running_var=running_var, residual=residual, batches_tracked=batches_tracked)
    mean = x.new_empty(x.shape[1], dtype=torch.float32)
    new = ((mean.new_empty(0), mean.new_empty(0)) if running_mean is None else
           (torch.empty_like(running_mean), torch.empty_like(running_var)))
    return (torch.empty_like(x), mean, torch.empty_like(mean),
            x.new_empty((), dtype=torch.int64), *new, torch.empty_like(mean))


# ---- backward ----------------------------------------------------------------------------

def backward_impl(grad_y: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor,
                  var: Tensor, relu_out: Optional[Tensor], eps: float, group: str,
                  num_threads: Optional[int], input_grad: bool, residual_grad: bool = False,
                  mean_low: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_x, grad_weight, grad_bias, grad_residual) of batch_norm_train; grad_x is empty
    unless input_grad, grad_residual unless residual_grad (relu_out given, no group).  The
    parameter gradients are this rank's (float32, whatever weight's type).  With relu_out
    (the layer's output), the engine masks the gradient with it in both passes.  Without a
    group: one native call on the tensors' own memory."""
    _check_device(x, grad_y=grad_y, weight=weight, mean=mean, var=var, relu_out=relu_out,
                  mean_low=mean_low)
    dx, dgamma, dbeta, d_res = _backward_grads(grad_y, x, weight, mean, var, relu_out, eps,
                                               group, num_threads, input_grad, residual_grad,
                                               mean_low)
    return dx, dgamma, dbeta, x.new_empty(0) if d_res is None else d_res


def _backward_grads(grad_y, x, weight, mean, var, relu_out, eps, group, num_threads, input_grad,
                    residual_grad, mean_low=None):
    """backward_impl's gradients, grad_residual None unless residual_grad (the eager layers
    take them so, without the operator's placeholder)."""
    if residual_grad and (relu_out is None or group):
        raise ValueError("the residual's gradient needs relu_out and no group")
    # (in the layout _backward_pass reads grad_y in)
    d_res = torch.empty_like(x, dtype=grad_y.dtype) if residual_grad else None
    dx, dgamma, dbeta = _backward_pass(grad_y, x, weight, mean, var, relu_out, eps, group,
                                       num_threads, input_grad, d_res, mean_low)
    return dx, dgamma, dbeta, d_res


def _laid_out_like(x, t):
    """Whether t has x's strides on every dim of size > 1 (t of x's shape)."""
    return t.stride() == x.stride() or all(
        a == b or n == 1 for a, b, n in zip(t.stride(), x.stride(), x.shape))


def _in_layout_of(x, grad_y, num_threads=None):
    """grad_y (or a residual), copied into x's layout when x is dense and grad_y is laid out
    otherwise.  The kernels visit x and dy in one order, so a gradient in another layout (the
    one an average pool hands back to a channels-last model) would be read strided in both
    passes: measured 4-6x slower than this one copy (docs/benchmark-history.md, 5d)."""
    if grad_y.shape != x.shape or _laid_out_like(x, grad_y):
        return grad_y
    if not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)
            or x.is_contiguous(memory_format=torch.channels_last_3d)):
        return grad_y
    out = torch.empty_like(x, dtype=grad_y.dtype)
    if not _transposed(grad_y, out, num_threads):
        out.copy_(grad_y)
    return out


_TILE_BLOCK_BYTES = 16      # the tiles' vector blocks: one 16-byte register a row


def _transposed(src, dst, num_threads):
    """Whether src was copied into dst (src's shape and dtype) by tiles: one of them dense
    channel-first, the other dense channel-last, of 2- or 4-byte elements, src's rows (a
    plane, or the channels) at least one 16-byte block long.  torch's copy_ moves that
    transposition element by element: (32, 64, 32, 32) float32 took 5.9 ms on one thread
    against 1.6 ms by tiles.  Shorter rows leave the tiles nothing but single elements, where
    copy_ was as fast or faster: bfloat16 2 x 2 planes 75 against 114 us (docs/
    benchmark-history.md, 6b, 6c)."""
    last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(src.dim())
    if (last is None or src.dtype != dst.dtype or src.element_size() not in (2, 4)
            or src.numel() == 0 or src.device.type != "cpu" or dst.device.type != "cpu"):
        return False
    samples, channels = src.shape[0], src.shape[1]
    plane = src.numel() // (samples * channels)
    if src.is_contiguous() and dst.is_contiguous(memory_format=last):
        rows, cols = channels, plane
    elif src.is_contiguous(memory_format=last) and dst.is_contiguous():
        rows, cols = plane, channels
    else:
        return False
    if cols * src.element_size() < _TILE_BLOCK_BYTES:
        return False
    transpose_samples(src.data_ptr(), dst.data_ptr(), samples, rows, cols, src.element_size(),
                      threads(num_threads))
    return True


def _backward_pass(grad_y, x, weight, mean, var, relu_out, eps, group, num_threads, input_grad,
                   residual_grad=None, mean_low=None):
    """backward_impl; with residual_grad (a tensor like grad_y; no group) the masked gradient
    - the gradient of a residual added before the ReLU - is written there too.  mean_low: the
    mean's low part, the backward centring on mean + mean_low."""
    grad_y = _in_layout_of(x, grad_y, num_threads)
    channels = x.shape[1]
    gamma = _f32(weight)
    nt = threads(num_threads)
    dgamma = torch.empty(channels, dtype=torch.float32)
    dbeta = torch.empty_like(dgamma)
    if not input_grad:
        # parameters only: the sums and their coefficients, no dx pass
        backward(TWO_PHASE, PARAMS, x, grad_y, mean, var, gamma, eps, "NCX", (dgamma, dbeta),
                 nt, relu_dst=relu_out, tensors=True, mean_low=mean_low)
        if residual_grad is not None:       # dy where y > 0, else +0, as the kernel writes it
            torch.where(relu_out > 0, grad_y, grad_y.new_zeros(()), out=residual_grad)
        return x.new_empty(0), dgamma, dbeta
    dx = torch.empty_like(x)
    if not group:
        backward(GRAPH, TRAINING, x, grad_y, mean, var, gamma, eps, "NCX", (dx, dgamma, dbeta),
                 nt, relu_dst=relu_out, diff_residual=residual_grad, tensors=True,
                 mean_low=mean_low)
        return dx, dgamma, dbeta
    from .distributed import _torch_sync
    perm, data_format = channel_order(x)
    relu_dst = None if relu_out is None else np_view(relu_out.permute(perm))
    xs, dys = np_view(x.permute(perm)), np_view(grad_y.permute(perm))
    stats = np_view(mean), np_view(var)
    gamma_np = None if gamma is None else np_view(gamma)
    params = (np_view(dgamma), np_view(dbeta))
    low = None if mean_low is None else np_view(mean_low)
    _, local = _torch_sync(xs, dys, *stats, gamma_np, epsilon=eps, group=_group(group),
                           out=(np_view(dx.permute(perm)), *params), keep_local=True,
                           data_format=data_format, num_threads=nt, relu_dst=relu_dst,
                           mean_low=low)
    # DistributedDataParallel averages parameter gradients: this rank's, from its sums
    backward(TWO_PHASE, PARAMS_FROM_SUMS, xs, dys, *stats, gamma_np, eps, data_format, params,
             nt, relu_dst=relu_dst, partial=local, count=x.numel() // channels, mean_low=low)
    return dx, dgamma, dbeta


batch_norm_train_backward = torch.library.custom_op("bnbw_native::batch_norm_train_backward",
                                                    backward_impl, mutates_args=(), **_ANY_LAYOUT)


@batch_norm_train_backward.register_fake
def _(grad_y, x, weight, mean, var, relu_out, eps, group, num_threads, input_grad,
      residual_grad=False, mean_low=None):
    _check_device(x, grad_y=grad_y, weight=weight, mean=mean, var=var, relu_out=relu_out,
                  mean_low=mean_low)
    dx = torch.empty_like(x) if input_grad else x.new_empty(0)
    dgamma = x.new_empty(x.shape[1], dtype=torch.float32)
    d_res = torch.empty_like(x, dtype=grad_y.dtype) if residual_grad else x.new_empty(0)
    return dx, dgamma, torch.empty_like(dgamma), d_res


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

_RESIDUAL_INPUT = 10        # batch_norm_train's residual among its inputs


def _setup_context(ctx, inputs, output):
    x, weight, bias, _, _, _, eps, relu, group, num_threads = inputs[:_RESIDUAL_INPUT]
    residual = inputs[_RESIDUAL_INPUT] if len(inputs) > _RESIDUAL_INPUT else None
    y, mean, var, _, new_mean, new_var, mean_low = output
    ctx.save_for_backward(x, weight, y if relu else None, mean, var, mean_low)
    _keep_options(ctx, weight, bias, eps, group, num_threads,
                  None if residual is None else _RESIDUAL_INPUT)
    ctx.mark_non_differentiable(mean, var, new_mean, new_var, mean_low)


def _keep_options(ctx, weight, bias, eps, group, num_threads, residual_at):
    """What the backward needs besides the saved tensors; residual_at: the residual's place
    among the inputs (None: no residual)."""
    ctx.eps, ctx.group, ctx.num_threads = eps, group, num_threads
    ctx.param_types = (None if weight is None else weight.dtype,
                       None if bias is None else bias.dtype)
    ctx.residual_at = residual_at


_FLOAT32_PARAMS = (torch.float32, torch.float32)


def _param_grads(ctx, dgamma, dbeta):
    """The parameter gradients (float32, or None) in the parameters' own types."""
    if ctx.param_types == _FLOAT32_PARAMS:
        return dgamma, dbeta
    return tuple(g if g is None or t == torch.float32 else g.to(t)
                 for g, t in zip((dgamma, dbeta), ctx.param_types))


def _grads(ctx, grad_y, backward, stats=()):
    """The autograd formula: (grad_x, grad_weight, grad_bias, grad_residual), None where not
    needed; `backward` is the operator, or its implementation in eager mode; the saved
    tensors hold the statistics (mean, var, mean_low) unless given."""
    x, weight, y, *saved = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_r = ctx.residual_at is not None and ctx.needs_input_grad[ctx.residual_at]
    if not (need_x or need_w or need_b or need_r):
        return None, None, None, None
    mean, var, mean_low = stats or saved
    dx, dgamma, dbeta, d_res = backward(grad_y, x, weight, mean, var, y, ctx.eps, ctx.group,
                                        ctx.num_threads, need_x, need_r, mean_low)
    return (dx if need_x else None, *_param_grads(ctx, dgamma if need_w else None,
                                                  dbeta if need_b else None),
            d_res if need_r else None)


def _refuse_nested_transforms():
    """once_differentiable makes a second derivative fail under autograd, but not under nested
    torch.func transforms: there the gradients would silently count as constants (a grad of
    a grad gave zeros).  functorch's interpreter stack is not public API: without it, no
    check."""
    functorch = torch._C._functorch
    if not hasattr(functorch, "get_interpreter_stack"):
        return
    differentiating = (functorch.TransformType.Grad, functorch.TransformType.Jvp)
    if sum(i.key() in differentiating for i in functorch.get_interpreter_stack() or ()) > 1:
        raise RuntimeError("bnbw_native's batch norm has no second derivative: its backward "
                           "ran inside nested torch.func transforms (grad of grad, or grad "
                           "with jvp), which would take its gradients for constants")


@once_differentiable
def _backward(ctx, grad_y, _mean, _var, _count, _new_mean, _new_var, _mean_low):
    _refuse_nested_transforms()
    dx, dgamma, dbeta, d_res = _grads(ctx, grad_y,
                                      torch.ops.bnbw_native.batch_norm_train_backward)
    grads = [dx, dgamma, dbeta] + [None] * (len(ctx.needs_input_grad) - 3)
    if ctx.residual_at is not None:
        grads[ctx.residual_at] = d_res
    return tuple(grads)


batch_norm_train.register_autograd(_backward, setup_context=_setup_context)


class BatchNormTrain(torch.autograd.Function):
    """batch_norm_train with the same formula, for torch.func transforms: register_autograd's
    wrapper has no setup_context in this PyTorch, which they require.  vmap runs the
    operators' own rule (one batch norm per entry)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*inputs):
        return torch.ops.bnbw_native.batch_norm_train(*inputs)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)


class EagerLayerStep(torch.autograd.Function):
    """batch_norm_train in plain eager mode, without the dispatcher and the custom-op
    wrappers: y is the only output, the statistics stay in the context.  With a residual
    (relu, no group): y = max(bn(x) + residual, 0), the add and the ReLU in the pass that
    writes y (the residual first copied into x's layout if it has another), and the backward
    writes the residual's gradient (the masked one) in the same pass as dx."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, running, options):
        factor, eps, relu, group, num_threads = options       # (few arguments: apply is faster)
        y, mean, var, _, mean_low = _forward_added(x, weight, bias, running, factor, eps, relu,
                                                   group, num_threads, running, residual,
                                                   numpy_statistics=True)
        if running is not None and not group:    # written by the kernel, as by torch's op
            torch.autograd.graph.increment_version(running)
        ctx.save_for_backward(x, weight, y if relu else None)
        ctx.stats = (mean, var, mean_low)
        _keep_options(ctx, weight, bias, eps, group, num_threads,
                      None if residual is None else 3)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        if torch.is_grad_enabled():     # create_graph: a second derivative must fail loudly
            return _eager_grads_once(ctx, grad_y)
        return _eager_grads(ctx, grad_y)


def _eager_grads(ctx, grad_y):
    """EagerLayerStep's gradients: the operator's formula on the backward pass itself, the
    statistics from the context."""
    return (*_grads(ctx, grad_y, _backward_grads, ctx.stats), None, None)


# Grad mode is on in a backward only under create_graph: the gradients are then marked as
# having none of their own, as the operator's formula marks them (a second derivative fails).
_eager_grads_once = once_differentiable(_eager_grads)


def _eager_apply():
    """EagerLayerStep.apply for plain eager mode, without torch.autograd.Function.apply's
    Python layer: that layer binds default arguments for a setup_context (EagerLayerStep has
    none), routes functorch transforms (train() sends those elsewhere) and unwraps tensors
    left over from finished transforms, which this does too, on the four tensor arguments.  It
    cost 3-10 us a layer step (docs/benchmark-history.md, 6e).  The C base's apply and
    functorch's unwrap_if_dead are not public API: without either, the public apply."""
    base = getattr(torch._C, "_FunctionBase", None)
    unwrap = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
    if base is None or unwrap is None or not issubclass(EagerLayerStep, base):
        return EagerLayerStep.apply
    apply = super(torch.autograd.Function, EagerLayerStep).apply

    def eager_apply(x, weight, bias, residual, *rest):
        return apply(unwrap(x), None if weight is None else unwrap(weight),
                     None if bias is None else unwrap(bias),
                     None if residual is None else unwrap(residual), *rest)
    return eager_apply


_eager_layer_step = _eager_apply()


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain(*tensors):
    """Whether every tensor given is a plain tensor (or None), whose memory the kernels read in
    place: a subclass (FakeTensor, a wrapper of other tensors) goes through the dispatcher,
    which gives it to the subclass's own rules."""
    for t in tensors:       # (a loop: all() over a generator cost 1 us a call)
        if t is not None and type(t) not in _PLAIN_TYPES:
            return False
    return True


def train(x, weight, bias, running_mean, running_var, momentum, batches_tracked, eps, relu,
          group, num_threads, residual=None):
    """y of batch_norm_train with its autograd formula, the running statistics updated in
    place with torch's momentum (None: the cumulative average, 1 / batches_tracked):
    EagerLayerStep in plain eager mode on plain tensors; else the operator (the graph holds it when
    compiling or tracing with torch.jit.trace, which cannot record a Python autograd
    Function), through BatchNormTrain under torch.func transforms, its new running
    statistics then stored.  A residual (with relu): y = max(bn(x) + residual, 0), inside
    the operator (as torch ops around it over a process group)."""
    compiling = torch.compiler.is_compiling() or torch.jit.is_tracing()    # a graph's op
    counted = None                  # (the count, when the operator reads it when it runs)
    if momentum is not None or running_mean is None:
        factor = 0.0 if momentum is None else float(momentum)
    elif compiling:
        factor, counted = 0.0, batches_tracked
    else:
        factor = _cumulative_factor(batches_tracked)
    if not (compiling or torch._C._are_functorch_transforms_active()) and _plain(
            x, weight, bias, residual, running_mean, running_var):
        _check_params(x, weight, bias)
        try:
            return _eager_layer_step(x, weight, bias, residual,
                                     _running(running_mean, running_var),
                                     (factor, eps, relu, group, num_threads))
        except (TypeError, ValueError):     # a tensor off x's device: say so, in torch's words
            _check_device(x, weight=weight, bias=bias, running_mean=running_mean,
                          running_var=running_var, residual=residual)
            raise
    inside = residual if relu and not group else None
    args = (x, weight, bias, running_mean, running_var, factor, eps,
            relu and (residual is None or inside is not None), group, num_threads, inside,
            counted)
    if compiling:
        y, _, _, _, new_mean, new_var, _ = torch.ops.bnbw_native.batch_norm_train(*args)
    else:
        y, _, _, _, new_mean, new_var, _ = BatchNormTrain.apply(*args)
    if running_mean is not None:   # (not under no_grad: an exported program that holds one
        running_mean.copy_(new_mean)    # fails to load; new_* are non-differentiable anyway)
        running_var.copy_(new_var)
    return y if residual is None or inside is not None else torch.relu(y + residual)
