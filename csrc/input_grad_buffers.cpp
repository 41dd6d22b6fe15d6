// ctx.input_grad_buffers: the engine's live InputBuffer slot for each input.
//
// While a custom backward runs, the gradients earlier producers already sent
// to each of this Function's inputs sit in the consumer's InputBuffer inside
// GraphTask::not_ready_. We hand out a slot only when the engine itself would
// be allowed to accumulate into it in place (input_buffer.cpp,
// can_accumulate_inplace) and when torch 2.15's thread and stream rules for
// direct accumulation hold (direct_accumulation.h), so that a backward which
// adds into it and returns None computes exactly what the engine would have.
#include "input_grad_buffers.h"

#include "direct_accumulation.h"
#include "fused_linear.h"

#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/input_buffer.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace torch_ctxext {

namespace {

enum class SlotState { kNotATensor, kNoGradient, kEmpty, kFilled };

// The engine's rule for accumulating into a slot in place (torch 2.15's
// input_buffer.cpp): a plain dense tensor whose TensorImpl and storage have no
// other owner. A Python wrapper that nothing but the tensor itself keeps alive
// (a tensor created in a Python backward, or a buffer handed out earlier and
// since dropped) is no other owner: the engine discounts it (how differs by
// release: engine_layout.h, uniquely_owned_by_buffer).
// Returns which part of the rule `v` breaks; the getter and explain() both
// read it, so they cannot disagree.
enum class InPlace {
  kAllowed,
  kSubclass,
  kZeroTensor,
  kNested,
  kNotDense,
  kShared,
  kStorageShared
};

InPlace in_place_rule(const at::Tensor& v) {
  if (at::isTensorSubclassLike(v)) {
    return InPlace::kSubclass;
  }
  if (v._is_zerotensor()) {
    return InPlace::kZeroTensor;
  }
  if (v.is_nested()) {
    return InPlace::kNested;
  }
  if (!v.is_non_overlapping_and_dense()) {
    return InPlace::kNotDense;
  }
  if (!uniquely_owned_by_buffer(v)) {  // the rule differs by release
    return InPlace::kShared;
  }
  if (!v.has_storage() || v.storage().use_count() != 1) {
    return InPlace::kStorageShared;
  }
  return InPlace::kAllowed;
}

// The checks every read starts with, in torch 2.15's order (python_function.cpp
// THPFunction_input_grad_buffers, then engine.cpp get_current_input_grad_buffers):
// torch 2.15's error text where the property is not available for `node`
// now, or nullptr with the running task in *task. The getter raises the text
// (running_task_for); the drop-ins' C++ Functions compute out of place
// (engine_buffers).
const char* unavailable_for(Node* node, GraphTask** task) {
  if (node == nullptr) {
#if TORCH_CTXEXT_WEAK_CTX_NODE
    // cdata is weak up to 2.12: the node of a ctx whose graph was freed is
    // gone, and that ctx is certainly not executing. torch 2.15 keeps the
    // node alive with the ctx and says which of the two it is.
    return current_graph_task() != nullptr ? kNotTheExecutingNode : kOutsideBackward;
#else
    return kLegacyAccess;
#endif
  }
  if (!node->post_hooks().empty()) {
    return kPostHooks;
  }
  *task = current_graph_task();
  if (*task == nullptr) {
    return kOutsideBackward;
  }
  if (torch::autograd::get_current_node().get() != node) {
    return kNotTheExecutingNode;
  }
  // The engine holds the task's mutex_ while final callbacks run; reading
  // (a callback queued by an inner graph, reading an outer ctx) would wait on
  // that lock forever.
  if (task_in_post_processing(*task)) {
    return kPostProcessing;
  }
  if (task_creates_graph(*task)) {
    return kCreateGraph;
  }
  if (torch::autograd::AnomalyMode::is_enabled()) {
    return kAnomaly;
  }
#if !TORCH_CTXEXT_NO_STALE_CAPTURE_OVERRIDE
  if (at::globalContext().overrideStaleCaptureStream()) {
    return kStaleCaptureStream;
  }
#endif
  return nullptr;
}

// The running task, where the property is available for `node`; throws
// torch 2.15's error where it is not.
GraphTask* running_task_for(Node* node) {
  GraphTask* task = nullptr;
  if (const char* why = unavailable_for(node, &task)) {
    throw std::runtime_error(why);
  }
  return task;
}

// What one argument's slot is, for visit() below.
struct Slot {
  SlotState state = SlotState::kNotATensor;
  InputBuffer* buffer = nullptr;  // set when kFilled
  size_t pos = 0;
  Node* consumer = nullptr;       // set unless kNotATensor / kNoGradient
};

// Why the GIL was let go while waiting for the task's mutex, and when it is
// taken back: after the lock is released (declare it before the lock).
struct GilReleased {
  PyThreadState* saved = nullptr;
  ~GilReleased() {
    if (saved != nullptr) {
      PyEval_RestoreThread(saved);
    }
  }
};

// Locks the task's mutex into `lock`. A thread holding the mutex may be
// waiting for the GIL, so this thread never waits for the mutex with the GIL
// held: it tries the lock first (which never waits, and fails when this
// thread already holds it), and only when that fails checks the lock's owner
// and waits with the GIL released, where this thread holds it (a Python
// backward does; a C++ node's backward runs without it). The common case, an
// uncontended lock, costs no system call and no GIL hand-over. Returns false,
// locking nothing, when this thread already holds the mutex.
bool lock_task(GraphTask* task, std::unique_lock<std::mutex>& lock,
               GilReleased& gil) {
  lock = std::unique_lock<std::mutex>(task->mutex_, std::try_to_lock);
  if (lock.owns_lock()) {
    return true;
  }
  if (held_by_this_thread(task->mutex_)) {
    return false;
  }
  if (PyGILState_Check()) {
    gil.saved = PyEval_SaveThread();
  }
  lock.lock();
  return true;
}

// The slot of the running task that `edge` leads to (under the task's mutex).
Slot slot_of(GraphTask* task, const torch::autograd::Edge& edge) {
  Slot slot;
  if (!edge.is_valid()) {
    slot.state = SlotState::kNoGradient;
    return slot;
  }
  slot.consumer = edge.function.get();
  slot.pos = static_cast<size_t>(edge.input_nr);
  auto it = task->not_ready_.find(slot.consumer);
  if (it == task->not_ready_.end() || slot.pos >= it->second.buffer.size() ||
      !it->second.buffer[slot.pos].defined()) {
    slot.state = SlotState::kEmpty;
    return slot;
  }
  slot.state = SlotState::kFilled;
  slot.buffer = &it->second;
  return slot;
}

// Calls visit(i, slot) for each argument, under the task's mutex (lock_task;
// with the GIL, which a Python backward holds, released while waiting).
template <typename Visit>
void for_each_slot(THPFunction* ctx, Node* node, GraphTask* task,
                   Visit&& visit) {
  const std::vector<bool>& is_tensor_arg = ctx->is_variable_input;
  GilReleased gil;
  std::unique_lock<std::mutex> lock;
  if (!lock_task(task, lock, gil)) {
    // Every engine path that holds the lock while Python runs is refused
    // above (post-processing); this stops any other from deadlocking.
    throw std::runtime_error(
        "torch_ctxext: input_grad_buffers cannot be read here: this thread "
        "already holds the running graph task's lock, and waiting for it "
        "would never return");
  }
  size_t edge_index = 0;
  for (size_t i = 0; i < is_tensor_arg.size(); ++i) {
    if (!is_tensor_arg[i] || edge_index >= node->num_outputs()) {
      visit(i, Slot{});
      continue;
    }
    visit(i, slot_of(task, node->next_edge(edge_index++)));
  }
}

// Why direct accumulation into `slot` from the running node is not allowed
// (under the task's mutex, for a slot the in-place rule allows); nullopt
// when it is. The getter raises it with torch 2.15's text.
std::optional<Refusal> exposure_refusal(GraphTask* task, Node* node,
                                        const Slot& slot) {
  const auto thread = exposing_thread(task, slot.consumer, slot.pos);
  return direct_accumulation_refusal(
      *slot.buffer, slot.pos, slot.buffer->buffer[slot.pos].device(),
      node->stream(), consumer_stream(*slot.buffer, slot.consumer),
      thread.value_or(std::this_thread::get_id()));
}

// Whether producers other than `node` have still to reach `consumer`'s
// buffer (under the task's mutex): the engine counts the producers each node
// is waiting for, and `node` has not delivered its own yet.
bool expects_later_producers(GraphTask* task, Node* node, Node* consumer) {
  auto it = task->dependencies_.find(consumer);
  if (it == task->dependencies_.end()) {
    return false;
  }
  const auto& edges = node->next_edges();
  const auto own = std::count_if(edges.begin(), edges.end(), [&](const auto& e) {
    return e.function.get() == consumer;
  });
  return it->second > own;
}

// Whether the getter exposes the filled `slot` to `node` (under the task's
// mutex): kNo where the in-place rule, the device or later producers keep it
// back (None in the getter's tuple), kRefused where torch 2.15 raises
// (`refusal` says why), else kYes. The getter and engine_buffers both ask.
enum class Exposure { kNo, kYes, kRefused };

Exposure exposable(GraphTask* task, Node* node, const Slot& slot, bool later_ok,
                   std::optional<Refusal>& refusal) {
  const at::Tensor& tensor = slot.buffer->buffer[slot.pos];
  if (in_place_rule(tensor) != InPlace::kAllowed ||
      !direct_accumulation_checkable(tensor.device())) {
    return Exposure::kNo;
  }
  refusal = exposure_refusal(task, node, slot);
  if (refusal) {
    return Exposure::kRefused;
  }
  if (!later_ok && expects_later_producers(task, node, slot.consumer)) {
    return Exposure::kNo;
  }
  return Exposure::kYes;
}

}  // namespace

PyObject* input_grad_buffers(PyObject* ctx_obj) {
  THPFunction* ctx = as_ctx(ctx_obj, "input_grad_buffers");
  Node* node = node_of(ctx);
  GraphTask* task = running_task_for(node);
  // Places the engine hook if it is needed, before the task's lock is taken.
  const bool later_ok = later_producers_validated();

  const size_t num_args = ctx->is_variable_input.size();
  std::vector<at::Tensor> exposed(num_args);
  bool any = false;
  for_each_slot(ctx, node, task, [&](size_t i, const Slot& slot) {
    if (slot.state != SlotState::kFilled) {
      return;
    }
    std::optional<Refusal> refusal;
    switch (exposable(task, node, slot, later_ok, refusal)) {
      case Exposure::kNo:
        return;
      case Exposure::kRefused:
        throw std::runtime_error(refusal_message(*refusal));
      case Exposure::kYes:
        break;
    }
    record_exposure(task, slot.consumer, slot.pos);
    // Taking the reference raises the slot's use count, so a second argument
    // reaching the same slot (f(x, x)) is not exposed again.
    exposed[i] = slot.buffer->buffer[slot.pos];
    any = true;
  });
  if (any) {
    mark_exposed(task, node);
  }

  PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(num_args));
  if (result == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < num_args; ++i) {
    PyObject* item;
    if (exposed[i].defined()) {
      item = THPVariable_Wrap(std::move(exposed[i]));
      if (item == nullptr) {
        Py_DECREF(result);
        return nullptr;
      }
    } else {
      Py_INCREF(Py_None);
      item = Py_None;
    }
    PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i), item);
  }
  return result;
}

std::vector<at::Tensor> engine_buffers(Node* node) {
  // Where the getter raises, nothing is added into: the node computes its
  // gradients out of place, as a drop-in's Python Function does
  // (nn/_buffers.readable_buffers).
  GraphTask* task = nullptr;
  if (unavailable_for(node, &task) != nullptr) {
    return {};
  }
  const bool later_ok = later_producers_validated();
  std::vector<at::Tensor> exposed(node->num_outputs());
  GilReleased gil;
  std::unique_lock<std::mutex> lock;
  if (!lock_task(task, lock, gil)) {
    return {};
  }
  for (size_t i = 0; i < exposed.size(); ++i) {
    const Slot slot = slot_of(task, node->next_edge(i));
    if (slot.state != SlotState::kFilled) {
      continue;
    }
    std::optional<Refusal> refusal;
    switch (exposable(task, node, slot, later_ok, refusal)) {
      case Exposure::kNo:
        continue;
      case Exposure::kRefused:  // the getter raises after exposing the earlier slots
        return {};
      case Exposure::kYes:
        break;
    }
    record_exposure(task, slot.consumer, slot.pos);
    exposed[i] = slot.buffer->buffer[slot.pos];  // the reference: a second edge to the slot finds it shared
  }
  return exposed;
}

std::vector<BufferReason> explain_input_grad_buffers(PyObject* ctx_obj) {
  THPFunction* ctx = as_ctx(ctx_obj, "explain");
  Node* node = node_of(ctx);
  GraphTask* task = running_task_for(node);
  const bool later_ok = later_producers_validated();
  std::vector<BufferReason> reasons(ctx->is_variable_input.size());
  // (buffer, slot) -> the first argument that reached it
  std::vector<std::pair<std::pair<InputBuffer*, size_t>, size_t>> seen;
  for_each_slot(ctx, node, task, [&](size_t i, const Slot& slot) {
    auto& reason = reasons[i];
    if (slot.state == SlotState::kFilled) {
      const std::pair<InputBuffer*, size_t> key{slot.buffer, slot.pos};
      auto first = std::find_if(seen.begin(), seen.end(),
                                [&](const auto& s) { return s.first == key; });
      if (first != seen.end()) {
        // f(x, x): the getter hands the slot to the first argument only.
        const auto& earlier = reasons[first->second];
        if (earlier.code == "exposed") {
          reason.code = "same_slot";
          reason.first_argument = first->second;
        } else {
          reason = earlier;
        }
        return;
      }
      seen.push_back({key, i});
    }
    switch (slot.state) {
      case SlotState::kNotATensor:
        reason.code = "not_a_tensor";
        return;
      case SlotState::kNoGradient:
        reason.code = "no_gradient";
        return;
      case SlotState::kEmpty: {
        const auto& exec_info = task->exec_info_;
        if (!exec_info.empty()) {
          auto it = exec_info.find(slot.consumer);
          if (it == exec_info.end() || !it->second.should_execute()) {
            // not among backward(inputs=...) / grad(inputs)
            reason.code = "not_needed";
            return;
          }
        }
        // consumers created after this Function run before it
        reason.code = "no_earlier_producer";
        return;
      }
      case SlotState::kFilled:
        break;
    }
    const at::Tensor& tensor = slot.buffer->buffer[slot.pos];
    switch (in_place_rule(tensor)) {
      case InPlace::kSubclass:
        reason.code = "subclass";
        return;
      case InPlace::kZeroTensor:
        reason.code = "zero_tensor";
        return;
      case InPlace::kNested:
        reason.code = "nested";
        return;
      case InPlace::kNotDense:
        reason.code = "not_dense";
        return;
      case InPlace::kShared:
        reason.code = "shared";
        reason.other_owners = tensor.use_count() - 1;
        return;
      case InPlace::kStorageShared:
        reason.code = "storage_shared";
        reason.other_owners =
            tensor.has_storage() ? tensor.storage().use_count() - 1 : 0;
        return;
      case InPlace::kAllowed:
        break;
    }
    if (!direct_accumulation_checkable(tensor.device())) {
      reason.code = "streams_unrecorded";
      return;
    }
    reason.refusal = exposure_refusal(task, node, slot);
    if (reason.refusal) {
      reason.code = "refused";
      return;
    }
    if (!later_ok && expects_later_producers(task, node, slot.consumer)) {
      reason.code = "later_producers_unvalidated";
      return;
    }
    reason.code = "exposed";
  });
  return reasons;
}

namespace {

PyObject* guarded_run_backward = nullptr;  // the engine's run_backward, bound

PyObject* run_backward_guarded(PyObject* /*module*/, PyObject* const* args,
                               size_t nargsf, PyObject* kwnames) {
  if (auto node = torch::autograd::get_current_node()) {
    try {
      GraphTask* task = current_graph_task();
      if (task != nullptr && exposed_in(task, node.get())) {
        PyErr_SetString(PyExc_RuntimeError, kReentrant);
        return nullptr;
      }
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
  }
  return PyObject_Vectorcall(guarded_run_backward, args, nargsf, kwnames);
}

PyMethodDef guard_def = {
    "run_backward",
    reinterpret_cast<PyCFunction>(
        reinterpret_cast<void (*)(void)>(run_backward_guarded)),
    METH_FASTCALL | METH_KEYWORDS,
    "The engine's run_backward, refused inside a backward that handed out a "
    "buffer of ctx.input_grad_buffers (torch_ctxext)."};

}  // namespace

PyObject* make_reentrancy_guard(PyObject* original) {
  Py_XDECREF(guarded_run_backward);
  Py_INCREF(original);
  guarded_run_backward = original;
  return PyCFunction_New(&guard_def, nullptr);
}

// --- torch_ctxext._C ------------------------------------------------------------

namespace {

// Raise the Python exception a C++ exception from the extension stands for.
void set_python_error(const std::exception& e) {
  if (dynamic_cast<const NotACtxError*>(&e) != nullptr) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } else {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

// The reentrancy guard is placed the first time a buffer is handed out, so
// that a process which never fuses pays nothing for it, and placed again if
// something replaced it since (Variable._execution_engine is a plain class
// attribute). ensure_guard(): returns the engine object that is in place.
PyObject* variable_class = nullptr;  // torch.autograd.variable.Variable
PyObject* guarded_engine = nullptr;  // what ensure_guard last returned
PyObject* ensure_guard = nullptr;

bool reentrancy_guard_in_place() {
  if (variable_class == nullptr) {
    return true;  // not armed (tests of the C functions alone)
  }
  static PyObject* const name = PyUnicode_InternFromString("_execution_engine");
  if (name == nullptr) {
    return false;
  }
  PyObject* engine = PyObject_GetAttr(variable_class, name);
  if (engine == nullptr) {
    return false;
  }
  Py_DECREF(engine);  // kept alive by the class attribute
  if (engine == guarded_engine) {
    return true;
  }
  PyObject* placed = PyObject_CallNoArgs(ensure_guard);
  if (placed == nullptr) {
    return false;
  }
  Py_XSETREF(guarded_engine, placed);
  return true;
}

// The getter behind FunctionCtx.input_grad_buffers, as a plain CPython
// function (METH_O): the property is read inside hot backward loops, and a
// pybind11 call costs about as much again as the read itself.
PyObject* input_grad_buffers_getter(PyObject* /*module*/, PyObject* ctx) {
  try {
    PyObject* tuple = input_grad_buffers(ctx);
    if (tuple == nullptr) {
      return nullptr;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); ++i) {
      if (PyTuple_GET_ITEM(tuple, i) != Py_None) {
        if (!reentrancy_guard_in_place()) {
          Py_DECREF(tuple);
          return nullptr;
        }
        break;
      }
    }
    return tuple;
  } catch (const std::exception& e) {
    set_python_error(e);
    return nullptr;
  }
}

// The same as FunctionCtx.input_grad_buffers' Python getter does it, in one
// call: a real ctx (judged by its type, not by isinstance, which a
// `__class__` attribute fools) is read; anything else (a hand-made
// FunctionCtx, a mock, a proxy) gets what torch 2.15's property gives it,
// the attribute lookup `obj._input_grad_buffers`, and is never read by the
// layout of a ctx.
PyObject* input_grad_buffers_property(PyObject* module, PyObject* obj) {
  if (is_ctx(obj)) {
    return input_grad_buffers_getter(module, obj);
  }
  static PyObject* const name = PyUnicode_InternFromString("_input_grad_buffers");
  return name == nullptr ? nullptr : PyObject_GetAttr(obj, name);
}

PyMethodDef input_grad_buffers_def = {
    "input_grad_buffers", input_grad_buffers_getter, METH_O,
    "The engine's gradient buffer for each argument of ctx's Function."};
PyMethodDef input_grad_buffers_property_def = {
    "input_grad_buffers_property", input_grad_buffers_property, METH_O,
    "FunctionCtx.input_grad_buffers: the engine's buffers for a ctx, "
    "obj._input_grad_buffers for any other object."};

// What a value prints as in torch's own messages.
template <typename T>
std::string printed(const T& value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

// A stream as (device, stream id): the two parts torch prints of it.
py::object stream_fields(const std::optional<c10::Stream>& stream) {
  if (!stream) {
    return py::none();
  }
  return py::make_tuple(printed(stream->device()), stream->id());
}

// A refusal's fields, under the names torch_ctxext/_explain.py phrases it
// by, and "message": the error a read raises (torch 2.15's text, written once,
// by refusal_message, which the getter and the engine hook raise).
py::dict refusal_fields(const Refusal& r) {
  using Kind = Refusal::Kind;
  py::dict d;
  d["message"] = refusal_message(r);
  switch (r.kind) {
    case Kind::kDevice:
      d["kind"] = "device";
      d["buffer_device"] = printed(r.buffer_device);
      d["gradient_device"] = printed(r.gradient_device);
      break;
    case Kind::kThread:
      d["kind"] = "thread";
      d["exposing_thread"] = printed(r.exposing_thread);
      d["accessing_thread"] = printed(r.accessing_thread);
      break;
    case Kind::kSlotStreamsUnrecorded:
      d["kind"] = "slot_streams_unrecorded";
      break;
    case Kind::kStreamsAbsent:
    case Kind::kStreamsPresent:
      d["kind"] = r.kind == Kind::kStreamsAbsent ? "streams_absent"
                                                 : "streams_present";
      d["producer_stream_present"] = r.producer.has_value();
      d["consumer_stream_present"] = r.consumer.has_value();
      break;
    case Kind::kStream:
      d["kind"] = "stream";
      d["producer_stream"] = stream_fields(r.producer);
      d["consumer_stream"] = stream_fields(r.consumer);
      d["accumulation_stream"] = stream_fields(r.accumulation);
      d["ready_stream"] = stream_fields(r.ready);
      break;
  }
  return d;
}

// Each reason as (code, detail): detail holds what the code's sentence
// needs ({} for most codes).
py::list reasons_for_python(const std::vector<BufferReason>& reasons) {
  py::list out;
  for (const auto& reason : reasons) {
    py::dict detail;
    if (reason.code == "shared" || reason.code == "storage_shared") {
      detail["owners"] = reason.other_owners;
    } else if (reason.code == "same_slot") {
      detail["argument"] = reason.first_argument;
    } else if (reason.refusal) {
      detail = refusal_fields(*reason.refusal);
    }
    out.append(py::make_tuple(reason.code, detail));
  }
  return out;
}

}  // namespace

void register_input_grad_buffers(py::module_& m, py::module_& /*testing*/) {
  m.add_object("input_grad_buffers",
               py::reinterpret_steal<py::object>(
                   PyCFunction_New(&input_grad_buffers_def, nullptr)));
  m.add_object("input_grad_buffers_property",
               py::reinterpret_steal<py::object>(
                   PyCFunction_New(&input_grad_buffers_property_def, nullptr)));
  m.def(
      "explain_input_grad_buffers",
      [](py::handle ctx) {
        return reasons_for_python(explain_input_grad_buffers(ctx.ptr()));
      },
      py::arg("ctx"));
  // Whether ctx handed out a buffer in the graph task running on this thread.
  m.def("exposed_in_running_task", [](py::handle ctx) {
    auto* fn = as_ctx(ctx.ptr(), "exposed_in_running_task");
    const auto* task = current_graph_task();
    auto* node = node_of(fn);
    return task != nullptr && node != nullptr && exposed_in(task, node);
  });
  m.def("arm_reentrancy_guard", [](py::object variable, py::object ensure) {
    Py_XSETREF(variable_class, variable.release().ptr());
    Py_XSETREF(ensure_guard, ensure.release().ptr());
  });
  m.def(
      "make_reentrancy_guard",
      [](py::handle original) {
        PyObject* fn = make_reentrancy_guard(original.ptr());
        if (fn == nullptr) {
          throw py::error_already_set();
        }
        return py::reinterpret_steal<py::object>(fn);
      },
      py::arg("original"));
}

}  // namespace torch_ctxext
