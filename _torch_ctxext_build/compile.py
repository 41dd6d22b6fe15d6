"""Compiling the extension against one torch, without importing it.

What ``torch.utils.cpp_extension.load`` would do for torch_ctxext's sources,
written out here: the ninja file (the same flags: include directories, the
C++ standard and ABI defines of the release, ``releases.cpp_extension_rules``;
the same libraries) and ninja run on it. Nothing here imports torch, so one
code path serves:

* the build at first import, run in a child process of the importer
  (``build_child``): the importer hands over the facts of its running torch
  (:func:`target_of_running_torch`, attribute reads only);
* the wheels (``tools/wheels.py``): a torch wheel unpacked, never installed
  nor imported, for every release and CPython (:func:`target_of_unpacked_torch`
  reads the same facts from its files).
"""
import collections
import os
import re

from . import releases, sources
from .cache import LIBRARY

Target = collections.namedtuple("Target", "torch_dir torch_version git_version python_include cxx11_abi pybind11")
Target.__doc__ = """One torch to compile against.

``torch_dir``: the torch package directory (``include/``, ``lib/``);
``torch_version``, ``git_version``: ``torch.__version__`` and
``torch.version.git_version``; ``python_include``: the directory of the
CPython headers (``Python.h``) of the interpreter it is for;
``cxx11_abi``: ``torch._C._GLIBCXX_USE_CXX11_ABI``; ``pybind11``:
{"COMPILER_TYPE", "STDLIB", "BUILD_ABI": ``torch._C._PYBIND11_<name>``}
(values None where torch has none)."""

PYBIND11_NAMES = ("COMPILER_TYPE", "STDLIB", "BUILD_ABI")
# The libraries every extension links, in cpp_extension's order.
LIBRARIES = ("c10", "torch_cpu", "torch", "torch_python")


def target_of_running_torch(torch, python_include):
    """The Target of an imported torch module (attribute reads only)."""
    return Target(
        os.path.dirname(os.path.abspath(torch.__file__)), torch.__version__, torch.version.git_version or "unknown",
        python_include, bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        {name: getattr(torch._C, f"_PYBIND11_{name}", None) for name in PYBIND11_NAMES},
    )


_VERSION_PY = re.compile(r"^(__version__|git_version)\s*(?::\s*str)?\s*=\s*['\"]([^'\"]*)['\"]", re.M)


def target_of_unpacked_torch(torch_dir, python_include):
    """The Target of a torch package directory that is not imported (an
    unpacked wheel): the version from its ``version.py``, the C++ ABI from
    the symbols libc10 exports, pybind11's ABI strings from the constants
    libtorch_python carries (what ``torch._C._PYBIND11_*`` return)."""
    with open(os.path.join(torch_dir, "version.py")) as f:
        facts = dict(_VERSION_PY.findall(f.read()))
    cxx11 = cxx11_abi(os.path.join(torch_dir, "lib", "libc10.so"))
    return Target(torch_dir, facts["__version__"], facts.get("git_version", "unknown"), python_include, cxx11,
                  pybind11_strings(os.path.join(torch_dir, "lib", "libtorch_python.so")))


# c10::detail::torchCheckFail(const char*, const char*, uint32_t, const std::string&),
# which every torch exports: its std::string is std::__cxx11::basic_string
# under the C++11 ABI, "Ss" under the old one.
_CHECK_FAIL = re.compile(rb"_ZN3c106detail14torchCheckFailEPKcS2_jRK(NSt7__cxx11|Ss)")


def cxx11_abi(libc10):
    """Whether libc10 was compiled with the C++11 ABI of libstdc++
    (torch._C._GLIBCXX_USE_CXX11_ABI), from the symbols it exports."""
    with open(libc10, "rb") as f:
        match = _CHECK_FAIL.search(f.read())
    if match is None:
        raise ValueError(f"{libc10} exports no c10::detail::torchCheckFail: not a libc10 this reads")
    return match.group(1) == b"NSt7__cxx11"


# pybind11's internals id, which spells the three strings out (2.4 and on):
# "__pybind11_internals_v4_gcc_libstdcpp_cxxabi1011__".
_PYBIND11_ID = re.compile(rb"__pybind11_internals_v\d+\w*?(_gcc|_clang|_icc|_mingw)(_libstdcpp|_libcpp)(_cxxabi\d+)")


def pybind11_strings(libtorch_python):
    """{name: the pybind11 ABI string torch._C would report, or None}: the
    COMPILER_TYPE, STDLIB and BUILD_ABI pybind11 was compiled with, which
    torch/csrc/Module.cpp exports as torch._C._PYBIND11_<name> (where
    cpp_extension passes them on), read from the internals id torch's
    pybind11 keeps in libtorch_python."""
    with open(libtorch_python, "rb") as f:
        match = _PYBIND11_ID.search(f.read())
    if match is None:
        return {name: None for name in PYBIND11_NAMES}
    return {name: value.decode() for name, value in zip(PYBIND11_NAMES, match.groups())}


def include_dirs(target):
    include = os.path.join(target.torch_dir, "include")
    dirs = [include, os.path.join(include, "torch", "csrc", "api", "include")]
    if releases.cpp_extension_rules(target.torch_version)["th_includes"]:
        dirs += [os.path.join(include, "TH"), os.path.join(include, "THC")]
    return dirs


def cflags(target):
    """The compiler flags of a build for ``target``: cpp_extension's for that
    release, then torch_ctxext's own (``sources``)."""
    rules = releases.cpp_extension_rules(target.torch_version)
    flags = ["-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    if rules["pybind11_abi_flags"]:
        flags += [f'-DPYBIND11_{name}="{value}"' for name, value in sorted(target.pybind11.items()) if value is not None]
    for directory in include_dirs(target) + [target.python_include]:
        flags += ["-isystem", directory]
    if rules["glibcxx_abi_flag"]:
        flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(target.cxx11_abi)}")
    flags += ["-fPIC", f"-std={rules['std']}"]
    flags += [f"-D{name}={value}" for name, value in sources.define_macros(target.torch_version, target.git_version)]
    return flags + sources.extra_compile_args()


def ldflags(target):
    # cpp_extension's order: the extra flags, then torch's libraries.
    return ["-shared"] + sources.extra_link_args() + ["-L" + os.path.join(target.torch_dir, "lib")] + \
        [f"-l{name}" for name in LIBRARIES]


def write_ninja(target, csrc, directory, compiler="c++", library=LIBRARY):
    """Write the translation units and ``directory``/build.ninja of a build
    for ``target``; return the path of the ninja file."""
    import shlex  # here: only a build writes a ninja file

    units = sources.write_units(csrc, directory, target.torch_version)
    quote = lambda words: " ".join(shlex.quote(w) for w in words)  # noqa: E731
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {compiler}",
        f"cflags = {quote(cflags(target))}",
        f"ldflags = {quote(ldflags(target))}",
        "",
        "rule compile",
        "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "",
        "rule link",
        "  command = $cxx $in $ldflags -o $out",
        "",
    ]
    objects = []
    for unit in units:
        name = os.path.splitext(os.path.basename(unit))[0] + ".o"
        objects.append(name)
        lines.append(f"build {name}: compile {_ninja_path(unit)}")
    lines += ["", f"build {library}: link {' '.join(objects)}", "", f"default {library}", ""]
    path = os.path.join(directory, "build.ninja")
    text = "\n".join(lines)
    try:
        with open(path) as f:
            unchanged = f.read() == text
    except OSError:
        unchanged = False
    if not unchanged:  # an unchanged file keeps a second run from compiling anything
        with open(path, "w") as f:
            f.write(text)
    return path


def _ninja_path(path):
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def ninja_arguments():
    """ninja's arguments: verbose (the log shows each command), and $MAX_JOBS
    jobs where it is set (as cpp_extension)."""
    jobs = os.environ.get("MAX_JOBS", "").strip()
    return ["-v"] + (["-j", jobs] if jobs.isdigit() else [])
