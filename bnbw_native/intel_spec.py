"""Intel spec ``BatchNormTrainingBackprop-1``: the training gradient."""
from ._arrays import TRAINING, backward
from ._rules import NXC_DEFAULT, Convention, check_data_format

INTEL = Convention(dict(x="input_forward", dy="output_delta", mean="mean", var="variance",
                        scale="gamma", dx="input_delta", dscale="gamma_delta",
                        dbias="beta_delta"))


def batch_norm_training_backprop(input_forward, output_delta, mean, variance, gamma=None, *,
                                 epsilon, data_format=NXC_DEFAULT, out=None, num_threads=None):
    """Gradient of batch normalization with respect to its input, gamma and beta.

    input_forward, output_delta: T1 (float32, float16, bfloat16), rank 2 to 8;
    mean, variance, gamma: 1-D of length C, T2 (float32, or bfloat16 when T1 is bfloat16);
    gamma None means 1.  data_format "NXC" (default) or "NCX".
    Returns (input_delta, gamma_delta, beta_delta).
    """
    data_format = check_data_format(data_format, input_forward)
    return backward(INTEL, TRAINING, input_forward, output_delta, mean, variance, gamma,
                    epsilon, data_format, out, num_threads)
