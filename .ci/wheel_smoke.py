"""Smoke test of an installed bnbw_native wheel, run from outside any checkout.

    python -I .ci/wheel_smoke.py [--vendored-openmp] [--torch]

Imports the installed package (and says where from), prints show_config(), runs one training
backward per layout against the float64 reference, and checks that threadpoolctl sees the
OpenMP runtime the package uses and that its limit reaches the package.  --vendored-openmp:
the wheel must carry its own OpenMP runtime (an auditwheel/delocate/delvewheel-repaired wheel)
and threadpoolctl must list that copy.  --torch (Linux): in both import orders (each in a new
interpreter), the process must hold one libgomp - the wheel's copy goes by its usual name,
.ci/share_openmp.py - and torch.set_num_threads must reach bnbw_native.
Used by .ci/wheel.sh and as cibuildwheel's test command (pyproject.toml).
"""
import argparse
import os
import subprocess
import sys


def check_backward():
    import numpy as np

    import bnbw_native
    from bnbw_native import reference

    rng = np.random.default_rng(11)
    for data_format, shape in (("NCX", (8, 16, 5, 5)), ("NXC", (8, 5, 5, 16))):
        c = shape[1] if data_format == "NCX" else shape[-1]
        x = (rng.standard_normal(shape) * 2 + 3).astype(np.float32)
        dy = rng.standard_normal(shape).astype(np.float32)
        axes = tuple(d for d in range(4) if d != (1 if data_format == "NCX" else 3))
        mean, var = x.mean(axis=axes), x.var(axis=axes)
        gamma = rng.uniform(0.5, 1.5, c).astype(np.float32)
        got = bnbw_native.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                                      data_format=data_format)
        want = reference.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5,
                                                     data_format=data_format)
        for name, g, w in zip(("diff_src", "diff_gamma", "diff_beta"), got, want):
            err = float(np.abs(g.astype(np.float64) - w).max() / np.abs(w).max())
            assert err < 1e-5, (data_format, name, err)
        print(f"backward {data_format} {shape}: agrees with the float64 reference")


def check_threadpoolctl(vendored):
    """threadpoolctl lists an OpenMP runtime (the package's own copy when it vendors one) and
    threadpool_limits(1) caps what a call of the package uses."""
    import bnbw_native
    from threadpoolctl import threadpool_info, threadpool_limits

    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(bnbw_native.__file__)))
    runtimes = [i for i in threadpool_info() if i["user_api"] == "openmp"]
    for info in runtimes:
        print(f"threadpoolctl sees {info['internal_api']} at {info['filepath']} "
              f"({info['num_threads']} threads)")
    assert runtimes, "threadpoolctl sees no OpenMP runtime in the process"
    if vendored:
        ours = [i for i in runtimes
                if os.path.abspath(i["filepath"]).startswith(package_dir + os.sep)
                and "bnbw_native" in os.path.relpath(i["filepath"], package_dir)]
        assert ours, f"no OpenMP runtime inside the installed wheel ({package_dir})"
    before = bnbw_native.get_num_threads()
    with threadpool_limits(1, user_api="openmp"):
        assert bnbw_native.get_num_threads() == 1
        check_backward()                                 # a call under the limit works too
    assert bnbw_native.get_num_threads() == before
    print(f"threadpool_limits(1) caps bnbw_native at 1 thread (outside: {before})")


TORCH_PROBE = """
import sys
if sys.argv[1] == "torch":
    import torch, bnbw_native
else:
    import bnbw_native, torch
torch.set_num_threads(2)
bnbw_native.set_num_threads(None)
a = bnbw_native.get_num_threads()
torch.set_num_threads(1)
b = bnbw_native.get_num_threads()
bnbw_native.set_num_threads(torch.get_num_threads())     # the explicit way always works
c = bnbw_native.get_num_threads()
import numpy as np
x = np.zeros((70000, 2), np.float32)                      # a call that starts a team
bnbw_native.batchnorm_training_forward(x, np.zeros(2, np.float32), np.ones(2, np.float32),
                                       epsilon=1e-5, num_threads=2)
torch.add(torch.ones(4), 1)
runtimes = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
print(a, b, c, len(runtimes))
"""


def measure_torch():
    """{import order: (threads before, after torch.set_num_threads(1), after passing torch's
    count explicitly, libgomp copies in the process)}, each order in a new interpreter (the
    dynamic linker binds the OpenMP symbols once, at the first import)."""
    results = {}
    for first in ("torch", "bnbw_native"):
        done = subprocess.run([sys.executable, "-I", "-c", TORCH_PROBE, first],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        results[first] = tuple(map(int, done.stdout.split()))
        a, b, c, runtimes = results[first]
        follows = "follows" if b == 1 else "does NOT follow"
        print(f"{first} imported first: {runtimes} libgomp in the process; bnbw_native "
              f"{follows} torch.set_num_threads(1) (get_num_threads {a} -> {b}); "
              f"set_num_threads(torch.get_num_threads()) -> {c}")
        assert c == 1
        # one runtime (.ci/share_openmp.py): torch's and our teams never fight for the cores
        assert runtimes == 1 and b == 1, f"{first} first: two OpenMP runtimes"
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vendored-openmp", action="store_true")
    parser.add_argument("--torch", action="store_true")
    args = parser.parse_args()

    import bnbw_native
    where = os.path.abspath(bnbw_native.__file__)
    print(f"bnbw_native {bnbw_native.__version__} from {where}")
    assert os.path.basename(os.path.dirname(os.path.dirname(where))) in (
        "site-packages", "dist-packages"), "not an installed bnbw_native"
    bnbw_native.show_config()
    assert bnbw_native.show_config(mode="dicts")["openmp"]["enabled"], "built without OpenMP"
    check_backward()
    check_threadpoolctl(args.vendored_openmp)
    if args.torch:
        measure_torch()
    print("wheel smoke: ok")


if __name__ == "__main__":
    main()
