#pragma once

#include "engine_layout.h"

namespace torch_ctxext {

// Route every PyNode::apply through torch_ctxext's boxed path, found from the
// node of `sample_ctx` (any live custom-Function ctx). For a boxed Function
// the engine's call reaches entry(ctx, grads, *placeholders), which calls
// ctx.apply_boxed(grads). Idempotent.
void install_boxed_grads_path(PyObject* sample_ctx, PyObject* entry);

}  // namespace torch_ctxext
