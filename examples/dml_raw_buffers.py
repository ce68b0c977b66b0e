"""DirectML batch-normalization gradients over raw memory: descriptors, operators, buffers.

    python examples/dml_raw_buffers.py

A DirectML caller describes memory (`TensorDesc`, strides in elements) and binds buffers, not
arrays: here bytearrays, ctypes arrays, memoryviews and integer addresses.  NumPy only makes
the data and checks the results against the float64 reference.  Fully annotated:
`mypy --strict examples/dml_raw_buffers.py` passes.
"""
import ctypes
from typing import Any

import numpy as np
from numpy.typing import NDArray

from bnbw_native import dml, half, reference

EPS = 1e-3
N, C, H, W = 4, 8, 6, 5


def relative_error(got: NDArray[Any], want: NDArray[np.float64]) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))


def main() -> None:
    rng = np.random.default_rng(1)
    # logical NCHW values, stored NHWC: the descriptor's strides say so
    x = (rng.standard_normal((N, H, W, C)) + 2).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    mean = x.mean(axis=(0, 1, 2)).astype(np.float32)
    var = x.var(axis=(0, 1, 2)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, C).astype(np.float32)

    nhwc = (H * W * C, 1, W * C, C)                     # NCHW sizes over NHWC memory
    big = dml.TensorDesc("float32", (N, C, H, W), strides=nhwc)
    stats = dml.TensorDesc("float32", (1, C, 1, 1))   # size 1: the summed dims
    print(big)
    print(f"minimum buffer {big.minimum_size_in_bytes} bytes, total "
          f"{big.total_tensor_size_in_bytes}")
    op = dml.BatchNormalizationTrainingGrad(
        input=big, input_gradient=big, mean=stats, variance=stats, scale=stats,
        output_gradient=big, output_scale_gradient=stats, output_bias_gradient=stats,
        epsilon=EPS)

    # raw memory of several kinds: bytes (read-only inputs), a bytearray, a ctypes array,
    # an ndarray's memoryview and an integer address (a C producer's pointer; the caller keeps it alive)
    dx = bytearray(big.minimum_size_in_bytes)
    dscale = (ctypes.c_float * C)()
    dbias = np.empty(C, np.float32)
    op.execute(input=x.tobytes(), input_gradient=dy.data, mean=mean.tobytes(),
               variance=var, scale=scale.ctypes.data, output_gradient=dx,
               output_scale_gradient=dscale, output_bias_gradient=dbias.data)

    stat_shape = (1, C, 1, 1)
    want = reference.backward(x.transpose(0, 3, 1, 2), dy.transpose(0, 3, 1, 2),
                              mean.reshape(stat_shape), var.reshape(stat_shape),
                              scale.reshape(stat_shape), epsilon=EPS, reduce_axes=(0, 2, 3))
    got_dx = np.frombuffer(dx, np.float32).reshape(N, H, W, C).transpose(0, 3, 1, 2)
    got_dscale = np.ctypeslib.as_array(dscale).reshape(stat_shape)
    errors = [relative_error(g, w) for g, w in
              zip((got_dx, got_dscale, dbias.reshape(stat_shape)), want)]
    print(f"training grad, NHWC memory: max error {max(errors):.1e}")
    assert max(errors) < 1e-5

    # frozen statistics (DirectML's BATCH_NORMALIZATION_GRAD), in place: output_gradient
    # may be input_gradient itself when their descriptors are identical
    frozen = dml.BatchNormalizationGrad(
        input=big, input_gradient=big, mean=stats, variance=stats, scale=stats,
        output_gradient=big, output_scale_gradient=stats, output_bias_gradient=stats,
        epsilon=EPS)
    grad = bytearray(dy.tobytes())
    ds, db = bytearray(4 * C), bytearray(4 * C)
    frozen.execute(input=x, input_gradient=grad, mean=mean, variance=var, scale=scale,
                   output_gradient=grad, output_scale_gradient=ds, output_bias_gradient=db)
    want_dx = dy * scale / np.sqrt(var.astype(np.float64) + np.float32(EPS))
    err = relative_error(np.frombuffer(grad, np.float32).reshape(x.shape), want_dx)
    print(f"frozen grad, in place: max error {err:.1e}")
    assert err < 1e-6

    # bfloat16 without ml_dtypes: uint16 bit patterns in any buffer
    def bits(a: NDArray[np.float32]) -> NDArray[np.uint16]:
        return half.float32_to_bfloat16(a).view(np.uint16)

    big16 = dml.TensorDesc("bfloat16", (N, C, H, W), strides=nhwc)
    stats16 = dml.TensorDesc("bfloat16", (1, C, 1, 1))
    op16 = dml.BatchNormalizationTrainingGrad(
        input=big16, input_gradient=big16, mean=stats16, variance=stats16, scale=stats16,
        output_gradient=big16, output_scale_gradient=stats16, output_bias_gradient=stats16,
        epsilon=EPS)
    dx16 = np.empty(x.shape, np.uint16)
    ds16, db16 = np.empty(C, np.uint16), np.empty(C, np.uint16)
    op16.execute(input=bits(x), input_gradient=bits(dy), mean=bits(mean), variance=bits(var),
                 scale=bits(scale), output_gradient=dx16, output_scale_gradient=ds16,
                 output_bias_gradient=db16)
    widened = half.bfloat16_to_float32(dx16).transpose(0, 3, 1, 2)
    err = relative_error(widened, want[0])
    print(f"training grad, bfloat16 bits: max error {err:.1e}")
    assert err < 3e-2

    # a descriptor the operator refuses: a ValueError naming the member
    try:
        dml.BatchNormalizationGrad(
            input=big, input_gradient=big, mean=dml.TensorDesc("float32", (1, C + 1, 1, 1)),
            variance=stats, scale=stats, output_gradient=big, output_scale_gradient=stats,
            output_bias_gradient=stats, epsilon=EPS)
    except ValueError as exc:
        print(f"refused: {exc}")


if __name__ == "__main__":
    main()
