"""Install torch_ctxext; compile its C++ extension where torch is importable.

The extension reads autograd-engine structures by layout, so it is compiled
against the very torch it runs with. Which build happens depends on whether
that torch is importable here:

* it is (``pip install --no-build-isolation .``, ``pip wheel
  --no-build-isolation .``, ``python -m build --wheel --no-isolation``): the
  extension is compiled now (and its layout verified against that torch, in
  a child process: the verdict is installed beside it), and the wheel
  declares the exact torch it was built for, as its requirement (the
  installed distribution's version: ``torch==2.13.0+cpu``, or
  ``torch==2.12.1`` for PyPI's CUDA wheels, whose ``torch.__version__`` is
  ``2.12.1+cu130``) and, built from a checkout, in a local version tag
  (``0.1.0+torch2.13.0.cpu``, ``0.1.0+torch2.12.1.cu130``: from
  ``torch.__version__``, so that builds for different torch builds are told
  apart), like the per-torch wheels of other extensions;
* it is not (pip's default build isolation, where it would have to download a
  torch of its own, never the one you run): the Python sources and csrc/ are
  installed, and the first import builds the extension for the running torch
  into a cache (torch_ctxext/_ext/build.py).

What the extension is compiled from, and the layout probe, come from the
build layer (``_torch_ctxext_build``: the standard library only), which is
imported from beside this file and shipped beside the package.

$TORCH_CTXEXT_BUILD_EXT overrides the choice: ``1`` compiles or fails, ``0``
installs the sources only. Either way the package ships csrc/, so that a later
torch can have its build at first import.
"""
import os
import re
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# The build layer is beside this file; a PEP 517 backend runs it with
# another directory first on the path (pip's in-process hook's).
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from _torch_ctxext_build import layout_verdict as _verdict  # noqa: E402
from _torch_ctxext_build import releases as _releases  # noqa: E402
from _torch_ctxext_build import sources as _sources  # noqa: E402

VERSION = "0.1.0"
# The supported torch releases (_torch_ctxext_build/releases.py).
SUPPORTED = _releases.requirement()


def _verify_layout(library):
    """Verify the new build's layout against this torch in a child process
    (_torch_ctxext_build/layout_verdict.py) and install the verdict beside it,
    so that its first import only reads it. Where it cannot be made here,
    the first import makes it."""
    try:
        record = _verdict.verify(library)
    except _verdict.ProbeNotRun as e:
        _notice(f"the layout of the new build was not verified ({e}); its first import verifies it.")
        return
    _verdict.write(_verdict.beside(library), record)
    found = record["found"]
    _notice("the new build reads this torch's structures as its headers say." if not found
            else f"the new build does not read this torch's structures as its headers say: {found}")


def _notice(message):
    print(f"torch_ctxext: {message}", file=sys.stderr)


def torch_to_build_against():
    """The torch to compile against here, or None to install the sources only."""
    mode = os.environ.get("TORCH_CTXEXT_BUILD_EXT", "auto").strip().lower()
    if mode == "0" or "sdist" in sys.argv:  # a source distribution is for any torch
        return None
    try:
        import torch
    except ImportError:
        if mode == "1":
            sys.exit(
                "torch_ctxext: TORCH_CTXEXT_BUILD_EXT=1 but torch is not importable "
                "here: install torch first, then build with --no-build-isolation "
                "(pip) or --no-isolation (python -m build) so the build sees it."
            )
        _notice(
            "torch is not importable in this build environment (pip's build "
            "isolation?): installing the sources only; the C++ extension is "
            "built for the running torch at first import."
        )
        return None
    if not _releases.supported(torch.__version__):
        if mode == "1":
            sys.exit(f"torch_ctxext: torch {torch.__version__} is not supported (torch{SUPPORTED}).")
        _notice(f"torch {torch.__version__} is not supported (torch{SUPPORTED}): installing the sources only.")
        return None
    return torch


def torch_requirement(torch):
    """The requirement on torch of a build compiled against ``torch``: the
    version of its installed distribution, which pip compares against, not
    ``torch.__version__``: PyPI's CUDA wheels say ``2.12.1+cu130`` at run
    time but are installed as ``2.12.1`` (the CPU wheels as ``2.13.0+cpu``
    both ways; a torch built from source as its own ``2.13.0a0+git...``).
    A torch without distribution metadata (a source tree on the path) gets
    the supported range: pip could not match a pin against it, and the
    import loads the build only into the torch it was built for anyway."""
    from importlib import metadata

    try:
        return f"torch=={metadata.version('torch')}"
    except metadata.PackageNotFoundError:
        return f"torch{SUPPORTED}"


def local_version_label(torch_version):
    """'2.13.0+cpu' -> 'torch2.13.0.cpu' (a PEP 440 local version label)."""
    return "torch" + re.sub(r"[^A-Za-z0-9.]+", ".", torch_version).strip(".")


class BuildPyWithSources(build_py):
    """Ship csrc/ inside the package (torch_ctxext/csrc/), for builds at first
    import; never ship a _build_info.py left in the source tree by an in-place
    build (build_ext writes the one that belongs to the build it makes)."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("torch_ctxext", "_build_info")]

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "torch_ctxext", "csrc")
        self.mkpath(target)
        csrc = os.path.join(HERE, "csrc")
        for path in _sources.sources(csrc) + _sources.headers(csrc):
            self.copy_file(path, os.path.join(target, os.path.basename(path)))


def extension_build(torch):
    """ext_modules and the build_ext command for compiling against ``torch``."""
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class BuildExtRecordingTorch(BuildExtension.with_options(use_ninja=True)):
        """Also write _build_info.py beside the extension: the torch it was
        built for, read by ``import torch_ctxext`` before loading it."""

        def run(self):
            super().run()
            for ext in self.extensions:
                directory = os.path.dirname(self.get_ext_fullpath(ext.name))
                with open(os.path.join(directory, "_build_info.py"), "w") as f:
                    f.write(
                        "# Written by setup.py: the torch this build of torch_ctxext._C is for.\n"
                        f"TORCH_VERSION = {torch.__version__!r}\n"
                        f"TORCH_GIT_VERSION = {torch.version.git_version!r}\n"
                    )
                if not _sources.advise_only(torch.__version__):  # advise()'s watch and the drop-ins' Function read nothing by layout
                    _verify_layout(self.get_ext_fullpath(ext.name))

    ext = CppExtension(
        name="torch_ctxext._C",
        # The generated translation units (_torch_ctxext_build/sources.py), under build/.
        sources=[
            os.path.relpath(p, HERE)
            for p in _sources.write_units(
                os.path.join(HERE, "csrc"), os.path.join(HERE, "build", "torch_ctxext_units"), torch.__version__
            )
        ],
        define_macros=_sources.define_macros(torch.__version__, torch.version.git_version),
        extra_compile_args=_sources.extra_compile_args(),
        extra_link_args=_sources.extra_link_args(),
    )
    return [ext], BuildExtRecordingTorch


torch = torch_to_build_against()
cmdclass = {"build_py": BuildPyWithSources}
if torch is None:
    ext_modules = []
    version = VERSION
    requires_torch = f"torch{SUPPORTED}"
else:
    ext_modules, cmdclass["build_ext"] = extension_build(torch)
    # Built from an sdist, pip insists that the version matches the file name.
    from_sdist = os.path.exists(os.path.join(HERE, "PKG-INFO"))
    version = VERSION if from_sdist else f"{VERSION}+{local_version_label(torch.__version__)}"
    requires_torch = torch_requirement(torch)
    _notice(f"the C++ extension is compiled against torch {torch.__version__} ({torch.__file__}).")

setup(
    name="torch_ctxext",
    version=version,
    description="The whole documented ctx contract of torch.autograd.Function on the torch you have",
    # _torch_ctxext_build: the build layer, which builds at first import,
    # their child processes and the layout probe import without the package.
    packages=find_packages(include=["torch_ctxext", "torch_ctxext.*", "_torch_ctxext_build"]),
    # The pytest plugin is a module of its own, outside the package: pytest
    # loads it in every run, and importing the package would patch torch.
    py_modules=["torch_ctxext_pytest"],
    # conformance/suite.ini: the suite's own pytest configuration, which
    # `python -m torch_ctxext check` runs it with (not the caller's).
    package_data={"torch_ctxext": ["py.typed", "conformance/suite.ini"]},
    python_requires=">=3.10",
    # ninja: the build at first import (torch.utils.cpp_extension needs it).
    install_requires=[requires_torch, "ninja"],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={
        "console_scripts": ["torch-ctxext=torch_ctxext.__main__:main"],
        "pytest11": ["torch_ctxext = torch_ctxext_pytest"],
    },
)
