"""A first import builds as torch.utils.cpp_extension.load would, without it.

* the ninja file the importing process writes, with cpp_extension's own
  helpers, is byte for byte the one load() writes for the same sources and
  flags (the running release's include paths, ABI and pybind11 defines,
  libraries; $TORCH_CTXEXT_EXTRA_CFLAGS/LDFLAGS), and ninja runs with the
  arguments load() gives it ($MAX_JOBS);
* where this torch's helpers are not as expected (a release that renamed or
  changed them), the build runs load() itself in a child process: it builds
  a library that provides the members, and a compile error is remembered
  and a killed build is not, as on the first path (test_build_lock.py);
* a library that links but does not load (it names a symbol nothing
  exports) is not published, and not remembered.

The subprocess cases run the package the subprocesses find (the installed
one, or the one $PYTHONPATH names), like test_build_lock.py.
"""
import contextlib
import glob
import io
import os
import re
import subprocess

import pytest
import torch

from test_build_lock import ANNOUNCE, FEATURES, KILL_THE_BUILD, NEEDS_EXTENSION, compiler, failing, run, unavailable

# Run before `import torch_ctxext`: a torch.utils.cpp_extension without the
# helper the importing process writes the ninja file with.
WITHOUT_HELPERS = "import torch.utils.cpp_extension as c; del c._write_ninja_file_to_build_library\n"
FALLBACK = "building with torch.utils.cpp_extension.load in a child process"
BUILD_FORCE = "import sys; from torch_ctxext.__main__ import main; sys.exit(main(['build', '--force']))"
PATHS = pytest.mark.parametrize("helpers", ["ninja file written here", "load() in a child"])


def _prefix(helpers):
    return WITHOUT_HELPERS if helpers == "load() in a child" else ""


def _log(cache):
    (log,) = glob.glob(str(cache / "builds" / "*.log"))
    with open(log) as f:
        return f.read()


@pytest.mark.parametrize("extra", [{}, {"TORCH_CTXEXT_EXTRA_CFLAGS": "-g0 -DTORCH_CTXEXT_PROBE=1",
                                        "TORCH_CTXEXT_EXTRA_LDFLAGS": "-Wl,-z,now", "MAX_JOBS": "3"}])
def test_the_ninja_file_and_command_are_the_ones_load_uses(tmp_path, monkeypatch, extra):
    import torch.utils.cpp_extension as cpp_extension
    from torch.utils._cpp_extension_versioner import ExtensionVersioner

    from torch_ctxext._ext import build as _build
    from torch_ctxext._ext import sources as _sources

    for name in ("TORCH_CTXEXT_EXTRA_CFLAGS", "TORCH_CTXEXT_EXTRA_LDFLAGS", "MAX_JOBS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in extra.items():
        monkeypatch.setenv(name, value)
    units = _sources.write_units(_sources.csrc_dir(), str(tmp_path / "units"), torch.__version__)
    cflags = _sources.jit_cflags(torch.__version__, torch.version.git_version)
    ldflags = _sources.extra_link_args()
    ours, theirs = tmp_path / "ours", tmp_path / "load"
    ours.mkdir()
    theirs.mkdir()  # as the build's private directory is
    arguments = _build._write_ninja_file(str(ours), units, cflags, ldflags)

    # load() as the fallback calls it, stopped short of running ninja and importing.
    ninja_runs, real_run = [], subprocess.run

    def run_ninja_or_the_compiler(command, *args, **kwargs):
        if list(command)[:1] == ["ninja"]:
            ninja_runs.append(list(command))
            return subprocess.CompletedProcess(command, 0)
        return real_run(command, *args, **kwargs)  # the compiler's version, for its ABI check

    monkeypatch.setattr(cpp_extension.subprocess, "run", run_ninja_or_the_compiler)
    monkeypatch.setattr(cpp_extension, "JIT_EXTENSION_VERSIONER", ExtensionVersioner())  # a fresh process's
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(cpp_extension, "_import_module_from_library", lambda *args: None)
    cpp_extension.load(
        name="_C", sources=units, extra_cflags=cflags, extra_ldflags=ldflags,
        build_directory=str(theirs), verbose=True, is_python_module=True,
    )
    assert (ours / "build.ninja").read_text() == (theirs / "build.ninja").read_text()
    assert ninja_runs == [["ninja"] + arguments]
    if extra:
        assert "-DTORCH_CTXEXT_PROBE=1" in (ours / "build.ninja").read_text()
        assert arguments == ["-v", "-j", "3"]


def test_helpers_that_want_an_argument_load_would_not_give_are_refused():
    from torch_ctxext._ext import build as _build

    def changed_helper(path, name, sources, with_metal):
        raise AssertionError("not to be called")

    with pytest.raises(TypeError, match="changed_helper takes with_metal, which load"):
        _build._call_by_name(changed_helper, {"path": "p", "name": "_C", "sources": []})
    assert _build._call_by_name(lambda path, verbose=False: (path, verbose), {"path": "p", "sources": []}) == ("p", False)


@NEEDS_EXTENSION
def test_without_the_helpers_the_build_runs_load_in_a_child_and_provides_the_members(tmp_path):
    cache = tmp_path / "cache"
    result = run(WITHOUT_HELPERS + FEATURES, timeout=600, TORCH_CTXEXT_CACHE=cache)
    assert result.stderr.count(ANNOUNCE) == 1
    assert set(unavailable(result).values()) == {"torch_ctxext"}, result.stderr
    log = _log(cache)
    assert FALLBACK in log
    assert "torch_ctxext: the new build loads" in log
    assert glob.glob(str(cache / "builds" / "torch-*" / "_C.so"))
    later = run(FEATURES, TORCH_CTXEXT_CACHE=cache)  # the build the fallback made is the cache's
    assert ANNOUNCE not in later.stderr
    assert set(unavailable(later).values()) == {"torch_ctxext"}

    # `build --force` in a process that loaded that build, from the path the
    # new one takes: a new build that does not load is still seen not to
    # (the loader must not answer with the loaded one), and the previous
    # build is put back.
    forced = run(BUILD_FORCE, TORCH_CTXEXT_CACHE=cache, CXX=_unloadable_compiler(tmp_path))
    assert forced.returncode == 1, forced.stdout + forced.stderr
    assert "the new build does not load:" in forced.stderr
    assert "undefined symbol: torch_ctxext_nowhere" in forced.stderr
    after = run(FEATURES, TORCH_CTXEXT_CACHE=cache)
    assert ANNOUNCE not in after.stderr
    assert set(unavailable(after).values()) == {"torch_ctxext"}


@NEEDS_EXTENSION
def test_the_first_path_writes_the_ninja_file_itself(tmp_path):
    cache = tmp_path / "cache"
    result = run(FEATURES, TORCH_CTXEXT_CACHE=cache, CXX=failing(tmp_path))
    unavailable(result)
    log = _log(cache)
    assert FALLBACK not in log
    assert re.search(r"^\$ \S*ninja -v", log, re.M), log


@NEEDS_EXTENSION
@PATHS
def test_a_compile_error_is_remembered_either_way(tmp_path, helpers):
    cache = tmp_path / "cache"
    result = run(_prefix(helpers) + FEATURES, TORCH_CTXEXT_CACHE=cache, CXX=failing(tmp_path))
    reason = next(iter(unavailable(result).values()))
    assert "failing-c++: error: this compiler always fails" in reason
    assert "This is a compile error: it is recorded" in reason
    assert len(glob.glob(str(cache / "builds" / "*.failed"))) == 1
    assert (FALLBACK in _log(cache)) == (helpers == "load() in a child")


@NEEDS_EXTENSION
@PATHS
def test_a_killed_build_is_not_remembered_either_way(tmp_path, helpers):
    cache = tmp_path / "cache"
    result = run(_prefix(helpers) + FEATURES, TORCH_CTXEXT_CACHE=cache, TEST_PROCESS=os.getpid(),
                 CXX=compiler(tmp_path, "build-killing-c++", KILL_THE_BUILD))
    reason = next(iter(unavailable(result).values()))
    assert "This failure may not recur (the build was killed by SIGKILL), so it is not recorded" in reason
    assert not glob.glob(str(cache / "builds" / "*.failed"))


# A compiler that compiles nothing (an empty object and its dependency file,
# for ninja) and links in a reference to a function nothing defines: the
# library links (a shared library may leave symbols to the loader) but does
# not load.
UNLOADABLE = r"""#!/bin/sh
out=; prev=; compiling=
for a in "$@"; do [ "$a" = -c ] && compiling=1; [ "$prev" = -o ] && out=$a; prev=$a; done
if [ -n "$compiling" ]; then
  : | cc -x c -fPIC -c - -o "$out" && echo "$out:" > "$out.d"; exit $?
fi
if [ -n "$out" ]; then
  echo 'extern void torch_ctxext_nowhere(void); void (*torch_ctxext_use)(void) = torch_ctxext_nowhere;' |
    cc -x c -fPIC -c - -o "$out.extra.o" && exec c++ "$@" "$out.extra.o"
fi
exec c++ "$@"
"""


def _unloadable_compiler(directory):
    path = directory / "unloadable-c++"
    path.write_text(UNLOADABLE)
    path.chmod(0o755)
    return path


@NEEDS_EXTENSION
def test_a_library_that_links_but_does_not_load_is_neither_published_nor_remembered(tmp_path):
    cache = tmp_path / "cache"
    result = run(FEATURES, TORCH_CTXEXT_CACHE=cache, CXX=_unloadable_compiler(tmp_path))
    reason = next(iter(unavailable(result).values()))
    assert "undefined symbol: torch_ctxext_nowhere" in reason
    assert "so it is not recorded: the next import builds again" in reason
    assert not glob.glob(str(cache / "builds" / "torch-*" / "_C.so"))
    assert not glob.glob(str(cache / "builds" / "*.failed"))


@NEEDS_EXTENSION
def test_a_build_without_its_record_is_not_loaded_and_the_next_import_builds_again(tmp_path):
    """The record is written last, once the library loaded: a build directory
    without it (the builder killed just after renaming it into place) is
    remains, not a build."""
    cache = tmp_path / "cache"
    assert run("import torch_ctxext", TORCH_CTXEXT_CACHE=cache, CXX="/nonexistent/c++").returncode == 0
    (lock,) = glob.glob(str(cache / "builds" / "*.lock"))
    remains = lock[: -len(".lock")]
    os.makedirs(remains)
    with open(os.path.join(remains, "_C.so"), "wb") as f:
        f.write(b"not a library")
    without_jit = run("import torch_ctxext", TORCH_CTXEXT_CACHE=cache, TORCH_CTXEXT_JIT="0")
    assert "ImportError: torch_ctxext's C++ extension has not been built for torch" in without_jit.stderr
    result = run(FEATURES, TORCH_CTXEXT_CACHE=cache, CXX=failing(tmp_path))
    assert result.stderr.count(ANNOUNCE) == 1
    assert "failing-c++: error: this compiler always fails" in next(iter(unavailable(result).values()))


def test_progress_names_each_compiled_source_even_under_a_path_with_a_space(tmp_path):
    """ninja quotes a path with a space in the commands it prints; the
    progress line still names the source each step compiled."""
    from torch_ctxext._ext import build as _build
    from torch_ctxext._ext import sources as _sources

    partial = tmp_path / "a cache with spaces" / "build.partial-x"
    partial.mkdir(parents=True)
    units = _sources.write_units(_sources.csrc_dir(), str(partial), torch.__version__)
    flags = _sources.jit_cflags(torch.__version__, torch.version.git_version)
    arguments = _build._write_ninja_file(str(partial), units, flags, _sources.extra_link_args())
    dry_run = subprocess.run([_build._find_ninja(), "-n", *arguments], cwd=partial, capture_output=True, text=True)
    assert dry_run.returncode == 0, dry_run.stdout + dry_run.stderr
    progress = _build._Progress()
    progress.tty = False
    with contextlib.redirect_stderr(io.StringIO()) as said:
        for step in filter(None, map(_build._STEP.match, dry_run.stdout.splitlines())):
            progress.step(int(step.group(1)), int(step.group(2)), step.group(3))
    total = len(units) + 1
    shown = said.getvalue().splitlines()
    assert [line.split("] ", 1)[0] for line in shown] == [f"torch_ctxext: [{i}/{total}" for i in range(1, total + 1)]
    what = [line.split("] ", 1)[1] for line in shown]
    assert sorted(what[:-1]) == sorted(f"compiled {os.path.basename(u)}" for u in units)
    assert what[-1] == "linked _C.so"
