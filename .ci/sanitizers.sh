#!/usr/bin/env bash
# Build the extensions with AddressSanitizer + UndefinedBehaviorSanitizer in a throwaway copy of
# the working tree, run the test suite against that build, and fail on any sanitizer report.
#
#   .ci/sanitizers.sh                 # the default test selection (not slow)
#   BNBW_SAN_SLOW=1 .ci/sanitizers.sh # the slow sweeps as well
#   .ci/sanitizers.sh -k dml          # extra arguments go to pytest
#
# CPython itself is not instrumented, so the ASan runtime is preloaded (LD_PRELOAD) and leak
# detection is off (the interpreter keeps its own objects until exit).  PYTHONMALLOC=malloc routes
# Python objects through malloc, so a kernel writing past an array into a neighbouring Python
# object is caught too.  Every report also goes to a log file (child processes of the tests,
# forked or spawned, included); any such file fails the run.  tests/engine/test_memory.py is left out:
# ASan's allocator and quarantine make RSS, mallinfo and peak figures meaningless.
#
# The virtual environment sees the system's packages (numpy, Cython, pytest, hypothesis,
# ml_dtypes, threadpoolctl); set BNBW_SAN_ISOLATED=1 to install them from the index instead.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/bnbw-san.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cc="${CC:-gcc}"

asan_runtime="$("$cc" -print-file-name=libasan.so)"
if [ ! -e "$asan_runtime" ]; then
    echo "sanitizers: $cc has no ASan runtime (libasan.so); install it (Debian: libasan8)" >&2
    exit 2
fi

# ---- a throwaway copy, without any build products of the working tree ----
mkdir -p "$work/src"
tar -C "$root" --exclude=./build --exclude='*.so' --exclude='./bnbw_native/_*.c' \
    --exclude=.git --exclude=.hypothesis --exclude=__pycache__ --exclude=.pytest_cache \
    --exclude='./venv*' -cf - . | tar -C "$work/src" -xf -

python="${PYTHON:-python3}"
if [ "${BNBW_SAN_ISOLATED:-0}" = "1" ]; then
    "$python" -m venv "$work/venv"
    "$work/venv/bin/python" -m pip install --quiet --upgrade pip
    "$work/venv/bin/python" -m pip install --quiet "setuptools>=77" wheel "Cython>=3.0" numpy \
        pytest hypothesis ml_dtypes threadpoolctl
else
    # no pip of its own: the venv's bundled setuptools would shadow the system's newer one
    "$python" -m venv --system-site-packages --without-pip "$work/venv"
fi
py="$work/venv/bin/python"

# ---- the instrumented build ----
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1"
start=$(date +%s)
(cd "$work/src" && CC="$cc" BNBW_EXTRA_CFLAGS="$flags" BNBW_REQUIRE_OPENMP=1 \
    "$py" setup.py build_ext --inplace >"$work/build.log" 2>&1) || {
    tail -40 "$work/build.log" >&2
    echo "sanitizers: the instrumented build failed" >&2
    exit 2
}
if ! nm -D "$work"/src/bnbw_native/_engine*.so 2>/dev/null | grep __asan_report >/dev/null; then
    echo "sanitizers: the build is not instrumented (BNBW_EXTRA_CFLAGS ignored?)" >&2
    exit 2
fi
echo "sanitizers: instrumented build in $(( $(date +%s) - start )) s"

# ---- the run ----
mkdir -p "$work/reports"
selection=(-m "not slow")
[ "${BNBW_SAN_SLOW:-0}" = "1" ] && selection=(-m "slow or not slow")   # overrides addopts
start=$(date +%s)
status=0
(
    cd "$work/src"
    export LD_PRELOAD="$asan_runtime"
    export PYTHONMALLOC=malloc
    export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:allocator_may_return_null=1:detect_odr_violation=0:log_path=$work/reports/asan"
    export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$work/reports/ubsan"
    export PYTHONPATH="$work/src"
    "$py" -m pytest -q -p no:cacheprovider "${selection[@]}" \
        --ignore=tests/engine/test_memory.py tests "$@"
) || status=$?
echo "sanitizers: tests ran in $(( $(date +%s) - start )) s, pytest status $status"

# A report is an ASan "ERROR:" or a UBSan "runtime error:"; warnings (e.g. an allocation the
# tests make too big on purpose, returned as NULL by allocator_may_return_null) are shown only.
found=0
for log in "$work"/reports/*; do
    [ -e "$log" ] || continue
    if grep -Eq "ERROR: AddressSanitizer|runtime error:|ERROR: UndefinedBehaviorSanitizer" "$log"
    then
        echo "==== $(basename "$log")" >&2
        cat "$log" >&2
        found=$((found + 1))
    else
        echo "sanitizers: warnings only in $(basename "$log"):" >&2
        sort "$log" | uniq -c | head -5 >&2
    fi
done
if [ "$found" -ne 0 ]; then
    echo "sanitizers: $found process(es) with sanitizer reports" >&2
    exit 1
fi
if [ "$status" -ne 0 ]; then
    echo "sanitizers: the test suite failed under the sanitizers (status $status)" >&2
    exit "$status"
fi
echo "sanitizers: no report"
