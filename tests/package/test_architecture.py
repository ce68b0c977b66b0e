"""docs/architecture.md's table of rooms is the code's: for every module of the package, the
modules its "who calls it" column names are exactly those that import or cimport it (the
package's own __init__, which re-exports and loads submodules lazily, aside).  The map cannot
drift from the code again without this test failing."""
import re

from cext import ROOT

PACKAGE = ROOT / "bnbw_native"
DOC = (ROOT / "docs" / "architecture.md").read_text()
IMPORT = re.compile(r"^\s*(?:from\s+(bnbw_native(?:\.\w+)*|\.\w*)\s+c?import\s+(\([^)]*\)|[^\n]+)"
                    r"|c?import\s+bnbw_native\.(\w+))", re.M)


def modules():
    """{module name: its source files} (.py, .pyx and .pxd; .pyi stubs are not code)."""
    found = {}
    for path in PACKAGE.iterdir():
        if path.suffix in (".py", ".pyx", ".pxd"):
            found.setdefault(path.stem, []).append(path)
    return found


def callers():
    """{module: the package modules that import or cimport it}."""
    found = modules()
    calls = {name: set() for name in found}
    for name, paths in found.items():
        for path in paths:
            for source, names, direct in IMPORT.findall(path.read_text()):
                if direct:
                    targets = [direct]
                elif source in (".", "bnbw_native"):          # from . import a, b
                    targets = re.findall(r"\w+", names)
                else:
                    targets = [source.lstrip(".").replace("bnbw_native.", "", 1).split(".")[0]]
                for target in targets:
                    if target in calls and target != name:
                        calls[target].add(name)
    return calls


def documented():
    """{module: the package modules its row's "who calls it" column names}."""
    rows = {}
    for line in DOC.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3:
            continue
        named = re.findall(r"`bnbw_native/(\w+)\.(?:pyx|py|pxd)`", cells[0])
        if not named:
            continue
        listed = {re.sub(r"\.(py|pyx|pxd)$", "", t) for t in re.findall(r"`([\w.]+)`", cells[2])}
        for name in named:
            rows[name] = listed
    return rows


def test_every_module_has_a_row():
    missing = sorted(set(modules()) - set(documented()) - {"__init__", "_build_info"})
    assert missing == []


def test_who_calls_each_module_is_what_the_code_imports():
    calls, rows, known = callers(), documented(), set(modules())
    wrong = {}
    for name, listed in rows.items():
        want = calls.get(name, set()) - {"__init__"}
        got = listed & known - {"__init__"}
        if got != want:
            wrong[name] = {"documented, not in the code": sorted(got - want),
                           "in the code, not documented": sorted(want - got)}
    assert wrong == {}
