// FusedLinear's and FusedConv1D's Function in C++ (fused_linear.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/function.h>

#include <vector>

namespace torch_ctxext {

// Binds fused_linear(x, weight, bias) and fused_conv1d(x, weight, bias) into
// the module (torch_ctxext._C, or advise()'s build on a torch that provides
// the whole contract), and the counts of what their backward looked up and
// added into the engine's buffers into its _testing (module.cpp,
// advise_module.cpp).
void register_fused_linear(pybind11::module_& m, pybind11::module_& testing);

// The engine's buffers `node` (the node the engine is running now, one of
// torch_ctxext's own) may add into, per next edge, by the rules of
// ctx.input_grad_buffers; none (undefined tensors, or an empty vector) where
// the property would raise (post-hooks on the node, anomaly detection,
// create_graph, a refused slot): the node then computes out of place, as the
// engine would. Defined by input_grad_buffers.cpp where torch_ctxext provides
// the property (torch 2.6 to 2.14), by fused_linear_native.cpp where torch
// does (_torch_ctxext_build/sources.py compiles one or the other).
std::vector<at::Tensor> engine_buffers(torch::autograd::Node* node);

}  // namespace torch_ctxext
