"""Build the native core of bnbw_native.

The extension modules are plain Cython + C.  A build-time probe and one rule decide the flags:

* OpenMP: compile *and run* a tiny OpenMP program.  If that works the kernels are built with
  OpenMP (runtime linked dynamically, so threadpoolctl can see and limit it): ``-fopenmp`` for
  GCC and LLVM clang, ``-Xpreprocessor -fopenmp -lomp`` for Apple clang with a separate libomp
  (e.g. Homebrew's, found through CFLAGS/LDFLAGS, which the probe reads as the build does),
  ``/openmp`` for MSVC.  If none works, the build warns and goes on serial, unless
  ``BNBW_REQUIRE_OPENMP=1`` asks for a hard failure instead.
* Flags by compiler type: GCC-style flags for the "unix" compilers (GCC, clang), MSVC's own
  equivalents for "msvc" (the kernels' GCC/clang attributes make an MSVC build fail today:
  configured, not working).
* No run path into the interpreter: the link command Python was configured with may carry
  ``-Wl,-rpath,<its prefix>/lib`` (pyenv and conda builds do); the extension modules need no
  run path at all (they do not link libpython), so those flags are dropped.  A run path the
  builder asks for in $LDFLAGS is kept.
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


def _environment_flags(*names):
    """The words of the environment variables `names` ($CPPFLAGS, $CFLAGS, $LDFLAGS), which
    the build adds to its compile and link commands: the probe must see what the build sees
    (e.g. -I/-L flags pointing at a libomp installed outside the compiler's search path)."""
    return [word for name in names for word in shlex.split(os.environ.get(name, ""))]


def _compile_and_run(source, flags):
    """True when `source` compiles with `flags` and the program exits 0."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        exe = os.path.join(tmp, "probe")
        with open(src, "w") as f:
            f.write(source)
        try:
            subprocess.run([*compiler_command(), *_environment_flags("CPPFLAGS", "CFLAGS"), src,
                            "-o", exe, *flags, *_environment_flags("LDFLAGS")], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            subprocess.run([exe], check=True, stdout=subprocess.DEVNULL, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
    return True


def _compile_and_run_with(compiler, source, flags):
    """True when `source` compiles and links with the distutils `compiler` object (MSVC, whose
    command is not a plain program on PATH) given `flags`, and the program exits 0."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(source)
        try:
            objects = compiler.compile([src], output_dir=tmp, extra_postargs=flags)
            compiler.link_executable(objects, "probe", output_dir=tmp)
            exe = os.path.join(tmp, compiler.executable_filename("probe"))
            subprocess.run([exe], check=True, stdout=subprocess.DEVNULL, timeout=60)
        except Exception:           # CompileError, LinkError, OSError, SubprocessError
            return False
    return True


# The OpenMP spellings tried, in order, per compiler type.  The second "unix" one is Apple
# clang's: its driver has no -fopenmp of its own, the preprocessor takes it and libomp (not part
# of Xcode) provides the runtime.
OPENMP_CANDIDATES = {
    "unix": (["-fopenmp"], ["-Xpreprocessor", "-fopenmp", "-lomp"]),
    "msvc": (["/openmp"],),
}


def openmp_flags(kind="unix", compiler=None):
    """(flags, note): the first OpenMP spelling of OPENMP_CANDIDATES[kind] with which the
    compiler builds and runs an OpenMP program, else [] and why, for the build record (pip
    hides the warning unless asked to be verbose).  `compiler`: the distutils compiler object,
    needed for kind "msvc"; "unix" compilers run as $CC (or Python's CC) says."""
    if os.environ.get("BNBW_DISABLE_OPENMP") == "1":
        return [], "disabled by BNBW_DISABLE_OPENMP=1"
    for flags in OPENMP_CANDIDATES[kind]:
        if kind == "msvc":
            works = compiler is not None and _compile_and_run_with(compiler, OPENMP_PROBE, flags)
        else:
            works = _compile_and_run(OPENMP_PROBE, flags)
        if works:
            return list(flags), ""
    who = "MSVC" if kind == "msvc" else shlex.join(compiler_command())
    note = f"{who} cannot build and run an OpenMP program"
    message = (f"bnbw_native: {note}; building the kernels serial (every num_threads runs on "
               "one thread).")
    if os.environ.get("BNBW_REQUIRE_OPENMP") == "1":
        sys.exit(message + " BNBW_REQUIRE_OPENMP=1 makes this an error.")
    warnings.warn(message)
    return [], note


def split_openmp_flags(flags, kind="unix"):
    """(compile flags, link flags) of an OpenMP spelling: -Xpreprocessor -fopenmp only
    compiles, -lomp / -L only link, a bare -fopenmp does both; MSVC's /openmp compiles and the
    object itself names the runtime (vcomp) to the linker."""
    if kind == "msvc":
        return list(flags), []
    compile_only, link_only = [], []
    after_xpreprocessor = False
    for flag in flags:
        if flag.startswith(("-l", "-L")):
            link_only.append(flag)
        else:
            compile_only.append(flag)
            if flag == "-fopenmp" and not after_xpreprocessor:
                link_only.append(flag)
        after_xpreprocessor = flag == "-Xpreprocessor"
    return compile_only, link_only


def compile_flags(kind="unix"):
    """The compile flags for the compiler type `kind` ("unix": GCC or clang; "msvc")."""
    if kind == "msvc":
        # The same intent in MSVC's words: /fp:precise, which (Visual Studio 2022 and later)
        # contracts nothing into FMAs without /fp:contract; C11 for the kernels' syntax; no
        # debug info unless asked (MSVC emits none without /Zi).  BNBW_NATIVE_ARCH is GCC-only.
        flags = ["/O2", "/std:c11", "/fp:precise"]
    else:
        # -ffp-contract=off: the bits of every result depend on each multiply and add rounding
        # where the source says (the kernels fuse explicitly where they mean to); a compiler
        # free to contract a*b + c into one FMA would round differently on machines with and
        # without FMA.  -g0: Python's own CFLAGS carry -g, which would ship megabytes of debug
        # info in the wheel; BNBW_EXTRA_CFLAGS comes later and may turn it back on (the
        # sanitizer build does).
        flags = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno",
                 "-Wno-unused-function", "-g0"]
        if os.environ.get("BNBW_NATIVE_ARCH") == "1":
            flags.append("-march=native")
    extra = os.environ.get("BNBW_EXTRA_CFLAGS")
    if extra:
        flags += shlex.split(extra)
    return flags


RUN_PATH_OPTIONS = ("-rpath", "--rpath", "-R")     # the linker's spellings, value next


def _strip_linker_run_paths(args, keep):
    """(the linker options `args` without run paths outside `keep`, the directories dropped)."""
    kept, dropped = [], []
    j = 0
    while j < len(args):
        arg = args[j]
        if arg in RUN_PATH_OPTIONS and j + 1 < len(args):
            option, value, j = arg, args[j + 1], j + 2
        elif arg.startswith(("-rpath=", "--rpath=")):
            (option, value), j = arg.split("=", 1), j + 1
        else:
            kept.append(arg)
            j += 1
            continue
        dirs = value.split(":")
        dropped += [d for d in dirs if d not in keep]
        wanted = [d for d in dirs if d in keep]
        if wanted:
            kept += [option, ":".join(wanted)]
    return kept, dropped


def strip_run_paths(words, keep=()):
    """(the link command `words` without the run paths it sets, except directories in `keep`;
    the directories dropped).  Reads the driver's spellings: -Wl,-rpath,DIR (also -rpath=DIR,
    --rpath, -R, other options in the same -Wl, word, the value in the next -Wl, word) and
    -Xlinker -rpath -Xlinker DIR."""
    out, dropped = [], []
    i = 0
    while i < len(words):
        word, start = words[i], i
        if word.startswith("-Wl,"):
            args = word[4:].split(",")
            i += 1
            while args[-1] in RUN_PATH_OPTIONS and i < len(words) and words[i].startswith("-Wl,"):
                args += words[i][4:].split(",")          # -Wl,-rpath -Wl,DIR
                i += 1
        elif word == "-Xlinker" and i + 1 < len(words):
            args = [words[i + 1]]
            i += 2
            if (args[0] in RUN_PATH_OPTIONS and i + 1 < len(words)
                    and words[i] == "-Xlinker"):
                args.append(words[i + 1])                # -Xlinker -rpath -Xlinker DIR
                i += 2
        else:
            out.append(word)
            i += 1
            continue
        kept, gone = _strip_linker_run_paths(args, keep)
        dropped += gone
        if not gone:
            out += words[start:i]                        # no run path dropped: as written
        elif kept:
            out.append("-Wl," + ",".join(kept))
    return out, dropped


def without_interpreter_run_paths(link_command):
    """(`link_command` without the run paths that Python's own configuration put in it, the
    directories dropped).  Run paths the builder asks for ($LDFLAGS, $LDSHARED) stay."""
    _, asked = strip_run_paths(_environment_flags("LDSHARED", "LDFLAGS"))
    return strip_run_paths(list(link_command), keep=set(asked))


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


def build_record(compile_command, extension_flags, openmp, openmp_note, dropped_run_paths=()):
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
        # run paths of Python's own link command that the modules were linked without
        "dropped_run_paths": sorted(set(dropped_run_paths)),
    }
    lines = [f"    {key!r}: {value!r}," for key, value in facts.items()]
    return ("# What built the extension modules beside this file; written by setup.py at build "
            "time.\nBUILD = {\n" + "\n".join(lines) + "\n}\n")


def available_cpus():
    """The CPUs this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def compile_sources_in_parallel(compiler, jobs):
    """Make a Unix-style distutils `compiler` compile the sources of one call in `jobs`
    threads, at most `jobs` compiler processes at once over every call (build_ext's -j runs
    several calls, one per module, at the same time).  The steps are distutils' own:
    _setup_compile, _get_cc_args, then _compile per object."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    slots = threading.BoundedSemaphore(max(1, jobs))

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=False,
                extra_preargs=None, extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj):
            if obj not in build:
                return
            src, ext = build[obj]
            with slots:
                compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

        with ThreadPoolExecutor(max(1, min(jobs, len(objects)))) as pool:
            list(pool.map(one, objects))
        return objects

    compiler.compile = compile


def _mtime(path):
    return os.stat(path).st_mtime_ns if os.path.exists(path) else None


def main():
    import numpy
    from setuptools import Extension, setup
    from setuptools.command.build_ext import build_ext
    from setuptools.command.build_py import build_py

    macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]

    def extension(name, sources):
        # compile and link flags: build_ext_with_record.build_extensions, which knows the compiler
        return Extension(
            f"bnbw_native.{name}",
            sources,
            include_dirs=["include", "src", numpy.get_include()],
            depends=sorted(glob.glob("include/*.h") + glob.glob("src/*.h")),   # rebuild when a header changes
            define_macros=macros,
            libraries=[] if sys.platform == "win32" else ["m"],   # fmaf (bnbw_kernels.h)
        )

    # plan -> schedules -> the engine entry (which links the kernels: one process, one choice of
    # body) -> the overlap solver -> the validation rules -> foreign objects as arrays (DLPack)
    # -> array calls / DirectML operators -> the C API table; _half: the public conversion
    # helpers; _relayout: the torch layers' channel-first <-> channel-last copies.
    kernel_sources = [f"src/body_{name}.c" for name in ("choice", "portable", "avx2", "avx512",
                                                          "neon")]
    extensions = [
        extension(name, [f"bnbw_native/{name}.pyx"]
                  + (kernel_sources if name == "_engine" else []))
        for name in ("_plan", "_schedules", "_execute", "_engine", "_overlap", "_rules", "_dlpack",
                     "_arrays", "_directml", "_capi", "_half", "_relayout")
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
        """Choose the flags for the compiler at hand, link without the interpreter's run paths,
        and write bnbw_native/_build_info.py beside the modules it compiled (in the build tree,
        and in the source tree for --inplace).  Builds on every CPU this process may use unless
        told otherwise (-j / --parallel): the modules in parallel, and the sources of one
        module (the kernel bodies of _engine) in parallel too, never more compilers at once
        than CPUs."""

        def finalize_options(self):
            super().finalize_options()
            if self.parallel is None:
                self.parallel = available_cpus()

        def build_extensions(self):
            kind = "msvc" if self.compiler.compiler_type == "msvc" else "unix"
            omp, self.omp_note = openmp_flags(kind, self.compiler)
            omp_compile, omp_link = split_openmp_flags(omp, kind)
            self.omp = omp
            self.cflags = compile_flags(kind) + omp_compile
            link = omp_link + [f for f in self.cflags if f.startswith("-fsanitize")]
            for ext in self.extensions:
                ext.extra_compile_args = list(self.cflags)
                ext.extra_link_args = list(link)
            self.dropped = []
            linker = getattr(self.compiler, "linker_so", None)
            if kind == "unix" and linker:
                self.compiler.linker_so, self.dropped = without_interpreter_run_paths(linker)
            if kind == "unix":
                compile_sources_in_parallel(self.compiler, int(self.parallel or 1))
            super().build_extensions()

        def run(self):
            # Cythonize here, not when setup.py is read: an sdist or egg_info needs no C, and
            # the generated C stays out of the sdist.  All at once, before -j's worker threads.
            from Cython.Build import cythonize
            generated = {e.name: e.sources for e in cythonize(
                self.extensions, language_level=3, compiler_directives=CYTHON_DIRECTIVES,
                nthreads=int(self.parallel or 1) if self.parallel != 1 else 0)}
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
            command = (getattr(self.compiler, "compiler_so", None)
                       or [getattr(self.compiler, "cc", None) or compiler_command()[0]])
            if not hasattr(self, "cflags"):      # no extension to build: nothing was probed
                return
            text = build_record(command, self.cflags, self.omp, self.omp_note, self.dropped)
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
