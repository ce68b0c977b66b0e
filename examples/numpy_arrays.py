"""Batch-normalization training backward on NumPy arrays, every array convention.

    python examples/numpy_arrays.py

Checks each result against the float64 reference and prints the largest error.  The file is
fully annotated: `mypy --strict examples/numpy_arrays.py` passes (the tests run it).
"""
from typing import Any, Optional

import numpy as np
from numpy.typing import NDArray

import bnbw_native as bn
from bnbw_native import half, ngraph, onednn, reference

Array = NDArray[Any]
EPS = 1e-5


def relative_error(got: Optional[Array], want: Optional[Array]) -> float:
    """The largest difference, relative to the largest reference value."""
    assert got is not None and want is not None
    ref = np.asarray(want, np.float64)
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


def check(name: str, got: tuple[Optional[Array], ...], want: tuple[Optional[Array], ...],
          tol: float) -> None:
    errors = [relative_error(g, w) for g, w in zip(got, want) if w is not None]
    print(f"{name:44s} max error {max(errors):.1e}")
    assert max(errors) < tol, name


def main() -> None:
    rng = np.random.default_rng(0)
    n, h, w, c = 16, 14, 14, 32
    x = (rng.standard_normal((n, h, w, c)) * 2 + 3).astype(np.float32)       # NHWC: "NXC"
    dy = rng.standard_normal(x.shape).astype(np.float32)
    mean = x.mean(axis=(0, 1, 2)).astype(np.float32)        # what a training forward saved
    var = x.var(axis=(0, 1, 2)).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, c).astype(np.float32)

    # oneDNN Graph BatchNormTrainingBackward: channels last is the default data_format
    res = bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS)
    want = reference.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS)
    check("training, NXC", tuple(res), want, 1e-5)

    # the same batch in NCHW memory: say data_format="NCX"
    x_nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    dy_nchw = np.ascontiguousarray(dy.transpose(0, 3, 1, 2))
    res_nchw = bn.batchnorm_training_backward(x_nchw, dy_nchw, mean, var, gamma, epsilon=EPS,
                                              data_format="NCX")
    assert res_nchw.diff_gamma is not None and res.diff_gamma is not None
    check("training, NCX", (res_nchw.diff_src.transpose(0, 2, 3, 1), res_nchw.diff_gamma),
          (want[0], want[1]), 1e-5)

    # num_outputs=1: oneDNN Graph's frozen-statistics formula, dy / sqrt(var + eps), gamma
    # ignored (not PyTorch's output_mask)
    frozen = bn.batchnorm_training_backward(x, dy, mean, var, epsilon=EPS, num_outputs=1)
    assert frozen.diff_gamma is None and frozen.diff_beta is None
    check("frozen statistics (num_outputs=1)", (frozen.diff_src,),
          (dy / np.sqrt(var.astype(np.float64) + np.float32(EPS)),), 1e-6)

    # preallocated outputs; diff_src may overwrite diff_dst in place
    dy_copy = dy.copy()
    dgamma, dbeta = np.empty(c, np.float32), np.empty(c, np.float32)
    bn.batchnorm_training_backward(x, dy_copy, mean, var, gamma, epsilon=EPS,
                                   out=(dy_copy, dgamma, dbeta))
    assert np.array_equal(dy_copy, res.diff_src) and np.array_equal(dgamma, res.diff_gamma)
    print(f"{'in place (out=(dy, ...))':44s} bit-identical")

    # any NumPy view: transposed, sliced, negative strides
    view = x[:, ::-1, :, :]
    res_view = bn.batchnorm_training_backward(view, dy[:, ::-1], mean, var, gamma, epsilon=EPS)
    assert np.array_equal(res_view.diff_src[:, ::-1], res.diff_src)
    print(f"{'negative strides':44s} bit-identical")

    # Intel spec BatchNormTrainingBackprop-1 and nGraph BatchNormTrainingBackprop
    intel = onednn.batch_norm_training_backprop(x, dy, mean, var, gamma, epsilon=EPS)
    check("Intel spec", intel, want, 1e-5)
    beta = np.zeros(c, np.float32)                        # validated, not used
    ng = ngraph.batch_norm_training_backprop(x_nchw, gamma, beta, mean, var, dy_nchw,
                                             epsilon=EPS)
    check("nGraph (channel axis 1)", (ng[0].transpose(0, 2, 3, 1), ng[1], ng[2]), want, 1e-5)

    # two phases, as data-parallel ranks do: each half of the batch reduces around the global
    # mean, the sums are added (an all-reduce), each half applies them
    halves = [(x[: n // 2], dy[: n // 2]), (x[n // 2:], dy[n // 2:])]
    partials = [bn.backward_reduce(xi, dyi, mean) for xi, dyi in halves]
    total = partials[0][0] + partials[1][0]
    count = partials[0][1] + partials[1][1]
    rows = [bn.backward_apply(xi, dyi, mean, var, gamma, total, count, epsilon=EPS)
            for xi, dyi in halves]
    assert np.array_equal(np.concatenate([r.diff_src for r in rows]), res.diff_src)
    print(f"{'two phases over 2 ranks':44s} bit-identical to one call")

    # float16 storage (arithmetic in float32, outputs rounded once); statistics stay float32
    x16, dy16 = half.float32_to_float16(x), half.float32_to_float16(dy)
    res16 = bn.batchnorm_training_backward(x16, dy16, mean, var, gamma, epsilon=EPS)
    want16 = reference.batchnorm_training_backward(x16, dy16, mean, var, gamma, epsilon=EPS)
    check("float16 storage", tuple(res16), want16, 2e-3)

    # errors say what to do
    try:
        bn.batchnorm_training_backward(x.astype(np.float64), dy, mean, var, epsilon=EPS)
    except TypeError as exc:
        print(f"float64 refused: {exc}")
    try:
        bn.batchnorm_training_backward(x_nchw, dy_nchw, mean, var, epsilon=EPS)
    except ValueError as exc:
        print(f"NCHW under the default data_format: {exc}")


if __name__ == "__main__":
    main()
