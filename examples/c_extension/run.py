"""Build the C extension of this directory and use it: bnbw_native's C API from C.

    python examples/c_extension/run.py [BUILD_DIR]

Builds bnbw_c_example with setup.py (into BUILD_DIR, by default build/ next to this file), then
calls it
on NumPy arrays and checks the results against the float64 reference.  The extension is
imported and called before anything imports bnbw_native: its bnbw_import() loads the library
itself, as NumPy's import_array() does.
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def build(where):
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", where,
                    "--build-temp", os.path.join(where, "tmp")], cwd=HERE, check=True)


def main():
    where = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "build"))
    build(where)
    sys.path.insert(0, where)
    import numpy as np

    import bnbw_c_example

    assert "bnbw_native" not in sys.modules
    rng = np.random.default_rng(0)
    n, c, h, w = 8, 16, 10, 10
    x = (rng.standard_normal((n, c, h, w)) * 2 + 3).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    mean = x.mean(axis=(0, 2, 3)).astype(np.float32)
    var = x.var(axis=(0, 2, 3)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, c).astype(np.float32)
    dx, dscale, dbias = np.empty_like(x), np.empty(c, np.float32), np.empty(c, np.float32)

    bnbw_c_example.training_grad(x, dy, mean, var, scale, dx, dscale, dbias, 1e-5)
    print(f"bnbw_native {bnbw_c_example.library_version()}, called from C")

    from bnbw_native import reference
    want = reference.batchnorm_training_backward(x, dy, mean, var, scale, epsilon=1e-5,
                                                 data_format="NCX")
    for name, got, ref in zip(("dx", "dscale", "dbias"), (dx, dscale, dbias), want):
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        print(f"{name:7s} max error {err:.1e} (relative to the largest value)")
        assert err < 1e-5, name

    try:                      # a refusal comes back as a Python exception with the C message
        bnbw_c_example.training_grad(x, dy, mean, var, scale, dx, dscale, dbias, 0.0)
    except ValueError as exc:
        print(f"epsilon 0 refused: {exc}")
    else:
        raise AssertionError("epsilon 0 was accepted")


if __name__ == "__main__":
    main()
