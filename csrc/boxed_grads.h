#pragma once

#include "engine_layout.h"

#include <pybind11/pybind11.h>

#include <cstddef>

namespace torch_ctxext {

// Where PyNode's vtable lies in libtorch_python: its offset from the
// library's load address, from the node of `sample_ctx` (any live
// custom-Function ctx). The layout probe, in a child process, records it in
// the build's layout verdict, keyed by libtorch_python's build id.
std::ptrdiff_t pynode_vtable_offset(PyObject* sample_ctx);

// Whether PyNode's vtable is at `vtable_offset` in libtorch_python (its
// RTTI names PyNode), every address checked to lie in libtorch_python's
// readable segments before it is read: false for any other offset, never a
// crash. The loader asks it of a verdict's offset before trusting it.
bool is_pynode_vtable_offset(std::ptrdiff_t vtable_offset);

// Route every PyNode::apply through torch_ctxext's boxed path, PyNode's
// vtable being at `vtable_offset` in libtorch_python (checked: its RTTI
// names PyNode). For a boxed Function the engine's call then reaches
// ctx.apply_boxed(grads), as on torch 2.13. Nothing of autograd runs.
// Idempotent.
void install_boxed_grads_path(std::ptrdiff_t vtable_offset);

// Binds the three functions above into torch_ctxext._C (module.cpp, on the
// releases this file is compiled for: _torch_ctxext_build/sources.py).
void register_boxed_grads(pybind11::module_& m, pybind11::module_& testing);

}  // namespace torch_ctxext
