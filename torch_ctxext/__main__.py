"""Command line: ``python -m torch_ctxext {info,check,build}`` (also ``torch-ctxext``).

``info``   what the running torch provides natively and what torch_ctxext adds;
           which build of the C++ extension is loaded, from where, for which torch.
           A build that failed is explained once (the members it leaves
           unavailable say "see extension above"). ``--json`` prints the same
           facts as JSON. Where torch_ctxext cannot be imported (an
           unsupported torch; no build and TORCH_CTXEXT_JIT=0) it says why and
           what to do, without a traceback, and exits 2.
``check``  run the conformance suite against the installed torch and report,
           per member of the contract, who provides it and what passed
           (``--device`` puts the suite's tensors on another device; ``-v``
           shows pytest's own output). The suite runs isolated from the
           caller's directory: its own rootdir and ini, no conftest.py of the
           caller, PYTEST_ADDOPTS ignored; the report says so.
``build``  build the C++ extension for the running torch into the cache now,
           ahead of the first import (images, clusters without a compiler on
           the nodes); ``--force`` builds it again. Where torch provides every
           member natively, the build is advise()'s C++ watch and
           the drop-ins' C++ Functions alone, which only they load.
``--version`` torch_ctxext's version and the running torch's; needs no build.

With no command it prints the help, and exits 2 as for any other usage
error (a script that runs it without a command has a mistake to show).

Exit status: 0 done (``check``: conforms), 1 ``check``: does not conform,
``build``: failed; 2 a usage or environment error, found before the suite
runs where it can be: a ``--json`` file that cannot be written, a ``-k`` that
selects no test, a torch torch_ctxext cannot be imported into.
"""
import argparse
import os
import sys


def _installed(warn=True):
    """Install the members, as ``import torch_ctxext`` does (the command
    line's own import of the package defers it: torch_ctxext._install);
    return None, or the ImportError that a plain import would raise."""
    import torch_ctxext

    try:
        torch_ctxext._install(warn=warn)
    except ImportError as refusal:
        return refusal
    return None


def _refused(command, refusal):
    """Say, on stderr, that ``command`` cannot run because torch_ctxext
    cannot be imported here; the refusal's message says what to do."""
    print(f"torch-ctxext {command}: torch_ctxext cannot be imported here: {refusal}", file=sys.stderr)
    return 2


def _info(args):
    import json

    import torch

    refusal = _installed(warn=False)  # info explains a failed build itself
    if refusal is not None:
        if args.json:
            print(json.dumps({
                "torch_ctxext": _version(), "importable": False, "error": str(refusal),
                "torch": {"version": torch.__version__, "git_version": torch.version.git_version},
            }, indent=2, sort_keys=True))
        else:
            print(f"torch          {torch.__version__} (git {torch.version.git_version[:12]})")
            print(f"torch_ctxext   cannot be imported: {refusal}")
        return 2
    import torch_ctxext
    from _torch_ctxext_build.cache import BUILD_AGAIN
    from torch_ctxext import _features, _releases
    from torch_ctxext._ext import build as _build
    from torch_ctxext.conformance import report as _report

    facts = (torch_ctxext.features(), torch.__version__, torch.version.git_version, _features.routes())
    if args.json:
        print(json.dumps(_report.info_facts(*facts), indent=2, sort_keys=True))
        return 0
    print(_report.info_table(*facts))
    if _releases.all_native(torch.__version__):  # nothing loaded at import; advise() may load its watch
        from torch_ctxext._ext import advise_module

        how = "C++" if advise_module.load() is not None else "Python"
        print(f"advise watch   {how}: {advise_module.choice}")
    failure = _build.last_failure
    if failure is not None:  # which failures the cache remembers, and until when
        if failure.remembered:
            print(f"build failure  remembered (a compile error): later imports report it "
                  f"without compiling until `{BUILD_AGAIN}`")
        else:
            print("build failure  not remembered (it may not recur): the next import tries again")
    return 0


def _build(args):
    import torch

    refusal = _installed()
    if refusal is not None:
        return _refused("build", refusal)
    import torch_ctxext
    from torch_ctxext._ext import build as _build
    from torch_ctxext._ext import loader as _extension

    if all(status == "native" for status in torch_ctxext.features().values()):
        # Nothing to patch: the build is advise()'s C++ watch and the
        # drop-ins' C++ Function alone, which read nothing by layout (no
        # verdict to make).
        from torch_ctxext._ext import advise_module

        try:
            library, _ = _build.build("asked for by `python -m torch_ctxext build`", force=args.force)
        except _build.ExtensionBuildError as e:
            print(e, file=sys.stderr)
            return 1
        print(f"torch {torch.__version__} provides every member of the contract natively: built only "
              f"advise()'s C++ watch and the drop-ins' C++ Functions, which they load (import torch_ctxext "
              f"loads nothing): {library}")
        return 0 if advise_module.load(library) is not None else 1
    packaged = _extension.packaged_build()
    if packaged and packaged[1:] == (torch.__version__, torch.version.git_version) and not args.force:
        library = packaged[0]
        print(f"the installed package carries a build for torch {torch.__version__}: {library}")
    else:
        try:
            library, _ = _build.build("asked for by `python -m torch_ctxext build`", force=args.force)
        except _build.ExtensionBuildError as e:
            print(e, file=sys.stderr)
            return 1
        print(f"build for torch {torch.__version__}: {library}")
    # Its layout verdict, made now where it is missing (a build from before
    # verdicts): the imports of a job then only read it.
    try:
        record, path = _extension.verdict_of(library)
    except Exception as e:  # ProbeNotRun, or a wait for another verification that timed out
        print(f"layout of the build not verified: {e}", file=sys.stderr)
        return 1
    found = record["found"]
    print(f"layout verdict: {'reads back as the headers say' if not found else found}: "
          f"{path or 'not kept (the build cache is not writable)'}")
    return 0 if not found else 1


def _unwritable(path):
    """Why ``path`` cannot be written, or None: checked before the suite
    runs, which would otherwise take minutes to fail at the end."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return "it is a directory"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "it is not writable"
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        return f"its directory {parent} does not exist"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"its directory {parent} is not writable"


def _check(args):
    if args.json:
        why = _unwritable(args.json)
        if why is not None:
            print(f"torch-ctxext check: --json {args.json}: cannot write the report there: {why}",
                  file=sys.stderr)
            return 2
        args.json = os.path.abspath(args.json)
    from torch_ctxext.conformance import _device

    name = args.device or os.environ.get("TORCH_CTXEXT_DEVICE") or "cpu"
    module = args.device_module or _device.module_for(name)
    try:
        device = _device.select(name, module)
    except _device.DeviceError as e:
        print(f"torch-ctxext check: {e}", file=sys.stderr)
        return 2
    # torch_ctxext after the device, as the suite's conftest does.
    refusal = _installed()
    if refusal is not None:
        return _refused("check", refusal)
    from torch_ctxext.conformance import report as _report

    print(f"running the ctx contract conformance suite (device {_device.describe()})")
    report = _report.run_suite(
        select=args.k, extra_pytest_args=args.pytest_args, device=str(device),
        verbose=args.verbose, progress=sys.stdout,
    )
    print(_report.format_report(report))
    if args.json:
        try:
            _report.write_json(report, args.json)
        except OSError as e:  # it could be written when the suite started
            print(f"torch-ctxext check: --json {args.json}: cannot write the report: {e}", file=sys.stderr)
            return 2
    if not report["ran"]:
        return 2  # could not run: the verdict, or pytest's own output above, says why
    return 0 if report["conforms"] else 1


def _version():
    """torch_ctxext's version, read without installing anything."""
    import torch_ctxext

    return torch_ctxext.__version__


class _Version(argparse.Action):
    """``--version``: torch_ctxext's version and torch's. Only imports torch
    (the command line's import of torch_ctxext installs nothing), so it
    works without a build, and on a torch torch_ctxext refuses."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        import torch

        print(f"torch_ctxext {_version()} (torch {torch.__version__})")
        parser.exit()


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="torch-ctxext",
        description="The ctx contract of torch.autograd.Function on the installed torch.",
    )
    parser.add_argument("--version", action=_Version, help="print torch_ctxext's and torch's versions")
    commands = parser.add_subparsers(dest="command", metavar="{info,check,build}")
    info = commands.add_parser("info", help="who provides each member of the contract")
    info.add_argument("--json", action="store_true", help="print the same facts as JSON")
    check = commands.add_parser(
        "check", help="run the conformance suite against the installed torch"
    )
    check.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    check.add_argument("-k", metavar="EXPR", help="select tests like pytest -k")
    check.add_argument(
        "-v", "--verbose", action="store_true",
        help="show pytest's own output (each test, warnings, tracebacks) as it runs",
    )
    check.add_argument(
        "--device",
        metavar="DEVICE",
        help="run the suite with its tensors on DEVICE: cpu (default), cuda, xpu, mps, or a "
        "PrivateUse1 backend's name, e.g. testdevice ($TORCH_CTXEXT_DEVICE)",
    )
    check.add_argument(
        "--device-module",
        metavar="MODULE",
        help="module that registers the DEVICE backend, imported before the suite runs "
        "(testdevice: torch_ctxext_testdevice)",
    )
    check.add_argument(
        "pytest_args", nargs="*", help="further pytest arguments (after --)"
    )
    build = commands.add_parser(
        "build", help="build the C++ extension for the running torch now, into the cache"
    )
    build.add_argument(
        "--force", action="store_true", help="build again even if the cache has a build (or a recorded failure)"
    )
    args = parser.parse_args(argv)
    if args.command is None:
        # No command: the help, on stderr, and the status of a usage error
        # (2), as argparse gives an unknown command: a script that runs it
        # without a command has a mistake, which a 0 would hide.
        parser.print_help(sys.stderr)
        return 2
    return {"info": _info, "check": _check, "build": _build}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
