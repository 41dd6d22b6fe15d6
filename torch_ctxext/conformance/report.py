"""Running the conformance suite and reporting on it, per member of the contract."""
import json
import os

import torch

from .. import _features
from .._features import MEMBERS, member_of_test_module

SUITE = "torch_ctxext.conformance"
# The suite's directory, and its own ini file (package data): ``check`` runs
# the suite with that ini, rootdir and confcutdir, never the caller's.
SUITE_DIR = os.path.dirname(os.path.abspath(__file__))
SUITE_INI = os.path.join(SUITE_DIR, "suite.ini")


def extension_lines():
    """Which build of the C++ extension is loaded, from where, for which torch."""
    from .._ext import build_cache, loader
    from .._features import UNAVAILABLE

    loaded = loader.loaded
    other = _features.loaded_extension() if loaded is None and _features.OTHER_COPY else None
    if other is not None:
        # A vendored copy imported second: its members are the first copy's.
        owner = getattr(torch._C, loader.HOOKS_OWNER, None) or other.__name__
        where = f"another copy's, loaded first: {owner}"
        built_for = f"{other.built_for_torch} (git {other.built_for_git_version[:12]})"
    elif loaded is None:
        if UNAVAILABLE:
            where = f"not loaded: {next(iter(UNAVAILABLE.values()))}"
        else:
            where = "not needed: the running torch provides every member natively"
        built_for = "(no build loaded)"
    else:
        record = build_cache.record_of(loaded.path)
        where = {
            "package": "installed with the package",
            "package (verified)": "installed with the package, for another build of this release (verified here)",
            "cache": "from the build cache",
            "built": "built at this import, into the build cache",
        }[loaded.origin] + f": {loaded.path}"
        if record.get("built_at"):
            where += f" (built {record['built_at']} in {record['seconds']:.0f} s)"
        built_for = f"{loaded.torch_version} (git {loaded.torch_git_version[:12]})"
    lines = [
        f"built for      {built_for}",
        f"extension      {where}",
        f"build cache    {build_cache.root()} (${build_cache.ENV_CACHE})",
        f"children       {_children()}",
    ]
    if loader.choice:
        lines.append(f"why            {loader.choice}")
    if loaded is not None:
        verdict = loader.verdict
        if verdict is None:
            layout = "not verified in this process (see the members' reasons)"
        elif verdict["found"]:
            layout = f"does not read back as the headers say ({', '.join(sorted(verdict['found']))})"
        else:
            layout = "reads back as the headers say"
        if verdict is not None:
            kept = loader.verdict_path or "not kept (the build cache is not writable)"
            layout += f"; verified {verdict.get('verified_at', '')} in a child process: {kept}"
        lines.append(f"layout         {layout}")
    return lines


def _children():
    """How this process starts the children a build or a layout probe needs
    (docs/reliability.md, the children an import starts)."""
    from _torch_ctxext_build import child

    if child.how == "posix_spawn":
        return "posix_spawn of a helper exec'd at once (no copy of this process); subprocess where refused"
    return child.how


def info_table(features, torch_version, torch_git_version, routes=None):
    """What ``info`` prints. A member unavailable for the reason the
    extension line already gives (no build) says so in a word: a build's
    failure message is long, and is the same for each member that needs it."""
    from .._ext import loader

    shared = _features.UNAVAILABLE and loader.loaded is None and not _features.OTHER_COPY
    extension_reason = next(iter(_features.UNAVAILABLE.values())) if shared else None
    lines = [
        f"torch          {torch_version} (git {torch_git_version[:12]})",
        *extension_lines(),
        "",
        f"{'member':<26}provided by",
        f"{'-' * 25} {'-' * 40}",
    ]
    for name, status in features.items():
        if extension_reason is not None and status == f"unavailable: {extension_reason}":
            status = "unavailable (see extension above)"
        lines.append(f"{name:<26}{status}")
        route = (routes or {}).get(name)
        if route and route not in ("native", "unavailable"):
            lines.append(f"{'':<26}  route: {route}")
    return "\n".join(lines)


def info_facts(features, torch_version, torch_git_version, routes=None):
    """What ``info --json`` prints: the facts of :func:`info_table`, as data.

    ``extension.status`` is ``loaded``, ``not needed`` (torch provides every
    member natively), ``another copy`` (a vendored copy loaded first) or
    ``unavailable`` (``extension.reason`` says why); each member has its
    ``provider`` (``native``, ``torch_ctxext`` or ``unavailable``), its
    ``route`` and, where unavailable, its ``reason``.
    """
    from .. import __version__
    from .._ext import build_cache, loader

    loaded = loader.loaded
    extension = {
        "status": "loaded", "path": None, "origin": None, "built_for": None, "reason": None,
        "cache": str(build_cache.root()), "why": loader.choice or None, "layout": None,
        "children": _children(),
    }
    if loaded is not None:
        extension.update(path=loaded.path, origin=loaded.origin,
                         built_for={"version": loaded.torch_version, "git_version": loaded.torch_git_version})
        verdict = loader.verdict
        if verdict is not None:
            extension["layout"] = {"found": sorted(verdict["found"]), "verified_at": verdict.get("verified_at"),
                                   "path": loader.verdict_path}
    elif _features.OTHER_COPY:
        extension["status"] = "another copy"
    elif _features.UNAVAILABLE:
        extension.update(status="unavailable", reason=next(iter(_features.UNAVAILABLE.values())))
    else:
        extension["status"] = "not needed"
    members = {}
    for name, status in features.items():
        provider, _, reason = status.partition(": ")
        members[name] = {"provider": provider, "route": (routes or {}).get(name), "reason": reason or None}
    return {
        "torch_ctxext": __version__,
        "importable": True,
        "torch": {"version": torch_version, "git_version": torch_git_version},
        "extension": extension,
        "members": members,
    }


def isolation(config):
    """How far a pytest run of the suite is from its caller's directory.

    Returns ``{"isolated", "rootdir", "inifile", "caller_conftests"}``: the
    run is isolated when it loaded no conftest.py but the suite's own, and
    no ini file but the suite's (or none). ``check`` runs it so; a plain
    ``pytest --pyargs torch_ctxext.conformance`` keeps the caller's
    conftest.py files out (torch_ctxext_pytest), not an ini file found in
    the caller's directory."""
    import types

    caller_conftests = sorted(
        os.path.abspath(plugin.__file__)
        for plugin in config.pluginmanager.get_plugins()
        if isinstance(plugin, types.ModuleType)
        and os.path.basename(getattr(plugin, "__file__", None) or "") == "conftest.py"
        and os.path.dirname(os.path.abspath(plugin.__file__)) != SUITE_DIR
    )
    inifile = str(config.inipath) if config.inipath else None
    return {
        "isolated": not caller_conftests and inifile in (None, SUITE_INI),
        "rootdir": str(config.rootpath),
        "inifile": inifile,
        "caller_conftests": caller_conftests,
    }


def isolation_line(facts):
    """The report's one line on :func:`isolation`."""
    if facts["isolated"]:
        return (f"isolated from the caller's directory: rootdir {facts['rootdir']}, "
                "no conftest.py or ini of the caller")
    loaded = [f"conftest.py {', '.join(facts['caller_conftests'])}"] if facts["caller_conftests"] else []
    if facts["inifile"] not in (None, SUITE_INI):
        loaded.append(f"ini {facts['inifile']}")
    return f"NOT isolated from the caller's directory (rootdir {facts['rootdir']}): loaded {'; '.join(loaded)}"


def _tally(rows):
    """The outcome counts of a member's tests, as the report states them."""
    return {
        "passed": sum(r["outcome"] == "passed" for r in rows),
        "failed": sum(r["outcome"] == "failed" for r in rows),
        "skipped": sum(r["outcome"] in ("skipped", "xfailed") for r in rows),
        "upstream_deviations": sum(r["outcome"] == "deviation" for r in rows),
    }


class _Collector:
    """A pytest plugin recording each test's outcome under its member, and
    the warnings the suite's tests raised; with ``progress``, it prints a
    line per member as the member's last test finishes."""

    def __init__(self, progress=None):
        self.results = []
        self.warnings = {}  # (category, message) -> number of tests
        self.progress = progress  # a writable stream, or None
        self.totals = {}
        self.done = {}
        self.isolation = None

    def pytest_sessionstart(self, session):
        self.isolation = isolation(session.config)

    def pytest_collection_finish(self, session):
        for item in session.items:
            member = member_of_test_module(os.path.basename(item.nodeid.split("::")[0]))
            self.totals[member] = self.totals.get(member, 0) + 1

    def pytest_warning_recorded(self, warning_message, when, nodeid, location):
        message = str(warning_message.message).strip().splitlines()[0]
        key = (warning_message.category.__name__, message)
        self.warnings[key] = self.warnings.get(key, 0) + 1

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and not report.passed):
            module = os.path.basename(report.nodeid.split("::")[0])
            member = member_of_test_module(module)
            deviation = bool(getattr(report, "wasxfail", "")) and (
                "known upstream deviation" in report.wasxfail
            )
            if report.skipped and deviation:
                outcome = "deviation"
            elif report.skipped and hasattr(report, "wasxfail"):
                outcome = "xfailed"
            else:
                outcome = report.outcome
            reason = ""
            if outcome == "failed":
                crash = getattr(report.longrepr, "reprcrash", None)
                reason = crash.message.splitlines()[0] if crash is not None else str(report.longrepr).splitlines()[-1]
            self.results.append(
                {"test": report.nodeid, "member": member, "outcome": outcome, "reason": reason}
            )
            self._advance(member)

    def _advance(self, member):
        self.done[member] = self.done.get(member, 0) + 1
        if self.progress is None or self.done[member] != self.totals.get(member):
            return
        tally = _tally([r for r in self.results if r["member"] == member])
        counts = [f"{n} {key.replace('_', ' ')}" for key, n in tally.items() if n]
        finished = sum(1 for m, n in self.done.items() if n == self.totals.get(m))
        self.progress.write(f"[{finished:>2}/{len(self.totals)}] {member:<25}{', '.join(counts)}\n")
        self.progress.flush()


# pytest's exit codes that mean the suite ran (the verdict says how it went).
_RAN = (0, 1)


def run_suite(select=None, extra_pytest_args=(), device="cpu", verbose=False, progress=None):
    """Run the suite in this process, with its tensors on ``device``; return
    the report as a dict.

    The run is isolated from the caller's directory: the suite is collected
    by its directory, with its own ini file (suite.ini) and rootdir, and
    conftest.py files cut off at its directory; PYTEST_ADDOPTS is ignored.
    A project's conftest.py (an autouse fixture setting the default dtype or
    device, seeding) or ini (addopts, filterwarnings = error) would otherwise
    change what the suite checks, and the report would blame torch. The
    report's ``isolation`` says what the run loaded.

    Quiet by default: pytest's own output is kept back and shown (on
    stderr) only when the suite could not run; ``progress`` (a stream) gets
    a line per member. ``verbose`` shows pytest's output as it comes.
    """
    import contextlib
    import io

    import pytest

    import torch_ctxext
    from . import _device

    collector = _Collector(progress=None if verbose else progress)
    previous = {name: os.environ.get(name) for name in ("TORCH_CTXEXT_DEVICE", "PYTEST_ADDOPTS")}
    os.environ["TORCH_CTXEXT_DEVICE"] = device  # read by the suite's conftest
    os.environ.pop("PYTEST_ADDOPTS", None)  # the caller's options are not the suite's
    args = [
        # By its directory, not --pyargs: pytest looks for the initial
        # conftest.py files of a --pyargs run in the current directory and its
        # parents, whatever --confcutdir says (it only cuts off the parents
        # of its own directory).
        SUITE_DIR, "-c", SUITE_INI, "--rootdir", SUITE_DIR, "--confcutdir", SUITE_DIR,
        "-p", "no:cacheprovider", "-o", "addopts=",
        # torch_ctxext is imported before pytest starts (the entry point of
        # its own plugin registers the package for rewriting too late).
        "-W", "ignore::pytest.PytestAssertRewriteWarning",
    ]
    args += ["-v"] if verbose else ["-q"]
    if select:
        args += ["-k", select]
    args += list(extra_pytest_args)
    held_back = io.StringIO()
    with contextlib.ExitStack() as stack:
        if not verbose:
            stack.enter_context(contextlib.redirect_stdout(held_back))
            stack.enter_context(contextlib.redirect_stderr(held_back))
        try:
            exit_code = pytest.main(args, plugins=[collector])
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    ran_suite = int(exit_code) in _RAN
    if int(exit_code) == pytest.ExitCode.NO_TESTS_COLLECTED:
        # Nothing wrong with the suite or torch: the selection is empty.
        why = f"no test matched -k {select}" if select else "pytest collected no test"
        not_run = f"could not run the suite: {why}"
    else:
        not_run = "could not run the suite"
        if not ran_suite and not verbose:
            import sys

            sys.stderr.write(held_back.getvalue())  # pytest says why
    features = torch_ctxext.features()
    routes = _features.routes()
    members = {}
    for name in MEMBERS:
        rows = [r for r in collector.results if r["member"] == name]
        members[name] = {"provider": features[name], "route": routes[name], **_tally(rows)}
    failed = [r["test"] for r in collector.results if r["outcome"] == "failed"]
    deviations = [r["test"] for r in collector.results if r["outcome"] == "deviation"]
    ran = sum(m["passed"] + m["failed"] for m in members.values())
    untested = [n for n, m in members.items() if not select and m["passed"] + m["failed"] == 0]
    ok = not failed and not untested and ran > 0 and exit_code == pytest.ExitCode.OK
    return {
        "torch": torch.__version__,
        "device": _device.describe(),
        "members": members,
        "failed_tests": failed,
        "failure_reasons": {r["test"]: r["reason"] for r in collector.results if r["outcome"] == "failed"},
        "upstream_deviation_tests": deviations,
        "untested_members": untested,
        "warnings": [
            {"category": c, "message": m, "tests": n} for (c, m), n in sorted(collector.warnings.items())
        ],
        "pytest_exit_code": int(exit_code),
        "ran": ran_suite,
        "conforms": ok,
        "verdict": verdict(ok, len(deviations)) if ran_suite else not_run,
        "isolation": collector.isolation,
    }


def verdict(conforms, deviations):
    """The one-line verdict: where native torch breaks the contract, the
    report says how often rather than hiding it."""
    if not conforms:
        return "does not conform"
    if deviations:
        return f"conforms, {deviations} upstream deviation{'s' if deviations != 1 else ''}"
    return "conforms"


def format_report(report):
    lines = [
        "",
        f"ctx contract conformance on torch {report['torch']}"
        + (f", device {report['device']}" if report.get("device", "cpu") != "cpu" else ""),
        "",
        f"{'member':<25}{'provider':<14}{'passed':>7}{'failed':>7}{'skipped':>8}"
        f"{'upstream deviations':>21}",
    ]
    for name, m in report["members"].items():
        provider = m["provider"] if not m["provider"].startswith("unavailable") else "unavailable"
        lines.append(
            f"{name:<25}{provider:<14}{m['passed']:>7}{m['failed']:>7}{m['skipped']:>8}"
            f"{m['upstream_deviations']:>21}"
        )
    for test in report.get("upstream_deviation_tests", []):
        lines.append(f"UPSTREAM DEVIATION {test}")
    reasons = report.get("failure_reasons", {})
    for test in report["failed_tests"]:
        reason = reasons.get(test)
        lines.append(f"FAILED {test}" + (f" - {reason[:160]}" if reason else ""))
    for name in report["untested_members"]:
        lines.append(f"UNTESTED {name}: the suite ran no test for it")
    warnings = report.get("warnings", [])
    if warnings:
        lines += ["", "warnings raised by torch while the suite ran (each named once):"]
        for w in warnings:
            lines.append(f"  {w['category']}: {w['message'][:200]} ({w['tests']} time{'s' if w['tests'] != 1 else ''})")
    if report.get("isolation"):
        lines += ["", isolation_line(report["isolation"])]
    lines += ["", f"verdict: {report['verdict']}"]
    return "\n".join(lines)


def write_json(report, path):
    with open(path, "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
        f.write("\n")
