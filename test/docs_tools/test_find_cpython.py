"""tools/find_cpython.py: how the README's commands find a CPython.

Most machines have no ``~/.pyenv``: the interpreter is found on PATH there,
and a missing one is said in one line. Where pyenv has several patch
releases, the newest by number is taken (3.11.10 after 3.11.7).
"""
import os
import subprocess
import sys

from install_env import ROOT, clean_env

FIND = os.path.join(ROOT, "tools", "find_cpython.py")
RUNNING = f"{sys.version_info[0]}.{sys.version_info[1]}"


def _find(home, *args, path=None):
    env = clean_env(HOME=home)
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, FIND, *args], capture_output=True, text=True, env=env, timeout=60)


def _fake_python(directory, name):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write("#!/bin/sh\nexit 0\n")
    os.chmod(path, 0o755)
    return path


def test_a_home_without_pyenv_finds_the_cpython_on_path(tmp_path):
    bin_dir = tmp_path / "bin"
    on_path = _fake_python(bin_dir, "python3.12")
    result = _find(str(tmp_path / "home"), "3.12", path=str(bin_dir))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == on_path


def test_a_missing_cpython_is_said_in_one_line(tmp_path):
    result = _find(str(tmp_path), "3.99", path=str(tmp_path))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "no CPython 3.99 here: put python3.99 on PATH (or `pyenv install 3.99`)"
    ]


def test_pyenv_takes_the_newest_patch_release_by_number(tmp_path):
    versions = tmp_path / ".pyenv" / "versions"
    _fake_python(versions / "3.11.7" / "bin", "python3.11")
    newest = _fake_python(versions / "3.11.10" / "bin", "python3.11")
    result = _find(str(tmp_path), "3.11", path=str(tmp_path))
    assert result.stdout.strip() == newest


def test_any_takes_the_preferred_cpython_else_the_running_python3(tmp_path):
    preferred = _fake_python(tmp_path / "bin", "python3.11")
    result = _find(str(tmp_path), "any", path=str(tmp_path / "bin"))
    assert result.stdout.split() == [preferred, "3.11"]
    # Without CPython 3.11 anywhere: the python3 that runs it (3.10 or newer).
    result = _find(str(tmp_path), "any", path=str(tmp_path / "nothing"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [sys.executable, RUNNING]
