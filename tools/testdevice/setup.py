"""Build torch_ctxext's test device against the installed torch.

A test tool, not a product: see README.md. Install it into an environment
that has the torch it is for, without build isolation (the build must see
that torch):

    pip install --no-build-isolation tools/testdevice
"""
from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # pragma: no cover - said once, clearly
    raise SystemExit(
        "torch_ctxext_testdevice builds against the installed torch, which is not "
        "importable here: install torch first, then "
        "`pip install --no-build-isolation tools/testdevice`."
    )

setup(
    name="torch_ctxext_testdevice",
    version="0.1.0",
    description="A PrivateUse1 test device emulated on host memory, for torch_ctxext's tests",
    packages=["torch_ctxext_testdevice"],
    ext_modules=[
        CppExtension(
            "torch_ctxext_testdevice._C",
            ["csrc/device.cpp", "csrc/operators.cpp"],
            extra_compile_args=["-O1", "-g0"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
)
