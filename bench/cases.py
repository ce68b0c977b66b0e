"""The cases: named shapes (bench/shapes.py) x memory layouts x storage dtypes x formulas, the
data each case runs on, and the traffic model that gives a case its bytes.

Formulas of ``batchnorm_training_backward``:
    training    num_outputs=3
    frozen      num_outputs=1 (dx = dy / sqrt(var + eps), gamma ignored)
    relu        num_outputs=3 with relu_dst = the forward's output y = max(bn(x), 0), stored in
                the dtype of x (a batch norm followed by ReLU)
    relu-mask   the same with relu_dst = (y > 0) as a bool array
and of ``batchnorm_training_forward`` (all five outputs, momentum MOMENTUM):
    forward       y = gamma * (x - batch_mean) / sqrt(batch_variance + eps) + beta
    forward-relu  the same with fuse_relu=True (a batch norm followed by ReLU)
"""
import zlib

import numpy as np

import shapes as shape_lists

try:
    import ml_dtypes
except ImportError:      # bf16 rows are skipped with a note
    ml_dtypes = None

EPSILON = 1e-5
# The forward's momentum, oneDNN Graph's: the weight of the OLD running statistics (torch's
# BatchNorm2d default, 0.1, weighs the new ones: the same update as ours with 0.9).
MOMENTUM = 0.9
LAYOUTS = ("NCX", "NXC", "strided")
FORMULAS = ("training", "frozen", "relu", "relu-mask", "forward", "forward-relu")
DEFAULT_FORMULAS = ("training", "frozen")
RELU_FORMULAS = ("relu", "relu-mask")              # the backward's fused ReLU
FORWARD_FORMULAS = ("forward", "forward-relu")     # batchnorm_training_forward
NUM_OUTPUTS = {"training": 3, "frozen": 1, "relu": 3, "relu-mask": 3, "forward": 5,
               "forward-relu": 5}
# What each row's `err` list holds, in order (the forward's result order).
OUTPUT_NAMES = {"backward": ("diff_src", "diff_gamma", "diff_beta"),
                "forward": ("dst", "running_mean", "running_variance", "batch_mean",
                            "batch_variance")}

DTYPES = {"f32": np.float32, "f16": np.float16}
if ml_dtypes is not None:
    DTYPES["bf16"] = ml_dtypes.bfloat16
DTYPE_KEYS = ("f32", "f16", "bf16")

# Traffic model, two-pass schedule: how many times a tensor of the storage dtype crosses the
# memory interface per element (PASSES), plus one-byte mask passes (MASK_PASSES).  training:
# the reduce reads x, dy, the apply reads x, dy and writes dx; relu adds y to both reads.
# forward (the two-read model): the statistics pass reads x, the normalisation reads x again
# and writes y; the fused ReLU is applied in that same pass.
PASSES = {"training": 5, "frozen": 2, "relu": 7, "relu-mask": 5, "forward": 3,
          "forward-relu": 3}
MASK_PASSES = {"training": 0, "frozen": 0, "relu": 0, "relu-mask": 2, "forward": 0,
               "forward-relu": 0}
TENSORS = {"training": 3, "frozen": 2, "relu": 4, "relu-mask": 3, "forward": 2,
           "forward-relu": 2}                                     # cache footprint
MASK_TENSORS = {"training": 0, "frozen": 0, "relu": 0, "relu-mask": 1, "forward": 0,
                "forward-relu": 0}
STRIDE_FACTOR = {"NCX": 1, "NXC": 1, "strided": 2}
# The probe pattern that stands for each formula (bench/stream.c).
PROBE_PATTERN = {"training": "training", "frozen": "scale", "relu": "training",
                 "relu-mask": "training", "forward": "forward", "forward-relu": "forward"}


def traffic(formula, layout, itemsize, elements):
    """(model bytes of one call, footprint bytes, bytes of one probe array)."""
    factor = STRIDE_FACTOR[layout]
    model = (PASSES[formula] * itemsize + MASK_PASSES[formula]) * elements * factor
    footprint = (TENSORS[formula] * itemsize + MASK_TENSORS[formula]) * elements * factor
    return model, footprint, itemsize * elements * factor


def select_shapes(text, quick):
    """{name: shape} for a --shapes value: names and groups, comma separated."""
    if not text:
        return dict(shape_lists.QUICK if quick else shape_lists.DEFAULT)
    chosen = {}
    for item in text.split(","):
        item = item.strip()
        if item in shape_lists.GROUPS:
            chosen.update(shape_lists.GROUPS[item])
        elif item == "QUICK":
            chosen.update(shape_lists.QUICK)
        elif item in shape_lists.ALL:
            chosen[item] = shape_lists.ALL[item]
        else:
            raise SystemExit(f"unknown shape or group: {item} (groups: "
                             f"{', '.join(shape_lists.GROUPS)}, QUICK)")
    return chosen


def seed_of(name, dtype_key):
    return zlib.crc32(f"{name}/{dtype_key}".encode())


def make_problem(name, shape, dtype_key, relu=False):
    """Logical NCX inputs (rounded to the storage dtype) and f32 statistics computed from
    them in f64, as a training forward would have saved them.  With `relu`, also the forward's
    output y = max(gamma * (x - mean) / sqrt(var + eps) + beta, 0) in the storage dtype.
    For the forward: "run_mean" and "run_var", the previous running statistics it is given
    (near the batch's, as after some steps of training)."""
    dtype = DTYPES[dtype_key]
    rng = np.random.default_rng(seed_of(name, dtype_key))
    C = shape[1]
    bshape = (1, C) + (1,) * (len(shape) - 2)
    centre = rng.uniform(-2, 2, C).astype(np.float32).reshape(bshape)
    spread = rng.uniform(0.5, 2, C).astype(np.float32).reshape(bshape)
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= spread
    x += centre
    dy = rng.standard_normal(shape, dtype=np.float32)
    x = x.astype(dtype, copy=False)
    dy = dy.astype(dtype, copy=False)
    red = tuple(d for d in range(len(shape)) if d != 1)
    x64 = x.astype(np.float64)
    mean64 = x64.mean(axis=red)
    x64 -= mean64.reshape(bshape)
    np.square(x64, out=x64)
    var64 = x64.mean(axis=red)
    del x64
    problem = {
        "name": name, "shape": tuple(shape), "dtype_key": dtype_key,
        "x": x, "dy": dy,
        "mean": mean64.astype(np.float32), "var": var64.astype(np.float32),
        "gamma": (1 + 0.25 * rng.standard_normal(C)).astype(np.float32),
        # a shift of either sign, so that channels are active from ~10% to ~90%
        "beta": (0.5 * rng.standard_normal(C)).astype(np.float32),
        "dy_absmax": float(np.abs(dy).max()) if dy.size else 0.0,
    }
    # drawn after everything above, so the backward's data is what it was before they existed
    problem["run_mean"] = (mean64 + 0.1 * rng.standard_normal(C)).astype(np.float32)
    problem["run_var"] = (var64 * rng.uniform(0.5, 1.5, C)).astype(np.float32)
    if relu:
        r = (1 / np.sqrt(problem["var"] + np.float32(EPSILON))).astype(np.float32)
        y = x.astype(np.float32)
        y -= problem["mean"].reshape(bshape)
        y *= (problem["gamma"] * r).reshape(bshape)
        y += problem["beta"].reshape(bshape)
        np.maximum(y, 0, out=y)
        problem["y"] = y.astype(dtype, copy=False)
    return problem


def arrange(logical, layout, fill):
    """(array, gaps): a logical NCX array laid out like `layout`.  NXC: a C-contiguous copy
    with the channel last.  strided: every other element of a buffer twice as wide on the
    innermost axis, whose other half (`gaps`, else None) holds `fill`."""
    if layout == "NCX":
        return logical, None
    if layout == "NXC":
        return np.ascontiguousarray(np.moveaxis(logical, 1, -1)), None
    if layout == "strided":
        buf = np.full(logical.shape[:-1] + (2 * logical.shape[-1],), fill, logical.dtype)
        buf[..., ::2] = logical
        return buf[..., ::2], buf[..., 1::2]
    raise ValueError(layout)


def layout_arrays(problem, layout):
    """The case's arrays in one layout: x, dy, dx (zeros), data_format, dx_gaps (the unused
    half of a strided dx, NaN to catch stray writes; None otherwise), and for relu problems
    y, mask (y > 0 as bool) and g (dy where the mask is set, else 0: the masked gradient)."""
    x, _ = arrange(problem["x"], layout, np.nan)
    dy, _ = arrange(problem["dy"], layout, np.nan)
    dx, gaps = arrange(np.zeros_like(problem["x"]), layout, np.nan)
    arrays = {"x": x, "dy": dy, "dx": dx, "dx_gaps": gaps,
              "data_format": "NXC" if layout == "NXC" else "NCX"}
    if "y" in problem:
        y, _ = arrange(problem["y"], layout, np.nan)
        mask, _ = arrange(problem["y"] > 0, layout, False)
        arrays.update(y=y, mask=mask, g=np.where(mask, dy, 0).astype(dy.dtype))
    return arrays


def to_layout(logical, layout):
    """A logical NCX array arranged like `layout`'s arrays (NXC moves C last)."""
    return np.moveaxis(logical, 1, -1) if layout == "NXC" else logical
