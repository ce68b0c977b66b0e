"""Which schedule runs, with how many threads and how wide a slice, never changes a bit.

The schedules (bnbw_native/_schedules.pyx) choose between splitting a call into two passes and
fusing them per group of channels, and size slices and groups from the thread count and the
caches of the machine.  The reduction's partition (the plan's row blocks) depends on the
tensors only, so every choice must give the same bits: each call below runs under several
cache models (which switch between fused and split schedules and change slice widths) and
thread counts, more threads than this machine has cores included, and is compared with the
one-thread split call bit for bit; x holds far values at each channel's first element, at the
first element of its second reduction block and at its last.  The schedules' own balance -
how much work each of 2 to 64 threads gets - is checked on the network shapes of the
benchmark, and the engine's own account of a call (_arrays.describe: its layout, schedule,
threads, sums and temporaries) is checked on calls whose schedule is known.
"""
import numpy as np
import pytest

import bnbw_native
from bnbw_native import _arrays, backward_reduce, batchnorm_training_backward, tuning
from bnbw_native._onednn_graph import GRAPH
from conftest import BF16

NO_CACHE = (1 << 10, 1 << 12, 64)          # nothing fits: split schedules everywhere
SMALL_CACHE = (1 << 20, 32 << 20, 16)
LARGE_CACHE = (16 << 20, 1 << 30, 2)       # everything fits: large fused groups, slabs
MODELS = [NO_CACHE, SMALL_CACHE, LARGE_CACHE]
THREADS = [1, 2, 3, 7]                     # 7: more threads than this machine's cores

DTYPES = [np.float32, np.float16] + ([BF16] if BF16 is not None else [])
CASES = [  # shape, data_format
    ((64, 7, 7, 96), "NXC"),               # 3136 rows of 96 channels: several row blocks
    ((9, 11, 13, 40), "NXC"),              # odd rows and a partial line of channels
    ((600, 300), "NXC"),                   # rank 2, slices of 300 channels
    ((16, 10, 10, 1024), "NXC"),           # slices narrower than a row on many threads
    ((16, 48, 9, 9), "NCX"),
    ((2, 6, 5000), "NCX"),                 # rows longer than a kernel call's piece
    ((3, 4100), "NXC"),                    # one row block, slabs on both sides of TILE
    ((34, 7, 7, 160), "NXC"),              # row blocks of 832, 832 and 2 rows: runs of equal
    ((16, 7, 7, 512), "NXC"),              # work, not of equal counts (256 x 3 and 16 rows)
]


@pytest.fixture
def cache_model():
    before = tuning.cache_model()
    yield tuning.set_cache_model
    tuning.set_cache_model(*before)


def _bits(results):
    return [None if r is None else np.ascontiguousarray(r).view(np.uint8).tobytes()
            for r in results]


def _problem(rng, shape, data_format, dtype):
    C = shape[-1] if data_format == "NXC" else shape[1]
    x = (rng.standard_normal(shape) * 2 + 3).astype(np.float32).astype(dtype)
    dy = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    y = rng.standard_normal(shape) > 0
    stats = [rng.standard_normal(C).astype(np.float32), (rng.random(C) + 0.5).astype(np.float32),
             rng.standard_normal(C).astype(np.float32)]
    return _outliers(x, data_format), dy, y, stats


def _outliers(x, data_format):
    """x with a far value in every channel at its first element, at the first element of its
    second reduction block and at its last: a block summed out of turn, or by two threads,
    moves the bits."""
    facts = tuning.describe(x, data_format)
    if data_format == "NXC":
        rows = x.reshape(-1, x.shape[-1])
        step = facts.get("rows_per_block", len(rows))
    else:
        rows = np.moveaxis(x, 1, -1).reshape(-1, x.shape[1])    # a copy, visiting order
        step = facts.get("block", len(rows))
    for at in (0, step, len(rows) - 1):
        if at < len(rows):
            rows[at] = 5003.0
    if data_format != "NXC":
        x[...] = np.moveaxis(rows.reshape(np.moveaxis(x, 1, -1).shape), -1, 1)
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape, data_format", CASES, ids=str)
def test_every_schedule_and_thread_count_gives_the_same_bits(rng, cache_model, dtype, shape,
                                                            data_format):
    x, dy, y, (mean, var, gamma) = _problem(rng, shape, data_format, dtype)
    mean_low = (rng.standard_normal(mean.shape) * 1e-4).astype(np.float32)

    def run(threads):
        fused = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                            data_format=data_format, num_threads=threads)
        masked = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                             data_format=data_format, num_threads=threads,
                                             relu_dst=y)
        sums = backward_reduce(x, dy, mean, data_format=data_format, num_threads=threads)[0]
        centred = _arrays.backward(GRAPH, _arrays.TRAINING, x, dy, mean, var, gamma, 1e-5,
                                   data_format, None, threads, mean_low=mean_low)
        return _bits(list(fused) + list(masked) + [sums] + list(centred))

    cache_model(*NO_CACHE)
    want = run(1)
    schedules, blocks = set(), 0
    for model in MODELS:
        cache_model(*model)
        for threads in THREADS:
            assert run(threads) == want, (model, threads)
            facts = _arrays.describe(GRAPH, _arrays.TRAINING, x, dy, mean, var, gamma, 1e-5,
                                     data_format, threads)
            schedules.add(facts["schedule"])
            blocks = facts["blocks"]
    if data_format == "NCX":
        assert "major-sweep-fused" in schedules         # fused groups of several sizes met
    else:            # slabs against the split, which a call of one row block never takes
        assert "last-slab" in schedules and ("last-split" in schedules or blocks == 1)


# Channel-last rows that stream (NO_CACHE: every call does) are read one at a time when a pass
# reads more than 256 B of each and x's row is at most 2 KiB: x and dy from 33 float32 channels
# (17 in 16 bits), x alone from 65 (129), up to 512 float32 channels (1024 in 16 bits).  Those
# loops, and the elementwise ones, take two runs of 16 channels per step: odd and even run
# counts, with and without a tail of channels, on both sides of every threshold.
ROW_LOOP_CHANNELS = [48, 53, 80, 144, 167, 512, 519, 1008, 1031]


@pytest.mark.parametrize("dtype", [np.float32] + ([BF16] if BF16 is not None else []),
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("channels", ROW_LOOP_CHANNELS)
def test_rows_one_at_a_time_give_the_bits_of_rows_in_groups(rng, cache_model, dtype, channels):
    """The backward (plain, masked, the sums) and the forward (plain, fused ReLU) of streaming
    rows, read one at a time, give the bits of the same calls whose rows fit the caches (read
    four at a time), and match float64."""
    shape = (37, channels)
    x, dy, y, (mean, var, gamma) = _problem(rng, shape, "NXC", dtype)
    beta = rng.standard_normal(channels).astype(np.float32)

    def run():
        back = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                           data_format="NXC", num_threads=1)
        masked = batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                             data_format="NXC", num_threads=1, relu_dst=y)
        sums = backward_reduce(x, dy, mean, data_format="NXC", num_threads=1)[0]
        fwd = [bnbw_native.batchnorm_training_forward(
            x, np.zeros(channels, np.float32), np.ones(channels, np.float32), gamma, beta,
            epsilon=1e-5, momentum=0.0, data_format="NXC", num_threads=1, fuse_relu=relu)
            for relu in (False, True)]
        return list(back) + list(masked) + [sums, fwd[0].dst, fwd[0].batch_mean,
                                            fwd[0].batch_variance, fwd[1].dst]

    cache_model(*NO_CACHE)
    streamed = run()
    cache_model(*LARGE_CACHE)
    assert _bits(run()) == _bits(streamed)

    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    m64, r = mean.astype(np.float64), 1 / np.sqrt(var.astype(np.float64) + 1e-5)
    dbeta, dgamma = dy64.sum(0), r * ((x64 - m64) * dy64).sum(0)
    dx = gamma * r * (dy64 - dbeta / len(x) - (x64 - m64) * r * dgamma / len(x))
    tol = 1e-2 if dtype != np.float32 else 1e-5     # the storage type's rounding of dx
    np.testing.assert_allclose(streamed[0].astype(np.float64), dx,
                               rtol=tol, atol=tol * np.abs(dx).max())
    np.testing.assert_allclose(streamed[1], dgamma, rtol=1e-5, atol=1e-6 * np.abs(dgamma).max())
    np.testing.assert_allclose(streamed[2], dbeta, rtol=1e-5, atol=1e-6 * np.abs(dbeta).max())
    bm, bv = x64.mean(0), x64.var(0)
    np.testing.assert_allclose(streamed[8], bm, rtol=2 ** -23)
    np.testing.assert_allclose(streamed[9], bv, rtol=2 ** -23)
    want_y = (gamma * (x64 - bm) / np.sqrt(bv + 1e-5) + beta)
    np.testing.assert_allclose(streamed[7].astype(np.float64), want_y,
                               rtol=tol, atol=tol * np.abs(want_y).max())
    np.testing.assert_array_equal(streamed[10], np.maximum(streamed[7], 0))


@pytest.mark.parametrize("threads", [2, 3, 8, 16, 64])
@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
def test_threads_get_balanced_work_on_network_shapes(bench, cache_model, threads, data_format):
    """On every batch-norm shape of ResNet-50 and MobileNet-v2 at batch 50, a training call on
    2 to 64 threads splits into items enough for every thread that has 32 K elements to work
    on.  The split schedules hand each thread a run of items holding within an eighth of the
    mean's elements, however unequal the items (a short last block), unless their slices are
    already one line wide; the fused ones, wherever
    the rows make four items per thread, split evenly enough that the busiest thread does at
    most a quarter more than the mean."""
    cache_model(*SMALL_CACHE)
    shapes, items_of = bench.shapes, bench.balance.describe    # the schedule a call gets
    for name, nchw in {**shapes.RESNET50_B50, **shapes.MOBILENETV2_B50}.items():
        shape = nchw if data_format == "NCX" else (nchw[0], *nchw[2:], nchw[1])
        facts = items_of(shape, data_format, threads)
        items, used = facts["items"], facts["threads"]
        worth = min(threads, int(np.prod(shape)) // 32768)
        assert used == min(threads, items) and items >= worth, (name, facts)
        runs = facts["thread_elements"]
        if runs is not None:
            assert len(runs) == used and sum(runs) == int(np.prod(shape)), (name, facts)
            assert min(runs) > 0, (name, facts)
            # (slices of one 128-byte line cannot be cut finer)
            assert (8 * max(runs) * used <= 9 * sum(runs)
                    or facts["group"] == min(32, facts["channels"])), (name, facts)
            continue
        busiest = -(-items // used)
        if items >= 4 * used:
            assert busiest <= 1.25 * items / used, (name, facts)


@pytest.mark.parametrize("rows", [1665, 1666, 1700, 2450, 3136, 784])
@pytest.mark.parametrize("channels", [160, 512, 100])
def test_split_runs_weigh_a_short_last_block_by_what_it_holds(channels, rows):
    """Channel-last calls whose last row block is short (or nearly empty) still give every
    thread a run of items within an eighth of the mean's elements: whole rows where the blocks
    allow it, else slices of whole 128-byte lines."""
    x = np.empty((rows, channels), np.float32)
    for threads in (2, 3, 4):
        facts = describe(x, "NXC", num_threads=threads)
        if facts["schedule"] != "last-split":
            continue
        runs, used = facts["thread_elements"], facts["threads"]
        assert sum(runs) == rows * channels and len(runs) == used, facts
        assert min(runs) > 0, facts
        assert 8 * max(runs) * used <= 9 * sum(runs) or facts["group"] == 32, facts
        assert facts["group"] == channels or facts["group"] % 32 == 0, facts


# ---- the plan and schedule a call gets (what _arrays.describe says) ------------------------

def describe(x, data_format, formula=_arrays.TRAINING, num_threads=1, **kw):
    C = x.shape[-1 if data_format == "NXC" else 1]
    mean, var = np.zeros(C, np.float32), np.ones(C, np.float32)
    return _arrays.describe(GRAPH, formula, x, x, mean, var, None, 1e-5, data_format,
                          num_threads, **kw)


@pytest.mark.parametrize("shape, data_format, threads, formula, cache, schedule", [
    ((32, 14, 14, 64), "NXC", 2, _arrays.TRAINING, SMALL_CACHE, "last-split"),
    ((32, 14, 14, 64), "NXC", 2, _arrays.FROZEN_DX, SMALL_CACHE, "last-split"),
    ((32, 2, 2, 512), "NXC", 2, _arrays.TRAINING, SMALL_CACHE, "last-slab"),    # one row block
    ((32, 2, 2, 512), "NXC", 2, _arrays.FROZEN_DX, SMALL_CACHE, "last-split"),
    ((64, 7, 7, 96), "NXC", 1, _arrays.TRAINING, LARGE_CACHE, "last-slab"),     # fits the L2
    ((64, 7, 7, 96), "NXC", 1, _arrays.TRAINING, NO_CACHE, "last-split"),
    ((64, 7, 7, 96), "NXC", 2, _arrays.TRAINING, LARGE_CACHE, "last-split"),    # 4 blocks
    ((32, 64, 14, 14), "NCX", 2, _arrays.TRAINING, SMALL_CACHE, "major-sweep-fused"),
    ((1, 4, 70000), "NCX", 2, _arrays.TRAINING, SMALL_CACHE, "major-channel-fused"),
    ((32, 64, 14, 14), "NCX", 2, _arrays.FROZEN_DX, SMALL_CACHE, "major-sweep"),
    ((1, 2, 70000), "NCX", 2, _arrays.FROZEN_DX, SMALL_CACHE, "major-blocks"),
    ((0, 4, 3), "NCX", 2, _arrays.TRAINING, SMALL_CACHE, "nothing"),
])
def test_describe_names_the_schedule(cache_model, shape, data_format, threads, formula, cache,
                                     schedule):
    cache_model(*cache)
    facts = describe(np.zeros(shape, np.float32), data_format, formula, threads)
    assert facts["schedule"] == schedule
    assert facts["layout"] == ("empty" if 0 in shape else
                               "channel-last" if data_format == "NXC" else "channel-major")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("l2, l3", [(1 << 20, 32 << 20), (2 << 20, 260 << 20)])
def test_fused_groups_of_long_rows_take_a_part_of_the_l3(cache_model, threads, l2, l3):
    """Channel-major rows of 8 KiB or more group so that a group's x and dy fit the thread's
    L2 and, of the L3, a quarter of one CPU's part split among the threads, at most four L2s
    (an L3 of 260 MiB for 2 CPUs, as a guest may see its socket's, reaches that cap); shorter
    rows count the thread's whole part of the L3."""
    cache_model(l2, l3, 2)
    budget = l2 + min(4 * l2, l3 // (4 * 2 * threads))
    long_rows = np.zeros((32, 256, 48, 48), np.float32)      # 9 KiB rows
    facts = describe(long_rows, "NCX", num_threads=threads)
    group_bytes = 2 * 4 * facts["count"]                     # a channel's x and dy
    assert facts["schedule"] == "major-sweep-fused", facts
    assert facts["group"] * group_bytes <= budget, facts
    assert facts["group"] * group_bytes > l2, facts          # the L3 part is used
    short_rows = np.zeros((32 * 9, 256, 16, 16), np.float32) # 1 KiB rows, the same count
    facts = describe(short_rows, "NCX", num_threads=threads)
    assert facts["schedule"] == "major-sweep-fused", facts
    assert facts["group"] * group_bytes > budget, facts


def test_describe_reports_threads_sums_and_temporaries():
    x = np.zeros((4, 3, 8, 8), np.float16)
    facts = describe(x, "NCX", num_threads=2)
    assert facts["sums"] == "blocked" and facts["threads"] == 1     # too small for threads
    assert facts["channels"] == 3 and facts["count"] == 256
    assert describe(x.astype(np.float32), "NCX")["sums"] == "exact"
    if BF16 is not None:
        assert describe(x.astype(BF16), "NCX")["sums"] == "blocked-even-odd"
    like_nhwc = np.zeros((4, 8, 8, 3), bool).transpose(0, 3, 1, 2)  # same rows as x
    assert describe(x, "NCX", relu_dst=like_nhwc)["via_temp"] == []
    swapped = np.zeros((4, 3, 8, 8), bool).transpose(0, 1, 3, 2)     # H and W swapped
    assert describe(x, "NCX", relu_dst=swapped)["via_temp"] == ["relu_dst"]


@pytest.fixture
def stream_policy():
    before = tuning.set_stream_policy("auto")
    yield tuning.set_stream_policy
    tuning.set_stream_policy(before)


@pytest.mark.parametrize("shape, data_format", CASES + [((3, 7, 5, 77), "NCX"),
                                                       ((5, 9, 1000), "NXC")], ids=str)
def test_streaming_dx_never_changes_a_bit(rng, stream_policy, shape, data_format):
    """dx (and the forward's y) written past the caches in whole lines - channel-major rows
    peeled to a line - gives the bits of plain stores, on every kernel that writes: training,
    frozen, ReLU, in place, the forward.  Channel-last calls never stream."""
    x, dy, y, (mean, var, gamma) = _problem(rng, shape, data_format, np.float32)

    def run():
        out = [batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                           data_format=data_format, num_threads=2),
               batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                           data_format=data_format, num_outputs=1),
               batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                           data_format=data_format, relu_dst=y),
               bnbw_native.batchnorm_training_forward(x, mean, var, gamma, gamma, epsilon=1e-5,
                                                      data_format=data_format, fuse_relu=True)]
        g = dy.copy()
        batchnorm_training_backward(x, g, mean, var, gamma, epsilon=1e-5, data_format=data_format,
                                    out=(g, np.empty_like(mean), np.empty_like(mean)))
        return _bits([r for res in out for r in res if r is not None] + [g])

    stream_policy("never")
    want = run()
    stream_policy("always")
    assert run() == want
    assert _arrays.describe(GRAPH, _arrays.TRAINING, x, dy, mean, var, gamma, 1e-5,
                            data_format, 1)["stream_dx"] == (data_format == "NCX")


@pytest.mark.parametrize("shape, data_format, streams", [
    ((8, 4, 64, 64), "NCX", True),       # rows of 16 KiB, 3 x 512 KiB > L2: past the caches
    ((8, 4, 2048), "NCX", True),         # rows of exactly 8 KiB
    ((8, 4, 2047), "NCX", False),        # a row shorter than 8 KiB keeps cached stores
    ((64, 16, 14, 14), "NCX", False),    # rows of 784 B
    ((8, 64, 64, 4), "NXC", False),      # channel-last: never
])
def test_dx_streams_in_long_channel_major_rows_that_outgrow_the_caches(
        stream_policy, cache_model, shape, data_format, streams):
    """The automatic rule: f32 dx goes past the caches when x, dy and dx together outgrow the
    L3 and every thread's L2, in channel-major rows of 8 KiB or more; with caches that hold
    the call, never."""
    x = np.zeros(shape, np.float32)
    cache_model(64 << 10, 256 << 10, 2)
    assert describe(x, data_format)["stream_dx"] is streams
    assert describe(x, data_format, formula=_arrays.FROZEN_DX)["stream_dx"] is streams
    cache_model(*LARGE_CACHE)
    assert describe(x, data_format)["stream_dx"] is False


@pytest.mark.parametrize("shape, data_format", [((8, 16, 16, 64), "NXC"), ((8, 64, 16, 16), "NCX")])
def test_channel_last_rows_are_walked_from_a_line_only_while_the_data_stay_in_the_l2s(
        rng, cache_model, shape, data_format):
    """from_line (rotated walks of rows that start inside a 64-byte line) holds for channel-last
    calls whose x, dy and dx fit in the L2s of the call's threads, and never for channel-major
    ones; either way the bits are those of line-aligned arrays."""
    x = rng.normal(3, 2, shape).astype(np.float32)
    dy = rng.normal(0, 1, shape).astype(np.float32)
    axes = (0, 1, 2) if data_format == "NXC" else (0, 2, 3)
    mean = x.mean(axis=axes, dtype=np.float64).astype(np.float32)
    var = x.var(axis=axes, dtype=np.float64).astype(np.float32)
    gamma = rng.normal(1, 0.2, mean.shape).astype(np.float32)

    def at_16(a):           # 16 bytes into a line, as numpy places large arrays
        raw = np.empty(a.nbytes + 128, np.uint8)
        skip = (16 - raw.ctypes.data) % 64
        out = raw[skip:skip + a.nbytes].view(a.dtype).reshape(a.shape)
        out[...] = a
        return out

    def run():
        a, g = at_16(x), at_16(dy)
        return _bits([*batchnorm_training_backward(a, g, mean, var, gamma, epsilon=1e-5,
                                                   data_format=data_format),
                      *bnbw_native.batchnorm_training_forward(a, mean, var, gamma, gamma,
                                                              epsilon=1e-5,
                                                              data_format=data_format)])

    want = _bits([*batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                               data_format=data_format),
                  *bnbw_native.batchnorm_training_forward(x, mean, var, gamma, gamma,
                                                          epsilon=1e-5,
                                                          data_format=data_format)])
    for threads in (1, 2):
        cache_model(64 << 10, 256 << 10, 2)         # 3 x 512 KiB outgrow these
        assert describe(x, data_format, num_threads=threads)["from_line"] is False
        assert run() == want
        cache_model(*LARGE_CACHE)
        assert (describe(x, data_format, num_threads=threads)["from_line"]
                is (data_format == "NXC"))
        assert run() == want


@pytest.mark.parametrize("formula", ["training", "forward"])
def test_channel_last_rows_stream_past_the_threads_l2s(cache_model, formula):
    """streaming (channel-last rows visited one at a time) holds when x, dy and dx outgrow the
    L2s of the call's threads, whatever the L3 - on both sides of that budget, for each thread
    count - and from_line holds exactly when it does not; neither for channel-major calls."""
    x = np.empty((1024, 256), np.float32)            # 1 MiB: three tensors of 3 MiB
    for l3, sharers in [(8 << 20, 4), (1 << 30, 1), (0, 0)]:
        for threads, streams in [(1, True),           # 1 MiB
                                 (2, True),           # 2 MiB
                                 (3, False),          # 3 MiB: exactly the tensors
                                 (4, False)]:
            cache_model(1 << 20, l3, sharers)
            facts = tuning.describe(x, "NXC", formula=formula, num_threads=threads)
            assert facts["threads"] == threads
            assert facts["streaming"] is streams, (l3, sharers, threads)
            assert facts["from_line"] is not streams, (l3, sharers, threads)
            major = tuning.describe(x.reshape(4, 256, 256), "NCX", formula=formula,
                                    num_threads=threads)
            assert major["streaming"] is False and major["from_line"] is False


def _sysfs_caches():
    """{level: (bytes, CPUs sharing it)} of CPU 0's data and unified caches, as sysfs lists
    them (empty where there is no sysfs)."""
    import glob
    import os
    found = {}
    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        def read(name):
            with open(os.path.join(index, name)) as f:
                return f.read().strip()
        try:
            level, kind, size = int(read("level")), read("type"), read("size")
            cpus = read("shared_cpu_list")
        except OSError:
            continue
        if kind == "Instruction":
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
        sharers = sum(int(b) - int(a) + 1 for a, _, b in
                      (part.partition("-") if "-" in part else (part, "", part)
                       for part in cpus.split(",")))
        found[level] = (int(size.rstrip("KMG")) * scale, sharers)
    return found


def test_the_cache_model_is_what_the_os_lists():
    """The schedules size their work by the caches sysfs lists for CPU 0 (an instance of the
    L3, not the whole package's, which sysconf reports on some AMD guests), and by how many
    CPUs share that L3."""
    caches = _sysfs_caches()
    if 2 not in caches or 3 not in caches:
        pytest.skip("this OS lists no L2 and L3 in sysfs")
    l2, l3, sharers = tuning.cache_model()
    assert (l2, l3, sharers) == (caches[2][0], caches[3][0], caches[3][1])


# ---- bnbw_native.tuning: the knobs' one door ----------------------------------------------

def test_the_tuning_module_drives_the_knobs_it_names(cache_model):
    from bnbw_native import tuning
    x = np.zeros((32, 64, 14, 14), np.float32)
    tuning.set_cache_model(*SMALL_CACHE)
    assert tuning.cache_model() == SMALL_CACHE
    assert tuning.describe(x, "NCX", num_threads=2)["schedule"] == "major-sweep-fused"
    assert tuning.describe(x, "NCX", formula="frozen", num_threads=2)["schedule"] == "major-sweep"
    assert tuning.describe(x, "NCX", formula="forward", num_threads=2)["schedule"] in \
        tuning.SCHEDULES
    with pytest.raises(ValueError, match="formula must be one of"):
        tuning.describe(x, "NCX", formula="inference")
    before = tuning.set_stream_policy("never")
    assert tuning.set_stream_policy(before) == "never"
    assert tuning.set_scratch_poison(tuning.set_scratch_poison(True)) is True
    assert tuning.TILE_ELEMENTS == 2048 and set(tuning.KERNEL_CAPS) >= {"portable"}


FLOOR = 128 * 1024          # bytes a thread must read (the default thread rule)


@pytest.fixture
def thread_rule():
    """The default thread rule (the session runs with the floor at 0)."""
    previous = tuning.set_thread_work_floor(FLOOR)
    yield
    tuning.set_thread_work_floor(previous)


@pytest.mark.parametrize("formula, arrays", [("training", 2), ("forward", 1)])
@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
@pytest.mark.parametrize("elements", [65536, 98304 - 64, 98304, 131072 - 64, 131072, 1 << 20])
def test_a_call_takes_one_thread_per_128_kib_it_reads(thread_rule, formula, arrays,
                                                     data_format, elements):
    # x (and dy) bytes // 128 KiB threads, at most those given, at least one; on both sides
    # of each step (rows of 32 KiB: the row-share rule never binds)
    shape = (elements // 8192, 8192) if data_format == "NXC" else (elements // 4096, 64, 64)
    paid = max(1, 4 * elements * arrays // FLOOR)
    for given in (1, 2, 3, 8):
        facts = tuning.describe(np.zeros(shape, np.float32), data_format, formula=formula,
                                num_threads=given)
        assert facts["threads"] == min(given, paid, facts["items"]), (given, facts)


@pytest.mark.parametrize("rows, C, given, thin, paged", [
    (1024, 64, 2, 1, 1),       # one row block of 256-byte rows: no 512 bytes for two
    (1024, 128, 2, 1, 1),      # 512-byte rows: one share
    (512, 256, 2, 2, 1),       # 1 KiB rows: two 512-byte shares, no page for two
    (512, 256, 3, 2, 1),
    (128, 1024, 2, 2, 1),      # 4 KiB rows: one page
    (128, 1024, 3, 3, 3),      # ... 512 bytes for three: more than twice as many threads
    (128, 1024, 4, 4, 4),
    (64, 2048, 2, 2, 2),       # 8 KiB rows: two pages
    (64, 2048, 4, 4, 2),       # (512 bytes for four threads: only twice two)
    (32, 8192, 4, 4, 4),       # 32 KiB rows: eight pages
])
def test_threads_that_share_one_row_block_take_512_bytes_or_a_page_of_a_row(
        thread_rule, rows, C, given, thin, paged):
    # The threads of a call of one row block take slices of the same rows: 512 bytes each at
    # least; the training and forward calls apply by runs of whole rows where the slices are
    # thinner than a page, and the frozen dx - written in its slices, in the pass that sums -
    # gives each thread a page, or 512 bytes where that brings more than twice the threads.
    # (x is 128 KiB - 1 MiB: the thread floor never binds.)
    for formula in ("training", "forward", "frozen"):
        facts = tuning.describe(np.zeros((rows, C), np.float32), "NXC", formula=formula,
                                num_threads=given)
        want = paged if formula == "frozen" else thin
        assert facts["blocks"] == 1, facts
        assert facts["threads"] == min(want, facts["items"]) == want, (formula, facts)
        if formula != "frozen":
            assert facts["apply_rows"] == (want > 1 and facts["group"] * 4 < 4096), facts


def test_thin_rows_in_many_blocks_go_to_threads_block_by_block(thread_rule):
    facts = tuning.describe(np.zeros((6272, 64), np.float32), "NXC", num_threads=2)
    assert facts["blocks"] > 2 and facts["threads"] == 2 and facts["group"] == 64, facts


@pytest.mark.parametrize("formula", ["training", "forward"])
@pytest.mark.parametrize("rows, C, dtype, blocks, by_rows", [
    (784, 256, np.float32, 2, True),      # a long block and a short one: slices balance
    (768, 256, np.float32, 2, True),
    (392, 512, np.float32, 2, True),
    (196, 1024, np.float16, 2, True),
    (1568, 256, np.float32, 4, True),
    (2048, 322, np.float32, 5, True),
    (2450, 160, np.float32, 3, True),
    (6272, 256, np.float32, 13, False),   # whole rows balance: the apply goes by the items
    (784, 2048, np.float32, 7, False),
])
def test_the_apply_goes_by_whole_rows_where_the_items_runs_share_rows(
        thread_rule, formula, rows, C, dtype, blocks, by_rows):
    # Where the threads' runs of items cut rows between them (slices) or are unequal, the
    # apply after the sums goes by equal runs of whole rows (threads writing slices of the
    # same rows at once slow each other down); the bits are one thread's either way
    x, dy = (np.random.default_rng(rows).standard_normal((rows, C)).astype(dtype)
             for _ in range(2))
    facts = tuning.describe(x, "NXC", formula=formula, num_threads=2)
    assert facts["blocks"] == blocks and facts["threads"] == 2, facts
    assert facts["apply_rows"] == by_rows, facts
    stat = np.ones(C, np.float32)
    if formula == "training":
        def call(nt):
            return bnbw_native.batchnorm_training_backward(x, dy, stat, stat, stat,
                                                           epsilon=1e-5, num_threads=nt)
    else:
        def call(nt):
            return bnbw_native.batchnorm_training_forward(x, stat, stat, epsilon=1e-5,
                                                          num_threads=nt)
    for one, two in zip(call(1), call(2)):
        np.testing.assert_array_equal(two, one)


def test_without_the_floor_threads_share_rows_however_thinly():
    # the tests' setting (floor 0): small channel-last inputs reach every team
    facts = tuning.describe(np.zeros((1024, 64), np.float32), "NXC", num_threads=2)
    assert facts["blocks"] == 1 and facts["threads"] == 2, facts


def test_the_thread_rule_counts_bytes_not_elements(thread_rule):
    # float16 halves the bytes of the same elements: half the threads
    shape = (32, 64, 64)        # x and dy of 1 MiB in float32: eight 128 KiB shares
    f32 = tuning.describe(np.zeros(shape, np.float32), "NCX", num_threads=8)
    f16 = tuning.describe(np.zeros(shape, np.float16), "NCX", num_threads=8)
    assert (f32["threads"], f16["threads"]) == (8, 4)


def test_the_thread_floor_is_refused_below_zero():
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        tuning.set_thread_work_floor(-1)
