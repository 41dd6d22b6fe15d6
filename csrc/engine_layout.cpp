#include "engine_layout.h"

#include <pybind11/stl.h>
#include <torch/csrc/DynamicTypes.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>
#include <string>

namespace torch_ctxext {

THPFunction* as_ctx(PyObject* obj, const char* who) {
  if (!is_ctx(obj)) {
    throw NotACtxError(
        std::string(who) +
        " expects the ctx of a custom autograd.Function (the object its "
        "forward and backward receive as ctx), but got an object of type " +
        (obj ? Py_TYPE(obj)->tp_name : "NULL"));
  }
  return reinterpret_cast<THPFunction*>(obj);
}

namespace {

GraphTask* task_from_exec_info(const void* exec_info) {
  // GraphTask is not standard-layout (it has a base class and std::atomic
  // members), so offsetof is "conditionally supported"; GCC and Clang compute
  // it exactly as the compiler that built libtorch laid the struct out.
  const auto offset = offsetof(GraphTask, exec_info_);
  return reinterpret_cast<GraphTask*>(
      reinterpret_cast<char*>(const_cast<void*>(exec_info)) - offset);
}

}  // namespace

GraphTask* current_graph_task_unchecked() {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  return exec_info == nullptr ? nullptr : task_from_exec_info(exec_info);
}

GraphTask* current_graph_task() {
  GraphTask* task = current_graph_task_unchecked();
  if (task == nullptr) {
    return nullptr;
  }
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  // get_current_graph_task_id() converts the 64-bit id to int: compare the
  // same conversion, or every read fails once 2^31 tasks have run.
  const int id = torch::autograd::get_current_graph_task_id();
  if (nodes != &task->nodes_in_graph_ || static_cast<int>(task->id_) != id) {
    throw std::runtime_error(
        "torch_ctxext: the autograd GraphTask layout of the running torch does "
        "not match the headers the extension was built with. Rebuild "
        "torch_ctxext against the installed torch: pip install "
        "--no-build-isolation --force-reinstall --no-deps torch_ctxext");
  }
  return task;
}

namespace {

// at::ThreadLocalState keeps the task's grad mode in a private member and has
// no getter before torch 2.15. An explicit template instantiation may name a
// private member ([temp.spec.general]/6); the friend function it defines hands
// out the member pointer, with the offset the compiler computes from the
// headers, so nothing is read by a guessed layout.
struct AutogradTlsMember {
  using type = c10::AutogradState at::ThreadLocalState::*;
  friend type member_pointer(AutogradTlsMember);
};

template <typename Tag, typename Tag::type Member>
struct ExposeMember {
  friend typename Tag::type member_pointer(Tag) {
    return Member;
  }
};

template struct ExposeMember<AutogradTlsMember, &at::ThreadLocalState::autograd_tls_>;

}  // namespace

#if TORCH_CTXEXT_ENGINE_CASTS_TO_OPTIONS_DTYPE
void set_metadata_options_dtype(InputMetadata& metadata, at::ScalarType dtype) {
  // Up to torch 2.9 the dtype the engine casts a node input's gradients to is
  // the one in InputMetadata::options_, declared `const` with no setter, and
  // the const member deletes the assignment operator. Replacing the element
  // (destroy + placement new) is no better: C++17 ([basic.life]/8) forbids
  // reaching a replaced object with a const member through the old pointer,
  // which is how the node's vector would reach it, and the constructor would
  // capture the current stream anew. So the member is written in place
  // (measured to take on 2.6 to 2.9). What makes it safe:
  //  * the metadata is never a const object: it lives on the heap, in the
  //    node's input_metadata_ vector, and libtorch reads it through
  //    options() in other translation units after opaque calls, so no
  //    compiled code can have folded the value it had at construction;
  //  * it is written once, by the thread that created the node, while
  //    Function.apply is returning and before its outputs reach the caller,
  //    so no engine thread can be reading it;
  //  * only on the releases whose engine casts to this dtype (the #if), and
  //    only after the import-time layout probe read a node's metadata back as
  //    Python sees it (_torch_ctxext_build/layout_check.py, "metadata");
  //  * it is read back here, and a write that did not take is an error.
  auto& options = const_cast<at::TensorOptions&>(metadata.options());
  options = options.dtype(dtype);
  if (c10::typeMetaToScalarType(metadata.dtype()) != dtype) {
    throw std::runtime_error(
        "torch_ctxext: the gradient dtype of an output could not be recorded "
        "in the engine's input metadata on this torch build");
  }
}
#endif

bool task_creates_graph(const GraphTask* task) {
  const at::ThreadLocalState& state = task->thread_locals_;
  return (state.*member_pointer(AutogradTlsMember{})).get_grad_mode();
}

bool held_by_this_thread(std::mutex& mutex) {
#if defined(__GLIBC__)
  const pid_t self = static_cast<pid_t>(syscall(SYS_gettid));
  return __atomic_load_n(&mutex.native_handle()->__data.__owner, __ATOMIC_RELAXED) == self;
#else
  (void)mutex;
  return false;
#endif
}

}  // namespace torch_ctxext

namespace torch_ctxext {

CtxLayoutFacts read_ctx_layout(PyObject* obj) {
  THPFunction* ctx = as_ctx(obj, "read_ctx_layout");
  CtxLayoutFacts facts;
  facts.ctx_size = sizeof(THPFunction);
  facts.is_variable_input = ctx->is_variable_input;
  facts.materialize_grads = ctx->materialize_grads;
  Node* node = node_of(ctx);
  facts.has_node = node != nullptr;
  facts.node_address = reinterpret_cast<uintptr_t>(node);
  if (node == nullptr) {
    return facts;
  }
  auto* py_node = static_cast<torch::autograd::PyNode*>(node);
#if TORCH_CTXEXT_WEAK_CTX_NODE
  facts.node_points_back = py_node->obj == obj;
#else
  facts.node_points_back = py_node->pyobj() == obj;
#endif
  for (size_t i = 0; i < node->num_outputs(); ++i) {
    facts.edge_valid.push_back(node->next_edge(i).is_valid());
  }
  for (size_t i = 0; i < node->num_inputs(); ++i) {
    const auto& meta = node->input_metadata(i);
    facts.input_default.push_back(meta.was_default_constructed());
    if (meta.was_default_constructed()) {
      facts.input_dtype.push_back(-1);
      facts.input_shape.emplace_back();
      continue;
    }
    facts.input_dtype.push_back(static_cast<int>(
        c10::typeMetaToScalarType(meta.dtype())));
    std::vector<int64_t> shape;
    if (!meta.is_nested_tensor()) {
      for (const auto& s : meta.shape_as_dim_vector()) {
        shape.push_back(s.guard_int(__FILE__, __LINE__));
      }
    }
    facts.input_shape.push_back(shape);
  }
  for (const auto& info : ctx->output_info) {
    facts.output_dtype.push_back(static_cast<int>(info.scalar_type));
    std::vector<int64_t> shape;
    for (const auto& s : info.size) {
      shape.push_back(s.guard_int(__FILE__, __LINE__));
    }
    facts.output_shape.push_back(shape);
  }
  return facts;
}

TaskLayoutFacts read_task_layout() {
  TaskLayoutFacts facts;
  GraphTask* task = current_graph_task();
  if (task == nullptr) {
    return facts;
  }
  facts.found = true;
  facts.creates_graph = task_creates_graph(task);
  facts.exec_info_empty = task->exec_info_.empty();
  facts.post_processing = task_in_post_processing(task);
  facts.holds_lock = held_by_this_thread(task->mutex_);
  if (!facts.holds_lock) {
    std::lock_guard<std::mutex> lock(task->mutex_);
    facts.not_ready = static_cast<int64_t>(task->not_ready_.size());
  }
  return facts;
}

namespace {

// ScalarType numbers as torch.dtype objects (None for -1).
pybind11::list dtypes_of(const std::vector<int>& scalar_types) {
  pybind11::list out;
  for (int st : scalar_types) {
    if (st < 0) {
      out.append(pybind11::none());
    } else {
      out.append(pybind11::reinterpret_borrow<pybind11::object>(reinterpret_cast<PyObject*>(
          torch::getTHPDtype(static_cast<at::ScalarType>(st)))));
    }
  }
  return out;
}

}  // namespace

void register_engine_layout(pybind11::module_& m, pybind11::module_& testing) {
  // The layout probes (_torch_ctxext_build/layout_check.py).
  m.def("read_ctx_layout", [](pybind11::handle ctx) {
    const auto f = read_ctx_layout(ctx.ptr());
    pybind11::dict d;
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
  m.def("read_task_layout", []() {
    const auto f = read_task_layout();
    pybind11::dict d;
    d["found"] = f.found;
    d["creates_graph"] = f.creates_graph;
    d["exec_info_empty"] = f.exec_info_empty;
    d["post_processing"] = f.post_processing;
    d["holds_lock"] = f.holds_lock;
    d["not_ready"] = f.not_ready;
    return d;
  });
  // The running graph task's 64-bit id, or None outside backward.
  testing.def("current_graph_task_id", []() -> pybind11::object {
    const auto* task = current_graph_task();
    if (task == nullptr) {
      return pybind11::none();
    }
    return pybind11::int_(task_id(task));
  });
}

}  // namespace torch_ctxext
