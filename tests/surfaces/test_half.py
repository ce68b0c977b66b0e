"""Tests for bnbw_native.half and the row converters of include/bnbw_half.h.

Why they are built this way: the header's scalar functions define the semantics and its SIMD
kernels must agree with them on every input, so every bit-level comparison runs twice, on the
path this CPU dispatches to and forced onto the portable code.  NumPy and ml_dtypes are the
references, compared as bit patterns so that NaN payloads and signed zeros count.  The float64
roundings have no library reference for bfloat16 (ml_dtypes rounds through float32), so they are
checked against exact integer arithmetic and a round-to-odd construction.  What the public
helpers refuse is in test_refusals.py (the private row converters' misuse is here).
"""
import bisect
import functools
import math
import platform

import numpy as np
import pytest

from bnbw_native import _half, half
from conftest import kernels

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is the bfloat16 reference")

SEED = 20240611
BIG = 3 * _half.PARALLEL_MIN + 12345  # several chunks, not a multiple of any of them


# ---------------------------------------------------------------------------- helpers

def bits(a):
    """Bit patterns of a float array (0-d included) as unsigned integers of the same width."""
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def f32(pattern):
    return np.asarray(pattern, dtype=np.uint32).view(np.float32)


# The package's half conversions keep a NaN's payload (bnbw_half.h), as NumPy's own casts do
# where NumPy converts in software (its x86-64 wheels).  Where it converts with the CPU's
# instructions (its AArch64 wheels: FCVT), a signalling NaN comes out quiet; the references
# then rebuild NaN lanes by the payload rule, every other lane staying NumPy's.
with np.errstate(invalid="ignore"):      # a signalling NaN raises FCVT's invalid flag
    _NUMPY_QUIETS_HALF_NANS = int(np.array(0x7C01, np.uint16).view(np.float16)
                                  .astype(np.float32).view(np.uint32)) != 0x7F802000


def _payload_kept_f16(x, r):
    """r (NumPy's float16 of x) with each NaN lane as the package makes it: the top ten bits
    of the payload (1 when they are all 0), the sign kept."""
    if not _NUMPY_QUIETS_HALF_NANS:
        return r
    x = np.asarray(x)
    nan = np.isnan(x)
    if not nan.any():
        return r
    wide = x.dtype.itemsize == 8
    xb = x.view(np.uint64 if wide else np.uint32)
    top = (xb >> (42 if wide else 13)) & 0x3FF
    sign = (xb >> (48 if wide else 16)) & 0x8000
    fixed = (sign | 0x7C00 | np.where(top == 0, 1, top)).astype(np.uint16)
    out = r.copy()
    out.view(np.uint16)[nan] = fixed[nan]
    return out


def ref_f16(x):
    with np.errstate(all="ignore"):  # NumPy warns on overflow in casts
        return _payload_kept_f16(x, np.asarray(x).astype(np.float16))


def ref_f16_to_f32(h):
    """float16 -> float32 as the package widens: NumPy's, a NaN's payload kept unquieted."""
    h = np.asarray(h)
    with np.errstate(invalid="ignore"):
        r = h.astype(np.float32)
    if _NUMPY_QUIETS_HALF_NANS:
        hb = h.view(np.uint16).astype(np.uint32)
        nan = np.isnan(h)
        r.view(np.uint32)[nan] = (((hb & 0x8000) << 16) | 0x7F800000 | ((hb & 0x3FF) << 13))[nan]
    return r


def test_references_keep_nan_payloads():
    """The references above give the package's NaNs on either kind of NumPy."""
    h = np.array([0x7C01, 0xFE00, 0x3C00], np.uint16).view(np.float16)
    assert list(bits(ref_f16_to_f32(h))) == [0x7F802000, 0xFFC00000, 0x3F800000]
    x = f32([0x7F800001, 0xFFA00000, 0x7FC00000, 0x3F800000])
    assert list(bits(ref_f16(x))) == [0x7C01, 0xFD00, 0x7E00, 0x3C00]


def ref_bf16(x):
    with np.errstate(all="ignore"):  # ml_dtypes warns on NaN in casts
        return np.asarray(x).astype(ml_dtypes.bfloat16)


def assert_bits_equal(got, expected):
    assert got.shape == expected.shape
    np.testing.assert_array_equal(bits(got), bits(expected))


@pytest.fixture(params=["dispatched", "portable"])
def path(request):
    """Runs a test on the SIMD path this CPU picks, then on the portable scalar code."""
    with kernels("portable" if request.param == "portable" else None):
        yield request.param


# ---------------------------------------------------------------------------- dispatch

def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_simd_path_names_the_code_taken():
    if platform.machine().lower() in ("aarch64", "arm64"):    # AdvSIMD is part of AArch64
        assert _half.simd_path() == "f16: NEON, bf16: NEON"
    elif {"avx2", "fma", "f16c"} <= _cpu_flags():
        assert _half.simd_path() == "f16: F16C, bf16: AVX2"
    else:
        assert _half.simd_path() in ("portable", "f16: F16C, bf16: AVX2")
    with kernels("portable"):
        assert _half.simd_path() == "portable"


# ---------------------------------------------------------------------------- widening, exhaustive

def test_float16_to_float32_all_patterns(path):
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    assert_bits_equal(half.float16_to_float32(h), ref_f16_to_f32(h))


@needs_ml_dtypes
@pytest.mark.parametrize("as_dtype", ["bfloat16", "uint16"])
def test_bfloat16_to_float32_all_patterns(path, as_dtype):
    u = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    src = u.view(ml_dtypes.bfloat16) if as_dtype == "bfloat16" else u
    assert_bits_equal(half.bfloat16_to_float32(src), u.view(ml_dtypes.bfloat16).astype(np.float32))


# ---------------------------------------------------------------------------- narrowing, sampled

def _with_neighbours(patterns):
    """Each float32 bit pattern with the patterns one ulp below and above it."""
    p = np.asarray(patterns, dtype=np.int64)
    return (np.concatenate([p - 1, p, p + 1]) & 0xFFFFFFFF).astype(np.uint32)


def _f16_ties():
    """Exact midpoints between consecutive float16 magnitudes, 65504|65536 included, both signs."""
    lo = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    hi = np.arange(1, 0x7C01, dtype=np.uint16).view(np.float16).astype(np.float64)
    hi[-1] = 65536.0  # the step past the largest finite value, where overflow starts
    mid = ((lo + hi) / 2).astype(np.float32)
    return np.concatenate([bits(mid), bits(-mid)])


def _nan_patterns():
    """Both signs; every payload whose float16 top bits vanish, then a stride through the rest."""
    frac = np.concatenate([np.arange(1, 1 << 14), np.arange(1 << 14, 1 << 23, 7)]).astype(np.uint32)
    return np.concatenate([0x7F800000 | frac, 0xFF800000 | frac])


_SPECIAL_F32 = [
    0.0, -0.0, np.inf, -np.inf, 1.0, -1.0,
    65504.0, 65519.0, 65519.99609375, 65520.0, 65520.00390625, 65535.0, 65536.0, 3.0e38,
    2.0**-24, 2.0**-25, 2.0**-25 * (1 + 2.0**-23), 3 * 2.0**-26, 2.0**-14, 2.0**-14 - 2.0**-24,
    2.0**-126, 2.0**-149, 2.0**-133, 2.0**-134, 3 * 2.0**-135, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-9,
]
_SPECIAL_BITS = [
    0x00000001, 0x007FFFFF, 0x00400000, 0x00008000, 0x00018000, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF,
    0x7F800001, 0x7FA00000, 0x7FC00000, 0x7FFFFFFF, 0x7F801FFF, 0x7F802000, 0xFF800001, 0xFFC00001,
]


@functools.lru_cache(maxsize=None)
def _narrow_set(name):
    if name == "f16_values":
        return _with_neighbours(bits(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
                                     .view(np.float16).astype(np.float32)))
    if name == "f16_ties":
        return _with_neighbours(_f16_ties())
    if name == "bf16_values":
        return _with_neighbours(np.arange(1 << 16, dtype=np.uint32) << 16)
    if name == "bf16_ties":
        return _with_neighbours((np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000)
    if name == "random":
        return np.random.default_rng(SEED).integers(0, 1 << 32, size=4_000_000, dtype=np.uint32)
    if name == "nans":
        return _nan_patterns()
    if name == "specials":
        finite = bits(np.array(_SPECIAL_F32, dtype=np.float32))
        return _with_neighbours(np.concatenate([finite, bits(-f32(finite)), _SPECIAL_BITS]))
    raise KeyError(name)


@functools.lru_cache(maxsize=None)
def _narrow_ref(name, target):
    x = f32(_narrow_set(name))
    return bits(ref_f16(x) if target == "f16" else ref_bf16(x))


NARROW_SETS = ["f16_values", "f16_ties", "bf16_values", "bf16_ties", "random", "nans", "specials"]


@pytest.mark.parametrize("name", NARROW_SETS)
def test_float32_to_float16_bits(path, name):
    x = f32(_narrow_set(name))
    np.testing.assert_array_equal(bits(half.float32_to_float16(x)), _narrow_ref(name, "f16"))


@needs_ml_dtypes
@pytest.mark.parametrize("name", NARROW_SETS)
def test_float32_to_bfloat16_bits(path, name):
    x = f32(_narrow_set(name))
    np.testing.assert_array_equal(bits(half.float32_to_bfloat16(x)), _narrow_ref(name, "bf16"))


@pytest.mark.parametrize("value, expected", [
    (65504.0, 0x7BFF), (65519.99609375, 0x7BFF), (65520.0, 0x7C00), (-65520.0, 0xFC00),
    (2.0**-25, 0x0000), (2.0**-25 * (1 + 2.0**-23), 0x0001), (3 * 2.0**-25, 0x0002),
    (-(2.0**-149), 0x8000), (1.0 + 2.0**-11, 0x3C00), (1.0 + 3 * 2.0**-11, 0x3C02),
])
def test_float32_to_float16_landmarks(path, value, expected):
    assert int(bits(half.float32_to_float16(np.float32(value)))) == expected


@pytest.mark.parametrize("pattern, expected", [
    (0x7F800001, 0x7C01), (0xFF801FFF, 0xFC01), (0x7FA00000, 0x7D00), (0x7FFFFFFF, 0x7FFF),
    (0x7FC00000, 0x7E00),
])
def test_float16_nan_payload_kept_not_quieted(path, pattern, expected):
    """F16C would quiet these; NumPy truncates the payload and keeps it a NaN."""
    assert int(bits(half.float32_to_float16(f32(pattern)))) == expected


@pytest.mark.parametrize("pattern", [0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7FC00000, 0xFFBFFFFF])
def test_bfloat16_nan_is_canonical_quiet_nan(path, pattern):
    expected = (pattern >> 16 & 0x8000) | 0x7FC0
    assert int(bits(half.float32_to_bfloat16(f32(pattern)).view(np.uint16))) == expected


@pytest.mark.slow
@pytest.mark.parametrize("target", ["f16", "bf16"])
def test_all_float32_patterns(target):
    """All 2^32 float32 patterns: the SIMD path against the portable code everywhere, and
    against the library on all of them for bfloat16 but, for float16, on every 61st (NumPy's own
    float16 cast runs at ~100 ns per element, 7+ minutes for all; a prime stride still reaches
    every residue of the low bits across the blocks)."""
    if target == "bf16" and ml_dtypes is None:
        pytest.skip("ml_dtypes is the bfloat16 reference")
    convert, ref, every = ((half.float32_to_float16, ref_f16, 61) if target == "f16"
                           else (half.float32_to_bfloat16, ref_bf16, 1))
    step = 1 << 24
    for start in range(0, 1 << 32, step):
        x = np.arange(start, start + step, dtype=np.uint64).astype(np.uint32).view(np.float32)
        got = bits(convert(x))
        with kernels("portable"):
            portable = bits(convert(x))
        np.testing.assert_array_equal(got, portable, err_msg=f"SIMD vs portable, block {start:#x}")
        sample = slice((-start) % every, None, every)  # global indices divisible by `every`
        np.testing.assert_array_equal(got[sample], bits(ref(x[sample])),
                                      err_msg=f"against the library, block {start:#x}")


# ---------------------------------------------------------------------------- float64, single rounding

def _exact(v):
    """A finite double scaled by 2^1100 into an integer: exact, since 2^-1074 is its finest unit."""
    num, den = float(v).as_integer_ratio()
    return num * ((1 << 1100) // den)


def _exact_table(patterns, inf_pattern, overflow_at):
    """Sorted non-negative finite values of a format (with their patterns), then the overflow
    point 2^(emax+1) carrying the infinity pattern: nearest-even between the largest finite value
    and it is exactly IEEE's overflow rule."""
    values = [_exact(v) for v in patterns[1]] + [overflow_at << 1100]
    return values, [int(p) for p in patterns[0]] + [inf_pattern]


@functools.lru_cache(maxsize=None)
def _table(target):
    if target == "f16":
        p = np.arange(0x7C00, dtype=np.uint16)
        return _exact_table((p, p.view(np.float16).astype(np.float64)), 0x7C00, 2**16)
    p = np.arange(0x7F80, dtype=np.uint32)
    return _exact_table((p, (p << 16).view(np.float32).astype(np.float64)), 0x7F80, 2**128)


def _exact_round(x, target):
    """Reference rounding of a non-NaN double in exact integers: nearest, ties to even."""
    values, patterns = _table(target)
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0
    ax = _exact(abs(x)) if math.isfinite(x) else values[-1]
    if ax >= values[-1]:
        return sign | patterns[-1]
    i = bisect.bisect_left(values, ax)
    if values[i] == ax:
        return sign | patterns[i]
    below, above = ax - values[i - 1], values[i] - ax
    if below != above:
        return sign | patterns[i - 1 if below < above else i]
    return sign | patterns[i - 1 if patterns[i - 1] % 2 == 0 else i]


def _double_rounding_traps(target):
    """Doubles at, just off and a hair (2^-30 relative, invisible to float32) off the midpoints
    between neighbouring values of the target, plus the values themselves; both signs."""
    values = [v / (1 << 1100) for v in _table(target)[0]]
    picks = list(range(0, len(values) - 1, 13)) + list(range(0, 40)) + list(range(len(values) - 40, len(values) - 1))
    out = []
    for k in picks:
        lo, hi = values[k], values[k + 1]
        mid = (lo + hi) / 2
        out += [lo, mid, math.nextafter(mid, 0), math.nextafter(mid, math.inf),
                mid * (1 + 2.0**-30), mid * (1 - 2.0**-30), math.nextafter(lo, math.inf)]
    out += [0.0, 5e-324, 2.2250738585072014e-308, 1e300, math.inf, 3.4028235677973366e38,
            3.3961775292304724e38, 65519.999999999, 65520.0, 65520.000000001]
    arr = np.array(out, dtype=np.float64)
    return np.concatenate([arr, -arr])


@pytest.mark.parametrize("target", ["f16", "bf16"])
def test_float64_rounding_matches_exact_arithmetic(target):
    x = _double_rounding_traps(target)
    convert = _half._f64_to_f16_bits if target == "f16" else _half._f64_to_bf16_bits
    expected = np.array([_exact_round(float(v), target) for v in x], dtype=np.uint16)
    np.testing.assert_array_equal(convert(x), expected)


def test_numpy_float64_to_float16_is_single_rounded():
    """The NumPy reference below is only a reference if it rounds once: 1 + 2^-11 + 2^-40 rounds
    to 1 + 2^-11 in float32, a tie that a second rounding would send down to 1."""
    x = np.array([1 + 2.0**-11 + 2.0**-40])
    assert int(bits(x.astype(np.float16))[0]) == 0x3C01
    assert int(_half._f64_to_f16_bits(x)[0]) == 0x3C01


def _random_doubles(n):
    """Random signs and mantissas over every exponent that matters to half formats, then raw
    patterns (mostly huge, tiny or NaN)."""
    rng = np.random.default_rng(SEED + 1)
    exp = rng.integers(1023 - 150, 1023 + 140, size=n, dtype=np.uint64)
    mant = rng.integers(0, 1 << 52, size=n, dtype=np.uint64)
    sign = rng.integers(0, 2, size=n, dtype=np.uint64) << np.uint64(63)
    ranged = (sign | (exp << np.uint64(52)) | mant).view(np.float64)
    raw = rng.integers(0, 1 << 64, size=n // 4, dtype=np.uint64).view(np.float64)
    return np.concatenate([ranged, raw])


def _bf16_round_to_odd_reference(d):
    """float64 -> bfloat16 with one rounding, built from library casts: round to float32 toward
    zero with the sticky bit forced into its last place (round-to-odd, exact since float32 keeps
    16 more bits than bfloat16 everywhere), then ml_dtypes' nearest-even float32 -> bfloat16."""
    with np.errstate(all="ignore"):
        f = d.astype(np.float32)
    back = f.astype(np.float64)
    inexact = np.isfinite(d) & (back != d)
    u = bits(f).copy()
    u[inexact & (np.abs(back) > np.abs(d))] -= np.uint32(1)
    u[inexact] |= np.uint32(1)
    return bits(ref_bf16(u.view(np.float32)))


def test_float64_to_float16_random_against_numpy():
    d = _random_doubles(1_000_000)
    np.testing.assert_array_equal(_half._f64_to_f16_bits(d), bits(ref_f16(d)))


@needs_ml_dtypes
def test_float64_to_bfloat16_random_against_round_to_odd():
    d = _random_doubles(1_000_000)
    np.testing.assert_array_equal(_half._f64_to_bf16_bits(d), _bf16_round_to_odd_reference(d))


@pytest.mark.parametrize("pattern", [0x7FF0000000000001, 0x7FF8000000000000, 0xFFF0040000000000,
                                     0x7FF0000000100000, 0xFFFFFFFFFFFFFFFF, 0x7FF4000000000000])
def test_float64_nan_to_float16_matches_numpy(pattern):
    d = np.array([pattern], dtype=np.uint64).view(np.float64)
    np.testing.assert_array_equal(_half._f64_to_f16_bits(d), bits(ref_f16(d)))


@needs_ml_dtypes
@pytest.mark.parametrize("pattern", [0x7FF0000000000001, 0x7FF8000000000000, 0xFFF0040000000000,
                                     0xFFFFFFFFFFFFFFFF])
def test_float64_nan_to_bfloat16_matches_ml_dtypes(pattern):
    d = np.array([pattern], dtype=np.uint64).view(np.float64)
    np.testing.assert_array_equal(_half._f64_to_bf16_bits(d), bits(ref_bf16(d)))


# ---------------------------------------------------------------------------- layouts

class Fn:
    """One public conversion, its source dtype and its reference."""

    def __init__(self, name, func, src_dtype, ref):
        self.name, self.func, self.src_dtype, self.ref = name, func, src_dtype, ref

    def source(self, shape, rng):
        """Source data drawn from all bit patterns (specials and NaNs included)."""
        if self.src_dtype == np.float32:
            return f32(rng.integers(0, 1 << 32, size=shape, dtype=np.uint32))
        return rng.integers(0, 1 << 16, size=shape, dtype=np.uint32).astype(np.uint16).view(self.src_dtype)

    def out_dtype(self):
        return self.ref(np.zeros(1, self.src_dtype)).dtype


def _bf16_dtype():
    return ml_dtypes.bfloat16 if ml_dtypes is not None else np.uint16


FNS = {
    "float32_to_float16": Fn("float32_to_float16", half.float32_to_float16, np.float32, ref_f16),
    "float16_to_float32": Fn("float16_to_float32", half.float16_to_float32, np.float16,
                             ref_f16_to_f32),
    "float32_to_bfloat16": Fn("float32_to_bfloat16", half.float32_to_bfloat16, np.float32, ref_bf16),
    "bfloat16_to_float32": Fn("bfloat16_to_float32", half.bfloat16_to_float32, _bf16_dtype(),
                              lambda x: np.asarray(x).view(ml_dtypes.bfloat16).astype(np.float32)),
}


def fn_params():
    return [pytest.param(FNS[name], id=name, marks=needs_ml_dtypes if "bfloat16" in name else ())
            for name in FNS]


def _odd_stride(base, step_bytes):
    """A 1-d view of `base`'s values at a byte stride that is not a multiple of the itemsize."""
    n, size = base.size, base.itemsize
    buf = bytearray(n * abs(step_bytes) + size + 1)
    start = 1 if step_bytes > 0 else 1 + (n - 1) * -step_bytes
    view = np.ndarray((n,), base.dtype, buffer=buf, offset=start, strides=(step_bytes,))
    view[...] = base.reshape(-1)
    return view


LAYOUTS = {
    "c_contiguous": lambda b: b,
    "transposed": lambda b: b.T,
    "fortran": lambda b: np.asfortranarray(b),
    "negative_1d": lambda b: b.reshape(-1)[::-1],
    "step_1d": lambda b: b.reshape(-1)[1::3],
    "negative_step_2d": lambda b: b[::-2, ::-3],
    "3d_mixed": lambda b: b.reshape(6, 4, 5)[:, ::-1, ::2],
    "0d": lambda b: b.reshape(-1)[7:8].reshape(()),
    "empty_1d": lambda b: b.reshape(-1)[:0],
    "empty_2d": lambda b: b[:, :0],
    "unaligned_odd_stride": lambda b: _odd_stride(b, 2 * b.itemsize + 1),
    "unaligned_negative_odd_stride": lambda b: _odd_stride(b, -(b.itemsize + 1)),
    "read_only": lambda b: np.frombuffer(b.tobytes(), b.dtype).reshape(b.shape),
    "byteswapped": lambda b: b.astype(b.dtype.newbyteorder(">")),
    "numpy_scalar": lambda b: b.reshape(-1)[3],
    "list_of_scalars": lambda b: list(b.reshape(-1)[:11]),
    "memoryview": lambda b: memoryview(b),
}


@pytest.mark.parametrize("fn", fn_params())
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts(fn, layout):
    base = fn.source((10, 12), np.random.default_rng(SEED))
    if layout in ("byteswapped", "memoryview") and fn.src_dtype not in (np.float32, np.float16):
        base = base.view(np.uint16)  # bfloat16 as bit patterns: ml_dtypes has neither form
    src = LAYOUTS[layout](base)
    got = fn.func(src)
    expected = fn.ref(np.asarray(src).astype(np.asarray(src).dtype.newbyteorder("=")))
    assert type(got) is np.ndarray and got.flags.c_contiguous
    assert got.dtype == fn.out_dtype()
    assert_bits_equal(got, expected)


# ---------------------------------------------------------------------------- out=

def _unaligned(shape, dtype):
    """A writable array whose data starts one byte past an aligned address."""
    dtype = np.dtype(dtype)
    return np.ndarray(shape, dtype, buffer=bytearray(int(np.prod(shape)) * dtype.itemsize + 1), offset=1)


# name -> (shape of the parent buffer for an out of shape (rows, cols), view of it used as out)
OUT_KINDS = {
    "c_contiguous": (lambda r, c: (r, c), lambda p: p),
    "transposed_view": (lambda r, c: (c, r), lambda p: p.T),
    "strided_view": (lambda r, c: (2 * r, 3 * c), lambda p: p[::2, ::-3]),
}


def _sentinel_fill(parent):
    bits(parent)[...] = 0x5A5A if parent.itemsize == 2 else 0x5A5A5A5A


@pytest.mark.parametrize("fn", fn_params())
@pytest.mark.parametrize("kind", list(OUT_KINDS))
def test_out_is_filled_and_returned(fn, kind):
    src = fn.source((9, 10), np.random.default_rng(SEED))
    parent_shape, view = OUT_KINDS[kind]
    parent = np.empty(parent_shape(*src.shape), fn.out_dtype())
    _sentinel_fill(parent)
    before = bits(parent).copy()
    out = view(parent)
    assert fn.func(src, out=out) is out
    assert_bits_equal(out, fn.ref(src))
    untouched = np.ones(parent.shape, bool)
    view(untouched)[...] = False
    np.testing.assert_array_equal(bits(parent)[untouched], before[untouched])


@pytest.mark.parametrize("fn", fn_params())
def test_out_unaligned(fn):
    src = fn.source((9, 10), np.random.default_rng(SEED))
    out = _unaligned(src.shape, fn.out_dtype())
    assert fn.func(src, out=out) is out
    assert_bits_equal(out, fn.ref(src))


@needs_ml_dtypes
@pytest.mark.parametrize("out_dtype", ["bfloat16", "uint16"])
def test_bfloat16_out_accepts_both_dtypes(out_dtype):
    x = FNS["float32_to_bfloat16"].source((33,), np.random.default_rng(SEED))
    out = np.empty(33, ml_dtypes.bfloat16 if out_dtype == "bfloat16" else np.uint16)
    assert half.float32_to_bfloat16(x, out=out) is out
    np.testing.assert_array_equal(bits(out), bits(ref_bf16(x)))


@pytest.mark.parametrize("fn", fn_params())
def test_an_out_whose_elements_share_memory_is_written_in_order(fn):
    # a writable out of stride 0 (every element one place): the last value, as NumPy's own
    # copies leave it, on any number of threads - not whichever thread wrote last (here a
    # short last piece, done while another thread still writes)
    src = fn.source(((1 << 17) + 1,), np.random.default_rng(SEED))
    want = bits(fn.ref(src))[-1]
    for threads in (1, 2, 4):
        for _ in range(3):
            cell = np.zeros(1, fn.out_dtype())
            out = np.lib.stride_tricks.as_strided(cell, shape=src.shape, strides=(0,),
                                                  writeable=True)
            assert fn.func(src, out=out, num_threads=threads) is out
            assert bits(cell)[0] == want, threads


def test_a_tensor_too_large_for_numpy_is_a_value_error():
    torch = pytest.importorskip("torch")
    huge = torch.zeros(1, 8).expand(2 ** 59, 8)
    for a in (huge, torch._neg_view(torch.zeros(1, 8)).expand(2 ** 59, 8)):  # (read by a copy)
        with pytest.raises(ValueError, match="argument 'a' is too large"):
            half.float32_to_float16(a)


def test_out_shares_memory_with_result():
    x = np.linspace(-2, 2, 50, dtype=np.float32)
    out = np.empty(50, np.float16)
    assert np.shares_memory(half.float32_to_float16(x, out=out), out)


@needs_ml_dtypes
def test_torch_tensors_are_read_in_every_storage_type():
    """A torch tensor, bfloat16 too (which NumPy cannot take), is read through DLPack as the
    engine's calls read it: the conversions of its values, bit for bit."""
    torch = pytest.importorskip("torch")
    x = torch.randn(7, 9, generator=torch.Generator().manual_seed(SEED))[:, ::2]
    np.testing.assert_array_equal(bits(half.float32_to_bfloat16(x)), bits(ref_bf16(x.numpy())))
    np.testing.assert_array_equal(bits(half.float32_to_float16(x)),
                                  bits(x.numpy().astype(np.float16)))
    for t in (x.to(torch.bfloat16), x.to(torch.float16)):
        np.testing.assert_array_equal(half.bfloat16_to_float32(t) if t.dtype == torch.bfloat16
                                      else half.float16_to_float32(t), t.float().numpy())
    with pytest.raises(TypeError, match="'a' must hold float32"):
        half.float32_to_float16(x.double())


def test_0d_out():
    out = np.zeros((), np.float32)
    assert half.float16_to_float32(np.float16(2.5), out=out) is out
    assert out == 2.5


# ---------------------------------------------------------------------------- overlap


def test_accepts_out_interleaved_with_source_without_overlap():
    """Shares a buffer but not a byte: not an overlap."""
    buf = np.zeros((8, 2), np.float32)
    a = buf[:, 0]
    a[...] = np.arange(8)
    out = buf.view(np.uint16)[:, 2]
    half.float32_to_float16(a, out=out.view(np.float16))
    np.testing.assert_array_equal(out.view(np.float16), np.arange(8, dtype=np.float16))


# ---------------------------------------------------------------------------- threads

@pytest.mark.parametrize("fn", fn_params())
@pytest.mark.parametrize("layout", ["contiguous", "strided_source", "strided_out"])
def test_threads_agree(fn, layout):
    src = fn.source((2 * BIG,), np.random.default_rng(SEED))
    src = src[::-2] if layout == "strided_source" else src[:BIG]
    results = []
    for threads in (1, 2, 3, None):
        if layout == "strided_out":
            out = np.zeros(2 * BIG, fn.out_dtype())[1::2]
            fn.func(src, out=out, num_threads=threads)
        else:
            out = fn.func(src, num_threads=threads)
        results.append(bits(out).copy())
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])
    np.testing.assert_array_equal(results[0], bits(fn.ref(src)))


@pytest.mark.parametrize("n", [_half.PARALLEL_MIN - 1, _half.PARALLEL_MIN, _half.PARALLEL_MIN + 1])
def test_parallel_threshold(n):
    x = FNS["float32_to_float16"].source((n,), np.random.default_rng(SEED))
    np.testing.assert_array_equal(bits(half.float32_to_float16(x, num_threads=2)), bits(ref_f16(x)))


# ---------------------------------------------------------------------------- without ml_dtypes

@pytest.fixture
def no_ml_dtypes(monkeypatch):
    monkeypatch.setattr(half, "ml_dtypes", None)


@needs_ml_dtypes
def test_without_ml_dtypes_bfloat16_comes_back_as_uint16(no_ml_dtypes):
    x = FNS["float32_to_bfloat16"].source((7, 9), np.random.default_rng(SEED))
    got = half.float32_to_bfloat16(x)
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, bits(ref_bf16(x)))


@needs_ml_dtypes
def test_without_ml_dtypes_uint16_bits_are_read(no_ml_dtypes):
    u = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)[::-1]
    assert_bits_equal(half.bfloat16_to_float32(u), u.view(ml_dtypes.bfloat16).astype(np.float32))


def test_without_ml_dtypes_out_uint16(no_ml_dtypes):
    out = np.zeros(4, np.uint16)
    half.float32_to_bfloat16(np.array([1.0, -2.0, np.inf, np.nan], np.float32), out=out)
    np.testing.assert_array_equal(out, [0x3F80, 0xC000, 0x7F80, 0x7FC0])


# ---------------------------------------------------------------------------- row converters

@pytest.mark.parametrize("kind, dtype", [("f16", np.float16), ("bf16", np.uint16), ("f32", np.float32)])
@pytest.mark.parametrize("step", [1, 3, -1, -5, 0])
def test_row_load_any_byte_stride(kind, dtype, step):
    """load(): the narrow side at strides of whole elements, odd byte strides and zero."""
    rng = np.random.default_rng(SEED)
    values = rng.integers(0, 1 << 16, size=300, dtype=np.uint32).astype(np.uint16).view(dtype) \
        if dtype != np.float32 else f32(rng.integers(0, 1 << 32, size=300, dtype=np.uint32))
    size = np.dtype(dtype).itemsize
    stride = step * size + (step > 0) - (step < 0)  # whole elements plus one byte: unaligned
    src = (np.lib.stride_tricks.as_strided(values[:1], shape=(300,), strides=(0,)) if step == 0
           else _odd_stride(values, stride))
    dst = np.empty(300, np.float32)
    _half.load(kind, src, dst)
    expected = {"f16": ref_f16_to_f32, "f32": lambda v: v,
                "bf16": lambda v: (v.astype(np.uint32) << 16).view(np.float32)}[kind](np.array(src))
    np.testing.assert_array_equal(bits(dst), bits(expected))


@pytest.mark.parametrize("kind", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("step", [1, 3, -1, -5])
def test_row_store_any_byte_stride(kind, step):
    x = f32(np.random.default_rng(SEED).integers(0, 1 << 32, size=300, dtype=np.uint32))
    size = 4 if kind == "f32" else 2
    dst = _odd_stride(np.zeros(300, np.float32 if kind == "f32" else np.uint16),
                      step * size + (step > 0) - (step < 0))
    _half.store(kind, x, dst)
    dst_full = np.zeros(300, np.float32 if kind == "f32" else np.uint16)
    _half.store(kind, x, dst_full)
    np.testing.assert_array_equal(np.array(dst), dst_full)
    # the unit-stride store against the library (f32: the very bits)
    if kind == "f16":
        np.testing.assert_array_equal(dst_full, bits(ref_f16(x)))
    elif kind == "f32":
        np.testing.assert_array_equal(bits(dst_full), bits(x))
    elif ml_dtypes is not None:
        np.testing.assert_array_equal(dst_full, bits(ref_bf16(x)))


@pytest.mark.parametrize("call", [
    lambda: _half.load("f16", np.zeros((2, 2), np.float16), np.zeros(4, np.float32)),
    lambda: _half.load("f16", np.zeros(4, np.float16), np.zeros(5, np.float32)),
    lambda: _half.load("f16", np.zeros(4, np.float32), np.zeros(4, np.float32)),
    lambda: _half.load("f16", np.zeros(4, np.float16), np.zeros(8, np.float32)[::2]),
    lambda: _half.load("f16", np.zeros(4, np.float16), np.zeros(4, np.float64)),
    lambda: _half.store("f16", np.zeros(4, np.float32), np.frombuffer(bytes(8), np.float16)),
    lambda: _half.store("f64", np.zeros(4, np.float32), np.zeros(4, np.float64)),
], ids=["2d", "length", "itemsize", "strided_float_side", "float64_side", "read_only", "kind"])
def test_row_entry_points_refuse_misuse(call):
    with pytest.raises((TypeError, ValueError)):
        call()
