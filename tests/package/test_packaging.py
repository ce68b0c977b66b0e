"""The package as distributed: license, metadata, one version, an sdist that is a whole source
tree (its own tests run in it), a wheel without generated C, debug info or run paths into the
machine that built it, and the release configuration (cibuildwheel, .ci/wheel.sh)."""
import email.parser
import importlib
import os
import re
import shlex
import shutil
import site
import struct
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

import bnbw_native
from cext import ROOT, c_compiler

NAME = f"bnbw_native-{bnbw_native.__version__}"


def _python(args, cwd, env=None, timeout=600):
    done = subprocess.run([sys.executable, *args], cwd=str(cwd), capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """(path of the sdist built from this tree by the PEP 517 backend, unpacked directory)."""
    out = tmp_path_factory.mktemp("sdist")
    _python(["-c", "import sys; from setuptools import build_meta; "
                   "print(build_meta.build_sdist(sys.argv[1]))", str(out)], cwd=ROOT)
    path = out / f"{NAME}.tar.gz"
    with tarfile.open(path) as tar:
        tar.extractall(out)
    return path, out / NAME


def _sdist_files(tree):
    return {p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def metadata(sdist):
    return email.parser.Parser().parsestr((sdist[1] / "PKG-INFO").read_text())


# ---- license, metadata, version ---------------------------------------------------------------

def test_license_file_is_the_apache_license(sdist, metadata):
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert (sdist[1] / "LICENSE").read_text() == text
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]


def test_classifiers(metadata):
    classifiers = metadata.get_all("Classifier") or []
    for wanted in ("Programming Language :: Python :: 3", "Programming Language :: Cython",
                   "Programming Language :: C", "Typing :: Typed",
                   "Intended Audience :: Science/Research"):
        assert wanted in classifiers
    # every minor version the metadata names is one requires-python admits
    low = tuple(map(int, re.fullmatch(r">=(\d+)\.(\d+)", metadata["Requires-Python"]).groups()))
    minors = [tuple(map(int, c.rsplit(" ", 1)[1].split(".")))
              for c in classifiers if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert minors and min(minors) == low


def test_the_version_has_one_source(metadata):
    """bnbw_native/_config.py holds the version; pyproject.toml reads it from there."""
    assert metadata["Version"] == bnbw_native.__version__
    pyproject = (ROOT / "pyproject.toml").read_text()
    project = re.search(r"(?ms)^\[project\]\n(.*?)(?=^\[)", pyproject).group(1)
    assert not re.search(r"(?m)^version\s*=", project), "[project] states a version"
    assert re.search(r'(?m)^dynamic\s*=\s*\[[^\]]*"version"', project)
    assert re.search(r'(?m)^version\s*=\s*\{\s*attr\s*=\s*"bnbw_native\._config\.__version__"',
                     pyproject)
    quoted = re.compile(r"""["']""" + re.escape(bnbw_native.__version__) + r"""["']""")
    holders = [p.relative_to(ROOT).as_posix()
               for p in [ROOT / "pyproject.toml", ROOT / "setup.py",
                         *(ROOT / "bnbw_native").glob("*.py"), *(ROOT / "bnbw_native").glob("*.pyx")]
               if quoted.search(p.read_text())]
    assert holders == ["bnbw_native/_config.py"]


# ---- the sdist ------------------------------------------------------------------------------

def _source_tree():
    """The files a source distribution must carry: what git tracks in a checkout (in an
    unpacked sdist, which has no git: every file but the sdist's own metadata)."""
    git = shutil.which("git")
    if git and (ROOT / ".git").exists():
        done = subprocess.run([git, "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
        tracked = {n.decode() for n in done.stdout.split(b"\0") if n}
        return {n for n in tracked if (ROOT / n).is_file()} - {".gitignore"}
    made_here = ("bnbw_native.egg-info/", "build/", "dist/", ".pytest_cache/", ".hypothesis/",
                 ".mypy_cache/", "bench/results/", "bench/.build/")
    return {n for n in _sdist_files(ROOT) if not _built(n) and not n.startswith(made_here)
            and n not in ("PKG-INFO", "setup.cfg", ".gitignore")}


def _built(name):
    """A build product or cache: compiled modules, the C Cython generates from a .pyx (not the
    hand-written C in src/), the build record."""
    generated = re.fullmatch(r"(bnbw_native/[^/]+)\.(c|html)", name)
    return (name.endswith((".so", ".o", ".pyc", ".pyd")) or "__pycache__" in name
            or (generated is not None and (ROOT / f"{generated.group(1)}.pyx").exists())
            or name == "bnbw_native/_build_info.py")


def test_sdist_is_the_whole_source_tree(sdist):
    """Tests import conftest.py and error_bounds.py, compile tests/surfaces/capi/example.c, run the
    examples and the benchmark smoke test: every tracked file goes in."""
    missing = sorted(_source_tree() - _sdist_files(sdist[1]))
    assert missing == []


def test_sdist_holds_no_build_products(sdist):
    files = _sdist_files(sdist[1])
    generated = [n for n in files if _built(n)]
    assert generated == []
    assert {"bnbw_native/_engine.pyx", "src/body_choice.c", "include/bnbw_native.h",
            "MANIFEST.in"} <= files


# ---- what the wheel carries -----------------------------------------------------------------

def test_package_files_hold_no_generated_c(sdist, tmp_path):
    """What build_py puts in the wheel (build_ext adds the modules): sources, stubs and
    headers, not the megabytes of C Cython generates."""
    tree = sdist[1]
    _python(["setup.py", "-q", "build_py", "--build-lib", str(tmp_path / "lib")], cwd=tree)
    pkg = tmp_path / "lib" / "bnbw_native"
    names = {p.relative_to(pkg).as_posix() for p in pkg.rglob("*") if p.is_file()}
    assert not [n for n in names if n.endswith((".c", ".html"))]   # compiled in, or generated
    assert "_build_info.py" not in names               # written by build_ext only
    assert {"py.typed", "__init__.py", "include/bnbw_native.h"} <= names
    # the Cython sources stay in the sdist: the modules are compiled from them
    assert not [n for n in names if n.endswith((".pyx", ".pxd"))], names
    # the public C API only: the kernels' private headers stay in the source tree (src/)
    assert {n for n in names if n.startswith("include/")} == {"include/bnbw_native.h"}
    assert {n for n in names if n.endswith(".pyi")} >= {"_engine.pyi", "dml.pyi", "half.pyi"}


@pytest.mark.slow
def test_sdist_builds_a_wheel_that_passes_the_sdists_own_tests(sdist, tmp_path):
    """What `pip install <sdist>` then `pytest` in the unpacked sdist does: the wheel is built
    from the sdist alone (with CC given as a command line), installed into a new environment
    and tested by the sdist's own suite, run from the sdist (not importing its source tree)."""
    cc = c_compiler()
    if cc is None:
        pytest.skip("no C compiler found")
    path, tree = sdist
    env = dict(os.environ, CC=f"{cc} -pipe", BNBW_REQUIRE_OPENMP="0")
    env.pop("PYTHONPATH", None)
    wheels = tmp_path / "wheels"
    _python(["-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
             str(path)], cwd=tmp_path, env=env, timeout=1200)
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        size = sum(i.file_size for i in zf.infolist())
        elf = sys.platform.startswith("linux") and sys.maxsize > 2**32
        run_paths = {n: elf_run_paths(zf.read(n)) for n in names if elf and n.endswith(".so")}
        debug = {n: elf_debug_sections(zf.read(n)) for n in run_paths}
    modules = len(list((tree / "bnbw_native").glob("*.pyx")))     # one extension each
    assert modules >= 8 and len(run_paths) == (modules if elf else 0), sorted(run_paths)
    assert not any(run_paths.values()), run_paths      # no run path at all before a repair
    assert not [n for n in names if n.endswith((".c", ".html"))]
    assert f"{NAME}.dist-info/licenses/LICENSE" in names
    assert "bnbw_native/py.typed" in names and "bnbw_native/_build_info.py" in names
    assert not any(debug.values()), debug               # built with -g0
    # the kernel bodies (portable, AVX2, AVX-512 on x86-64) are about 2.7 MB of machine code;
    # far more would be generated C or debugging information shipped by mistake
    assert size < 6_000_000, size

    # a new environment that sees this one's packages (numpy, pytest, ...) behind its own
    venv = tmp_path / "venv"
    _python(["-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    py = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True)
    outer = [p for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]}
             if os.path.isdir(p)]
    Path(purelib.stdout.strip(), "_outer_env.pth").write_text("\n".join(outer) + "\n")
    # --ignore-installed: the outer environment may hold an installed bnbw_native (CI's does)
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
                    "-q", str(wheel)], check=True, env=env)
    shown = subprocess.run([str(py), "-I", "-c", textwrap.dedent("""
        import bnbw_native
        facts = bnbw_native.show_config(mode="dicts")
        print(bnbw_native.__file__)
        print(facts["build"]["compile_command"][:2], facts["openmp"]["enabled"])
    """)], cwd=tmp_path, capture_output=True, text=True, check=True)
    where, built = shown.stdout.splitlines()
    assert where.startswith(str(venv))
    assert built == f"{[cc, '-pipe']} True"           # the build's compiler, OpenMP on

    # the README's first command, then its second: -I keeps the current directory off
    # sys.path, as the `pytest` command does
    demo = subprocess.run([str(venv / "bin" / "bnbw-demo")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert demo.returncode == 0 and "results agree with the float64 reference" in demo.stdout
    env.pop("CC")
    done = subprocess.run([str(py), "-I", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"],
                          cwd=tree, capture_output=True, text=True, timeout=1800, env=env)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]


# ---- run paths ------------------------------------------------------------------------------

DT_RPATH, DT_RUNPATH = 15, 29


def _elf_sections(data):
    """(name, sh_type, sh_offset, sh_size, sh_link) of each section of a 64-bit little-endian
    ELF shared object (its bytes)."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link
    headers = [struct.unpack_from("<IIQQQQI", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    for name, kind, _, _, offset, size, link in headers:
        start = names_at + name
        yield data[start:data.index(b"\0", start)].decode(), kind, offset, size, link


def elf_run_paths(data):
    """The RPATH and RUNPATH entries of a 64-bit little-endian ELF shared object (its bytes),
    as a list of directories."""
    sections = list(_elf_sections(data))
    found = []
    for _, kind, offset, size, link in sections:
        if kind != 6:                                   # SHT_DYNAMIC
            continue
        strings_offset = sections[link][2]
        for at in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag in (DT_RPATH, DT_RUNPATH):
                start = strings_offset + value
                found += data[start:data.index(b"\0", start)].decode().split(":")
    return found


def elf_debug_sections(data):
    """The names of an ELF shared object's debugging sections (.debug_*, DWARF)."""
    return [name for name, *_ in _elf_sections(data) if name.startswith(".debug")]


def test_elf_run_paths_reads_what_the_linker_wrote(tmp_path):
    """The readers above against libraries linked here: two run paths, none; with and without
    debugging information."""
    cc = c_compiler()
    if cc is None or not sys.platform.startswith("linux") or sys.maxsize < 2**32:
        pytest.skip("needs a C compiler making 64-bit ELF (Linux)")
    source = tmp_path / "f.c"
    source.write_text("int f(void) { return 1; }\n")
    for flags, want in ((["-Wl,-rpath,/opt/a:$ORIGIN/b"], ["/opt/a", "$ORIGIN/b"]), ([], [])):
        lib = tmp_path / "libf.so"
        subprocess.run([cc, "-shared", "-fPIC", str(source), "-o", str(lib), *flags], check=True)
        assert elf_run_paths(lib.read_bytes()) == want
    subprocess.run([cc, "-shared", "-fPIC", "-g", str(source), "-o", str(lib)], check=True)
    assert ".debug_info" in elf_debug_sections(lib.read_bytes())
    subprocess.run([cc, "-shared", "-fPIC", "-g0", str(source), "-o", str(lib)], check=True)
    assert elf_debug_sections(lib.read_bytes()) == []


def _forbidden_run_path(entry):
    """True for a run path into the interpreter that built the module or into a source or build
    tree: the directories a module picks up from the build machine."""
    if entry.startswith("$ORIGIN"):
        return False
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                sysconfig.get_config_var("LIBDIR") or sys.prefix, str(ROOT)}
    path = os.path.abspath(entry)
    return (any(path == p or path.startswith(p.rstrip(os.sep) + os.sep) for p in prefixes)
            or "/build/" in path + "/" or "/pip-" in path)


def test_extension_modules_carry_no_run_path_into_the_build_machine():
    """A pyenv or conda Python links with -Wl,-rpath,<its prefix>/lib (LDSHARED); setup.py
    drops it, so the modules under test (in place or installed) have no such run path."""
    if not (sys.platform.startswith("linux") and sys.maxsize > 2**32):
        pytest.skip("reads 64-bit ELF files (Linux)")
    for name in ("_plan", "_schedules", "_execute", "_engine", "_overlap", "_rules", "_dlpack",
                 "_arrays", "_directml", "_capi", "_half", "_relayout"):
        path = importlib.import_module(f"bnbw_native.{name}").__file__
        bad = [e for e in elf_run_paths(Path(path).read_bytes()) if _forbidden_run_path(e)]
        assert bad == [], (path, bad)


def test_the_build_record_says_which_run_paths_were_dropped():
    """What Python's configured link command would have put in the modules is recorded, so a
    build from a pyenv Python shows the fix working (an empty list from a system Python)."""
    record = bnbw_native._config._build_record()
    if record is None:
        pytest.skip("no build record (built by other means)")
    configured = shlex.split(sysconfig.get_config_var("LDSHARED") or "")
    asked = shlex.split(os.environ.get("LDFLAGS", ""))
    from_python = {w.split(",")[-1] for w in configured if w.startswith("-Wl,-rpath,")}
    from_python -= {w.split(",")[-1] for w in asked if w.startswith("-Wl,-rpath,")}
    assert from_python <= set(record.get("dropped_run_paths", [])), record


# ---- the release configuration --------------------------------------------------------------

@pytest.fixture(scope="module")
def cibuildwheel():
    try:
        import tomllib
    except ImportError:                          # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["cibuildwheel"]


def _override(config, selector):
    return next(o for o in config.get("overrides", []) if o["select"] == selector)


def test_cibuildwheel_builds_every_platform_the_release_promises(cibuildwheel, metadata):
    assert cibuildwheel["linux"]["archs"] == ["x86_64", "aarch64"]
    assert cibuildwheel["macos"]["archs"] == ["x86_64", "arm64"]
    assert cibuildwheel["windows"]["archs"] == ["AMD64"]
    for arch in ("x86_64", "aarch64"):
        assert cibuildwheel[f"manylinux-{arch}-image"] in ("manylinux_2_28", "manylinux2014")
    # exactly the CPython versions the classifiers name
    classifiers = metadata.get_all("Classifier") or []
    minors = sorted(c.rsplit(".", 1)[1] for c in classifiers
                    if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    built = sorted(re.fullmatch(r"cp3(\d+)-\*", b).group(1) for b in cibuildwheel["build"])
    assert built == minors


def test_cibuildwheel_requires_openmp_and_tests_every_wheel(cibuildwheel):
    """A wheel built serial must fail the release rather than ship; every wheel is tested by
    the smoke script .ci/wheel.sh uses (aarch64, under QEMU, by that alone)."""
    for platform in ("linux", "macos", "windows"):
        assert cibuildwheel[platform]["environment"]["BNBW_REQUIRE_OPENMP"] == "1"
    smoke = "python -I {project}/.ci/wheel_smoke.py --vendored-openmp"
    assert (ROOT / ".ci" / "wheel_smoke.py").is_file()
    assert cibuildwheel["test-command"][0] == smoke
    assert any(c.startswith("pytest {project}/tests") for c in cibuildwheel["test-command"])
    assert _override(cibuildwheel, "*-manylinux_aarch64")["test-command"] == smoke
    assert "--vendored-openmp" in (ROOT / ".ci" / "wheel.sh").read_text()


def test_cibuildwheel_macos_finds_libomp_the_way_the_probe_does(cibuildwheel):
    """Homebrew's libomp is keg-only: its -I/-L come through CPPFLAGS/LDFLAGS, which the probe
    reads as the build does, and Apple clang's spelling is one the probe tries."""
    setup_py = (ROOT / "setup.py").read_text()
    macos = cibuildwheel["macos"]
    assert "brew install libomp" in macos["before-all"]
    assert macos["environment"]["CPPFLAGS"] == "-I$(brew --prefix libomp)/include"
    assert macos["environment"]["LDFLAGS"] == "-L$(brew --prefix libomp)/lib"
    assert '["-Xpreprocessor", "-fopenmp", "-lomp"]' in setup_py
    assert '_environment_flags("CPPFLAGS", "CFLAGS")' in setup_py
    for arch in ("arm64", "x86_64"):
        target = _override(cibuildwheel, f"*-macosx_{arch}")["environment"]
        assert re.fullmatch(r"\d+\.0", target["MACOSX_DEPLOYMENT_TARGET"])


def test_ci_runs_the_wheel_stage_after_the_test_command():
    run = (ROOT / ".ci" / "run").read_text()
    assert run.index('pip install ".[test]" && pytest') < run.index("bash .ci/wheel.sh")
    stage = (ROOT / ".ci" / "wheel.sh").read_text()
    for step in ("pip wheel", "auditwheel repair", "readelf -d", "manylinux_", "bnbw-demo",
                 "-m venv", "c_extension/run.py"):
        assert step in stage, step


def test_linux_wheels_share_one_openmp_runtime_with_the_process(cibuildwheel):
    """auditwheel's repair, then the vendored libgomp back under its usual name: the release
    configuration and .ci/wheel.sh both run .ci/share_openmp.py on the repaired wheel, and the
    stage checks the name, the soname and the modules' NEEDED entries (two runtimes in one
    process fight for the cores: README, "Threads")."""
    command = cibuildwheel["linux"]["repair-wheel-command"]
    assert command.startswith("auditwheel repair -w {dest_dir} {wheel} && ")
    assert command.endswith("python {project}/.ci/share_openmp.py {dest_dir}")
    stage = (ROOT / ".ci" / "wheel.sh").read_text()
    assert stage.index("auditwheel\" repair") < stage.index(".ci/share_openmp.py")
    for check in ("SONAME.*", r"NEEDED.*\[libgomp\.so\.1\]", "libgomp.so.1 alone"):
        assert check in stage, check
    smoke = (ROOT / ".ci" / "wheel_smoke.py").read_text()
    assert "assert runtimes == 1 and b == 1" in smoke
