"""Result checks: every implementation's result against the float64 reference."""
import math

import numpy as np

from cases import EPSILON

# Largest accepted error (see `relative_error`) of ours against the float64 reference:
# f32 arithmetic with f64 sums, then one rounding to the storage type.  A wrong formula or a
# wrong element is off by O(1).  The forward's rows use the same pairs: dst (one rounding to
# the storage type after an f32 multiply-add) like dx, its four statistics (f32, within an ulp
# of the f64 values by the contract) like diff_gamma and diff_beta.
TOLERANCE = {  # dtype: (dx or dst, the per-channel outputs, which are f32 for every T1 here)
    "f32": (2e-5, 2e-5),
    "f16": (2e-3, 2e-5),
    "bf16": (1.6e-2, 2e-5),
}

# A peer's result differing from the reference by more than this means the arguments we pass
# it do not have our semantics (precision alone stays far below it).
SEMANTICS_LIMIT = 0.05
PEER_SLACK = 10          # a peer above this many times our tolerance gets a note on its row


class CheckFailed(AssertionError):
    """A result disagrees with the float64 reference."""


def absmax(a):
    """max |a| without a temporary (NaN when `a` holds one); 0 for an empty array."""
    a = np.asarray(a)
    return float(max(a.max(), -a.min())) if a.size else 0.0


def relative_error(got, ref, floor=0.0, ref_absmax=None):
    """max |got - ref| / max(max |ref|, floor); 0 when both are exactly equal.  `floor` is
    the size of the terms the result is made of, for results that cancel to ~0."""
    if ref is None or got is None:
        return 0.0
    got = np.asarray(got)
    if got.size == 0:
        return 0.0
    if got.dtype.itemsize < 4:          # f16/bf16: exact in f32, which subtract understands
        got = got.astype(np.float32)
    diff = np.subtract(got, ref, dtype=np.float64)
    np.abs(diff, out=diff)
    worst = float(diff.max())
    if math.isnan(worst):                # NaN must sit exactly where the reference has NaN
        if not np.array_equal(np.isnan(got), np.isnan(ref)):
            return float("inf")
        worst = float(np.nanmax(diff)) if not np.isnan(diff).all() else 0.0
    if worst == 0.0:
        return 0.0
    scale = max(absmax(ref) if ref_absmax is None else ref_absmax, floor)
    return worst / scale if scale > 0 else float("inf")


def ref_scales(ref):
    """max |ref| per output (NaN ignored), computed once per reference result."""
    return [None if a is None else absmax(np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0))
            for a in ref]


def errors(result, ref, scales, problem, num_outputs):
    """Relative errors (dx, dgamma, dbeta) of `result` against the float64 `ref`, whose
    max |.| per output are `scales`."""
    r = 1 / np.sqrt(problem["var"].astype(np.float64) + float(np.float32(EPSILON)))
    lead = r * (np.abs(problem["gamma"]) if num_outputs == 3 else 1)
    floor = float(lead.max()) * problem["dy_absmax"] if lead.size else 0.0
    out = [relative_error(result[0], ref[0], floor, scales[0])]
    if num_outputs == 3:
        out += [relative_error(result[1], ref[1], 0.0, scales[1]),
                relative_error(result[2], ref[2], 0.0, scales[2])]
    else:
        out += [0.0, 0.0]
    return out


def forward_errors(result, ref, scales):
    """Relative errors of a forward `result` (dst, running_mean, running_variance, batch_mean,
    batch_variance; None for an output the implementation does not give) against the float64
    `ref`, whose max |.| per output are `scales`: dst and the means against their largest
    value, the variances against max(their largest value, epsilon), since a variance only acts
    through var + epsilon (a channel of one element has variance 0: an implementation that
    keeps 1/sqrt(var + eps) gives it back as a few ulps of eps).  None where `result` has
    None."""
    floors = (0.0, 0.0, EPSILON, 0.0, EPSILON)
    return [None if got is None else relative_error(got, want, floor, scale)
            for got, want, floor, scale in zip(result, ref, floors, scales)]


def within(errs, dtype_key, slack=1.0):
    """Whether errors (first: dx or dst; then per-channel outputs, None = not given) are within
    `slack` x our tolerance."""
    tol_dx, tol_p = TOLERANCE[dtype_key]
    rest = [e for e in errs[1:] if e is not None]
    return errs[0] <= tol_dx * slack and all(e <= tol_p * slack for e in rest)


def peer_verdict(name, errs, dtype_key, where):
    """None when a peer's errors are within PEER_SLACK x our tolerance, else a note for its
    row; raises CheckFailed beyond SEMANTICS_LIMIT (the peer was not asked what ours was)."""
    worst = max(e for e in errs if e is not None)
    if not worst <= SEMANTICS_LIMIT:
        raise CheckFailed(f"{name} differs from the reference by {worst:.2g} on {where}: the "
                          f"arguments passed to {name} do not mean what ours do")
    if not within(errs, dtype_key, slack=PEER_SLACK):
        return f"{name} err {worst:.0e}"
    return None
