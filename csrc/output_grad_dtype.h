#pragma once

#include "engine_layout.h"

#include <optional>
#include <vector>

namespace torch_ctxext {

// For each output of a Function whose outputs have been wrapped (after
// Function.apply), whether the engine tracks a gradient for it: the node's
// input metadata for that output was built from a differentiable tensor.
// Empty when the call built no graph (no input requires grad, or no_grad).
std::vector<bool> differentiable_outputs(PyObject* ctx);

// Make the engine hand backward the gradient of output `index` in `dtype`
// (nullopt: in whatever dtype it arrives). The engine casts each incoming
// gradient to the consumer's InputMetadata::grad_dtype before accumulating
// it, and PyNode::apply materializes an undefined gradient from the output's
// VariableInfo, so both are set.
void set_output_grad_dtype(PyObject* ctx, size_t index,
                           std::optional<at::ScalarType> dtype);

// A replacement for Function.apply (to wrap in classmethod): calls
// `original(cls, *args, **kwargs)`; when set_output_grad_dtype was called
// meanwhile on this thread, then calls `resolver(depth, output, ok)` with the
// depth of this apply (ok False, output None when apply raised).
PyObject* make_apply(PyObject* original, PyObject* resolver);

// How many Function.apply calls are running on this thread.
int current_apply_depth();

// Record that a declaration was made on this thread.
void note_declaration();

}  // namespace torch_ctxext
