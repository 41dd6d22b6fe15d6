// The drop-ins' Functions in C++: FusedLinear's, FusedConv1D's, the
// projections of FusedMultiheadAttention and the cells' steps
// (fused_linear.cpp), FusedEmbedding's (fused_embedding.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace torch_ctxext {

// Binds fused_linear, fused_projection, fused_conv1d, fused_gru_cell,
// fused_lstm_cell and fused_embedding into the module (torch_ctxext._C, or
// advise()'s build on a torch that provides the whole contract), and the
// counts of what their backward looked up and added into the engine's
// buffers into its _testing (module.cpp, advise_module.cpp).
void register_fused_linear(pybind11::module_& m, pybind11::module_& testing);
void register_fused_embedding(pybind11::module_& m);

// The engine's buffers `node` (the node the engine is running now, one of
// torch_ctxext's own) may add into, per next edge, by the rules of
// ctx.input_grad_buffers; none (undefined tensors, or an empty vector) where
// the property would raise (post-hooks on the node, anomaly detection,
// create_graph, a refused slot): the node then computes out of place, as the
// engine would. Defined by input_grad_buffers.cpp where torch_ctxext provides
// the property (torch 2.6 to 2.14), by fused_linear_native.cpp where torch
// does (_torch_ctxext_build/sources.py compiles one or the other).
std::vector<at::Tensor> engine_buffers(torch::autograd::Node* node);

namespace fused_linear_detail {

// For tests: how many backward calls looked for buffers, how many slots
// they added into (the Python Functions' reads and non-None entries).
extern std::atomic<uint64_t> lookups;
extern std::atomic<uint64_t> additions;

// What a route checks before it takes a call (fused_linear.cpp): an object
// whose type is torch.Tensor or nn.Parameter itself; a dense CPU tensor with
// autograd and nothing else; a thread that runs eager code as by default (no
// torch function or dispatch mode, functorch, autocast, inference mode or
// forward AD); `nargs` arguments (else a TypeError naming them is set).
bool plain_type(PyObject* obj);
bool plain_cpu(const at::Tensor& t);
bool default_modes();
bool check_nargs(Py_ssize_t nargs, Py_ssize_t expected, const char* names);

// The engine's buffers for the inputs of the node running `ctx`, where its
// backward may add into them: only when the node running is `ctx`'s own
// CppNode<Fn> (compiled autograd calls the backward outside the engine's node
// execution).
template <class Fn>
std::vector<at::Tensor> own_buffers(torch::autograd::AutogradContext* ctx) {
  const auto current = torch::autograd::get_current_node();
  auto* node = dynamic_cast<torch::autograd::CppNode<Fn>*>(current.get());
  if (node == nullptr || &node->ctx_ != ctx) {
    return {};
  }
  lookups++;
  return engine_buffers(node);
}

}  // namespace fused_linear_detail

}  // namespace torch_ctxext
