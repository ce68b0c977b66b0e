"""The README works as written: every code block, in order.

Python blocks run one after another in one namespace, as a reader pastes them; a block that
needs torch or MPI skips with that reason when the extra is absent, and the two distributed
blocks run in a process group of one.  The C block is compiled into an extension module and
called from a fresh interpreter.  Shell blocks and inline commands are checked against the
project: every `pip install` target is the checkout with extras it defines, every script a
command runs exists.
"""
import importlib.util
import re
import shlex
import textwrap

import numpy as np
import pytest

import bnbw_native
from cext import ROOT, build_extension, c_compiler, run_python

README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
BLOCKS = [(m.group(1), m.group(2), README.count("\n", 0, m.start()) + 1)
          for m in FENCE.finditer(README)]


def _ids(kind):
    return [f"L{line}" for lang, _, line in BLOCKS if lang == kind]


def _blocks(kind):
    return [(code, line) for lang, code, line in BLOCKS if lang == kind]


def test_the_readme_has_the_blocks_this_file_runs():
    langs = {lang for lang, _, _ in BLOCKS}
    assert langs <= {"python", "c", "bash", ""}, langs      # "": output excerpts and layout
    assert len(_blocks("python")) >= 8 and len(_blocks("c")) == 1 and _blocks("bash")
    for lang, code, line in BLOCKS:
        if lang == "":
            assert not re.search(r"^(import|from) \w", code, re.M), f"untagged code at L{line}"


# ---- Python, in order ----------------------------------------------------------------------

def _needs(code):
    """The optional extra a block needs: "mpi", "torch" or None."""
    code = re.sub(r"#.*", "", code)                 # what it runs, not what it mentions
    if re.search(r"mpi4py|_mpi\b|\bMPI\b", code):
        return "mpi"
    if re.search(r"\btorch\b|bnbw_native\.(autograd|distributed)", code):
        return "torch"
    return None


@pytest.fixture(scope="module")
def namespace():
    """What a reader's session holds after the blocks run so far."""
    return {"__name__": "__readme__"}


def _process_group_of_one(code, ns, tmp_path, prelude):
    """Run a distributed block in a fresh interpreter as the only rank of its group, with the
    arrays of `ns`, and check its result against the single-process call."""
    used = set(re.findall(r"\w+", code)) | {"x", "dy", "mean", "var", "gamma"}
    arrays = {k: v for k, v in ns.items() if isinstance(v, np.ndarray) and k in used}
    np.savez(tmp_path / "ns.npz", **arrays)
    script = "\n".join([
        "import numpy as np",
        "import bnbw_native as bn",
        f"globals().update(np.load({str(tmp_path / 'ns.npz')!r}))",
        prelude,
        code,
        "want = bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-5)",
        "for got, ref in zip(res, want):",
        "    assert np.array_equal(got, ref)",
        "print('same as one process')",
    ])
    done = run_python(["-c", script], cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "same as one process" in done.stdout


TORCH_GROUP = textwrap.dedent("""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
""")


@pytest.mark.parametrize("code, line", _blocks("python"), ids=_ids("python"))
def test_python_block(code, line, namespace, tmp_path):
    needs = _needs(code)
    if needs == "torch" and importlib.util.find_spec("torch") is None:
        pytest.skip(f"README L{line} needs torch (the [torch] extra), which is not installed")
    if needs == "mpi" and importlib.util.find_spec("mpi4py") is None:
        pytest.skip(f"README L{line} needs mpi4py (the [mpi] extra), which is not installed")
    if "init_process_group" in code:       # "on every rank, after init_process_group(...)"
        store = tmp_path / "store"
        _process_group_of_one(code, namespace, tmp_path, TORCH_GROUP.format(store=store))
    elif needs == "mpi":                   # "mpirun -n 4 python train.py": here one rank
        _process_group_of_one(code, namespace, tmp_path, "from mpi4py import MPI")
    else:
        exec(compile(code, f"README.md:{line}", "exec"), namespace)
    namespace.setdefault("__snapshots__", []).append(dict(namespace))


def test_python_blocks_leave_what_they_say(namespace):
    """After the blocks: the in-place call left dy as it was (the blocks after it use it), and
    each convention agrees."""
    onednn = next((snap for snap in namespace.get("__snapshots__", []) if "res" in snap), None)
    assert onednn is not None, "the oneDNN Graph block did not run"
    again = bnbw_native.batchnorm_training_backward(
        onednn["x"], onednn["dy"], onednn["mean"], onednn["var"], onednn["gamma"], epsilon=1e-5)
    assert np.array_equal(again.diff_src, onednn["res"].diff_src), "the block overwrote dy"
    # the session as it was after the Intel spec / nGraph block (later blocks rebind x, dy)
    ns = next((snap for snap in namespace.get("__snapshots__", []) if "input_delta" in snap),
              None)
    assert ns is not None, "the blocks above did not run"
    want = bnbw_native.batchnorm_training_backward(ns["x"], ns["dy"], ns["mean"], ns["var"],
                                                   ns["gamma"], epsilon=1e-5)
    assert np.array_equal(ns["g"], want.diff_src)            # g held a copy of dy
    assert np.array_equal(ns["input_delta"].transpose(0, 2, 3, 1), want.diff_src)
    halves = next(snap for snap in namespace["__snapshots__"] if "h" in snap)
    assert np.array_equal(halves["h"], halves["a"].astype(np.float16))


# ---- C ---------------------------------------------------------------------------------------

# What the README's `run` needs around it to be called from Python: buffers in, buffers out.
C_HARNESS = textwrap.dedent("""
    static PyObject *call(PyObject *self, PyObject *args)
    {
        Py_buffer in[5], out[3];
        PyObject *result = NULL;
        if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*w*w*", &in[0], &in[1], &in[2], &in[3],
                              &in[4], &out[0], &out[1], &out[2]))
            return NULL;
        if (run(in[0].buf, in[1].buf, in[2].buf, in[3].buf, in[4].buf, out[0].buf, out[1].buf,
                out[2].buf) == 0) {
            result = Py_None;
            Py_INCREF(result);
        } else if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "run() failed");
        }
        for (int i = 0; i < 5; ++i) PyBuffer_Release(&in[i]);
        for (int i = 0; i < 3; ++i) PyBuffer_Release(&out[i]);
        return result;
    }

    static PyMethodDef methods[] = {{"run", call, METH_VARARGS, NULL}, {NULL}};
    static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "bnbw_readme_c", NULL, -1,
                                        methods};
    PyMODINIT_FUNC PyInit_bnbw_readme_c(void) { return PyModule_Create(&module); }
""")

# In a fresh interpreter: nothing has imported bnbw_native when the C code calls bnbw_import().
C_CHECK = textwrap.dedent("""
    import sys
    import numpy as np
    import bnbw_readme_c

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 4, 5, 3)) + 2).astype(np.float32)      # NHWC memory
    dy = rng.standard_normal(x.shape).astype(np.float32)
    mean, var = x.mean(axis=(0, 1, 2)), x.var(axis=(0, 1, 2))
    scale = np.array([0.5, 1.0, 2.0], np.float32)
    dx, dscale, dbias = np.empty_like(x), np.empty(3, np.float32), np.empty(3, np.float32)
    assert "bnbw_native" not in sys.modules
    bnbw_readme_c.run(x, dy, mean, var, scale, dx, dscale, dbias)

    from bnbw_native import reference
    want = reference.batchnorm_training_backward(x, dy, mean, var, scale, epsilon=1e-5)
    for got, ref in zip((dx, dscale, dbias), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    print("ok")
""")


def test_c_block(tmp_path):
    if c_compiler() is None:
        pytest.skip("no C compiler found (set CC, or install cc/gcc/clang)")
    (code, line), = _blocks("c")
    source = tmp_path / "bnbw_readme_c.c"
    source.write_text(f"#line 1 \"README.md:{line}\"\n{code}\n#line 1 \"harness\"\n{C_HARNESS}")
    build_extension("bnbw_readme_c", [source], tmp_path, extra_compile_args=("-O1", "-Werror"))
    done = run_python(["-c", C_CHECK], tmp_path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


# ---- shell commands ----------------------------------------------------------------------------

def _commands():
    """(command, where) for every shell command the README gives: the lines of the bash blocks
    and the inline code spans that start with pip or python."""
    found = []
    for code, line in _blocks("bash"):
        for text in code.splitlines():
            text = text.split("#", 1)[0].strip()
            found += [(part.strip(), f"L{line}") for part in text.split("&&") if part.strip()]
    prose = FENCE.sub("", README)
    for span in re.findall(r"`([^`\n]+)`", prose):
        if re.match(r"(pip|python) ", span):
            found += [(part.strip(), "inline") for part in span.split("&&")]
    return found


def _extras():
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"(?ms)^\[project\.optional-dependencies\]\n(.*?)(?=^\[)", text).group(1)
    return set(re.findall(r"(?m)^(\w+)\s*=", section))


COMMANDS = _commands()


def test_the_readme_gives_the_two_set_up_commands():
    """The first shell block, right under the Set-up heading, holds both commands."""
    first = _blocks("bash")[0][1]
    assert README.splitlines()[first - 3].startswith("## Set-up")
    where = f"L{first}"
    # a virtual environment first; the package built once, with the test extras
    setup = [c for c, w in COMMANDS if w == where]
    assert setup[:3] == ["python3 -m venv .venv", ". .venv/bin/activate",
                         'pip install ".[test]"'], setup
    assert setup[3:] == ["bnbw-demo", "pytest"], setup


@pytest.mark.parametrize("command, where", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_shell_command_names_what_exists(command, where):
    words = shlex.split(command)
    if words[:2] == ["pip", "install"]:
        (target,) = words[2:]
        match = re.fullmatch(r"\.(?:\[([\w,]+)\])?", target)
        assert match, f"{where}: pip install {target!r}: install the checkout, '.' or '.[extra]'"
        for extra in filter(None, (match.group(1) or "").split(",")):
            assert extra in _extras(), f"{where}: no extra [{extra}] in pyproject.toml"
    elif words[:2] == ["pip", "wheel"]:
        assert words[2] == ".", f"{where}: pip wheel {words[2]!r}: build the checkout, '.'"
    elif words[0] == "python" and words[1] == "-m":
        assert importlib.util.find_spec(words[2]), f"{where}: no module {words[2]}"
    elif words[0] == "python":
        assert (ROOT / words[1]).is_file(), f"{where}: {words[1]} does not exist"
        if words[1] == "setup.py":
            assert words[2] == "build_ext"
    elif words[0] == "bnbw-demo":
        assert re.search(r'(?m)^bnbw-demo = "bnbw_native\.demo:main"', (
            ROOT / "pyproject.toml").read_text())
    elif words[:3] == ["python3", "-m", "venv"] or words[0] == ".":
        assert words[-1] in (".venv", ".venv/bin/activate"), f"{where}: {command!r}"
    elif words[0] in ("pytest", "bash", "mpirun"):
        if words[0] == "bash":
            assert (ROOT / words[1]).is_file()
    else:
        pytest.fail(f"{where}: the README runs {command!r}; teach this test what it means")


def test_num_outputs_1_is_said_to_be_onednn_graphs_formula_not_output_mask():
    """A PyTorch user reads num_outputs=1 as output_mask=[True, False, False]; it is not."""
    prose = " ".join(FENCE.sub("", README).split())
    assert re.search(r"`num_outputs=1` is oneDNN Graph's frozen-statistics formula.{0,120}"
                     r"not PyTorch's `output_mask`", prose)
