"""The release facts under the package's name: ``_torch_ctxext_build.releases``.

The facts live in the build layer (``_torch_ctxext_build/releases.py``), which
``setup.py``, ``tools/`` and the build's processes import without torch; the
package imports them from there, and this name is that same module object
(``torch_ctxext._releases is _torch_ctxext_build.releases``).

    python3 torch_ctxext/_releases.py releases|ci-releases|reference|default|requirement

prints one fact (the standard library only: it runs before any venv exists).
"""
import os
import sys

if __name__ == "__main__":
    # Run as a file: the build layer is this directory's sibling (a checkout,
    # or site-packages), which Python did not put on the path.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from _torch_ctxext_build.releases import _main

    sys.exit(_main(sys.argv[1:]))

from _torch_ctxext_build import releases as _facts  # noqa: E402

sys.modules[__name__] = _facts
