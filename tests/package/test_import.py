"""Importing bnbw_native, as a new user first meets it: the C API's table (bnbw_import) from a
freshly compiled extension in a fresh interpreter, a clear message when Python picks up the
unbuilt source tree, and a broken install's own error kept."""
import shutil
import textwrap

import pytest

import bnbw_native
from cext import ROOT, build_extension, c_compiler, run_python

# The smallest C user: fetch the table, ask it something that needs the library.
IMPORTER = textwrap.dedent("""
    #define PY_SSIZE_T_CLEAN
    #include <Python.h>
    #include "bnbw_native.h"

    static PyObject *version(PyObject *self, PyObject *unused)
    {
        static const int64_t sizes[2] = {3, 5};
        uint64_t minimum = 0;
        if (bnbw_import() < 0)
            return NULL;
        if (bnbw_api->calc_buffer_tensor_size(BNBW_DATA_TYPE_FLOAT16, 2, sizes, NULL, &minimum,
                                              NULL) != BNBW_OK)
            return PyErr_Format(PyExc_RuntimeError, "%s", bnbw_api->error_message());
        return Py_BuildValue("sK", bnbw_api->library_version(), (unsigned long long)minimum);
    }

    static PyMethodDef methods[] = {{"version", version, METH_NOARGS, NULL}, {NULL}};
    static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "bnbw_first_user", NULL, -1,
                                        methods};
    PyMODINIT_FUNC PyInit_bnbw_first_user(void) { return PyModule_Create(&module); }
""")


@pytest.fixture(scope="module")
def first_user(tmp_path_factory):
    if c_compiler() is None:
        pytest.skip("no C compiler found (set CC, or install cc/gcc/clang)")
    out = tmp_path_factory.mktemp("first_user")
    source = out / "bnbw_first_user.c"
    source.write_text(IMPORTER)
    build_extension("bnbw_first_user", [source], out)
    return out


@pytest.mark.parametrize("before", ["", "import bnbw_native", "import bnbw_native.dml"])
def test_bnbw_import_works_in_a_fresh_interpreter(first_user, tmp_path, before):
    """bnbw_import() fetches the table whatever Python imported before, as import_array() does;
    PyCapsule_Import finds the module as an attribute of the package."""
    code = textwrap.dedent(f"""
        import sys
        {before}
        import bnbw_first_user
        assert ("bnbw_native._directml" in sys.modules) == {"dml" in before}
        print(*bnbw_first_user.version())
    """)
    done = run_python(["-c", code], first_user, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [bnbw_native.__version__, "30"]


# ---- importing from the source tree -----------------------------------------------------------

def _unbuilt_copy(dest):
    """The package's Python sources and setup.py, without any built extension module: what a
    checkout looks like after `pip install .` (the build went to site-packages)."""
    pkg = dest / "bnbw_native"
    pkg.mkdir(parents=True)
    for path in (ROOT / "bnbw_native").iterdir():
        if path.suffix in (".py", ".pyx", ".pxd"):
            shutil.copy(path, pkg / path.name)
    shutil.copy(ROOT / "setup.py", dest / "setup.py")
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_importing_the_unbuilt_source_tree_says_what_to_do(tmp_path):
    tree = _unbuilt_copy(tmp_path / "checkout")
    done = run_python(["-c", "import bnbw_native"], cwd=tree)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: "), done.stderr
    assert "partially initialized" not in last
    assert str(tree / "bnbw_native") in last          # where it looked
    assert "source tree" in last
    assert "build_ext --inplace" in last              # the two ways out
    assert "another directory" in last


def test_a_broken_install_keeps_its_own_error(tmp_path):
    """Only the source tree gets the advice: an installed copy missing a module (no setup.py
    beside it) reports what is missing."""
    tree = _unbuilt_copy(tmp_path / "site")
    (tree / "setup.py").unlink()
    (tree / "pyproject.toml").unlink()
    done = run_python(["-c", "import bnbw_native"], cwd=tree)
    assert done.returncode != 0
    assert "source tree" not in done.stderr
    assert "_engine" in done.stderr.strip().splitlines()[-1]
