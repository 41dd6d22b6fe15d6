"""Loading a built library of the extension as a module, under a given name.

The one place in the tree that loads a file by its path: the extension's
shared library (``_C.so``), which is never on an import path (it lives in
the build cache, under a wheel's ``_binaries/``, or is loaded under another
name than its file's: advise()'s watch, the layout probe's copy).
"""
import importlib.util
import sys


def load(name, path, register=False):
    """The library at ``path``, imported as the module ``name`` (its
    initialisation function is ``PyInit_<last part of name>``). ``register``:
    it is in ``sys.modules`` while it initialises and after (removed again
    if that fails); else it is not put there. Raises ImportError where the
    dynamic loader refuses it or its initialisation fails."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"{path} is not a library Python can load as {name}", name=name, path=path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if register:
            sys.modules.pop(name, None)
        raise
    return module
