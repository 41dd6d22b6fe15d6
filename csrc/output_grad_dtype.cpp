#include "output_grad_dtype.h"

#include <pybind11/stl.h>
#include <torch/csrc/Dtype.h>

#include <stdexcept>
#include <string>

#if TORCH_CTXEXT_ENGINE_CASTS_TO_OPTIONS_DTYPE
#include "fork_safety.h"
#include "patching.h"

#include <dlfcn.h>

#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/engine.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <iterator>
#include <mutex>
#include <unordered_map>
#include <utility>
#endif

namespace torch_ctxext {

std::vector<bool> differentiable_outputs(PyObject* ctx_obj) {
  THPFunction* ctx = as_ctx(ctx_obj, "differentiable_outputs");
  Node* node = node_of(ctx);
  std::vector<bool> result;
  if (node == nullptr) {
    return result;
  }
  const auto n = node->num_inputs();
  result.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    result.push_back(!node->input_metadata(i).was_default_constructed());
  }
  return result;
}

void set_output_grad_dtype(PyObject* ctx_obj, size_t index,
                           std::optional<at::ScalarType> dtype) {
  THPFunction* ctx = as_ctx(ctx_obj, "set_output_grad_dtype");
  Node* node = node_of(ctx);
  if (node == nullptr || index >= node->num_inputs() ||
      node->input_metadata(index).was_default_constructed()) {
    // Callers validate first; reaching this is a bug in torch_ctxext, and an
    // InputMetadata assert inside torch must never be what the user sees.
    throw std::out_of_range("torch_ctxext: output " + std::to_string(index) +
                            " carries no gradient metadata");
  }
#if TORCH_CTXEXT_ENGINE_CASTS_TO_OPTIONS_DTYPE
  // Up to torch 2.9 the engine casts to the metadata's own dtype, and casts
  // even when told nothing (engine_layout.h, B and C).
  if (dtype.has_value()) {
    set_metadata_options_dtype(node->mutable_input_metadata(index), *dtype);
  } else {
    keep_gradients_uncast(weak_node_of(ctx), index);
  }
#else
  node->mutable_input_metadata(index).set_grad_dtype(dtype);
#endif
  if (dtype.has_value() && index < ctx->output_info.size()) {
    ctx->output_info[index].scalar_type = *dtype;
  }
}

namespace {

// Per thread: how many Function.apply calls are running, and how many
// declarations were made so far. Plain C thread-locals: the wrapper below
// runs on every Function.apply, and a Python-level wrapper alone would cost
// several percent of a small Function's forward+backward.
thread_local int apply_depth = 0;
thread_local uint64_t declarations = 0;
PyObject* original_apply = nullptr;  // Function.apply's function, unbound
PyObject* resolve = nullptr;  // resolve(depth, output, ok) in Python

// Function.apply(cls, *args, **kwargs), as a classmethod: the original, then,
// only if a declaration was made meanwhile, resolve() for this depth.
PyObject* apply_with_declarations(PyObject* /*module*/, PyObject* const* args,
                                  size_t nargsf, PyObject* kwnames) {
  const int depth = ++apply_depth;
  const uint64_t before = declarations;
  PyObject* output = PyObject_Vectorcall(original_apply, args, nargsf, kwnames);
  --apply_depth;
  if (declarations == before) {
    return output;
  }
  if (output == nullptr) {  // drop this depth's declarations, keep the error
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject* r = PyObject_CallFunction(resolve, "iOO", depth, Py_None, Py_False);
    Py_XDECREF(r);
    PyErr_Clear();
    PyErr_Restore(type, value, traceback);
    return nullptr;
  }
  PyObject* r = PyObject_CallFunction(resolve, "iOO", depth, output, Py_True);
  if (r == nullptr) {
    Py_DECREF(output);
    return nullptr;
  }
  Py_DECREF(r);
  return output;
}

PyMethodDef apply_def = {
    "apply", reinterpret_cast<PyCFunction>(
                 reinterpret_cast<void (*)(void)>(apply_with_declarations)),
    METH_FASTCALL | METH_KEYWORDS, nullptr};

}  // namespace

PyObject* make_apply(PyObject* original, PyObject* resolver) {
  Py_XDECREF(original_apply);
  Py_XDECREF(resolve);
  Py_INCREF(original);
  Py_INCREF(resolver);
  original_apply = original;
  resolve = resolver;
  return PyCFunction_New(&apply_def, nullptr);
}

int current_apply_depth() {
  return apply_depth;
}

void note_declaration() {
  ++declarations;
}

}  // namespace torch_ctxext

// --- set_output_grad_dtype(None) up to torch 2.9 (see the header) -------------

#if TORCH_CTXEXT_ENGINE_CASTS_TO_OPTIONS_DTYPE

namespace torch_ctxext {

namespace {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::variable_list;
using FormatError = std::function<std::string(const std::string&)>;
using ValidateOutputs = void (*)(const edge_list&, variable_list&, const FormatError&);

// validate_outputs(const edge_list&, variable_list&, const std::function<
// std::string(const std::string&)>&): its mangled name spells std::string,
// which the old C++ ABI of the torch 2.6 wheels mangles as `Ss` and the new
// one (2.7 on) as `NSt7__cxx1112basic_string...`. This file is compiled with
// the ABI of the installed torch (torch.utils.cpp_extension passes it), so
// the macro picks the right one; uncast_gradients_available() also checks it
// against the symbol the loader resolved for our own call.
#if _GLIBCXX_USE_CXX11_ABI
constexpr const char* kValidateOutputsSymbol =
    "_ZN5torch8autograd16validate_outputsERKSt6vectorINS0_4EdgeESaIS2_EERS1_IN2at6TensorESaIS8_EERKSt8functionIFNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERKSI_EE";
#else
constexpr const char* kValidateOutputsSymbol =
    "_ZN5torch8autograd16validate_outputsERKSt6vectorINS0_4EdgeESaIS2_EERS1_IN2at6TensorESaIS8_EERKSt8functionIFSsRKSsEE";
#endif

// The original: its address as the loader resolved it for this library,
// libtorch_cpu's definition itself (never the value of the GOT entry we
// replace: before its first call that is the lazy-binding stub, which would
// write the real address back over the wrapper).
const ValidateOutputs original_validate_outputs = &torch::autograd::validate_outputs;

struct Key {
  const Node* node;
  uint32_t input_nr;
  bool operator==(const Key& other) const {
    return node == other.node && input_nr == other.input_nr;
  }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    return std::hash<const void*>()(key.node) ^ (std::hash<uint32_t>()(key.input_nr) << 1);
  }
};

// Taken by the engine hook without the GIL: fork-safe (fork_safety.h).
ForkSafeMutex registry_mutex{"output_grad_dtype"};
std::unordered_map<Key, std::weak_ptr<Node>, KeyHash> declared;  // under the mutex
size_t calls_since_sweep = 0;                                    // under the mutex
// declared.size(), readable without the lock: the wrapper's fast path.
std::atomic<size_t> declared_count{0};
std::atomic<uint64_t> locked_calls{0};
std::atomic<uint64_t> restored{0};

void publish_count_locked() {
  declared_count.store(declared.size(), std::memory_order_release);
}

// Drop the records of nodes that died. Called on every declaration and, from
// the wrapper, once per as many calls as there are records: amortized
// constant per call, and the fast path comes back within that many node runs
// after the last declaring node died.
void sweep_locked() {
  for (auto it = declared.begin(); it != declared.end();) {
    it = it->second.expired() ? declared.erase(it) : std::next(it);
  }
  calls_since_sweep = 0;
  publish_count_locked();
}

// Whether the input `edge` leads to was declared None (under the mutex).
bool declared_uncast_locked(const Edge& edge) {
  auto it = declared.find({edge.function.get(), edge.input_nr});
  if (it == declared.end()) {
    return false;
  }
  if (it->second.expired()) {
    // The declaring node died; this is another node at its address.
    declared.erase(it);
    publish_count_locked();
    return false;
  }
  return true;
}

void validate_outputs_keeping_uncast(const edge_list& edges, variable_list& grads,
                                     const FormatError& format_error) {
  if (declared_count.load(std::memory_order_acquire) == 0) {
    original_validate_outputs(edges, grads, format_error);
    return;
  }
  locked_calls.fetch_add(1, std::memory_order_relaxed);
  c10::SmallVector<std::pair<size_t, at::Tensor>, 4> kept;
  {
    std::lock_guard<ForkSafeMutex> lock(registry_mutex);
    if (++calls_since_sweep > declared.size()) {
      sweep_locked();
    }
    for (size_t i = 0; i < edges.size() && i < grads.size(); ++i) {
      if (edges[i].is_valid() && grads[i].defined() &&
          declared_uncast_locked(edges[i])) {
        kept.emplace_back(i, grads[i]);
      }
    }
  }
  // Shape, device and layout checks, reduction and the cast, as always.
  original_validate_outputs(edges, grads, format_error);
  for (auto& [i, incoming] : kept) {
    if (!grads[i].defined() || grads[i].scalar_type() == incoming.scalar_type()) {
      continue;
    }
    const auto& metadata = edges[i].function->input_metadata(edges[i].input_nr);
    at::Tensor uncast = metadata.maybe_reduce(i, std::move(incoming), format_error);
    if (uncast.device() != grads[i].device()) {
      uncast = uncast.to(grads[i].device());  // a CPU scalar moved to the input's device
    }
    grads[i] = std::move(uncast);
    restored.fetch_add(1, std::memory_order_relaxed);
  }
}

void** validate_outputs_slot() {
  static void** const slot = [] {
    // The symbol the GOT entry is for must be the function we call as the
    // original: compare it with the name the loader gives that address.
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(original_validate_outputs), &info) == 0 ||
        info.dli_sname == nullptr ||
        std::strcmp(info.dli_sname, kValidateOutputsSymbol) != 0) {
      return static_cast<void**>(nullptr);
    }
    return find_got_slot("libtorch_cpu", kValidateOutputsSymbol);
  }();
  return slot;
}

GotHook uncast_hook{&validate_outputs_slot,
                    reinterpret_cast<void*>(&validate_outputs_keeping_uncast)};

void place_wrapper() {
  if (!uncast_hook.place()) {
    throw std::runtime_error(
        "torch_ctxext: set_output_grad_dtype(None) cannot be honoured on this "
        "torch build: libtorch_cpu makes no call to validate_outputs through "
        "its GOT, and torch <= 2.9 casts every gradient to the output's dtype");
  }
}

}  // namespace

bool uncast_gradients_available() {
  return validate_outputs_slot() != nullptr;
}

void keep_gradients_uncast(const std::weak_ptr<Node>& node, size_t input_nr) {
  auto alive = node.lock();
  if (!alive) {
    throw std::logic_error("torch_ctxext: declaring None for a node that is gone");
  }
  place_wrapper();
  std::lock_guard<ForkSafeMutex> lock(registry_mutex);
  sweep_locked();
  declared[{alive.get(), static_cast<uint32_t>(input_nr)}] = node;
  publish_count_locked();
}

size_t live_uncast_declarations() {
  std::lock_guard<ForkSafeMutex> lock(registry_mutex);
  sweep_locked();
  return declared.size();
}

bool uncast_hook_placed() {
  return uncast_hook.placed();
}

uint64_t uncast_hook_locked_calls() {
  return locked_calls.load();
}

uint64_t uncast_gradients_restored() {
  return restored.load();
}

}  // namespace torch_ctxext

#endif  // TORCH_CTXEXT_ENGINE_CASTS_TO_OPTIONS_DTYPE

// --- torch_ctxext._C ------------------------------------------------------------

namespace py = pybind11;

namespace torch_ctxext {

namespace {

std::optional<at::ScalarType> to_scalar_type(py::handle dtype) {
  if (dtype.is_none()) {
    return std::nullopt;
  }
  if (!THPDtype_Check(dtype.ptr())) {
    throw py::type_error("expected a torch.dtype or None");
  }
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

}  // namespace

void register_output_grad_dtype(py::module_& m, py::module_& testing) {
  m.def(
      "set_output_grad_dtype",
      [](py::handle ctx, size_t index, py::handle dtype) {
        set_output_grad_dtype(ctx.ptr(), index, to_scalar_type(dtype));
      },
      py::arg("ctx"), py::arg("index"), py::arg("dtype"));
  m.def("note_declaration", &note_declaration);
  m.def(
      "differentiable_outputs",
      [](py::handle ctx) { return differentiable_outputs(ctx.ptr()); },
      py::arg("ctx"));
  m.def(
      "make_apply",
      [](py::handle original, py::handle resolver) {
        PyObject* fn = make_apply(original.ptr(), resolver.ptr());
        if (fn == nullptr) {
          throw py::error_already_set();
        }
        return py::reinterpret_steal<py::object>(fn);
      },
      py::arg("original"), py::arg("resolver"));
  m.def("apply_depth", &current_apply_depth);
  // The name CPython's own errors print for an object's type (tp_name), for
  // the message that refuses a dtype: "str", "Tensor",
  // "numpy.dtypes.Float64DType", "torch.finfo".
  m.def("type_name", [](py::handle obj) {
    return std::string(Py_TYPE(obj.ptr())->tp_name);
  });
#if TORCH_CTXEXT_ENGINE_CASTS_TO_OPTIONS_DTYPE
  // set_output_grad_dtype(None) through the validate_outputs wrapper.
  m.def("uncast_gradients_available", &uncast_gradients_available);
  testing.def("live_uncast_declarations", &live_uncast_declarations);
  testing.def("uncast_hook_placed", &uncast_hook_placed);
  testing.def("uncast_hook_locked_calls", &uncast_hook_locked_calls);
  testing.def("uncast_gradients_restored", &uncast_gradients_restored);
#else
  (void)testing;
#endif
}

}  // namespace torch_ctxext
