// FusedEmbedding's Function in C++: torch_ctxext/nn/embedding.py's
// FusedEmbeddingFunction, without a Python Function's cost per call, for the
// lookups it computes alike to the bit (no scale_grad_by_freq: there the
// Python Function scales the buffer's rows around the add).
//
// fused_embedding(indices, weight, padding_idx) is weight[indices] (as
// torch.embedding) with a node whose backward adds the rows of the output's
// gradient into the engine's buffer for the weight (index_add_, then the
// padding row put back as it was) where ctx.input_grad_buffers would expose
// it, and returns aten::embedding_dense_backward's gradient elsewhere; None
// where the Python Function must run (see routable_lookup).
#include "fused_linear.h"

#include <ATen/ops/embedding.h>
#include <ATen/ops/embedding_dense_backward.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>

namespace torch_ctxext {

// The Function; CppNode names its node "torch_ctxext::FusedEmbeddingFunction".
// It saves the indices (the lookup's own saved tensor) and keeps the table's
// row count and the padding row (-1: none) in saved_data.
struct FusedEmbeddingFunction : public torch::autograd::Function<FusedEmbeddingFunction> {
  static constexpr bool is_traceable = true;  // as FusedLinearFunction

  static at::Tensor forward(torch::autograd::AutogradContext* ctx,
                            const at::Tensor& indices, const at::Tensor& weight,
                            int64_t padding_idx) {
    ctx->save_for_backward({indices});
    ctx->saved_data["num_weights"] = weight.size(0);
    ctx->saved_data["padding_idx"] = padding_idx;
    return at::embedding(weight, indices, padding_idx, false, false);
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const at::Tensor indices = ctx->get_saved_variables()[0];
    const int64_t padding_idx = ctx->saved_data["padding_idx"].toInt();
    torch::autograd::variable_list result(3);
    if (!ctx->needs_input_grad(1)) {
      return result;
    }
    const at::Tensor& grad = grads[0];
    std::vector<at::Tensor> buffers;
    if (!at::GradMode::is_enabled()) {  // create_graph: the differentiable fallback
      buffers = fused_linear_detail::own_buffers<FusedEmbeddingFunction>(ctx);
    }
    if (buffers.size() > 1 && buffers[1].defined() &&
        buffers[1].scalar_type() == grad.scalar_type()) {
      const at::Tensor& w_buf = buffers[1];
      // The padding row gets no gradient: add every row, then put the
      // padding row's buffer back as it was (one row kept aside).
      const at::Tensor kept = padding_idx >= 0 ? w_buf[padding_idx].clone() : at::Tensor();
      w_buf.index_add_(0, indices.reshape(-1), grad.reshape({-1, grad.size(-1)}));
      if (kept.defined()) {
        w_buf[padding_idx].copy_(kept);
      }
      fused_linear_detail::additions++;
      return result;
    }
    result[1] = at::embedding_dense_backward(
        grad, indices, ctx->saved_data["num_weights"].toInt(), padding_idx, false);
    return result;
  }
};

namespace fused_linear_detail {

// Whether the lookup is one the C++ Function computes as the Python Function
// does: plain CPU tensors, integer indices, a floating matrix.
bool routable_lookup(PyObject* indices_obj, PyObject* weight_obj) {
  if (!plain_type(indices_obj) || !plain_type(weight_obj)) {
    return false;
  }
  const at::Tensor& indices = THPVariable_Unpack(indices_obj);
  const at::Tensor& weight = THPVariable_Unpack(weight_obj);
  return (indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt) &&
         plain_cpu(indices) && plain_cpu(weight) && weight.dim() == 2 &&
         at::isFloatingType(weight.scalar_type());
}

PyObject* apply_embedding(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!check_nargs(nargs, 3, "indices, weight, padding_idx")) {
    return nullptr;
  }
  if (!PyLong_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "padding_idx must be an int (-1: none)");
    return nullptr;
  }
  const int64_t padding_idx = PyLong_AsLongLong(args[2]);
  if (padding_idx == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  if (!default_modes() || !routable_lookup(args[0], args[1])) {
    Py_RETURN_NONE;
  }
  const at::Tensor& indices = THPVariable_Unpack(args[0]);
  const at::Tensor& weight = THPVariable_Unpack(args[1]);
  return THPVariable_Wrap(FusedEmbeddingFunction::apply(indices, weight, padding_idx));
  END_HANDLE_TH_ERRORS
}

PyMethodDef embedding_def = {
    "fused_embedding",
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(apply_embedding)),
    METH_FASTCALL,
    "FusedEmbedding's Function in C++: fused_embedding(indices, weight, padding_idx) "
    "is its output, or None where the Python Function must run "
    "(torch_ctxext/nn/embedding.py)"};

}  // namespace fused_linear_detail

void register_fused_embedding(pybind11::module_& m) {
  PyObject* function = PyCFunction_New(&fused_linear_detail::embedding_def, nullptr);
  if (function == nullptr) {
    throw pybind11::error_already_set();
  }
  m.add_object("fused_embedding", pybind11::reinterpret_steal<pybind11::object>(function));
}

}  // namespace torch_ctxext
