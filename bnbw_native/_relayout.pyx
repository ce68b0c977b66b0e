# cython: language_level=3
"""Dense tensors moved between channel-first and channel-last, for the torch layers.

A gradient can reach a layer in the other layout than its input (a pooling's backward under
torch.compile hands a channels-last model a contiguous one).  The kernels then want it copied
into the input's layout.  Per sample that copy is a transposition of a (rows, cols) matrix;
done element by element, the side read or written across rows touches one element per line,
and with power-of-two planes (32 x 32 images) all those lines fall into one cache set.  Here
the matrices go by 64-byte square tiles (src/bnbw_relayout.h): every line of either side is
read or written whole, once.
"""
from cython.parallel cimport prange
from libc.stdint cimport int64_t, uint16_t, uint32_t

from bnbw_native._headers cimport bnbw_tile
from bnbw_native._vocabulary cimport SERIAL_BELOW
from bnbw_native._engine cimport resolve_threads, team_started

# Tiles per block side
cdef int64_t BLOCK = 4
# Fewer elements than this go on the calling thread
PARALLEL_MIN = SERIAL_BELOW

ctypedef fused word:
    uint16_t
    uint32_t


cdef void _transpose(const word *src, word *dst, int64_t samples, int64_t rows, int64_t cols,
                     int threads) noexcept nogil:
    """Every sample's (rows, cols) matrix of src transposed into dst, a block of BLOCK x BLOCK
    tiles per task: it reads and writes runs of BLOCK lines on both sides, which the
    prefetchers follow, and its 16 KiB (float32) stay in the L1 between its tiles."""
    cdef int64_t side = 64 // sizeof(word), span = BLOCK * side
    cdef int64_t bi = (rows + span - 1) // span, bj = (cols + span - 1) // span
    cdef int64_t plane = rows * cols, tasks = samples * bi * bj
    cdef int64_t task, s, b, i0, j0, i, j
    if samples * plane < SERIAL_BELOW or threads == 1 or tasks == 1:
        threads = 1
    else:
        team_started()
    for task in prange(tasks, schedule="static", num_threads=threads):
        s = task // (bi * bj)
        b = task % (bi * bj)
        i0 = (b // bj) * span
        j0 = (b % bj) * span
        i = i0
        while i < min(i0 + span, rows):
            j = j0
            while j < min(j0 + span, cols):
                bnbw_tile(src + s * plane, dst + s * plane, rows, cols, i, j, sizeof(word))
                j = j + side
            i = i + side


def transpose_samples(size_t src, size_t dst, int64_t samples, int64_t rows, int64_t cols,
                      int itemsize, int num_threads=0):
    """dst[s][j][i] = src[s][i][j]: `samples` dense (rows, cols) matrices of `itemsize`-byte
    elements (2 or 4) at address src, written transposed at address dst, on num_threads
    threads (0: the package default).  The caller answers for the memory: two dense,
    non-overlapping buffers of samples * rows * cols elements (_torch_ops checks its tensors)."""
    if samples < 0 or rows < 0 or cols < 0:
        raise ValueError("expected sizes >= 0")
    if itemsize != 2 and itemsize != 4:
        raise ValueError(f"itemsize: expected 2 or 4, got {itemsize}")
    cdef int threads = resolve_threads(num_threads)
    if samples == 0 or rows == 0 or cols == 0:
        return
    with nogil:
        if itemsize == 2:
            _transpose(<const uint16_t *>src, <uint16_t *>dst, samples, rows, cols, threads)
        else:
            _transpose(<const uint32_t *>src, <uint32_t *>dst, samples, rows, cols, threads)
