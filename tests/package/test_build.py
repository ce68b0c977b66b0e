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

COMPILED = ("_plan", "_schedules", "_engine", "_rules", "_arrays", "_directml", "_capi",
            "_half")


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
        assert plain == (["-fopenmp"], "")


def test_openmp_probe_failure_is_recorded(setup_py, monkeypatch):
    monkeypatch.delenv("BNBW_REQUIRE_OPENMP", raising=False)
    monkeypatch.setenv("CC", "no-such-compiler-bnbw -pipe")
    with pytest.warns(UserWarning, match="no-such-compiler-bnbw -pipe cannot build"):
        flags, note = setup_py["openmp_flags"]()
    assert flags == [] and "no-such-compiler-bnbw -pipe" in note


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
