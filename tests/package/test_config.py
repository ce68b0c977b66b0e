"""show_config() and the kernel body: which body runs, and how BNBW_KERNELS caps it.

The cap is read when the package is imported, so each case starts a fresh interpreter.
"""
import importlib.metadata
import os
import subprocess
import sys
import tempfile

import pytest

import bnbw_native
from bnbw_native import _config
from conftest import bodies

BODIES = ("portable", "AVX2", "AVX-512", "NEON")
NAMES = {"portable": "portable", "avx2": "AVX2", "avx512": "AVX-512", "neon": "NEON"}


def _fresh(code, kernels=None):
    """stdout and stderr of `code` run by a new interpreter with BNBW_KERNELS=kernels."""
    env = dict(os.environ)
    env.pop("BNBW_KERNELS", None)
    # the package this test process imported (installed, or built in place), from anywhere
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(bnbw_native.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
    if kernels is not None:
        env["BNBW_KERNELS"] = kernels
    # cwd outside the checkout: there `import bnbw_native` would find the source tree, which
    # holds no built extension after `pip install .`
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=True, cwd=tempfile.gettempdir())
    return done.stdout, done.stderr


def _kernels_line(printed):
    lines = [line for line in printed.splitlines() if line.startswith("kernels:")]
    assert len(lines) == 1, printed
    return lines[0]


def test_show_config_names_the_body_in_use(capsys):
    bnbw_native.show_config()
    line = _kernels_line(capsys.readouterr().out)
    body = _config.kernel_body()
    assert body in BODIES
    assert line.split()[1] == body


SHOW = "import bnbw_native; bnbw_native.show_config()"


def test_no_cap_runs_the_best_body_the_cpu_has():
    out, _ = _fresh(SHOW)
    best = _config._engine.build_info()["cpu_kernels"]
    assert _kernels_line(out).split()[1] == best


def test_portable_cap_runs_the_portable_body():
    out, _ = _fresh(SHOW, "portable")
    assert _kernels_line(out).split()[1] == "portable"
    out, _ = _fresh("from bnbw_native import _half; print(_half.simd_path())", "portable")
    assert out.strip() == "portable"


@pytest.mark.parametrize("cap", ["avx2", "avx512", "AVX2", "neon"])
def test_a_cap_above_the_cpu_falls_back_to_the_best_it_runs(cap):
    """A cap names a level (1: AVX2 or NEON, 2: AVX-512): the CPU's own body at that level, or
    the best below it; another architecture's name stands for its level."""
    runs = [NAMES[body] for body in bodies()]         # this CPU's bodies, level by level
    wanted = {"avx2": 1, "avx512": 2, "neon": 1}[cap.lower()]
    out, err = _fresh(SHOW, cap)
    assert _kernels_line(out).split()[1] == runs[min(len(runs) - 1, wanted)]
    assert "BNBW_KERNELS" not in err


def test_an_unknown_value_is_ignored_with_a_warning():
    out, err = _fresh(SHOW, "sse9")
    assert "BNBW_KERNELS" in err and "sse9" in err
    best = _config._engine.build_info()["cpu_kernels"]
    assert _kernels_line(out).split()[1] == best


def test_use_kernels_restores_and_refuses():
    before = _config.kernel_body()
    previous = _config.use_kernels("portable")
    try:
        assert _config.kernel_body() == "portable"
    finally:
        _config.use_kernels(previous)
    assert _config.kernel_body() == before
    with pytest.raises(ValueError, match="kernels"):
        _config.use_kernels("sse9")


def test_show_config_prints_version_and_openmp(capsys):
    version = getattr(bnbw_native, "__version__", None) or importlib.metadata.version(
        "bnbw_native")
    bnbw_native.show_config()
    printed = capsys.readouterr().out
    assert version in printed
    assert "OpenMP" in printed
