"""What the C++ extension is compiled from, and with which flags.

One list for every build: ``setup.py`` (the extension built at install),
``torch_ctxext._ext.build`` (built at first import) and ``tools/wheels.py``.
Every ``csrc/*.cpp`` is part of ``torch_ctxext._C``, so a file added to
``csrc/`` is picked up by all of them without naming it anywhere, except
the files whose member the running torch provides natively
(``ONLY_BEFORE``), the files only the build for a torch that provides all
of them compiles (``NATIVE_ONLY``), and in that build every file but
advise()'s watch and the drop-ins' C++ Function (``ADVISE_ONLY``).

How they are compiled: every source includes the autograd headers of torch
(through ``engine_layout.h``), and those take most of a compile: on torch
2.13, 2 cores, a file that includes only ``engine_layout.h`` compiles in
13 s against 13 to 15 s for a unit of sources (parsing is about half; the
rest is what the headers define, pybind11's alone about 100 KB of code in
every unit). Each source compiled on its own came to 57 s for a first
import. So the sources are compiled in ``UNITS``: a generated file per unit
that includes its sources (a "unity" build), two units to keep two cores
busy. Each unit parses the headers once. A precompiled header does not help
(it moves the parse, but not the code the headers define, out of the two
units and in front of them), and neither did other groupings of the
sources; ``-O1`` would save 1 to 2 s of a unit and cost 8% on the read of
``ctx.input_grad_buffers``.
"""
import glob
import os

from . import releases

# The directory holding this layer and the torch_ctxext package: a checkout,
# or site-packages.
_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the sources live: inside an installed package (setup.py ships them
# there, for builds at first import), or beside the package in a checkout.
CSRC_CANDIDATES = (
    os.path.join(_PARENT, "torch_ctxext", "csrc"),
    os.path.join(_PARENT, "csrc"),
)
SOURCE_PATTERNS = ("*.cpp",)
HEADER_PATTERNS = ("*.h",)

# Sources compiled only on the old side of a release boundary (releases:
# where torch provides their member natively they are left out; module.cpp
# binds them under the same macro, csrc/engine_layout.h).
ONLY_BEFORE = {
    "boxed_grads.cpp": "NO_NATIVE_BOXED_GRADS",
}

# On a torch that provides every member natively (releases.all_native) the
# build is advise()'s C++ watch and the drop-ins' C++ Functions alone: these
# sources, advise_module.cpp the module (loaded by advise() and FusedLinear
# only: torch_ctxext/_ext/advise_module.py), and never elsewhere.
# fused_linear_native.cpp reads the engine's buffers for the drop-ins' C++
# Function through torch's own get_current_input_grad_buffers there; elsewhere
# input_grad_buffers.cpp defines the same function.
ADVISE_ONLY = ("advise_watch.cpp", "advise_module.cpp", "fused_linear.cpp", "fused_embedding.cpp",
               "fused_linear_native.cpp")
NATIVE_ONLY = ("advise_module.cpp", "fused_linear_native.cpp")

# The generated translation units and the sources each includes, about equal
# in compile time (measured on torch 2.13). A source named in neither (a new
# file in csrc/) joins the last.
UNITS = (
    ("unit_engine", ("engine_layout.cpp", "input_grad_buffers.cpp", "direct_accumulation.cpp", "patching.cpp", "boxed_grads.cpp", "fused_linear.cpp",
                     "fused_embedding.cpp", "fused_linear_native.cpp")),
    ("unit_module", ("module.cpp", "output_grad_dtype.cpp", "advise_watch.cpp", "advise_module.cpp")),
)


def csrc_dir():
    """The directory holding the extension's sources, or None if none is found."""
    for candidate in CSRC_CANDIDATES:
        if glob.glob(os.path.join(candidate, "*.cpp")):
            return candidate
    return None


def sources(directory, torch_version=None):
    """The extension's sources in ``directory``, sorted: all of them, or
    those a build for ``torch_version`` compiles."""
    found = sorted(p for pattern in SOURCE_PATTERNS for p in glob.glob(os.path.join(directory, pattern)))
    if torch_version is None:
        return found
    if advise_only(torch_version):
        return [p for p in found if os.path.basename(p) in ADVISE_ONLY]
    old_side = releases.boundaries(torch_version)
    return [p for p in found if old_side.get(ONLY_BEFORE.get(os.path.basename(p)), True)
            and os.path.basename(p) not in NATIVE_ONLY]


def advise_only(torch_version):
    """Whether a build for ``torch_version`` is advise()'s watch and the
    drop-ins' C++ Function alone (ADVISE_ONLY)."""
    return releases.all_native(torch_version)


def units(directory, torch_version):
    """[(unit name, [source paths])] of a build for ``torch_version``; units
    left empty are dropped."""
    wanted = sources(directory, torch_version)
    grouped = {name: [] for name, _ in UNITS}
    for path in wanted:
        name = os.path.basename(path)
        unit = next((u for u, members in UNITS if name in members), UNITS[-1][0])
        grouped[unit].append(path)
    return [(name, paths) for name, paths in grouped.items() if paths]


def write_units(directory, out_dir, torch_version):
    """Write the generated translation units of a build for ``torch_version``
    into ``out_dir`` (a file is rewritten only when its text changes, so that
    incremental builds stay incremental); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, members in units(directory, torch_version):
        text = "// Generated by _torch_ctxext_build/sources.py: one translation unit of torch_ctxext._C.\n" + "".join(
            '#include "%s"\n' % os.path.abspath(m).replace("\\", "/") for m in members
        )
        path = os.path.join(out_dir, name + ".cpp")
        try:
            with open(path) as f:
                unchanged = f.read() == text
        except OSError:
            unchanged = False
        if not unchanged:
            with open(path, "w") as f:
                f.write(text)
        paths.append(path)
    return paths


def headers(directory):
    """The extension's own headers in ``directory``, sorted."""
    return sorted(p for pattern in HEADER_PATTERNS for p in glob.glob(os.path.join(directory, pattern)))


def define_macros(torch_version, torch_git_version):
    """The torch build the library records (``_C.built_for_torch`` and
    ``_C.built_for_git_version``, as C string literals), and the release
    boundaries of that torch (``releases``: csrc/engine_layout.h branches on
    them)."""
    def c_string(value):
        return '"' + value.replace('"', "") + '"'

    return [
        ("TORCH_CTXEXT_BUILT_FOR_TORCH", c_string(torch_version)),
        ("TORCH_CTXEXT_BUILT_FOR_GIT", c_string(torch_git_version)),
    ] + releases.define_macros(torch_version)


def extra_compile_args():
    """Compiler flags beyond torch's own; $TORCH_CTXEXT_EXTRA_CFLAGS adds to
    them (tools/sanitizers.sh builds with -fsanitize=...).

    -DNDEBUG: torch's release builds define it, and setuptools passes it to
    the install-time build (from Python's own flags) but
    torch.utils.cpp_extension.load does not: named here, both builds compile
    the same code against torch's headers.

    -DAT_PER_OPERATOR_HEADERS: ATen's headers (ExpandUtils.h,
    TensorSubclassLikeUtils.h, ...) then include the one header of each
    operator they call instead of ATen/Functions.h, which declares all of
    them: with csrc/engine_layout.h not including ATen/ATen.h, 3 s less of
    each translation unit (16.0 to 13.0 s, both units side by side, torch
    2.13, 2 cores). A source that calls an at:: operator includes its
    ATen/ops/<name>.h.

    -fvisibility=hidden -fvisibility-inlines-hidden: the library exports
    its module's initialisation (PyInit__C) and nothing of its own beyond
    it. A second copy of it in the process (another path, a package that
    vendors torch_ctxext) must share no state with this one: with default
    visibility, an inline variable or a function-local static of an inline
    function (csrc/fork_safety.h's list of locks) is an STB_GNU_UNIQUE
    symbol, which the dynamic linker merges across every library that
    defines it, RTLD_LOCAL or not."""
    return [
        "-O2", "-DNDEBUG", "-DAT_PER_OPERATOR_HEADERS", "-Wno-invalid-offsetof",
        "-fvisibility=hidden", "-fvisibility-inlines-hidden",
    ] + os.environ.get("TORCH_CTXEXT_EXTRA_CFLAGS", "").split()


def extra_link_args():
    """Linker flags beyond torch's own ($TORCH_CTXEXT_EXTRA_LDFLAGS)."""
    return os.environ.get("TORCH_CTXEXT_EXTRA_LDFLAGS", "").split()
