"""The plugin's own tests: one folder per subject, the shared helpers here.

The helper modules (support, install_env, doubling_functions,
engine_hook_functions, training_stacks, check_corpus) live in this
directory; the test modules, one folder down, import them by name. This
file imports neither torch nor torch_ctxext: the tests about what the first
import does to a process decide when that happens.
"""
import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
# The checkout's examples/, benchmarks/ and tools/ are importable by name too
# (no module name is in two of them); appended, so that none shadows an
# installed module.
for _folder in ("examples", "benchmarks", "tools"):
    _path = os.path.join(os.path.dirname(TESTS), _folder)
    if _path not in sys.path:
        sys.path.append(_path)
