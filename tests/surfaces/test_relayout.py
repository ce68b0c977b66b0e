"""The tiled transposition that moves a gradient into its input's layout (bnbw_native/_relayout
.pyx, used by the torch layers): every element lands where NumPy's transpose puts it, on both
sides of every vector block (4 four-byte or 8 two-byte elements a side, whole ones inside partial
tiles too), tile (16 or 32 a side) and task (4 tiles a side) boundary, serial and parallel.  Without torch (the layers' use: test_torch_relayout.py), so
that every machine's vector path runs it."""
import numpy as np
import pytest

from bnbw_native._relayout import PARALLEL_MIN, transpose_samples

# sizes around the vector block (4, 8), tile (16, 32) and task (64, 128) edges, and odd ones
EDGES = [1, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 63, 64, 65, 127, 128, 129]


def _transposed(a, num_threads):
    samples, rows, cols = a.shape
    out = np.full((samples, cols, rows), 0x5A, dtype=a.dtype)   # no stale answer
    transpose_samples(a.ctypes.data, out.ctypes.data, samples, rows, cols, a.itemsize,
                      num_threads)
    return out


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize("rows", EDGES)
def test_every_element_lands_where_numpy_transposes_it(dtype, rows):
    rng = np.random.default_rng(rows)
    for cols in EDGES:
        a = rng.integers(0, np.iinfo(dtype).max, size=(2, rows, cols), dtype=dtype)
        np.testing.assert_array_equal(_transposed(a, 1), a.transpose(0, 2, 1))


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize("line_gap", [2048, 4096])
def test_every_element_lands_in_both_block_orders(dtype, line_gap):
    """Where dst's lines lie a multiple of 2 KiB apart (rows of that many bytes) a tile's
    blocks go column block first, elsewhere row block first: rows on that multiple and one
    element either side of it, against every column count around the edges."""
    rng = np.random.default_rng(line_gap)
    around = line_gap // np.dtype(dtype).itemsize
    for rows in (around - 1, around, around + 1):
        for cols in EDGES:
            a = rng.integers(0, np.iinfo(dtype).max, size=(1, rows, cols), dtype=dtype)
            np.testing.assert_array_equal(_transposed(a, 1), a.transpose(0, 2, 1))


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("dtype, shape", [
    (np.float32, (3, 64, 1024)),      # power-of-two planes: 32 x 32 images, channel-first
    (np.float32, (3, 1024, 64)),      # ... channel-last
    (np.float16, (2, 200, 333)),      # partial tiles and blocks at both ends
    (np.float32, (1, 4, 70000)),      # one sample, rows narrower than a tile
])
def test_parallel_calls_give_the_serial_result(num_threads, dtype, shape):
    assert np.prod(shape) >= PARALLEL_MIN    # the parallel path
    a = np.random.default_rng(7).standard_normal(shape).astype(dtype)
    a.flat[::97] = np.nan                    # bits move, values are not looked at
    want = a.transpose(0, 2, 1)
    got = _transposed(a, num_threads)
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()


def test_empty_matrices_write_nothing():
    out = np.full(8, 7, np.uint32)
    for shape in [(0, 4, 2), (4, 0, 2), (4, 2, 0)]:
        transpose_samples(0, out.ctypes.data, *shape, 4)
    assert (out == 7).all()


@pytest.mark.parametrize("bad, match", [
    (dict(itemsize=8), "itemsize: expected 2 or 4, got 8"),
    (dict(itemsize=1), "itemsize: expected 2 or 4, got 1"),
    (dict(rows=-1), "sizes >= 0"),
])
def test_bad_arguments_are_refused(bad, match):
    a = np.zeros(4, np.uint32)
    args = dict(src=a.ctypes.data, dst=a.ctypes.data, samples=1, rows=2, cols=2, itemsize=4)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        transpose_samples(**args)
