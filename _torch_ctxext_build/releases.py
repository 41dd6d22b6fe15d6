"""Release facts: the torch releases torch_ctxext supports, and where they differ.

The one place for these facts. Everything else reads them from here:

* ``setup.py``, ``tools/`` and the build's own processes import this module
  (``_torch_ctxext_build.releases``: the standard library only, importable
  without torch);
* the package, under the name ``torch_ctxext._releases`` (the same module
  object): the supported range (``_features``), the sources a build
  compiles (``sources``), the boundary macros the C++ extension is compiled
  with (``csrc/engine_layout.h`` branches on them and exports them back as
  ``_C.boundaries``, compared with :func:`boundaries` at load), the routes
  ``features``/``info`` describe;
* the command line (``python3 torch_ctxext/_releases.py releases``, or this
  file run the same way);
* the tests, wherever an expectation depends on who provides a member.

Adding a release in which every member is native (torch 2.16, say) is one
line: append it to ``RELEASES``. A release that changes an engine structure
torch_ctxext reads needs a boundary as well (``BOUNDARIES`` and its
``#if`` sites in ``csrc/``: docs/maintainers.md says how).
"""
import collections
import re
import sys

# Every release torch_ctxext supports, as the patch release it is tested
# with (the latest of each minor), oldest first. The supported range is from
# the first to the last of these minors.
RELEASES = (
    "2.6.0",
    "2.7.1",
    "2.8.0",
    "2.9.1",
    "2.10.0",
    "2.11.0",
    "2.12.1",
    "2.13.0",
    "2.14.1",
    "2.15.0",
)

# The release whose behaviour is the reference (docs/upstream-2.15.md): it
# provides every member natively.
REFERENCE = "2.15.0"

# The release this project's machines have on local disk: what `check` and
# the CI's main run use.
DEFAULT = "2.13.0"

# What CI's `test` job runs besides DEFAULT: one release per path of the
# boundaries below (`matrix` runs them all).
#   2.6.0   the oldest: every boundary on its old side (2.7 takes the same
#           paths but OLD_ACCELERATOR_API and the old C++ ABI)
#   2.9.1   the newest on the old side of the <= 2.9 boundaries
#   2.12.1  the newest on the old side of the <= 2.12 boundaries
#   2.15.0  everything native: the reference
CI_RELEASES = ("2.6.0", "2.9.1", "2.12.1", "2.15.0")

# The release from which torch itself provides each member torch_ctxext can
# add (older releases get it from torch_ctxext). The other members of the
# contract are native on every supported release.
NATIVE_FROM = {
    "apply_boxed": (2, 13),
    "set_output_grad_dtype": (2, 14),
    "input_grad_buffers": (2, 15),
}

# A native member torch_ctxext replaces where it provides another one:
# BackwardCFunction.apply, which cannot box grads before torch 2.13, is
# replaced wherever apply_boxed is provided.
REPLACED_ALONG_WITH = {"apply": "apply_boxed"}

Boundary = collections.namedtuple("Boundary", "name last_old old_behaviour")
Boundary.__doc__ = """A place where torch releases differ in what the extension reads.

``name``: the C++ macro is ``TORCH_CTXEXT_<name>``, 1 on releases up to
``last_old`` (the newest release that still has the old behaviour), else 0.
``old_behaviour``: what those releases do, in a sentence."""

# Each boundary once; csrc/engine_layout.h says which files branch on which.
BOUNDARIES = (
    Boundary("WEAK_CTX_NODE", (2, 12),
             "THPFunction::cdata is a std::weak_ptr<PyNode> (an intrusive_ptr from 2.13)"),
    Boundary("NO_NATIVE_BOXED_GRADS", (2, 12),
             "PyNode::apply cannot box grads (BackwardCFunction.apply_boxed is native from 2.13)"),
    Boundary("NO_STALE_CAPTURE_OVERRIDE", (2, 12),
             "no stale-capture stream override (InputBuffer::opt_overridden_consumer_stream from 2.13)"),
    Boundary("STEALABLE_BY_USE_COUNT", (2, 9),
             "the engine accumulates into a buffer slot in place when "
             "at::caching::adjusted_use_count(v) == 1 (impl::is_tensor_stealable from 2.10)"),
    Boundary("ENGINE_CASTS_TO_OPTIONS_DTYPE", (2, 9),
             "validate_outputs casts every gradient to InputMetadata::options_'s dtype "
             "(InputMetadata::grad_dtype_, which may be nullopt, from 2.10)"),
    Boundary("ADD_WITHOUT_CONSUMER_NODE", (2, 9),
             "InputBuffer::add takes no consumer Node* (a fifth parameter from 2.10)"),
    Boundary("NO_SLOT_STREAMS", (2, 7),
             "InputBuffer records no accumulation or ready stream per slot (from 2.8)"),
    Boundary("OLD_ACCELERATOR_API", (2, 6),
             "at::isAccelerator is the only spelling (at::accelerator::isAccelerator from 2.7)"),
)

# How torch.utils.cpp_extension compiles an extension on each release, which
# torch_ctxext's own ninja file (compile.py) repeats without importing it
# (test/build_load/test_build_paths.py compares the two on the running torch):
# the C++ standard, and the ABI defines it passes (the C++ ABI of the
# standard library, pybind11's ABI strings, both read from torch._C).
CPP_EXTENSION = {
    "cxx20_from": (2, 12),            # -std=c++17 before
    "glibcxx_abi_flag_until": (2, 7),  # -D_GLIBCXX_USE_CXX11_ABI=torch._C._GLIBCXX_USE_CXX11_ABI
    "pybind11_abi_flags_until": (2, 8),  # -DPYBIND11_{COMPILER_TYPE,STDLIB,BUILD_ABI} from torch._C
    "th_includes_until": (2, 6),  # -isystem include/TH and include/THC as well
}


def cpp_extension_rules(version):
    """{"std": "c++17"|"c++20", "glibcxx_abi_flag": bool, "pybind11_abi_flags": bool}:
    what torch.utils.cpp_extension of torch ``version`` passes to the compiler."""
    current = release(version)
    return {
        "std": "c++20" if current >= CPP_EXTENSION["cxx20_from"] else "c++17",
        "glibcxx_abi_flag": current <= CPP_EXTENSION["glibcxx_abi_flag_until"],
        "pybind11_abi_flags": current <= CPP_EXTENSION["pybind11_abi_flags_until"],
        "th_includes": current <= CPP_EXTENSION["th_includes_until"],
    }


def release(version):
    """(major, minor) of a torch version string: '2.13.0+cpu' -> (2, 13)."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if not match:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


SUPPORTED_RANGE = (release(RELEASES[0]), release(RELEASES[-1]))


def supported(version):
    """Whether torch ``version`` is in the supported (tested) range."""
    return SUPPORTED_RANGE[0] <= release(version) <= SUPPORTED_RANGE[1]


def newer(version):
    """Whether torch ``version`` is newer than every tested release (2.16,
    a nightly ``2.16.0a0+git...``). torch_ctxext imports there as a no-op:
    every member it can add is native from 2.15 on, and it never loads its
    extension, which reads engine structures by layout, into a torch it was
    not tested with."""
    return release(version) > SUPPORTED_RANGE[1]


def requirement():
    """The requirement on torch as a pip specifier: '>=2.6'. No upper
    bound: on a newer torch the import is a no-op (:func:`newer`), and a
    bound would make pip downgrade the torch a user already has."""
    low_major, low_minor = SUPPORTED_RANGE[0]
    return f">={low_major}.{low_minor}"


def range_text():
    """The supported range in words: '2.6 to 2.15'."""
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_RANGE
    return f"{low_major}.{low_minor} to {high_major}.{high_minor}"


def boundaries(version):
    """{boundary name: whether torch ``version`` is on its old side}."""
    current = release(version)
    return {b.name: current <= b.last_old for b in BOUNDARIES}


def define_macros(version):
    """The boundary macros a build for torch ``version`` is compiled with."""
    return [(f"TORCH_CTXEXT_{name}", "1" if old else "0") for name, old in boundaries(version).items()]


def native(member, version):
    """Whether torch ``version`` provides ``member`` itself."""
    return release(version) >= NATIVE_FROM.get(member, (0, 0))


def all_native(version):
    """Whether torch ``version`` provides every member of the contract itself
    (torch_ctxext then patches nothing; its build is advise()'s watch and the
    drop-ins' C++ Function alone)."""
    return all(native(member, version) for member in NATIVE_FROM)


def _main(argv):
    """The command line: print one fact, space-separated where it is a list."""
    facts = {
        "releases": " ".join(RELEASES),
        "ci-releases": " ".join(CI_RELEASES),
        "reference": REFERENCE,
        "default": DEFAULT,
        "requirement": requirement(),
    }
    if len(argv) != 1 or argv[0] not in facts:
        sys.stderr.write(f"usage: python3 {__file__} {'|'.join(facts)}\n")
        return 2
    print(facts[argv[0]])
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
