// torch_ctxext._C: the parts of the ctx contract Python cannot reach.
//
// Each feature file binds its own functions (register_<feature>, declared in
// its header) into _C, and what only tests call into _C._testing; this file
// makes the module: it claims the engine hooks for this copy of the library,
// records what the build was compiled for, and calls them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <ATen/FuncTorchTLS.h>

#include <dlfcn.h>

#include <string>

#include "advise_watch.h"
#include "boxed_grads.h"
#include "direct_accumulation.h"
#include "engine_layout.h"
#include "fork_safety.h"
#include "fused_linear.h"
#include "input_grad_buffers.h"
#include "output_grad_dtype.h"

#ifndef TORCH_CTXEXT_BUILT_FOR_TORCH
#error "setup.py defines TORCH_CTXEXT_BUILT_FOR_TORCH"
#endif

namespace py = pybind11;

namespace {

// --- one copy of the extension per process ----------------------------------
//
// Each copy of this library (a second path, or a package that vendors
// torch_ctxext under another name) would hook the engine on its own:
// libtorch_cpu's GOT entries (validate_outputs, InputBuffer::add) and PyNode's
// vtable slot hold one function each, and the hook a second copy writes
// consults only that copy's records, so the first copy's declarations and
// exposures would silently stop being honoured. The first copy to load
// claims the hooks in torch._C (one per process, whatever the copies are
// called; extensions load RTLD_LOCAL, so a symbol would not be seen), and any
// later one refuses to load, naming both. torch_ctxext/_ext/loader.py checks
// the same marker before loading and reports the refusal like a failed build.
constexpr const char* kClaimAttribute = "_torch_ctxext_engine_hooks_owner";

std::string this_library_path() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&this_library_path), &info) == 0 ||
      info.dli_fname == nullptr) {
    return "<unknown path>";
  }
  return info.dli_fname;
}

// False, with ImportError set, when another copy claimed the hooks. Plain C
// API: it runs before pybind11 creates this module (see PyInit__C).
bool no_other_copy_loaded() {
  PyObject* torch_c = PyImport_ImportModule("torch._C");
  if (torch_c == nullptr) {
    return false;
  }
  PyObject* first = PyObject_GetAttrString(torch_c, kClaimAttribute);
  Py_DECREF(torch_c);
  if (first == nullptr) {
    PyErr_Clear();
    return true;
  }
  PyErr_Format(
      PyExc_ImportError,
      "torch_ctxext: another copy of torch_ctxext's C++ extension is already "
      "loaded in this process: %S. This copy, %s, is not loaded: each copy "
      "hooks the autograd engine itself (libtorch_cpu's GOT, PyNode's vtable) "
      "and a second copy would replace the first one's hooks. Import a single "
      "torch_ctxext per process (a library that vendors it should use the "
      "installed one when present).",
      first, this_library_path().c_str());
  Py_DECREF(first);
  return false;
}

// This copy claims the hooks (PyInit__C checked that no other copy did).
// Its locks are covered across fork() from now on (a refused copy never
// gets here, and registers nothing: fork_safety.h).
void claim_engine_hooks(py::module_& m) {
  torch_ctxext::fork_safety::install_fork_handlers();
  py::module_::import("torch._C").attr(kClaimAttribute) =
      this_library_path() + " (module " + m.attr("__name__").cast<std::string>() + ")";
}

// The torch this build was compiled for, and the release boundaries it was
// compiled with (engine_layout.h): the package compares them with
// torch_ctxext/_releases.py at load, and features(), `info` and the tests
// describe each route from them.
void record_build(py::module_& m) {
  m.attr("built_for_torch") = TORCH_CTXEXT_BUILT_FOR_TORCH;
  m.attr("built_for_git_version") = TORCH_CTXEXT_BUILT_FOR_GIT;
  py::dict boundaries;
#define TORCH_CTXEXT_EXPORT_BOUNDARY(name) boundaries[#name] = bool(TORCH_CTXEXT_##name);
  TORCH_CTXEXT_BOUNDARIES(TORCH_CTXEXT_EXPORT_BOUNDARY)
#undef TORCH_CTXEXT_EXPORT_BOUNDARY
  m.attr("boundaries") = boundaries;
}

// An object that is not a ctx, handed to a function that reads a ctx by
// layout, raises TypeError.
void translate_not_a_ctx_error(std::exception_ptr p) {
  try {
    if (p) {
      std::rethrow_exception(p);
    }
  } catch (const torch_ctxext::NotACtxError& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  }
}

// What the process holds because of this library: the process-global locks
// the engine takes without the GIL, each made fork-safe (fork_safety.h); for
// tests, a hook that parks the next GIL-free acquisition of one inside its
// region, so that a test can fork right then (test/hardening/test_hardening_fork.py),
// and whether this thread has functorch's thread-local state: once it
// exists, every graph task and every captured ThreadLocalState deep-copies
// it (about 1.2k instructions and two allocations more per forward+backward
// of a small Function, measured with callgrind on torch 2.14), so the import
// must not create it.
void register_process_state(py::module_& m, py::module_& testing) {
  namespace fork_safety = torch_ctxext::fork_safety;
  m.def("fork_safe_locks", &fork_safety::names);
  testing.def("park_next_gil_free_lock", &fork_safety::park_next,
              py::arg("name"), py::arg("milliseconds"));
  testing.def("lock_parked", &fork_safety::is_parked);
  testing.def("release_parked_lock", &fork_safety::release_parked);
  testing.def("functorch_tls_exists", []() {
    return at::functorch::getCopyOfFuncTorchTLS() != nullptr;
  });
}

}  // namespace

// The module's initialisation is named pybind11_PyInit__C (the name
// PYBIND11_MODULE pastes is rescanned, so this macro renames it), and
// PyInit__C, below, calls it only when no other copy is loaded: pybind11 2
// (the headers of torch 2.6, for one) re-initialises the static definition
// of the module a library created when its PyInit runs again (the same file
// imported under a second name), which corrupts the loaded module and aborts
// the process at exit.
#define PyInit__C pybind11_PyInit__C
PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_ctxext engine hooks (internal; use torch_ctxext)";
  claim_engine_hooks(m);
  record_build(m);
  py::register_exception_translator(&translate_not_a_ctx_error);
  py::module_ testing = m.def_submodule(
      "_testing", "What only torch_ctxext's tests call: counters and switches of the engine hooks");
  register_process_state(m, testing);
  torch_ctxext::register_engine_layout(m, testing);
  torch_ctxext::register_input_grad_buffers(m, testing);
  torch_ctxext::register_direct_accumulation(m, testing);
  torch_ctxext::register_output_grad_dtype(m, testing);
  torch_ctxext::register_fused_linear(m, testing);
#if TORCH_CTXEXT_NO_NATIVE_BOXED_GRADS  // boxed_grads.cpp is compiled up to 2.12 only
  torch_ctxext::register_boxed_grads(m, testing);
#endif
  // advise()'s walk and hooks (torch_ctxext/_advise/graph.py).
  torch_ctxext::bind_advise_watch(m);
}
#undef PyInit__C

extern "C" PYBIND11_EXPORT PyObject* PyInit__C() {
  if (!no_other_copy_loaded()) {
    return nullptr;
  }
  return pybind11_PyInit__C();
}
