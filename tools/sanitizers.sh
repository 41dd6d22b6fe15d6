#!/usr/bin/env bash
# Build torch_ctxext's C++ extension with AddressSanitizer and
# UndefinedBehaviorSanitizer into a copy of the repository, then run the test
# suite (test/ and the conformance package torch_ctxext.conformance) against it.
#
#   bash tools/sanitizers.sh [pytest args...]
#
# Environment:
#   TORCH_CTXEXT_PYTHON     python of a venv with torch, pytest, hypothesis,
#                           expecttest, ninja (default: the cached 2.13 venv
#                           tools/run.py creates)
#   TORCH_CTXEXT_ASAN_DIR   where the instrumented copy is built
#                           (default /tmp/asan-build; wiped first)
#   TORCH_CTXEXT_ASAN_REUSE=1  keep the instrumented build in that copy when
#                           setup.py, csrc/ and torch are unchanged (the
#                           Python sources and tests are refreshed)
#   MAX_JOBS                parallel compile jobs (default 2)
#
# Python and libtorch are not instrumented, so the ASan runtime must be loaded
# first (LD_PRELOAD of the compiler's libasan) and leak detection is off (the
# interpreter "leaks" by design at exit). UBSan is built in no-recover mode: the
# first undefined behaviour aborts the process. A run is clean when pytest
# passes and the log holds no sanitizer report.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${TORCH_CTXEXT_CACHE:-$HOME/.cache/torch_ctxext}
python=${TORCH_CTXEXT_PYTHON:-}
if [ -z "$python" ]; then
    for candidate in "$cache/venv-2.13/bin/python" "$cache/venv-2.13.0/bin/python"; do
        if [ -x "$candidate" ]; then python=$candidate; break; fi
    done
fi
[ -n "$python" ] || { echo "set TORCH_CTXEXT_PYTHON (no cached venv found)" >&2; exit 2; }
dest=${TORCH_CTXEXT_ASAN_DIR:-/tmp/asan-build}
log=$dest.log
start=$(date +%s)

cxx=${CXX:-g++}
libasan=$("$cxx" -print-file-name=libasan.so)
libubsan=$("$cxx" -print-file-name=libubsan.so)
if [ ! -e "$libasan" ] || [ "$libasan" = libasan.so ]; then
    echo "no libasan.so for $cxx: install the compiler's sanitizer runtime" >&2
    exit 2
fi
libasan=$(readlink -f "$libasan")
libubsan=$(readlink -f "$libubsan")

# UBSan's vptr check of a downcast needs the class's typeinfo, and libtorch
# does not export PyNode's. The nodes the extension downcasts are PyNodes by
# construction (a THPFunction's own node, or the node whose PyNode vtable
# slot it replaced after checking that vtable's RTTI); every other UBSan
# check stays on.
san="-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
# What the instrumented build depends on: reused when unchanged and
# TORCH_CTXEXT_ASAN_REUSE=1 (the Python sources and tests are always refreshed).
key=$(cd "$root" && cat setup.py csrc/* | sha256sum | cut -c1-16)-$("$python" -c 'import torch; print(torch.version.git_version[:12])')
so=$(ls "$dest"/torch_ctxext/_C*.so 2>/dev/null || true)
if [ "${TORCH_CTXEXT_ASAN_REUSE:-0}" = 1 ] && [ -n "$so" ] && [ "$(cat "$dest/.build-key" 2>/dev/null)" = "$key" ]; then
    reuse=1
else
    reuse=0
    rm -rf "$dest"
fi
echo "== copying $root to $dest (sources only: no build outputs)"
mkdir -p "$dest"
(cd "$root" && tar --exclude=./build --exclude=./dist --exclude='*.so' \
    --exclude='__pycache__' --exclude=./.git --exclude='*.egg-info' \
    --exclude=./torch_ctxext/_build_info.py \
    --exclude=.hypothesis --exclude=.pytest_cache -cf - .) | tar -C "$dest" -xf -

if [ "$reuse" = 1 ]; then
    echo "== reusing the instrumented build in $dest (sources unchanged)"
else
    echo "== building the extension with -fsanitize=address,undefined"
    (
        cd "$dest"
        TORCH_CTXEXT_EXTRA_CFLAGS="$san -D_GLIBCXX_ASSERTIONS" \
        TORCH_CTXEXT_EXTRA_LDFLAGS="-fsanitize=address,undefined" \
        MAX_JOBS=${MAX_JOBS:-2} \
            "$python" setup.py -q build_ext --inplace >"$dest/build.log" 2>&1 \
            || { cat "$dest/build.log"; exit 1; }
    )
    echo "$key" >"$dest/.build-key"
fi
so=$(ls "$dest"/torch_ctxext/_C*.so)
if ! nm -D "$so" | grep __asan_report >/dev/null; then  # not -q: SIGPIPE + pipefail
    echo "the built extension is not instrumented: $so" >&2
    exit 1
fi
build_done=$(date +%s)
echo "   built in $((build_done - start)) s: $so"

export_sanitizer_env() {
    export LD_PRELOAD="$libasan $libubsan"
    # detect_leaks=0: Python and torch are not instrumented and never free
    # everything at exit. The allocator checks still cover every allocation of
    # the extension, and PYTHONMALLOC=malloc routes Python objects through
    # ASan's malloc as well, so overruns of Python objects show up too.
    export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1:symbolize=1:detect_odr_violation=0:allocator_may_return_null=1
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    export PYTHONMALLOC=malloc
}

echo "== canary: the same setup must catch a heap overflow and a signed overflow"
canary=$dest/canary
mkdir -p "$canary"
cat >"$canary/canary.c" <<'EOF'
#include <stdlib.h>
int heap_overflow(int i) { int* p = malloc(4 * sizeof(int)); int v = p[i]; free(p); return v; }
int signed_overflow(int i) { return i + 2147483647; }
EOF
gcc -shared -fPIC $san -o "$canary/libcanary.so" "$canary/canary.c"
for probe in "heap_overflow(4):heap-buffer-overflow" "signed_overflow(1):signed integer overflow"; do
    call=${probe%%:*}
    expect=${probe#*:}
    out=$(export_sanitizer_env; "$python" -c "import ctypes; ctypes.CDLL('$canary/libcanary.so').$call" 2>&1) && {
        echo "canary $call was not caught: the sanitizer setup is broken" >&2; exit 1; }
    grep -q "$expect" <<<"$out" || { echo "canary $call: no '$expect' report:" >&2; echo "$out" >&2; exit 1; }
    echo "   $call caught ($expect)"
done

echo "== running the test suite under ASan+UBSan (log: $log)"
status=0
(
    cd /tmp
    export_sanitizer_env
    export TORCH_CTXEXT_SANITIZERS=1
    export PYTHONPATH=$dest
    # The suite's own subprocesses inherit all of the above.
    "$python" -c "import torch_ctxext, torch_ctxext._C as C; assert C.__file__.startswith('$dest'), C.__file__"
    "$python" -m pytest -q -p no:cacheprovider -o addopts= --rootdir "$dest" \
        "$dest/test" --pyargs torch_ctxext.conformance "$@"
) >"$log" 2>&1 || status=$?
end=$(date +%s)
tail -5 "$log"
if grep -qE "ERROR: AddressSanitizer|runtime error:|SUMMARY: (Address|UndefinedBehavior)Sanitizer" "$log"; then
    echo "== sanitizer reports found in $log:"
    grep -nE -A30 "ERROR: AddressSanitizer|runtime error:" "$log" | head -80
    if [ "$status" -eq 0 ]; then status=1; fi
fi
echo "== sanitizers: exit $status, build $((build_done - start)) s, tests $((end - build_done)) s, total $((end - start)) s"
exit "$status"
