"""Synchronised batch-norm backward over existing distributed engines.

Data-parallel training splits a batch over ranks; the training backward then needs the
per-channel sums of every rank.  Each function here is the two-phase API with one collective
in the middle:

    partial, count = backward_reduce(local x, local dy, GLOBAL mean)     # local sums, f64
    all-reduce partial (float64 (2, C)) and count (int64) in place       # the engine's job
    backward_apply(local x, local dy, ..., partial, count)               # local rows

* ``sync_batchnorm_backward``: ``torch.distributed`` (gloo, or MPI when torch was built with
  it); NumPy buffers go to the collective through ``torch.from_numpy``, no copy.
* ``sync_batchnorm_backward_mpi``: mpi4py ``comm.Allreduce(MPI.IN_PLACE, ...)`` on the NumPy
  buffers.

`mean` and `variance` are the GLOBAL statistics the caller's forward computed (every rank
passes the same values).  diff_src holds this rank's rows; diff_gamma and diff_beta come from
the global sums, so they are the gradients of the whole batch and equal on every rank (the
collectives give every rank the same sum).  Under DistributedDataParallel, which averages
parameter gradients over ranks, use ``bnbw_native.autograd.SyncBatchNorm`` instead: it returns
the local parameter gradients, as ``torch.nn.SyncBatchNorm`` does.

Every rank must call with the same C, dtypes and group.  Arguments are checked before the
collective where the check is local (x, dy, mean, data_format, epsilon, num_threads), so a
call refused on every rank leaves no rank waiting; a call refused on some ranks only leaves
the others in the collective until the group's timeout, as with any collective.

torch and mpi4py are optional: they are imported on the first call, never with the package.
"""
from ._onednn_graph import BackwardResult
from ._rules import NXC_DEFAULT, check_data_format, check_epsilon
from ._two_phase import apply_sums, backward_apply, backward_reduce

_TORCH_HINT = ("sync_batchnorm_backward needs PyTorch with torch.distributed: "
               "pip install 'bnbw_native[torch]'")
_MPI_HINT = ("sync_batchnorm_backward_mpi needs mpi4py and an MPI library: "
             "pip install 'bnbw_native[mpi]' (with e.g. Open MPI: "
             "apt-get install openmpi-bin libopenmpi-dev)")


def _torch_distributed():
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise ImportError(_TORCH_HINT) from exc
    if not dist.is_available():
        raise ImportError(_TORCH_HINT + " (this PyTorch build has no torch.distributed)")
    return torch, dist


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(_MPI_HINT) from exc
    return MPI


def _local_checks(data_format, epsilon, x, stacklevel):
    """What the apply phase would refuse after the collective, checked before it; returns the
    data_format (a DataFormatWarning names the frame `stacklevel` levels up from here)."""
    data_format = check_data_format(data_format, x, stacklevel + 1)
    check_epsilon(epsilon)
    return data_format


def sync_batchnorm_backward(x, dy, mean, variance, gamma=None, *, epsilon,
                            data_format=NXC_DEFAULT,
                            group=None, out=None, num_threads=None, relu_dst=None,
                            diff_residual=None):
    """Training backward of a batch norm whose batch is split over a torch.distributed group.

    x, dy: this rank's rows (any array, any layout, as batchnorm_training_backward takes, DLPack producers
    included); mean, variance: the GLOBAL batch statistics; gamma None means 1.
    group: a torch.distributed process group (None: the default group), initialised by the
    caller with a backend that reduces CPU tensors (gloo, or mpi).
    Returns BackwardResult(diff_src for the local rows, diff_gamma, diff_beta of the whole
    batch).  out, num_threads, relu_dst (this rank's rows of the forward's ReLU output, for a
    SyncBatchNorm followed by ReLU) and diff_residual as in batchnorm_training_backward.
    """
    result, _ = _torch_sync(x, dy, mean, variance, gamma, epsilon=epsilon,
                            data_format=data_format, group=group, out=out,
                            num_threads=num_threads, relu_dst=relu_dst,
                            diff_residual=diff_residual)
    return result


def _check_group(group):
    """torch.distributed, checked ready for a collective over `group` (None: default)."""
    torch, dist = _torch_distributed()
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group('gloo', ...) first")
    if group is not None and dist.get_rank(group) < 0:
        # torch would silently skip the collective on a non-member: refuse instead
        raise ValueError("group: this process is not a member of the given process group")
    return torch, dist


def _torch_sync(x, dy, mean, variance, gamma, *, epsilon, data_format, group, out,
                num_threads, keep_local=False, relu_dst=None, diff_residual=None,
                mean_low=None):
    """The torch.distributed path; also returns a copy of the local sums when keep_local
    (the autograd layer derives DDP-style local parameter gradients from them, and passes
    the forward's mean_low: the mean is mean + mean_low)."""
    torch, dist = _check_group(group)
    data_format = _local_checks(data_format, epsilon, x, 3)
    partial, count = backward_reduce(x, dy, mean, data_format=data_format,
                                     num_threads=num_threads, relu_dst=relu_dst)
    local = partial.copy() if keep_local else None
    counts = torch.tensor([count], dtype=torch.int64)
    # Both collectives in flight at once; from_numpy shares partial's memory, so the sums
    # land in place.
    pending = [dist.all_reduce(torch.from_numpy(partial), group=group, async_op=True),
               dist.all_reduce(counts, group=group, async_op=True)]
    for work in pending:
        work.wait()
    result = apply_sums(x, dy, mean, variance, gamma, partial, int(counts[0]),
                        epsilon=epsilon, data_format=data_format, out=out,
                        num_threads=num_threads, relu_dst=relu_dst,
                        diff_residual=diff_residual, mean_low=mean_low)
    return result, local


def sync_batchnorm_backward_mpi(x, dy, mean, variance, gamma=None, *, epsilon,
                                data_format=NXC_DEFAULT, comm=None, out=None, num_threads=None,
                                relu_dst=None, diff_residual=None):
    """sync_batchnorm_backward over an mpi4py communicator (None: MPI.COMM_WORLD).

    The sums are all-reduced in place in the NumPy buffers (MPI.IN_PLACE); every rank of
    `comm` must call.  Returns BackwardResult as sync_batchnorm_backward does.
    """
    import numpy as np

    MPI = _mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    data_format = _local_checks(data_format, epsilon, x, 2)
    partial, count = backward_reduce(x, dy, mean, data_format=data_format,
                                     num_threads=num_threads, relu_dst=relu_dst)
    counts = np.array([count], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, partial, op=MPI.SUM)
    comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
    return backward_apply(x, dy, mean, variance, gamma, partial, int(counts[0]),
                          epsilon=epsilon, data_format=data_format, out=out,
                          num_threads=num_threads, relu_dst=relu_dst,
                          diff_residual=diff_residual)


__all__ = ["BackwardResult", "sync_batchnorm_backward", "sync_batchnorm_backward_mpi"]
