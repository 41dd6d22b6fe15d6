#pragma once

#include "engine_layout.h"

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
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
// gradient to the consumer's InputMetadata::grad_dtype (up to torch 2.9: to
// the dtype of its options, and always; see engine_layout.h) before
// accumulating it, and PyNode::apply materializes an undefined gradient from
// the output's VariableInfo, so both are set.
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

// --- set_output_grad_dtype(None) up to torch 2.9 ------------------------------
//
// From torch 2.10 a node input whose InputMetadata::grad_dtype is nullopt
// takes its gradient in whatever dtype it arrives. Up to 2.9 there is no such
// field: validate_outputs (engine.cpp) casts every gradient it hands to a
// node to the dtype of that input's metadata (engine_layout.h, B and C). The
// engine calls it through libtorch_cpu's GOT, for the root gradients and for
// the outputs of every node it runs; that entry is routed through a wrapper
// that, for each edge whose (node, input) was declared None, keeps the
// incoming gradient, lets validate_outputs check and cast as usual, and then
// puts back the kept gradient, reduced to the input's shape exactly as
// validate_outputs reduces it, but not cast.
//
// Cost: the wrapper is placed at the first None declaration in the process,
// so a process that never makes one pays nothing. Afterwards each node run
// pays one atomic load while no declaring node is alive, and a registry
// lookup per edge while one is.
//
// Declarations are keyed by (node address, input), each with a weak_ptr to
// its node: when the node dies its record is dead, and a node allocated
// later at the same address is not mistaken for it.
//
// Not covered: compiled autograd, which validates through the other
// validate_outputs overload (or its own copy of it): there a None declaration
// is cast as if it had not been made (docs/set_output_grad_dtype.md).
#if TORCH_CTXEXT_ENGINE_CASTS_TO_OPTIONS_DTYPE

// Whether the wrapper can be placed on this build: libtorch_cpu calls
// validate_outputs through a GOT entry, and that entry's symbol is the
// function this extension calls as the original.
bool uncast_gradients_available();

// Hand input `input_nr` of `node` its gradients uncast for as long as the
// node lives. Places the wrapper on first use; throws std::runtime_error
// when it cannot be placed.
void keep_gradients_uncast(const std::weak_ptr<Node>& node, size_t input_nr);

// For tests: live declarations (dead ones swept first), whether the wrapper
// is placed, how many of its calls took the registry's lock, and how many
// gradients it put back uncast.
size_t live_uncast_declarations();
bool uncast_hook_placed();
uint64_t uncast_hook_locked_calls();
uint64_t uncast_gradients_restored();

#endif

// Binds set_output_grad_dtype and what its Python side needs into
// torch_ctxext._C, and the counters for tests above into _C._testing
// (module.cpp).
void register_output_grad_dtype(pybind11::module_& m, pybind11::module_& testing);

}  // namespace torch_ctxext
