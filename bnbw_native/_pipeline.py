"""The one call path of every array front-end: validate -> allocate -> plan -> kernel -> results.

A front-end only says what its arguments are called, where its channel axis is, which dtype
rule it follows and which formula it wants; this module does the rest, so all conventions
share one set of checks and one engine.
"""
from typing import NamedTuple, Optional

import numpy as np

from . import _config, _core
from ._validate import (check_epsilon, check_no_overlap, check_out, check_rank,
                        check_same_shape, check_vector, dtype_name, float_input)

OP = _core.OP_FLAGS
DTYPE_CODES = _core.DTYPE_CODES
N_SLOTS = 8

# What each formula asks of the engine.
FORMULAS = {
    "training": OP["compute_sums"] | OP["training"] | OP["write_dx"] | OP["write_params"],
    "frozen_dx": OP["write_dx"],
    "frozen": OP["compute_sums"] | OP["write_dx"] | OP["write_params"],
    "reduce": OP["compute_sums"] | OP["return_sums"],
    "apply": OP["given_sums"] | OP["training"] | OP["write_dx"] | OP["write_params"],
}


# Formulas the engine's fast path takes (plain NumPy calls; see _core.fast_backward).
FAST_FORMULAS = ("training", "frozen_dx")


class BackwardResult(NamedTuple):
    """diff_src (like src), diff_gamma and diff_beta (length C; None when not computed)."""
    diff_src: np.ndarray
    diff_gamma: Optional[np.ndarray]
    diff_beta: Optional[np.ndarray]


class Names(NamedTuple):
    """A convention's names for the engine's operands."""
    x: str
    dy: str
    mean: str
    var: str
    scale: str
    dx: str
    dscale: str
    dbias: str


# ---- dtype rules --------------------------------------------------------------------------

def graph_dtypes(names, t1, t2, stat_name):
    """oneDNN Graph / Intel spec: T1 in {f32, bf16, f16}, T2 in {f32, bf16}, T2 = bf16 only
    when T1 = bf16."""
    if t2 not in ("float32", "bfloat16") or (t2 == "bfloat16" and t1 != "bfloat16"):
        raise TypeError(
            f"{stat_name} has dtype {t2} with {names.x} of dtype {t1}; allowed "
            f"({names.x}/{names.dy}, {names.mean}/{names.var}/{names.scale}): (float32, "
            "float32), (bfloat16, float32), (bfloat16, bfloat16), (float16, float32)")


def same_dtypes(names, t1, t2, stat_name):
    """nGraph / DirectML: one element type for every tensor."""
    if t2 != t1:
        raise TypeError(f"{stat_name} must have the element type of {names.x} ({t1}), "
                        f"got {t2}")


# ---- the call --------------------------------------------------------------------------

def channel_axis(data_format, ndim):
    return 1 if data_format == "NCX" else ndim - 1


def array_backward(names, x, dy, mean, var, scale, *, epsilon, data_format, formula,
                   out=None, num_threads=None, dtype_rule=graph_dtypes, ranks=(2, 8),
                   extra_stats=(), partial=None, count=None, exact_sums=False):
    """Validate, run and return (dx, dscale, dbias) or, for formula="reduce", (sums, count).

    extra_stats: [(name, obj)] further length-C inputs that are validated but unused
    (nGraph's beta).  partial/count: the global sums of the two-phase API.  exact_sums: every
    term in float64 also for f16/bf16 storage (see _core._blocked_sums)."""
    if formula in FAST_FORMULAS and not extra_stats and not exact_sums:
        done = _core.fast_backward(
            x, dy, mean, var, scale, epsilon, data_format == "NXC", FORMULAS[formula],
            formula == "frozen_dx", out, num_threads, _config.resolve_threads,
            dtype_rule is graph_dtypes, ranks[0], ranks[1])
        if done is not None:
            return done
    x = float_input(x, names.x)
    check_rank(x, names.x, *ranks)
    dy = float_input(dy, names.dy)
    t1 = dtype_name(x)
    if dtype_name(dy) != t1:
        raise TypeError(f"{names.dy} must have the dtype of {names.x} ({t1}), "
                        f"got {dtype_name(dy)}")
    check_same_shape(dy, names.dy, x.shape, names.x)
    axis = channel_axis(data_format, x.ndim)
    C = x.shape[axis]

    stats = {}
    t2 = None
    for role, obj in (("mean", mean), ("var", var), ("scale", scale)) + tuple(extra_stats):
        name = getattr(names, role, role)
        if obj is None and (role == "scale" or (role == "var" and formula == "reduce")):
            stats[role] = None      # scale None means 1; the reduction needs no variance
            continue
        arr = float_input(obj, name)
        if t2 is None:
            t2 = dtype_name(arr)
            dtype_rule(names, t1, t2, name)
        elif dtype_name(arr) != t2:
            raise TypeError(f"{name} must have the dtype of {names.mean} ({t2}), "
                            f"got {dtype_name(arr)}")
        check_vector(arr, name, C)
        stats[role] = arr
    eps = check_epsilon(epsilon) if formula != "reduce" else 0.0
    nthreads = _config.resolve_threads(_config.check_num_threads(num_threads))
    sums = None
    if formula == "apply":
        sums, count = check_partial(partial, count, C, x.shape, axis)

    # outputs
    writes_params = formula not in ("frozen_dx", "reduce")
    specs = []
    if formula != "reduce":
        specs.append((f"out[0] ({names.dx})", x.shape, x.dtype))
    if writes_params:
        specs += [(f"out[1] ({names.dscale})", (C,), np.dtype(t2) if t2 else x.dtype),
                  (f"out[2] ({names.dbias})", (C,), np.dtype(t2) if t2 else x.dtype)]
    given = check_out(out, specs) if formula != "reduce" else None
    if given is not None:
        inputs = [(names.x, x), (names.dy, dy)] + [
            (getattr(names, role, role), arr) for role, arr in stats.items()]
        labels = [spec[0] for spec in specs]
        check_no_overlap(list(zip(labels, given)), inputs, in_place=(labels[0], names.dy))
        results = list(given)
    elif formula == "reduce":
        results = []
    else:
        results = [np.empty_like(x)]
        if writes_params:
            results += [np.empty(C, stats["mean"].dtype), np.empty(C, stats["mean"].dtype)]

    # plan and run
    ndim = x.ndim
    dx = results[0] if results else None
    dscale, dbias = (results[1], results[2]) if writes_params else (None, None)
    stat_dtype = stats["mean"].dtype if stats.get("mean") is not None else x.dtype

    def stat_row(arr):
        row = [0] * ndim
        if arr is not None:
            row[axis] = arr.strides[0]
        return row

    strides = [x.strides, dy.strides, (dx if dx is not None else dy).strides,
               stat_row(stats.get("mean")), stat_row(stats.get("var")),
               stat_row(stats.get("scale")), stat_row(dscale), stat_row(dbias)]
    reduced = [d != axis for d in range(ndim)]
    engine = _core.Engine(x.shape, reduced, strides, DTYPE_CODES[t1],
                          DTYPE_CODES[dtype_name(np.empty(0, stat_dtype))])
    if formula == "reduce":
        sums = np.zeros(2 * C)
    # frozen_dx is oneDNN Graph's diff_src-only result: gamma validated, then ignored
    scale = None if formula == "frozen_dx" else stats.get("scale")
    operands = [x, dy, dx, stats.get("mean"), stats.get("var"), scale, dscale, dbias]
    m = engine.count if count is None else count
    op = FORMULAS[formula] | (OP["exact_sums"] if exact_sums else 0)
    engine.execute(operands, op, eps, float(m), sums, nthreads)
    if formula == "reduce":
        return np.ascontiguousarray(sums.reshape(C, 2).T), engine.count
    return tuple(results) if writes_params else (results[0], None, None)


def check_partial(partial, count, C, shape, axis):
    """The global sums of the two-phase API: (2, C) float64, and an int count."""
    import numbers
    try:
        arr = np.asarray(partial) if partial is not None else None
    except (ValueError, TypeError) as exc:      # ragged nested sequences
        raise TypeError(f"partial must be a float64 array of shape (2, C) from "
                        f"backward_reduce ({exc})") from None
    if arr is None or arr.dtype != np.float64:
        raise TypeError("partial must be a float64 array of shape (2, C) from backward_reduce")
    if arr.shape != (2, C):
        raise ValueError(f"partial must have shape (2, {C}), got {arr.shape}")
    if isinstance(count, bool) or not isinstance(count, numbers.Integral):
        raise TypeError(f"count must be an int, got {type(count).__name__}")
    local = 1
    for d, size in enumerate(shape):
        local *= size if d != axis else 1
    if count >= 2 ** 63:
        raise ValueError(f"count must be below 2**63, got {count}")
    if count < local:
        raise ValueError(f"count must be at least the local element count per channel "
                         f"({local}), got {count}")
    sums = np.ascontiguousarray(arr.T).reshape(-1)   # engine layout: [Sg, Sxg] per channel
    return sums, int(count)

