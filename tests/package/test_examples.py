"""Every example runs as its docstring says (`python examples/<name>`), in a fresh interpreter
started outside the checkout, and checks its own results."""
import pytest

from cext import ROOT, c_compiler, run_python

EXAMPLES = ROOT / "examples"


def run_example(relative, tmp_path, args=(), timeout=300):
    done = run_python([str(EXAMPLES / relative), *args], cwd=tmp_path, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_every_example_is_run_here():
    """A new example gets a test here (the distributed one, which starts gloo ranks, lives with
    the distributed tests)."""
    found = {p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*")
             if p.suffix in (".py", ".c") and "build" not in p.parts}
    assert found == {"numpy_arrays.py", "dml_raw_buffers.py", "distributed_gloo.py",
                     "train_resnet_fused.py", "bench_torch_layers.py",
                     "c_extension/bnbw_c_example.c", "c_extension/setup.py",
                     "c_extension/run.py", "c_program/bnbw_c_program.c", "c_program/run.py"}


def test_numpy_arrays(tmp_path):
    out = run_example("numpy_arrays.py", tmp_path)
    for line in ("training, NXC", "frozen statistics (num_outputs=1)", "nGraph",
                 "two phases over 2 ranks", "float16 storage"):
        assert line in out
    assert ".astype(np.float32)" in out and "did you mean data_format='NCX'?" in out


def test_dml_raw_buffers(tmp_path):
    out = run_example("dml_raw_buffers.py", tmp_path)
    assert "training grad, NHWC memory: max error" in out
    assert "training grad, bfloat16 bits: max error" in out
    assert "refused: mean: sizes[1]" in out


def test_c_extension(tmp_path):
    """examples/c_extension/run.py builds the C module with its setup.py and calls it before
    anything imports bnbw_native."""
    if c_compiler() is None:
        pytest.skip("no C compiler found (set CC, or install cc/gcc/clang)")
    out = run_example("c_extension/run.py", tmp_path, args=[str(tmp_path / "build")])
    assert "called from C" in out
    assert "epsilon 0 refused: ERROR_EPSILON: epsilon" in out


def test_c_program(tmp_path):
    """examples/c_program/run.py compiles a plain C program that embeds this interpreter (the
    way python3-config --embed links it), and the program reaches the C API of the
    environment it is handed, whatever PATH holds: the embedded Python finds bnbw_native."""
    if c_compiler() is None:
        pytest.skip("no C compiler found (set CC, or install cc/gcc/clang)")
    import os
    # the program is handed this interpreter; PATH leads nowhere near its environment
    env = dict(os.environ, PATH=os.pathsep.join(["/usr/bin", "/bin"]))
    done = run_python([str(EXAMPLES / "c_program" / "run.py"), str(tmp_path / "build")],
                      cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "called from a C program: dx max error" in out
    assert "epsilon 0 refused: ERROR_EPSILON: epsilon" in out


def test_distributed_gloo_example_is_tested_elsewhere():
    """The torch example needs torch and spawns ranks: tests/surfaces/test_distributed.py runs
    it."""
    text = (ROOT / "tests" / "surfaces" / "test_distributed.py").read_text()
    assert "distributed_gloo.py" in text


# ---- the torch examples ------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [[], pytest.param(["--channels-last"], marks=pytest.mark.slow)],
                         ids=["NCHW", "channels_last"])
def test_train_resnet_fused(tmp_path, layout):
    """A small ResNet-like network with fused BatchNormReLU layers trains alike to plain torch."""
    pytest.importorskip("torch")
    out = run_example("train_resnet_fused.py", tmp_path, args=["--short", *layout])
    assert "4 BatchNormReLU + 3 BatchNormAddReLU + 2 BatchNorm" in out and "gradients match plain torch" in out
    losses = [line.split() for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 3
    for words in losses:                 # the two copies train alike
        assert abs(float(words[4]) - float(words[6])) <= 1e-4 * abs(float(words[4]))
    assert "time per training step" in out


def test_bench_torch_layers(tmp_path):
    """The layer benchmark times every layer against torch's own."""
    pytest.importorskip("torch")
    out = run_example("bench_torch_layers.py", tmp_path, args=["--quick", "--threads", "1"])
    rows = [line.split() for line in out.splitlines() if line.startswith("  Batch")]
    assert [r[0] for r in rows] == ["BatchNorm", "BatchNormReLU", "BatchNormReLU/inplace",
                                    "BatchNormAddReLU"] * 2
    assert all(float(r[2]) > 0 and float(r[6]) > 0 for r in rows)

