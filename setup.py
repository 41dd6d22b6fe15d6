"""Build torch_ctxext against the torch that is installed.

The C++ extension reads autograd-engine structures by their layout, so it is
compiled against the headers of the running torch and records which torch that
was (``torch_ctxext/_build_info.py``); ``import torch_ctxext`` refuses to load
it against any other build. Install with ``pip install --no-build-isolation .``
so that the build sees your torch rather than a fresh one pip would fetch.
"""
import os
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    sys.exit(
        "torch_ctxext: install torch first (pip install torch), then rerun "
        "with --no-build-isolation so the extension is built against it."
    )

HERE = os.path.dirname(os.path.abspath(__file__))
SUPPORTED = ">=2.6,<2.16"

def write_build_info():
    path = os.path.join(HERE, "torch_ctxext", "_build_info.py")
    text = (
        "# Written by setup.py: the torch this copy of torch_ctxext was built for.\n"
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"TORCH_GIT_VERSION = {torch.version.git_version!r}\n"
    )
    with open(path, "w") as f:
        f.write(text)


write_build_info()

def c_string(value):
    return '"' + value.replace('"', "") + '"'

ext = CppExtension(
    name="torch_ctxext._C",
    sources=[
        "csrc/module.cpp",
        "csrc/engine_layout.cpp",
        "csrc/input_grad_buffers.cpp",
        "csrc/output_grad_dtype.cpp",
        "csrc/boxed_grads.cpp",
        "csrc/direct_accumulation.cpp",
        "csrc/patching.cpp",
    ],
    define_macros=[
        ("TORCH_CTXEXT_BUILT_FOR_TORCH", c_string(torch.__version__)),
        ("TORCH_CTXEXT_BUILT_FOR_GIT", c_string(torch.version.git_version)),
    ],
    extra_compile_args=["-O2", "-Wno-invalid-offsetof"]
    + os.environ.get("TORCH_CTXEXT_EXTRA_CFLAGS", "").split(),
    extra_link_args=os.environ.get("TORCH_CTXEXT_EXTRA_LDFLAGS", "").split(),
)

setup(
    name="torch_ctxext",
    version="0.1.0",
    description="The whole documented ctx contract of torch.autograd.Function on the torch you have",
    packages=find_packages(include=["torch_ctxext", "torch_ctxext.*"]),
    # The pytest plugin is a module of its own, outside the package: pytest
    # loads it in every run, and importing the package would patch torch.
    py_modules=["torch_ctxext_pytest"],
    package_data={"torch_ctxext": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=[f"torch{SUPPORTED}"],
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    entry_points={
        "console_scripts": ["torch-ctxext=torch_ctxext.__main__:main"],
        "pytest11": ["torch_ctxext = torch_ctxext_pytest"],
    },
)
