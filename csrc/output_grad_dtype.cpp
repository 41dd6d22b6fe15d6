#include "output_grad_dtype.h"

#include <stdexcept>
#include <string>

namespace torch_ctxext {

std::vector<bool> differentiable_outputs(PyObject* ctx_obj) {
  THPFunction* ctx = as_ctx(ctx_obj);
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
  THPFunction* ctx = as_ctx(ctx_obj);
  Node* node = node_of(ctx);
  if (node == nullptr || index >= node->num_inputs() ||
      node->input_metadata(index).was_default_constructed()) {
    // Callers validate first; reaching this is a bug in torch_ctxext, and an
    // InputMetadata assert inside torch must never be what the user sees.
    throw std::out_of_range("torch_ctxext: output " + std::to_string(index) +
                            " carries no gradient metadata");
  }
  node->mutable_input_metadata(index).set_grad_dtype(dtype);
  if (dtype.has_value() && index < ctx->output_info.size()) {
    ctx->output_info[index].scalar_type = *dtype;
  }
}

}  // namespace torch_ctxext
