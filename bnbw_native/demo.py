"""The README's first command: run the fast kernels next to the float64 NumPy reference on
ResNet-50-sized batch norms, check the results and print timings (``bnbw-demo``)."""
import argparse
import time

import numpy as np

from . import batchnorm_training_backward, get_num_threads, show_config
from .reference import batchnorm_training_backward as reference

DEMO_SHAPES = {"resnet50-conv2 (N, C, H, W)": (32, 64, 56, 56),
               "resnet50-conv4 (N, C, H, W)": (32, 256, 14, 14),
               "dense (N, C)": (256, 2048)}


def make_case(shape, data_format, rng):
    """NCX shapes laid out for `data_format`; statistics from the data, as a forward saves."""
    if data_format == "NXC":
        shape = (shape[0],) + shape[2:] + (shape[1],)
    axis = 1 if data_format == "NCX" else len(shape) - 1
    x = (rng.standard_normal(shape, dtype=np.float32) * 2 + 3).astype(np.float32)
    dy = rng.standard_normal(shape, dtype=np.float32)
    reduce_axes = tuple(d for d in range(len(shape)) if d != axis)
    mean = x.mean(axis=reduce_axes, dtype=np.float64).astype(np.float32)
    var = x.var(axis=reduce_axes, dtype=np.float64).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, shape[axis]).astype(np.float32)
    return x, dy, mean, var, gamma


def best_time(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def max_relative_error(got, ref):
    scale = np.abs(ref).max() or 1.0
    return float(np.abs(got.astype(np.float64) - ref).max() / scale)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    show_config()
    rng = np.random.default_rng(2024)
    threads = sorted({1, get_num_threads()})
    header = (f"{'case':30} {'layout':6} {'reference ms':>12} " +
              " ".join(f"{f'{t} thr ms':>9} {'speed-up':>8}" for t in threads) +
              f" {'max rel err':>11}")
    print("\n" + header + "\n" + "-" * len(header))
    worst = 0.0
    for name, shape in DEMO_SHAPES.items():
        for data_format in ("NCX", "NXC"):
            x, dy, mean, var, gamma = make_case(shape, data_format, rng)
            call = dict(epsilon=1e-5, data_format=data_format)
            ref = reference(x, dy, mean, var, gamma, **call)
            t_ref = best_time(lambda: reference(x, dy, mean, var, gamma, **call), 2)
            out = tuple(np.empty_like(a) for a in (x, gamma, gamma))
            cells = []
            for t in threads:
                run = lambda: batchnorm_training_backward(  # noqa: E731
                    x, dy, mean, var, gamma, out=out, num_threads=t, **call)
                run()
                t_ours = best_time(run, args.repeat)
                cells.append(f"{t_ours * 1e3:9.2f} {t_ref / t_ours:7.1f}x")
            err = max(max_relative_error(o, r) for o, r in zip(out, ref))
            worst = max(worst, err)
            print(f"{name:30} {data_format:6} {t_ref * 1e3:12.1f} {' '.join(cells)} {err:11.1e}")
    ok = worst < 1e-5
    print(f"\nresults {'agree' if ok else 'DISAGREE'} with the float64 reference "
          f"(worst max-relative error {worst:.1e})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
