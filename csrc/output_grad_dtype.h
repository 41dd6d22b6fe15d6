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

}  // namespace torch_ctxext
