"""nGraph ``BatchNormTrainingBackprop`` (SPEC 3.3; seed 003): channel axis 1, one element
type for every tensor, beta validated but unused (it does not enter any gradient)."""
from ._pipeline import Names, array_backward, same_dtypes
from ._validate import float_input

NAMES = Names(x="input", dy="normalized_delta", mean="mean", var="variance", scale="gamma",
              dx="input_delta", dscale="gamma_delta", dbias="beta_delta")


def batch_norm_training_backprop(input, gamma, beta, mean, variance, normalized_delta, *,
                                 epsilon, out=None, num_threads=None):
    """Training gradient in nGraph's argument order.

    input, normalized_delta: (N, C, ...) rank 2 to 8; gamma, beta, mean, variance: (C,); every
    tensor float32, float16 or bfloat16, all the same.
    Returns (input_delta, gamma_delta, beta_delta).
    """
    gamma = float_input(gamma, "gamma")      # required here, unlike the oneDNN conventions
    return array_backward(NAMES, input, normalized_delta, mean, variance, gamma,
                          epsilon=epsilon, data_format="NCX", formula="training", out=out,
                          num_threads=num_threads, dtype_rule=same_dtypes,
                          extra_stats=(("beta", beta),))
