"""A first import builds as torch.utils.cpp_extension.load would, without it.

* the flags of the ninja file torch_ctxext writes (``_torch_ctxext_build/compile.py``, in
  the build's own process, without importing cpp_extension) are the ones
  load() writes for the same sources and flags on the running release
  (include paths, C++ standard, ABI and pybind11 defines, libraries;
  $TORCH_CTXEXT_EXTRA_CFLAGS/LDFLAGS), and ninja runs with the arguments
  load() gives it ($MAX_JOBS);
* the facts of torch that the flags need, read from an unpacked torch that
  is not imported (the wheels, tools/wheels.py), are those the running
  torch reports;
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
import shlex
import subprocess
import sysconfig

import pytest
import torch

from test_build_lock import ANNOUNCE, FEATURES, NEEDS_EXTENSION, failing, run, unavailable

BUILD_FORCE = "import sys; from torch_ctxext.__main__ import main; sys.exit(main(['build', '--force']))"


def _log(cache):
    (log,) = glob.glob(str(cache / "builds" / "*.log"))
    with open(log) as f:
        return f.read()


def _ninja_variables(path):
    """{name: [words]} of a ninja file's top-level variables."""
    found = {}
    for line in open(path).read().splitlines():
        match = re.match(r"^(\w+) = (.*)$", line)
        if match:
            found[match.group(1)] = shlex.split(match.group(2))
    return found


@pytest.mark.parametrize("extra", [{}, {"TORCH_CTXEXT_EXTRA_CFLAGS": "-g0 -DTORCH_CTXEXT_PROBE=1",
                                        "TORCH_CTXEXT_EXTRA_LDFLAGS": "-Wl,-z,now", "MAX_JOBS": "3"}])
def test_the_flags_and_the_ninja_command_are_the_ones_load_uses(tmp_path, monkeypatch, extra):
    import torch.utils.cpp_extension as cpp_extension
    from torch.utils._cpp_extension_versioner import ExtensionVersioner

    from _torch_ctxext_build import compile as _compile
    from _torch_ctxext_build import sources as _sources

    for name in ("TORCH_CTXEXT_EXTRA_CFLAGS", "TORCH_CTXEXT_EXTRA_LDFLAGS", "MAX_JOBS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in extra.items():
        monkeypatch.setenv(name, value)
    target = _compile.target_of_running_torch(torch, sysconfig.get_path("include", scheme="posix_prefix"))
    ours, theirs = tmp_path / "ours", tmp_path / "load"
    ours.mkdir()
    theirs.mkdir()
    _compile.write_ninja(target, _sources.csrc_dir(), str(ours))
    units = _sources.write_units(_sources.csrc_dir(), str(tmp_path / "units"), torch.__version__)

    # load() with our own defines and flags, stopped short of running ninja and importing.
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
    ours_only = [f"-D{n}={v}" for n, v in _sources.define_macros(torch.__version__, torch.version.git_version)]
    cpp_extension.load(
        name="_C", sources=units, extra_cflags=[shlex.quote(f) for f in ours_only + _sources.extra_compile_args()],
        extra_ldflags=_sources.extra_link_args(), build_directory=str(theirs), verbose=True, is_python_module=True,
    )
    mine, load = _ninja_variables(ours / "build.ninja"), _ninja_variables(theirs / "build.ninja")
    assert sorted(mine["cflags"]) == sorted(load["cflags"])
    assert mine["ldflags"] == load["ldflags"]
    assert ninja_runs == [["ninja"] + _compile.ninja_arguments()]
    if extra:
        assert "-DTORCH_CTXEXT_PROBE=1" in mine["cflags"] and "-Wl,-z,now" in mine["ldflags"]
        assert _compile.ninja_arguments() == ["-v", "-j", "3"]


def test_the_facts_read_from_torch_s_files_are_the_ones_the_running_torch_reports():
    """What the wheels compile with (tools/wheels.py reads a torch it does
    not import) is what a build at import reads from the running torch:
    version, git hash, C++ ABI, pybind11's ABI strings."""
    from _torch_ctxext_build import compile as _compile

    include = sysconfig.get_path("include", scheme="posix_prefix")
    running = _compile.target_of_running_torch(torch, include)
    assert _compile.target_of_unpacked_torch(running.torch_dir, include) == running
    assert running.cxx11_abi == bool(torch._C._GLIBCXX_USE_CXX11_ABI)


def test_a_libc10_this_cannot_read_is_said():
    from _torch_ctxext_build import compile as _compile

    with pytest.raises(ValueError, match="exports no c10::detail::torchCheckFail"):
        _compile.cxx11_abi(os.__file__)


@NEEDS_EXTENSION
def test_a_compile_error_is_remembered(tmp_path):
    cache = tmp_path / "cache"
    result = run(FEATURES, TORCH_CTXEXT_CACHE=cache, CXX=failing(tmp_path))
    reason = next(iter(unavailable(result).values()))
    assert "failing-c++: error: this compiler always fails" in reason
    assert "This is a compile error: it is recorded" in reason
    assert len(glob.glob(str(cache / "builds" / "*.failed"))) == 1
    assert re.search(r"^\$ \S*ninja -v", _log(cache), re.M)


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
    from _torch_ctxext_build import build_child as _child
    from _torch_ctxext_build import compile as _compile
    from _torch_ctxext_build import sources as _sources

    partial = tmp_path / "a cache with spaces" / "build.partial-x"
    partial.mkdir(parents=True)
    target = _compile.target_of_running_torch(torch, sysconfig.get_path("include", scheme="posix_prefix"))
    _compile.write_ninja(target, _sources.csrc_dir(), str(partial))
    units = _sources.units(_sources.csrc_dir(), torch.__version__)
    dry_run = subprocess.run([_child.find_ninja(), "-n", *_compile.ninja_arguments()], cwd=partial,
                             capture_output=True, text=True)
    assert dry_run.returncode == 0, dry_run.stdout + dry_run.stderr
    progress = _build._Progress()
    progress.tty = False
    with contextlib.redirect_stderr(io.StringIO()) as said:
        for step in filter(None, map(_child._STEP.match, dry_run.stdout.splitlines())):
            progress.step(int(step.group(1)), int(step.group(2)), _child._describe(step.group(3)))
    total = len(units) + 1
    shown = said.getvalue().splitlines()
    assert [line.split("] ", 1)[0] for line in shown] == [f"torch_ctxext: [{i}/{total}" for i in range(1, total + 1)]
    what = [line.split("] ", 1)[1] for line in shown]
    assert sorted(what[:-1]) == sorted(f"compiled {name}.cpp" for name, _ in units)
    assert what[-1] == "linked _C.so"


# --------------------------------------------------------------------------
# A compiler that does not work, as the first import meets it
# --------------------------------------------------------------------------


def _ninja_gives_exit_statuses():
    """Whether the ninja a build runs prints a failed command's exit status
    ("FAILED: [code=1] out", ninja 1.12 and later)."""
    from _torch_ctxext_build import build_child as _child

    version = subprocess.run([_child.find_ninja(), "--version"], capture_output=True, text=True).stdout
    return tuple(int(n) for n in re.findall(r"\d+", version)[:2]) >= (1, 12)


@NEEDS_EXTENSION
def test_a_compiler_that_fails_without_a_word_is_named_and_no_unit_it_failed_on_is_called_compiled(tmp_path):
    result = run(FEATURES, TORCH_CTXEXT_CACHE=tmp_path / "cache", CXX="false")
    steps = [line for line in result.stderr.splitlines() if re.match(r"torch_ctxext: \[\d+/\d+\] ", line)]
    assert steps and all(re.search(r"\] failed to compile unit_\w+\.cpp$", line) for line in steps), steps
    reason = next(iter(unavailable(result).values()))
    assert "ninja: build stopped" not in reason
    named = re.search(r"the C\+\+ compiler `false` \(from \$CXX\) failed on unit_\w+\.cpp \((csrc/\w+\.cpp(, )?)+\)"
                      r"(: exit status \d+)? with no output", reason)
    assert named, reason
    assert (": exit status 1 " in named.group(0)) == _ninja_gives_exit_statuses()
    assert "a compiler that fails without saying why does not work (or was killed): install or fix a C++ compiler, or set $CXX to one that works" in reason
    assert "or install a wheel built for this torch" in reason


@NEEDS_EXTENSION
def test_a_compile_error_names_the_compiler_and_the_unit_with_the_error_it_printed(tmp_path):
    compiler = failing(tmp_path)
    result = run(FEATURES, TORCH_CTXEXT_CACHE=tmp_path / "cache", CXX=compiler)
    reason = next(iter(unavailable(result).values()))
    assert re.search(rf"the C\+\+ compiler `{re.escape(str(compiler))}` \(from \$CXX\) failed on unit_\w+\.cpp "
                     r"\(csrc/[^)]*\)(: exit status 1)?: failing-c\+\+: error: this compiler always fails", reason), reason
    assert "fails without saying why" not in reason  # it said what is wrong with the code


@NEEDS_EXTENSION
@pytest.mark.parametrize("compiler, says", [
    ("/nonexistent/g++", "no C++ compiler: `/nonexistent/g++` (from $CXX) does not exist; install one"),
    (os.__file__, f"no C++ compiler: `{os.__file__}` (from $CXX) is not an executable file; install one"),
    ("no-such-c++", "no C++ compiler: `no-such-c++` (from $CXX) is not on PATH; install one"),
])
def test_a_compiler_that_cannot_be_run_is_named_with_why(tmp_path, compiler, says):
    result = run(FEATURES, TORCH_CTXEXT_CACHE=tmp_path / "cache", CXX=compiler)
    reason = next(iter(unavailable(result).values()))
    assert says in reason, reason
    assert "or install a wheel built for this torch" in reason
    assert not re.search(r"torch_ctxext: \[\d+/\d+\]", result.stderr)  # nothing was compiled


@pytest.mark.parametrize("failed_line, code", [("FAILED: unit_a.o ", None), ("FAILED: [code=3] unit_a.o ", 3)])
def test_a_step_ninja_calls_failed_is_shown_failed_even_if_it_left_its_file(tmp_path, capsys, failed_line, code):
    """ninja prints a step's line when it ends, then FAILED; a step whose
    object is missing is failed at once, one whose object is there (a
    compiler that wrote it, then failed) is shown again as failed."""
    import json

    from _torch_ctxext_build import build_child as _child

    (tmp_path / "unit_a.cpp").write_text('#include "/src/csrc/one.cpp"\n#include "/src/csrc/two.cpp"\n')
    (tmp_path / "unit_a.o").write_bytes(b"")  # written, yet the step fails
    steps = _child.NinjaSteps(str(tmp_path))
    command = "c++ -MMD -MF unit_a.o.d -c unit_a.cpp -o unit_a.o"
    for line in [f"[1/3] {command}", failed_line, command, "unit_a.cpp:1: error: no", "second line",
                 "[2/3] c++ -c unit_b.cpp -o unit_b.o", "ninja: build stopped: subcommand failed."]:
        steps.line(line + "\n")
    told = [json.loads(line)["progress"] for line in capsys.readouterr().out.splitlines()]
    assert told == [[1, 3, "compiled unit_a.cpp"], [1, 3, "failed to compile unit_a.cpp"],
                    [2, 3, "failed to compile unit_b.cpp"]]
    (failed,) = steps.failed
    assert failed["what"] == "failed on unit_a.cpp (csrc/one.cpp, csrc/two.cpp)"
    assert failed["code"] == code and failed["output"] == ["unit_a.cpp:1: error: no", "second line"]
