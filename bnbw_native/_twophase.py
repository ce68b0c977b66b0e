"""Two phases for data-parallel training (SPEC 7).

Each rank reduces its local batch to per-channel sums around the GLOBAL mean; any engine sums
`partial` and `count` over ranks; each rank then applies the global sums to its own rows.
Format of `partial`: a C-contiguous float64 array of shape (2, C), row 0 = Sum dy, row 1 =
Sum (x - mean) * dy.  Single-process training equals reduce -> apply bit for bit, because both
run the same block partition and the same coefficient code.
"""
from ._pipeline import BackwardResult, Names, array_backward, graph_dtypes
from ._validate import check_choice

NAMES = Names(x="x", dy="dy", mean="mean", var="variance", scale="gamma", dx="diff_src",
              dscale="diff_gamma", dbias="diff_beta")


def backward_reduce(x, dy, mean, *, data_format="NXC", num_threads=None, exact_sums=False):
    """Local per-channel sums: returns (partial, count), partial float64 (2, C), count int.

    f16 and bf16 inputs are summed as every backward call sums them: in short float32 blocks
    added into float64, within ~2^-20 of the sum of |terms| (README, "Accuracy").
    exact_sums=True adds every term in float64 instead (slower; what a caller that derives
    statistics by cancelling algebra needs, e.g. Sum x*x - n*mean^2)."""
    check_choice(data_format, "data_format", ("NXC", "NCX"))
    if not isinstance(exact_sums, bool):
        raise TypeError(f"exact_sums must be True or False, got {exact_sums!r}")
    return array_backward(NAMES, x, dy, mean, None, None, epsilon=None,
                          data_format=data_format, formula="reduce", num_threads=num_threads,
                          dtype_rule=graph_dtypes, exact_sums=exact_sums)


def backward_apply(x, dy, mean, variance, gamma, partial, count, *, epsilon, data_format="NXC",
                   out=None, num_threads=None):
    """diff_src for the local rows and diff_gamma, diff_beta from the global sums.

    partial: the (2, C) float64 sums over all ranks; count: the global element count per
    channel (>= the local one).  gamma None means 1."""
    check_choice(data_format, "data_format", ("NXC", "NCX"))
    return BackwardResult(*array_backward(
        NAMES, x, dy, mean, variance, gamma, epsilon=epsilon, data_format=data_format,
        formula="apply", out=out, num_threads=num_threads, dtype_rule=graph_dtypes,
        partial=partial, count=count))
