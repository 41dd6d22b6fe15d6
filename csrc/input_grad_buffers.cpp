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

#include <mutex>
#include <stdexcept>
#include <vector>

namespace torch_ctxext {

namespace {

using torch::autograd::InputBuffer;

// The engine's rule for accumulating into a slot in place (torch 2.15's
// input_buffer.cpp): a plain dense tensor whose TensorImpl and storage have no
// other owner. A Python wrapper that nothing but the tensor itself keeps alive
// (a tensor created in a Python backward, or a buffer handed out earlier and
// since dropped) is no other owner: is_tensor_stealable discounts it.
bool can_accumulate_inplace(const at::Tensor& v) {
  return !(at::isTensorSubclassLike(v) || v._is_zerotensor() ||
           v.is_nested()) &&
      v.is_non_overlapping_and_dense() &&
      torch::autograd::impl::is_tensor_stealable(
          v, 1 + (at::caching::is_cached_tensor(v) ? 1 : 0)) &&
      v.has_storage() && v.storage().use_count() == 1;
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

PyObject* input_grad_buffers(PyObject* ctx_obj) {
  THPFunction* ctx = as_ctx(ctx_obj);
  Node* node = node_of(ctx);
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

  const std::vector<bool>& is_tensor_arg = ctx->is_variable_input;
  const size_t num_args = is_tensor_arg.size();
  std::vector<at::Tensor> exposed(num_args);
  {
    // Other engine threads take mutex_ and may need the GIL while holding it
    // (a subclass's __torch_dispatch__ inside InputBuffer::add).
    PyThreadState* saved = PyEval_SaveThread();
    try {
      std::lock_guard<std::mutex> lock(task->mutex_);
      size_t edge_index = 0;
      for (size_t i = 0; i < num_args; ++i) {
        if (!is_tensor_arg[i]) {
          continue;
        }
        if (edge_index >= node->num_outputs()) {
          break;
        }
        const auto& edge = node->next_edge(edge_index++);
        if (!edge.is_valid()) {
          continue;
        }
        auto it = task->not_ready_.find(edge.function.get());
        if (it == task->not_ready_.end()) {
          continue;
        }
        InputBuffer& buffer = it->second;
        const auto pos = static_cast<size_t>(edge.input_nr);
        if (pos >= buffer.buffer.size()) {
          continue;
        }
        const at::Tensor& slot = buffer.buffer[pos];
        if (!slot.defined() || !can_accumulate_inplace(slot) ||
            !stream_agrees(buffer, pos, slot, node)) {
          continue;
        }
        // Taking the reference raises the slot's use count, so a second
        // argument reaching the same slot (f(x, x)) is not exposed again.
        exposed[i] = slot;
      }
    } catch (...) {
      PyEval_RestoreThread(saved);
      throw;
    }
    PyEval_RestoreThread(saved);
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

}  // namespace torch_ctxext
