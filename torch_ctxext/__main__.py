"""Command line: ``python -m torch_ctxext {info,check,build}`` (also ``torch-ctxext``).

``info``   what the running torch provides natively and what torch_ctxext adds;
           which build of the C++ extension is loaded, from where, for which torch.
``check``  run the conformance suite against the installed torch and report,
           per member of the contract, who provides it and what passed
           (``--device`` puts the suite's tensors on another device; ``-v``
           shows pytest's own output). Exit status: 0 conforms, 1 does not
           conform, 2 could not run.
``build``  build the C++ extension for the running torch into the cache now,
           ahead of the first import (images, clusters without a compiler on
           the nodes); ``--force`` builds it again. Where torch provides every
           member natively, the build is advise()'s C++ watch alone, which
           only advise() loads.
"""
import argparse
import os
import sys


def _info(_args):
    import torch

    import torch_ctxext
    from torch_ctxext import _features, _releases
    from torch_ctxext._ext import build as _build
    from torch_ctxext.conformance import report as _report

    print(_report.info_table(torch_ctxext.features(), torch.__version__, torch.version.git_version,
                             _features.routes()))
    if _releases.all_native(torch.__version__):  # nothing loaded at import; advise() may load its watch
        from torch_ctxext._ext import advise_module

        how = "C++" if advise_module.load() is not None else "Python"
        print(f"advise watch   {how}: {advise_module.choice}")
    failure = _build.last_failure
    if failure is not None:  # which failures the cache remembers, and until when
        if failure.remembered:
            print(f"build failure  remembered (a compile error): later imports report it "
                  f"without compiling until `{_build.REBUILD}`")
        else:
            print("build failure  not remembered (it may not recur): the next import tries again")
    return 0


def _build(args):
    import torch

    import torch_ctxext
    from torch_ctxext._ext import build as _build
    from torch_ctxext._ext import loader as _extension

    if all(status == "native" for status in torch_ctxext.features().values()):
        # Nothing to patch: the build is advise()'s C++ watch alone, which
        # reads nothing by layout (no verdict to make).
        from torch_ctxext._ext import advise_module

        try:
            library, _ = _build.build("asked for by `python -m torch_ctxext build`", force=args.force)
        except _build.ExtensionBuildError as e:
            print(e, file=sys.stderr)
            return 1
        print(f"torch {torch.__version__} provides every member of the contract natively: built only "
              f"advise()'s C++ watch, which advise() loads (import torch_ctxext loads nothing): {library}")
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


def _check(args):
    from torch_ctxext.conformance import _device

    name = args.device or os.environ.get("TORCH_CTXEXT_DEVICE") or "cpu"
    module = args.device_module or _device.module_for(name)
    try:
        device = _device.select(name, module)
    except _device.DeviceError as e:
        print(f"torch-ctxext check: {e}", file=sys.stderr)
        return 2
    from torch_ctxext.conformance import report as _report

    print(f"running the ctx contract conformance suite (device {_device.describe()})")
    report = _report.run_suite(
        select=args.k, extra_pytest_args=args.pytest_args, device=str(device),
        verbose=args.verbose, progress=sys.stdout,
    )
    print(_report.format_report(report))
    if args.json:
        _report.write_json(report, args.json)
    if not report["ran"]:
        return 2  # could not run: pytest's own output above says why
    return 0 if report["conforms"] else 1


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="torch-ctxext",
        description="The ctx contract of torch.autograd.Function on the installed torch.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="who provides each member of the contract")
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
    return {"info": _info, "check": _check, "build": _build}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
