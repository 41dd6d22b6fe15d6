// torch_ctxext._C: the parts of the ctx contract Python cannot reach.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/Dtype.h>

#include "boxed_grads.h"
#include "engine_layout.h"
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

// The getter of FunctionCtx.input_grad_buffers, as a plain CPython function
// (METH_O): the property is read inside hot backward loops, and a pybind11
// call costs about as much again as the read itself.
// Called once, the first time a buffer is handed out in this process: installs
// the reentrancy guard, so that a process that never fuses pays nothing for it.
PyObject* first_exposure_callback = nullptr;

PyObject* input_grad_buffers_getter(PyObject* /*module*/, PyObject* ctx) {
  try {
    if (!THPFunction_Check(ctx)) {
      // A ctx that is no autograd node is never the one executing backward.
      throw std::runtime_error(torch_ctxext::current_graph_task() != nullptr
                                   ? torch_ctxext::kNotTheExecutingNode
                                   : torch_ctxext::kOutsideBackward);
    }
    PyObject* tuple = torch_ctxext::input_grad_buffers(ctx);
    if (tuple == nullptr) {
      return nullptr;
    }
    // Mark the ctx with the graph task that handed out a buffer, so that the
    // reentrancy guard applies to this execution only and dies with the ctx.
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); ++i) {
      if (PyTuple_GET_ITEM(tuple, i) != Py_None) {
        PyObject* id =
            PyLong_FromLong(torch::autograd::get_current_graph_task_id());
        const int failed =
            id == nullptr ||
            PyObject_SetAttrString(ctx, "_ctxext_exposed_in_task", id) < 0;
        Py_XDECREF(id);
        if (failed) {
          Py_DECREF(tuple);
          return nullptr;
        }
        if (first_exposure_callback != nullptr) {
          PyObject* callback = first_exposure_callback;
          first_exposure_callback = nullptr;
          PyObject* result = PyObject_CallNoArgs(callback);
          Py_DECREF(callback);
          if (result == nullptr) {
            Py_DECREF(tuple);
            return nullptr;
          }
          Py_DECREF(result);
        }
        break;
      }
    }
    return tuple;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyMethodDef input_grad_buffers_def = {
    "input_grad_buffers", input_grad_buffers_getter, METH_O,
    "The engine's gradient buffer for each argument of ctx's Function."};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_ctxext engine hooks (internal; use torch_ctxext)";
  m.attr("built_for_torch") = TORCH_CTXEXT_BUILT_FOR_TORCH;
  m.attr("built_for_git_version") = TORCH_CTXEXT_BUILT_FOR_GIT;

  m.add_object("input_grad_buffers",
               py::reinterpret_steal<py::object>(
                   PyCFunction_New(&input_grad_buffers_def, nullptr)));
  m.def(
      "explain_input_grad_buffers",
      [](py::handle ctx) {
        return torch_ctxext::explain_input_grad_buffers(ctx.ptr());
      },
      py::arg("ctx"));
  m.def(
      "install_boxed_grads_path",
      [](py::handle ctx, py::handle entry) {
        torch_ctxext::install_boxed_grads_path(ctx.ptr(), entry.ptr());
      },
      py::arg("sample_ctx"), py::arg("entry"));
  m.def(
      "explain_input_grad_buffers",
      [](py::handle ctx) {
        return torch_ctxext::explain_input_grad_buffers(ctx.ptr());
      },
      py::arg("ctx"));
  m.def("on_first_exposure", [](py::object callback) {
    Py_XDECREF(first_exposure_callback);
    first_exposure_callback = callback.release().ptr();
  });
  m.def("current_graph_task_id", []() -> py::object {
    if (torch_ctxext::current_graph_task() == nullptr) {
      return py::none();
    }
    return py::int_(torch::autograd::get_current_graph_task_id());
  });
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
      [](py::handle original, py::handle check) {
        PyObject* fn =
            torch_ctxext::make_reentrancy_guard(original.ptr(), check.ptr());
        if (fn == nullptr) {
          throw py::error_already_set();
        }
        return py::reinterpret_steal<py::object>(fn);
      },
      py::arg("original"), py::arg("check"));
  m.def("apply_depth", &torch_ctxext::current_apply_depth);
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
