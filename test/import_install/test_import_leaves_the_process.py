"""``import torch_ctxext`` leaves the process as ``import torch`` leaves it.

The import loads the extension, checks the cheap identities (the torch
build, the release boundaries, the layout verdict kept beside the build) and
installs the members. It runs nothing of autograd: no backward, hence none
of the engine's once-per-process start, which counts every registered
backend's devices (on a CUDA build ``cudaGetDeviceCount``, which initialises
the driver), starts a thread per device, and from then on refuses backward
in forked children. So, as after ``import torch`` alone:

* no engine thread exists after the import, and no device was queried;
* a forked child runs backward, on the CPU and on an accelerator, whether
  the accelerator's backend was imported before torch_ctxext or after;
* a backend imported after torch_ctxext trains with the same gradients as
  one imported before it (its engine thread is started by the first
  backward, as without torch_ctxext);
* on a CUDA build of torch, the import makes no call into the CUDA runtime
  or driver (an interposer, LD_PRELOADed, records every call).

The same holds of the project's test device (tools/testdevice): its import
runs no backward either, as a real backend's does not. Each case runs in a
fresh interpreter; CI runs this module on every CI release, native 2.15
included.
"""
import importlib.util
import os
import shutil
import subprocess
import textwrap

import pytest
import torch
from support import TESTS, python

HAS_TESTDEVICE = importlib.util.find_spec("torch_ctxext_testdevice") is not None
needs_testdevice = pytest.mark.skipif(
    not HAS_TESTDEVICE, reason="the test device is not installed (tools/run.py installs it)"
)
# Each script ends with os._exit: torch 2.12 and 2.14 abort now and then at
# interpreter shutdown after a backward on a device thread, with or without
# torch_ctxext (test_testdevice.py says more).
EXIT = "\nimport os, sys\nsys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n"
PRELUDE = """
import os
def threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return sorted(names)
def device_queries():
    import sys
    td = sys.modules.get("torch_ctxext_testdevice")
    return td.counters()["device_count_queries"] if td else 0
"""
MODULES = {"torch_ctxext": "torch_ctxext", "testdevice": "torch_ctxext_testdevice"}


def run(code, env=None):
    """``code`` in a fresh interpreter (the shared test helpers on its path); its stdout's lines."""
    completed = python(code=PRELUDE + textwrap.dedent(code) + EXIT, path=[TESTS], **(env or {}))
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed.stdout.strip().splitlines()


def imports(order):
    """One import statement: the modules in that order."""
    return "import " + ", ".join(MODULES[name] for name in order)


# --- no engine thread, no device query ------------------------------------


@pytest.mark.parametrize("backend", [False, pytest.param(True, marks=needs_testdevice)], ids=["cpu only", "testdevice"])
def test_the_import_starts_no_thread_and_queries_no_device(backend):
    out = run(f"""
        import torch
        {"import torch_ctxext_testdevice" if backend else ""}
        before, queries = threads(), device_queries()
        import torch_ctxext
        after = threads()
        print(after == before, [t for t in after if t.startswith("pt_autograd")], device_queries() - queries)
    """)
    assert out == ["True [] 0"]


# --- forked children ----------------------------------------------------------

ORDERS = {
    "torch_ctxext": ["torch_ctxext"],
    "testdevice, then torch_ctxext": ["testdevice", "torch_ctxext"],
    "torch_ctxext, then testdevice": ["torch_ctxext", "testdevice"],
    "testdevice alone": ["testdevice"],
}


@pytest.mark.parametrize(
    "order",
    [o if o == "torch_ctxext" else pytest.param(o, marks=needs_testdevice) for o in ORDERS],
)
def test_a_forked_child_runs_backward_after_the_import(order):
    """Until the parent's own first backward, a forked child may run
    backward (torch.multiprocessing's fork start, forked data workers that
    compute gradients), on the CPU and on the accelerator; then the parent
    trains as usual."""
    devices = ["cpu"] + (["testdevice:0", "testdevice:1"] if "testdevice" in ORDERS[order] else [])
    out = run(f"""
        import torch
        {imports(ORDERS[order])}
        def step(device):
            x = torch.ones(3, device=device, requires_grad=True)
            (x * 3).sum().backward()
            return x.grad.cpu().tolist()
        pid = os.fork()
        if pid == 0:
            try:
                print("child", [step(d) for d in {devices!r}], flush=True)
            except BaseException as e:
                print("child failed:", e, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent", [step(d) for d in {devices!r}])
    """)
    expected = str([[3.0, 3.0, 3.0]] * len(devices))
    assert out == [f"child {expected}", f"parent {expected}"]


# --- a backend imported after torch_ctxext ------------------------------------

TRAINING = """
    import torch
    {imports}
    from doubling_functions import doubling, fuse_into_buffer
    torch.manual_seed(0)
    exposed = []
    Double = doubling(lambda ctx, g: fuse_into_buffer(ctx, g, exposed=exposed))
    device = "testdevice"
    w = torch.randn(4, 4, device=device, requires_grad=True)
    reference = w.detach().clone().requires_grad_(True)
    for _ in range(3):
        x = torch.randn(2, 4, device=device)
        # w reaches the fusing Function after another consumer ran: its slot may be exposed.
        loss = (Double.apply(w) @ x.t()).sum() + (w.sin() * x.sum()).sum()
        expected = (2 * reference @ x.t()).sum() + (reference.sin() * x.sum()).sum()
        loss.backward()
        expected.backward()
        with torch.no_grad():
            w -= 0.1 * w.grad
            reference -= 0.1 * reference.grad
        w.grad = None
        reference.grad = None
    print(w.detach().cpu().tolist())
    print(exposed)
    print(torch.equal(w.detach(), reference.detach()))
"""


@needs_testdevice
def test_a_backend_imported_after_torch_ctxext_trains_with_the_same_gradients():
    before = run(TRAINING.format(imports=imports(["testdevice", "torch_ctxext"])))
    after = run(TRAINING.format(imports=imports(["torch_ctxext", "testdevice"])))
    assert after == before
    assert before[2] == "True"  # fused or not, the same weights as plain autograd


# --- no call into CUDA ------------------------------------------------------------

# An interposer for the entry points through which torch queries or
# initialises CUDA (the runtime's device queries and initialisation, the
# driver's cuInit, NVML): each call is appended to $CUDA_CALLS_LOG as
# "pid name", then forwarded to the real function, if loaded.
INTERPOSER = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static void note(const char* name) {
  const char* path = getenv("CUDA_CALLS_LOG");
  FILE* f = path ? fopen(path, "a") : NULL;
  if (f) { fprintf(f, "%d %s\n", (int)getpid(), name); fclose(f); }
}
#define FORWARD(name, params, args, fail)                          \
  int name params {                                                \
    note(#name);                                                   \
    int(*next) params = (int(*) params)dlsym(RTLD_NEXT, #name);    \
    return next ? next args : fail;                                \
  }
FORWARD(cudaGetDeviceCount, (int* n), (n), 100)
FORWARD(cudaGetDevice, (int* d), (d), 100)
FORWARD(cudaSetDevice, (int d), (d), 100)
FORWARD(cudaDriverGetVersion, (int* v), (v), 100)
FORWARD(cudaRuntimeGetVersion, (int* v), (v), 100)
FORWARD(cudaFree, (void* p), (p), 100)
FORWARD(cudaMalloc, (void** p, size_t n), (p, n), 100)
FORWARD(cudaInitDevice, (int d, unsigned a, unsigned b), (d, a, b), 100)
FORWARD(cuInit, (unsigned flags), (flags), 100)
FORWARD(cuDeviceGetCount, (int* n), (n), 100)
FORWARD(cuDriverGetVersion, (int* v), (v), 100)
FORWARD(nvmlInit_v2, (void), (), 12)
FORWARD(nvmlInitWithFlags, (unsigned flags), (flags), 12)
FORWARD(nvmlDeviceGetCount_v2, (unsigned* n), (n), 12)
"""


@pytest.fixture(scope="module")
def cuda_interposer(tmp_path_factory):
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    assert compiler, "a C compiler builds the CUDA interposer"
    directory = tmp_path_factory.mktemp("interposer")
    (directory / "cuda_calls.c").write_text(INTERPOSER)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(directory / "cuda_calls.so"),
                    str(directory / "cuda_calls.c"), "-ldl"], check=True)
    return directory / "cuda_calls.so"


def _cuda_calls(interposer, tmp_path, code):
    """The calls into CUDA that the process running ``code`` made itself
    (not a child of it), and its pid."""
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    out = run(f"print(os.getpid())\n{code}", env={"LD_PRELOAD": str(interposer), "CUDA_CALLS_LOG": str(log)})
    pid = out[0]
    lines = log.read_text().splitlines() if log.exists() else []
    return [line.split()[1] for line in lines if line.split()[0] == pid]


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU build of torch has no CUDA runtime to call")
def test_the_import_makes_no_call_into_the_cuda_runtime(cuda_interposer, tmp_path):
    # The interposer sees what torch calls: a device count is a runtime call.
    assert "cudaGetDeviceCount" in _cuda_calls(cuda_interposer, tmp_path, "import torch\ntorch.cuda.device_count()")
    # ... and a backward, which starts the engine, counts the devices.
    backward = "import torch\nx = torch.ones(1, requires_grad=True)\n(x * 2).sum().backward()"
    assert "cudaGetDeviceCount" in _cuda_calls(cuda_interposer, tmp_path, backward)
    import_torch = _cuda_calls(cuda_interposer, tmp_path, "import torch")
    assert import_torch == []
    assert _cuda_calls(cuda_interposer, tmp_path, "import torch\nimport torch_ctxext") == import_torch


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU build of torch has no CUDA runtime to call")
def test_a_first_import_that_builds_makes_no_call_into_cuda_with_a_cuda_toolkit_visible(cuda_interposer, tmp_path):
    """The build runs in a process of its own, which never imports
    torch.utils.cpp_extension: that module asks torch.cuda.is_available()
    when it finds a CUDA toolkit ($CUDA_HOME here), which calls into CUDA."""
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    env = {"LD_PRELOAD": str(cuda_interposer), "CUDA_CALLS_LOG": str(tmp_path / "calls.log"),
           "CUDA_HOME": str(toolkit), "TORCH_CTXEXT_CACHE": str(tmp_path / "cache")}

    def calls(code):
        (tmp_path / "calls.log").unlink(missing_ok=True)
        out = run(f"print(os.getpid())\n{code}", env=env)
        lines = (tmp_path / "calls.log").read_text().splitlines() if (tmp_path / "calls.log").exists() else []
        return [line.split()[1] for line in lines if line.split()[0] == out[0]], out

    # The control: cpp_extension in the importer, with that toolkit visible, calls into CUDA.
    assert calls("import torch.utils.cpp_extension")[0] != []
    made, out = calls("import torch, torch_ctxext\nprint(torch_ctxext.features()['input_grad_buffers'])")
    import torch_ctxext
    from torch_ctxext._ext import loader

    # What the import does comes from what this torch lacks and from how the
    # copy under test was installed: one that carries its own binary (built
    # in place, a wheel's) loads it, one installed from source builds.
    assert out[-1] == torch_ctxext.features()["input_grad_buffers"]
    built = list((tmp_path / "cache" / "builds").glob("*/_C.so"))
    if loader.loaded is None or loader.loaded.origin.startswith("package"):
        assert built == [], "nothing to build: the members are native, or the copy carries its binary"
    else:
        assert built, "this import built the extension"
    assert made == []
