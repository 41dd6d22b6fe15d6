// ctx.input_grad_buffers: the engine's live InputBuffer slot for each input.
//
// While a custom backward runs, the gradients earlier producers already sent
// to each of this Function's inputs sit in the consumer's InputBuffer inside
// GraphTask::not_ready_. We hand out a slot only when the engine itself would
// be allowed to accumulate into it in place (input_buffer.cpp,
// can_accumulate_inplace), so that a backward which adds into it and returns
// None computes exactly what the engine would have.
#include "input_grad_buffers.h"

#include <ATen/CachedTensorUtils.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/input_buffer.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace torch_ctxext {

namespace {

using torch::autograd::InputBuffer;

enum class SlotState { kNotATensor, kNoGradient, kEmpty, kFilled };

// The engine's rule for accumulating into a slot in place (torch 2.15's
// input_buffer.cpp): a plain dense tensor whose TensorImpl and storage have no
// other owner. A Python wrapper that nothing but the tensor itself keeps alive
// (a tensor created in a Python backward, or a buffer handed out earlier and
// since dropped) is no other owner: is_tensor_stealable discounts it.
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
  if (!torch::autograd::impl::is_tensor_stealable(
          v, 1 + (at::caching::is_cached_tensor(v) ? 1 : 0))) {
    return InPlace::kShared;
  }
  if (!v.has_storage() || v.storage().use_count() != 1) {
    return InPlace::kStorageShared;
  }
  return InPlace::kAllowed;
}

// On an accelerator a slot is usable only from the stream the engine
// accumulates it on, and only when that is the stream the running node (and
// therefore the user's backward) is on. CPU slots have no streams.
bool stream_agrees(InputBuffer& buffer, size_t pos, const at::Tensor& slot,
                   Node* running) {
  const auto device = slot.device();
  if (device.is_cpu()) {
    return true;
  }
  const auto& accum = buffer.opt_accum_streams[pos];
  const auto node_stream = running->stream();
  if (!accum.has_value() || !node_stream.has_value() ||
      *accum != *node_stream || accum->device() != device) {
    return false;
  }
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  return impl->getStream(device) == *accum;
}

}  // namespace

namespace {

// The checks every read starts with; throws torch 2.15's error when the
// property is not available. Returns the running task.
GraphTask* running_task_for(Node* node) {
  GraphTask* task = current_graph_task();
  if (task == nullptr) {
    throw std::runtime_error(kOutsideBackward);
  }
  if (node == nullptr || torch::autograd::get_current_node().get() != node) {
    throw std::runtime_error(kNotTheExecutingNode);
  }
  // Precedence as in torch 2.15: post-hooks, then create_graph, then anomaly.
  if (!node->post_hooks().empty()) {
    throw std::runtime_error(kPostHooks);
  }
  // The engine runs backward with grad mode equal to create_graph.
  if (c10::GradMode::is_enabled()) {
    throw std::runtime_error(kCreateGraph);
  }
  if (torch::autograd::AnomalyMode::is_enabled()) {
    throw std::runtime_error(kAnomaly);
  }
  return task;
}

// Calls visit(i, state, buffer, pos) for each argument (buffer is null
// unless state is kFilled), under the task's mutex with the GIL released.
template <typename Visit>
void for_each_slot(THPFunction* ctx, Node* node, GraphTask* task,
                   Visit&& visit) {
  const std::vector<bool>& is_tensor_arg = ctx->is_variable_input;
  PyThreadState* saved = PyEval_SaveThread();
  try {
    std::lock_guard<std::mutex> lock(task->mutex_);
    size_t edge_index = 0;
    for (size_t i = 0; i < is_tensor_arg.size(); ++i) {
      if (!is_tensor_arg[i] || edge_index >= node->num_outputs()) {
        visit(i, SlotState::kNotATensor, nullptr, 0);
        continue;
      }
      const auto& edge = node->next_edge(edge_index++);
      if (!edge.is_valid()) {
        visit(i, SlotState::kNoGradient, nullptr, 0);
        continue;
      }
      auto it = task->not_ready_.find(edge.function.get());
      const auto pos = static_cast<size_t>(edge.input_nr);
      if (it == task->not_ready_.end() || pos >= it->second.buffer.size() ||
          !it->second.buffer[pos].defined()) {
        visit(i, SlotState::kEmpty, nullptr, 0);
        continue;
      }
      visit(i, SlotState::kFilled, &it->second, pos);
    }
  } catch (...) {
    PyEval_RestoreThread(saved);
    throw;
  }
  PyEval_RestoreThread(saved);
}

}  // namespace

PyObject* input_grad_buffers(PyObject* ctx_obj) {
  THPFunction* ctx = as_ctx(ctx_obj);
  Node* node = node_of(ctx);
  GraphTask* task = running_task_for(node);

  const std::vector<bool>& is_tensor_arg = ctx->is_variable_input;
  const size_t num_args = is_tensor_arg.size();
  std::vector<at::Tensor> exposed(num_args);
  for_each_slot(ctx, node, task,
                [&](size_t i, SlotState state, InputBuffer* buffer, size_t pos) {
                  if (state != SlotState::kFilled) {
                    return;
                  }
                  const at::Tensor& slot = buffer->buffer[pos];
                  if (in_place_rule(slot) == InPlace::kAllowed &&
                      stream_agrees(*buffer, pos, slot, node)) {
                    // Taking the reference raises the slot's use count, so a
                    // second argument reaching the same slot (f(x, x)) is
                    // not exposed again.
                    exposed[i] = slot;
                  }
                });

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

std::vector<std::pair<std::string, std::string>> explain_input_grad_buffers(
    PyObject* ctx_obj) {
  THPFunction* ctx = as_ctx(ctx_obj);
  Node* node = node_of(ctx);
  GraphTask* task = running_task_for(node);
  std::vector<std::pair<std::string, std::string>> reasons(
      ctx->is_variable_input.size());
  size_t edge_index = 0;
  std::vector<Node*> consumers(reasons.size(), nullptr);
  for (size_t i = 0; i < reasons.size(); ++i) {
    if (ctx->is_variable_input[i] && edge_index < node->num_outputs()) {
      consumers[i] = node->next_edge(edge_index++).function.get();
    }
  }
  // (buffer, slot) -> the first argument that reached it
  std::vector<std::pair<std::pair<InputBuffer*, size_t>, size_t>> seen;
  for_each_slot(ctx, node, task, [&](size_t i, SlotState state,
                                     InputBuffer* buffer, size_t pos) {
    auto& reason = reasons[i];
    if (state == SlotState::kFilled) {
      const std::pair<InputBuffer*, size_t> key{buffer, pos};
      auto first = std::find_if(seen.begin(), seen.end(),
                                [&](const auto& s) { return s.first == key; });
      if (first != seen.end()) {
        // f(x, x): the getter hands the slot to the first argument only.
        const auto& earlier = reasons[first->second];
        reason = earlier.first == "exposed"
            ? std::make_pair(std::string("same_slot"),
                             "the same gradient slot as argument " +
                                 std::to_string(first->second) +
                                 ", which gets the buffer")
            : earlier;
        return;
      }
      seen.push_back({key, i});
    }
    switch (state) {
      case SlotState::kNotATensor:
        reason = {"not_a_tensor", "the argument is not a tensor"};
        return;
      case SlotState::kNoGradient:
        reason = {"no_gradient", "the input does not require grad"};
        return;
      case SlotState::kEmpty: {
        const auto& exec_info = task->exec_info_;
        if (!exec_info.empty()) {
          auto it = exec_info.find(consumers[i]);
          if (it == exec_info.end() || !it->second.should_execute()) {
            reason = {"not_needed",
                      "this backward does not compute the input's gradient "
                      "(not among backward(inputs=...) / grad(inputs))"};
            return;
          }
        }
        reason = {"no_earlier_producer",
                  "no producer has contributed to the input's gradient yet "
                  "(consumers created after this Function run before it)"};
        return;
      }
      case SlotState::kFilled:
        break;
    }
    const at::Tensor& slot = buffer->buffer[pos];
    switch (in_place_rule(slot)) {
      case InPlace::kSubclass:
        reason = {"subclass", "the gradient is a tensor subclass"};
        return;
      case InPlace::kZeroTensor:
        reason = {"zero_tensor", "the gradient is a zero tensor"};
        return;
      case InPlace::kNested:
        reason = {"nested", "the gradient is a nested tensor"};
        return;
      case InPlace::kNotDense:
        reason = {"not_dense",
                  "the gradient is not dense (expanded or overlapping)"};
        return;
      case InPlace::kShared:
        reason = {"shared",
                  "the gradient tensor has " +
                      std::to_string(slot.use_count() - 1) +
                      " other owner(s) (another buffer, a root gradient the "
                      "caller holds, or a buffer you still hold)"};
        return;
      case InPlace::kStorageShared:
        reason = {"storage_shared",
                  "the gradient's storage has " +
                      std::to_string(slot.has_storage()
                                         ? slot.storage().use_count() - 1
                                         : 0) +
                      " other owner(s) (a view of a shared storage)"};
        return;
      case InPlace::kAllowed:
        break;
    }
    if (!stream_agrees(*buffer, pos, slot, node)) {
      reason = {"other_stream",
                "the gradient is accumulated on another device or stream "
                "than the running node's"};
    } else {
      reason = {"exposed", "the buffer is exposed"};
    }
  });
  return reasons;
}

namespace {

PyObject* guarded_run_backward = nullptr;  // the original, a Python function
PyObject* reentrancy_check = nullptr;      // raises when a buffer was handed out

PyObject* run_backward_guarded(PyObject* /*module*/, PyObject* const* args,
                               size_t nargsf, PyObject* kwnames) {
  if (torch::autograd::get_current_node()) {
    PyObject* r = PyObject_CallNoArgs(reentrancy_check);
    if (r == nullptr) {
      return nullptr;
    }
    Py_DECREF(r);
  }
  return PyObject_Vectorcall(guarded_run_backward, args, nargsf, kwnames);
}

PyMethodDef guard_def = {
    "_engine_run_backward",
    reinterpret_cast<PyCFunction>(
        reinterpret_cast<void (*)(void)>(run_backward_guarded)),
    METH_FASTCALL | METH_KEYWORDS, nullptr};

}  // namespace

PyObject* make_reentrancy_guard(PyObject* original, PyObject* check) {
  Py_XDECREF(guarded_run_backward);
  Py_XDECREF(reentrancy_check);
  Py_INCREF(original);
  Py_INCREF(check);
  guarded_run_backward = original;
  reentrancy_check = check;
  return PyCFunction_New(&guard_def, nullptr);
}

}  // namespace torch_ctxext
