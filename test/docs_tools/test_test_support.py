"""What the tests' shared helpers (test/support.py) promise the tests that use them.

* a child's environment is a fresh shell's: none of this run's
  ``TORCH_CTXEXT_*``, ``PYTHON*`` or ``CXX``; then what the test sets
  (None removes), and a setting that is not an upper-case name is refused
  (a misspelt keyword of the helper would otherwise become a variable);
* a Python child imports the same torch_ctxext as this process;
* ``wait_until`` returns the condition's value, or fails naming what never
  happened; ``reap`` ends a child that does not exit by itself.
"""
import os
import time

import pytest

import support


def test_a_child_environment_has_none_of_this_runs_settings_and_then_what_the_test_sets(monkeypatch):
    monkeypatch.setenv("TORCH_CTXEXT_CACHE", "/somewhere")
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    monkeypatch.setenv("CXX", "/usr/bin/false")
    monkeypatch.setenv("KEPT_BY_THE_HELPER", "1")
    env = support.clean_env(TORCH_CTXEXT_IMPORT=1, KEPT_BY_THE_HELPER=None)
    assert "TORCH_CTXEXT_CACHE" not in env and "PYTHONHASHSEED" not in env and "CXX" not in env
    assert env["TORCH_CTXEXT_IMPORT"] == "1"
    assert "KEPT_BY_THE_HELPER" not in env


@pytest.mark.parametrize("misspelt", ["timeout_seconds", "Cwd", "pythonpath"])
def test_a_setting_that_is_not_an_upper_case_name_is_refused_naming_it(misspelt):
    with pytest.raises(TypeError, match=f"^{misspelt}=1: environment settings are upper-case names"):
        support.clean_env(**{misspelt: 1})
    with pytest.raises(TypeError, match=misspelt):
        support.python(code="pass", **{misspelt: 1})


def test_a_python_child_imports_the_same_torch_ctxext_as_this_process():
    import importlib.util

    here = importlib.util.find_spec("torch_ctxext").origin
    result = support.python(code="import importlib.util; print(importlib.util.find_spec('torch_ctxext').origin)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == here


def test_wait_until_returns_the_value_or_fails_naming_what_never_happened():
    values = iter([0, None, "ready"])
    assert support.wait_until(lambda: next(values), 5, "the third value", interval=0.001) == "ready"
    start = time.monotonic()
    with pytest.raises(AssertionError, match="^the lock was released: not within 0.2 s$"):
        support.wait_until(lambda: False, 0.2, "the lock was released", interval=0.01)
    assert time.monotonic() - start < 5


def test_reap_kills_a_child_that_does_not_exit_and_returns_how_it_ended():
    child = support.start_python(code="import time; time.sleep(600)")
    assert support.reap(child, timeout=0.5) == -9
    assert support.reap(support.start_python(code="raise SystemExit(3)")) == 3
    pid = os.fork()
    if pid == 0:
        os._exit(5)
    assert support.reap(pid) == 5
