// Where torch_ctxext reads autograd-engine internals by layout.
//
// Everything that depends on how a particular torch release lays out its
// engine structures lives here, so that supporting another release means
// changing this file only. The extension is built against the headers of the
// installed torch and refuses (in Python, before loading, and again here at
// load time) to run against any other build.
#pragma once

#include <Python.h>

#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/function.h>  // node.h from 2.13; function.h on all
#include <torch/csrc/autograd/python_function.h>
#include <torch/version.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace torch_ctxext {

using torch::autograd::GraphTask;
using torch::autograd::Node;

// Raised (as Python's TypeError) when an object that is not the ctx of a
// custom Function reaches a function that reads it by layout.
struct NotACtxError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Whether `obj` is a THPFunction (the ctx a custom Function's forward and
// backward receive), judged by its real type: PyObject_IsInstance, which
// torch's THPFunction_Check uses, honours a `__class__` attribute, so a mock
// or a proxy would pass it and then be read by THPFunction's layout.
bool is_ctx(PyObject* obj);

// `obj` as a THPFunction; throws NotACtxError naming its type otherwise.
THPFunction* as_ctx(PyObject* obj, const char* who);

// The autograd node a ctx stands for, or nullptr when the node is gone or was
// never created. THPFunction::cdata is a std::weak_ptr<PyNode> up to torch
// 2.12 and a c10::intrusive_ptr<Node> from 2.13: this is the one place that
// knows.
inline Node* node_of(THPFunction* ctx) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR <= 12
  auto locked = ctx->cdata.lock();
  return locked.get();  // kept alive by the running engine or by the graph
#else
  return ctx->cdata.get();
#endif
}

// The GraphTask this thread is executing, or nullptr outside backward.
//
// The engine exports the address of the current task's `exec_info_` only; the
// task itself is found by subtracting the member's offset in the GraphTask of
// the headers this file was compiled with, then cross-checked against two
// other exported accessors. A mismatch means the headers do not describe the
// running binary: we throw instead of reading garbage.
GraphTask* current_graph_task();

// The same, without the cross-check: for the engine hook that runs inside
// InputBuffer::add, where the check already passed when the hook was placed.
GraphTask* current_graph_task_unchecked();

// The graph task's 64-bit id (get_current_graph_task_id() returns an int,
// which wraps after 2^31 tasks in a process).
inline uint64_t task_id(const GraphTask* task) {
  return task->id_;
}

// Whether the task runs backward with create_graph=True. The engine gives
// each task a snapshot of the caller's thread-local state with grad mode set
// to create_graph and installs it on the thread for every node it runs; a
// backward may change the thread's grad mode afterwards (torch.no_grad()), so
// the thread's current mode says nothing about the task.
bool task_creates_graph(const GraphTask* task);

// Whether the task's post-processing (final callbacks, leaf stream syncs) has
// started: the engine then holds the task's mutex_ and runs no more nodes.
inline bool task_in_post_processing(const GraphTask* task) {
  return task->future_completed_.load();
}

// Whether this thread holds `mutex` (glibc records the owner's thread id in
// every mutex it locks): locking it again would deadlock.
bool held_by_this_thread(std::mutex& mutex);

}  // namespace torch_ctxext

namespace torch_ctxext {

// What the extension reads of a ctx, its node and their metadata, read the
// way the rest of the extension reads them: compared at import against what
// Python knows of a probe Function, to catch a torch whose layout differs
// from the headers (an edited tree, an "Unknown" git hash, a distribution's
// patches) before anything is written by that layout.
struct CtxLayoutFacts {
  size_t ctx_size = 0;  // sizeof(THPFunction), against _FunctionBase.__basicsize__
  std::vector<bool> is_variable_input;
  bool materialize_grads = false;
  bool has_node = false;
  bool node_points_back = false;  // the node's Python object is this ctx
  std::vector<bool> edge_valid;   // per next edge
  // Per node input (= Function output): scalar type, shape, default-constructed.
  std::vector<int> input_dtype;
  std::vector<std::vector<int64_t>> input_shape;
  std::vector<bool> input_default;
  // Per Function output, as PyNode materializes zeros from it.
  std::vector<int> output_dtype;
  std::vector<std::vector<int64_t>> output_shape;
};
CtxLayoutFacts read_ctx_layout(PyObject* ctx);

// What the extension reads of the running GraphTask (inside a backward).
struct TaskLayoutFacts {
  bool found = false;
  bool creates_graph = false;
  bool exec_info_empty = false;
  bool post_processing = false;
  bool holds_lock = false;
  int64_t not_ready = -1;  // buffers waiting for producers
};
TaskLayoutFacts read_task_layout();

}  // namespace torch_ctxext
