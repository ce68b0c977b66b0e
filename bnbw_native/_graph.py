"""oneDNN Graph ``BatchNormTrainingBackward`` (SPEC 3.1; seeds 000, 001)."""
from ._pipeline import BackwardResult, Names, array_backward, graph_dtypes
from ._validate import check_choice, check_int_choice

NAMES = Names(x="src", dy="diff_dst", mean="mean", var="variance", scale="gamma",
              dx="diff_src", dscale="diff_gamma", dbias="diff_beta")


def batchnorm_training_backward(src, diff_dst, mean, variance, gamma=None, *, epsilon,
                                data_format="NXC", num_outputs=3, out=None, num_threads=None):
    """Gradients of a training-mode batch normalization, as oneDNN Graph computes them.

    num_outputs=3: diff_src, diff_gamma, diff_beta of the training forward (gamma = 1 when
    None).  num_outputs=1: what oneDNN Graph produces when only diff_src is attached, i.e.
    frozen statistics with gamma ignored: diff_src = diff_dst / sqrt(variance + epsilon);
    diff_gamma and diff_beta are then None.

    src, diff_dst: same dtype T1 (float32, bfloat16, float16), rank 2 to 8, any strides;
    mean, variance, gamma: 1-D of length C, same dtype T2 (float32, or bfloat16 when T1 is
    bfloat16).  data_format "NXC" (channels last, the default) or "NCX" (channel axis 1).
    out: preallocated outputs, one per returned output; diff_src may be diff_dst itself.
    Returns a BackwardResult(diff_src, diff_gamma, diff_beta).
    """
    check_choice(data_format, "data_format", ("NXC", "NCX"))
    num_outputs = check_int_choice(num_outputs, "num_outputs", (1, 3))
    formula = "training" if num_outputs == 3 else "frozen_dx"
    dx, dgamma, dbeta = array_backward(
        NAMES, src, diff_dst, mean, variance, gamma, epsilon=epsilon,
        data_format=data_format, formula=formula, out=out, num_threads=num_threads,
        dtype_rule=graph_dtypes)
    return BackwardResult(dx, dgamma, dbeta)
