"""Build the native core of bnbw_native.

The extension modules are plain Cython + C.  A build-time probe and one rule decide the flags:

* OpenMP: compile *and run* a tiny OpenMP program.  If that works the kernels are built with
  ``-fopenmp`` (runtime linked dynamically, so threadpoolctl can see and limit it).  If it does
  not, the build warns and goes on serial, unless ``BNBW_REQUIRE_OPENMP=1`` asks for a hard
  failure instead.
* No ``-march=native``: the kernels are compiled once per instruction set (portable, AVX2,
  AVX-512; each translation unit targets its own) and picked at run time from what the CPU and
  the OS support, so one wheel runs everywhere.  ``BNBW_NATIVE_ARCH=1`` adds the flag for local
  experiments only.
"""
import glob
import os
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import warnings

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

OPENMP_PROBE = textwrap.dedent(
    """
    #include <omp.h>
    #include <stdio.h>
    int main(void) {
        int n = 0;
        #pragma omp parallel reduction(+:n)
        n += 1;
        printf("%d %d\\n", n, _OPENMP);
        return n > 0 ? 0 : 1;
    }
    """
)

def _compiler():
    return os.environ.get("CC") or sysconfig.get_config_var("CC").split()[0] or "cc"


def _compile_and_run(source, flags):
    """True when `source` compiles with `flags` and the program exits 0."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        exe = os.path.join(tmp, "probe")
        with open(src, "w") as f:
            f.write(source)
        try:
            subprocess.run([_compiler(), src, "-o", exe, *flags], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            subprocess.run([exe], check=True, stdout=subprocess.DEVNULL, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
    return True


def openmp_flags():
    if os.environ.get("BNBW_DISABLE_OPENMP") == "1":
        return []
    if _compile_and_run(OPENMP_PROBE, ["-fopenmp"]):
        return ["-fopenmp"]
    message = ("bnbw_native: the C compiler cannot build and run an OpenMP program; "
               "building the kernels serial (every num_threads runs on one thread).")
    if os.environ.get("BNBW_REQUIRE_OPENMP") == "1":
        sys.exit(message + " BNBW_REQUIRE_OPENMP=1 makes this an error.")
    warnings.warn(message)
    return []


def compile_flags():
    # -ffp-contract=off: the bits of every result depend on each multiply and add rounding
    # where the source says (the kernels fuse explicitly where they mean to); a compiler free to
    # contract a*b + c into one FMA would round differently on machines with and without FMA.
    flags = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-Wno-unused-function"]
    if os.environ.get("BNBW_NATIVE_ARCH") == "1":
        flags.append("-march=native")
    extra = os.environ.get("BNBW_EXTRA_CFLAGS")
    if extra:
        flags += extra.split()
    return flags


omp = openmp_flags()
cflags = compile_flags() + omp
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]


def extension(name, sources):
    return Extension(
        f"bnbw_native.{name}",
        sources,
        include_dirs=["include", numpy.get_include()],
        depends=sorted(glob.glob("include/*.h")),   # rebuild when a header changes
        define_macros=macros,
        extra_compile_args=cflags,
        extra_link_args=omp + [f for f in cflags if f.startswith("-fsanitize")],
        libraries=[] if sys.platform == "win32" else ["m"],   # fmaf (bnbw_kernels.h)
    )


# plan -> schedules -> the validation layer (_call) -> the C API table (_capi); _half: the
# public conversion helpers.  The kernels (one translation unit per instruction set, each
# targeting its own, plus the run-time choice between them) are linked into _schedules only,
# so one process has one choice of body.
KERNEL_SOURCES = [f"bnbw_native/kernels{suffix}.c"
                  for suffix in ("", "_portable", "_avx2", "_avx512")]
extensions = [
    extension(name, [f"bnbw_native/{name}.pyx"] + (KERNEL_SOURCES if name == "_schedules" else []))
    for name in ("_plan", "_schedules", "_call", "_capi", "_half")
]

class build_py_with_headers(build_py):
    """Ship include/*.h inside the package, where bnbw_native.get_include() finds them."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "bnbw_native", "include")
        self.mkpath(target)
        for name in sorted(os.listdir("include")):
            if name.endswith(".h"):
                self.copy_file(os.path.join("include", name), os.path.join(target, name))


setup(
    cmdclass={"build_py": build_py_with_headers},
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    ),
)
