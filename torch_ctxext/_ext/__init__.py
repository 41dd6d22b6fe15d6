"""The C++ extension's layer in the package: building one for the running
torch at import (``build``), which build in the cache is its (``build_cache``),
loading only a build made for it and its layout verdict (``loader``), and
advise()'s watch on a torch that needs nothing else (``advise_module``).

What these call into, without torch and without the package (what the
extension is compiled from, the build's processes, the layout probe and its
verdicts): ``_torch_ctxext_build``. Nothing here patches torch;
``torch_ctxext/__init__.py`` loads the extension through ``loader.load()``
only where the running torch lacks a member.
"""
