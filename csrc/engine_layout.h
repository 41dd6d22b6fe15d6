// Where torch_ctxext reads autograd-engine internals by layout.
//
// What depends on how a particular torch release lays out its engine
// structures is read through this file; the releases themselves are named in
// torch_ctxext/_releases.py only (the boundaries below). The extension is
// built against the headers of the installed torch and refuses (in Python,
// before loading, and again here at load time) to run against any other
// build.
#pragma once

#include <Python.h>

#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/function.h>  // node.h from 2.13; function.h on all
#include <torch/csrc/autograd/python_function.h>

#include "ctx_node.h"

#include <pybind11/pybind11.h>

#include <ATen/DeviceAccelerator.h>
#include <torch/csrc/autograd/input_buffer.h>
#include <torch/csrc/autograd/input_metadata.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <vector>

// --- Where torch releases differ (measured on 2.6 to 2.15) ---------------------
//
// Each boundary is a macro TORCH_CTXEXT_<NAME>, 1 on the releases up to the
// newest that still has the old behaviour, else 0. The build defines them
// from torch_ctxext/_releases.py (BOUNDARIES: the one place that says which
// release each boundary falls on; adding a release changes that file only),
// and module.cpp exports them back as _C.boundaries, which the package
// compares with _releases at load. The code branches on them, never on a
// release number. What each boundary means for users: docs/compatibility.md.
//
// WEAK_CTX_NODE (2.12)
//   files: engine_layout.h, ctx_node.h, engine_layout.cpp, input_grad_buffers.cpp
//   THPFunction::cdata is a std::weak_ptr<PyNode> (an intrusive_ptr from 2.13).
// NO_NATIVE_BOXED_GRADS (2.12)
//   files: boxed_grads.cpp, module.cpp (and _torch_ctxext_build/sources.py
//   compiles boxed_grads.cpp only on this side): PyNode::apply cannot box
//   grads.
// NO_STALE_CAPTURE_OVERRIDE (2.12)
//   files: direct_accumulation.cpp, input_grad_buffers.cpp
//   No stale-capture stream override (at::Context::overrideStaleCaptureStream,
//   InputBuffer::opt_overridden_consumer_stream appear in 2.13).
// STEALABLE_BY_USE_COUNT (2.9)
//   files: engine_layout.h
//   A. The engine decides whether it may accumulate into a buffer slot in
//   place by at::caching::adjusted_use_count(v) == 1 (PyObject preservation
//   made a dropped Python wrapper owned by the TensorImpl, so it does not
//   count); from 2.10 by impl::is_tensor_stealable, which discounts such a
//   wrapper explicitly (new PyObject preservation: the wrapper holds a count).
// ENGINE_CASTS_TO_OPTIONS_DTYPE (2.9)
//   files: engine_layout.h, engine_layout.cpp, output_grad_dtype.h,
//   output_grad_dtype.cpp
//   B. InputMetadata has no grad_dtype_: validate_outputs casts every incoming
//   gradient to the dtype in InputMetadata::options_ (from 2.10 to
//   grad_dtype_, the output's dtype unless set_grad_dtype changed it, and not
//   at all when that is nullopt). C. Hence a gradient declared "uncast"
//   (set_output_grad_dtype(None)) is cast anyway unless validate_outputs is
//   hooked (output_grad_dtype.h).
// ADD_WITHOUT_CONSUMER_NODE (2.9)
//   files: direct_accumulation.cpp
//   InputBuffer::add(pos, var, producer stream, consumer stream) takes no
//   consumer Node* (a fifth parameter from 2.10), and the hook that validates
//   producers reaching an exposed slot later needs it to find the slot's
//   record. Where that hook would be needed (a process with accelerators),
//   slots that still expect later producers are therefore not exposed on
//   these releases.
// NO_SLOT_STREAMS (2.7)
//   files: engine_layout.h
//   D. InputBuffer keeps only `buffer`; the per-slot accumulation and ready
//   streams (opt_accum_streams, ready_streams) the direct-accumulation rules
//   check appear in 2.8.
// OLD_ACCELERATOR_API (2.6)
//   files: engine_layout.h
//   at::isAccelerator (namespace at) is the only spelling;
//   at::accelerator::isAccelerator from 2.7. (The 2.6 wheels are also the
//   only ones built with the old C++ ABI, _GLIBCXX_USE_CXX11_ABI=0, which
//   changes every mangled name that mentions std::string: output_grad_dtype.cpp
//   branches on torch's own macro for that.)
//
// Each boundary: NAME (the newest release on its old side), the files whose
// #if branches on it, what the old side does. test/contract/test_release_facts.py
// checks that this names every boundary of _releases.py, with its release and
// exactly the files that branch on it.

#define TORCH_CTXEXT_BOUNDARIES(X) \
  X(WEAK_CTX_NODE)                 \
  X(NO_NATIVE_BOXED_GRADS)         \
  X(NO_STALE_CAPTURE_OVERRIDE)     \
  X(STEALABLE_BY_USE_COUNT)        \
  X(ENGINE_CASTS_TO_OPTIONS_DTYPE) \
  X(ADD_WITHOUT_CONSUMER_NODE)     \
  X(NO_SLOT_STREAMS)               \
  X(OLD_ACCELERATOR_API)

#if !defined(TORCH_CTXEXT_WEAK_CTX_NODE) || !defined(TORCH_CTXEXT_NO_NATIVE_BOXED_GRADS) ||       \
    !defined(TORCH_CTXEXT_NO_STALE_CAPTURE_OVERRIDE) || !defined(TORCH_CTXEXT_STEALABLE_BY_USE_COUNT) || \
    !defined(TORCH_CTXEXT_ENGINE_CASTS_TO_OPTIONS_DTYPE) ||                                       \
    !defined(TORCH_CTXEXT_ADD_WITHOUT_CONSUMER_NODE) || !defined(TORCH_CTXEXT_NO_SLOT_STREAMS) ||  \
    !defined(TORCH_CTXEXT_OLD_ACCELERATOR_API)
#error "torch_ctxext: a release boundary macro is not defined: build with setup.py or torch_ctxext's own build, which define them from torch_ctxext/_releases.py"
#endif

// Declared as ATen/CachedTensorUtils.h declares them (unchanged from 2.6 to
// 2.15), instead of including it: that header includes ATen/ATen.h, whose
// every-operator ATen/Functions.h cost each translation unit about 3 s (with
// AT_PER_OPERATOR_HEADERS, which makes the build's other headers include only
// the operators they use: both units side by side 16.0 s before, 13.0 s
// after, torch 2.13, 2 cores; _torch_ctxext_build/sources.py). A changed
// signature leaves an undefined symbol, which the in-process load check of a
// new build reports.
namespace at::caching {
TORCH_API bool is_cached_tensor(const at::Tensor& t);
TORCH_API size_t adjusted_use_count(const at::Tensor& t);
}  // namespace at::caching

namespace torch_ctxext {

using torch::autograd::GraphTask;
using torch::autograd::InputBuffer;
using torch::autograd::InputMetadata;
using torch::autograd::Node;

inline bool is_accelerator(c10::DeviceType type) {
#if TORCH_CTXEXT_OLD_ACCELERATOR_API
  return at::isAccelerator(type);
#else
  return at::accelerator::isAccelerator(type);
#endif
}

// A: whether no one but the engine's buffer owns `v`'s TensorImpl, by the
// rule the running engine itself applies before accumulating in place
// (input_buffer.cpp, can_accumulate_inplace). A cached tensor (CUDA graphs)
// is owned once more by the cache.
inline bool uniquely_owned_by_buffer(const at::Tensor& v) {
#if TORCH_CTXEXT_STEALABLE_BY_USE_COUNT
  return at::caching::adjusted_use_count(v) == 1;
#else
  return torch::autograd::impl::is_tensor_stealable(
      v, 1 + (at::caching::is_cached_tensor(v) ? 1 : 0));
#endif
}

// D: the stream the engine accumulates slot `pos` on and the one its last
// contribution was ready on (both recorded for accelerator slots only).
// Before 2.8 the engine records neither: nullopt, and slots_record_streams()
// says so, so that callers never expose an accelerator slot there.
constexpr bool slots_record_streams() {
  return !TORCH_CTXEXT_NO_SLOT_STREAMS;
}
inline std::optional<c10::Stream> accumulation_stream(const InputBuffer& buffer,
                                                      size_t pos) {
#if TORCH_CTXEXT_NO_SLOT_STREAMS
  (void)buffer, (void)pos;
  return std::nullopt;
#else
  return buffer.opt_accum_streams.at(pos);
#endif
}
inline std::optional<c10::Stream> ready_stream(const InputBuffer& buffer,
                                               size_t pos) {
#if TORCH_CTXEXT_NO_SLOT_STREAMS
  (void)buffer, (void)pos;
  return std::nullopt;
#else
  return buffer.ready_streams.at(pos);
#endif
}

#if TORCH_CTXEXT_ENGINE_CASTS_TO_OPTIONS_DTYPE
// B: make the engine cast the gradients of a node input to `dtype`, up to
// torch 2.9 (from 2.10 that is InputMetadata::set_grad_dtype). The engine
// casts to the dtype of the metadata's options_, a member declared const
// (`const at::TensorOptions options_;`) with neither a setter nor an
// assignment; engine_layout.cpp says why it is written anyway and what
// guards the write.
void set_metadata_options_dtype(InputMetadata& metadata, at::ScalarType dtype);
#endif

// The node of a ctx, weakly (for registries that must not mistake a node
// created later at a freed node's address for it). Up to 2.12 PyNode is owned
// by a shared_ptr and Node derives from enable_shared_from_this.
#if TORCH_CTXEXT_WEAK_CTX_NODE
inline std::weak_ptr<Node> weak_node_of(THPFunction* ctx) {
  return ctx->cdata;
}
#endif

// Raised (as Python's TypeError) when an object that is not the ctx of a
// custom Function reaches a function that reads it by layout.
struct NotACtxError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// is_ctx(obj) and node_of(ctx): ctx_node.h.

// `obj` as a THPFunction; throws NotACtxError naming its type otherwise.
THPFunction* as_ctx(PyObject* obj, const char* who);

// The GraphTask this thread is executing, or nullptr outside backward.
//
// The engine exports the address of the current task's `exec_info_` only; the
// task itself is found by subtracting the member's offset in the GraphTask of
// the headers this file was compiled with, then cross-checked against two
// other exported accessors. A mismatch means the headers do not describe the
// running binary: we throw instead of reading garbage.
GraphTask* current_graph_task();

// The same, without the cross-check: for the engine hook that runs inside
// InputBuffer::add, where the check already passed when the hook was placed.
GraphTask* current_graph_task_unchecked();

// The graph task's 64-bit id (get_current_graph_task_id() returns an int,
// which wraps after 2^31 tasks in a process).
inline uint64_t task_id(const GraphTask* task) {
  return task->id_;
}

// Whether the task runs backward with create_graph=True. The engine gives
// each task a snapshot of the caller's thread-local state with grad mode set
// to create_graph and installs it on the thread for every node it runs; a
// backward may change the thread's grad mode afterwards (torch.no_grad()), so
// the thread's current mode says nothing about the task.
bool task_creates_graph(const GraphTask* task);

// Whether the task's post-processing (final callbacks, leaf stream syncs) has
// started: the engine then holds the task's mutex_ and runs no more nodes.
inline bool task_in_post_processing(const GraphTask* task) {
  return task->future_completed_.load();
}

// Whether this thread holds `mutex` (glibc records the owner's thread id in
// every mutex it locks): locking it again would deadlock.
bool held_by_this_thread(std::mutex& mutex);

}  // namespace torch_ctxext

namespace torch_ctxext {

// What the extension reads of a ctx, its node and their metadata, read the
// way the rest of the extension reads them: compared at import against what
// Python knows of a probe Function, to catch a torch whose layout differs
// from the headers (an edited tree, an "Unknown" git hash, a distribution's
// patches) before anything is written by that layout.
struct CtxLayoutFacts {
  size_t ctx_size = 0;  // sizeof(THPFunction), against _FunctionBase.__basicsize__
  std::vector<bool> is_variable_input;
  bool materialize_grads = false;
  bool has_node = false;
  uintptr_t node_address = 0;     // for tests of registries keyed by node
  bool node_points_back = false;  // the node's Python object is this ctx
  std::vector<bool> edge_valid;   // per next edge
  // Per node input (= Function output): scalar type, shape, default-constructed.
  std::vector<int> input_dtype;
  std::vector<std::vector<int64_t>> input_shape;
  std::vector<bool> input_default;
  // Per Function output, as PyNode materializes zeros from it.
  std::vector<int> output_dtype;
  std::vector<std::vector<int64_t>> output_shape;
};
CtxLayoutFacts read_ctx_layout(PyObject* ctx);

// What the extension reads of the running GraphTask (inside a backward).
struct TaskLayoutFacts {
  bool found = false;
  bool creates_graph = false;
  bool exec_info_empty = false;
  bool post_processing = false;
  bool holds_lock = false;
  int64_t not_ready = -1;  // buffers waiting for producers
};
TaskLayoutFacts read_task_layout();

// Binds the two reads above into torch_ctxext._C, and the running task's id
// into _C._testing (module.cpp).
void register_engine_layout(pybind11::module_& m, pybind11::module_& testing);

}  // namespace torch_ctxext
