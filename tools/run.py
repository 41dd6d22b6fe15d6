"""Set up everything on a fresh machine, then run one job::

    python3 tools/run.py check          conformance report for the installed torch (main job)
    python3 tools/run.py test           every test, on the CI subset of releases (what CI runs)
    python3 tools/run.py matrix [--keep] [--bench]
                                        every supported release, one at a time: its report,
                                        the suite on the test device and the plugin's own
                                        tests; the compatibility matrix regenerated from the
                                        reports; --bench also measures each release's idle
                                        and read cost (and, with valgrind, the idle cost in
                                        instructions) into docs/benchmarks.json
    python3 tools/run.py docs           build the documentation site (warnings are errors)
    python3 tools/run.py wheels [--python 3.10,3.13] [--torch 2.6.0,2.13.0] [--out DIR] [--verify]
                                        the binary wheels, one per CPython (tools/wheels.py);
                                        --verify installs each beside each torch and checks it
    python3 tools/run.py ci             what .ci/run runs: test, then check with an empty HOME

Standard library only: any python3 from 3.8 runs it, before any virtual
environment exists. Virtual environments are cached outside the clone
(tools/run_venvs.py); each job prints every step's time, and a summary.

TORCH_CTXEXT_TORCH picks the release for ``check`` (default: DEFAULT in
torch_ctxext/_releases.py, the one this machine has on local disk);
TORCH_CTXEXT_CI_RELEASES (space-separated) replaces the subset ``test`` runs
besides it, and TORCH_CTXEXT_RELEASES the releases ``matrix`` runs (the
other kept reports stay), to rerun a part. TORCH_CTXEXT_CACHE moves the
cache (default ~/.cache/torch_ctxext).

The jobs are in tools/run_jobs.py, their steps' machinery in
tools/run_steps.py, the release facts and the venvs in tools/run_venvs.py.
"""
import sys

import run_jobs  # beside this file (tools/ is on sys.path when run as a script)

if __name__ == "__main__":
    sys.exit(run_jobs.main(sys.argv[1:]))
