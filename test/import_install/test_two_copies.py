"""Two copies of torch_ctxext's extension in one process: the second is refused.

Each copy of the library would hook the autograd engine itself (libtorch_cpu's
GOT entries, PyNode's vtable slot) and consult only its own records, so a
second copy would silently undo what the first provides (on torch <= 2.9 the
first copy's set_output_grad_dtype(None) declarations would be cast). The
first copy to load claims the hooks in torch._C; a later one refuses to load,
naming both (csrc/module.cpp), and a package that vendors torch_ctxext under
another name reports the refusal like a failed build: the import succeeds
and features() says why its members are unavailable.

Each case runs in a subprocess: a refused copy must not leave the test
process with a claim it cannot undo.
"""
import os
import re
import shutil
import subprocess
import textwrap

import pytest
import torch

import torch_ctxext
from torch_ctxext._ext import loader as _extension
from support import TESTS, python

pytestmark = pytest.mark.skipif(
    _extension.loaded is None, reason="no extension loaded (native torch 2.15)"
)

# Checks, in the subprocess, that the first copy still provides what it did.
FIRST_COPY_INTACT = textwrap.dedent(
    f"""
    import sys
    sys.path.append({TESTS!r})
    from engine_hook_functions import fused_backward, uncast_backward

    def first_copy_intact():
        uncast_backward()
        assert fused_backward(), "no backward received w's buffer"
        print("first copy: intact")
    """
)


def run(script, *args):
    proc = python(*args, code=FIRST_COPY_INTACT + textwrap.dedent(script))
    return proc.returncode, proc.stdout + proc.stderr


def test_the_same_library_loaded_again_from_another_path_is_refused_naming_both(tmp_path):
    first = _extension.loaded.path
    second = tmp_path / os.path.basename(first)
    shutil.copyfile(first, second)
    code, output = run(
        """
        import sys
        import torch_ctxext
        from _torch_ctxext_build import extension
        first_copy_intact()
        for name, path in (("vendored._C", sys.argv[1]), ("vendored_again._C", sys.argv[2])):
            try:
                extension.load(name, path)
            except ImportError as error:
                print("refused:", error)
            else:
                print("loaded a second copy:", path)
        first_copy_intact()
        """,
        str(second),
        first,  # the very same file, under another module name
    )
    assert code == 0, output
    assert "loaded a second copy" not in output, output
    assert output.count("first copy: intact") == 2, output
    assert output.count(
        "refused: torch_ctxext: another copy of torch_ctxext's C++ extension is "
        f"already loaded in this process: {first} (module torch_ctxext._C). This copy, "
    ) == 2, output
    assert f"This copy, {second}, is not loaded" in output, output
    assert f"This copy, {first}, is not loaded" in output, output
    assert "a second copy would replace the first one's hooks" in output, output


# Code the library compiles from torch's and pybind11's headers (the standard
# library's own headers give its templates default visibility, whatever they
# are instantiated with: std::vector<at::Tensor> is the standard library's).
FROM_TORCH_HEADERS = re.compile(r"^(?:(?:typeinfo|typeinfo name|vtable|VTT|guard variable) for )?(?:c10|at|torch|caffe2|pybind11)::")


def _torch_exports(nm):
    """The symbols from torch's headers that torch's own libraries
    (libtorch_cpu, libtorch_python) export themselves."""
    names = set()
    for name in ("libtorch_cpu.so", "libtorch_python.so"):
        library = os.path.join(os.path.dirname(torch.__file__), "lib", name)
        listing = subprocess.run([nm, "-D", "--defined-only", "-C", library], capture_output=True, text=True,
                                 check=True).stdout
        names.update(name for name in (line.split(" ", 2)[2] for line in listing.splitlines() if line.count(" ") >= 2)
                     if FROM_TORCH_HEADERS.match(name))
    return names


def test_the_library_exports_its_module_initialisation_and_nothing_a_second_copy_could_share():
    """Nothing of the extension is exported beyond PyInit__C: no function a
    library loaded with RTLD_GLOBAL would interpose on another copy's, and
    no unique (STB_GNU_UNIQUE) symbol but the standard library's constant
    tables, so that no state of one copy (its list of fork-safe locks, say)
    is merged with another copy's by the dynamic linker."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) to list the library's dynamic symbols")
    listing = subprocess.run(
        [nm, "-D", "--defined-only", "-C", _extension.loaded.path], capture_output=True, text=True, check=True
    ).stdout
    symbols = [line.split(" ", 2)[1:] for line in listing.splitlines() if line.strip()]
    names = {name for _, name in symbols}
    assert "PyInit__C" in names, listing
    # What torch's headers define inline in a torch class the extension
    # derives from or calls (the type_info of advise's C++ hooks'
    # FunctionPostHook and FunctionPreHook; FusedLinear's CppNode's
    # IValue accessors and the guard of Node's empty hook list) is emitted,
    # as vague linkage, wherever it is used, and exported as torch's own
    # libraries export the same symbol: torch's object, identical in every
    # copy, merged by design.
    torch_shares = _torch_exports(nm)
    assert [name for _, name in symbols
            if "torch_ctxext" in name or (FROM_TORCH_HEADERS.match(name) and name not in torch_shares)] == [], listing
    assert [name for kind, name in symbols
            if kind == "u" and "std::" not in name and name not in torch_shares] == [], listing


def vendor_a_copy(target):
    """A copy of this torch_ctxext under another name, with its C++ sources
    inside, as a library that vendors it would ship it (and as an installed
    copy carries them; a checkout keeps csrc/ beside the package)."""
    package = os.path.dirname(torch_ctxext.__file__)
    shutil.copytree(package, target, ignore=shutil.ignore_patterns("__pycache__"))
    if not os.path.isdir(os.path.join(target, "csrc")):
        shutil.copytree(os.path.join(os.path.dirname(package), "csrc"), os.path.join(target, "csrc"))


@pytest.mark.skipif(
    _extension.loaded is not None and _extension.loaded.origin == "package",
    reason="this copy carries its own build (compiled in place): a vendored copy of it would "
    "load its own library instead of building, which the next test covers",
)
def test_a_vendored_copy_of_the_package_reports_the_refusal_in_features(tmp_path):
    # A copy of the package under another name, as a library that vendors
    # torch_ctxext ships it. It loads an extension only for a member still
    # missing (one the installed copy does not provide, say a newer member):
    # simulated by hiding the first copy's input_grad_buffers while the
    # vendored copy is imported.
    vendor_a_copy(tmp_path / "vendored_ctxext")
    code, output = run(
        """
        import sys, warnings
        sys.path.insert(0, sys.argv[1])
        import torch_ctxext
        from torch.autograd.function import FunctionCtx
        first_copy_intact()
        hidden = FunctionCtx.__dict__["input_grad_buffers"]
        del FunctionCtx.input_grad_buffers
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import vendored_ctxext
        for w in caught:
            print("warned:", w.category.__name__, w.message)
        print("vendored features:", vendored_ctxext.features()["input_grad_buffers"])
        FunctionCtx.input_grad_buffers = hidden
        print("vendored loaded:", "vendored_ctxext._C" in sys.modules)
        print("first features:", torch_ctxext.features()["input_grad_buffers"])
        first_copy_intact()
        """,
        str(tmp_path),
    )
    assert code == 0, output
    path = _extension.loaded.path
    refusal = (
        "torch_ctxext: another copy of torch_ctxext's C++ extension is already "
        f"loaded in this process: {path} (module torch_ctxext._C). This copy, "
        f"{path} (module vendored_ctxext._C), is not loaded"
    )
    assert f"vendored features: unavailable: {refusal}" in output, output
    assert f"warned: ExtensionUnavailableWarning {refusal}" in output, output
    assert "vendored loaded: False" in output, output
    assert "first features: torch_ctxext" in output, output
    assert output.count("first copy: intact") == 2, output


@pytest.mark.parametrize("where", ["", "inside the first copy's `with explain()`"])
def test_a_vendored_copy_imported_second_says_the_members_are_the_first_copys_not_native(tmp_path, where):
    """Every member the installed copy provides is already there when the
    vendored copy is imported: it loads nothing, and says who provides them
    (torch_ctxext, from the other copy), never "native"; also where it is
    imported while the first copy's explain() observes the reads."""
    vendor_a_copy(tmp_path / "vendored_ctxext")
    code, output = run(
        """
        import contextlib, sys
        sys.path.insert(0, sys.argv[1])
        import torch_ctxext
        with torch_ctxext.explain() if sys.argv[2] else contextlib.nullcontext():
            import vendored_ctxext
        from vendored_ctxext import _features
        provided = [n for n, s in torch_ctxext.features().items() if s == "torch_ctxext"]
        print("provided by the first:", provided)
        print("vendored says:", sorted({vendored_ctxext.features()[n] for n in provided}))
        print("vendored route:", sorted({_features.routes()[n] for n in provided}))
        first_copy_intact()
        """,
        str(tmp_path),
        where,
    )
    assert code == 0, output
    assert "provided by the first: []" not in output, output
    assert "vendored says: ['torch_ctxext']" in output, output
    assert "vendored route: ['provided by another copy of torch_ctxext, loaded first (torch_ctxext." in output, output
    assert "first copy: intact" in output, output


# In the subprocess: a backward that fuses x's gradient when it can, and asks
# both copies' explain() why, from inside the backward.
EXPLAIN_IN_A_BACKWARD = """
import os, sys, torch
sys.path.insert(0, sys.argv[1])
import torch_ctxext
if sys.argv[2]:  # whatever the vendored copy would build goes to an empty cache
    os.environ["TORCH_CTXEXT_CACHE"] = sys.argv[2]
import vendored_ctxext

started = []

def no_process_started(event, args):
    if event in ("subprocess.Popen", "os.posix_spawn", "os.system", "os.exec"):
        started.append(args[1] if event == "subprocess.Popen" else args[0])
        raise RuntimeError("a process was started (a build) in a backward")

sys.addaudithook(no_process_started)

class Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        for name, copy in (("vendored", vendored_ctxext), ("first", torch_ctxext)):
            try:
                print(f"{name} explains:", copy.explain(ctx).codes)
            except Exception as error:
                print(f"{name} explain raised:", type(error).__name__, error)
        (buffer,) = ctx.input_grad_buffers
        if buffer is None:
            return g * 2
        buffer.add_(g * 2)
        return None

def step():
    x = torch.ones(3, requires_grad=True)
    # x * 3 runs first (created last): Fused finds its buffer with x * 3's gradient.
    (Fused.apply(x) + x * 3).sum().backward()
    return x.grad.tolist()

print("grad:", step())
for name, copy in (("vendored", vendored_ctxext), ("first", torch_ctxext)):
    try:
        with copy.explain() as report:
            print(f"grad in the {name} copy's block:", step())
    except Exception as error:
        print(f"the {name} copy's block raised:", type(error).__name__, error)
    else:
        print(f"{name} report:", report)
print("processes started:", started)
print("vendored loaded:", "vendored_ctxext._C" in sys.modules)
first_copy_intact()
"""


@pytest.mark.parametrize("sources", ["the same sources", "other sources than the cache's builds"])
def test_explain_of_a_vendored_copy_imported_second_explains_with_the_first_copys_extension(tmp_path, sources):
    """The vendored copy's members are the first copy's (it loads no
    extension of its own): its explain(ctx), and its `with explain()` around
    a backward that reads ctx.input_grad_buffers, use the extension behind
    them, the first copy's, also inside the other copy's `with explain()`;
    they never load, refuse or build one, inside the user's backward. Its
    sources may differ from every build in the cache."""
    vendor_a_copy(tmp_path / "vendored_ctxext")
    cache = ""  # the same sources: the first copy's build is the vendored copy's too
    if sources != "the same sources":
        with open(tmp_path / "vendored_ctxext" / "csrc" / "module.cpp", "a") as f:
            f.write("\n// a vendored copy patched by the library that ships it\n")
        cache = str(tmp_path / "empty_cache")
    code, output = run(EXPLAIN_IN_A_BACKWARD, str(tmp_path), cache)
    assert code == 0, output
    assert "raised" not in output, output
    assert output.count("vendored explains: ('exposed',)") == 3, output
    assert output.count("first explains: ('exposed',)") == 3, output
    assert output.count("grad: [5.0, 5.0, 5.0]") == 1, output
    for copy in ("vendored", "first"):
        assert f"grad in the {copy} copy's block: [5.0, 5.0, 5.0]" in output, output
        assert f"{copy} report: input_grad_buffers, per Function:\n  Fused: 1 read(s), 1 exposed, 0 fell back" in output, output
    assert "processes started: []" in output, output
    assert "vendored loaded: False" in output, output
    assert "first copy: intact" in output, output


@pytest.mark.parametrize("first", ["torch_ctxext", "vendored_ctxext"])
def test_a_copy_imported_second_describes_the_build_of_the_copy_loaded_first(tmp_path, first):
    """A copy imported second loads no extension: what it says of the build
    (the release boundaries it was compiled with, the slots it can expose,
    which extension `info` shows) is that of the copy loaded first, whatever
    either copy is called."""
    vendor_a_copy(tmp_path / "vendored_ctxext")
    second = "vendored_ctxext" if first == "torch_ctxext" else "torch_ctxext"
    code, output = run(
        f"""
        import importlib, sys
        sys.path.insert(0, sys.argv[1])
        first = importlib.import_module({first!r})
        second = importlib.import_module({second!r})
        report = importlib.import_module({second!r} + ".conformance.report")
        print("first loaded:", {first!r} + "._C" in sys.modules, "second loaded:", {second!r} + "._C" in sys.modules)
        compiled = dict(first._C.boundaries)
        print("boundaries:", first._features.boundaries() == compiled, second._features.boundaries() == compiled)
        print("routes:", second._features.routes()["input_grad_buffers"])
        print(*report.extension_lines()[:2], sep="\\n")
        """,
        str(tmp_path),
    )
    assert code == 0, output
    assert "first loaded: True second loaded: False" in output, output
    assert "boundaries: True True" in output, output
    assert f"routes: provided by another copy of torch_ctxext, loaded first ({first}._backport.input_grad_buffers)" in output, output
    assert f"built for      {torch.__version__} (git {torch.version.git_version[:12]})" in output, output
    # (the first copy's library: the cache's build, or the one a copy of the installed package carries)
    assert re.search(rf"extension      another copy's, loaded first: /\S+ \(module {first}\._C\)\n", output), output
