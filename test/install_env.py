"""A user's environment for the install tests: a throwaway venv that sees the
running torch, and what the tests run in it.

Nothing here touches the running installation: the tests install into a
virtual environment that has the running torch (its site-packages symlinked,
as a user's environment would have it) but no torch_ctxext, and build into
throwaway caches. test_install.py and test_first_import.py import the
fixtures below.
"""
import glob
import os
import shutil
import site
import subprocess
import sys

import pytest

import torch_ctxext
from package_copy import CHECKOUT_OUTPUTS
from support import ROOT, clean_env, run  # noqa: F401  (the tests import them from here too)

CSRC = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "csrc", "*.[ch]*")))
# The members torch_ctxext adds to this torch with its C++ extension.
BACKPORTED = [m for m, s in torch_ctxext.features().items() if s != "native"]
needs_extension = pytest.mark.skipif(not BACKPORTED, reason="the running torch needs no extension")
BUILD_TIMEOUT = 1200  # a build takes about 20 s on 2 idle cores; CI machines are not idle
ANNOUNCE = "torch_ctxext: building its C++ extension for torch"
LOADED = "import torch_ctxext, torch_ctxext._ext.loader as e; print(e.loaded.origin, e.loaded.path)"




class UserEnv:
    """A virtual environment that has the running torch (and what it needs)
    but no torch_ctxext: a user's environment before ``pip install``."""

    def __init__(self, base):
        self.dir = base / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(self.dir)], check=True)
        self.python = self.dir / "bin" / "python"
        shared = base / "shared-site-packages"
        shared.mkdir()
        for site_packages in site.getsitepackages():
            for entry in os.listdir(site_packages):
                skip = entry.lower().startswith(("torch_ctxext", "__editable__", "__pycache__"))
                if not skip and not entry.endswith(".pth") and not (shared / entry).exists():
                    os.symlink(os.path.join(site_packages, entry), shared / entry)
        purelib = run([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        self.site_packages = purelib.stdout.strip()
        with open(os.path.join(self.site_packages, "_shared.pth"), "w") as f:
            f.write(f"{shared}\n")

    def pip(self, *args, timeout=600, **env):
        return run([self.python, "-m", "pip", *args], timeout=timeout, **env)

    def package(self):
        return os.path.join(self.site_packages, "torch_ctxext")


def copy_checkout(dest):
    """The checkout's files that an install reads (not its build outputs)."""
    shutil.copytree(
        ROOT, dest,
        ignore=shutil.ignore_patterns(*CHECKOUT_OUTPUTS, "docs", "benchmarks", "tools", "test"),
    )
    return dest


def failing_compiler(directory):
    path = os.path.join(directory, "failing-c++")
    with open(path, "w") as f:
        # A compiler that says what it is (torch asks) and fails to compile.
        f.write(
            "#!/bin/sh\n"
            "for a in \"$@\"; do if [ \"$a\" = -c ]; then\n"
            "  echo 'failing-c++: error: this compiler always fails' >&2; exit 1\n"
            "fi; done\n"
            "exec c++ \"$@\"\n"
        )
    os.chmod(path, 0o755)
    return path


@pytest.fixture(scope="session")
def checkout(tmp_path_factory):
    return copy_checkout(tmp_path_factory.mktemp("checkout") / "torch_ctxext")


@pytest.fixture(scope="session")
def user_env(tmp_path_factory):
    return UserEnv(tmp_path_factory.mktemp("user-env"))


@pytest.fixture(scope="session")
def installed_from_source(user_env, checkout):
    """``pip install <checkout>`` with pip's default build isolation. (No
    dependencies: whether pip must install a torch for the package's
    requirement depends on the machine's pip configuration, not on us; the
    requirement itself is checked below.)"""
    result = user_env.pip("install", "-v", "--no-deps", checkout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="session")
def sdist(checkout, tmp_path_factory):
    dist = tmp_path_factory.mktemp("sdist")
    code = "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))"
    result = subprocess.run([sys.executable, "-c", code, str(dist)], cwd=checkout,
                            capture_output=True, text=True, env=clean_env())
    assert result.returncode == 0, result.stderr
    return dist / result.stdout.strip().splitlines()[-1]
