"""Find a CPython on this machine: pyenv's where there is one, else on PATH.

The one place tools/run.py and tools/wheels.py look for an interpreter, so
that neither depends on ``~/.pyenv`` existing (most machines have none)::

    python3 tools/find_cpython.py 3.11     # prints its path, or says in one line it is missing (exit 1)
    python3 tools/find_cpython.py any      # 3.11 if it is here, else this python3 if it is 3.10 or newer

Standard library only: it runs before any virtual environment exists.
"""
import glob
import os
import re
import shutil
import sys

# The CPython the project's own venvs use when nothing else is asked for:
# the one this machine's local torch wheel is built for.
PREFERRED = "3.11"
OLDEST = (3, 10)


def _patch_level(path):
    """3.11.10 sorts after 3.11.7: compare the numbers, not the text."""
    match = re.search(r"/versions/(\d+)\.(\d+)\.(\d+)", path)
    return tuple(int(n) for n in match.groups()) if match else (0, 0, 0)


def find(version):
    """The path of CPython ``version`` ('3.11'), or None."""
    home = os.path.expanduser("~")
    pyenv = glob.glob(os.path.join(home, ".pyenv", "versions", f"{version}.*", "bin", f"python{version}"))
    pyenv = [path for path in pyenv if os.access(path, os.X_OK)]
    if pyenv:
        return max(pyenv, key=_patch_level)
    return shutil.which(f"python{version}")


def any_supported():
    """(path, '3.X'): the preferred CPython if it is here, else the running
    python3 where it is new enough; None otherwise."""
    path = find(PREFERRED)
    if path:
        return path, PREFERRED
    if sys.version_info[:2] >= OLDEST:
        return sys.executable, f"{sys.version_info[0]}.{sys.version_info[1]}"
    return None


def main(argv):
    if len(argv) != 1:
        sys.stderr.write("usage: python3 tools/find_cpython.py 3.X|any\n")
        return 2
    if argv[0] == "any":
        found = any_supported()
        if found is None:
            sys.stderr.write(
                f"no CPython {PREFERRED} here and python3 is {sys.version.split()[0]}: "
                f"install CPython {OLDEST[0]}.{OLDEST[1]} or newer (python{PREFERRED} on PATH is enough)\n"
            )
            return 1
        print(f"{found[0]} {found[1]}")
        return 0
    path = find(argv[0])
    if path is None:
        sys.stderr.write(f"no CPython {argv[0]} here: put python{argv[0]} on PATH (or `pyenv install {argv[0]}`)\n")
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
