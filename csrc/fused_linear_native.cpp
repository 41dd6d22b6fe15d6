// engine_buffers (fused_linear.h) on a torch that provides
// ctx.input_grad_buffers itself (torch 2.15): torch's own lookup behind the
// property, get_current_input_grad_buffers, which raises where the property
// would. Compiled only in the build for such a torch, with advise()'s watch
// (_torch_ctxext_build/sources.py: ADVISE_ONLY); public headers only.
#include "fused_linear.h"

#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/graph_task.h>

#include <exception>

namespace torch_ctxext {

std::vector<at::Tensor> engine_buffers(torch::autograd::Node* node) {
  // The property's own refusals that torch checks before the engine's
  // lookup (python_function.cpp), as input_grad_buffers.cpp makes them.
  if (!node->post_hooks().empty() ||
      torch::autograd::AnomalyMode::is_enabled()) {
    return {};
  }
  try {
    return torch::autograd::get_current_input_grad_buffers(node);
  } catch (const std::exception&) {
    return {};  // refused: out of place
  }
}

}  // namespace torch_ctxext
