#pragma once

#include "engine_layout.h"

#include <string>
#include <utility>
#include <vector>

namespace torch_ctxext {

// The error texts of torch 2.15, verbatim.
inline constexpr const char* kOutsideBackward =
    "input_grad_buffers can only be accessed while autograd is executing "
    "backward()";
inline constexpr const char* kNotTheExecutingNode =
    "input_grad_buffers can only be accessed from the currently executing "
    "autograd.Function backward()";
inline constexpr const char* kCreateGraph =
    "input_grad_buffers does not support create_graph=True";
inline constexpr const char* kAnomaly =
    "input_grad_buffers does not support anomaly detection";
inline constexpr const char* kPostHooks =
    "input_grad_buffers does not support post-hooks on the producing autograd "
    "node because directly accumulated gradients are returned as None and "
    "cannot be observed or replaced by those hooks";

// A new tuple with one entry per argument passed to Function.apply: the
// engine's InputBuffer slot for that argument when it may be updated in
// place, else None. Throws std::runtime_error with torch 2.15's texts when
// the property is not available.
PyObject* input_grad_buffers(PyObject* ctx);

// Why each entry of input_grad_buffers is (or would be) None: a
// (code, explanation) per argument; code "exposed" when it is not None.
// Reads without taking references, so it changes nothing it explains.
std::vector<std::pair<std::string, std::string>> explain_input_grad_buffers(
    PyObject* ctx);

// A replacement for torch.autograd.graph._engine_run_backward: calls
// `check()` first when this thread is inside a backward (some node is
// executing), then `original(*args, **kwargs)`. Outside any backward (the
// common case) it costs one thread-local read.
PyObject* make_reentrancy_guard(PyObject* original, PyObject* check);

}  // namespace torch_ctxext
