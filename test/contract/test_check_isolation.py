"""The conformance suite checks torch, not the project it is run from.

A project's conftest.py (an autouse fixture that seeds, sets the default
dtype or device), its ini file (addopts, which test functions to collect)
and PYTEST_ADDOPTS must not change what ``python -m torch_ctxext check``
runs, nor what a plain ``pytest --pyargs torch_ctxext.conformance`` loads:
otherwise the report says "does not conform" and blames torch."""
import os
import textwrap
from support import ROOT, python

SUBSET = "apply_jvp"  # one member, fast


def a_users_project(tmp_path):
    """A repository whose conftest.py files (one in the directory the
    command runs in, one in its parent) and ini would break the suite; the
    directory to run in."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        import pytest
        import torch

        @pytest.fixture(autouse=True)
        def _float64():
            torch.set_default_dtype(torch.float64)
            yield
            torch.set_default_dtype(torch.float32)
    """))
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.fixture(autouse=True)
        def _seeded():
            raise RuntimeError("the caller's conftest.py ran")
    """))
    return project


def the_users_ini(project):
    (project / "pytest.ini").write_text(textwrap.dedent("""
        [pytest]
        addopts = -k not_a_test_of_the_suite
        python_functions = check_*
    """))


def _plugin(cwd):
    """``-p torch_ctxext_pytest`` where the plugin's entry point is not
    installed (a source tree on the path); nothing where it is (pytest would
    refuse to register it twice)."""
    done = run(["-c", "import importlib.metadata as m; print(any(ep.value == 'torch_ctxext_pytest' "
                      "for ep in m.entry_points(group='pytest11')))"], cwd)
    return [] if done.stdout.strip() == "True" else ["-p", "torch_ctxext_pytest"]


def run(args, cwd, **env):
    return python(*args, cwd=cwd, timeout=600, path=[ROOT], **env)


def test_check_runs_the_suite_without_the_callers_conftest_ini_or_pytest_addopts(tmp_path):
    project = a_users_project(tmp_path)
    the_users_ini(project)
    done = run(["-m", "torch_ctxext", "check", "-k", SUBSET], project,
               PYTEST_ADDOPTS="-k not_a_test_of_the_suite_either")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.rstrip().splitlines()[-1].startswith("verdict: conforms"), out  # upstream deviations allowed
    assert "the caller's conftest.py ran" not in out + done.stderr
    suite = os.path.join(ROOT, "torch_ctxext", "conformance")
    assert (f"isolated from the caller's directory: rootdir {suite}, no conftest.py or ini of the caller"
            in out.splitlines()), out


def test_check_of_the_whole_suite_is_not_changed_by_a_conftest_setting_the_default_dtype(tmp_path):
    """The dtype fixture alone, over more of the suite than one member."""
    a_users_project(tmp_path)
    done = run(["-m", "torch_ctxext", "check", "-k", "apply or save_for"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().splitlines()[-1].startswith("verdict: conforms"), done.stdout


def test_pytest_on_the_suite_alone_loads_no_conftest_of_the_callers_directory(tmp_path):
    project = a_users_project(tmp_path)
    done = run(["-m", "pytest", *_plugin(project), "-p", "no:cacheprovider",
                "--pyargs", "torch_ctxext.conformance", "-k", SUBSET], project)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the caller's conftest.py ran" not in done.stdout
    assert "ctx contract conformance: isolated from the caller's directory" in done.stdout, done.stdout


def test_pytest_on_the_suite_says_when_an_ini_of_the_callers_directory_applies(tmp_path):
    project = a_users_project(tmp_path)
    (project / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: a marker of the project\n")
    done = run(["-m", "pytest", *_plugin(project), "-p", "no:cacheprovider",
                "--pyargs", "torch_ctxext.conformance", "-k", SUBSET], project)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("ctx contract conformance: NOT isolated from the caller's directory "
            f"(rootdir {project}): loaded ini {project / 'pytest.ini'}") in done.stdout, done.stdout


def test_pytest_with_other_targets_too_loads_their_conftest(tmp_path):
    """Only a run of the suite alone is isolated: a project's own tests get
    their conftest.py."""
    project = a_users_project(tmp_path)
    (project / "test_mine.py").write_text("def test_mine():\n    pass\n")
    done = run(["-m", "pytest", *_plugin(project), "-p", "no:cacheprovider",
                "test_mine.py"], project)
    assert done.returncode == 1 and "the caller's conftest.py ran" in done.stdout, done.stdout
