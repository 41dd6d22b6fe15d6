// torch_ctxext._C: the parts of the ctx contract Python cannot reach.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/Dtype.h>

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

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_ctxext engine hooks (internal; use torch_ctxext)";
  m.attr("built_for_torch") = TORCH_CTXEXT_BUILT_FOR_TORCH;
  m.attr("built_for_git_version") = TORCH_CTXEXT_BUILT_FOR_GIT;

  m.def(
      "input_grad_buffers",
      [](py::handle ctx) {
        PyObject* tuple = torch_ctxext::input_grad_buffers(ctx.ptr());
        if (tuple == nullptr) {
          throw py::error_already_set();
        }
        return py::reinterpret_steal<py::tuple>(tuple);
      },
      py::arg("ctx"));
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
      "set_output_grad_dtype",
      [](py::handle ctx, size_t index, py::handle dtype) {
        torch_ctxext::set_output_grad_dtype(ctx.ptr(), index,
                                            to_scalar_type(dtype));
      },
      py::arg("ctx"), py::arg("index"), py::arg("dtype"));
}
