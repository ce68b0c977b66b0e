"""Throughput of bnbw_native.half against a plain memory copy and against NumPy / ml_dtypes,
and the time of a half-precision training backward as a fraction of the float32 one.

Why this yardstick: the conversions do a few integer ops per element and are meant to be
memory bound, so the honest target is the bandwidth of np.copyto over the same source bytes
(read + write counted for every row).  Destinations are allocated once so page faults are
timed for nobody but the library astype calls, which allocate by design.

The second table times batchnorm_training_backward (out= given, all three outputs) on one
shape in float32, float16 and bfloat16, interleaved round by round so that a shared, noisy
machine slows all three alike; the figure is each median over the float32 median.  Storage in
16 bits halves the bytes, so a memory-bound backward would take ~0.5 of the float32 time.

    python bench/bench_half.py [--mib 64] [--repeat 7] [--shape 32,64,56,56]
                                            [--rounds 15]      (or after pip install .)
"""
import argparse
import time

import numpy as np

from bnbw_native import (batchnorm_training_backward, get_num_threads, half, show_config,
                         tuning)

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None


def best_seconds(call, repeat):
    call()  # warm-up: first touch of the destination, thread pool start
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return best


def half_training_ratios(shape, rounds):
    """Median seconds per call of f32, f16, bf16 training backward on `shape` (NCX logical
    order), per layout and thread count, timed interleaved."""
    rng = np.random.default_rng(1)
    channels = shape[1]
    dtypes = [("f32", np.float32), ("f16", np.float16)]
    if ml_dtypes is not None:
        dtypes.append(("bf16", ml_dtypes.bfloat16))
    stats = [np.zeros(channels, np.float32), np.ones(channels, np.float32),
             rng.standard_normal(channels).astype(np.float32)]
    calls = {}
    for layout in ("NCX", "NXC"):
        logical = shape if layout == "NCX" else (shape[0], *shape[2:], channels)
        x32 = rng.standard_normal(logical, dtype=np.float32)
        dy32 = rng.standard_normal(logical, dtype=np.float32)
        for key, dtype in dtypes:
            x, dy = x32.astype(dtype), dy32.astype(dtype)
            out = (np.empty_like(x), np.empty(channels, np.float32),
                   np.empty(channels, np.float32))
            for threads in (1, 2):
                calls[layout, threads, key] = (
                    lambda x=x, dy=dy, out=out, layout=layout, threads=threads:
                    batchnorm_training_backward(x, dy, *stats, epsilon=1e-5, data_format=layout,
                                                out=out, num_threads=threads))
    samples = {k: [] for k in calls}
    for call in calls.values():
        call()
    for _ in range(rounds):
        for key, call in calls.items():
            t = time.perf_counter()
            call()
            samples[key].append(time.perf_counter() - t)
    return {k: float(np.median(v)) for k, v in samples.items()}, [k for k, _ in dtypes]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="source size in MiB (default 64)")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs, best kept (default 7)")
    parser.add_argument("--shape", default="32,64,56,56",
                        help="training backward shape, N,C,spatial... (default 32,64,56,56)")
    parser.add_argument("--rounds", type=int, default=15,
                        help="interleaved rounds of the training table (default 15)")
    args = parser.parse_args()

    nbytes = args.mib << 20
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal(nbytes // 4, dtype=np.float32)
    h16 = f32[: nbytes // 2 // 2].astype(np.float16)
    h16 = np.concatenate([h16, h16])  # nbytes of float16
    b16 = (f32.view(np.uint32) >> 16).astype(np.uint16)
    b16 = np.concatenate([b16, b16])
    if ml_dtypes is not None:
        b16 = b16.view(ml_dtypes.bfloat16)
    out16 = np.empty(f32.size, np.float16)
    outb = np.empty(f32.size, b16.dtype)
    out32 = np.empty(h16.size, np.float32)

    copy_dst = np.empty_like(f32)
    copy_s = best_seconds(lambda: np.copyto(copy_dst, f32), args.repeat)
    copy_gbs = 2 * nbytes / copy_s / 1e9

    simd = show_config(mode="dicts")["half_conversion"]
    print(f"simd path: {simd}; threads: {get_num_threads()}; "
          f"source {args.mib} MiB; best of {args.repeat}")
    print(f"{'case':44s} {'ms':>8s} {'GB/s':>7s} {'% copy':>7s}")
    print(f"{'np.copyto (same source bytes)':44s} {copy_s * 1e3:8.2f} {copy_gbs:7.2f} {100:7.0f}")

    cases = [
        ("float32_to_float16", f32, out16, half.float32_to_float16,
         ("numpy astype(float16)", lambda: f32.astype(np.float16))),
        ("float16_to_float32", h16, out32, half.float16_to_float32,
         ("numpy astype(float32)", lambda: h16.astype(np.float32))),
        ("float32_to_bfloat16", f32, outb, half.float32_to_bfloat16,
         ("ml_dtypes astype(bfloat16)", lambda: f32.astype(ml_dtypes.bfloat16)) if ml_dtypes else None),
        ("bfloat16_to_float32", b16, out32, half.bfloat16_to_float32,
         ("ml_dtypes astype(float32)", lambda: b16.astype(np.float32)) if ml_dtypes else None),
    ]
    with np.errstate(all="ignore"):
        for name, src, out, func, library in cases:
            moved = src.nbytes + out.nbytes
            rows = [(f"{name}, {t} thread{'s' * (t > 1)}",
                     lambda func=func, src=src, out=out, t=t: func(src, out=out, num_threads=t))
                    for t in (1, 2)]
            if library is not None:
                rows.append(library)
            for label, call in rows:
                s = best_seconds(call, args.repeat)
                gbs = moved / s / 1e9
                print(f"{label:44s} {s * 1e3:8.2f} {gbs:7.2f} {100 * gbs / copy_gbs:7.0f}")
            previous = tuning.use_kernels("portable")
            try:
                s = best_seconds(lambda: func(src, out=out, num_threads=1), args.repeat)
            finally:
                tuning.use_kernels(previous)
            gbs = moved / s / 1e9
            print(f"{name + ', portable code, 1 thread':44s} {s * 1e3:8.2f} {gbs:7.2f} "
                  f"{100 * gbs / copy_gbs:7.0f}")

    shape = tuple(int(v) for v in args.shape.split(","))
    times, keys = half_training_ratios(shape, args.rounds)
    print(f"\ntraining backward on {shape}, median of {args.rounds} interleaved rounds: "
          "ms (fraction of the f32 time)")
    print(f"{'layout':7s} {'threads':>7s} " + " ".join(f"{k:>14s}" for k in keys))
    for layout in ("NCX", "NXC"):
        for threads in (1, 2):
            f32 = times[layout, threads, "f32"]
            cells = [f"{times[layout, threads, k] * 1e3:7.2f} ({times[layout, threads, k] / f32:.2f})"
                     for k in keys]
            print(f"{layout:7s} {threads:7d} " + " ".join(f"{c:>14s}" for c in cells))


if __name__ == "__main__":
    main()
