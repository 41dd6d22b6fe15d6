"""tools/run.py, the driver of the README's commands and CI: standard
library only and Python 3.8 syntax (it runs before any venv exists); the
releases from the build layer (_torch_ctxext_build.releases); test files found by basename
wherever they lie under test/; commands whose failure stops the job with
their output; background tasks two at a time; side-by-side steps reported in
order; the files that cannot share the machine run alone after the
parallel pass.
"""
import ast
import os
import sys
import threading

import pytest

from torch_ctxext import _releases
from support import ROOT, python

TOOLS = os.path.join(ROOT, "tools")
DRIVER = [os.path.join(TOOLS, name) for name in ("run.py", "run_jobs.py", "run_steps.py", "run_venvs.py",
                                                 "package_copy.py")]

import package_copy
import run_jobs
import run_steps
import run_venvs


def test_the_driver_imports_the_standard_library_only_and_parses_as_python_3_8():
    own = {"find_cpython", "run_jobs", "run_steps", "run_venvs", "package_copy"}
    for path in DRIVER:
        source = open(path).read()
        tree = ast.parse(source, feature_version=(3, 8))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in own or top == "_torch_ctxext_build", (path, name)


def test_the_release_facts_come_from_the_release_module_and_leave_sys_path_as_it_was():
    before = list(sys.path)
    facts = run_venvs.release_facts()
    assert sys.path == before
    assert facts.releases == list(_releases.RELEASES)
    assert facts.ci_releases == list(_releases.CI_RELEASES)
    assert (facts.reference, facts.default, facts.oldest) == (
        _releases.REFERENCE, _releases.DEFAULT, _releases.RELEASES[0])


def test_a_test_file_is_found_by_its_basename_wherever_it_lies_under_test(tmp_path):
    (tmp_path / "test" / "contract").mkdir(parents=True)
    (tmp_path / "test" / "contract" / "test_a.py").write_text("")
    assert run_steps.find_test(str(tmp_path), "test_a.py") == str(tmp_path / "test" / "contract" / "test_a.py")
    with pytest.raises(run_steps.Failed, match=r"test/\*\*/test_b.py: 0 files found"):
        run_steps.find_test(str(tmp_path), "test_b.py")
    (tmp_path / "test" / "test_a.py").write_text("")
    with pytest.raises(run_steps.Failed, match="2 files found"):
        run_steps.find_test(str(tmp_path), "test_a.py")


def test_every_test_file_the_driver_names_exists():
    source = open(os.path.join(TOOLS, "run_jobs.py")).read()
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("test_") and node.value.endswith(".py"):
                names.add(node.value)
    assert len(names) > 10
    for name in names:
        run_steps.find_test(ROOT, name)


def test_a_job_without_a_name_or_with_an_unknown_one_gets_the_usage():
    for args in ([], ["nonsense"]):
        result = python(os.path.join(TOOLS, "run.py"), *args, timeout=60)
        assert result.returncode == 2
        assert result.stderr.startswith("usage: python3 tools/run.py check|test|matrix")


def test_a_failing_command_raises_with_what_it_printed(tmp_path):
    log = str(tmp_path / "log")
    with pytest.raises(run_steps.Failed, match=r"(?s)said this.*exit 3"):
        run_steps.command([sys.executable, "-c", "print('said this'); raise SystemExit(3)"], log=log)
    assert run_steps.command([sys.executable, "-c", "import os; print(os.environ.get('A'), os.environ.get('HOME'))"],
                             env={"A": "1", "HOME": None}, log=log).split() == ["1", "None"]


def test_background_tasks_run_two_at_a_time_and_a_failure_is_raised_at_the_wait(tmp_path):
    first, second = threading.Event(), threading.Event()

    def meet(mine, other):
        def task(log):
            mine.set()
            assert other.wait(60), "the other task never ran beside this one"
        return task

    def fails(log):
        raise run_steps.Failed("no such torch")

    background = run_steps.Background(str(tmp_path), workers=2)
    background.submit("one", meet(first, second))
    background.submit("two", meet(second, first))
    background.submit("three", fails)
    background.submit("four", lambda log: "four's result")
    background.start()
    background.wait("one")
    background.wait("two")
    assert background.wait("four") == "four's result" and background.seconds("four") >= 0
    with pytest.raises(run_steps.Failed, match="three failed: no such torch"):
        background.wait("three")


def test_side_by_side_steps_are_reported_in_order_and_the_first_failure_raised_once_all_are_done(capsys):
    finished = []
    slow_may_end = threading.Event()

    def slow():
        assert slow_may_end.wait(60)
        finished.append("slow")
        return "slow said"

    def fast():
        finished.append("fast")
        slow_may_end.set()
        raise run_steps.Failed("fast failed")

    steps = run_steps.Steps()
    with pytest.raises(run_steps.Failed, match="fast failed"):
        steps.together(("the slow one", slow), ("the fast one", fast))
    assert sorted(finished) == ["fast", "slow"]
    out = capsys.readouterr().out
    assert out.index("== the slow one") < out.index("slow said") < out.index("== the fast one")
    steps.summary("job")
    assert "the slow one" in capsys.readouterr().out


def test_files_that_cannot_share_the_machine_run_alone_after_the_parallel_pass(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(run_jobs, "command", lambda args, env=None, log=None, cwd=None: calls.append(args) or "1 passed")
    alone = run_steps.find_test(ROOT, "test_release_facts.py")
    other = run_steps.find_test(ROOT, "test_run_driver.py")
    tests = os.path.join(ROOT, "test")

    run_jobs.Job.pytest(None, "python", [tests, "--pyargs", "x"], str(tmp_path / "log"), serial=["test_release_facts.py"])
    parallel, serial = calls
    assert parallel[-4:] == [tests, "--pyargs", "x", f"--ignore={alone}"] and "-n" in parallel
    assert serial[-1] == alone and "-n" not in serial

    calls.clear()
    run_jobs.Job.pytest(None, "python", [alone, other], str(tmp_path / "log"), serial=["test_release_facts.py"])
    parallel, serial = calls
    assert alone not in parallel and other in parallel and serial[-1] == alone

    calls.clear()
    run_jobs.Job.pytest(None, "python", [alone], str(tmp_path / "log"), serial=["test_release_facts.py"])
    assert calls == [serial]


def test_the_snapshot_a_background_build_reads_is_the_tree_without_its_build_outputs_and_with_its_times(
        monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_CTXEXT_CACHE", str(tmp_path))
    job = run_jobs.Job()
    try:
        copy = job.snapshot()
    finally:
        os.rmdir(job.out)
    assert copy == str(tmp_path / "sources")
    for name in (".git", "build", "dist", "torch_ctxext.egg-info"):
        assert not os.path.exists(os.path.join(copy, name)), name
    for path in ("setup.py", os.path.join("csrc", "module.cpp"), os.path.join("tools", "wheels.py")):
        original = os.path.join(ROOT, path)
        assert os.stat(os.path.join(copy, path)).st_mtime == os.stat(original).st_mtime, path
    assert sorted(os.listdir(os.path.join(copy, "csrc"))) == sorted(
        n for n in os.listdir(os.path.join(ROOT, "csrc")) if n != "__pycache__")


def test_a_second_snapshot_leaves_each_unchanged_file_with_its_time_so_that_ninja_compiles_only_what_changed(
        tmp_path):
    """A fresh clone's files are all new; the copy keeps the old times of the
    files whose bytes did not change, copies the others, drops what went."""
    tree, copy = tmp_path / "clone", tmp_path / "sources"
    (tree / "csrc").mkdir(parents=True)
    (tree / "csrc" / "same.cpp").write_text("int same;\n")
    (tree / "csrc" / "changed.cpp").write_text("int before;\n")
    (tree / "csrc" / "gone.cpp").write_text("int gone;\n")
    (tree / "build").mkdir()
    (tree / "build" / "x.o").write_bytes(b"")
    package_copy.synced_copy(str(tree), str(copy))
    old = 1_000_000_000
    for name in ("same.cpp", "changed.cpp"):
        os.utime(copy / "csrc" / name, (old, old))
    # The next clone: the same file again (a new time), one changed, one gone, one new.
    (tree / "csrc" / "same.cpp").write_text("int same;\n")
    (tree / "csrc" / "changed.cpp").write_text("int after;\n")
    (tree / "csrc" / "gone.cpp").unlink()
    (tree / "csrc" / "new.h").write_text("#pragma once\n")
    package_copy.synced_copy(str(tree), str(copy))
    assert os.stat(copy / "csrc" / "same.cpp").st_mtime == old
    assert (copy / "csrc" / "changed.cpp").read_text() == "int after;\n"
    assert os.stat(copy / "csrc" / "changed.cpp").st_mtime == os.stat(tree / "csrc" / "changed.cpp").st_mtime
    assert sorted(os.listdir(copy / "csrc")) == ["changed.cpp", "new.h", "same.cpp"]
    assert not (copy / "build").exists()


def _venv(tmp_path, *dist_infos):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\n")
    (venv / "bin" / "python").chmod(0o755)
    for name in dist_infos:
        (venv / "lib" / "python3.11" / "site-packages" / name).mkdir(parents=True)
    return str(venv)


@pytest.mark.parametrize("version, answer", [("2.13.0", True), ("2.13.1", False), ("2.1", False), ("2.13", False)])
def test_a_cached_venv_holds_a_release_when_pip_recorded_that_torch_any_local_build_of_it(tmp_path, version, answer):
    venvs = run_venvs.Venvs(str(tmp_path), run_venvs.release_facts())
    assert venvs.has_torch(_venv(tmp_path, "torch-2.13.0+cpu.dist-info"), version) is answer


def test_a_venv_without_pips_record_of_torch_or_without_its_python_is_made_again(tmp_path):
    venvs = run_venvs.Venvs(str(tmp_path), run_venvs.release_facts())
    assert venvs.has_torch(_venv(tmp_path / "a", "torch-2.15.0.dist-info"), "2.15.0")
    assert not venvs.has_torch(_venv(tmp_path / "b", "numpy-2.0.0.dist-info"), "2.15.0")
    assert not venvs.has_torch(str(tmp_path / "none"), "2.15.0")


def test_a_cached_venv_is_asked_for_the_test_tools_again_only_when_their_list_changed(tmp_path, monkeypatch):
    calls = []

    def pip(args, env=None, log=None, **kwargs):
        calls.append(args[5:])  # python -m pip install -q ...
        if "broken" in args:
            raise run_steps.Failed("pip failed")
        return ""
    monkeypatch.setattr(run_venvs, "command", pip)
    venvs = run_venvs.Venvs(str(tmp_path), run_venvs.release_facts())
    venv = _venv(tmp_path)
    venvs._install_deps(venv, ["pytest", "numpy"], {}, None)
    venvs._install_deps(venv, ["pytest", "numpy"], {}, None)
    assert calls == [["pytest", "numpy"]]
    venvs._install_deps(venv, ["pytest", "numpy", "transformers==5.23.0"], {}, None)
    assert calls[-1] == ["pytest", "numpy", "transformers==5.23.0"]
    with pytest.raises(run_steps.Failed):
        venvs._install_deps(venv, ["broken"], {}, None)
    calls.clear()
    with pytest.raises(run_steps.Failed):  # a failed install is asked again next time
        venvs._install_deps(venv, ["broken"], {}, None)
    assert calls == [["broken"]]


def test_a_venv_a_tool_was_uninstalled_from_or_whose_requirements_file_changed_is_asked_again(
        tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(run_venvs, "command", lambda args, env=None, log=None, **kwargs: calls.append(args[3:]))
    venvs = run_venvs.Venvs(str(tmp_path), run_venvs.release_facts())
    venv = _venv(tmp_path)
    requirements = tmp_path / "requirements-docs.txt"
    requirements.write_text("sphinx==7.2.6\n")
    for _ in range(2):
        venvs._install_deps(venv, ["pytest", "ninja"], {}, None, requirements=str(requirements))
    assert calls == [["install", "-q", "pytest", "ninja", "-r", str(requirements)]]
    requirements.write_text("sphinx==7.3.0\n")
    venvs._install_deps(venv, ["pytest", "ninja"], {}, None, requirements=str(requirements))
    assert len(calls) == 2
    venvs.uninstall(venv, ["ninja"])  # as the wheel check does
    assert calls[-1] == ["uninstall", "-q", "-y", "ninja"]
    venvs._install_deps(venv, ["pytest", "ninja"], {}, None, requirements=str(requirements))
    assert calls[-1] == ["install", "-q", "pytest", "ninja", "-r", str(requirements)]
