"""Compile the plain C program of this directory against the running interpreter and run it.

    python examples/c_program/run.py [BUILD_DIR]

bnbw_c_program.c embeds CPython to reach bnbw_native's C API.  It is compiled and linked with
the flags `python3-config --cflags --ldflags --embed` would give for this interpreter (read
from sysconfig, since a virtual environment has no python3-config of its own), then run with
this interpreter's path as its argument, so the embedded Python finds this environment's
bnbw_native.
"""
import os
import shlex
import subprocess
import sys
import sysconfig

import bnbw_native

HERE = os.path.dirname(os.path.abspath(__file__))


def embed_flags():
    """(compile flags, link flags) for a program that embeds this interpreter."""
    var = sysconfig.get_config_var
    compile_flags = [f"-I{sysconfig.get_path('include')}", f"-I{bnbw_native.get_include()}"]
    libdirs = [d for d in (var("LIBDIR"), var("LIBPL")) if d]
    link = [f"-L{d}" for d in libdirs] + [f"-lpython{var('LDVERSION')}"]
    link += shlex.split(var("LIBS") or "") + shlex.split(var("SYSLIBS") or "")
    link += shlex.split(var("LINKFORSHARED") or "")   # exports the C API extension modules use
    if var("Py_ENABLE_SHARED"):
        link.append(f"-Wl,-rpath,{var('LIBDIR')}")     # where the shared libpython lives
    return compile_flags, link + ["-lm"]


def main():
    where = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "build"))
    os.makedirs(where, exist_ok=True)
    program = os.path.join(where, "bnbw_c_program")
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    compile_flags, link_flags = embed_flags()
    subprocess.run([*cc, "-O1", "-Wall", "-Werror", *compile_flags,
                    os.path.join(HERE, "bnbw_c_program.c"), "-o", program, *link_flags],
                   check=True)
    done = subprocess.run([program, sys.executable], capture_output=True, text=True)
    print(done.stdout, end="")
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"bnbw_c_program exited with {done.returncode}")


if __name__ == "__main__":
    main()
