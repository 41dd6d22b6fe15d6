#pragma once

#include "engine_layout.h"

namespace torch_ctxext {

// Route every PyNode::apply through torch_ctxext's boxed path, found from the
// node of `sample_ctx` (any live custom-Function ctx). For a boxed Function
// the engine's call then reaches ctx.apply_boxed(grads), as on torch 2.13.
// Idempotent.
void install_boxed_grads_path(PyObject* sample_ctx);

}  // namespace torch_ctxext
