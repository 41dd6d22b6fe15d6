// torch_ctxext._C: the parts of the ctx contract Python cannot reach.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Dtype.h>

#include <ATen/FuncTorchTLS.h>

#include <dlfcn.h>

#include <sstream>
#include <string>

#include "advise_watch.h"
#include "boxed_grads.h"
#include "direct_accumulation.h"
#include "engine_layout.h"
#include "fork_safety.h"
#include "input_grad_buffers.h"
#include "output_grad_dtype.h"

#ifndef TORCH_CTXEXT_BUILT_FOR_TORCH
#error "setup.py defines TORCH_CTXEXT_BUILT_FOR_TORCH"
#endif

namespace py = pybind11;

namespace {

std::optional<at::ScalarType> to_scalar_type(py::handle dtype) {
  if (dtype.is_none()) {
    return std::nullopt;
  }
  if (!THPDtype_Check(dtype.ptr())) {
    throw py::type_error("expected a torch.dtype or None");
  }
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

// Raise the Python exception a C++ exception from the extension stands for.
void set_python_error(const std::exception& e) {
  if (dynamic_cast<const torch_ctxext::NotACtxError*>(&e) != nullptr) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } else {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

// The reentrancy guard is placed the first time a buffer is handed out, so
// that a process which never fuses pays nothing for it, and placed again if
// something replaced it since (Variable._execution_engine is a plain class
// attribute). ensure_guard(): returns the engine object that is in place.
PyObject* variable_class = nullptr;  // torch.autograd.variable.Variable
PyObject* guarded_engine = nullptr;  // what ensure_guard last returned
PyObject* ensure_guard = nullptr;

bool reentrancy_guard_in_place() {
  if (variable_class == nullptr) {
    return true;  // not armed (tests of the C functions alone)
  }
  static PyObject* const name = PyUnicode_InternFromString("_execution_engine");
  if (name == nullptr) {
    return false;
  }
  PyObject* engine = PyObject_GetAttr(variable_class, name);
  if (engine == nullptr) {
    return false;
  }
  Py_DECREF(engine);  // kept alive by the class attribute
  if (engine == guarded_engine) {
    return true;
  }
  PyObject* placed = PyObject_CallNoArgs(ensure_guard);
  if (placed == nullptr) {
    return false;
  }
  Py_XSETREF(guarded_engine, placed);
  return true;
}

// The getter behind FunctionCtx.input_grad_buffers, as a plain CPython
// function (METH_O): the property is read inside hot backward loops, and a
// pybind11 call costs about as much again as the read itself.
PyObject* input_grad_buffers_getter(PyObject* /*module*/, PyObject* ctx) {
  try {
    PyObject* tuple = torch_ctxext::input_grad_buffers(ctx);
    if (tuple == nullptr) {
      return nullptr;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); ++i) {
      if (PyTuple_GET_ITEM(tuple, i) != Py_None) {
        if (!reentrancy_guard_in_place()) {
          Py_DECREF(tuple);
          return nullptr;
        }
        break;
      }
    }
    return tuple;
  } catch (const std::exception& e) {
    set_python_error(e);
    return nullptr;
  }
}

// The same as FunctionCtx.input_grad_buffers' Python getter does it, in one
// call: a real ctx (judged by its type, not by isinstance, which a
// `__class__` attribute fools) is read; anything else (a hand-made
// FunctionCtx, a mock, a proxy) gets what torch 2.15's property gives it,
// the attribute lookup `obj._input_grad_buffers`, and is never read by the
// layout of a ctx.
PyObject* input_grad_buffers_property(PyObject* module, PyObject* obj) {
  if (torch_ctxext::is_ctx(obj)) {
    return input_grad_buffers_getter(module, obj);
  }
  static PyObject* const name = PyUnicode_InternFromString("_input_grad_buffers");
  return name == nullptr ? nullptr : PyObject_GetAttr(obj, name);
}

// ScalarType numbers as torch.dtype objects (None for -1).
py::list dtypes_of(const std::vector<int>& scalar_types) {
  py::list out;
  for (int st : scalar_types) {
    if (st < 0) {
      out.append(py::none());
    } else {
      out.append(py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(
          torch::getTHPDtype(static_cast<at::ScalarType>(st)))));
    }
  }
  return out;
}

// What a value prints as in torch's own messages.
template <typename T>
std::string printed(const T& value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

// A stream as (device, stream id): the two parts torch prints of it.
py::object stream_fields(const std::optional<c10::Stream>& stream) {
  if (!stream) {
    return py::none();
  }
  return py::make_tuple(printed(stream->device()), stream->id());
}

// A refusal's fields, under the names torch_ctxext/_explain.py phrases it
// by, and "message": the error a read raises (torch 2.15's text, written once,
// by refusal_message, which the getter and the engine hook raise).
py::dict refusal_fields(const torch_ctxext::Refusal& r) {
  using Kind = torch_ctxext::Refusal::Kind;
  py::dict d;
  d["message"] = torch_ctxext::refusal_message(r);
  switch (r.kind) {
    case Kind::kDevice:
      d["kind"] = "device";
      d["buffer_device"] = printed(r.buffer_device);
      d["gradient_device"] = printed(r.gradient_device);
      break;
    case Kind::kThread:
      d["kind"] = "thread";
      d["exposing_thread"] = printed(r.exposing_thread);
      d["accessing_thread"] = printed(r.accessing_thread);
      break;
    case Kind::kSlotStreamsUnrecorded:
      d["kind"] = "slot_streams_unrecorded";
      break;
    case Kind::kStreamsAbsent:
    case Kind::kStreamsPresent:
      d["kind"] = r.kind == Kind::kStreamsAbsent ? "streams_absent"
                                                 : "streams_present";
      d["producer_stream_present"] = r.producer.has_value();
      d["consumer_stream_present"] = r.consumer.has_value();
      break;
    case Kind::kStream:
      d["kind"] = "stream";
      d["producer_stream"] = stream_fields(r.producer);
      d["consumer_stream"] = stream_fields(r.consumer);
      d["accumulation_stream"] = stream_fields(r.accumulation);
      d["ready_stream"] = stream_fields(r.ready);
      break;
  }
  return d;
}

// Each reason as (code, detail): detail holds what the code's sentence
// needs ({} for most codes).
py::list reasons_for_python(
    const std::vector<torch_ctxext::BufferReason>& reasons) {
  py::list out;
  for (const auto& reason : reasons) {
    py::dict detail;
    if (reason.code == "shared" || reason.code == "storage_shared") {
      detail["owners"] = reason.other_owners;
    } else if (reason.code == "same_slot") {
      detail["argument"] = reason.first_argument;
    } else if (reason.refusal) {
      detail = refusal_fields(*reason.refusal);
    }
    out.append(py::make_tuple(reason.code, detail));
  }
  return out;
}

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

PyMethodDef input_grad_buffers_def = {
    "input_grad_buffers", input_grad_buffers_getter, METH_O,
    "The engine's gradient buffer for each argument of ctx's Function."};
PyMethodDef input_grad_buffers_property_def = {
    "input_grad_buffers_property", input_grad_buffers_property, METH_O,
    "FunctionCtx.input_grad_buffers: the engine's buffers for a ctx, "
    "obj._input_grad_buffers for any other object."};

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
  // PyInit__C checked that no other copy claimed the hooks: this one will.
  // Its locks are covered across fork() from now on (a refused copy never
  // gets here, and registers nothing: fork_safety.h).
  torch_ctxext::fork_safety::install_fork_handlers();
  py::module_::import("torch._C").attr(kClaimAttribute) =
      this_library_path() + " (module " + m.attr("__name__").cast<std::string>() + ")";
  m.attr("built_for_torch") = TORCH_CTXEXT_BUILT_FOR_TORCH;
  m.attr("built_for_git_version") = TORCH_CTXEXT_BUILT_FOR_GIT;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const torch_ctxext::NotACtxError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    }
  });

  m.add_object("input_grad_buffers",
               py::reinterpret_steal<py::object>(
                   PyCFunction_New(&input_grad_buffers_def, nullptr)));
  m.add_object("input_grad_buffers_property",
               py::reinterpret_steal<py::object>(
                   PyCFunction_New(&input_grad_buffers_property_def, nullptr)));
  m.def(
      "explain_input_grad_buffers",
      [](py::handle ctx) {
        return reasons_for_python(
            torch_ctxext::explain_input_grad_buffers(ctx.ptr()));
      },
      py::arg("ctx"));
#if TORCH_CTXEXT_NO_NATIVE_BOXED_GRADS  // boxed_grads.cpp is compiled up to 2.12 only
  m.def(
      "pynode_vtable_offset",
      [](py::handle ctx) { return torch_ctxext::pynode_vtable_offset(ctx.ptr()); },
      py::arg("sample_ctx"));
  m.def("is_pynode_vtable_offset", &torch_ctxext::is_pynode_vtable_offset,
        py::arg("vtable_offset"));
  m.def("install_boxed_grads_path", &torch_ctxext::install_boxed_grads_path,
        py::arg("vtable_offset"));
#endif
  m.def("arm_reentrancy_guard", [](py::object variable_class, py::object ensure) {
    Py_XSETREF(::variable_class, variable_class.release().ptr());
    Py_XSETREF(ensure_guard, ensure.release().ptr());
  });
  // The running graph task's 64-bit id, or None outside backward.
  m.def("current_graph_task_id", []() -> py::object {
    const auto* task = torch_ctxext::current_graph_task();
    if (task == nullptr) {
      return py::none();
    }
    return py::int_(torch_ctxext::task_id(task));
  });
  // Whether ctx handed out a buffer in the graph task running on this thread.
  m.def("exposed_in_running_task", [](py::handle ctx) {
    auto* fn = torch_ctxext::as_ctx(ctx.ptr(), "exposed_in_running_task");
    const auto* task = torch_ctxext::current_graph_task();
    auto* node = torch_ctxext::node_of(fn);
    return task != nullptr && node != nullptr && torch_ctxext::exposed_in(task, node);
  });
  // The layout probes (torch_ctxext/_ext/layout_check.py).
  m.def("read_ctx_layout", [](py::handle ctx) {
    const auto f = torch_ctxext::read_ctx_layout(ctx.ptr());
    py::dict d;
    d["ctx_size"] = f.ctx_size;
    d["is_variable_input"] = f.is_variable_input;
    d["materialize_grads"] = f.materialize_grads;
    d["has_node"] = f.has_node;
    d["node_address"] = f.node_address;
    d["node_points_back"] = f.node_points_back;
    d["edge_valid"] = f.edge_valid;
    d["input_dtype"] = dtypes_of(f.input_dtype);
    d["input_shape"] = f.input_shape;
    d["input_default"] = f.input_default;
    d["output_dtype"] = dtypes_of(f.output_dtype);
    d["output_shape"] = f.output_shape;
    return d;
  });
  // Whether this thread has functorch's thread-local state: once it exists,
  // every graph task and every captured ThreadLocalState deep-copies it
  // (about 1.2k instructions and two allocations more per forward+backward of
  // a small Function, measured with callgrind on torch 2.14). The import
  // must not create it (tests).
  m.def("functorch_tls_exists", []() {
    return at::functorch::getCopyOfFuncTorchTLS() != nullptr;
  });
  m.def("read_task_layout", []() {
    const auto f = torch_ctxext::read_task_layout();
    py::dict d;
    d["found"] = f.found;
    d["creates_graph"] = f.creates_graph;
    d["exec_info_empty"] = f.exec_info_empty;
    d["post_processing"] = f.post_processing;
    d["holds_lock"] = f.holds_lock;
    d["not_ready"] = f.not_ready;
    return d;
  });
  // The release boundaries this build was compiled with (engine_layout.h):
  // the package compares them with torch_ctxext/_releases.py at load, and
  // features(), `info` and the tests describe each route from them.
  py::dict boundaries;
#define TORCH_CTXEXT_EXPORT_BOUNDARY(name) boundaries[#name] = bool(TORCH_CTXEXT_##name);
  TORCH_CTXEXT_BOUNDARIES(TORCH_CTXEXT_EXPORT_BOUNDARY)
#undef TORCH_CTXEXT_EXPORT_BOUNDARY
  m.attr("boundaries") = boundaries;
#if TORCH_CTXEXT_ENGINE_CASTS_TO_OPTIONS_DTYPE
  // set_output_grad_dtype(None) through the validate_outputs wrapper.
  m.def("uncast_gradients_available", &torch_ctxext::uncast_gradients_available);
  m.def("live_uncast_declarations", &torch_ctxext::live_uncast_declarations);
  m.def("uncast_hook_placed", &torch_ctxext::uncast_hook_placed);
  m.def("uncast_hook_locked_calls", &torch_ctxext::uncast_hook_locked_calls);
  m.def("uncast_gradients_restored", &torch_ctxext::uncast_gradients_restored);
#endif
  // For tests of the engine hook that validates later producers.
  m.def("validated_later_producers", &torch_ctxext::validated_later_producers);
  m.def("producer_hook_placed", &torch_ctxext::producer_hook_placed);
  m.def("place_producer_hook", &torch_ctxext::place_producer_hook);
  m.def(
      "differentiable_outputs",
      [](py::handle ctx) {
        return torch_ctxext::differentiable_outputs(ctx.ptr());
      },
      py::arg("ctx"));
  m.def(
      "make_apply",
      [](py::handle original, py::handle resolver) {
        PyObject* fn = torch_ctxext::make_apply(original.ptr(), resolver.ptr());
        if (fn == nullptr) {
          throw py::error_already_set();
        }
        return py::reinterpret_steal<py::object>(fn);
      },
      py::arg("original"), py::arg("resolver"));
  m.def(
      "make_reentrancy_guard",
      [](py::handle original) {
        PyObject* fn = torch_ctxext::make_reentrancy_guard(original.ptr());
        if (fn == nullptr) {
          throw py::error_already_set();
        }
        return py::reinterpret_steal<py::object>(fn);
      },
      py::arg("original"));
  m.def("apply_depth", &torch_ctxext::current_apply_depth);
  // advise()'s walk and hooks (torch_ctxext/_advise/graph.py).
  torch_ctxext::bind_advise_watch(m);
  // The process-global locks the engine takes without the GIL, each made
  // fork-safe (fork_safety.h), and a test-only hook that parks the next
  // GIL-free acquisition of one inside its region, so that a test can fork
  // right then (test/test_hardening_fork.py).
  m.def("fork_safe_locks", &torch_ctxext::fork_safety::names);
  m.def("_park_next_gil_free_lock", &torch_ctxext::fork_safety::park_next,
        py::arg("name"), py::arg("milliseconds"));
  m.def("_lock_parked", &torch_ctxext::fork_safety::is_parked);
  m.def("_release_parked_lock", &torch_ctxext::fork_safety::release_parked);
  // The name CPython's own errors print for an object's type (tp_name):
  // "str", "Tensor", "numpy.dtypes.Float64DType", "torch.finfo".
  m.def("type_name", [](py::handle obj) {
    return std::string(Py_TYPE(obj.ptr())->tp_name);
  });
  m.def("note_declaration", &torch_ctxext::note_declaration);
  m.def(
      "set_output_grad_dtype",
      [](py::handle ctx, size_t index, py::handle dtype) {
        torch_ctxext::set_output_grad_dtype(ctx.ptr(), index,
                                            to_scalar_type(dtype));
      },
      py::arg("ctx"), py::arg("index"), py::arg("dtype"));
}
#undef PyInit__C

extern "C" PYBIND11_EXPORT PyObject* PyInit__C() {
  if (!no_other_copy_loaded()) {
    return nullptr;
  }
  return pybind11_PyInit__C();
}
