"""The build: setup.py's OpenMP probe reads $CC as the build does, the extension modules carry
no debug info, and show_config() describes the build (its compiler, not the interpreter's)."""
import runpy
import shlex
import struct
import sys
import sysconfig
from pathlib import Path

import pytest

import bnbw_native
from bnbw_native import _config, _engine
from cext import ROOT, c_compiler

COMPILED = ("_plan", "_schedules", "_execute", "_engine", "_overlap", "_rules", "_dlpack",
            "_arrays", "_directml", "_capi", "_half", "_relayout")


@pytest.fixture(scope="module")
def setup_py():
    """setup.py's functions, loaded without running setup()."""
    return runpy.run_path(str(ROOT / "setup.py"), run_name="bnbw_setup")


def test_compiler_command_is_a_command_line(setup_py, monkeypatch):
    monkeypatch.setenv("CC", "ccache '/opt/my tools/gcc' -pipe")
    assert setup_py["compiler_command"]() == ["ccache", "/opt/my tools/gcc", "-pipe"]
    monkeypatch.delenv("CC")
    assert setup_py["compiler_command"]() == shlex.split(sysconfig.get_config_var("CC") or "cc")


def test_openmp_probe_takes_cc_with_flags(setup_py, monkeypatch):
    """CC="gcc -pipe" builds with OpenMP exactly when CC="gcc" does; it used to look for a
    program called "gcc -pipe" and build serial without a word (pip hides the warning)."""
    cc = c_compiler()
    if cc is None:
        pytest.skip("no C compiler found")
    monkeypatch.delenv("BNBW_DISABLE_OPENMP", raising=False)
    monkeypatch.delenv("BNBW_REQUIRE_OPENMP", raising=False)
    monkeypatch.setenv("CC", cc)
    plain = setup_py["openmp_flags"]()
    monkeypatch.setenv("CC", f"{cc} -pipe")
    assert setup_py["openmp_flags"]() == plain
    if _engine.build_info()["openmp"]:          # this very compiler built an OpenMP package
        # -fopenmp, or Apple clang's -Xpreprocessor -fopenmp -lomp
        assert plain[0] in [list(f) for f in setup_py["OPENMP_CANDIDATES"]["unix"]]
        assert plain[1] == ""


def test_openmp_probe_failure_is_recorded(setup_py, monkeypatch):
    monkeypatch.delenv("BNBW_REQUIRE_OPENMP", raising=False)
    monkeypatch.setenv("CC", "no-such-compiler-bnbw -pipe")
    with pytest.warns(UserWarning, match="no-such-compiler-bnbw -pipe cannot build"):
        flags, note = setup_py["openmp_flags"]()
    assert flags == [] and "no-such-compiler-bnbw -pipe" in note


def test_openmp_spellings_split_into_compile_and_link_flags(setup_py):
    """Apple clang's spelling: -Xpreprocessor -fopenmp compiles, -lomp links; a bare -fopenmp
    does both (GCC needs it at link time to pull in libgomp)."""
    split = setup_py["split_openmp_flags"]
    assert split(["-fopenmp"]) == (["-fopenmp"], ["-fopenmp"])
    assert split(["-Xpreprocessor", "-fopenmp", "-lomp"]) == (["-Xpreprocessor", "-fopenmp"],
                                                              ["-lomp"])
    assert split(["/openmp"], "msvc") == (["/openmp"], [])
    assert split([]) == ([], [])
    # every spelling the probe may pick compiles with something and links with something
    for flags in setup_py["OPENMP_CANDIDATES"]["unix"]:
        compile_only, link_only = split(flags)
        assert compile_only and link_only


def test_openmp_probe_reads_the_flags_the_build_reads(setup_py, monkeypatch):
    """$CFLAGS / $LDFLAGS reach the probe as they reach the build (e.g. -I/-L of a libomp
    outside the compiler's paths): a $CFLAGS that breaks every compile turns OpenMP off."""
    cc = c_compiler()
    if cc is None or not _engine.build_info()["openmp"]:
        pytest.skip("needs a compiler that builds OpenMP programs")
    monkeypatch.delenv("BNBW_REQUIRE_OPENMP", raising=False)
    monkeypatch.delenv("BNBW_DISABLE_OPENMP", raising=False)
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("CFLAGS", "-DBNBW_PROBE_MARK=1 -include no-such-header-bnbw.h")
    with pytest.warns(UserWarning, match="cannot build and run an OpenMP program"):
        assert setup_py["openmp_flags"]()[0] == []
    monkeypatch.setenv("CFLAGS", "-DBNBW_PROBE_MARK=1")
    flags, note = setup_py["openmp_flags"]()
    assert "-fopenmp" in flags and note == ""


def test_msvc_gets_its_own_flags(setup_py, monkeypatch):
    """MSVC would reject GCC's spellings: its list holds only /-options, with the intent kept
    (optimised, C11, precise floating point that contracts nothing)."""
    monkeypatch.delenv("BNBW_EXTRA_CFLAGS", raising=False)
    monkeypatch.setenv("BNBW_NATIVE_ARCH", "1")                 # GCC-only: not passed to MSVC
    msvc = setup_py["compile_flags"]("msvc")
    assert msvc == ["/O2", "/std:c11", "/fp:precise"]
    unix = setup_py["compile_flags"]("unix")
    assert {"-O3", "-std=c11", "-ffp-contract=off", "-g0", "-march=native"} <= set(unix)
    assert setup_py["OPENMP_CANDIDATES"]["msvc"] == (["/openmp"],)


PYENV_LDSHARED = ("gcc -shared -L/opt/py/lib -Wl,-rpath,/opt/py/lib -L/opt/py/lib "
                  "-Wl,-rpath,/opt/py/lib")
CONDA_LDSHARED = ("gcc -pthread -shared -Wl,-O2 -Wl,--sort-common -Wl,--as-needed "
                  "-Wl,--disable-new-dtags -Wl,-rpath,/opt/conda/lib "
                  "-Wl,-rpath-link,/opt/conda/lib -L/opt/conda/lib")


@pytest.mark.parametrize("command, want, dropped", [
    (PYENV_LDSHARED, "gcc -shared -L/opt/py/lib -L/opt/py/lib", ["/opt/py/lib"] * 2),
    (CONDA_LDSHARED, "gcc -pthread -shared -Wl,-O2 -Wl,--sort-common -Wl,--as-needed "
                     "-Wl,--disable-new-dtags -Wl,-rpath-link,/opt/conda/lib -L/opt/conda/lib",
     ["/opt/conda/lib"]),
    ("cc -shared -Wl,-O1,-rpath,/a:/b,--as-needed", "cc -shared -Wl,-O1,--as-needed", ["/a", "/b"]),
    ("cc -shared -Wl,-rpath -Wl,/a -Wl,--rpath=/b", "cc -shared", ["/a", "/b"]),
    ("cc -shared -Xlinker -rpath -Xlinker /a -Xlinker --no-undefined",
     "cc -shared -Xlinker --no-undefined", ["/a"]),
    ("gcc -pthread -shared", "gcc -pthread -shared", []),           # Debian's own python3
])
def test_run_paths_are_stripped_from_the_link_command(setup_py, command, want, dropped):
    """The run paths a pyenv or conda Python configured into its link command (RUNPATH into
    the build machine's interpreter, in every module) go; other linker options stay."""
    got, gone = setup_py["strip_run_paths"](shlex.split(command))
    assert (shlex.join(got), gone) == (want, dropped)


def test_run_paths_the_builder_asks_for_stay(setup_py, monkeypatch):
    monkeypatch.delenv("LDSHARED", raising=False)
    monkeypatch.setenv("LDFLAGS", "-L/opt/omp/lib -Wl,-rpath,/opt/omp/lib")
    command = shlex.split(PYENV_LDSHARED) + ["-L/opt/omp/lib", "-Wl,-rpath,/opt/omp/lib"]
    got, gone = setup_py["without_interpreter_run_paths"](command)
    assert got == ["gcc", "-shared", "-L/opt/py/lib", "-L/opt/py/lib", "-L/opt/omp/lib",
                   "-Wl,-rpath,/opt/omp/lib"]
    assert gone == ["/opt/py/lib"] * 2


def _elf_section_names(path):
    """The section names of a 64-bit little-endian ELF file."""
    data = Path(path).read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, path
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i):
        # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size
        return struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)

    _, _, _, _, str_off, str_size = section(shstrndx)
    strings = data[str_off:str_off + str_size]
    return [strings[n:strings.index(b"\0", n)].decode() for n, *_ in map(section, range(shnum))]


def test_extension_modules_carry_no_debug_info():
    """Python's CFLAGS say -g; the wheel would carry several MB of DWARF."""
    import importlib
    paths = [importlib.import_module(f"bnbw_native.{name}").__file__ for name in COMPILED]
    if not (sys.platform.startswith("linux") and sys.maxsize > 2**32):
        pytest.skip("the section check reads 64-bit ELF files (Linux)")
    from bnbw_native import _build_info
    debug_flags = [f for f in _build_info.BUILD["extension_flags"] if f.startswith("-g")]
    if debug_flags and debug_flags[-1] != "-g0":
        pytest.skip(f"this build asked for debug info ({debug_flags[-1]} in BNBW_EXTRA_CFLAGS, "
                    "e.g. the sanitizer build)")
    for path in paths:
        debug = [s for s in _elf_section_names(path) if s.startswith((".debug", ".zdebug"))]
        assert debug == [], (path, debug)


# ---- show_config ---------------------------------------------------------------------------

def test_the_build_left_its_record():
    record = _config._build_record()
    assert record is not None, "setup.py writes bnbw_native/_build_info.py beside the modules"
    assert set(record) >= {"compiler", "compile_command", "extension_flags", "openmp_flags"}
    assert ("-fopenmp" in record["openmp_flags"]) == bool(_engine.build_info()["openmp"])
    assert record["compile_command"] and "-g0" in record["extension_flags"]


FAKE = {"compiler": "fakecc 9.9.9 (the build's)", "compile_command": ["fakecc", "-pipe"],
        "extension_flags": ["-O3", "-g0"], "openmp_flags": [], "openmp_note": "",
        "python": "3.99.0", "platform": "fake-x86_64"}


def test_show_config_names_the_compiler_that_built_the_package(monkeypatch, capsys):
    monkeypatch.setattr(_config, "_build_record", lambda: dict(FAKE))
    bnbw_native.show_config()
    lines = capsys.readouterr().out.splitlines()
    assert "compiler:         fakecc 9.9.9 (the build's)" in lines
    assert "compile command:  fakecc -pipe -O3 -g0" in lines
    facts = bnbw_native.show_config(mode="dicts")
    assert facts["build"]["compiler"] == FAKE["compiler"]
    assert facts["build"]["compile_command"] == ["fakecc", "-pipe"]


def test_show_config_without_a_record_says_so(monkeypatch, capsys):
    monkeypatch.setattr(_config, "_build_record", lambda: None)
    bnbw_native.show_config()
    out = capsys.readouterr().out
    assert "compiler:         unknown" in out
    assert str(sysconfig.get_config_var("CC")) not in out.split("compiler:")[1].splitlines()[0]


def test_show_config_dicts_hold_what_it_prints(capsys):
    facts = bnbw_native.show_config(mode="dicts")
    assert capsys.readouterr().out == ""
    info = _engine.build_info()
    assert facts["version"] == bnbw_native.__version__
    assert facts["openmp"]["enabled"] == bool(info["openmp"])
    assert facts["kernels"]["in_use"] == info["kernels"] == _config.kernel_body()
    assert facts["kernels"]["cpu"] == info["cpu_kernels"]
    assert facts["threads"]["current"] == bnbw_native.get_num_threads()
    assert facts["half_conversion"] == info["half_path"]
    bnbw_native.show_config()
    printed = capsys.readouterr().out
    assert f"kernels:          {facts['kernels']['in_use']} " in printed
    assert facts["build"]["compiler"] in printed
