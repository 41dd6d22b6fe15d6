"""The jobs of tools/run.py (check, test, matrix, docs, wheels, ci), and
what they share (:class:`Job`). Standard library only, Python 3.8 and newer.

The suites run on both cores (pytest-xdist, ``-n 2``), except the files in
:data:`SERIAL`, which run after them in one process. Where a job runs a
test file by name, it is found by its basename under test/ (any folder).
"""
import glob
import os
import shutil
import signal
import sys
import tempfile

import run_steps
from package_copy import synced_copy
from run_steps import Background, Failed, Steps, command, find_test, from_line, last_lines
from run_venvs import ROOT, Venvs, cpython_for_check, release_facts

# Test files whose tests cannot share the machine with another pytest
# process (found by running the suite with -n 2): they run in a pass of
# their own, one test at a time.
SERIAL = ()
# The -n 2 options: each test file's tests on one of two workers (a file's
# tests share its fixtures and run in its order, as in one process); the
# slowest tests' times go to the log, to see where the time goes.
PARALLEL = ("-n", "2", "--dist", "loadfile", "--durations", "25")
PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", ROOT)

USAGE = "usage: python3 tools/run.py check|test|matrix [--keep] [--bench]|docs|wheels [...]|ci"


# How the copy plugin_tests tests was installed -> how its step says so.
INSTALLS = {"sources": "installed from source", "wheel": "the binary wheel installed"}


class Job:
    """What every job shares: the release facts, the cache, the venvs, the
    output folder (reports, logs) and the steps' clock."""

    def __init__(self):
        self.facts = release_facts()
        self.cache = os.environ.get("TORCH_CTXEXT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                          "torch_ctxext")
        os.makedirs(self.cache, exist_ok=True)
        os.environ["TORCH_CTXEXT_CACHE"] = self.cache  # the venvs' builds go to $cache/builds
        self.venvs = Venvs(self.cache, self.facts)
        self.out = tempfile.mkdtemp(prefix="torch_ctxext-run.", dir="/tmp")
        self.steps = Steps()
        self.ci_releases = _releases_from_env("TORCH_CTXEXT_CI_RELEASES", self.facts.ci_releases)
        self.matrix_releases = _releases_from_env("TORCH_CTXEXT_RELEASES", self.facts.releases)

    def log(self, name):
        return os.path.join(self.out, name)

    def test(self, *names):
        return [find_test(ROOT, name) for name in names]

    # --- steps shared by the jobs ---------------------------------------------------

    def pytest(self, python, args, log, env=None, serial=()):
        """pytest with ``args`` on both cores; the files among ``serial``
        (basenames) that ``args`` name or hold then run alone in one process.
        Return the summary lines."""
        tests_dir = os.path.join(ROOT, "test")
        args = list(args)
        alone = []
        for name in serial:
            try:
                path = find_test(ROOT, name)
            except Failed:
                continue
            if path in args:
                args.remove(path)
                alone.append(path)
            elif tests_dir in args:
                args.append(f"--ignore={path}")
                alone.append(path)
        texts = []
        if any(not a.startswith("-") for a in args):
            texts.append(command([python] + list(PYTEST) + list(PARALLEL) + args, env=env, log=log))
        if alone:
            texts.append(command([python] + list(PYTEST) + alone, env=env, log=log + ".serial"))
        return "\n".join(last_lines(text) for text in texts)

    def report(self, version, python, env=None):
        """The conformance report, as JSON in the output folder. Where native
        torch breaks the contract, it counts upstream deviations: the suite
        checks the contract, not us."""
        text = command([python, "-m", "torch_ctxext", "check", "--json", self.log(f"check-{version}.json")],
                       env=env, log=self.log(f"check-{version}.log"), cwd="/tmp")
        return from_line(text, "ctx contract conformance on torch")

    def accelerator_tests(self, version, python, env=None):
        """The conformance suite on the test device; every accelerator test ran."""
        xml = self.log(f"device-{version}.xml")
        text = command([python] + list(PYTEST) + ["-rs", "--junitxml", xml, "--pyargs", "torch_ctxext.conformance",
                                                  "--ctx-device", "testdevice"],
                       env=env, log=self.log(f"device-{version}.log"), cwd="/tmp")
        counted = command([sys.executable, os.path.join(ROOT, "tools", "count_accelerator_tests.py"), xml],
                          log=self.log(f"device-{version}.count"))
        return last_lines(text) + "\n" + counted.rstrip()

    def import_tests(self):
        """The tests of what the import and the install do to a process, which
        each CI release runs (in one pytest run with its other tests, so that
        the two workers share them out)."""
        return ["-rs"] + self.test("test_import_leaves_the_process.py") + [
            find_test(ROOT, "test_install.py")
            + "::test_pip_install_without_build_isolation_resolves_against_the_installed_torch"]

    def venv_for(self, version, background=None):
        """The venv for ``version`` (made here, or by ``background``) with
        torch_ctxext and the test device installed; return (what was built, its python)."""
        name = f"venv-{version}"
        if background is not None and background.has(name):
            background.wait(name)
        else:
            self.venvs.create(version, log=self.log(name + ".log"))
        venv = self.venvs.dir(version)
        self.venvs.install_sources(venv, log=self.log(f"install-{version}.log"))
        said = self.venvs.install_testdevice(venv, log=self.log(f"testdevice-{version}.log"))
        return said, self.venvs.python(venv)

    def build_wheels(self, *args, root=ROOT):
        """tools/wheels.py ARGS (of the tree at ``root``), with ninja from a small venv of its own."""
        python = self.venvs.wheel_builder(log=self.log("venv-wheels.log"))
        return command([python, os.path.join(root, "tools", "wheels.py")] + list(args),
                       log=self.log("wheels-" + "-".join(a.strip("-") for a in args[:4]) + ".log"))

    def snapshot(self):
        """A copy of the source tree without its build outputs, always at the
        same place in the cache: what a build in the background reads, so
        that it never writes into the tree while a step installs from it.
        Files unchanged since the last run keep their times there
        (package_copy.synced_copy), so that the wheels' ninja builds compile
        again only what changed, from a fresh clone too."""
        return synced_copy(ROOT, os.path.join(self.cache, "sources"))

    def wheel_check(self, version, python_version, dist, background=None):
        """The binary wheel for ``python_version`` in a venv of its own, as a user
        installs it: with no build tool, the layout verdict for this torch put
        in first (as the release step does), imported and checked. Return the
        venv's python (the wheel installed)."""
        tag = "cp" + python_version.replace(".", "")
        (wheel,) = glob.glob(os.path.join(dist, f"torch_ctxext-*-{tag}-{tag}-*.whl"))
        venv = self._wheel_venv(version, python_version)
        name = os.path.basename(venv)
        if background is not None and background.has(name):
            background.wait(name)
        else:
            self.venvs.create(version, python_version, venv, log=self.log(name + ".log"))
        python = self.venvs.python(venv)
        log = self.log(f"wheel-{version}-py{python_version}.log")
        # No build tool in the venv while the wheel is checked (the tests' ninja comes back after).
        self.venvs.uninstall(venv, ["ninja"], log=log + ".uninstall")
        command([python, os.path.join(ROOT, "tools", "wheel_verdicts.py"), wheel], log=log + ".verdicts")
        command([python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", wheel],
                env=self.venvs.pip_env(version, python_version), log=log + ".install")
        # Three first imports and three later ones (the default is ten of each):
        # what is checked holds in every process or in none; the figures are only printed.
        text = command([python, os.path.join(ROOT, "tools", "wheel_check.py"), "--rounds", "3"], log=log, cwd="/tmp")
        return f"{os.path.basename(wheel)}\n{text.rstrip()}", python

    def _wheel_venv(self, version, python_version):
        if python_version == "3.11":  # not the venv the source install is tested in
            return os.path.join(self.cache, f"venv-{version}-wheel")
        return self.venvs.dir(version, python_version)

    def plugin_tests(self, version, python_version, python, install):
        """The plugin's own tests, with ninja and the test device, on the copy
        ``install`` says: "sources" (installed from the tree, built at its
        first import: the tests of that build, its lock, its failures run
        there) or "wheel" (the binary wheel already installed in that venv:
        what a test expects comes from how the copy was installed, and those
        of the build at import do not apply)."""
        if install not in INSTALLS:
            raise ValueError(f"install={install!r}: one of {', '.join(map(repr, INSTALLS))}")
        command([python, "-m", "pip", "install", "-q", "ninja"], env=self.venvs.pip_env(version, python_version),
                log=self.log(f"ninja-{version}-py{python_version}.log"))
        venv = os.path.dirname(os.path.dirname(python))
        if install == "sources":
            self.venvs.install_sources(venv, log=self.log(f"install-{version}-py{python_version}.log"))
        # The tests that need the test device run here too (the CI releases'
        # steps leave those of the oldest release to this run).
        self.venvs.install_testdevice(venv, log=self.log(f"testdevice-{version}-py{python_version}.log"))
        return self.pytest(python, [os.path.join(ROOT, "test")], self.log(f"test-{version}-py{python_version}.log"),
                           serial=SERIAL)

    def docs(self):
        venv = self.venvs.docs(log=self.log("venv-docs.log"))
        self.venvs.install_sources(venv, log=self.log("install-docs.log"))
        html = self.log("html")
        command([os.path.join(venv, "bin", "sphinx-build"), "-q", "-W", "--keep-going", "-b", "html",
                 os.path.join(ROOT, "docs"), html], log=self.log("docs.log"), cwd="/tmp")
        return f"docs built: {html}/index.html"


def _releases_from_env(variable, default):
    value = os.environ.get(variable, "").split()
    return value or list(default)


# --- the jobs ---------------------------------------------------------------------------


def check(job, args):
    """The conformance report on the CPU (the test device is not built). With a
    binary wheel for this CPython in dist/ (``tools/run.py wheels``), it is
    installed instead of the sources, and nothing is compiled. CPython 3.11
    where it is here (this machine's torch wheel is for it), else this
    python3 if it is 3.10 or newer."""
    python_version = cpython_for_check()[1]
    version = os.environ.get("TORCH_CTXEXT_TORCH") or job.facts.default
    venv = job.venvs.dir(version, python_version)
    log = job.log("venv.log")
    print(f"== setting up {venv} (torch {version}, CPython {python_version}; log: {log})", flush=True)
    try:
        job.venvs.create(version, python_version, venv, log=log)
        tag = "cp" + python_version.replace(".", "")
        wheels = sorted(glob.glob(os.path.join(ROOT, "dist", f"torch_ctxext-*-{tag}-{tag}-*.whl")))
        if wheels:
            command([job.venvs.python(venv), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
                     wheels[-1]], env=job.venvs.pip_env(version, python_version), log=log)
        else:
            job.venvs.install_sources(venv, log=log)
    except (Failed, RuntimeError) as error:
        sys.exit(str(error))
    os.chdir("/tmp")
    python = job.venvs.python(venv)
    sys.stdout.flush()
    os.execv(python, [python, "-m", "torch_ctxext", "check"])


def test(job, args):
    """Every test, on the CI subset of releases (what CI runs). What each run
    proves, so that nothing runs twice:

    * the default release (2.13, CPython 3.11, this machine's CPU build):
      test/ and the conformance suite, the broken variants, the report, the
      suite on the test device;
    * each CI release: its report and the suite on the test device; where the
      releases differ (test_release_boundaries.py), advise's report, its C++
      watch and the drop-ins with their C++ Function; the import's and the install's effect on a
      process. The oldest release runs its report and its suite on the test
      device only: the whole test/ on that same torch, with the test device
      (CPython 3.10, below), runs the rest;
    * native 2.15 (the reference): the differential checks, and the tests of
      what the stacks, advise, explain and the command line do there, once,
      with advise()'s own C++ watch built first (test_advise_watch.py checks
      that its report is Python's watch's; test_advise_module.py that without
      the build advise watches in Python);
    * the binary wheels: each installed alone and checked without a compiler
      (3.11 and 3.13 with the default release, 3.10 with the oldest); the
      plugin's own tests on the binary wheel installed (with ninja and the
      test device) on 3.13 (PyPI's CUDA build, the newest CPython), and on a
      source install on 3.10 (the oldest torch and CPython): the install
      modes a user has, the tests of the build at first import on the
      latter (and on the default release, run from the tree);
    * the documentation site.
    """
    os.chdir("/tmp")
    facts, steps, venvs = job.facts, job.steps, job.venvs
    default, reference, oldest = facts.default, facts.reference, facts.oldest
    main_wheel_versions = ("3.11", "3.13")
    # What later steps need, made in the background while the default release's suite runs.
    background = Background(job.out, workers=2)
    for version in job.ci_releases:
        background.submit(f"venv-{version}", lambda log, v=version: venvs.create(v, log=log))
    for version, python_version in [(default, p) for p in main_wheel_versions] + [(oldest, "3.10")]:
        venv = job._wheel_venv(version, python_version)
        background.submit(os.path.basename(venv),
                          lambda log, v=version, p=python_version, d=venv: venvs.create(v, p, d, log=log))
    background.submit("venv-docs", lambda log: venvs.docs(log=log))
    # The binary wheels, as users install them (tools/wheels.py): CPython 3.11
    # with this machine's CPU build of the default release, 3.13 with PyPI's
    # (CUDA) build of it, 3.10 with PyPI's oldest. Built from a copy of the
    # tree, in the background.
    dist = job.log("dist")
    sources = job.snapshot()

    def build_wheels(log):
        return (last_lines(job.build_wheels("--python", ",".join(main_wheel_versions), "--torch", default,
                                            "--out", dist, root=sources), 4) + "\n"
                + last_lines(job.build_wheels("--python", "3.10", "--torch", oldest, "--out", dist, root=sources), 3))
    background.submit("wheels", build_wheels)
    background.start()

    _, python = steps.run(f"venv, torch_ctxext and the test device, torch {default}", job.venv_for, default)
    steps.run(f"tests of the plugin and the conformance suite: torch {default} + torch_ctxext",
              job.pytest, python, [os.path.join(ROOT, "test"), "--pyargs", "torch_ctxext.conformance"],
              job.log(f"test-{default}.log"), None, SERIAL)
    steps.together(
        ("the suite reports each deliberately broken variant of the contract", lambda: last_lines(command(
            [python, os.path.join(ROOT, "tools", "broken_variants", "run.py")], log=job.log("broken.log")), 40)),
        (f"conformance report: torch {default}", job.report, default, python),
        (f"the conformance suite on the test device (testdevice): torch {default}",
         job.accelerator_tests, default, python))

    ref_python = None
    for version in job.ci_releases:
        if version == reference:
            # Everything is native: nothing of the extension is loaded, so the
            # source tree runs as it is (no build).
            def native_venv(v=version):
                background.wait(f"venv-{v}")
                venv = venvs.dir(v)
                said = venvs.install_testdevice(venv, log=job.log(f"testdevice-{v}.log"))
                return said, venvs.python(venv)
            _, ref_python = steps.run(f"venv and the test device, native torch {version}", native_venv)
            env = {"PYTHONPATH": ROOT}
            steps.together(
                (f"conformance report: torch {version}", job.report, version, ref_python, env),
                (f"the conformance suite on the test device: torch {version}",
                 job.accelerator_tests, version, ref_python, env))
            continue  # its other tests run with the reference checks (below)
        _, python = steps.run(f"venv, torch_ctxext and the test device, torch {version}", job.venv_for, version,
                           background)
        steps.together(
            (f"conformance report: torch {version}", job.report, version, python),
            (f"the conformance suite on the test device: torch {version}", job.accelerator_tests, version, python))
        if version == oldest:
            print(f"== torch {version}: where the releases differ, advise, the drop-ins and the import's effect on a "
                  "process are tested by the plugin's own tests on that torch (CPython 3.10, below)")
            continue
        steps.run(f"where the releases differ, advise's report, its C++ watch and the drop-ins, their C++ "
                  f"Function (test_release_boundaries.py, test_advise_models.py, test_advise_watch.py, test_nn.py, "
                  f"test_nn_fused_linear_route.py); the import leaves the process as import torch does, the "
                  f"install resolves against this torch: torch {version}",
                  job.pytest, python, job.test("test_release_boundaries.py", "test_advise_models.py",
                                               "test_advise_watch.py", "test_nn.py",
                                               "test_nn_fused_linear_route.py") + job.import_tests(),
                  job.log(f"test-{version}.log"))

    steps.run("the compatibility matrix in the docs matches these reports", lambda: command(
        [sys.executable, os.path.join(ROOT, "tools", "compat_matrix.py"), "--check"]
        + sorted(glob.glob(job.log("check-*.json"))), log=job.log("compat.log")).rstrip())
    if ref_python is not None:
        reference_checks(job, ref_python)
    else:
        print(f"== skipped: the differential check and the tests on native {reference} "
              "(not among TORCH_CTXEXT_CI_RELEASES)")

    steps.run(f"the binary wheels (tools/wheels.py, built in the background): CPython "
              f"{' and '.join(main_wheel_versions)}, torch {default}; CPython 3.10, torch {oldest}",
              lambda: background.wait("wheels") + f"\n({background.seconds('wheels'):.0f} s in the background)")
    def wheel_step(version, python_version):
        return (f"the binary wheel installed alone, imported and checked without a compiler: CPython "
                f"{python_version}, torch {version}", job.wheel_check, version, python_version, dist, background)

    def plugin_step(version, python_version, python, install):
        steps.run(f"the plugin's own tests, {INSTALLS[install]}, with the test device: CPython {python_version}, "
                  f"torch {version}", job.plugin_tests, version, python_version, python, install)

    # Each wheel check is one process at a time: the three and the docs share the two cores.
    _, (_, python313), (_, python310), _ = steps.together(
        wheel_step(default, "3.11"), wheel_step(default, "3.13"), wheel_step(oldest, "3.10"),
        ("documentation site (warnings are errors)", lambda: (background.wait("venv-docs"), job.docs())[1]))
    plugin_step(default, "3.13", python313, "wheel")
    plugin_step(oldest, "3.10", python310, "sources")
    steps.summary("test")


def reference_checks(job, ref_python):
    """What needs native torch 2.15: the differential, the stacks, advise
    without torch_ctxext's extension; and the import's and the install's
    effect on a process there, in the same pytest run."""
    facts, steps = job.facts, job.steps
    reference, default, oldest = facts.reference, facts.default, facts.oldest
    diff = os.path.join(ROOT, "tools", "differential")
    native = {"PYTHONPATH": ROOT}
    compared = []
    for version in (default, oldest):
        if version == default or version in job.ci_releases:
            compared.append(version)
        else:
            print(f"== skipped: the differential check on {version} (not among TORCH_CTXEXT_CI_RELEASES)")

    def scenarios(python, name, env, *device):
        command([python, os.path.join(diff, "run.py")] + list(device) + ["--out", job.log(name + ".json")],
                env=env, log=job.log(name + ".log"))

    def compare(reference_name, name, allow, start=None):
        text = command([sys.executable, os.path.join(diff, "run.py"), "--compare", job.log(reference_name + ".json"),
                        job.log(name + ".json"), "--allow", os.path.join(diff, allow)], log=job.log(name + ".cmp"))
        return from_line(text, start) if start else last_lines(text)

    def differential(version, device):
        python = job.venvs.python(job.venvs.dir(version))
        extension = {"TORCH_CTXEXT_IMPORT": "1"}
        if device:
            scenarios(python, f"diff-device-{version}", extension, "--device", "testdevice")
            return compare("diff-device-ref", f"diff-device-{version}", "deviations-device.txt", "non-None buffers")
        scenarios(python, f"diff-{version}", extension)
        return compare("diff-ref", f"diff-{version}", "deviations.txt")

    steps.together(
        (f"the differential scenarios on native {reference}", scenarios, ref_python, "diff-ref", native),
        (f"the differential scenarios on the test device, native {reference}", scenarios, ref_python,
         "diff-device-ref", native, "--device", "testdevice"))
    checks = []
    for version in compared:
        checks.append((f"differential check: the same scenarios on native {reference} and on {version} "
                       "+ torch_ctxext", differential, version, False))
        checks.append((f"differential check on the test device: native {reference} and {version} + torch_ctxext",
                       differential, version, True))
    for i in range(0, len(checks), 2):
        steps.together(*checks[i:i + 2])
    steps.run("advise()'s own C++ watch and the drop-ins' C++ Functions, which only they load (python -m torch_ctxext "
              "build builds them alone): "
              f"native {reference}", lambda: last_lines(command(
                  [ref_python, "-m", "torch_ctxext", "build"], env=native, log=job.log("build-ref.log"))))
    # Where fusion happens in each stack, and what advise reports, is pinned on
    # the default release + torch_ctxext above; native 2.15 is the reference
    # behaviour, so the same tests must pass there. Each file once: advise's
    # report with the C++ watch (built just above) is Python's watch's
    # (test_advise_watch.py), and without a build advise watches in Python
    # (test_advise_module.py); the drop-ins' C++ Functions (in the same build)
    # computes what its Python Function does (test_nn_fused_linear_route.py).
    steps.run(f"training stacks (DDP, FSDP2, checkpointing, autocast, torch.compile), examples/, advise's report "
              "with its C++ watch, explain and the drop-ins, a newer torch's version string, check run from a "
              f"user's project, the command line; the import leaves the process as import torch does, the install "
              f"resolves against this torch: native {reference}",
              job.pytest, ref_python, job.test(
                  "test_training_stacks.py", "test_examples.py", "test_advise_models.py", "test_nn.py",
                  "test_advise_transformers.py", "test_advise.py", "test_explain.py",
                  "test_newer_torch_and_unavailable_members.py", "test_check_isolation.py", "test_command_line.py",
                  "test_advise_module.py", "test_advise_watch.py", "test_nn_fused_linear_route.py",
                  "test_nn_strides.py") + job.import_tests(),
              job.log(f"test-{reference}.log"), native, SERIAL)


def matrix(job, args):
    """Every supported release, one at a time (see the module's docstring)."""
    keep = bench = False
    for option in args:
        if option == "--keep":
            keep = True
        elif option == "--bench":
            bench = True
        else:
            sys.exit(f"unknown option for matrix: {option}")
    os.chdir("/tmp")
    facts, steps, venvs = job.facts, job.steps, job.venvs
    existed = {v for v in facts.releases if os.access(venvs.python(venvs.dir(v)), os.X_OK)}
    keep_reference = False
    if bench:
        # Reads are compared with native 2.15, alive for the whole run (or the
        # python TORCH_CTXEXT_BENCH_NATIVE names); the figures need matplotlib
        # (the docs environment has it, or TORCH_CTXEXT_BENCH_PYTHON).
        native_python = os.environ.get("TORCH_CTXEXT_BENCH_NATIVE")
        if not native_python:
            native_python = venvs.python(venvs.create(facts.reference, log=job.log(f"venv-{facts.reference}.log")))
            keep_reference = True
        bench_python = os.environ.get("TORCH_CTXEXT_BENCH_PYTHON") or venvs.python(venvs.docs(
            log=job.log("venv-docs.log")))
    for version in job.matrix_releases:
        _, python = steps.run(f"venv, torch_ctxext and the test device, torch {version}", job.venv_for, version)
        steps.together(
            (f"conformance report: torch {version}", job.report, version, python),
            (f"the conformance suite on the test device: torch {version}", job.accelerator_tests, version, python))
        # Every supported release passes them: what a test expects of a member
        # comes from who provides it there (features()), never from a release
        # number pinned in the test.
        steps.run(f"the plugin's own tests, torch {version}", job.pytest, python, [os.path.join(ROOT, "test")],
                  job.log(f"test-{version}.log"), None, SERIAL)
        if bench:
            # The idle cost in instructions too, where valgrind is installed
            # (benchmarks/bench_idle_instructions.py: wall time is too noisy).
            remeasure = ["--remeasure", "releases"]
            if shutil.which("valgrind"):
                remeasure += ["--remeasure", "instructions"]
            steps.run(f"benchmarks, torch {version}", lambda: last_lines(command(
                [bench_python, os.path.join(ROOT, "benchmarks", "run_all.py"), "--from-json",
                 os.path.join(ROOT, "docs", "benchmarks.json")] + remeasure
                + ["--other-releases", python, "--torch-2-15", native_python], log=job.log(f"bench-{version}.log"))))
        # A venv this run created goes unless --keep (5 to 7 GB each); one that
        # was cached before stays. With --bench the reference goes last.
        if not keep and version not in existed and not (keep_reference and version == facts.reference):
            shutil.rmtree(venvs.dir(version), ignore_errors=True)
    if keep_reference and not keep and facts.reference not in existed:
        shutil.rmtree(venvs.dir(facts.reference), ignore_errors=True)
    # CPython 3.12 (CI tests 3.10, 3.11 and 3.13): the binary wheel, as a user
    # installs it, and the plugin's tests, with the newest release that needs a binary.
    newest = facts.releases[-2]
    dist = job.log("dist")
    steps.run(f"the binary wheel (tools/wheels.py): CPython 3.12, torch {newest}", lambda: last_lines(job.build_wheels(
        "--python", "3.12", "--torch", newest, "--out", dist), 3))
    text, python = steps.run(f"the binary wheel installed alone, imported and checked without a compiler: CPython 3.12, "
                             f"torch {newest}", lambda: job.wheel_check(newest, "3.12", dist))
    steps.run(f"the plugin's own tests, {INSTALLS['sources']}, with the test device: CPython 3.12, torch {newest}",
              job.plugin_tests, newest, "3.12", python, "sources")
    if not keep:
        shutil.rmtree(venvs.dir(newest, "3.12"), ignore_errors=True)
    steps.run("compatibility matrix regenerated (docs/compatibility.md, README.md, docs/compat/)", lambda: command(
        [sys.executable, os.path.join(ROOT, "tools", "compat_matrix.py"), "--store"]
        + sorted(glob.glob(job.log("check-*.json"))), log=job.log("compat.log")).rstrip())
    steps.summary(f"matrix ({len(job.matrix_releases)} releases)")


def ci(job, args):
    """What .ci/run runs: the README's ``test``; then its ``check`` as a new
    user meets it: a HOME with nothing in it (no ~/.pyenv, an empty cache)
    and no pyenv on PATH. Each step's time is printed."""
    run = os.path.join(ROOT, "tools", "run.py")
    job.steps.run("ci: python3 tools/run.py test", command, ["python3", run, "test"])
    home = tempfile.mkdtemp(prefix="torch_ctxext-ci-home.", dir="/tmp")
    try:
        path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if "pyenv" not in p)
        env = {"HOME": home, "PATH": path, "PYENV_ROOT": None, "PYENV_VERSION": None, "TORCH_CTXEXT_CACHE": None}
        python3 = shutil.which("python3", path=path)
        if python3 is None:
            raise Failed("no python3 on PATH once pyenv's folders are left out")
        job.steps.run(f"ci: python3 tools/run.py check with HOME={home} (empty: no ~/.pyenv) and no pyenv on PATH "
                      f"({python3})", command, [python3, run, "check"], env)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    job.steps.summary("ci")


def docs(job, args):
    job.steps.run("documentation site (warnings are errors)", job.docs)


def wheels(job, args):
    python = job.venvs.wheel_builder(log=job.log("venv-wheels.log"))
    sys.stdout.flush()
    os.execv(python, [python, os.path.join(ROOT, "tools", "wheels.py")] + list(args))


JOBS = {"check": check, "test": test, "matrix": matrix, "docs": docs, "wheels": wheels, "ci": ci}


def main(argv):
    if not argv or argv[0] not in JOBS:
        sys.stderr.write(USAGE + "\n")
        return 2
    # A job stopped from outside stops its commands too (the finally below).
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    job = Job()
    try:
        JOBS[argv[0]](job, argv[1:])
    except Failed as error:
        print(error, file=sys.stderr, flush=True)
        print(f"== {argv[0]} failed (logs in {job.out})", file=sys.stderr, flush=True)
        return 1
    finally:
        run_steps.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
