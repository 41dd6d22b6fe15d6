// FusedLinear's Function in C++ (fused_linear.cpp): where FusedLinear's
// forward takes it, and why.
#pragma once

#include <pybind11/pybind11.h>

namespace torch_ctxext {

// Binds fused_linear(x, weight, bias) into torch_ctxext._C, and the count of
// the gradients its backward added into the engine's buffers into
// _C._testing (module.cpp).
void register_fused_linear(pybind11::module_& m, pybind11::module_& testing);

}  // namespace torch_ctxext
