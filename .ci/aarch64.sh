#!/usr/bin/env bash
# The AArch64 stage: build bnbw_native for arm64 and run its default test selection under QEMU
# user-mode emulation, inside an arm64 Debian root file system made from scratch with Debian's
# own packages (qemu-user-static, binfmt-support, debootstrap).  Run as root on Debian:
#
#   bash .ci/aarch64.sh                                  # everything from scratch, then removed
#   BNBW_ARM_ROOT=/var/tmp/bnbw-arm bash .ci/aarch64.sh  # keep the root file system there and
#                                                        # reuse it on the next run
#   bash .ci/aarch64.sh -k kernel_bodies                  # extra arguments go to pytest
#
# Steps: register the emulator for arm64 binaries; debootstrap an arm64 system of this machine's
# Debian release from the mirror apt already uses (python3, python3-dev, python3-venv, gcc);
# a venv there with the test requirements from PyPI (NumPy and ml_dtypes ship arm64 wheels);
# an sdist of this tree there, a wheel built from it, installed; the NEON conversions checked
# against the portable ones (tests/engine/aarch64/conversions.c); show_config(); the tests, run
# against the installed wheel.  Every step is timed.
#
# Left out of the selection, both run in the native stage:
# * tests/engine/test_memory.py::test_no_leak_over_10000_calls, whose Python-block meter is a
#   heuristic that emulation has tipped over once with no growth in glibc's heap or
#   tracemalloc's windows; it checks Python-level bookkeeping, not the kernels.
# * tests/surfaces/test_hostile_inputs.py::test_out_of_memory_for_a_temporary_*: they cap the
#   address space with RLIMIT_AS, which QEMU's user mode accepts and does not apply (the
#   emulator's own mappings live in the same process), so the capped calls succeed.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
t0=$(date +%s)
step() { echo "aarch64: [$(( $(date +%s) - t0 )) s] $*"; }

# ---- host packages ----------------------------------------------------------------------------
missing=()
for pkg in qemu-user-static binfmt-support debootstrap; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    step "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# ---- the emulator for arm64 executables (binfmt_misc, with the interpreter opened at
# registration - flag F - so that it runs inside the chroot too) ------------------------------
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
fi
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    update-binfmts --enable qemu-aarch64 || update-binfmts --import qemu-aarch64
fi
grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64
grep -q '^flags:.*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 || {
    echo "aarch64: the qemu-aarch64 binfmt entry lacks the F flag (needed inside a chroot)" >&2
    exit 2
}

# ---- the root file system ---------------------------------------------------------------------
if [ -n "${BNBW_ARM_ROOT:-}" ]; then
    work="$BNBW_ARM_ROOT"
    keep=1
    mkdir -p "$work"
else
    work="$(mktemp -d "${TMPDIR:-/var/tmp}/bnbw-arm.XXXXXX")"
    keep=0
fi
rootfs="$work/rootfs"
cleanup() {
    for m in "$rootfs/proc" "$rootfs/dev"; do
        mountpoint -q "$m" 2>/dev/null && umount -l "$m" || true
    done
    [ "$keep" = 1 ] || rm -rf "$work"
}
trap cleanup EXIT

# This machine's release and the mirror apt uses for it (deb822 .sources or one-line .list).
. /etc/os-release
suite="${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}"
apt_mirror() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -e "$f" ] || continue
        awk -v suite="$suite" '
            /^[[:space:]]*$/ { if (uri != "" && ok) exit; uri = ""; ok = 0; next }
            tolower($1) == "uris:" { uri = $2 }
            tolower($1) == "suites:" { for (i = 2; i <= NF; i++) if ($i == suite) ok = 1 }
            END { if (uri != "" && ok) print uri }' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -e "$f" ] || continue
        awk -v suite="$suite" '$1 == "deb" {
            for (i = 2; i < NF; i++) if ($i !~ /^\[/ && $(i + 1) == suite) { print $i; exit } }' "$f"
    done
}
mirror="$(apt_mirror | head -n 1 || true)"
[ -n "$mirror" ] || { echo "aarch64: no apt source for $suite found" >&2; exit 2; }

if [ ! -e "$rootfs/.bnbw-ready" ]; then
    rm -rf "$rootfs"
    step "debootstrap arm64 $suite"
    debootstrap --arch=arm64 --variant=minbase \
        --include=python3,python3-dev,python3-venv,gcc,libc6-dev,ca-certificates \
        "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || {
        tail -30 "$work/debootstrap.log" >&2
        exit 2
    }
    touch "$rootfs/.bnbw-ready"
fi
mountpoint -q "$rootfs/proc" || mount -t proc proc "$rootfs/proc"
mountpoint -q "$rootfs/dev" || mount --bind /dev "$rootfs/dev"
# name resolution, and the certificates this host trusts (a TLS-inspecting proxy's included)
cp -L /etc/resolv.conf "$rootfs/etc/resolv.conf"
cp -L /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"

# Commands inside: a clean environment, pip told of the host's certificates and index.
inside() {
    local env=(PATH=/venv/bin:/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8
               PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1
               PIP_DEFAULT_TIMEOUT=180 CI="${CI:-}")
    [ -n "${PIP_INDEX_URL:-}" ] && env+=(PIP_INDEX_URL="$PIP_INDEX_URL")
    chroot "$rootfs" /usr/bin/env -i "${env[@]}" /bin/sh -c "$1"
}

if [ ! -x "$rootfs/venv/bin/python" ]; then
    step "venv and test requirements from PyPI"
    inside "python3 -m venv /venv && pip install --quiet numpy ml_dtypes 'Cython>=3.0' \
            'setuptools>=77' wheel pytest hypothesis threadpoolctl"
fi

# ---- this tree, without build products (as .ci/sanitizers.sh copies it) ----------------------
rm -rf "$rootfs/src" "$rootfs/dist"
mkdir -p "$rootfs/src"
tar -C "$root" --exclude=./build --exclude=./dist --exclude='*.so' --exclude='./bnbw_native/_*.c' \
    --exclude=./bnbw_native/_build_info.py --exclude=.git --exclude=.hypothesis \
    --exclude=__pycache__ --exclude=.pytest_cache --exclude='./venv*' -cf - . |
    tar -C "$rootfs/src" -xf -

step "an sdist of the tree, a wheel built from the sdist (arm64 gcc, emulated), installed"
inside "mkdir -p /dist && cd /src && python -c 'import sys; from setuptools import build_meta; \
        build_meta.build_sdist(sys.argv[1])' /dist >/dev/null \
        && BNBW_REQUIRE_OPENMP=1 pip wheel --quiet --no-deps --no-build-isolation -w /dist \
           /dist/bnbw_native-*.tar.gz \
        && pip install --quiet --force-reinstall --no-deps /dist/bnbw_native-*.whl && ls /dist"

step "NEON conversions against the portable ones"
inside "cd /src && gcc -O2 -std=c11 -Isrc tests/engine/aarch64/conversions.c -o /tmp/conversions \
        && /tmp/conversions"

step "show_config"
inside "cd /tmp && python -c 'import bnbw_native; bnbw_native.show_config()'"

step "the default test selection"
status=0
inside "cd /src && pytest -q -p no:cacheprovider --junitxml=/tmp/junit.xml \
        --deselect tests/engine/test_memory.py::test_no_leak_over_10000_calls \
        --deselect tests/surfaces/test_hostile_inputs.py::test_out_of_memory_for_a_temporary \
        $*" || status=$?
inside "python3 - <<'EOF'
import xml.etree.ElementTree as ET
cases = [c for c in ET.parse('/tmp/junit.xml').iter('testcase')
         if c.get('classname', '').startswith('tests.engine.test_digests')]
bad = [c.get('name') for c in cases if c.find('failure') is not None or c.find('error') is not None]
skipped = [c.get('name') for c in cases if c.find('skipped') is not None]
print(f'aarch64: tests/engine/test_digests.py: {len(cases)} run, {len(cases) - len(bad) - len(skipped)} passed, '
      f'{len(skipped)} skipped, failed: {bad or None}')
EOF"
step "done, pytest status $status"
exit "$status"
