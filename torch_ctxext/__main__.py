"""Command line: ``python -m torch_ctxext {info,check}`` (also ``torch-ctxext``).

``info``   what the running torch provides natively and what torch_ctxext adds.
``check``  run the conformance suite against the installed torch and report,
           per member of the contract, who provides it and what passed.
"""
import argparse
import sys


def _info(_args):
    import torch

    import torch_ctxext
    from torch_ctxext import _report

    from torch_ctxext import _features

    print(_report.info_table(torch_ctxext.features(), torch.__version__, _built_for(),
                             _features.routes()))
    return 0


def _built_for():
    try:
        from torch_ctxext import _build_info
    except ImportError:
        return "(extension not built)"
    return _build_info.TORCH_VERSION


def _check(args):
    from torch_ctxext import _report

    report = _report.run_suite(select=args.k, extra_pytest_args=args.pytest_args)
    print(_report.format_report(report))
    if args.json:
        _report.write_json(report, args.json)
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
        "pytest_args", nargs="*", help="further pytest arguments (after --)"
    )
    args = parser.parse_args(argv)
    return {"info": _info, "check": _check}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
