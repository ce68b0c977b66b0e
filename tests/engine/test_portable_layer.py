"""The portable vector layer against its scalar definitions, in C.

src/bnbw_simd_portable.h defines the bits every kernel body gives.  tests/engine/portable/check_layer.c
checks its operations lane by lane against what they stand for: vf_fma against libm's fmaf
(near-midpoint sums built to defeat double rounding, cancellations, subnormal results,
overflow, infinities, NaNs, signed zeros, random operands), the half loads and stores against
bnbw_half.h's scalar functions (every 16-bit pattern; f32 patterns around every rounding point),
masks and folds against their scalar meaning.  It is built here with the package's flags in
every form the layer takes on this machine: GNU C vectors, the plain C fallback
(BNBW_PORTABLE_SCALAR), and the fmaf emulation forced where the target has an FMA instruction
(BNBW_PORTABLE_EMULATED_FMA); and, where a cross compiler and qemu-user are installed, for
other targets (little- and big-endian).  The checker prints the first differences it meets.
"""
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig

import pytest

from cext import ROOT

SOURCE = ROOT / "tests" / "engine" / "portable" / "check_layer.c"
FLAGS = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wextra"]

# the C compiler as a command line, read as setup.py reads it ($CC may be "ccache gcc")
CC = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
pytestmark = pytest.mark.skipif(
    shutil.which(CC[0]) is None or not SOURCE.exists() or not (ROOT / "src").is_dir(),
    reason="needs a C compiler and the source tree (src/, tests/engine/portable/)")

VARIANTS = {
    "vectors": [],
    "plain-c": ["-DBNBW_PORTABLE_SCALAR"],
    "emulated-fma": ["-DBNBW_PORTABLE_EMULATED_FMA"],
}


def build(tmp_path, cc, extra, name="check_layer"):
    """check_layer.c compiled by the command `cc` with the package's flags and `extra`."""
    exe = tmp_path / name
    done = subprocess.run([*cc, *FLAGS, *extra, "-I", str(ROOT / "src"), str(SOURCE), "-o",
                           str(exe), "-lm"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"check_layer.c does not build with {extra}:\n{done.stderr}"
    return exe


def run(command, timeout=600):
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("all equal"), (
        f"{' '.join(map(str, command))} found differences:\n{done.stdout}{done.stderr}")
    return done.stdout


@pytest.mark.parametrize("variant", VARIANTS)
def test_layer_gives_the_scalar_bits(tmp_path, variant):
    out = run([build(tmp_path, CC, VARIANTS[variant])])
    first = out.splitlines()[0]
    # the variant is the layer that was built (a compiler without GNU C vectors gets plain C)
    if variant == "plain-c":
        assert "plain C" in first
    if variant == "emulated-fma":
        assert "fma: emulated" in first
    assert "vf_fma and v__fmaf_exact against fmaf" in out and "v_store bf16" in out


def test_native_target_has_the_vector_layer(tmp_path):
    """GCC and Clang get the GNU C vector layer, not the plain C fallback, on this machine;
    on the x86-64 baseline (no FMA instruction) the fmaf emulation."""
    out = run([build(tmp_path, CC, [])])
    program = [word for word in CC if not word.startswith("-")]
    version = subprocess.run([*program, "--version"], capture_output=True, text=True).stdout
    if "gcc" in version.lower() or "clang" in version.lower():
        assert out.startswith("layer: GNU C vectors")
    if platform.machine() in ("x86_64", "AMD64"):
        assert "fma: emulated" in out.splitlines()[0]


@pytest.mark.slow
def test_every_f32_pattern_rounds_to_halves_as_the_scalar_functions(tmp_path):
    """All 2^32 f32 patterns stored as f16 and bf16 through the vector layer (~1 minute)."""
    run([build(tmp_path, CC, []), "--exhaustive"], timeout=3600)


CROSS = [  # (target triple, qemu-user program, extra flags)
    ("aarch64-linux-gnu", "qemu-aarch64", []),                 # NEON, FMA instruction
    ("s390x-linux-gnu", "qemu-s390x", ["-march=z13"]),         # big-endian, z vector facility
    ("powerpc64le-linux-gnu", "qemu-ppc64le", []),             # VSX
    ("riscv64-linux-gnu", "qemu-riscv64", []),                 # no vector unit: scalar lowering
]


@pytest.mark.parametrize("triple,qemu,flags", CROSS, ids=[c[0] for c in CROSS])
@pytest.mark.parametrize("variant", VARIANTS)
def test_other_targets_give_the_scalar_bits(tmp_path, triple, qemu, flags, variant):
    """The same checks built for another target and run under qemu-user (Debian's
    gcc-<triple> and qemu-user packages)."""
    cc = shutil.which(f"{triple}-gcc")
    if cc is None or shutil.which(qemu) is None:
        pytest.skip(f"no {triple}-gcc or {qemu} on this machine")
    exe = build(tmp_path, [cc, "-static", *flags], VARIANTS[variant], name=f"check_{triple}")
    out = run([qemu, str(exe)], timeout=1200)
    if triple.startswith("s390x"):
        assert "big-endian" in out.splitlines()[0]
