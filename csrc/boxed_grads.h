#pragma once

#include "engine_layout.h"

namespace torch_ctxext {

// Route every PyNode::apply through torch_ctxext's boxed path, found from the
// node of `sample_ctx` (any live custom-Function ctx). For a boxed Function
// the engine's call reaches BackwardCFunction.apply with placeholders, and
// take_boxed_grads(ctx) returns the list of real grads. Idempotent.
void install_boxed_grads_path(PyObject* sample_ctx);

// The grads list of the engine's boxed call of `ctx` that is running on this
// thread (a new reference; taken once), or None: a direct grad_fn.apply()
// call, another ctx, or no boxed call.
PyObject* take_boxed_grads(PyObject* ctx);

}  // namespace torch_ctxext
