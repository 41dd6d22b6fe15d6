"""The C++ extension's layer: what it is compiled from (``sources``), where
builds live (``build_cache``), building one for the running torch
(``build``), loading only a build made for it (``loader``) and checking at
import that the engine reads back as the headers say (``layout_check``).

Nothing here patches torch; ``torch_ctxext/__init__.py`` loads the extension
through ``loader.load()`` only where the running torch lacks a member.
"""
