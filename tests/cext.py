"""Helpers for tests that meet the package the way a C user or a new user does: a freshly
compiled extension module, a fresh interpreter, a script run as written.

Test modules import them by name (``from cext import build_extension, run_python``): pytest
puts this directory on ``sys.path``.
"""
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import bnbw_native

ROOT = Path(__file__).resolve().parents[1]
#: The directory that holds the bnbw_native being tested (the checkout or site-packages).
PACKAGE_PARENT = Path(bnbw_native.__file__).resolve().parents[1]


def c_compiler():
    """The C compiler command's program, or None when there is none."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shutil.which(shlex.split(cc)[0]) or shutil.which("cc")


def build_extension(name, sources, out_dir, extra_compile_args=("-O1",)):
    """Compile `sources` into the extension module `name` in `out_dir` (as any C user's
    setup.py would, against bnbw_native.get_include()) and return the module's path."""
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    ext = Extension(name, [str(s) for s in sources], include_dirs=[bnbw_native.get_include()],
                    extra_compile_args=["-Wall", "-Werror=implicit-function-declaration",
                                        *extra_compile_args])
    cmd = build_ext(Distribution({"name": name, "ext_modules": [ext]}))
    cmd.build_lib = str(out_dir)
    cmd.build_temp = str(Path(out_dir) / "tmp")
    cmd.ensure_finalized()
    cmd.run()
    return next(Path(out_dir).glob(f"{name}*{sysconfig.get_config_var('EXT_SUFFIX')}"))


def run_python(args, *path, cwd, timeout=300, env=None):
    """Run a new interpreter with `args` in `cwd`, bnbw_native and `path` on PYTHONPATH;
    return the completed process (stdout and stderr as text)."""
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [*(str(p) for p in path), str(PACKAGE_PARENT)]
        + [p for p in [full_env.get("PYTHONPATH")] if p])
    full_env.pop("BNBW_KERNELS", None)
    return subprocess.run([sys.executable, *args], cwd=str(cwd), env=full_env,
                          capture_output=True, text=True, timeout=timeout)
