"""Sphinx configuration of the torch_ctxext documentation.

Build (warnings are errors)::

    sphinx-build -W --keep-going -b html docs docs/_build/html

with an environment that has requirements-docs.txt and the exact torch
torch_ctxext was built for (its C extension must import: autodoc reads the
docstrings from the live objects). An installed torch_ctxext is used if there
is one; otherwise the source tree (with an in-place build) is put on the path.
"""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("torch_ctxext") is None:
    sys.path.append(ROOT)

import torch_ctxext  # noqa: E402  (fails loudly if the extension does not load)

project = "torch_ctxext"
author = "torch_ctxext contributors"
copyright = "torch_ctxext contributors"
release = version = torch_ctxext.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "none"

html_theme = "alabaster"
html_title = f"torch_ctxext {release}"
html_theme_options = {
    "description": "The whole ctx contract of torch.autograd.Function on the torch you have",
    "fixed_sidebar": True,
}
