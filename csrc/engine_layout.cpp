#include "engine_layout.h"

#include <cstddef>
#include <stdexcept>
#include <string>

namespace torch_ctxext {

THPFunction* as_ctx(PyObject* obj) {
  if (obj == nullptr || !THPFunction_Check(obj)) {
    throw std::invalid_argument(
        std::string("expected the ctx of a custom autograd.Function, got ") +
        (obj ? Py_TYPE(obj)->tp_name : "NULL"));
  }
  return reinterpret_cast<THPFunction*>(obj);
}

GraphTask* current_graph_task() {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr) {
    return nullptr;
  }
  // GraphTask is not standard-layout (it has a base class and std::atomic
  // members), so offsetof is "conditionally supported"; GCC and Clang compute
  // it exactly as the compiler that built libtorch laid the struct out.
  const auto offset = offsetof(GraphTask, exec_info_);
  auto* task = reinterpret_cast<GraphTask*>(
      reinterpret_cast<char*>(const_cast<void*>(
          static_cast<const void*>(exec_info))) -
      offset);
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  const auto id = torch::autograd::get_current_graph_task_id();
  if (nodes != &task->nodes_in_graph_ ||
      static_cast<int64_t>(task->id_) != static_cast<int64_t>(id)) {
    throw std::runtime_error(
        "torch_ctxext: the autograd GraphTask layout of the running torch does "
        "not match the headers the extension was built with. Rebuild "
        "torch_ctxext against the installed torch: pip install "
        "--no-build-isolation --force-reinstall --no-deps torch_ctxext");
  }
  return task;
}

}  // namespace torch_ctxext
