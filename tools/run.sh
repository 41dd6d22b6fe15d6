#!/usr/bin/env bash
# Set up everything on a fresh machine, then run one job:
#
#   bash tools/run.sh check           conformance report for the installed torch (main job)
#   bash tools/run.sh test            every test, on the CI subset of releases (what CI runs)
#   bash tools/run.sh matrix [--keep] [--bench]
#                                     every supported release, one at a time: its report,
#                                     the suite on the test device and the plugin's own
#                                     tests; the compatibility matrix regenerated from the
#                                     reports;
#                                     --bench also measures each release's idle and read
#                                     cost (and, with valgrind, the idle cost in
#                                     instructions) into docs/benchmarks.json
#   bash tools/run.sh docs            build the documentation site (warnings are errors)
#   bash tools/run.sh wheels [--python 3.10,3.13] [--torch 2.6.0,2.13.0] [--out DIR] [--verify]
#                                     the binary wheels, one per CPython (tools/wheels.py);
#                                     --verify installs each beside each torch and checks it
#
# Virtual environments are cached outside the clone, in $TORCH_CTXEXT_CACHE
# (default ~/.cache/torch_ctxext), one per torch release, so a second run
# downloads nothing. torch_ctxext is installed into each from source, and its
# first import there builds the extension for that torch into
# $TORCH_CTXEXT_CACHE/builds, as a user's would: venvs with the same torch
# share one build, and a second run with the same sources builds nothing.
# TORCH_CTXEXT_TORCH picks the release for `check` (default 2.13.0, the one
# this machine has on local disk); TORCH_CTXEXT_CI_RELEASES (space-separated)
# replaces the subset `test` runs besides 2.13.0, and TORCH_CTXEXT_RELEASES
# the releases `matrix` runs (the other kept reports stay), to rerun a part.
set -euo pipefail
shopt -s inherit_errexit  # a failing step inside $(...) stops the run too
job=${1:?usage: bash tools/run.sh check|test|matrix [--keep] [--bench]|docs|wheels [...]}
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${TORCH_CTXEXT_CACHE:-$HOME/.cache/torch_ctxext}
# The releases: torch_ctxext/_releases.py (the one place; standard library only).
facts() { python3 "$root/torch_ctxext/_releases.py" "$1"; }
main=$(facts default)
default_torch=${TORCH_CTXEXT_TORCH:-$main}
reference=$(facts reference)
# Every supported release (the latest patch of each minor): `matrix`.
read -ra releases <<<"$(facts releases)"
# What `test` runs besides $main: one release per path of the release
# boundaries (CI_RELEASES in _releases.py says which path each covers).
read -ra ci_releases <<<"$(facts ci-releases)"
if [ -n "${TORCH_CTXEXT_CI_RELEASES:-}" ]; then read -ra ci_releases <<<"$TORCH_CTXEXT_CI_RELEASES"; fi
oldest=${releases[0]}
matrix_releases=("${releases[@]}")
if [ -n "${TORCH_CTXEXT_RELEASES:-}" ]; then read -ra matrix_releases <<<"$TORCH_CTXEXT_RELEASES"; fi
test_deps=(numpy pytest hypothesis expecttest ninja "setuptools>=70,<82" wheel)
# Test-only: the real architectures of test/test_advise_transformers.py, in
# the $main venv and native 2.15's (never a dependency of the package).
model_test_deps=("transformers==5.23.0")
mkdir -p "$cache"
export TORCH_CTXEXT_CACHE=$cache  # the venvs' builds go to $cache/builds
out=$(mktemp -d /tmp/torch_ctxext-run.XXXXXX)

pip_env() {  # pip_env VERSION -> the environment pip runs with for that release
    # This machine's pip configuration caps torch at what lies on its disk
    # (2.13.0); the other releases come from the package index itself.
    # No cache: it would double the disk each release takes (5 to 7 GB).
    if [ "$1" = "$main" ]; then echo PIP_NO_CACHE_DIR=1; else echo PIP_CONFIG_FILE=/dev/null PIP_NO_CACHE_DIR=1; fi
}

install_torch_ctxext() {  # install_torch_ctxext VENV: the sources; the first import builds
    TORCH_CTXEXT_BUILD_EXT=0 "$1/bin/python" -m pip install -q --no-build-isolation --no-deps "$root" >&2
}

install_testdevice() {  # install_testdevice VENV: the test device (tools/testdevice), built for its torch
    # Built again only when its sources change (the hash is kept in the venv).
    local venv=$1 hash
    hash=$(cd "$root/tools/testdevice" && find . -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.py' -o -name '*.toml' \) \
        -not -path './build/*' | sort | xargs sha256sum | sha256sum | cut -c1-16)
    if [ "$(cat "$venv/.testdevice-hash" 2>/dev/null)" = "$hash" ]; then return; fi
    local src
    src=$(mktemp -d /tmp/torch_ctxext-testdevice.XXXXXX)
    cp -r "$root/tools/testdevice/." "$src"
    local t0=$SECONDS
    "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps "$src" >&2
    echo "== test device built for $("$venv/bin/python" -c 'import torch; print(torch.__version__)') in $(( SECONDS - t0 )) s" >&2
    rm -rf "$src"
    echo "$hash" >"$venv/.testdevice-hash"
}

import_tests() {  # import_tests VERSION PYTHON [ENV...]: what the import and the install do to a process, on that torch
    local version=$1 python=$2
    shift 2
    echo "== the import leaves the process as import torch does; the install resolves against this torch, torch $version"
    env "$@" "$python" -m pytest -q -p no:cacheprovider -o addopts= -rs --rootdir "$root" \
        "$root/test/test_import_leaves_the_process.py" \
        "$root/test/test_install.py::test_pip_install_without_build_isolation_resolves_against_the_installed_torch"
}

accelerator_tests() {  # accelerator_tests VERSION PYTHON [ENV...]: the suite on the test device
    local version=$1 python=$2
    shift 2
    echo "== the conformance suite on the test device (testdevice), torch $version"
    env "$@" "$python" -m pytest -q -p no:cacheprovider -o addopts= -rs --junitxml "$out/device-$version.xml" \
        --pyargs torch_ctxext.conformance --ctx-device testdevice >"$out/device-$version.log" 2>&1 \
        || { cat "$out/device-$version.log"; exit 1; }
    tail -n 1 "$out/device-$version.log"
    "$python" "$root/tools/count_accelerator_tests.py" "$out/device-$version.xml"
}

docs_venv() {  # torch $main (2.13.0) + torch_ctxext + the documentation tools
    local dir=$cache/venv-docs
    if [ ! -x "$dir/bin/python" ] || ! "$dir/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$main'" 2>/dev/null; then
        rm -rf "$dir"
        python3 -m venv "$dir"
        env $(pip_env "$main") "$dir/bin/python" -m pip install -q "torch==$main" >&2
    fi
    env $(pip_env "$main") "$dir/bin/python" -m pip install -q "${test_deps[@]}" -r "$root/requirements-docs.txt" >&2
    env $(pip_env "$main") "$dir/bin/python" -m pip install -q "${model_test_deps[@]}" >&2  # the benchmarks' real models
    install_torch_ctxext "$dir"
    echo "$dir"
}

build_docs() {
    local dir
    dir=$(docs_venv)
    (cd /tmp && "$dir/bin/sphinx-build" -q -W --keep-going -b html "$root/docs" "$out/html")
    echo "docs built: $out/html/index.html"
}

python_for() {  # python_for 3.X -> that CPython here (tools/find_cpython.py: pyenv's, else on PATH), or one line why not
    python3 "$root/tools/find_cpython.py" "$1"
}

venv_dir() {  # venv_dir VERSION [CPYTHON] -> where that venv is cached
    if [ -z "${2:-}" ] || [ "$2" = 3.11 ]; then echo "$cache/venv-$1"; else echo "$cache/venv-$1-py$2"; fi
}

venv_create() {  # venv_create VERSION [CPYTHON [DIR]]: a venv with that torch and the test tools
    local version=$1 python=${2:-3.11} dir=${3:-}
    [ -n "$dir" ] || dir=$(venv_dir "$version" "$python")
    local pipenv
    pipenv=$(pip_env "$version")
    # The torch on this machine's disk is for CPython 3.11: the others come from the index.
    if [ "$python" != 3.11 ]; then pipenv="PIP_CONFIG_FILE=/dev/null PIP_NO_CACHE_DIR=1"; fi
    if [ ! -x "$dir/bin/python" ] || ! "$dir/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$version'" 2>/dev/null; then
        rm -rf "$dir"
        "$(python_for "$python")" -m venv "$dir"
        env $pipenv "$dir/bin/python" -m pip install -q "torch==$version"
    fi
    env $pipenv "$dir/bin/python" -m pip install -q "${test_deps[@]}"
    if [ "$version" = "$main" ] || [ "$version" = "$reference" ]; then
        env $pipenv "$dir/bin/python" -m pip install -q "${model_test_deps[@]}"
    fi
}

build_wheels() {  # build_wheels ARGS...: tools/wheels.py, with ninja from a small venv of its own
    local dir=$cache/venv-wheels
    if [ ! -x "$dir/bin/ninja" ]; then
        rm -rf "$dir"
        python3 -m venv "$dir"
        PIP_CONFIG_FILE=/dev/null "$dir/bin/python" -m pip install -q ninja
    fi
    "$dir/bin/python" "$root/tools/wheels.py" "$@"
}

wheel_tests() {  # wheel_tests VERSION CPYTHON DIST [plugin]: the wheel in a venv of its own, as a user installs it
    local version=$1 python=$2 dist=$3 dir wheel tag
    tag=cp${python/./}
    wheel=$(ls "$dist"/torch_ctxext-*-"$tag"-"$tag"-*.whl)
    echo "== the binary wheel $(basename "$wheel") with torch $version: installed alone, imported and checked without a compiler"
    dir=$(venv_dir "$version" "$python")
    if [ "$python" = 3.11 ]; then dir=$cache/venv-$version-wheel; fi  # not the venv the source install is tested in
    venv_create "$version" "$python" "$dir" >&2
    # No build tool in the venv while the wheel is checked (the tests' ninja goes, and comes back after).
    "$dir/bin/python" -m pip uninstall -q -y ninja >&2 || true
    # The layout verdict for this torch goes into the wheel before it is
    # installed, as the release step (wheels.py --verify) puts one in for
    # every torch it verifies: the check then requires a first import that
    # starts no process.
    "$dir/bin/python" "$root/tools/wheel_verdicts.py" "$wheel"
    env $(pip_env "$version") "$dir/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel" >&2
    "$dir/bin/python" "$root/tools/wheel_check.py"
    if [ "${4:-}" = plugin ]; then
        # The plugin's tests are about a source install too (the build at
        # first import, its lock, its failures): they run on one, with ninja.
        echo "== the plugin's own tests on CPython $python, torch $version (installed from source)"
        env $(pip_env "$version") "$dir/bin/python" -m pip install -q ninja >&2
        install_torch_ctxext "$dir"
        "$dir/bin/python" -m pytest -q -p no:cacheprovider -o addopts= --rootdir "$root" "$root/test" \
            >"$out/test-$version-py$python.log" 2>&1 || { cat "$out/test-$version-py$python.log"; exit 1; }
        tail -n 1 "$out/test-$version-py$python.log"
    fi
}

# Creating a venv is mostly download and unpacking, building torch_ctxext is
# compiling: `test` creates the next releases' venvs in the background (one
# at a time) while the foreground builds and tests.
prefetched=()
prefetch() {
    prefetched=("$@")
    (
        for version in "$@"; do
            if venv_create "$version" >"$out/venv-$version.log" 2>&1; then status=ok; else status=failed; fi
            echo $status >"$out/venv-$version.done"
        done
    ) &
    prefetch_pid=$!
    trap 'stop_prefetch' EXIT
}
stop_prefetch() {
    if [ -n "${prefetch_pid:-}" ] && kill -0 "$prefetch_pid" 2>/dev/null; then
        pkill -TERM -P "$prefetch_pid" 2>/dev/null || true
        kill "$prefetch_pid" 2>/dev/null || true
    fi
}

venv_ready() {  # venv_ready VERSION: its venv exists (created here, or by prefetch)
    local version=$1
    if [[ " ${prefetched[*]} " == *" $version "* ]]; then
        while [ ! -e "$out/venv-$version.done" ]; do sleep 5; done
        if [ "$(cat "$out/venv-$version.done")" != ok ]; then
            cat "$out/venv-$version.log" >&2
            return 1
        fi
    else
        venv_create "$version" >&2
    fi
}

venv_for() {  # venv_for VERSION -> path of a venv with that torch and torch_ctxext installed
    local version=$1 dir=$cache/venv-$1
    venv_ready "$version"
    install_torch_ctxext "$dir"
    install_testdevice "$dir"
    echo "$dir"
}

report() {  # report VERSION PYTHON [ENV...]: the conformance report, as JSON in $out
    local version=$1 python=$2
    shift 2
    echo "== conformance report, torch $version"
    # Where native torch breaks the contract, the report counts upstream
    # deviations: the suite checks the contract, not us.
    env "$@" "$python" -m torch_ctxext check --json "$out/check-$version.json" >"$out/check-$version.log" 2>&1 \
        || { cat "$out/check-$version.log"; exit 1; }
    sed -n '/^ctx contract conformance on torch/,$p' "$out/check-$version.log"
}

tested() {  # tested VERSION: whether this run of `test` set up that release (its venv has these sources)
    if [ "$1" = "$main" ] || [[ " ${ci_releases[*]} " == *" $1 "* ]]; then return 0; fi
    echo "== skipped: the differential check on $1 (not among TORCH_CTXEXT_CI_RELEASES)"
    return 1
}

reference_checks() {  # what needs native $reference ($ref_python): the differential, the stacks, advise without the extension
    diff_dir=$root/tools/differential
    PYTHONPATH="$root" "$ref_python" "$diff_dir/run.py" --out "$out/diff-ref.json" >/dev/null 2>&1
    for version in $main $oldest; do
        tested "$version" || continue
        echo "== differential check: the same scenarios on native $reference and on $version + torch_ctxext"
        TORCH_CTXEXT_IMPORT=1 "$cache/venv-$version/bin/python" "$diff_dir/run.py" --out "$out/diff-$version.json" >/dev/null 2>&1
        python3 "$diff_dir/run.py" --compare "$out/diff-ref.json" "$out/diff-$version.json" \
            --allow "$diff_dir/deviations.txt" | tail -n 1
    done
    # The accelerator scenarios, on the test device (tools/differential/scenarios_device.py).
    PYTHONPATH="$root" "$ref_python" "$diff_dir/run.py" --device testdevice --out "$out/diff-device-ref.json" >/dev/null 2>&1
    for version in $main $oldest; do
        tested "$version" || continue
        echo "== differential check on the test device: native $reference and $version + torch_ctxext"
        TORCH_CTXEXT_IMPORT=1 "$cache/venv-$version/bin/python" "$diff_dir/run.py" --device testdevice \
            --out "$out/diff-device-$version.json" >/dev/null 2>&1
        python3 "$diff_dir/run.py" --compare "$out/diff-device-ref.json" "$out/diff-device-$version.json" \
            --allow "$diff_dir/deviations-device.txt" | sed -n '/^non-None buffers/,$p'
    done
    echo "== training stacks (DDP, FSDP2, checkpointing, autocast, torch.compile), examples/, advise's report, explain and the drop-ins, a newer torch's version string, check run from a user's project, the command line, native $reference"
    # Where fusion happens in each stack, and what advise reports, is pinned on
    # $main + torch_ctxext above; native 2.15 is the reference behaviour, so
    # the same tests must pass there; and what advise and explain say without
    # the extension is tested only there.
    PYTHONPATH="$root" "$ref_python" -m pytest -q -p no:cacheprovider -o addopts= \
        --rootdir "$root" "$root/test/test_training_stacks.py" "$root/test/test_examples.py" \
        "$root/test/test_advise_models.py" "$root/test/test_nn.py" "$root/test/test_advise_transformers.py" \
        "$root/test/test_advise.py" "$root/test/test_explain.py" \
        "$root/test/test_newer_torch_and_unavailable_members.py" "$root/test/test_check_isolation.py" \
        "$root/test/test_command_line.py"
    echo "== advise()'s own C++ watch on native $reference (python -m torch_ctxext build: that watch alone, which only advise() loads): the same report as Python's watch above"
    PYTHONPATH="$root" "$ref_python" -m torch_ctxext build | tail -n 1
    PYTHONPATH="$root" "$ref_python" -m pytest -q -p no:cacheprovider -o addopts= \
        --rootdir "$root" "$root/test/test_advise_module.py" "$root/test/test_advise_watch.py" \
        "$root/test/test_advise.py" "$root/test/test_advise_models.py" "$root/test/test_advise_transformers.py" \
        "$root/test/test_explain.py"
}

case $job in
docs)
    build_docs
    ;;
check)
    # The conformance report on the CPU: the test device is not built. With
    # a binary wheel for this CPython in dist/ (bash tools/run.sh wheels),
    # it is installed instead of the sources, and nothing is compiled.
    # CPython 3.11 where it is here (this machine's torch wheel is for it),
    # else the python3 on PATH if it is 3.10 or newer.
    read -r _ check_python <<<"$(python3 "$root/tools/find_cpython.py" any)"
    venv=$(venv_dir "$default_torch" "$check_python")
    venv_create "$default_torch" "$check_python" "$venv" >&2
    tag=cp${check_python/./}
    wheel=""
    for candidate in "$root"/dist/torch_ctxext-*-"$tag"-"$tag"-*.whl; do
        [ -e "$candidate" ] && wheel=$candidate
    done
    if [ -n "$wheel" ]; then
        env $(pip_env "$default_torch") "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel" >&2
    else
        install_torch_ctxext "$venv"
    fi
    cd /tmp && exec "$venv/bin/python" -m torch_ctxext check
    ;;
wheels)
    build_wheels "${@:2}"
    ;;
test)
    cd /tmp
    start=$(date +%s)
    prefetch "${ci_releases[@]}"
    main_venv=$(venv_for $main)
    echo "== tests of the plugin and the conformance suite, torch $main + torch_ctxext"
    "$main_venv/bin/python" -m pytest -q -p no:cacheprovider -o addopts= \
        --rootdir "$root" "$root/test" --pyargs torch_ctxext.conformance
    echo "== the suite reports each deliberately broken variant of the contract"
    "$main_venv/bin/python" "$root/tools/broken_variants/run.py"
    report $main "$main_venv/bin/python"
    accelerator_tests $main "$main_venv/bin/python"
    for version in "${ci_releases[@]}"; do
        if [ "$version" = "$reference" ]; then
            # Everything is native: nothing of the extension is loaded, so
            # the source tree runs as it is (no build).
            venv_ready "$version"
            install_testdevice "$cache/venv-$version"
            ref_python=$cache/venv-$version/bin/python
            report "$version" "$ref_python" PYTHONPATH="$root"
            accelerator_tests "$version" "$ref_python" PYTHONPATH="$root"
            import_tests "$version" "$ref_python" PYTHONPATH="$root"
            continue
        fi
        venv=$(venv_for "$version")
        report "$version" "$venv/bin/python"
        accelerator_tests "$version" "$venv/bin/python"
        echo "== where the releases differ (test/test_release_boundaries.py), advise's report, its C++ watch and the drop-ins (test/test_advise_models.py, test/test_advise_watch.py, test/test_nn.py), torch $version"
        "$venv/bin/python" -m pytest -q -p no:cacheprovider -o addopts= \
            --rootdir "$root" "$root/test/test_release_boundaries.py" "$root/test/test_advise_models.py" \
            "$root/test/test_advise_watch.py" "$root/test/test_nn.py"
        import_tests "$version" "$venv/bin/python"
    done
    echo "== the compatibility matrix in the docs matches these reports"
    python3 "$root/tools/compat_matrix.py" --check "$out"/check-*.json
    if [ -n "${ref_python:-}" ]; then
        reference_checks
    else
        echo "== skipped: the differential check and the tests on native $reference (not among TORCH_CTXEXT_CI_RELEASES)"
    fi
    # The binary wheels, as users install them (tools/wheels.py): CPython 3.11
    # with this machine's CPU build of $main, 3.13 with PyPI's (CUDA) build
    # of $main, 3.10 with PyPI's $oldest; the plugin's own tests on 3.13 and 3.10.
    echo "== binary wheels (tools/wheels.py): CPython 3.11 and 3.13 for torch $main, 3.10 for torch $oldest"
    t0=$SECONDS
    build_wheels --python 3.11,3.13 --torch "$main" --out "$out/dist" | tail -n 4
    build_wheels --python 3.10 --torch "$oldest" --out "$out/dist" | tail -n 3
    echo "== wheels built in $(( SECONDS - t0 )) s"
    wheel_tests "$main" 3.11 "$out/dist"
    wheel_tests "$main" 3.13 "$out/dist" plugin
    wheel_tests "$oldest" 3.10 "$out/dist" plugin
    echo "== documentation site (warnings are errors)"
    build_docs
    echo "== test: $(( $(date +%s) - start )) s"
    ;;
matrix)
    keep=false bench=false keep_reference=false
    for option in "${@:2}"; do
        case $option in
        --keep) keep=true ;;
        --bench) bench=true ;;
        *) echo "unknown option for matrix: $option" >&2; exit 2 ;;
        esac
    done
    cd /tmp
    start=$(date +%s)
    declare -A existed=()  # every cached venv, whichever releases this run checks
    for version in "${releases[@]}"; do
        [ -x "$cache/venv-$version/bin/python" ] && existed[$version]=1
    done
    if $bench; then
        # Reads are compared with native $reference, alive for the whole run
        # (or the python TORCH_CTXEXT_BENCH_NATIVE names); the figures need
        # matplotlib (the docs environment has it, or TORCH_CTXEXT_BENCH_PYTHON).
        native_python=${TORCH_CTXEXT_BENCH_NATIVE:-}
        if [ -z "$native_python" ]; then
            venv_ready $reference
            native_python=$cache/venv-$reference/bin/python
            keep_reference=true
        fi
        bench_python=${TORCH_CTXEXT_BENCH_PYTHON:-$(docs_venv)/bin/python}
    fi
    for version in "${matrix_releases[@]}"; do
        t0=$(date +%s)
        venv=$(venv_for "$version")
        t1=$(date +%s)
        report "$version" "$venv/bin/python"
        accelerator_tests "$version" "$venv/bin/python"
        echo "== the plugin's own tests, torch $version"
        # Every supported release passes them: what a test expects of a
        # member comes from who provides it there (features()), never from
        # a release number pinned in the test.
        "$venv/bin/python" -m pytest -q -p no:cacheprovider -o addopts= \
            --rootdir "$root" "$root/test" >"$out/test-$version.log" 2>&1 \
            || { cat "$out/test-$version.log"; exit 1; }
        tail -n 1 "$out/test-$version.log"
        t2=$(date +%s)
        if $bench; then
            # The idle cost in instructions too, where valgrind is installed
            # (benchmarks/bench_idle_instructions.py: wall time is too noisy).
            "$bench_python" "$root/benchmarks/run_all.py" --from-json "$root/docs/benchmarks.json" \
                --remeasure releases $(command -v valgrind >/dev/null && echo --remeasure instructions) \
                --other-releases "$venv/bin/python" \
                --torch-2-15 "$native_python" >"$out/bench-$version.log" 2>&1 \
                || { cat "$out/bench-$version.log"; exit 1; }
        fi
        # A venv this run created goes unless --keep (5 to 7 GB each); one
        # that was cached before stays. With --bench the reference goes last.
        if ! $keep && [ -z "${existed[$version]:-}" ] && ! { $keep_reference && [ "$version" = $reference ]; }; then
            rm -rf "$venv"
        fi
        echo "== torch $version: $(( $(date +%s) - t0 )) s (venv and build $(( t1 - t0 )) s, check $(( t2 - t1 )) s$($bench && echo ", benchmark $(( $(date +%s) - t2 )) s" || true))"
    done
    if $keep_reference && ! $keep && [ -z "${existed[$reference]:-}" ]; then rm -rf "$cache/venv-$reference"; fi
    # CPython 3.12 (CI tests 3.10, 3.11 and 3.13): the binary wheel, as a user
    # installs it, and the plugin's tests, with the newest release that needs a binary.
    newest=${releases[${#releases[@]}-2]}
    build_wheels --python 3.12 --torch "$newest" --out "$out/dist" | tail -n 3
    wheel_tests "$newest" 3.12 "$out/dist" plugin
    $keep || rm -rf "$(venv_dir "$newest" 3.12)"
    python3 "$root/tools/compat_matrix.py" --store "$out"/check-*.json
    echo "== compatibility matrix regenerated (docs/compatibility.md, README.md, docs/compat/)"
    echo "== matrix: ${#matrix_releases[@]} releases in $(( $(date +%s) - start )) s"
    ;;
*)
    echo "unknown job: $job (check|test|matrix|docs)" >&2
    exit 2
    ;;
esac
