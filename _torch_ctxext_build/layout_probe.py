"""The layout probe's process: ``layout_verdict.probe`` runs :func:`main` in a child.

It imports the importer's torch (the spec names its path and its file),
loads the build to verify under a name of its own (never
``torch_ctxext._C``: nothing of the package is imported here), runs
``layout_check`` on it and prints its answer, one JSON line after
``layout_verdict.ANSWER``. It ends with ``child.run``'s helper, which ends
with the importer.
"""
import json
import os
import sys

from . import child, extension
from .child_helper import die_with_parent
from .layout_verdict import ANSWER


def main(argv):
    """``argv``: the spec (JSON: path, torch, library, parent)."""
    child.default_sigchld()  # an ignored SIGCHLD survives exec
    spec = json.loads(argv[0])
    die_with_parent()  # child.run's helper, which ends with the importer
    try:
        os.kill(spec["parent"], 0)
    except ProcessLookupError:  # the importer ended before PDEATHSIG was set
        return 1
    sys.path[:] = spec["path"]
    import torch

    if torch.__file__ != spec["torch"]:
        _answer({"error": f"the probe's process imported torch from {torch.__file__}, not {spec['torch']}"})
        return 0
    from . import layout_check

    ext = extension.load("_torch_ctxext_layout_probe._C", spec["library"])
    _answer({"found": layout_check.mismatches(ext), "facts": layout_check.facts(ext)})
    return 0


def _answer(answer):
    print(ANSWER + json.dumps(answer), flush=True)
