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

namespace torch_ctxext {

using torch::autograd::GraphTask;
using torch::autograd::Node;

// The ctx object a custom Function's forward and backward receive is a
// THPFunction; `obj` must be one (checked, TypeError otherwise).
THPFunction* as_ctx(PyObject* obj);

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

}  // namespace torch_ctxext
