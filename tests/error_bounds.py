"""Rigorous per-element error bounds and memory layouts for the robustness tests.

The property, scale and concurrency modules check results of any size, layout and data against
the float64 reference (`bnbw_native.reference`).  A norm-wise tolerance (conftest.Tolerance) is
meant for the well-conditioned data of the hand-written tests; random shapes with M from 1 to
10^5, statistics that are not those of x and 16-bit storage need a bound that follows the
arithmetic instead.  The engine (bnbw_native._schedules and include/bnbw_kernels.h) forms x - mean in f32, sums in f64,
computes the per-channel constants k1, k2, k3 in f64 and rounds them to f32, then evaluates
dx = k1*dy + k2*(x - mean) + k3 in f32 (as two fused multiply-adds).  Every one of those f32 steps errs by at most 2^-24
relative to the magnitude of what it combines, so with

    A = |gamma r g|,  B = |gamma r Sum g / M|,  Cc = |gamma| r^3 |x - mu| |Sum (x - mu) g| / M,
    D = |gamma| r^3 |x - mu| Sum |x - mu||g| / M       (the error of the f32 x - mu in dscale)

the f32 result is within 2^-20 (A + B + Cc + D) of the exact value (a safety factor of ~2 over
the six roundings).  dscale is within 2^-20 r Sum |x - mu||g|, dbias within 2^-30 Sum |g|.  A
16-bit output adds the one rounding to nearest: half an ulp, u |v| with u = 2^-(p+1), plus half
the subnormal spacing.  These bounds are tight enough to catch any formula error (an M - 1 for
an M moves dx by ~1/M of its size, 2^-12 at M = 4096, far above 2^-20).

f16/bf16 storage sums in f32 blocks of up to 16 terms per lane (bnbw_kernels.h): at most 17
roundings of 2^-24 relative to the sum of |terms| (BLOCKED_SUMS), which dscale's bound adds to
ARITH; dbias then errs by up to BLOCKED_SUMS Sum |g|, and k3 (through Sum g) moves dx by up to
BLOCKED_SUMS |gamma| r Sum |g| / M, which the dx bound adds as 2 ARITH |gamma| r Sum |g| / M.
"""
import numpy as np

from bnbw_native import reference

try:
    import ml_dtypes
except ImportError:      # bf16 cases are left out without ml_dtypes (SPEC 2)
    ml_dtypes = None

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
BF16 = None if ml_dtypes is None else np.dtype(ml_dtypes.bfloat16)
STORAGE = [F32, F16] + ([BF16] if BF16 is not None else [])

# unit roundoff of the one final rounding, and half the smallest subnormal spacing
_ROUND = {F32: (2.0 ** -24, 2.0 ** -150), F16: (2.0 ** -11, 2.0 ** -25)}
if BF16 is not None:
    _ROUND[BF16] = (2.0 ** -8, 2.0 ** -134)

ARITH = 2.0 ** -20          # f32 arithmetic, with margin (module docstring)
SUMS = 2.0 ** -30           # f64 sums of f32 values
BLOCKED_SUMS = 17 * 2.0 ** -24   # f32 blocks of f16/bf16 terms, then f64 (module docstring)


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


def _max_finite(dtype):
    return float(ml_dtypes.finfo(dtype).max if dtype == BF16 else np.finfo(dtype).max)


def assert_within(got, ref, bound, dtype, what="result"):
    """got (storage `dtype`) against ref: non-finite exactly where ref is, finite values within
    bound (the f32 computation) plus the final rounding to `dtype`."""
    dtype = np.dtype(dtype)
    got = np.asarray(got)
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    ref = np.broadcast_to(np.asarray(ref, np.float64), got.shape)
    bound = np.broadcast_to(np.asarray(bound, np.float64), got.shape)
    g = got.astype(np.float64)
    finite = np.isfinite(ref)
    u, tiny = _ROUND[dtype]
    with np.errstate(invalid="ignore", over="ignore"):
        allowed = bound * (1 + u) + u * np.abs(ref) + tiny
        err = np.abs(g - ref)
        # IEEE overflow: a value that may round past the largest finite one may be +-inf
        overflow = (np.isinf(g) & finite & (np.sign(g) == np.sign(ref))
                    & (np.abs(ref) + allowed >= _max_finite(dtype)))
    mismatch = (np.isfinite(g) != finite) & ~overflow
    assert not mismatch.any(), (
        f"{what}: {int(mismatch.sum())} element(s) finite in only one of got/ref, first at "
        f"{np.argwhere(mismatch)[0].tolist()}: got {g[mismatch][0]!r}, ref {ref[mismatch][0]!r}")
    bad = finite & ~overflow & ~(err <= allowed)
    if bad.any():
        i = np.argmax(np.where(bad, err - allowed, -np.inf))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} element(s) out of bounds ({dtype}); worst "
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
