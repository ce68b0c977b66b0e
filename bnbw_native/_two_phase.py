"""Two phases, for data-parallel training: the backward's (public) and the forward's (the
torch layers' SyncBatchNorm).

Each rank reduces its local batch to per-channel sums around the GLOBAL mean; any engine sums
`partial` and `count` over ranks; each rank then applies the global sums to its own rows.
Format of `partial`: a C-contiguous float64 array of shape (2, C), row 0 = Sum dy, row 1 =
Sum (x - mean) * dy.  Single-process training equals reduce -> apply bit for bit, because both
run the same block partition and the same coefficient code.
"""
from ._arrays import APPLY, FORWARD_APPLY, FORWARD_REDUCE, REDUCE, backward, forward
from ._onednn_graph import BackwardResult
from ._rules import NXC_DEFAULT, Convention, check_data_format

TWO_PHASE = Convention(dict(x="x", dy="dy", mean="mean", var="variance", scale="gamma",
                            dx="diff_src", dscale="diff_gamma", dbias="diff_beta",
                            relu_dst="relu_dst", diff_residual="diff_residual",
                            partial="partial"))


def backward_reduce(x, dy, mean, *, data_format=NXC_DEFAULT, num_threads=None, exact_sums=False,
                    relu_dst=None):
    """Local per-channel sums: returns (partial, count), partial float64 (2, C), count int.

    f16 and bf16 inputs are summed as every backward call sums them: in short float32 blocks
    added into float64, within ~2^-20 of the sum of |terms|.  exact_sums=True adds every term
    in float64 instead (slower; what a caller that derives statistics by cancelling algebra
    needs, e.g. Sum x*x - n*mean^2).  relu_dst: the forward's ReLU output (or bool mask), as in
    batchnorm_training_backward; the sums are then those of the masked gradient."""
    data_format = check_data_format(data_format, x)
    if not isinstance(exact_sums, bool):
        raise TypeError(f"exact_sums must be True or False, got {exact_sums!r}")
    return backward(TWO_PHASE, REDUCE, x, dy, mean, None, None, None, data_format, None,
                    num_threads, relu_dst=relu_dst, exact_sums=exact_sums)


def backward_apply(x, dy, mean, variance, gamma, partial, count, *, epsilon,
                   data_format=NXC_DEFAULT,
                   out=None, num_threads=None, relu_dst=None, diff_residual=None):
    """diff_src for the local rows and diff_gamma, diff_beta from the global sums.

    partial: the (2, C) float64 sums over all ranks; count: the global element count per
    channel (>= the local one).  gamma None means 1.  relu_dst, diff_residual: as in
    batchnorm_training_backward (pass the same relu_dst to backward_reduce)."""
    return apply_sums(x, dy, mean, variance, gamma, partial, count, epsilon=epsilon,
                      data_format=check_data_format(data_format, x), out=out,
                      num_threads=num_threads, relu_dst=relu_dst, diff_residual=diff_residual)


def apply_sums(x, dy, mean, variance, gamma, partial, count, *, epsilon, data_format, out,
               num_threads, relu_dst, diff_residual, mean_low=None):
    """backward_apply with a checked data_format; mean_low (the torch layers'): the mean is
    mean + mean_low, the sums in `partial` taken around mean."""
    return BackwardResult(*backward(TWO_PHASE, APPLY, x, dy, mean, variance, gamma, epsilon,
                                    data_format, out, num_threads, relu_dst=relu_dst,
                                    diff_residual=diff_residual, partial=partial,
                                    count=count, mean_low=mean_low))


# The forward in two phases.  Every rank sums its rows around one shift the ranks share, the
# sums and counts are all-reduced, and each rank normalises its rows with the global sums.
FORWARD_PHASES = Convention(dict(x="x", mean="shift", var="variance", scale="gamma", beta="beta",
                                 dx="y", run_mean="running_mean", run_var="running_variance",
                                 batch_mean="batch_mean", batch_var="batch_variance",
                                 partial="sums"))


def forward_reduce(x, shift, *, data_format, num_threads=None):
    """[Sum (x - shift), Sum (x - shift)^2] per channel as float64 (2, C), and the local count
    per channel; exact f64 terms, as the one-process forward sums them."""
    return forward(FORWARD_PHASES, x, shift, None, None, None, None, None, data_format, False,
                   None, num_threads, formula=FORWARD_REDUCE)


def forward_apply(x, shift, gamma, beta, sums, count, *, epsilon, data_format, relu=False,
                  out=None, num_threads=None, mean_low=None):
    """The forward's outputs from the global sums around `shift` and the global count:
    (y, _, _, batch_mean, batch_variance) - the two running statistics equal the batch ones
    here (momentum 0); the layer keeps its own.  mean_low: an output for what rounding the
    batch mean left out."""
    return forward(FORWARD_PHASES, x, shift, shift, gamma, beta, epsilon, 0.0, data_format,
                   relu, out, num_threads, formula=FORWARD_APPLY, partial=sums, count=count,
                   mean_low=mean_low)
