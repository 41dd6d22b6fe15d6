"""The release facts and the virtual environments tools/run.py runs in.

Virtual environments are cached outside the clone, in $TORCH_CTXEXT_CACHE
(default ~/.cache/torch_ctxext), one per torch release (and CPython, where it
is not 3.11), so a second run downloads nothing. torch_ctxext is installed
into each from source, and its first import there builds the extension for
that torch into $TORCH_CTXEXT_CACHE/builds, as a user's would.

Standard library only, Python 3.8 and newer.
"""
import glob
import hashlib
import os
import shutil
import sys
import tempfile
import threading

import find_cpython  # beside this file (tools/ is on sys.path when run.py runs)
from run_steps import command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What every venv gets besides torch (pytest-xdist: the suites use both cores).
TEST_DEPS = ("numpy", "pytest", "pytest-xdist", "hypothesis", "expecttest", "ninja", "setuptools>=70,<82", "wheel")
# Test-only: the real architectures of test_advise_transformers.py, in the
# default release's venv and native 2.15's (never a dependency of the package).
MODEL_TEST_DEPS = ("transformers==5.23.0",)


class Facts:
    """The facts tools/run.py needs from torch_ctxext/_releases.py."""

    def __init__(self, releases, ci_releases, reference, default):
        self.releases = list(releases)        # every supported release, oldest first
        self.ci_releases = list(ci_releases)  # what `test` runs besides the default
        self.reference = reference            # native torch 2.15: the behaviour reference
        self.default = default                # on this machine's disk: `check`, CI's main run
        self.oldest = self.releases[0]


# --- what the driver takes from the rest of the tree (the two places) --------------


def cpython(version):
    """The path of CPython ``version`` ('3.11') here (tools/find_cpython.py:
    pyenv's, else on PATH), or None."""
    return find_cpython.find(version)


def cpython_for_check():
    """(path, '3.X') of the CPython ``check`` uses: 3.11 where it is here,
    else the running python3 where it is 3.10 or newer; or a SystemExit that
    says in one line what to install."""
    found = find_cpython.any_supported()
    if found is None:
        raise SystemExit(
            f"no CPython {find_cpython.PREFERRED} here and python3 is {sys.version.split()[0]}: install CPython "
            f"{find_cpython.OLDEST[0]}.{find_cpython.OLDEST[1]} or newer (python{find_cpython.PREFERRED} on PATH "
            "is enough)")
    return found


def release_facts(root=ROOT):
    """The release facts, from the build layer (``_torch_ctxext_build.releases``,
    standard library only), imported from ``root``: the one place this driver
    touches the tree's Python."""
    saved = list(sys.path)
    sys.path.insert(0, root)
    try:
        from _torch_ctxext_build import releases
    finally:
        sys.path[:] = saved
    return Facts(releases.RELEASES, releases.CI_RELEASES, releases.REFERENCE, releases.DEFAULT)


class Venvs:
    """The cached venvs: where each is, how pip runs for it, what goes in."""

    def __init__(self, cache, facts, root=ROOT):
        self.cache = cache
        self.facts = facts
        self.root = root
        # pip installs from the source tree build in it: one at a time.
        self.tree = threading.Lock()

    def pip_env(self, version, python="3.11"):
        """The environment pip runs with for torch ``version`` on CPython ``python``.

        This machine's pip configuration caps torch at what lies on its disk
        (the default release, for CPython 3.11); the other releases and
        CPythons come from the package index itself. No cache: it would
        double the disk each release takes (5 to 7 GB)."""
        if version == self.facts.default and python == "3.11":
            return {"PIP_NO_CACHE_DIR": "1"}
        return {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_CACHE_DIR": "1"}

    def dir(self, version, python=None):
        """Where the venv for torch ``version`` on CPython ``python`` is cached."""
        if python in (None, "3.11"):
            return os.path.join(self.cache, f"venv-{version}")
        return os.path.join(self.cache, f"venv-{version}-py{python}")

    @staticmethod
    def python(venv):
        return os.path.join(venv, "bin", "python")

    def has_torch(self, venv, version):
        """Whether ``venv`` exists with torch ``version`` (any local build of
        it), as pip recorded it: torch is not imported (a CUDA build's first
        import reads gigabytes, and every cached venv is asked at each run).
        pip writes the record once the files are in, so an interrupted
        install has none, and the venv is made again."""
        if not os.access(self.python(venv), os.X_OK):
            return False
        pattern = os.path.join(venv, "lib", "python3*", "site-packages", f"torch-{version}.dist-info")
        local = os.path.join(venv, "lib", "python3*", "site-packages", f"torch-{version}+*.dist-info")
        return bool(glob.glob(pattern) or glob.glob(local))

    # What a venv was last given, kept in it: a file of that name, holding a
    # text that says what (a digest, or a list of requirements).
    DEPS_STAMP = ".torch_ctxext-deps"
    TESTDEVICE_STAMP = ".testdevice-hash"

    @staticmethod
    def _stamped(venv, name, value):
        """Whether the stamp ``name`` in ``venv`` says ``value``."""
        try:
            with open(os.path.join(venv, name)) as f:
                return f.read().strip() == value.strip()
        except OSError:
            return False

    @staticmethod
    def _stamp(venv, name, value):
        with open(os.path.join(venv, name), "w") as f:
            f.write(value.strip() + "\n")

    def _install_deps(self, venv, deps, env, log, requirements=None):
        """pip install ``deps`` (and the ``requirements`` file) into ``venv``,
        unless the same went in last time (a stamp in the venv, written once
        pip succeeded): asking pip again costs each cached venv a second or
        two of every run. :meth:`uninstall` forgets the stamp."""
        args = list(deps)
        wanted = "\n".join(deps)
        if requirements is not None:
            args += ["-r", requirements]
            with open(requirements) as f:
                wanted += "\n" + f.read()
        if self._stamped(venv, self.DEPS_STAMP, wanted):
            return
        command([self.python(venv), "-m", "pip", "install", "-q"] + args, env=env, log=log)
        self._stamp(venv, self.DEPS_STAMP, wanted)

    def uninstall(self, venv, names, log=None):
        """pip uninstall ``names`` from ``venv``; the next :meth:`create`
        installs the test tools again."""
        try:
            os.remove(os.path.join(venv, self.DEPS_STAMP))
        except FileNotFoundError:
            pass
        command([self.python(venv), "-m", "pip", "uninstall", "-q", "-y"] + list(names), log=log)

    def create(self, version, python="3.11", venv=None, log=None):
        """A venv with torch ``version`` and the test tools (made where it is
        missing or holds another torch); return its path."""
        venv = venv or self.dir(version, python)
        env = self.pip_env(version, python)
        if not self.has_torch(venv, version):
            shutil.rmtree(venv, ignore_errors=True)
            interpreter = cpython(python)
            if interpreter is None:
                raise RuntimeError(f"no CPython {python} here: put python{python} on PATH (or `pyenv install {python}`)")
            command([interpreter, "-m", "venv", venv], log=log)
            command([self.python(venv), "-m", "pip", "install", "-q", f"torch=={version}"], env=env, log=log)
        deps = list(TEST_DEPS)
        if version in (self.facts.default, self.facts.reference):
            deps += MODEL_TEST_DEPS
        self._install_deps(venv, deps, env, log)
        return venv

    def install_sources(self, venv, log=None):
        """torch_ctxext from the source tree, nothing compiled: its first import builds."""
        with self.tree:
            command([self.python(venv), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", self.root],
                    env={"TORCH_CTXEXT_BUILD_EXT": "0"}, log=log)

    def install_testdevice(self, venv, log=None):
        """The test device (tools/testdevice), built for the venv's torch; built
        again only when its sources change (their digest is kept in the venv).
        Return a line saying it was built, or ''."""
        source = os.path.join(self.root, "tools", "testdevice")
        digest = hashlib.sha256()
        for folder, dirs, files in os.walk(source):
            dirs[:] = sorted(d for d in dirs if not (folder == source and d == "build"))
            for name in sorted(files):
                if name.endswith((".cpp", ".h", ".py", ".toml")):
                    path = os.path.join(folder, name)
                    digest.update(os.path.relpath(path, source).encode() + b"\0")
                    with open(path, "rb") as f:
                        digest.update(hashlib.sha256(f.read()).digest())
        if self._stamped(venv, self.TESTDEVICE_STAMP, digest.hexdigest()[:16]):
            return ""
        copy = tempfile.mkdtemp(prefix="torch_ctxext-testdevice.")
        try:
            shutil.rmtree(copy)
            shutil.copytree(source, copy, ignore=shutil.ignore_patterns("build"))
            command([self.python(venv), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", copy],
                    log=log)
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        self._stamp(venv, self.TESTDEVICE_STAMP, digest.hexdigest()[:16])
        return "test device built"

    def docs(self, log=None):
        """torch (the default release), the test tools, the documentation tools
        and the benchmarks' real models, without torch_ctxext; return its path."""
        venv = os.path.join(self.cache, "venv-docs")
        default = self.facts.default
        env = self.pip_env(default)
        if not self.has_torch(venv, default):
            shutil.rmtree(venv, ignore_errors=True)
            command([sys.executable, "-m", "venv", venv], log=log)
            command([self.python(venv), "-m", "pip", "install", "-q", f"torch=={default}"], env=env, log=log)
        self._install_deps(venv, list(TEST_DEPS) + list(MODEL_TEST_DEPS), env, log,
                           requirements=os.path.join(self.root, "requirements-docs.txt"))
        return venv

    def wheel_builder(self, log=None):
        """A small venv with ninja, for tools/wheels.py; return its python."""
        venv = os.path.join(self.cache, "venv-wheels")
        if not os.access(os.path.join(venv, "bin", "ninja"), os.X_OK):
            shutil.rmtree(venv, ignore_errors=True)
            command([sys.executable, "-m", "venv", venv], log=log)
            command([self.python(venv), "-m", "pip", "install", "-q", "ninja"], env={"PIP_CONFIG_FILE": os.devnull},
                    log=log)
        return self.python(venv)
