"""PyTorch layers whose training backward runs the bnbw_native kernels.

    from bnbw_native.autograd import BatchNorm, SyncBatchNorm, batch_norm, convert_batchnorm

Design:
* Forward (training): per-channel batch mean and biased variance from the kernel's own
  reduction (backward_reduce with dy = x: Sum x and Sum (x - c) x, exact float64 products,
  float64 sums; a second pass around the mean only when |mean| >> std), then
  y = (x - mean) / sqrt(var + eps) * weight + bias by torch's own batch_norm with those
  statistics.  `SyncBatchNorm` gathers (count, mean, M2) of every rank and merges them in rank
  order in float64, so every rank holds the same bits.
* Backward: x and dy reach the kernel through DLPack views of the torch tensors and dx is
  written straight into the tensor handed back to autograd: no copy.  Channels-first tensors
  go as they are with data_format "NCX"; channels-last ones as their (N, *spatial, C) view with
  "NXC"; any other strides are read in place too (autograd often hands over expanded,
  zero-stride gradients).
* Parameter gradients are LOCAL (this rank's rows) in SyncBatchNorm, as in
  torch.nn.SyncBatchNorm: DistributedDataParallel averages them with every other parameter.
  dx uses the global sums (one all-reduce of 2*C float64 sums and the count).
* Eval mode with running statistics: plain torch ops.
Storage types: x float32, float16 or bfloat16 (bfloat16 needs ml_dtypes); parameters and
statistics float32, as torch.nn.BatchNorm2d keeps them.  Double backward is not supported.
"""
try:
    import torch
    from torch.autograd.function import once_differentiable
except ImportError as exc:  # an optional extra
    raise ImportError("bnbw_native.autograd needs PyTorch: pip install 'bnbw_native[torch]'") \
        from exc
import numpy as np

from ._graph import batchnorm_training_backward
from ._twophase import backward_reduce

_STORAGE = (torch.float32, torch.float16, torch.bfloat16)


# ---- zero-copy views -----------------------------------------------------------------------

def _np(t):
    """A NumPy view of a CPU tensor's memory (DLPack; bfloat16 through an int16 view)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        try:
            import ml_dtypes
        except ImportError as exc:
            raise TypeError("bfloat16 tensors need ml_dtypes: pip install "
                            "'bnbw_native[bf16]'") from exc
        return np.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)
    return np.from_dlpack(t)


def _channel_last_order(x):
    """(permutation, data_format): the (N, *spatial, C) view for channels-last memory,
    the tensor as it is (channel axis 1) otherwise."""
    ndim = x.dim()
    if ndim > 2 and not x.is_contiguous():
        perm = (0, *range(2, ndim), 1)
        if x.permute(perm).is_contiguous():
            return perm, "NXC"
    return tuple(range(ndim)), "NCX"


def _check_input(x, num_features):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise TypeError(f"input must be a CPU tensor, got device {x.device}")
    if x.dtype not in _STORAGE:
        raise TypeError(f"input must be float32, float16 or bfloat16, got {x.dtype}")
    if not 2 <= x.dim() <= 8:
        raise ValueError(f"input must have 2 to 8 dimensions (N, C, *), got {x.dim()}")
    if num_features is not None and x.shape[1] != num_features:
        raise ValueError(f"input has {x.shape[1]} channels (dim 1), expected num_features = "
                         f"{num_features}")


# ---- statistics --------------------------------------------------------------------------

# One pass gives Sum x and Sum x*x; M2 = Sum x*x - (Sum x)^2 / n then loses about
# log10(mean^2 / var) of float64's 16 digits.  Past this ratio a second pass sums around the
# mean instead (a ratio of 1e4 leaves ~1e-12 relative, far below float32's 6e-8).
_CANCELLATION = 1e4


def _moments(x, num_threads):
    """(count, mean, M2 = Sum (x - mean)^2) per channel, float64, from the kernel's sums.

    backward_reduce(x, dy=x, mean=c, exact_sums=True) returns [Sum x, Sum (x - c) * x] with
    exact float64 products and float64 accumulation, for any layout and storage type, without
    copies (the default f32 blocks of f16/bf16 sums would not survive the cancellation)."""
    perm, data_format = _channel_last_order(x)
    xs = _np(x.permute(perm))
    channels = x.shape[1]
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


def _batch_stats(x, group, sync, num_threads):
    """float32 mean and biased variance over the batch (all ranks when sync), and the count."""
    count, mean, m2 = _moments(x, num_threads)
    if sync:
        count, mean, m2 = _merge_ranks(count, mean, m2, group)
    var = m2 / count if count else m2
    return (torch.from_numpy(mean.astype(np.float32)), torch.from_numpy(var.astype(np.float32)),
            count)


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


# ---- the autograd function -----------------------------------------------------------------

class _BatchNormFunction(torch.autograd.Function):
    """(x, weight, bias) -> (y, mean, variance, count); mean, variance, count are statistics
    for the running averages, not differentiable."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, group, sync, num_threads):
        mean, var, count = _batch_stats(x, group, sync, num_threads)
        if count == 0:
            raise ValueError("batch norm in training mode needs at least one value per channel; "
                             f"got input of shape {tuple(x.shape)}")
        y = torch.nn.functional.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.eps, ctx.group, ctx.sync, ctx.num_threads = eps, group, sync, num_threads
        count_t = torch.tensor(count, dtype=torch.int64)
        ctx.mark_non_differentiable(mean, var, count_t)
        return y, mean, var, count_t

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, _mean, _var, _count):
        x, weight, mean, var = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if not (need_x or need_w or need_b):
            return None, None, None, None, None, None, None
        perm, data_format = _channel_last_order(x)
        xs, dys = _np(x.permute(perm)), _np(grad_y.permute(perm))
        stats = _np(mean), _np(var)
        gamma = None if weight is None else _np(weight)
        kw = dict(data_format=data_format, num_threads=ctx.num_threads)
        dx = dgamma = dbeta = None
        if need_x:
            dx = torch.empty_like(x)          # keeps x's memory format
            dgamma = torch.empty(x.shape[1], dtype=torch.float32)
            dbeta = torch.empty_like(dgamma)
            out = (_np(dx.permute(perm)), _np(dgamma), _np(dbeta))
            if ctx.sync:
                from .distributed import _torch_sync
                _, local = _torch_sync(xs, dys, *stats, gamma, epsilon=ctx.eps,
                                       group=ctx.group, out=out, keep_local=True, **kw)
                dgamma, dbeta = _param_grads(local, var, ctx.eps)
            else:
                batchnorm_training_backward(xs, dys, *stats, gamma, epsilon=ctx.eps,
                                            out=out, **kw)
        else:
            # parameters only: their (local) gradients need the sums, not a second pass
            local, _ = backward_reduce(xs, dys, stats[0], **kw)
            dgamma, dbeta = _param_grads(local, var, ctx.eps)
        if weight is None:
            dgamma = dbeta = None
        return (dx, dgamma if need_w else None, dbeta if need_b else None,
                None, None, None, None)


def _param_grads(sums, var, eps):
    """diff_gamma = r * Sum (x - mean) dy and diff_beta = Sum dy from (2, C) float64 sums."""
    r = 1.0 / np.sqrt(_np(var).astype(np.float64) + float(np.float32(eps)))
    return (torch.from_numpy((sums[1] * r).astype(np.float32)),
            torch.from_numpy(sums[0].astype(np.float32)))


def batch_norm(x, weight=None, bias=None, *, eps=1e-5, num_threads=None):
    """Training-mode batch norm over (N, C, *) with the bnbw_native backward; returns y."""
    _check_input(x, None)
    return _BatchNormFunction.apply(x, weight, bias, float(eps), None, False, num_threads)[0]


# ---- modules -----------------------------------------------------------------------------

class BatchNorm(torch.nn.Module):
    """torch.nn.BatchNorm1d/2d/3d with the bnbw_native training backward.

    Input (N, C, *) of 2 to 8 dims, float32/float16/bfloat16, channels-first or channels-last.
    Same arguments, parameters, buffers and state_dict keys as torch.nn.BatchNorm2d (so its
    state dicts load), plus num_threads for the kernel.  momentum None means a cumulative
    average, as in torch.
    """

    _sync = False

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, *, num_threads=None, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype or torch.float32}
        self.num_features = int(num_features)
        self.eps = float(eps)
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        self.num_threads = num_threads
        if affine:
            self.weight = torch.nn.Parameter(torch.ones(self.num_features, **factory))
            self.bias = torch.nn.Parameter(torch.zeros(self.num_features, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(self.num_features, **factory))
            self.register_buffer("running_var", torch.ones(self.num_features, **factory))
            self.register_buffer("num_batches_tracked",
                                 torch.tensor(0, dtype=torch.long, device=device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def extra_repr(self):
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats}")

    def _group(self):
        return None

    def forward(self, x):
        _check_input(x, self.num_features)
        if not (self.training or self.running_mean is None):
            return torch.nn.functional.batch_norm(x, self.running_mean, self.running_var,
                                                  self.weight, self.bias, False, 0.0,
                                                  self.eps)
        sync = self._sync and self._world_size() > 1
        y, mean, var, count = _BatchNormFunction.apply(
            x, self.weight, self.bias, self.eps, self._group(), sync, self.num_threads)
        count = int(count)
        if count <= 1:
            raise ValueError(f"expected more than 1 value per channel when training, got "
                             f"input of shape {tuple(x.shape)}")
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                if self.momentum is None:
                    factor = 1.0 / float(self.num_batches_tracked)
                else:
                    factor = self.momentum
                self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
                self.running_var.mul_(1 - factor).add_(var * (count / (count - 1)),
                                                       alpha=factor)
        return y

    def _world_size(self):
        return 1


class SyncBatchNorm(BatchNorm):
    """BatchNorm whose statistics and input gradient span a torch.distributed group.

    Forward merges every rank's statistics (one all_gather of 3*C float64); backward sums the
    two per-channel sums and the count over the group (two all-reduces, in flight together).
    weight/bias gradients are this rank's, as in torch.nn.SyncBatchNorm, for DDP to average.
    process_group None means the default group; a world of one runs as BatchNorm.
    """

    _sync = True

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, *, num_threads=None,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         num_threads=num_threads, device=device, dtype=dtype)
        self.process_group = process_group

    def _group(self):
        return self.process_group

    def _world_size(self):
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)


def convert_batchnorm(module, *, sync=False, process_group=None, num_threads=None):
    """Replace every torch.nn BatchNorm1d/2d/3d/SyncBatchNorm inside `module` by BatchNorm
    (SyncBatchNorm when sync), keeping parameters, buffers and train/eval mode."""
    from torch.nn.modules.batchnorm import _BatchNorm
    if isinstance(module, _BatchNorm):
        kw = {"num_threads": num_threads}
        cls = BatchNorm
        if sync:
            cls, kw["process_group"] = SyncBatchNorm, process_group
        new = cls(module.num_features, module.eps, module.momentum, module.affine,
                  module.track_running_stats, **kw)
        with torch.no_grad():
            if module.affine:
                new.weight = module.weight
                new.bias = module.bias
            if module.track_running_stats:
                new.running_mean = module.running_mean
                new.running_var = module.running_var
                new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, convert_batchnorm(child, sync=sync, process_group=process_group,
                                                  num_threads=num_threads))
    return module


__all__ = ["BatchNorm", "SyncBatchNorm", "batch_norm", "convert_batchnorm"]
