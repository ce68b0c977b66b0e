"""nGraph ``BatchNormTrainingBackprop``: channel axis 1, one element type for every tensor,
beta validated but unused (it does not enter any gradient)."""
from ._arrays import TRAINING, backward
from ._rules import Convention

NGRAPH = Convention(dict(x="input", dy="normalized_delta", mean="mean", var="variance",
                         scale="gamma", beta="beta", dx="input_delta", dscale="gamma_delta",
                         dbias="beta_delta"),
                    dtype_rule="same", data_format=False, scale_required=True,
                    beta_required=True)


def batch_norm_training_backprop(input, gamma, beta, mean, variance, normalized_delta, *,
                                 epsilon, out=None, num_threads=None):
    """Training gradient in nGraph's argument order.

    input, normalized_delta: (N, C, ...) rank 2 to 8; gamma, beta, mean, variance: (C,); every
    tensor float32, float16 or bfloat16, all the same.
    Returns (input_delta, gamma_delta, beta_delta).
    """
    return backward(NGRAPH, TRAINING, input, normalized_delta, mean, variance, gamma,
                    epsilon, "NCX", out, num_threads, beta=beta)
