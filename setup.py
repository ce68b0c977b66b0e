"""Build the native core of bnbw_native.

The extension modules are plain Cython + C.  A build-time probe and one rule decide the flags:

* OpenMP: compile *and run* a tiny OpenMP program.  If that works the kernels are built with
  ``-fopenmp`` (runtime linked dynamically, so threadpoolctl can see and limit it).  If it does
  not, the build warns and goes on serial, unless ``BNBW_REQUIRE_OPENMP=1`` asks for a hard
  failure instead.
* No ``-march=native``: the kernels are compiled once per instruction set (portable, AVX2,
  AVX-512, NEON on AArch64; each translation unit targets its own) and picked at run time from
  what the CPU and the OS support, so one wheel runs everywhere.  ``BNBW_NATIVE_ARCH=1`` adds the flag for local
  experiments only.
"""
import glob
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import warnings

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


def compiler_command():
    """The C compiler as a command line, read the way the build itself reads it: $CC when set
    (e.g. "ccache gcc" or "gcc -pipe"), else the compiler Python was built with."""
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def _compile_and_run(source, flags):
    """True when `source` compiles with `flags` and the program exits 0."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        exe = os.path.join(tmp, "probe")
        with open(src, "w") as f:
            f.write(source)
        try:
            subprocess.run([*compiler_command(), src, "-o", exe, *flags], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            subprocess.run([exe], check=True, stdout=subprocess.DEVNULL, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
    return True


def openmp_flags():
    """(flags, note): ["-fopenmp"] when the compiler builds and runs an OpenMP program, else []
    and why, for the build record (pip hides the warning unless asked to be verbose)."""
    if os.environ.get("BNBW_DISABLE_OPENMP") == "1":
        return [], "disabled by BNBW_DISABLE_OPENMP=1"
    if _compile_and_run(OPENMP_PROBE, ["-fopenmp"]):
        return ["-fopenmp"], ""
    note = f"{shlex.join(compiler_command())} cannot build and run an OpenMP program"
    message = (f"bnbw_native: {note}; building the kernels serial (every num_threads runs on "
               "one thread).")
    if os.environ.get("BNBW_REQUIRE_OPENMP") == "1":
        sys.exit(message + " BNBW_REQUIRE_OPENMP=1 makes this an error.")
    warnings.warn(message)
    return [], note


def compile_flags():
    # -ffp-contract=off: the bits of every result depend on each multiply and add rounding
    # where the source says (the kernels fuse explicitly where they mean to); a compiler free to
    # contract a*b + c into one FMA would round differently on machines with and without FMA.
    # -g0: Python's own CFLAGS carry -g, which would ship megabytes of debug info in the wheel;
    # BNBW_EXTRA_CFLAGS comes later and may turn it back on (the sanitizer build does).
    flags = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-Wno-unused-function",
             "-g0"]
    if os.environ.get("BNBW_NATIVE_ARCH") == "1":
        flags.append("-march=native")
    extra = os.environ.get("BNBW_EXTRA_CFLAGS")
    if extra:
        flags += shlex.split(extra)
    return flags


def compiler_version(command):
    """The first line of `command --version` (e.g. "gcc (Debian 12.2.0-14) 12.2.0"), or ""."""
    program = []
    for word in command:            # the program and any wrapper before it, not its flags
        if word.startswith("-"):
            break
        program.append(word)
    try:
        done = subprocess.run([*program, "--version"], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = done.stdout.strip().splitlines()
    return lines[0] if done.returncode == 0 and lines else ""


RECORD = "_build_info.py"
CYTHON_DIRECTIVES = {
    "boundscheck": False,
    "wraparound": False,
    "cdivision": True,
    "initializedcheck": False,
}


def build_record(compile_command, extension_flags, openmp, openmp_note):
    """The text of bnbw_native/_build_info.py: what built the extension modules, for
    show_config (which must not describe the interpreter's compiler instead)."""
    facts = {
        "compiler": compiler_version(compile_command),
        "compile_command": list(compile_command),
        "extension_flags": list(extension_flags),
        "openmp_flags": list(openmp),
        "openmp_note": openmp_note,
        "python": sys.version.split()[0],
        "platform": sysconfig.get_platform(),
    }
    lines = [f"    {key!r}: {value!r}," for key, value in facts.items()]
    return ("# What built the extension modules beside this file; written by setup.py at build "
            "time.\nBUILD = {\n" + "\n".join(lines) + "\n}\n")


def _mtime(path):
    return os.stat(path).st_mtime_ns if os.path.exists(path) else None


def main():
    import numpy
    from setuptools import Extension, setup
    from setuptools.command.build_ext import build_ext
    from setuptools.command.build_py import build_py

    omp, omp_note = openmp_flags()
    cflags = compile_flags() + omp
    macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]

    def extension(name, sources):
        return Extension(
            f"bnbw_native.{name}",
            sources,
            include_dirs=["include", "src", numpy.get_include()],
            depends=sorted(glob.glob("include/*.h") + glob.glob("src/*.h")),   # rebuild when a header changes
            define_macros=macros,
            extra_compile_args=cflags,
            extra_link_args=omp + [f for f in cflags if f.startswith("-fsanitize")],
            libraries=[] if sys.platform == "win32" else ["m"],   # fmaf (bnbw_kernels.h)
        )

    # plan -> schedules -> the validation layer (_call) -> the C API table (_capi); _half: the
    # public conversion helpers.  The kernels (one translation unit per instruction set, each
    # targeting its own, plus the run-time choice between them) are linked into _schedules
    # only, so one process has one choice of body.
    kernel_sources = [f"src/body_{name}.c" for name in ("choice", "portable", "avx2", "avx512",
                                                          "neon")]
    extensions = [
        extension(name, [f"bnbw_native/{name}.pyx"]
                  + (kernel_sources if name == "_schedules" else []))
        for name in ("_plan", "_schedules", "_call", "_capi", "_half")
    ]

    class build_py_with_headers(build_py):
        """Ship the public header (include/*.h) inside the package, where
        bnbw_native.get_include() finds it; the private C sources (src/) stay out of wheels.
        The build record is build_ext's alone: an in-place one must not reach a wheel or an
        sdist."""

        def find_package_modules(self, package, package_dir):
            return [m for m in super().find_package_modules(package, package_dir)
                    if m[1] != RECORD[:-3]]

        def run(self):
            super().run()
            target = os.path.join(self.build_lib, "bnbw_native", "include")
            self.mkpath(target)
            for name in sorted(os.listdir("include")):
                if name.endswith(".h"):
                    self.copy_file(os.path.join("include", name), os.path.join(target, name))

    class build_ext_with_record(build_ext):
        """Write bnbw_native/_build_info.py beside the modules it compiled (in the build tree,
        and in the source tree for --inplace)."""

        def run(self):
            # Cythonize here, not when setup.py is read: an sdist or egg_info needs no C, and
            # the generated C stays out of the sdist.  All at once, before -j's worker threads.
            from Cython.Build import cythonize
            generated = {e.name: e.sources for e in cythonize(
                self.extensions, language_level=3, compiler_directives=CYTHON_DIRECTIVES)}
            for ext in self.extensions:
                ext.sources = generated[ext.name]
            outputs = [os.path.join(self.build_lib, self.get_ext_filename(ext.name))
                       for ext in self.extensions]
            before = [_mtime(path) for path in outputs]
            super().run()
            compiled = before != [_mtime(path) for path in outputs]
            targets = [os.path.join(self.build_lib, "bnbw_native")]
            if self.inplace:
                targets.append(self.get_finalized_command("build_py").get_package_dir(
                    "bnbw_native"))
            command = getattr(self.compiler, "compiler_so", None) or compiler_command()
            text = build_record(command, cflags, omp, omp_note)
            for target in targets:
                path = os.path.join(target, RECORD)
                # an up-to-date build compiles nothing: keep the record of what did compile
                if compiled or not os.path.exists(path):
                    os.makedirs(target, exist_ok=True)
                    with open(path, "w") as f:
                        f.write(text)

    setup(
        cmdclass={"build_py": build_py_with_headers, "build_ext": build_ext_with_record},
        ext_modules=extensions,
    )


# setuptools runs this file as __main__; tests load it under another name to call the probes.
if __name__ == "__main__":
    main()
