"""Every schedule writes its scratch before it reads it, in every pass.

A call's scratch - the row blocks' partial sums, the per-channel floats - is reused between
passes: the training forward sums a channel again around fl32(mean) when the first pass's sums,
taken around the channel's first element, cancel too much (contract §10).  A pass that added to
the sums of the pass before instead of replacing them gave a mean of shift + 2·(mean - shift)
on channel-last plans of several row blocks, silently.

Two guards here:

* the property test: every schedule (forced by layout, channel count, thread count and cache
  model; `describe()` says which one ran) × row/element counts on both sides of a block
  boundary (and of a kernel tile on channel-major rows) × where an outlier sits (the channel's
  first element, which the forward sums around first; the first row of a later block; the last
  element), against a float64 NumPy reference written here, and bit for bit across schedules;
* scratch poisoning: `tuning.set_scratch_poison(True)` fills each call's scratch with NaN,
  so that any pass reading what it did not write gives NaN, not a plausible number.
"""
import numpy as np
import pytest

from bnbw_native import (backward_reduce, batchnorm_training_backward,
                         batchnorm_training_forward, tuning)

NO_CACHE = (1 << 10, 1 << 12, 64)          # nothing fits: smallest fused groups
LARGE_CACHE = (8 << 20, 1 << 30, 2)        # everything fits: widest fused groups
EPS = 1e-5
BASE, OUTLIER = 3.0, 5000.0                # noise around BASE; the outlier BASE + OUTLIER


@pytest.fixture(autouse=True)
def poisoned_scratch():
    before = tuning.cache_model()
    previous = tuning.set_scratch_poison(True)
    yield
    tuning.set_scratch_poison(previous)
    tuning.set_cache_model(*before)


# Each case: a name, the array shape, data_format and the count per block (rows for NXC,
# reduced elements for NCX).  Channel-last blocks are 131072 // C elements in rows of multiples
# of 16 within 128..1024 rows; channel-major blocks are 32768 elements (whole rows when a row
# fits in one), rows cut into tiles of 2048.  A first element far from its channel's mean makes
# the forward sum again only past 4096 elements per channel (the outlier's own share of the
# variance), so every case has more.
CASES = []
for rows in (5 * 1024 - 1, 5 * 1024, 5 * 1024 + 1):       # 4 channels: 1024-row blocks
    CASES.append((f"nxc-C4-rows{rows}", (rows, 4), "NXC", 1024))
for rows in (2 * 3280 - 1, 2 * 3280, 2 * 3280 + 1):       # 40 channels: 3280-row blocks
    CASES.append((f"nxc-C40-rows{rows}", (rows, 40), "NXC", 3280))
# rows one at a time (no common row stride): channels 2..7 of 9, rank 3
CASES.append(("nxc-strided", (5, 1025, 6), "NXC", 1024))
for n in (511, 512, 513):                                   # whole 64-element rows
    CASES.append((f"ncx-rows64-n{n}", (n, 3, 64), "NCX", 32768))
for length in (32767, 32768, 32769):                        # blocks cut rows
    CASES.append((f"ncx-row{length}", (1, 3, length), "NCX", 32768 // length * length or 32768))
CASES.append(("ncx-row2049", (17, 3, 2049), "NCX", 15 * 2049))   # rows cross a tile


def _zeros(case):
    name, shape, _, _ = case
    if name == "nxc-strided":
        return np.zeros((5, 1025, 9), np.float32)[:, :, 2:8]
    return np.zeros(shape, np.float32)


def _make(case, rng, where):
    """The case's x: noise around BASE, and in each channel one outlier at `where`, the
    position in the channel's reduced elements in the engine's order (row-major over the
    reduced dims)."""
    _, _, data_format, block = case
    x = _zeros(case)
    x[...] = rng.standard_normal(x.shape) + BASE
    for c in range(x.shape[-1 if data_format == "NXC" else 1]):
        values = x[..., c] if data_format == "NXC" else x[:, c]      # a view
        pos = {"first": 0, "later-block": min(block, values.size - 1),
               "last": values.size - 1}[where]
        values[np.unravel_index(pos, values.shape)] = BASE + OUTLIER * (1 + c % 8)
    return x


def _reference(x, data_format, gamma, beta):
    axis = x.ndim - 1 if data_format == "NXC" else 1
    axes = tuple(d for d in range(x.ndim) if d != axis)
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=axes)
    var = ((x64 - np.expand_dims(mean, axes)) ** 2).mean(axis=axes)
    shape = [1] * x.ndim
    shape[axis] = -1
    r = 1 / np.sqrt(var + EPS)
    scaled = (gamma * r).reshape(shape) * (x64 - mean.reshape(shape))
    return mean, var, scaled + beta.reshape(shape), np.abs(scaled) + np.abs(beta).reshape(shape)


def _forward(x, data_format, gamma, beta, threads, relu=False):
    C = x.shape[-1 if data_format == "NXC" else 1]
    old = np.zeros(C, np.float32), np.ones(C, np.float32)
    return batchnorm_training_forward(x, *old, gamma, beta, epsilon=EPS, momentum=0.0,
                                      data_format=data_format, num_threads=threads,
                                      fuse_relu=relu)


def _schedule(x, data_format, threads):
    return tuning.describe(x, data_format, formula="forward", num_threads=threads)["schedule"]


def _bits(result):
    return [np.ascontiguousarray(a).view(np.uint8).tobytes() for a in result]


def _runs(x, data_format):
    """(schedule, bits) of the forward under every thread count and cache model tried."""
    C = x.shape[-1 if data_format == "NXC" else 1]
    gamma = np.linspace(0.5, 2.0, C).astype(np.float32)
    beta = np.linspace(-1.0, 1.0, C).astype(np.float32)
    runs = []
    for model in (NO_CACHE, LARGE_CACHE):
        tuning.set_cache_model(*model)
        for threads in (1, 2, 3):
            result = _forward(x, data_format, gamma, beta, threads)
            runs.append((_schedule(x, data_format, threads), result))
    return gamma, beta, runs


@pytest.mark.parametrize("where", ["first", "later-block", "last"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_statistics_on_every_schedule_around_block_boundaries(rng, case, where):
    name, shape, data_format, _ = case
    x = _make(case, rng, where)
    gamma, beta, runs = _runs(x, data_format)
    mean, var, y, size = _reference(x, data_format, gamma, beta)
    want = _bits(runs[0][1])
    for schedule, result in runs:
        assert _bits(result) == want, (schedule, name, where)
    result = runs[0][1]
    # contract §10: batch statistics within one float32 ulp of the float64 values
    ulp = lambda v: np.spacing(np.abs(v).astype(np.float32)).astype(np.float64)  # noqa: E731
    assert np.all(np.abs(result.batch_mean - mean) <= ulp(mean)), (result.batch_mean, mean)
    assert np.all(np.abs(result.batch_variance - var) <= ulp(var)), (result.batch_variance, var)
    # dst within 2^-20 of its terms' size, plus its rounding to float32
    err = np.abs(result.dst.astype(np.float64) - y)
    assert np.all(err <= 2.0 ** -20 * size + np.abs(y) * 2.0 ** -24), err.max()


def test_the_cases_reach_every_schedule():
    """The forward's cases above run on all six schedules that sum (and the backward's below
    on the split ones): nothing is left to chance in the cache model or thread count."""
    seen = set()
    for case in CASES:
        x = _zeros(case)
        for model in (NO_CACHE, LARGE_CACHE):
            tuning.set_cache_model(*model)
            for threads in (1, 2, 3):
                seen.add(_schedule(x, case[2], threads))
    assert seen == {"last-split", "last-slab", "major-sweep", "major-blocks",
                    "major-sweep-fused", "major-channel-fused"}


def test_a_far_first_element_on_many_row_blocks():
    """The defect as found: 8192 rows of 4 channels, all 0 but the first row at 5.  The mean
    was shift + 2·(mean - shift) = -4.9988 in every channel."""
    x = np.zeros((8192, 4), np.float32)
    x[0] = 5.0
    result = _forward(x, "NXC", None, None, 1)
    np.testing.assert_array_equal(result.batch_mean, np.float32(5.0 / 8192))
    assert np.all(np.abs(result.batch_variance - x.astype(np.float64).var(axis=0))
                  <= np.spacing(np.float32(x.astype(np.float64).var(axis=0)[0])))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_backward_passes_never_read_unwritten_scratch(rng, case):
    """Poisoned scratch gives the same bits as clean scratch on every schedule, in every
    backward formula: the training gradient (plain and masked), diff_src only, the sums."""
    name, shape, data_format, _ = case
    x = _make(case, rng, "first")
    dy = rng.standard_normal(x.shape).astype(np.float32)
    C = x.shape[-1 if data_format == "NXC" else 1]
    mean, var = x.astype(np.float64).mean(axis=tuple(
        d for d in range(x.ndim) if d != (x.ndim - 1 if data_format == "NXC" else 1))), None
    mean = mean.astype(np.float32)
    var = np.full(C, 4.0, np.float32)
    gamma = np.linspace(0.5, 2.0, C).astype(np.float32)

    def calls(threads):
        kw = dict(epsilon=EPS, data_format=data_format, num_threads=threads)
        return (_bits(batchnorm_training_backward(x, dy, mean, var, gamma, **kw))
                + _bits(batchnorm_training_backward(x, dy, mean, var, gamma, relu_dst=x > BASE,
                                                    **kw))
                + _bits(batchnorm_training_backward(x, dy, mean, var, gamma, num_outputs=1,
                                                    **kw)[:1])
                + _bits(backward_reduce(x, dy, mean, data_format=data_format,
                                        num_threads=threads)[:1]))

    tuning.set_scratch_poison(False)
    tuning.set_cache_model(*NO_CACHE)
    want = calls(1)
    tuning.set_scratch_poison(True)
    for model in (NO_CACHE, LARGE_CACHE):
        tuning.set_cache_model(*model)
        for threads in (1, 2, 3):
            assert calls(threads) == want, (name, model, threads)


def _last_block_rows(C):
    """The plan's channel-last rows per block (bnbw_native/_plan.pyx): about 131072 elements,
    whole multiples of 16 rows, within 128..1024 rows."""
    return min(1024, max(128, -(-131072 // C + 15) // 16 * 16))


SWEEP = [(C, rows) for C in (1, 3, 17, 130, 1030, 2050)
         for rows in {4097, *(k * _last_block_rows(C) + d
                              for k in (5, 9) for d in (-1, 0, 1)
                              if k * _last_block_rows(C) + d > 4096)}]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("where", ["first", "later-block", "last"])
@pytest.mark.parametrize("C, rows", SWEEP, ids=[f"C{c}-rows{r}" for c, r in SWEEP])
def test_forward_sweep_over_channel_counts(rng, C, rows, where, dtype):
    """The property test over more channel counts (row blocks of 128..1024 rows, slices that
    split a row, rows wider than a tile) and float16 storage."""
    case = (f"C{C}", (rows, C), "NXC", _last_block_rows(C))
    x = _make(case, rng, where).astype(dtype)
    gamma, beta, runs = _runs(x, "NXC")
    want = _bits(runs[0][1])
    assert all(_bits(result) == want for _, result in runs)
    mean, var, _, _ = _reference(x, "NXC", gamma, beta)
    ulp = np.spacing(np.abs(mean).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(runs[0][1].batch_mean - mean) <= ulp)
    ulp = np.spacing(np.abs(var).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(runs[0][1].batch_variance - var) <= ulp)


def test_every_road_to_the_forward_on_the_defect_as_found():
    """The same 8192 x 4 input through every surface that reaches the forward's kernels: the
    array call, the DirectML-style training operator (the C API's, whose table is a thin shell
    over it), the two phases of the Sync layers, and the torch layer against
    torch.nn.BatchNorm1d.  Each had the wrong mean before."""
    from bnbw_native import _two_phase, dml
    x = np.zeros((8192, 4), np.float32)
    x[0] = 5.0
    want = np.float32(5.0 / 8192)
    got = _forward(x, "NXC", None, None, 2)
    np.testing.assert_array_equal(got.batch_mean, want)

    big, stat = dml.TensorDesc("float32", x.shape), dml.TensorDesc("float32", (1, 4))
    op = dml.BatchNormalizationTraining(
        input=big, mean=stat, variance=stat, output=big, output_running_mean=stat,
        output_running_variance=stat, output_batch_mean=stat, output_batch_variance=stat,
        epsilon=EPS)
    out = [np.empty_like(x)] + [np.empty(4, np.float32) for _ in range(4)]
    op.execute(input=x, mean=np.zeros(4, np.float32), variance=np.ones(4, np.float32),
               output=out[0], output_running_mean=out[1], output_running_variance=out[2],
               output_batch_mean=out[3], output_batch_variance=out[4])
    np.testing.assert_array_equal(out[3], want)
    assert np.array_equal(out[0].view(np.uint32), got.dst.view(np.uint32))

    # the Sync layers' phases: sums around a shift far from the mean (the first element)
    shift = x[0].copy()
    sums, count = _two_phase.forward_reduce(x, shift, data_format="NXC")
    phases = _two_phase.forward_apply(x, shift, None, None, sums, count, epsilon=EPS,
                                      data_format="NXC")
    assert np.all(np.abs(phases[3] - 5.0 / 8192) <= 2 * np.spacing(want))

    torch = pytest.importorskip("torch")
    from bnbw_native.autograd import BatchNorm
    t = torch.from_numpy(x)
    with torch.no_grad():
        y = BatchNorm(4)(t)
        ref = torch.nn.BatchNorm1d(4)(t)
    assert float((y - ref).abs().max()) < 1e-3 * float(ref.abs().max())


# ---- an operator's scratch, reused ------------------------------------------------------------
# A DirectML (or C) operator's plan holds its scratch: every execute reuses it, and one that
# finds it taken by another thread's execute allocates its own.  Neither may carry anything
# from one execute into the next.

def _training_operator(shape, channel_last):
    from bnbw_native import dml
    n, c, rows = shape
    big = (dml.TensorDesc("float32", (n, c, rows), (rows * c, 1, c)) if channel_last
           else dml.TensorDesc("float32", (n, c, rows)))
    stats = dml.TensorDesc("float32", (1, c, 1))
    return dml.BatchNormalizationTraining(
        input=big, mean=stats, variance=stats, scale=stats, bias=stats, output=big,
        output_running_mean=stats, output_running_variance=stats, output_batch_mean=stats,
        output_batch_variance=stats, epsilon=EPS, momentum=0.25)


def _problem(rng, shape, channel_last, far):
    n, c, rows = shape
    x = rng.standard_normal((n, rows, c) if channel_last else (n, c, rows)).astype(np.float32)
    x += np.float32(far)             # far from 0: the forward sums some channels again
    stats = [rng.standard_normal((1, c, 1)).astype(np.float32) for _ in range(4)]
    stats[1] = np.abs(stats[1]) + 1
    return x, stats


def _run(op, x, stats, num_threads=None):
    out = np.empty_like(x)
    outs = [np.empty_like(stats[0]) for _ in range(4)]
    op.execute(input=x, mean=stats[0], variance=stats[1], scale=stats[2], bias=stats[3],
               output=out, output_running_mean=outs[0], output_running_variance=outs[1],
               output_batch_mean=outs[2], output_batch_variance=outs[3],
               num_threads=num_threads)
    return [out] + outs


@pytest.mark.parametrize("channel_last", [False, True])
def test_an_operator_run_many_times_gives_a_fresh_operators_bits(rng, channel_last):
    shape = (4, 40, 700)          # channel-last: several row blocks; channel-major: two tiles
    op = _training_operator(shape, channel_last)
    problems = [_problem(rng, shape, channel_last, far) for far in (0.0, 3e4, 1.0, -7e3)]
    for x, stats in problems + problems[::-1]:
        got = _run(op, x, stats, num_threads=2)
        want = _run(_training_operator(shape, channel_last), x, stats, num_threads=1)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))


def test_one_operator_from_many_threads_at_once(rng):
    from concurrent.futures import ThreadPoolExecutor
    shape = (8, 64, 512)
    op = _training_operator(shape, True)
    problems = [_problem(rng, shape, True, far) for far in (0.0, 2e4, -5.0, 9e3)] * 4
    want = [_run(_training_operator(shape, True), x, s, num_threads=1) for x, s in problems]
    with ThreadPoolExecutor(8) as pool:            # executes overlap: some find it taken
        got = list(pool.map(lambda p: _run(op, *p, num_threads=1), problems))
    for g_all, w_all in zip(got, want):
        for g, w in zip(g_all, w_all):
            np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))
