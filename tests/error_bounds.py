"""How close a result must be to the float64 reference: the one table of the tests.

Every test that compares a result with the float64 reference (`bnbw_native.reference`) takes its
allowance from here, in one of two forms that share the constants below.

ROUNDING, per storage type: one rounding to nearest of a value v moves it by at most u |v|,
u = 2^-(p+1) with p stored mantissa bits (half an ulp), or by half the subnormal spacing when v
is subnormal.  float32 keeps p = 23 (u = 2^-24 ~ 6.0e-8), float16 p = 10 (u = 2^-11 ~ 4.9e-4),
bfloat16 p = 7 (u = 2^-8 ~ 3.9e-3): bfloat16 has float32's 8 exponent bits and pays for them with
3 mantissa bits, so its outputs are 8 times coarser than float16's, with float32's range
(float16 overflows past 65504).

The engine's arithmetic (bnbw_native._schedules, include/bnbw_kernels.h) forms x - mean in f32,
sums in f64, computes the per-channel constants k1, k2, k3 in f64 and rounds them to f32, then
evaluates dx = k1*dy + k2*(x - mean) + k3 in f32 (as two fused multiply-adds).  Every one of
those f32 steps errs by at most 2^-24 relative to the magnitude of what it combines, so with

    A = |gamma r g|,  B = |gamma r Sum g / M|,  Cc = |gamma| r^3 |x - mu| |Sum (x - mu) g| / M,
    D = |gamma| r^3 |x - mu| Sum |x - mu||g| / M       (the error of the f32 x - mu in dscale)

the f32 result is within ARITH (A + B + Cc + D) of the exact value, ARITH = 2^-20 (a safety
factor of ~2.7 over the six roundings).  dscale is within ARITH r Sum |x - mu||g|, dbias within
SUMS Sum |g| (f64 sums of f32 values).  f16/bf16 storage sums in f32 blocks of up to 16 terms
per lane (bnbw_kernels.h): at most 17 roundings of 2^-24 relative to the sum of |terms|
(BLOCKED_SUMS), which dscale's bound adds to ARITH; dbias then errs by up to BLOCKED_SUMS Sum |g|,
and k3 (through Sum g) moves dx by up to BLOCKED_SUMS |gamma| r Sum |g| / M, which the dx bound
adds as 2 ARITH |gamma| r Sum |g| / M.  A 16-bit output adds its one rounding (ROUNDING).

The two forms:

* `expected` + `assert_within`: those bounds element by element, computed from the inputs.  They
  hold for any data (random shapes with M up to 10^5, statistics that are not those of x,
  |mean| >> std, inf and NaN) and are tight enough to catch any formula error (an M - 1 for an M
  moves dx by ~1/M of its size, 2^-12 at M = 4096, far above 2^-20).

* `assert_close` with TOLERANCES: |got - ref| <= rtol |ref| + ntol max|ref| (+ half the
  subnormal spacing), for the hand-written cases whose inputs are well conditioned (statistics
  of x, dy of size ~1 correlated with x, M up to a few thousand), where it needs no inputs.
  rtol is the output's one rounding, u of its storage type.  ntol is the f32 arithmetic,
  NORMWISE = 2 ARITH = 2^-19 ~ 1.9e-6 of the largest result, the same for every storage type
  (the blocked sums of halves, 17 * 2^-24 ~ 1.0e-6 of the terms, are of the same size as ARITH).
  It is a measured allowance, not a proof: on this data the terms reach up to ~8 max|ref| (dx)
  and, for random-sign dy stored in halves, the terms of dbias up to ~17, but the roundings of
  independent terms do not all go one way.  The largest error seen, beyond the output's
  rounding, is 2.8e-7 max|ref| (0.3 ARITH, 4.7 u of f32), over the suite's ~1600 such
  comparisons and 6000 more random cases like test_random_shapes_match_reference's: 7 times
  below NORMWISE.  2^-19 still sees an M - 1 for an M up to M ~ 5 * 10^5, and a 16-bit output
  truncated instead of rounded (up to 2u).  Data whose terms dwarf the result belong to the
  first form.

This table replaced four: conftest (rtol 1e-6 f32, 2^-11 f16, 2^-8 bf16, ntol 1e-5),
test_conventions (max error / max|ref| <= 2e-6 f32, 2e-3 f16, 1.6e-2 bf16), test_capi and test_dml
(assert_allclose with rtol = atol / max|ref| = 2e-5 f32, 3e-3 f16, 2e-2 bf16).  Each allowed at
least what this one does (the half subnormal spacing aside: 2^-25 in f16, which counts only
where max|ref| < 0.004), so no comparison became looser.
"""
from typing import NamedTuple

import numpy as np

from bnbw_native import reference

try:
    import ml_dtypes
except ImportError:      # bf16 arrays are left out without ml_dtypes (contract 2)
    ml_dtypes = None

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
BF16 = None if ml_dtypes is None else np.dtype(ml_dtypes.bfloat16)
STORAGE = [F32, F16] + ([BF16] if BF16 is not None else [])


class Rounding(NamedTuple):
    """One rounding to nearest into a storage type."""

    unit: float      # u = 2^-(p+1): the most it moves a normal value, relative
    tiny: float      # half the subnormal spacing: the most it moves a subnormal value
    max: float       # the largest finite value; beyond it (plus half an ulp) lies infinity


# keyed by dtype name, so that bfloat16 is known without ml_dtypes (its uint16 bit patterns)
ROUNDING = {
    "float32": Rounding(2.0 ** -24, 2.0 ** -150, float(np.finfo(np.float32).max)),   # p = 23
    "float16": Rounding(2.0 ** -11, 2.0 ** -25, 65504.0),                              # p = 10
    "bfloat16": Rounding(2.0 ** -8, 2.0 ** -134, (2 - 2.0 ** -7) * 2.0 ** 127),        # p = 7
}

ARITH = 2.0 ** -20               # f32 arithmetic, relative to the terms, with margin
SUMS = 2.0 ** -30                # f64 sums of f32 values
BLOCKED_SUMS = 17 * 2.0 ** -24   # f32 blocks of f16/bf16 terms, then f64
NORMWISE = 2 * ARITH             # assert_close's share of max|ref| (module docstring)


class Tolerance(NamedTuple):
    """Allowed |got - ref| per element: ``rtol * |ref| + ntol * max|ref|`` (module docstring)."""

    rtol: float
    ntol: float


TOLERANCES = {name: Tolerance(rtol=r.unit, ntol=NORMWISE) for name, r in ROUNDING.items()}


def storage_name(dtype):
    """"float32", "float16" or "bfloat16" for a dtype (or its name)."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in ROUNDING:
        raise ValueError(f"{name!r} is not a storage type ({', '.join(ROUNDING)})")
    return name


def _as_float64(got, name, what):
    """The values of `got`, which must be of storage type `name`; bfloat16 may also come as its
    uint16 bit patterns (how it travels without ml_dtypes)."""
    got = np.asarray(got)
    if name == "bfloat16" and got.dtype == np.uint16:
        return (got.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    assert got.dtype.name == name, f"{what}: dtype {got.dtype}, expected {name}"
    return got.astype(np.float64)


def assert_close(got, ref, dtype, what="result"):
    """A result of storage type `dtype` against its float64 reference, within TOLERANCES.

    `got` must have exactly `dtype` (or be bfloat16 bits in uint16) and the shape of `ref`.
    Non-finite values must sit where the reference has them (NaN and inf are not told apart: IEEE
    results of different but equivalent evaluation orders may differ there)."""
    name = storage_name(dtype)
    g = _as_float64(got, name, what)
    ref = np.asarray(ref, dtype=np.float64)
    assert g.shape == ref.shape, f"{what}: shape {g.shape}, expected {ref.shape}"
    finite = np.isfinite(ref)
    mismatch = np.isfinite(g) != finite
    assert not mismatch.any(), (
        f"{what}: {mismatch.sum()} element(s) finite in one of got/ref only, first at "
        f"{np.argwhere(mismatch)[0].tolist()}")
    if not finite.any():
        return
    tol = TOLERANCES[name]
    g, ref = g[finite], ref[finite]
    scale = np.abs(ref).max()
    error = np.abs(g - ref)
    allowed = tol.rtol * np.abs(ref) + tol.ntol * scale + ROUNDING[name].tiny
    bad = error > allowed
    if bad.any():
        worst = np.argmax(error - allowed)
        raise AssertionError(
            f"{what}: {bad.sum()} of {bad.size} element(s) out of tolerance ({name}: {tol}); "
            f"worst: got {g[worst]!r}, ref {ref[worst]!r}, error {error[worst]:.3g} > allowed "
            f"{allowed[worst]:.3g} (max|ref| = {scale:.3g})")


def f64(a):
    return np.asarray(a).astype(np.float64)


def expected(x, dy, mean, var, scale, *, epsilon, axes, formula, count=None):
    """Reference (dx, dscale, dbias) and their error bounds; statistics keepdims-shaped.

    scale None means 1.  count: M of the formula when it differs from the local count."""
    axes = tuple(axes)
    blocked = np.asarray(x).dtype != F32
    ref = reference.backward(x, dy, mean, var, scale, epsilon=epsilon, reduce_axes=axes,
                             formula=formula, count=count)
    x, g, mu, v = f64(x), f64(dy), f64(mean), f64(var)
    gamma = np.abs(f64(scale)) if scale is not None else 1.0
    m = int(np.prod([x.shape[a] for a in axes])) if count is None else int(count)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        r = 1.0 / np.sqrt(v + float(np.float32(epsilon)))
        d = np.abs(x - mu)
        s_abs = (d * np.abs(g)).sum(axis=axes, keepdims=True)
        s_gabs = np.abs(g).sum(axis=axes, keepdims=True)
        a_term = gamma * r * np.abs(g)
        if formula == "frozen" or m == 0:
            dx_bound = ARITH * a_term
        else:
            s_xg = np.abs(((x - mu) * g).sum(axis=axes, keepdims=True))
            s_g = np.abs(g.sum(axis=axes, keepdims=True))
            dx_bound = ARITH * (a_term + gamma * r * (s_g + 2 * s_gabs * blocked) / m
                                + gamma * r ** 3 * d * (s_xg + s_abs) / m)
        dscale_bound = (ARITH + BLOCKED_SUMS * blocked) * r * s_abs
        dbias_bound = (BLOCKED_SUMS if blocked else SUMS) * s_gabs
    return ref, (dx_bound, dscale_bound, dbias_bound)


def assert_within(got, ref, bound, dtype, what="result"):
    """got (storage `dtype`, or bfloat16 bits in uint16) against ref: non-finite exactly where ref
    is, finite values within bound (the f32 computation) plus the final rounding to `dtype`."""
    name = storage_name(dtype)
    g = _as_float64(got, name, what)
    ref = np.broadcast_to(np.asarray(ref, np.float64), g.shape)
    bound = np.broadcast_to(np.asarray(bound, np.float64), g.shape)
    finite = np.isfinite(ref)
    u, tiny, largest = ROUNDING[name]
    with np.errstate(invalid="ignore", over="ignore"):
        allowed = bound * (1 + u) + u * np.abs(ref) + tiny
        err = np.abs(g - ref)
        # IEEE overflow: a value that may round past the largest finite one may be +-inf
        overflow = (np.isinf(g) & finite & (np.sign(g) == np.sign(ref))
                    & (np.abs(ref) + allowed >= largest))
    mismatch = (np.isfinite(g) != finite) & ~overflow
    assert not mismatch.any(), (
        f"{what}: {int(mismatch.sum())} element(s) finite in only one of got/ref, first at "
        f"{np.argwhere(mismatch)[0].tolist()}: got {g[mismatch][0]!r}, ref {ref[mismatch][0]!r}")
    bad = finite & ~overflow & ~(err <= allowed)
    if bad.any():
        i = np.argmax(np.where(bad, err - allowed, -np.inf))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} element(s) out of bounds ({name}); worst "
            f"at {np.unravel_index(i, bad.shape)}: got {g.flat[i]!r}, ref {ref.flat[i]!r}, "
            f"error {err.flat[i]:.3g} > allowed {allowed.flat[i]:.3g}")


def same_bits(a, b):
    """Two results (arrays or tuples of arrays/None) hold the very same bytes."""
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_bits(p, q) for p, q in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ---- memory layouts -----------------------------------------------------------------------

def _fill(dtype):
    return np.nan     # every storage type here has NaN: a stray read poisons the result


def _spans(shape, perm, steps, offset):
    """Buffer shape (memory order) and the slices of a view of `shape` in it.  Size-1 dims get
    neither step nor offset, so the buffer stays a small multiple of the view."""
    mem_shape, fwd = [], []
    for d in perm:
        n, s = shape[d], abs(steps[d])
        if n <= 1:
            mem_shape.append(n)
            fwd.append(slice(None))
        else:
            mem_shape.append((n - 1) * s + 1 + offset)
            fwd.append(slice(offset, offset + (n - 1) * s + 1, s))
    return mem_shape, tuple(fwd)


def strided(values, perm=None, steps=None, broadcast=None, offset=1):
    """A view holding `values` (its logical content) in a larger NaN-filled buffer.

    perm: memory order of the dims, outermost first.  steps: per dim a nonzero step in
    elements, negative = reversed.  broadcast: per dim, True = stride 0 (the view keeps the first
    slice of `values` along that dim and is read-only; callers take the view's content as the
    data).  offset: elements skipped at the start of every memory dim."""
    a = np.asarray(values)
    nd = a.ndim
    perm = tuple(range(nd)) if perm is None else tuple(perm)
    steps = (1,) * nd if steps is None else tuple(steps)
    broadcast = (False,) * nd if broadcast is None else tuple(broadcast)
    small = a[tuple(slice(0, 1) if b else slice(None) for b in broadcast)]
    mem_shape, fwd = _spans(small.shape, perm, steps, offset)
    buf = np.full(mem_shape, _fill(a.dtype), dtype=a.dtype)
    view = buf[fwd]
    flip = tuple(j for j, d in enumerate(perm) if steps[d] < 0)
    if flip:
        view = np.flip(view, flip)
    view = view.transpose(np.argsort(perm))
    view[...] = small
    if any(b and n > 1 for b, n in zip(broadcast, a.shape)):
        view = np.broadcast_to(view, a.shape)
    return view


class Sentinel:
    """An output view inside a larger buffer filled with a byte pattern, so a test can check
    both the view (written) and the gaps around it (never written)."""

    PATTERN = 0xA5

    def __init__(self, shape, dtype, perm=None, steps=None, offset=1):
        nd = len(shape)
        perm = tuple(range(nd)) if perm is None else tuple(perm)
        steps = (1,) * nd if steps is None else tuple(steps)
        mem_shape, fwd = _spans(shape, perm, steps, offset)
        self.buffer = np.empty(mem_shape, dtype)
        self.buffer.view(np.uint8)[...] = self.PATTERN
        view = self.buffer[fwd]
        mask = np.zeros(mem_shape, bool)
        mask[fwd] = True
        self._mask = mask
        flip = tuple(j for j, d in enumerate(perm) if steps[d] < 0)
        if flip:
            view = np.flip(view, flip)
        self.view = view.transpose(np.argsort(perm))

    def gaps_untouched(self):
        raw = self.buffer.view(np.uint8).reshape(self.buffer.shape + (-1,))
        return bool((raw[~self._mask] == self.PATTERN).all())

    def untouched(self):
        return bool((self.buffer.view(np.uint8) == self.PATTERN).all())
