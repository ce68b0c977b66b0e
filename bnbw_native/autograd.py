"""PyTorch layers whose training backward runs the bnbw_native kernels.

    from bnbw_native.autograd import (BatchNorm, BatchNormReLU, BatchNormAddReLU,
                                      SyncBatchNorm, SyncBatchNormReLU, batch_norm,
                                      convert_batchnorm)

Design:
* The work is done by two PyTorch custom operators (bnbw_native._torch_ops):
  torch.ops.bnbw_native.batch_norm_train and ...batch_norm_train_backward, with fake
  implementations and an autograd formula, so the layers run in eager mode, under
  torch.compile and under torch.func transforms alike.
* Forward (training): the engine's training forward (bnbw_native.batchnorm_training_forward):
  the batch mean and biased variance from exact float64 sums, y = weight * (x - mean) /
  sqrt(var + eps) + bias written straight into the tensor returned (and the ReLU in the same
  pass for the fused layers).  The same native call computes the new running statistics as
  PyTorch does (its momentum on the batch, the unbiased variance), in float64 rounded once:
  written in place in plain eager mode, returned by the operator and stored by the layer when
  compiled or under torch.func - the same bits.
  The Sync layers run the forward in two phases: the sums and counts all-reduced once (a
  second time only for channels whose mean lies far from zero), so every rank holds the same
  bits.
* One native call per pass: the tensors reach the kernels as they are - their address, sizes
  and strides, whatever the memory format - and y and dx are written straight into the
  tensors handed to autograd: no copy, no NumPy view.  The fused layers keep their output y
  for the backward (as torch's ReLU does) and mask the gradient with it.
* Parameter gradients are LOCAL (this rank's rows) in the Sync layers, as in
  torch.nn.SyncBatchNorm: DistributedDataParallel averages them with every other parameter.
  dx uses the global sums (one all-reduce of 2*C float64 sums and the count).
* Eval mode, and float64 input (torch.autograd.gradcheck): torch's own batch norm (and ReLU).
* Threads: num_threads None follows torch (torch.get_num_threads()) at every call.
Storage types: x float32, float16 or bfloat16 (bfloat16 in the Sync layers needs ml_dtypes);
parameters and statistics float32, as torch.nn.BatchNorm2d keeps them.  Double backward is not
supported.
"""
import collections
import operator
import warnings
from typing import Any, Dict, Optional, Tuple, Type

try:
    import torch
except ImportError as exc:  # an optional extra
    raise ImportError("bnbw_native.autograd needs PyTorch: pip install 'bnbw_native[torch]'") \
        from exc

from . import _torch_ops
from ._rules import check_epsilon, requested_threads
from ._torch_ops import STORAGE


def _check_options(eps: float, num_threads: Optional[int]) -> None:
    """eps: finite and > 0 as a float32 (torch would accept a NaN and give NaN outputs);
    num_threads: None (torch's own count, torch.get_num_threads()) or a positive int."""
    check_epsilon(eps, "eps")
    requested_threads(num_threads)


_INPUT_TYPES = STORAGE + (torch.float64,)


def _check_input(x: Any, num_features: Optional[int]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_cpu:
        raise TypeError(f"input must be a CPU tensor, got device {x.device}")
    if x.dtype not in _INPUT_TYPES:
        raise TypeError(f"input must be float32, float16 or bfloat16 (or float64, which runs "
                        f"torch's own batch norm), got {x.dtype}")
    if not 2 <= x.dim() <= 8:
        raise ValueError(f"input must have 2 to 8 dimensions (N, C, *), got {x.dim()}")
    if num_features is not None and x.shape[1] != num_features:
        raise ValueError(f"input has {x.shape[1]} channels (dim 1), expected num_features = "
                         f"{num_features}")


def _check_float64(x: torch.Tensor, tensors: Any) -> None:
    """torch's batch norm takes float64 input only with float64 parameters and statistics."""
    for name, t in tensors:
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"input is float64, which runs torch's own batch norm: {name} must "
                            f"be float64 too, got {t.dtype} (call .double() on the layer)")


def _batched(t: torch.Tensor) -> bool:
    """Whether `t` is a tensor batched by torch.func.vmap (functorch's own test)."""
    test = getattr(getattr(torch._C, "_functorch", None), "is_batchedtensor", None)
    return test is not None and test(t)


def _check_more_than_one(x: torch.Tensor) -> None:
    """Training statistics need two values per channel, as in torch (M = 1 has no variance)."""
    if x.numel() == x.shape[1]:
        raise ValueError(f"expected more than 1 value per channel when training, got input "
                         f"of shape {tuple(x.shape)}")


def batch_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, *, eps: float = 1e-5, relu: bool = False,
               num_threads: Optional[int] = None) -> torch.Tensor:
    """Training-mode batch norm over (N, C, *) with the bnbw_native backward; returns y
    (max(y, 0) when relu).  float64 input runs torch's own batch norm."""
    _check_input(x, None)
    _check_options(eps, num_threads)
    if x.dtype == torch.float64 or x.numel() == 0:     # (an empty batch: torch's empty y)
        if x.dtype == torch.float64:
            _check_float64(x, (("weight", weight), ("bias", bias)))
        y = torch.nn.functional.batch_norm(x, None, None, weight, bias, True, 0.0, eps)
        return torch.relu(y) if relu else y
    _check_more_than_one(x)
    return _torch_ops.train(x, weight, bias, None, None, None, None, float(eps), bool(relu), "",
                            num_threads)


# ---- modules -----------------------------------------------------------------------------

class BatchNorm(torch.nn.Module):
    """torch.nn.BatchNorm1d/2d/3d with the bnbw_native training backward.

    Input (N, C, *) of 2 to 8 dims, float32/float16/bfloat16, channels-first or channels-last.
    Same arguments, parameters, buffers and state_dict keys as torch.nn.BatchNorm2d (so its
    state dicts load), plus num_threads for the kernel.  momentum None means a cumulative
    average, as in torch.  float64 input (with a float64 layer: .double()) runs torch's own
    batch norm, so torch.autograd.gradcheck applies.
    """

    _sync = False
    _relu = False

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *,
                 num_threads: Optional[int] = None, device: Any = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype or torch.float32}
        self.num_features = int(num_features)
        _check_options(eps, num_threads)
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

    # state-dict version 2, as torch's batch norms: num_batches_tracked is in it
    _version = 2

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any,
                              *args: Any) -> None:
        # a state dict from before num_batches_tracked (version 1) loads with a count of 0, as
        # into torch.nn.BatchNorm2d
        key = prefix + "num_batches_tracked"
        version = local_metadata.get("version")
        if (version is None or version < 2) and self.track_running_stats \
                and key not in state_dict:
            state_dict[key] = torch.tensor(0, dtype=torch.long)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    def reset_running_stats(self) -> None:
        """Running statistics back to their start (mean 0, variance 1, no batch seen)."""
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        """Running statistics and the affine parameters back to their start (1 and 0)."""
        self.reset_running_stats()
        if self.affine:
            torch.nn.init.ones_(self.weight)
            torch.nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats}")

    def _group_key(self) -> str:
        """The operators' name for the group whose batch this layer normalises ("": none)."""
        return ""

    def __prepare_scriptable__(self) -> "BatchNorm":
        # torch.jit.script calls this on every submodule before compiling it; TorchScript
        # cannot compile the Python around the operators, and its own error names a line of
        # ours and a type "Any"
        raise RuntimeError(
            f"{type(self).__name__} cannot be compiled by torch.jit.script (TorchScript): "
            "its forward is Python around custom operators. torch.jit.trace, torch.compile "
            "and torch.export take it")

    def forward(self, input: torch.Tensor) -> torch.Tensor:   # torch's name: bn(input=x)
        return self._train_or_eval(input, None)

    def _train_or_eval(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """The layer's y; with a residual (the add layer): max(bn(x) + residual, 0)."""
        _check_input(x, self.num_features)
        group = self._group_key()
        if x.dtype == torch.float64 or not self.training or (x.numel() == 0 and not group):
            if residual is None:    # (an empty batch: torch's empty y, as BatchNorm2d)
                return self._torch_forward(x, self._relu)
            return torch.relu(self._torch_forward(x, False) + residual)
        if not group:
            _check_more_than_one(x)
        if residual is not None and (group or not isinstance(residual, torch.Tensor)
                                     or residual.shape != x.shape
                                     or residual.dtype != x.dtype):
            # not the add the layer fuses (broadcast, another type, a group): as written
            return torch.relu(self._train(x, group, False, None) + residual)
        return self._train(x, group, self._relu, residual)

    def _state(self) -> Tuple[Any, Any, Any, Any, Any]:
        """(weight, bias, running_mean, running_var, num_batches_tracked), read from the
        module's dicts: five attribute reads through torch.nn.Module.__getattr__ cost 2-3 us a
        step.  A parametrized or otherwise replaced attribute is read as an attribute."""
        try:
            params, buffers = self._parameters, self._buffers
            return (params["weight"], params["bias"], buffers["running_mean"],
                    buffers["running_var"], buffers["num_batches_tracked"])
        except KeyError:
            return (self.weight, self.bias, self.running_mean, self.running_var,
                    self.num_batches_tracked)

    def _train(self, x: torch.Tensor, group: str, relu: bool,
               residual: Optional[torch.Tensor]) -> torch.Tensor:
        weight, bias, running_mean, running_var, batches = self._state()
        if not self.track_running_stats:
            running_mean = running_var = None
        else:
            if (torch._C._are_functorch_transforms_active()    # (vmap's tensors exist only then)
                    and any(_batched(t) for t in (x, weight, bias) if t is not None)):
                raise RuntimeError(
                    "vmap over a batch norm that updates its running statistics: they are not "
                    "batched and cannot take one update per entry; make the layer with "
                    "track_running_stats=False (as for torch.nn.BatchNorm2d under vmap)")
            if self.momentum is not None and not 0.0 <= self.momentum <= 1.0:
                raise ValueError(f"momentum must be None or in [0, 1], got {self.momentum}")
            batches.add_(1)
        kept = None
        if running_mean is not None and running_mean.dtype != torch.float32:
            # the kernels keep float32 statistics: update float32 copies, then store them back
            kept = (running_mean, running_var)
            running_mean, running_var = running_mean.float(), running_var.float()
        y = _torch_ops.train(x, weight, bias, running_mean, running_var, self.momentum,
                             batches, self.eps, relu, group, self.num_threads, residual)
        if kept is not None:
            kept[0].copy_(running_mean)        # (the statistics take no gradient)
            kept[1].copy_(running_var)
        return y

    def _torch_forward(self, x: torch.Tensor, relu: bool) -> torch.Tensor:
        """torch.nn.BatchNorm2d's forward (then ReLU when relu)."""
        if x.dtype == torch.float64:
            if self._group_key():
                raise TypeError("input must be float32, float16 or bfloat16 in a process "
                                "group of more than one rank, got float64")
            _check_float64(x, (("weight", self.weight), ("bias", self.bias),
                               ("running_mean", self.running_mean),
                               ("running_var", self.running_var)))
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        y = torch.nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias,
            self.training or self.running_mean is None, factor, self.eps)
        return torch.relu_(y) if relu else y


class BatchNormReLU(BatchNorm):
    """BatchNorm followed by ReLU, y = max(bn(x), 0), in one layer whose backward masks the
    gradient with y.  The parameters, buffers and state_dict keys of torch.nn.BatchNorm2d."""

    _relu = True


class BatchNormAddReLU(BatchNorm):
    """y = max(bn(x) + residual, 0): a batch norm, the residual add after it and the ReLU,
    as a residual block ends (torchvision's `out = bn2(...); out += identity; relu(out)`),
    in one layer called as layer(x, residual).  Its forward adds the residual (in x's type,
    to y rounded to it) and applies the ReLU in the pass that writes y - a -0 sum gives +0,
    where torch.relu keeps -0 -; its backward masks the gradient with y and writes the
    residual's gradient in the same pass as x's.  The parameters, buffers and
    state_dict keys of torch.nn.BatchNorm2d.  A residual that is not x's shape and type
    (broadcast) is added as written, after the batch norm."""

    _relu = True

    def forward(self, input: torch.Tensor,  # type: ignore[override]
                residual: torch.Tensor) -> torch.Tensor:
        return self._train_or_eval(input, residual)


class SyncBatchNorm(BatchNorm):
    """BatchNorm whose statistics and input gradient span a torch.distributed group.

    Forward merges every rank's statistics (one all_gather of 3*C float64); backward sums the
    two per-channel sums and the count over the group (two all-reduces, in flight together).
    weight/bias gradients are this rank's, as in torch.nn.SyncBatchNorm, for DDP to average.
    process_group None means the default group; a world of one runs as BatchNorm.
    """

    _sync = True

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: Any = None, *, num_threads: Optional[int] = None,
                 device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         num_threads=num_threads, device=device, dtype=dtype)
        self.process_group = process_group

    def _group_key(self) -> str:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return ""
        if dist.get_world_size(self.process_group) <= 1:
            return ""
        return _torch_ops.group_key(self.process_group)


class SyncBatchNormReLU(SyncBatchNorm):
    """SyncBatchNorm followed by ReLU in one layer, as BatchNormReLU is to BatchNorm."""

    _relu = True


def _replacement(module: Any, relu: bool, sync: bool, process_group: Any,
                 num_threads: Optional[int], add: bool = False) -> "BatchNorm":
    """Our layer for a torch (or our) batch norm, sharing its parameters and buffers
    (BatchNormAddReLU when add)."""
    cls: Type[BatchNorm]
    kw: Dict[str, Any] = {}
    if isinstance(module, SyncBatchNorm):     # ours, already converted: stays in its group
        sync, process_group = True, module.process_group
    elif sync and process_group is None:      # torch's SyncBatchNorm: its own group
        process_group = getattr(module, "process_group", None)
    if add:
        cls = BatchNormAddReLU
    elif sync:
        cls = SyncBatchNormReLU if relu else SyncBatchNorm
        kw["process_group"] = process_group
    else:
        cls = BatchNormReLU if relu else BatchNorm
    if isinstance(module, BatchNorm) and num_threads is None:
        num_threads = module.num_threads
    new = cls(module.num_features, module.eps, module.momentum, module.affine,
              module.track_running_stats, num_threads=num_threads, **kw)
    if module.affine:
        new.weight = module.weight
        new.bias = module.bias
    if module.track_running_stats:
        new.running_mean = module.running_mean
        new.running_var = module.running_var
        new.num_batches_tracked = module.num_batches_tracked
    new.train(module.training)
    return new


def _hooked(module: torch.nn.Module) -> bool:
    """Whether anything watches `module` through a hook (module or parameter hooks)."""
    return any(getattr(module, name, None) for name in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
        "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks"))


def _fusable_relu(module: Optional[torch.nn.Module]) -> bool:
    """A plain torch.nn.ReLU (inplace or not) that nothing else observes."""
    return type(module) is torch.nn.ReLU and not _hooked(module)


def _convertible(module: torch.nn.Module, name: str) -> bool:
    """Whether a batch norm can be replaced: refuses an uninitialised lazy one; leaves one
    with hooks as it is (our layer would not call them), with a warning."""
    from torch.nn.modules.lazy import LazyModuleMixin
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        raise ValueError(f"{name or 'the module'} is a {type(module).__name__} whose "
                         "num_features is not known yet: run one forward pass first (it then "
                         "becomes a BatchNorm*d), then convert")
    if _hooked(module):
        warnings.warn(f"convert_batchnorm: {name or 'the module'} ({type(module).__name__}) "
                      "has hooks, which the converted layer would not call: left as it is",
                      RuntimeWarning, stacklevel=4)
        return False
    from torch.nn.modules.batchnorm import _BatchNorm
    if isinstance(module, _BatchNorm) and type(module).forward not in (
            _BatchNorm.forward, torch.nn.SyncBatchNorm.forward):
        warnings.warn(f"convert_batchnorm: {name or 'the module'} ({type(module).__name__}) "
                      "has a forward of its own, which the converted layer would not run: left "
                      "as it is", RuntimeWarning, stacklevel=4)
        return False
    return True


def _convert_tree(module: torch.nn.Module, sync: bool, process_group: Any,
                  num_threads: Optional[int], fuse_relu: bool, prefix: str = "") -> None:
    """convert_batchnorm's module rule, in place below `module`: every batch norm becomes ours;
    with fuse_relu, inside every nn.Sequential a batch norm followed by a plain ReLU becomes the
    ReLU layer and the ReLU nn.Identity()."""
    from torch.nn.modules.batchnorm import _BatchNorm
    # every slot, in order: named_children() lists a module held twice once, which would make
    # a batch norm look followed by a ReLU that is not the next slot
    children = list(module._modules.items())
    # (a subclass with a forward of its own may use a batch norm's output otherwise)
    fuse = (fuse_relu and isinstance(module, torch.nn.Sequential)
            and type(module).forward is torch.nn.Sequential.forward)
    skip = set()
    for i, (name, child) in enumerate(children):
        if name in skip or child is None:
            continue
        path = prefix + name
        is_bn = isinstance(child, (_BatchNorm, BatchNorm))
        if is_bn and not _convertible(child, path):
            continue
        relu = (fuse and is_bn and not getattr(child, "_relu", False)
                and i + 1 < len(children) and _fusable_relu(children[i + 1][1]))
        if isinstance(child, _BatchNorm) or (isinstance(child, BatchNorm) and relu):
            module.add_module(name, _replacement(child, relu, sync, process_group,
                                                 num_threads))
        else:
            _convert_tree(child, sync, process_group, num_threads, fuse_relu, path + ".")
        if relu:
            next_name = children[i + 1][0]
            module.add_module(next_name, torch.nn.Identity())
            skip.add(next_name)


_RELU_FUNCTIONS = (torch.relu, torch.relu_, torch.nn.functional.relu)


def _relu_of(node: Any, source: Any, modules: Dict[str, torch.nn.Module]) -> bool:
    """Whether graph node `node` is a ReLU of `source` alone: torch.relu, torch.relu_,
    F.relu (inplace or not), x.relu(), x.relu_() or a plain nn.ReLU module."""
    if not node.args or node.args[0] is not source or len(node.args) > 2:
        return False
    if node.op == "call_function":
        return node.target in _RELU_FUNCTIONS
    if node.op == "call_method":
        return node.target in ("relu", "relu_") and len(node.args) == 1
    if node.op == "call_module":
        return _fusable_relu(modules[node.target]) and len(node.args) == 1
    return False


def _residual_add(node: Any, source: Any) -> Any:
    """The other operand when graph node `node` is source + other (operator.add - what
    `out += identity` traces to -, torch.add, x.add(_)) with nothing else, else None."""
    if node.kwargs or len(node.args) != 2 or source not in node.args:
        return None
    other = node.args[1] if node.args[0] is source else node.args[0]
    if other is source or not isinstance(other, torch.fx.Node):
        return None
    if node.op == "call_function" and node.target in (operator.add, operator.iadd, torch.add):
        return other
    if node.op == "call_method" and node.target in ("add", "add_") and node.args[0] is source:
        return other
    return None


def _keep_order(copy: torch.nn.Module, original: torch.nn.Module) -> None:
    """Put `copy`'s submodules, parameters and buffers (a GraphModule's: registered in the
    order the forward calls them) back in `original`'s order, level by level, so that
    parameters(), state_dict() and an optimizer's state keep their order."""
    for attr in ("_modules", "_parameters", "_buffers"):
        mine, theirs = getattr(copy, attr), getattr(original, attr)
        order = [k for k in theirs if k in mine] + [k for k in mine if k not in theirs]
        items = [(k, mine[k]) for k in order]
        mine.clear()
        mine.update(items)
    for name, child in copy._modules.items():
        source = original._modules.get(name)
        if child is not None and source is not None and child is not source:
            _keep_order(child, source)


class _Untraceable(Exception):
    """A forward that torch.fx would trace into a graph that does not compute what it does."""


def _modes() -> Tuple[bool, ...]:
    """The global modes a forward may switch that a torch.fx graph does not record: grad,
    inference, CPU autocast."""
    autocast = (torch.is_autocast_enabled("cpu") if hasattr(torch, "get_autocast_dtype")
                else torch.is_autocast_cpu_enabled())
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast


def _faithful_trace(module: torch.nn.Module) -> Any:
    """The graph torch.fx traces from module's forward, our batch norms left as calls; raises
    _Untraceable where the graph would not do what the forward does: a forward with optional
    or variable arguments (traced with a Proxy, `if arg is None` takes one branch for good),
    one that switches grad, inference or autocast mode (the graph keeps the ops, not the
    modes), one that reads `training` (the graph keeps the mode of the trace: it is traced
    with every module in training mode and in eval mode too, and the graphs must agree), or
    hooks on the model or on the submodules the graph inlines (they would not run)."""
    import inspect
    import torch.fx

    start = _modes()

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
            return isinstance(m, BatchNorm) or super().is_leaf_module(m, qualname)

        def create_node(self, *args: Any, **kwargs: Any) -> Any:
            if _modes() != start:
                raise _Untraceable("its forward switches grad, inference or autocast mode, "
                                   "which a graph does not record")
            return super().create_node(*args, **kwargs)

        def call_module(self, m: torch.nn.Module, forward: Any, args: Any,
                        kwargs: Any) -> Any:
            if not self.is_leaf_module(m, self.path_of_module(m)) and _hooked(m):
                raise _Untraceable(f"{type(m).__name__} has hooks, which a graph would not "
                                   "call")
            return super().call_module(m, forward, args, kwargs)

    if _hooked(module):
        raise _Untraceable("the model has hooks, which a graph would not call")
    for p in inspect.signature(module.forward).parameters.values():
        if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise _Untraceable(f"its forward has an optional argument ({p.name})")
    modes = [(m, m.training) for m in module.modules()]
    try:
        graph = Tracer().trace(module)
        for mode in (True, False):
            for m, _ in modes:
                m.training = mode
            if str(Tracer().trace(module)) != str(graph):
                raise _Untraceable("its forward depends on training mode, which a graph "
                                   "would keep as traced")
    finally:
        for m, mode in modes:
            m.training = mode
    return graph


def _fuse_in_graph(module: torch.nn.Module, sync: bool, process_group: Any,
                   num_threads: Optional[int]) -> Optional[torch.nn.Module]:
    """The model's forward traced by torch.fx, each batch norm whose output goes only to a ReLU
    made the ReLU layer and the ReLU dropped from the graph.  None when there is nothing to
    fuse; the module itself, with a warning, when it cannot be traced or the traced module
    would not keep its state-dict keys."""
    name = type(module).__name__
    try:
        graph = _faithful_trace(module)
    except Exception as exc:  # any failure to trace: data-dependent control flow, ...
        warnings.warn(f"convert_batchnorm(fuse_relu=True): {name}'s forward cannot be traced "
                      f"by torch.fx ({type(exc).__name__}: {exc}); only batch norms followed "
                      "by a ReLU inside nn.Sequential were fused", RuntimeWarning, stacklevel=3)
        return module
    gm = torch.fx.GraphModule(module, graph, name)
    _keep_order(gm, module)
    modules = dict(gm.named_modules())
    # a layer called at several places is replaced at all of them: fused only if called once
    calls = collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_module")
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        bn = modules[node.target]
        if (not isinstance(bn, BatchNorm) or bn._relu or len(node.users) != 1
                or len(node.args) != 1 or node.kwargs or calls[node.target] != 1):
            continue
        (after,) = node.users
        parent, _, leaf = node.target.rpartition(".")
        if _relu_of(after, node, modules):
            gm.get_submodule(parent).add_module(
                leaf, _replacement(bn, True, sync, process_group, num_threads))
            after.replace_all_uses_with(node)
            gm.graph.erase_node(after)
            fused += 1
            continue
        other = None if sync or bn._sync else _residual_add(after, node)
        if other is None or len(after.users) != 1:
            continue
        (relu,) = after.users
        if not _relu_of(relu, after, modules):
            continue
        # bn -> + residual -> ReLU: one BatchNormAddReLU call, layer(x, residual)
        gm.get_submodule(parent).add_module(
            leaf, _replacement(bn, True, sync, process_group, num_threads, add=True))
        with gm.graph.inserting_before(after):
            fused_node = gm.graph.call_module(node.target, (node.args[0], other))
        relu.replace_all_uses_with(fused_node)
        for dead in (relu, after, node):
            gm.graph.erase_node(dead)
        fused += 1
    if not fused:
        return None
    if list(gm.state_dict()) != list(module.state_dict()):
        warnings.warn(f"convert_batchnorm(fuse_relu=True): the traced {name} would not keep "
                      "its state-dict keys (a part its forward never calls, or reaches "
                      "otherwise than as a submodule); only batch norms followed by a ReLU "
                      "inside nn.Sequential were fused", RuntimeWarning, stacklevel=3)
        return module
    gm.graph.lint()
    gm.recompile()
    gm.training = module.training     # (its submodules keep their own modes)
    return gm


def convert_batchnorm(module: torch.nn.Module, *, sync: bool = False, process_group: Any = None,
                      num_threads: Optional[int] = None,
                      fuse_relu: bool = False) -> torch.nn.Module:
    """Replace every torch.nn BatchNorm1d/2d/3d/SyncBatchNorm inside `module` by BatchNorm
    (SyncBatchNorm when sync), keeping parameters, buffers and train/eval mode.

    fuse_relu: every batch norm whose output goes to a ReLU alone becomes BatchNormReLU
    (SyncBatchNormReLU when sync), wherever the model computes it:
    * inside every nn.Sequential (with Sequential's own forward), a batch norm immediately
      followed by a torch.nn.ReLU (inplace or not) becomes the ReLU layer and the ReLU
      nn.Identity(), so the Sequential keeps its indices and state_dict keys;
    * in the model's forward (torch.relu, F.relu, x.relu_(), an nn.ReLU called there, inplace
      or not), found by tracing the forward with torch.fx; and a batch norm whose output goes
      only to an add whose sum goes only to a ReLU - a residual block's `out = bn(...);
      out += identity; relu(out)` - becomes BatchNormAddReLU, called as layer(x, identity)
      (not with sync).  The model then comes back as a torch.fx.GraphModule with the same
      submodules, parameters, buffers and state_dict keys, whose forward no longer calls
      those adds and ReLUs, its parameters and keys in their old order, its submodules in
      their own training modes (the model's methods, attributes and hooks are not carried
      over).  A batch norm the forward calls at more than one place is not fused.  A model
      torch.fx cannot trace, or whose graph would not do what its forward does (optional or
      variable arguments, grad/inference/autocast mode switched, a graph that depends on
      training mode, hooks on the model or on a submodule the graph inlines), keeps the
      Sequential rule alone, with a RuntimeWarning that says why.
    Layers already converted (BatchNorm) followed by a ReLU are fused too (a SyncBatchNorm of
    ours stays in its group; with sync and no process_group, a torch.nn.SyncBatchNorm keeps
    its own).  A ReLU with hooks is
    left alone; a batch norm with hooks, or a subclass of torch's with a forward of its own, is
    left unconverted, with a RuntimeWarning; an
    uninitialised LazyBatchNorm*d is refused (ValueError: run one forward first).
    Returns the converted model: `module` (converted in place), the GraphModule, or the new
    layer when `module` is a batch norm.
    """
    from torch.nn.modules.batchnorm import _BatchNorm
    if isinstance(module, (_BatchNorm, BatchNorm)):
        if not _convertible(module, ""):
            return module
        if isinstance(module, _BatchNorm):
            return _replacement(module, False, sync, process_group, num_threads)
        return module
    _convert_tree(module, sync, process_group, num_threads, fuse_relu)
    if fuse_relu:
        traced = _fuse_in_graph(module, sync, process_group, num_threads)
        return module if traced is None else traced
    return module


__all__ = ["BatchNorm", "BatchNormAddReLU", "BatchNormReLU", "SyncBatchNorm",
           "SyncBatchNormReLU", "batch_norm", "convert_batchnorm"]
