// The ctx of a custom Function and the autograd node it stands for.
//
// Apart from engine_layout.h (which reads engine internals by layout) so that
// advise()'s watch (advise_watch.cpp) builds alone, against public headers
// only, for a torch that provides every member of the contract natively
// (advise_module.cpp). THPFunction::cdata changed type at 2.13: the
// WEAK_CTX_NODE boundary (engine_layout.h lists the boundaries).
#pragma once

#include <Python.h>

#include <torch/csrc/autograd/function.h>  // node.h from 2.13; function.h on all
#include <torch/csrc/autograd/python_function.h>

namespace torch_ctxext {

using torch::autograd::Node;

// Whether `obj` is a THPFunction (the ctx a custom Function's forward and
// backward receive), judged by its real type: PyObject_IsInstance, which
// torch's THPFunction_Check uses, honours a `__class__` attribute, so a mock
// or a proxy would pass it and then be read by THPFunction's layout.
inline bool is_ctx(PyObject* obj) {
  return obj != nullptr && PyType_IsSubtype(Py_TYPE(obj), &THPFunctionType);
}

// The autograd node a ctx stands for, or nullptr when the node is gone or was
// never created. THPFunction::cdata is a std::weak_ptr<PyNode> up to torch
// 2.12 and a c10::intrusive_ptr<Node> from 2.13: this is the one place that
// knows.
inline Node* node_of(THPFunction* ctx) {
#if TORCH_CTXEXT_WEAK_CTX_NODE
  auto locked = ctx->cdata.lock();
  return locked.get();  // kept alive by the running engine or by the graph
#else
  return ctx->cdata.get();
#endif
}

}  // namespace torch_ctxext
