"""Sphinx configuration of the torch_ctxext documentation.

Build (warnings are errors)::

    sphinx-build -W --keep-going -b html docs docs/_build/html

with an environment that has requirements-docs.txt and torch (torch_ctxext's
C extension must load: autodoc reads the docstrings from the live objects;
the first import builds it for that torch if nothing has yet). An installed
torch_ctxext is used if there is one; otherwise the source tree is put on the
path.
"""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("torch_ctxext") is None:
    sys.path.append(ROOT)

import warnings  # noqa: E402

import pytorch_sphinx_theme2  # noqa: E402

with warnings.catch_warnings():
    # No extension, no documentation of what it adds: fail loudly.
    warnings.filterwarnings("error", message="torch_ctxext could not build")
    import torch_ctxext  # noqa: E402

project = "torch_ctxext"
author = "torch_ctxext contributors"
copyright = "torch_ctxext contributors"
release = version = torch_ctxext.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "pytorch_sphinx_theme2",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "none"

# The theme of PyTorch's own documentation (docs.pytorch.org), so that these
# pages read like the rest of a PyTorch user's stack.
html_theme = "pytorch_sphinx_theme2"
html_theme_path = [pytorch_sphinx_theme2.get_html_theme_path()]
templates_path = [os.path.join(pytorch_sphinx_theme2.get_html_theme_path(), "templates")]
html_title = f"torch_ctxext {release}"
html_theme_options = {
    "logo": {"text": f"torch_ctxext {release}"},
    "navbar_start": ["navbar-logo"],
    "navbar_end": ["search-field-custom", "theme-switcher"],
    "navigation_with_keys": False,
    "show_lf_header": False,
    "show_lf_footer": False,
    "show_pytorch_org_link": False,
    "use_edit_page_button": False,
    "article_footer_items": [],
    "article_header_end": [],
    "secondary_sidebar_items": ["page-toc"],
    "show_prev_next": True,
    "llm_disabled": "true",  # no llms.txt or per-page .md copies beside the HTML
}
html_show_sourcelink = False
