"""Type checkers see an annotated package: py.typed, stubs beside the compiled modules and the
thin front-ends, and `mypy --strict` on a user's script finds nothing to complain about (it
used to stop at import-untyped).  The stubs are checked against the runtime."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import bnbw_native
from cext import PACKAGE_PARENT, ROOT

PACKAGE = Path(bnbw_native.__file__).resolve().parent
TYPED_EXAMPLES = [ROOT / "examples" / "numpy_arrays.py", ROOT / "examples" / "dml_raw_buffers.py"]
STUBBED = ["_onednn_graph", "_two_phase", "intel_spec", "onednn", "ngraph", "dml", "half",
           "reference", "_dlpack", "_arrays", "_rules", "_overlap", "_engine", "_directml",
           "_capi", "_half", "_relayout", "_plan", "_schedules", "_execute"]


@pytest.fixture(scope="module")
def user_python(tmp_path_factory):
    """An interpreter for which bnbw_native is an installed package, as a user's is: a new
    environment whose site-packages reaches the package under test and this environment's
    packages (NumPy's annotations) through a .pth file.  mypy then applies PEP 561: without
    py.typed it refuses to read the package (import-untyped)."""
    pytest.importorskip("mypy", reason="mypy comes with the [test] extra")
    venv = tmp_path_factory.mktemp("user") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    import numpy
    paths = [str(PACKAGE_PARENT), str(Path(numpy.__file__).resolve().parents[1])]
    Path(purelib, "bnbw_under_test.pth").write_text("\n".join(paths) + "\n")
    return python


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory):
    """One cache for every mypy run here: NumPy's stubs are analysed once."""
    return tmp_path_factory.mktemp("mypy_cache")


def mypy(user_python, files, cwd, cache):
    env = dict(os.environ)
    env.pop("MYPYPATH", None)
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-color-output",
                           "--python-executable", str(user_python),
                           "--cache-dir", str(cache), *map(str, files)],
                          cwd=str(cwd), capture_output=True, text=True, env=env, timeout=600)


def test_package_is_marked_typed():
    assert (PACKAGE / "py.typed").is_file()
    for name in STUBBED:
        assert (PACKAGE / f"{name}.pyi").is_file(), name


def test_mypy_strict_passes_on_the_typed_examples(user_python, mypy_cache, tmp_path):
    done = mypy(user_python, TYPED_EXAMPLES, tmp_path, mypy_cache)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found in 2 source files" in done.stdout


def test_mypy_strict_catches_a_wrong_call(user_python, mypy_cache, tmp_path):
    """The annotations say something: wrong calls are reported, results are typed."""
    script = tmp_path / "wrong.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import bnbw_native as bn
        from bnbw_native import dml

        x = np.zeros((4, 3), np.float32)
        s = np.ones(3, np.float32)
        bn.batchnorm_training_backward(x, x, s, s, epsilon="1e-5")
        bn.batchnorm_training_backward(x, x, s, s, epsilon=1e-5, data_format="NHWC")
        dml.TensorDesc("float32", (4, 3)).sizes.append(1)
        res = bn.batchnorm_training_backward(x, x, s, s, epsilon=1e-5)
        reveal_type(res.diff_gamma)
        reveal_type(bn.show_config(mode="dicts"))
        reveal_type(bn.backward_reduce(x, x, s))
    """))
    out = mypy(user_python, [script], tmp_path, mypy_cache).stdout
    assert 'Argument "epsilon" to "batchnorm_training_backward" has incompatible type "str"' in out
    assert 'Argument "data_format" to "batchnorm_training_backward" has incompatible type' in out
    assert '"tuple[int, ...]" has no attribute "append"' in out
    assert re.search(r'Revealed type is "numpy\.ndarray\[.*\] \| None"', out), out
    # (older mypy versions print builtins.dict, builtins.int)
    assert re.search(r'Revealed type is "(builtins\.)?dict\[(builtins\.)?str, Any\]"', out), out
    assert re.search(r'Revealed type is "(builtins\.)?tuple\[numpy\.ndarray\[.*float64.*\], '
                     r'(builtins\.)?int\]"', out), out
    assert "import-untyped" not in out


ALLOWLIST = """
# Cython's own module and class attributes
bnbw_native\\._\\w+\\.__pyx_capi__
bnbw_native\\._\\w+\\.__test__
bnbw_native\\._\\w+\\.__reduce_cython__
bnbw_native\\._\\w+\\.__setstate_cython__
# extension types: no introspectable __init__ (the arguments go to __cinit__), disjoint bases
bnbw_native\\._directml\\.Operator\\.__init__
bnbw_native\\._directml\\.Operator
bnbw_native\\._rules\\.Convention
"""


def test_stubs_match_the_runtime(mypy_cache, tmp_path):
    """mypy's stubtest: every name, signature and default in the stubs is the runtime's."""
    pytest.importorskip("mypy", reason="mypy comes with the [test] extra")
    allow = tmp_path / "allowlist.txt"
    allow.write_text(ALLOWLIST)
    config = tmp_path / "mypy.ini"
    config.write_text(f"[mypy]\ncache_dir = {mypy_cache}\n")
    env = dict(os.environ)
    env.pop("MYPYPATH", None)
    # the package under test on the path of both the runtime import and mypy; started outside
    # it (from site-packages, mypy would take every module there for the user's own)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_PARENT),
                                                      env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "mypy.stubtest", "--mypy-config-file",
                           str(config), "--allowlist", str(allow), "--ignore-unused-allowlist",
                           *(f"bnbw_native.{m}" for m in STUBBED)],
                          cwd=str(tmp_path), capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]



def test_mypy_strict_passes_on_a_script_using_the_torch_layers(user_python, mypy_cache,
                                                               tmp_path):
    """The layers are annotated: strict mypy on a user's script reported "Call to untyped
    function" for BatchNorm and convert_batchnorm, and a wrong argument is caught."""
    pytest.importorskip("torch")
    script = tmp_path / "layers.py"
    script.write_text(textwrap.dedent("""
        import torch
        from bnbw_native.autograd import (BatchNorm, BatchNormReLU, SyncBatchNorm, batch_norm,
                                          convert_batchnorm)

        layer = BatchNorm(8, momentum=None, num_threads=1)
        y: torch.Tensor = layer(torch.randn(4, 8, 3, 3))
        net = convert_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(8), torch.nn.ReLU()),
                                fuse_relu=True)
        z: torch.Tensor = batch_norm(torch.randn(4, 8), relu=True)
        fused = BatchNormReLU(8)
        sync = SyncBatchNorm(8, process_group=None)
    """))
    done = mypy(user_python, [script], tmp_path, mypy_cache)
    assert done.returncode == 0, done.stdout + done.stderr
    wrong = tmp_path / "wrong_layers.py"
    wrong.write_text("from bnbw_native.autograd import BatchNorm\nBatchNorm('8', eps='x')\n")
    out = mypy(user_python, [wrong], tmp_path, mypy_cache).stdout
    assert 'Argument 1 to "BatchNorm" has incompatible type "str"' in out, out
