"""What the C++ extension is compiled from, and with which flags.

One list for both builds: ``setup.py`` (the extension built at install) and
``torch_ctxext._build`` (built at first import). Every ``csrc/*.cpp`` is a
translation unit of ``torch_ctxext._C``, so a file added to ``csrc/`` is
picked up by both without naming it anywhere.

setup.py loads this file by its path, without importing the package (whose
``__init__`` needs torch and the extension): keep it free of imports beyond
the standard library.
"""
import glob
import os
import shlex

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Where the sources live: inside an installed package (setup.py ships them
# there, for builds at first import), or beside the package in a checkout.
CSRC_CANDIDATES = (
    os.path.join(PACKAGE_DIR, "csrc"),
    os.path.join(os.path.dirname(PACKAGE_DIR), "csrc"),
)
SOURCE_PATTERNS = ("*.cpp",)
HEADER_PATTERNS = ("*.h",)


def csrc_dir():
    """The directory holding the extension's sources, or None if none is found."""
    for candidate in CSRC_CANDIDATES:
        if glob.glob(os.path.join(candidate, "*.cpp")):
            return candidate
    return None


def sources(directory):
    """Every translation unit of the extension in ``directory``, sorted."""
    return sorted(p for pattern in SOURCE_PATTERNS for p in glob.glob(os.path.join(directory, pattern)))


def headers(directory):
    """The extension's own headers in ``directory``, sorted."""
    return sorted(p for pattern in HEADER_PATTERNS for p in glob.glob(os.path.join(directory, pattern)))


def define_macros(torch_version, torch_git_version):
    """The torch build the library records (``_C.built_for_torch`` and
    ``_C.built_for_git_version``), as C string literals."""
    def c_string(value):
        return '"' + value.replace('"', "") + '"'

    return [
        ("TORCH_CTXEXT_BUILT_FOR_TORCH", c_string(torch_version)),
        ("TORCH_CTXEXT_BUILT_FOR_GIT", c_string(torch_git_version)),
    ]


def extra_compile_args():
    """Compiler flags beyond torch's own; $TORCH_CTXEXT_EXTRA_CFLAGS adds to
    them (tools/sanitizers.sh builds with -fsanitize=...).

    -DNDEBUG: torch's release builds define it, and setuptools passes it to
    the install-time build (from Python's own flags) but
    torch.utils.cpp_extension.load does not: named here, both builds compile
    the same code against torch's headers."""
    return ["-O2", "-DNDEBUG", "-Wno-invalid-offsetof"] + os.environ.get("TORCH_CTXEXT_EXTRA_CFLAGS", "").split()


def extra_link_args():
    """Linker flags beyond torch's own ($TORCH_CTXEXT_EXTRA_LDFLAGS)."""
    return os.environ.get("TORCH_CTXEXT_EXTRA_LDFLAGS", "").split()


def jit_cflags(torch_version, torch_git_version):
    """The same flags as setup.py's, for torch.utils.cpp_extension.load: its
    ninja file passes extra_cflags to the shell unquoted, so quote them here."""
    flags = [f"-D{name}={value}" for name, value in define_macros(torch_version, torch_git_version)]
    return [shlex.quote(flag) for flag in flags + extra_compile_args()]
