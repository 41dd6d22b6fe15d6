#pragma once

#include "direct_accumulation.h"
#include "engine_layout.h"

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace torch_ctxext {

// The error texts of torch 2.15, verbatim.
inline constexpr const char* kOutsideBackward =
    "input_grad_buffers can only be accessed while autograd is executing "
    "backward()";
inline constexpr const char* kNotTheExecutingNode =
    "input_grad_buffers can only be accessed from the currently executing "
    "autograd.Function backward()";
inline constexpr const char* kPostProcessing =
    "input_grad_buffers cannot be accessed during backward post-processing";
inline constexpr const char* kCreateGraph =
    "input_grad_buffers does not support create_graph=True";
inline constexpr const char* kAnomaly =
    "input_grad_buffers does not support anomaly detection";
inline constexpr const char* kStaleCaptureStream =
    "input_grad_buffers does not support "
    "set_override_stale_capture_stream(True)";
inline constexpr const char* kPostHooks =
    "input_grad_buffers does not support post-hooks on the producing autograd "
    "node because directly accumulated gradients are returned as None and "
    "cannot be observed or replaced by those hooks";
inline constexpr const char* kLegacyAccess =
    "Attribute 'input_grad_buffers' is invalid for this instance of "
    "_C._FunctionBase. Accessing this attribute directly on an instance of "
    "autograd.Function is a legacy access pattern that is no longer "
    "supported. For examples on how to use new\xe2\x80\x91" "style autograd "
    "functions, see "
    "https://pytorch.org/docs/stable/autograd.html#torch.autograd.Function ";
inline constexpr const char* kReentrant =
    "Calling backward or grad reentrantly after accessing a non-None "
    "ctx.input_grad_buffers entry is not supported";

// A new tuple with one entry per argument passed to Function.apply: the
// engine's InputBuffer slot for that argument when it may be updated in
// place, else None. Throws std::runtime_error with torch 2.15's texts when
// the property is not available or direct accumulation is refused, and
// NotACtxError when `ctx` is not a custom Function's ctx.
PyObject* input_grad_buffers(PyObject* ctx);

// Why an entry of input_grad_buffers is what it is: a code from
// torch_ctxext/_explain.py's vocabulary, which phrases it, and the detail
// its sentence needs.
struct BufferReason {
  std::string code;            // "exposed" when the entry is not None
  int64_t other_owners = 0;    // "shared", "storage_shared"
  size_t first_argument = 0;   // "same_slot": the argument given the buffer
  std::optional<Refusal> refusal;  // "refused": what a read would raise
};

// Why each entry of input_grad_buffers is (or would be) None: a reason per
// argument. Reads without taking references, so it changes nothing it
// explains.
std::vector<BufferReason> explain_input_grad_buffers(PyObject* ctx);

// A replacement for the engine's run_backward (a bound method, given as
// `original`): when this thread is inside a node's backward that handed out
// a buffer in the running graph task, raises kReentrant; then calls
// `original(*args, **kwargs)`. Outside any backward (the common case) it
// costs one thread-local read.
PyObject* make_reentrancy_guard(PyObject* original);

// Binds the getter (and FunctionCtx.input_grad_buffers' property), explain's
// reasons, and the reentrancy guard into torch_ctxext._C (module.cpp).
void register_input_grad_buffers(pybind11::module_& m, pybind11::module_& testing);

}  // namespace torch_ctxext
