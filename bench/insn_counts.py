"""Instructions executed per element by each kernel, NEON against AVX2, counted under QEMU.

    python bench/insn_counts.py [--kernels reduce_row,apply_rows] [--markdown]

bench/insn_driver.c makes one kernel call; it is built statically twice from the project's
sources and flags (gcc for x86-64, aarch64-linux-gnu-gcc for AArch64) and run under QEMU
user-mode emulation (qemu-x86_64-static -cpu max, which has AVX2, FMA and F16C but not AVX-512;
qemu-aarch64-static) with QEMU's execution log (-d in_asm,exec,nochain): every translated block
is listed once with its instructions and logged each time it runs, so the log gives the exact
number of guest instructions executed.  Each case runs at two sizes and the difference, divided
by the difference in elements, is the cost per element of the kernel's loops, free of the
program's start-up and of each call's fixed cost.  These are counts, not timings: emulation
says nothing about speed on real hardware.

Debian packages: gcc, gcc-aarch64-linux-gnu, qemu-user-static.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-Wno-unused-function",
         "-g0", "-static"]        # setup.py's compile_flags, static for qemu-user
SOURCES = ["bench/insn_driver.c"] + [f"src/body_{name}.c" for name in
                                      ("choice", "portable", "avx2", "avx512", "neon")]
TARGETS = {   # name: (compiler, emulator, body level)
    "AVX2": ("gcc", ["qemu-x86_64-static", "-cpu", "max"], 1),
    "NEON": ("aarch64-linux-gnu-gcc", ["qemu-aarch64-static"], 1),
}
CHANNELS = 256                    # insn_driver.c's channel-last rows
# (kernel, dtype, sums): the reductions in the modes the engine uses (f32: exact; halves: exact
# with exact_sums=True, blocks otherwise, bf16's blocks in even/odd order), then the
# elementwise kernels
CASES = ([("reduce_row", "f32", "exact"), ("reduce_row", "f16", "exact"),
          ("reduce_row", "f16", "blocks"), ("reduce_row", "bf16", "exact"),
          ("reduce_row", "bf16", "even_odd")]
         + [(k.replace("_row", "_rows"), d, s) for k, d, s in
            [("reduce_row", "f32", "exact"), ("reduce_row", "f16", "exact"),
             ("reduce_row", "f16", "blocks"), ("reduce_row", "bf16", "exact"),
             ("reduce_row", "bf16", "even_odd")]]
         + [(k, d, "-") for k in ("apply_row", "scale_row", "apply_rows", "scale_rows")
            for d in ("f32", "f16", "bf16")])
# two sizes per case: elements of one row, or rows of CHANNELS channels (whole blocks of 16)
SIZES = {False: (4096, 8192), True: (64, 128)}

TRACE = re.compile(r"^Trace \d+: 0x[0-9a-f]+ \[[0-9a-f]+/([0-9a-f]+)/")
INSN = re.compile(r"^0x([0-9a-f]+):\s")


def build(target, out):
    compiler = TARGETS[target][0]
    subprocess.run([compiler, *FLAGS, "-Isrc", *SOURCES, "-lm", "-o", out], cwd=ROOT,
                   check=True)


def executed(target, exe, args, log):
    """Guest instructions the program executed, from QEMU's log: each "IN:" block lists a
    translated block's instructions (the first one's address names the block), each "Trace"
    line is one run of a block."""
    emulator = TARGETS[target][1]
    subprocess.run([*emulator, "-d", "in_asm,exec,nochain", "-D", log, exe, *args],
                   check=True, stdout=subprocess.DEVNULL)
    size_of, total = {}, 0
    listing, start = False, None
    with open(log, errors="replace") as f:
        for line in f:
            if listing:
                m = INSN.match(line)
                if m:
                    if start is None:
                        start = int(m.group(1), 16)
                        size_of[start] = 0
                    size_of[start] += 1
                    continue
                if not line.strip():
                    listing = False
                continue
            if line.startswith("IN:"):
                listing, start = True, None
                continue
            m = TRACE.match(line)
            if m:
                total += size_of[int(m.group(1), 16)]
    os.unlink(log)
    return total


def per_element(target, exe, case, tmp):
    kernel, dtype, sums = case
    rows = kernel.endswith("_rows")
    small, big = SIZES[rows]
    level = str(TARGETS[target][2])
    counts = [executed(target, exe, [kernel, dtype, "exact" if sums == "-" else sums,
                                     str(size), level], os.path.join(tmp, "qemu.log"))
              for size in (small, big)]
    elements = (big - small) * (CHANNELS if rows else 1)
    return (counts[1] - counts[0]) / elements


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", help="comma list of kernels (default: all)")
    parser.add_argument("--markdown", action="store_true", help="a Markdown table")
    args = parser.parse_args(argv)
    cases = CASES
    if args.kernels:
        wanted = set(args.kernels.split(","))
        cases = [c for c in CASES if c[0] in wanted]
    with tempfile.TemporaryDirectory() as tmp:
        exes = {}
        for target in TARGETS:
            exes[target] = os.path.join(tmp, f"driver-{target}")
            build(target, exes[target])
        header = ("kernel", "dtype", "sums", "AVX2/elem", "NEON/elem", "NEON/AVX2")
        if args.markdown:
            print("| " + " | ".join(header) + " |")
            print("|" + "|".join(["---"] * 3 + ["---:"] * 3) + "|")
        else:
            print(f"{header[0]:<12} {header[1]:<5} {header[2]:<9} {header[3]:>10} "
                  f"{header[4]:>10} {header[5]:>10}")
        for case in cases:
            avx2 = per_element("AVX2", exes["AVX2"], case, tmp)
            neon = per_element("NEON", exes["NEON"], case, tmp)
            kernel, dtype, sums = case
            if args.markdown:
                print(f"| {kernel} | {dtype} | {sums} | {avx2:.3f} | {neon:.3f} | "
                      f"{neon / avx2:.2f} |")
            else:
                print(f"{kernel:<12} {dtype:<5} {sums:<9} {avx2:10.3f} {neon:10.3f} "
                      f"{neon / avx2:10.2f}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
