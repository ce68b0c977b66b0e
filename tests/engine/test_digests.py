"""The same bits on every machine: digests of a fixed set of calls, recorded in digests.json.

Every kernel body gives the bits of the portable one (test_kernel_paths.py compares them on
this CPU); this test pins those bits down across machines, compilers and instruction sets.  A
fixed list of calls covers every kernel path - channels first (NCX) and last (NXC), strided,
negative-strided and general layouts, the channel-major runs of short rows, rows cut at the
2048-element tile, f32/f16/bf16 storage with f32 and bf16 statistics, exact and blocked sums,
training and frozen statistics (num_outputs=1), the two-phase backward_reduce/backward_apply,
ReLU masks of the storage type and bool with diff_residual, NaN and infinity inputs, one element
per channel, and sizes that are not multiples of 16.  Each call's outputs are hashed (SHA-256 of
their bytes, every NaN as one pattern, since which NaN an operation returns is not specified)
and compared with the digests recorded in tests/engine/digests.json, on every body this CPU runs and
at 1 and 2 threads.

Inputs come from an integer hash in NumPy's uint64 arithmetic, turned into floats exactly
(small integers times powers of two, representable in the storage type): no random generator
and no libm, so every machine builds the same inputs.

Regenerate the file after a deliberate change of results (it checks first that every body and
thread count agrees, and refuses otherwise):

    python tests/engine/test_digests.py --record
"""
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

if __name__ == "__main__":          # run as a script (--record): the tests' helpers beside it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bnbw_native as bn  # noqa: E402
from conftest import BF16, bodies, kernels, make_layout  # noqa: E402

DIGESTS = Path(__file__).resolve().parent / "digests.json"
EPS = 2.0 ** -10                                 # exact in every precision
THREADS = (1, 2)

# ---------------------------------------------------------------------------------------------
# Inputs: hashed integers, exact in the storage type


def _hashes(n, seed):
    """n 64-bit hashes (splitmix64 of seed, seed + 1, ...), in NumPy's wrapping uint64."""
    z = (np.arange(n, dtype=np.uint64) + np.uint64(seed)) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _ints(shape, seed, bits, low=None):
    """Integers in [low, low + 2^bits) (low = -2^(bits-1) when None) as int64."""
    n = math.prod(shape)
    k = (_hashes(n, seed) >> np.uint64(64 - bits)).astype(np.int64)
    return (k + (-(1 << (bits - 1)) if low is None else low)).reshape(shape)


# significand bits each storage type holds exactly
BITS = {"f32": 24, "f16": 11, "bf16": 8}


def _floats(shape, seed, kind, exp, low=None, bits=None):
    """f32 values k * 2^exp, k a hashed integer of the type's significand width: exact in
    `kind`, so the cast to it changes nothing."""
    k = _ints(shape, seed, bits or BITS[kind], low)
    return k.astype(np.float32) * np.float32(2.0 ** exp)


def _dtype(kind):
    return {"f32": np.float32, "f16": np.float16, "bf16": BF16}[kind]


def _inputs(shape, fmt, kind, stat_kind, seed, special=False):
    """x, dy, mean, var, gamma for a call: x in [-4, 4) around a per-channel mean, dy in
    [-1, 1); special: NaN in some x, +-inf in some dy, an infinite mean."""
    b = BITS[kind]
    C = shape[1] if fmt == "NCX" else shape[-1]
    x = _floats(shape, seed, kind, 3 - b)
    dy = _floats(shape, seed + 1, kind, 1 - b)
    sb = BITS[stat_kind]
    mean = _floats((C,), seed + 2, stat_kind, 1 - sb)
    var = _floats((C,), seed + 3, stat_kind, 1 - sb, low=1 << (sb - 2))     # in [0.5, 1.5)
    gamma = _floats((C,), seed + 4, stat_kind, 2 - sb)
    if special:
        h = _hashes(x.size, seed + 5).reshape(shape) >> np.uint64(58)       # 0..63
        x[h == 0] = np.nan
        dy[h == 1] = np.inf
        dy[h == 2] = -np.inf
        dy[h == 3] = -np.nan
        mean[::5] = np.inf
    dt, st = _dtype(kind), _dtype(stat_kind)
    return (x.astype(dt), dy.astype(dt), mean.astype(st), var.astype(st), gamma.astype(st))


def _relu_dst(shape, kind, seed, as_bool):
    """A forward's ReLU output: zeros (both signs), positives, negatives, a NaN now and then;
    or a bool mask."""
    if as_bool:
        return (_ints(shape, seed, 2, low=0) != 0)
    y = _floats(shape, seed, kind, -4)
    h = _ints(shape, seed + 1, 4, low=0)
    y[h == 0] = 0.0
    y[h == 1] = -0.0
    y[h == 2] = np.nan
    return y.astype(_dtype(kind))


def _axes(shape, fmt):
    return 1 if fmt == "NCX" else len(shape) - 1


# ---------------------------------------------------------------------------------------------
# The calls


def _train(shape, fmt, kind, stat_kind="f32", layout="contiguous", special=False, seed=1,
           num_outputs=3, in_place=False):
    def call(threads):
        x, dy, mean, var, gamma = _inputs(shape, fmt, kind, stat_kind, seed, special)
        x, dy = make_layout(x, layout), make_layout(dy, layout)
        if in_place:            # diff_src written over diff_dst
            res = bn.batchnorm_training_backward(
                x, dy, mean, var, gamma, epsilon=EPS, data_format=fmt, num_outputs=num_outputs,
                num_threads=threads, out=(dy,) + tuple(np.empty_like(gamma) for _ in range(num_outputs - 1)))
            return [dy] + list(res[1:num_outputs])
        res = bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS,
                                             data_format=fmt, num_outputs=num_outputs,
                                             num_threads=threads)
        return [r for r in res if r is not None]
    return call


def _relu(shape, fmt, kind, as_bool, residual=True, layout="contiguous", seed=7, num_outputs=3):
    def call(threads):
        x, dy, mean, var, gamma = _inputs(shape, fmt, kind, "f32", seed)
        y = make_layout(_relu_dst(shape, kind, seed + 10, as_bool), layout)
        x, dy = make_layout(x, layout), make_layout(dy, layout)
        dres = np.empty_like(dy) if residual else None
        res = bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS,
                                             data_format=fmt, num_outputs=num_outputs,
                                             num_threads=threads, relu_dst=y,
                                             diff_residual=dres)
        return [r for r in res if r is not None] + ([dres] if residual else [])
    return call


def _two_phase(shape, fmt, kind, exact_sums, stat_kind="f32", relu=None, layout="contiguous",
               seed=13):
    def call(threads):
        x, dy, mean, var, gamma = _inputs(shape, fmt, kind, stat_kind, seed)
        x, dy = make_layout(x, layout), make_layout(dy, layout)
        y = None if relu is None else _relu_dst(shape, kind, seed + 10, relu == "bool")
        partial, count = bn.backward_reduce(x, dy, mean, data_format=fmt, num_threads=threads,
                                            exact_sums=exact_sums, relu_dst=y)
        res = bn.backward_apply(x, dy, mean, var, gamma, partial, count, epsilon=EPS,
                                data_format=fmt, num_threads=threads, relu_dst=y)
        return [partial, np.array([count], np.int64)] + list(res)
    return call


def _forward(shape, fmt, kind, stat_kind="f32", relu=False, layout="contiguous", special=False,
             affine=True, seed=21, far=False):
    """The training forward: dst and the four statistics.  far: some channels' first element
    far from their mean (their sums are taken again around it)."""
    def call(threads):
        x, _, mean, var, gamma = _inputs(shape, fmt, kind, stat_kind, seed, special)
        beta = _floats(gamma.shape, seed + 6, stat_kind, 1 - BITS[stat_kind]).astype(gamma.dtype)
        if far:
            first = (0,) * len(shape)
            for c in range(0, gamma.shape[0], 2):
                index = list(first)
                index[_axes(shape, fmt)] = c
                x[tuple(index)] = 4096
        x = make_layout(x, layout)
        res = bn.batchnorm_training_forward(x, mean, var, gamma if affine else None,
                                            beta if affine else None, epsilon=EPS,
                                            momentum=0.75, data_format=fmt, fuse_relu=relu,
                                            num_threads=threads)
        return list(res)
    return call


def _cases():
    """{name: call(threads) -> list of arrays}, in a fixed order."""
    cases = {}
    kinds = ["f32", "f16", "bf16"]
    shapes = [  # (shape, format, what it reaches)
        ((3, 5, 37), "NCX"),            # rows of 2 runs of 16 and a tail of 5
        ((2, 3, 2100), "NCX"),          # a row cut at the 2048-element tile, then a tail of 52
        ((4, 24, 7, 7), "NCX"),         # rows of 49: runs of short rows
        ((8, 32, 300), "NCX"),          # 76,800 elements: a team of 2 threads
        ((1, 6, 1), "NCX"),             # one element per channel
        ((5, 2, 16), "NCX"),            # a whole run, no tail
        ((37, 19), "NXC"),              # 16 channels and 3
        ((5, 6, 7, 40), "NXC"),         # 16 + 16 + 8 channels
        ((9, 3, 131), "NXC"),           # 8 runs of 16 + 3
        ((300, 256), "NXC"),            # wide rows (1 KiB of f32): 76,800 elements
        ((40, 2100), "NXC"),            # more channels than a slice (2048)
        ((1, 20), "NXC"),               # one element per channel
        ((70, 48), "NXC"),              # rows of 96 bytes of halves: blocks in registers
    ]
    for shape, fmt in shapes:
        for kind in kinds:
            tag = f"{fmt}{shape}-{kind}"
            cases[f"train {tag}"] = _train(shape, fmt, kind)
            cases[f"frozen {tag}"] = _train(shape, fmt, kind, num_outputs=1)
    for shape, fmt in [((6, 21, 45), "NCX"), ((6, 7, 300), "NXC"), ((4, 3, 5, 60), "NCX")]:
        for kind in kinds:
            for layout in ("sliced", "negative", "transposed"):
                tag = f"{fmt}{shape}-{kind}-{layout}"
                cases[f"train {tag}"] = _train(shape, fmt, kind, layout=layout)
                cases[f"frozen {tag}"] = _train(shape, fmt, kind, layout=layout, num_outputs=1)
    for shape, fmt in [((3, 5, 37), "NCX"), ((4, 24, 7, 7), "NCX"), ((37, 19), "NXC"),
                       ((9, 3, 131), "NXC")]:
        for kind in kinds:
            tag = f"{fmt}{shape}-{kind}"
            cases[f"train nan-inf {tag}"] = _train(shape, fmt, kind, special=True)
            cases[f"frozen nan-inf {tag}"] = _train(shape, fmt, kind, special=True, num_outputs=1)
            cases[f"in-place {tag}"] = _train(shape, fmt, kind, in_place=True)
    for shape, fmt in [((3, 5, 37), "NCX"), ((9, 3, 131), "NXC"), ((300, 256), "NXC")]:
        tag = f"{fmt}{shape}-bf16"
        cases[f"train bf16-stats {tag}"] = _train(shape, fmt, "bf16", stat_kind="bf16")
        cases[f"two-phase bf16-stats {tag}"] = _two_phase(shape, fmt, "bf16", False,
                                                          stat_kind="bf16")
    for shape, fmt in [((3, 5, 37), "NCX"), ((2, 3, 2100), "NCX"), ((4, 24, 7, 7), "NCX"),
                       ((9, 3, 131), "NXC"), ((300, 256), "NXC")]:
        for kind in kinds:
            tag = f"{fmt}{shape}-{kind}"
            cases[f"two-phase blocked {tag}"] = _two_phase(shape, fmt, kind, False)
            cases[f"two-phase exact {tag}"] = _two_phase(shape, fmt, kind, True)
    for shape, fmt in [((3, 5, 37), "NCX"), ((4, 24, 7, 7), "NCX"), ((8, 32, 300), "NCX"),
                       ((9, 3, 131), "NXC"), ((300, 256), "NXC")]:
        for kind in kinds:
            tag = f"{fmt}{shape}-{kind}"
            cases[f"relu values {tag}"] = _relu(shape, fmt, kind, as_bool=False)
            cases[f"relu bool {tag}"] = _relu(shape, fmt, kind, as_bool=True)
            cases[f"relu frozen {tag}"] = _relu(shape, fmt, kind, as_bool=False, num_outputs=1)
            cases[f"two-phase relu {tag}"] = _two_phase(shape, fmt, kind, False, relu="values")
    for shape, fmt in shapes:
        for kind in kinds:
            tag = f"{fmt}{shape}-{kind}"
            cases[f"forward {tag}"] = _forward(shape, fmt, kind)
            cases[f"forward relu {tag}"] = _forward(shape, fmt, kind, relu=True)
    for shape, fmt in [((3, 5, 37), "NCX"), ((4, 24, 7, 7), "NCX"), ((9, 3, 131), "NXC"),
                       ((300, 256), "NXC")]:
        for kind in kinds:
            tag = f"{fmt}{shape}-{kind}"
            cases[f"forward nan-inf {tag}"] = _forward(shape, fmt, kind, special=True)
            cases[f"forward far first {tag}"] = _forward(shape, fmt, kind, far=True)
            cases[f"forward no affine {tag}"] = _forward(shape, fmt, kind, affine=False)
            for layout in ("sliced", "negative"):
                cases[f"forward {layout} {tag}"] = _forward(shape, fmt, kind, layout=layout)
        cases[f"forward bf16-stats {fmt}{shape}"] = _forward(shape, fmt, "bf16", stat_kind="bf16")
    for kind in kinds:
        cases[f"relu values sliced NCX(6, 21, 45)-{kind}"] = _relu((6, 21, 45), "NCX", kind, False,
                                                                  layout="sliced")
        cases[f"relu bool negative NXC(6, 7, 300)-{kind}"] = _relu((6, 7, 300), "NXC", kind, True,
                                                                  layout="negative")
    return cases


# ---------------------------------------------------------------------------------------------
# Digests


def _canonical_bytes(a):
    """The bytes of `a` (C order), every NaN as the quiet NaN of positive sign, and its
    dtype and shape: what a digest covers."""
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "b" or a.dtype.kind in "iu":
        return f"{a.dtype.str}{a.shape}".encode() + a.tobytes()
    width = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    bits = a.view(width).copy()
    nan = np.isnan(a.astype(np.float64))
    bits[nan] = {2: 0x7E00 if a.dtype == np.float16 else 0x7FC0, 4: 0x7FC00000,
                 8: 0x7FF8000000000000}[a.dtype.itemsize]
    return f"{a.dtype.str}{a.shape}".encode() + bits.tobytes()


def digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(_canonical_bytes(a))
    return h.hexdigest()


def compute(names=None, threads=1):
    """{case: digest} on the body in use."""
    out = {}
    for name, call in _cases().items():
        if names is not None and name not in names:
            continue
        with np.errstate(all="ignore"):
            out[name] = digest(call(threads))
    return out


def _runnable(name):
    """bf16 cases need ml_dtypes for their arrays."""
    return BF16 is not None or "bf16" not in name


def _recorded():
    with open(DIGESTS) as f:
        return json.load(f)["digests"]


# ---------------------------------------------------------------------------------------------
# Tests


def test_digest_file_covers_every_case():
    recorded = _recorded()
    names = list(_cases())
    assert len(names) == len(set(names))
    missing = [n for n in names if n not in recorded]
    extra = [n for n in recorded if n not in names]
    assert not missing and not extra, (
        f"tests/engine/digests.json is out of date (missing {missing[:5]}, unknown {extra[:5]}); "
        "regenerate it: python tests/engine/test_digests.py --record")
    # most calls give results of their own (some agree by design: an in-place call and its
    # out-of-place twin, f32 layouts that keep the order of the sums); a digest that ignored
    # its input would make them all one
    assert len(set(recorded.values())) > 0.75 * len(recorded)


def test_digest_covers_every_bit_but_nan_payloads():
    a = np.array([1.0, -0.0, np.nan], np.float32)
    b = a.copy()
    b.view(np.uint32)[2] = 0xFFC00001             # another NaN: the same digest
    assert digest([a]) == digest([b])
    b[1] = 0.0                                    # +0 instead of -0: another digest
    assert digest([a]) != digest([b])
    assert digest([a]) != digest([a.astype(np.float64)])
    assert digest([a]) != digest([a[:2]])


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("body", bodies())
def test_results_have_the_recorded_digests(body, threads):
    recorded = _recorded()
    names = [n for n in _cases() if _runnable(n)]
    with kernels(body):
        got = compute(names, threads)
    wrong = [n for n in names if got[n] != recorded[n]]
    assert not wrong, (
        f"{len(wrong)} of {len(names)} calls give other bits than tests/engine/digests.json records "
        f"(body {body}, {threads} thread(s)):\n  " + "\n  ".join(wrong[:40])
        + ("\n  ..." if len(wrong) > 40 else ""))
    if len(names) < len(recorded):
        pytest.skip(f"{len(recorded) - len(names)} bf16 calls not run: ml_dtypes is not "
                    "installed (the others match)")


def record():
    """Write tests/engine/digests.json from the portable body at 1 thread, after checking that every
    body this CPU runs gives the same digests at every thread count."""
    if BF16 is None:
        sys.exit("recording needs ml_dtypes (the bf16 calls)")
    with kernels("portable"):
        want = compute(threads=1)
    for body in bodies():
        for threads in THREADS:
            with kernels(body):
                got = compute(threads=threads)
            wrong = [n for n in want if got[n] != want[n]]
            if wrong:
                sys.exit(f"not recorded: body {body} at {threads} thread(s) differs from the "
                         f"portable body on {len(wrong)} calls, e.g. {wrong[:3]}")
    doc = {
        "about": "SHA-256 digests of tests/engine/test_digests.py's calls (every NaN as one "
                 "pattern); regenerate with: python tests/engine/test_digests.py --record",
        "digests": want,
    }
    with open(DIGESTS, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
    print(f"recorded {len(want)} digests in {DIGESTS} (bodies checked: {', '.join(bodies())})")


if __name__ == "__main__":
    if sys.argv[1:] == ["--record"]:
        record()
    else:
        sys.exit(__doc__.split("Regenerate")[0] + "usage: python tests/engine/test_digests.py --record")
