"""A first import that builds, under an importer whose SIGCHLD is not the default.

An importer whose SIGCHLD is ignored, or handled by a handler that reaps
every child, builds as any other: the handler runs at most once for each
child the import starts (the helper of ``_torch_ctxext_build/child.py``),
never for the build's own processes, and every status is read right: a
build killed by a signal is said so, not "status 0".

Each case runs a fresh interpreter with a build cache of its own; each
builds (20 s or more on 2 cores). The cases of the process the build leaves
are in test_first_import_leaves_the_process.py.
"""
import signal

import pytest

from test_build_lock import NEEDS_EXTENSION, compiler
from test_first_import_leaves_the_process import PROVIDERS, _answer, first_import


REAPER = """
import signal, os
handled = []
def reap(signum, frame):
    handled.append(signum)
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
"""
SIGCHLD = {
    "ignored": "signal.signal(signal.SIGCHLD, signal.SIG_IGN)\nhandled = []\n",
    "reaped by a handler": REAPER + "signal.signal(signal.SIGCHLD, reap)\n",
}

# What the importer's handler sees of a building import: one SIGCHLD, for the
# exit of the one child it starts (child.run's helper, which starts the build
# process and reports its status over a pipe); nothing of the build's own
# processes. An ignored SIGCHLD runs nothing. The handler is placed after
# ``import torch`` (first_import's importer imports torch first), so torch's
# own children (a CUDA build runs ldconfig) are not among what it sees.
HELPERS_SEEN = {"ignored": [], "reaped by a handler": [int(signal.SIGCHLD)]}


@NEEDS_EXTENSION
@pytest.mark.parametrize("sigchld", list(SIGCHLD))
def test_an_importer_whose_sigchld_is_not_the_default_builds_and_sees_only_its_helpers_exit(tmp_path, sigchld):
    completed = first_import(tmp_path, """
        import json
        import torch_ctxext
        print(json.dumps({"features": torch_ctxext.features(), "handled": handled,
                          "disposition": repr(signal.getsignal(signal.SIGCHLD))}))
    """, prelude=SIGCHLD[sigchld])
    answer = _answer(completed)
    assert "built in" in completed.stderr
    assert {m: answer["features"][m] for m in PROVIDERS} == PROVIDERS
    assert answer["handled"] == HELPERS_SEEN[sigchld]


@NEEDS_EXTENSION
@pytest.mark.parametrize("sigchld", list(SIGCHLD))
def test_under_such_an_importer_a_killed_build_is_said_killed(tmp_path, sigchld):
    """Every status is read right: ninja killed by SIGKILL reads as that,
    not as a build that exited with 0."""
    killer = compiler(tmp_path, "ninja-killing-c++",
                      "p=$$; while [ \"$p\" -gt 1 ]; do if [ \"$(cat /proc/$p/comm)\" = ninja ]; then kill -9 $p; break; fi; "
                      "p=$(sed 's/.*) //' /proc/$p/stat | cut -d' ' -f2); done; exit 1")
    completed = first_import(tmp_path, """
        import json
        import torch_ctxext
        print(json.dumps({"features": torch_ctxext.features(), "handled": handled}))
    """, env={"CXX": str(killer)}, prelude=SIGCHLD[sigchld])
    answer = _answer(completed)
    reason = answer["features"]["input_grad_buffers"]
    assert "the build was killed by SIGKILL" in reason, reason
    assert answer["handled"] == HELPERS_SEEN[sigchld]
