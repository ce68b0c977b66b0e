"""Every kernel body gives the same bits.

The kernels are compiled once per instruction set (portable, AVX2, AVX-512 on x86-64; portable and
NEON on AArch64) from one source; the portable body defines the results and every other body the
CPU runs must give its bits, so every output is compared bit for bit across the bodies.  The shapes
put tails everywhere: rows that are not a multiple of 16 or 8 elements, rows longer than a kernel
call's piece (2048), channel counts with 8- and 16-wide runs plus leftovers of every kind (masked
loads and stores; the AVX2 body's channel-major elementwise bf16 kernels split runs of 16 into even
and odd elements); strided operands (gathers, every-other-element loads); NaN and infinity inputs
check that the bodies round special values alike (NaN payloads and signs aside).
"""
import numpy as np
import pytest

import bnbw_native
from bnbw_native import _config, _engine, backward_apply, backward_reduce, batchnorm_training_backward, dml, tuning
from conftest import BF16, bodies, kernels, make_layout

DTYPES = [np.float16, np.float32] + ([BF16] if BF16 is not None else [])

SHAPES = [  # (shape, data_format)
    ((3, 5, 37), "NCX"),
    ((2, 3, 2100), "NCX"),          # a row cut at the 2048-element tile boundary
    ((4, 6, 7, 9), "NCX"),          # short rows: the memory-order sweep
    ((1, 2, 4200), "NCX"),
    ((37, 19), "NXC"),              # 16 channels + 3
    ((5, 6, 7, 40), "NXC"),         # 16 + 16 + 8
    ((9, 3, 131), "NXC"),           # 8 runs of 16 + 3
    ((600, 64), "NXC"),
    ((5, 300), "NXC"),              # 18 runs of 16 + 12
    ((3, 4, 7, 7), "NCX"),          # rows of 49: a tail of one
    ((6, 2, 34), "NCX"),            # a tail of two
    ((11, 17), "NXC"),              # one channel after a run of 16
]


def _inputs(rng, shape, dtype, data_format, special):
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    if special:
        flat_x, flat_dy = x.reshape(-1), dy.reshape(-1)
        idx = rng.choice(flat_x.size, size=max(1, flat_x.size // 50), replace=False)
        flat_x[idx[::3]] = np.nan
        flat_dy[idx[1::3]] = np.inf
        flat_dy[idx[2::3]] = -np.nan
    C = shape[1] if data_format == "NCX" else shape[-1]
    mean = rng.standard_normal(C).astype(np.float32)
    if special:
        mean[::3] = np.inf          # x - mean infinite in every lane a kernel fills
    var = (rng.random(C) + 0.5).astype(np.float32)
    gamma = rng.standard_normal(C).astype(np.float32)
    stat = BF16 if dtype == BF16 else np.float32
    return (x.astype(dtype), dy.astype(dtype), mean.astype(stat), var.astype(stat),
            gamma.astype(stat))


def _every_body(call):
    """call() on every body the CPU runs, the portable one first."""
    results = []
    for body in bodies():
        with kernels(body):
            results.append(call())
    return results


def _same_on_every_body(call, compared=True):
    """call()'s outputs (None or arrays) are the same bits on every body.  A test that only
    compares the bodies is skipped where the CPU runs one body (it could not fail);
    compared=False for a test that checks each result against something else too."""
    if compared and len(bodies()) == 1:
        pytest.skip("this CPU runs the portable body only: nothing to compare")
    portable, *others = _every_body(call)
    for other in others:
        for got, want in zip(other, portable):
            if want is None:
                assert got is None
                continue
            np.testing.assert_array_equal(_bits(got), _bits(want))
    return portable


def _bits(a):
    """The bit patterns of `a`, every NaN as one pattern: which NaN operand an IEEE operation
    passes on is unspecified, and compilers swap the operands of commutative operations."""
    a = np.ascontiguousarray(a)
    bits = a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16).copy()
    bits[np.isnan(a)] = np.iinfo(bits.dtype).max
    return bits


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,data_format", SHAPES, ids=str)
@pytest.mark.parametrize("num_outputs", [3, 1])
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
def test_every_body_gives_the_portable_bits(rng, dtype, shape, data_format, num_outputs,
                                            special):
    x, dy, mean, var, gamma = _inputs(rng, shape, dtype, data_format, special)
    _same_on_every_body(lambda: batchnorm_training_backward(
        x, dy, mean, var, gamma, epsilon=1e-3, data_format=data_format,
        num_outputs=num_outputs, num_threads=2))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("channels", [16, 17, 33, 48, 64, 65, 80, 130, 512, 519])
@pytest.mark.parametrize("streaming", [True, False], ids=["from-memory", "cached"])
def test_rows_taken_from_memory_give_the_portable_bits(rng, dtype, channels, streaming):
    """Channel-last rows the schedule takes to come from memory (a cache model with no room)
    are visited one at a time up to 2 KiB and four at a time past it, in the backward's sums
    and the forward's statistics; rows of at most as many channels as a body keeps the sums
    of in registers (16 to 64) go one at a time from memory or not: every body gives the
    portable bits, on either side of each body's limit."""
    before = tuning.cache_model()
    tuning.set_cache_model(*((1 << 10, 1 << 12, 64) if streaming else (1 << 30, 1 << 30, 2)))
    try:
        x, dy, mean, var, gamma = _inputs(rng, (37, channels), dtype, "NXC", False)
        assert tuning.describe(x, "NXC", num_threads=2)["streaming"] == streaming

        def call():
            fwd = bnbw_native.batchnorm_training_forward(x, mean, var, gamma, gamma,
                                                         epsilon=1e-3, data_format="NXC",
                                                         num_threads=2)
            return [*batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3,
                                                 data_format="NXC", num_threads=2),
                    fwd.dst, fwd.batch_mean, fwd.batch_variance]
        _same_on_every_body(call)
    finally:
        tuning.set_cache_model(*before)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", ["contiguous", "sliced", "negative"])
@pytest.mark.parametrize("shape,data_format", [((6, 21, 45), "NCX"), ((6, 7, 300), "NXC")],
                         ids=str)
def test_in_place_and_strided_operands_give_the_portable_bits(rng, dtype, layout, shape,
                                                             data_format):
    """dx written over dy (the kernels read and write one buffer), and strided operands next
    to unit-stride ones."""
    x, dy, mean, var, gamma = _inputs(rng, shape, dtype, data_format, special=False)
    x = make_layout(x, layout)

    def call():
        dx, dg, db = batchnorm_training_backward(x, make_layout(dy, layout), mean, var, gamma,
                                                 epsilon=1e-5, data_format=data_format)
        buf = make_layout(dy, layout)
        batchnorm_training_backward(x, buf, mean, var, gamma, epsilon=1e-5,
                                    data_format=data_format,
                                    out=(buf, np.empty_like(dg), np.empty_like(db)))
        np.testing.assert_array_equal(_bits(buf), _bits(dx))   # in place == out of place
        return dx, dg, db

    _same_on_every_body(call, compared=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("data_format", ["NCX", "NXC"])
def test_reduction_sums_are_the_same_on_every_body(rng, dtype, data_format):
    shape = (7, 33, 290) if data_format == "NCX" else (7, 290, 33)
    x, dy, mean, _, _ = _inputs(rng, shape, dtype, data_format, special=False)
    portable, *others = _every_body(
        lambda: backward_reduce(x, dy, mean, data_format=data_format)[0])
    for other in others:
        np.testing.assert_array_equal(other.view(np.uint64), portable.view(np.uint64))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,data_format", [((2, 3, 37), "NCX"), ((37, 19), "NXC")],
                         ids=str)
def test_padding_of_short_rows_adds_nothing(rng, dtype, shape, data_format):
    """An infinite mean makes every real term -inf (dy > 0): the sums must be exactly -inf,
    which padding lanes that computed inf - inf would turn into NaN."""
    x, _, mean, var, gamma = _inputs(rng, shape, dtype, data_format, special=False)
    dy = (np.abs(rng.standard_normal(shape)) + 0.5).astype(dtype)
    mean[0] = np.inf
    for result in _every_body(lambda: batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=1e-3, data_format=data_format)):
        assert np.isneginf(float(result[1][0]))
    _same_on_every_body(lambda: batchnorm_training_backward(
        x, dy, mean, var, gamma, epsilon=1e-3, data_format=data_format), compared=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,data_format,pad", [((5, 3, 7, 7), "NCX", 3), ((4, 3, 34), "NCX", 1),
                                                   ((4, 3, 19), "NCX", 2), ((40, 17), "NXC", 5),
                                                   ((40, 27), "NXC", 1), ((40, 10), "NXC", 3)],
                         ids=str)
@pytest.mark.parametrize("num_outputs", [3, 1])
def test_row_tails_write_only_their_elements(rng, dtype, shape, data_format, pad, num_outputs):
    """The last elements of a row (fewer than 16) are loaded and stored with masks: dx as a
    view whose rows are followed by `pad` sentinel elements, which must keep their bits."""
    x, dy, mean, var, gamma = _inputs(rng, shape, dtype, data_format, special=False)
    buffer = np.full(shape[:-1] + (shape[-1] + pad,), 7.0, np.float32).astype(dtype)
    before = _bits(buffer).copy()
    dx = buffer[..., :shape[-1]]
    stats = (np.empty_like(gamma), np.empty_like(gamma))[:num_outputs - 1]
    fresh = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                        data_format=data_format, num_outputs=num_outputs)
    batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5, data_format=data_format,
                                num_outputs=num_outputs, out=(dx,) + stats)
    np.testing.assert_array_equal(_bits(dx), _bits(fresh[0]))
    np.testing.assert_array_equal(_bits(buffer)[..., shape[-1]:], before[..., shape[-1]:])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_long_rows_are_cut_alike_on_every_path(dtype):
    """Rows longer than a kernel call's piece (2048) are summed in pieces of that size
    wherever they go: contiguous or strided, on every body.
    The first row of each channel holds one large term and, past the tile boundary in the same
    lane, four terms each a quarter of its f64 ulp: a row summed whole rounds each of them away,
    summed in two pieces it keeps them.  So a path that cut rows elsewhere would change the f64
    sums.  (Reversed rows are summed in memory order, another order: not compared here.)"""
    shape = (2, 3, 2100)
    x = np.zeros(shape, np.float32)
    x[0, :, 0] = 2.0 ** 15
    x[0, :, 2048:2100:16] = 2.0 ** -12         # (x - mean) * dy = 2**30 and 4 x 2**-24
    x, dy = x.astype(dtype), x.astype(dtype)
    mean = np.zeros(3, np.float32)

    def sums(layout):
        return backward_reduce(make_layout(x, layout), make_layout(dy, layout), mean,
                               data_format="NCX", num_threads=2)[0].view(np.uint64)

    want = sums("sliced")                      # strided rows
    for got in _every_body(lambda: sums("contiguous")):
        np.testing.assert_array_equal(got, want)


def _times_one_and_a_half(dy, dtype, data_format, kernel):
    """1.5 * dy as the kernels store it: by the scale kernel (DirectML's frozen GRAD) or the
    apply kernel (zero sums given to backward_apply)."""
    C = 2 if data_format == "NCX" else 16
    x = np.zeros_like(dy)                      # x - mean = 0
    var, eps = 0.75, 0.25                      # var + eps = 1: k1 = scale = 1.5 exactly
    if kernel == "scale":
        def stat(value):
            return np.full((1, C, 1), value, np.float32).astype(dtype)
        if data_format == "NCX":
            views = (x, dy)
        else:
            views = (x.transpose(0, 2, 1), dy.transpose(0, 2, 1))
        dx = dml.batch_normalization_grad(*views, stat(0.0), stat(var), stat(1.5), eps)[0]
        if data_format == "NXC":
            dx = dx.transpose(0, 2, 1)
    else:
        stat = np.ones(C, np.float32)
        dx = backward_apply(x, dy, stat * 0, stat * var, stat * 1.5, np.zeros((2, C)), dy.size // C,
                            epsilon=eps, data_format=data_format)[0]
    return dx


@pytest.mark.parametrize("dtype", [np.float16] + ([BF16] if BF16 is not None else []),
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("data_format", ["NCX", "NXC"])
@pytest.mark.parametrize("kernel", ["scale", "apply"])
@pytest.mark.parametrize("body", bodies())
def test_every_half_pattern_is_rounded_as_numpy_rounds(dtype, data_format, kernel, body):
    """dx = 1.5 * dy for all 65,536 dy patterns, stored by the kernels (the AVX2 bodies round
    bf16 from even and odd lanes apart).  The f32 product is exact and lands exactly halfway
    between two halves for thousands of patterns: ties to even, overflow, subnormals,
    infinities and NaNs all meet the rounding, checked against NumPy/ml_dtypes.  Frozen
    statistics (DirectML's GRAD) take the scale kernel; zero sums given to backward_apply make
    the training formula's apply kernel compute the same product."""
    dy = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)
    dy = dy.reshape((4, 2, 8192) if data_format == "NCX" else (4, 1024, 16))
    with kernels(body):
        dx = _times_one_and_a_half(dy, dtype, data_format, kernel)
    with np.errstate(over="ignore", invalid="ignore"):
        want = (np.float32(1.5) * dy.astype(np.float32)).astype(dtype)
    same_zero = lambda a: np.where(a == 0, np.zeros_like(a), a)   # the sign of 0 * 0 terms
    np.testing.assert_array_equal(_bits(same_zero(dx)), _bits(same_zero(want)))


@pytest.mark.parametrize("body", bodies())
def test_forcing_a_body_is_visible(body):
    """The comparisons above mean something only if the cap changes the body the kernels run:
    the kernels of every body the CPU runs are linked into one module, which holds the only
    cap of the process."""
    before = _config.kernel_body()
    with kernels(body):
        assert _config.kernel_body() == {"portable": "portable", "avx2": "AVX2",
                                         "avx512": "AVX-512", "neon": "NEON"}[body]
        assert (_engine.build_info()["half_path"] == "portable") == (body == "portable")
    assert _config.kernel_body() == before


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("in_layout", ["contiguous", "negative", "sliced"])
@pytest.mark.parametrize("dx_layout", ["contiguous", "negative", "transposed", "sliced"])
@pytest.mark.parametrize("shape,data_format", [((4, 3, 5, 60), "NCX"), ((4, 5, 60, 20), "NXC"),
                                               ((6, 7, 300), "NXC")], ids=str)
def test_results_do_not_depend_on_where_dx_lies(rng, dtype, in_layout, dx_layout, shape,
                                                data_format):
    """The order in which x and dy are visited decides how the sums round (f32 blocks of
    halves); a dx in another layout (rows that no longer merge, dims no longer flipped, not
    channel-last) must not change it: every out= dx gives the bits of the in-place call."""
    x, dy, mean, var, gamma = _inputs(rng, shape, dtype, data_format, special=False)
    x, dy = make_layout(x, in_layout), make_layout(dy, in_layout)
    buf = make_layout(dy, in_layout)
    dg, db = np.empty_like(gamma), np.empty_like(gamma)
    batchnorm_training_backward(x, buf, mean, var, gamma, epsilon=1e-5,
                                data_format=data_format, out=(buf, dg, db))
    dx = make_layout(np.zeros_like(dy), dx_layout)
    got = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                      data_format=data_format,
                                      out=(dx, np.empty_like(dg), np.empty_like(db)))
    assert got[0] is dx
    for a, b in zip(got, (buf, dg, db)):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def _at_offset(a, offset):
    """A copy of `a` whose data starts `offset` bytes into a 64-byte line."""
    raw = np.empty(a.nbytes + 128, np.uint8)
    skip = (offset - raw.ctypes.data) % 64
    out = raw[skip:skip + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 64 == offset
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(3, 2, 1040), (5, 1056), (3, 1041), (5, 3, 64), (4, 4, 64),
                                   (9, 5, 64), (40, 16), (33, 48), (20, 512), (17, 1024)],
                         ids=str)
@pytest.mark.parametrize("body", bodies())
def test_results_do_not_depend_on_where_x_starts_in_its_line(rng, dtype, shape, body):
    """Channel-last kernels cut rows wider than 2 KiB at x's first line boundary (the channels
    before it go alone), and walk narrower dense rows of whole lines from that boundary with
    the channels rotated (from a block of 16 rows on): the lane a channel falls in must not
    change a bit.  x, dy and the mask at every offset into a 64-byte line (dx where numpy puts
    it) give the bits of line-aligned arrays, backward (training, frozen, ReLU mask) and
    forward, on every body.  Rows of whole lines wide enough to cut in every storage type (1040,
    1056 channels: 16 + 16 lines and a leftover run); rows that are not whole lines (1041);
    rows of whole lines too few to rotate (15 rows of 64) and just enough (16), more (45 rows
    of 64); one line of f32 (16 channels) and three (48), which halves fill only partly; 2 KiB
    of f32 (512), the widest rotated row, and of halves (1024), which f32 cuts instead."""
    x, dy, mean, var, gamma = _inputs(rng, shape, dtype, "NXC", special=False)
    mask = x > 1

    def run(offset):
        a, g, m = (_at_offset(t, offset) for t in (x, dy, mask))
        return [_bits(r) for r in
                (*batchnorm_training_backward(a, g, mean, var, gamma, epsilon=1e-5,
                                              data_format="NXC"),
                 batchnorm_training_backward(a, g, mean, var, gamma, epsilon=1e-5,
                                             data_format="NXC", num_outputs=1)[0],
                 *batchnorm_training_backward(a, g, mean, var, gamma, epsilon=1e-5,
                                              data_format="NXC", relu_dst=m),
                 *bnbw_native.batchnorm_training_forward(a, mean, var, gamma, gamma,
                                                         epsilon=1e-5, data_format="NXC",
                                                         fuse_relu=True))
                if r is not None]

    with kernels(body):
        want = run(0)
        for offset in range(np.dtype(dtype).itemsize, 64, np.dtype(dtype).itemsize):
            got = run(offset)
            for i, (a, b) in enumerate(zip(got, want)):
                np.testing.assert_array_equal(a, b, err_msg=f"output {i}, offset {offset}")
