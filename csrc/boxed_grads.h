#pragma once

#include "engine_layout.h"

namespace torch_ctxext {

// Whether this build provides the boxed-grads engine path (torch <= 2.12,
// which lacks boxed_grads_call; later releases have it natively).
constexpr bool kProvidesBoxedGrads =
    TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR <= 12;

// Route every PyNode::apply through torch_ctxext's boxed path, found from the
// node of `sample_ctx` (any live custom-Function ctx). For a boxed Function
// the engine's call reaches entry(ctx, grads, *placeholders), which calls
// ctx.apply_boxed(grads). Idempotent.
void install_boxed_grads_path(PyObject* sample_ctx, PyObject* entry);

}  // namespace torch_ctxext
