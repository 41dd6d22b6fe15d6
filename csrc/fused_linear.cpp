// FusedLinear's Function in C++: the same forward and backward as
// torch_ctxext/nn/linear.py's FusedLinearFunction, without a Python
// Function's cost per call.
//
// A Python autograd.Function costs about 15 us a call more than nn.Linear on
// CPU (Function.apply's wrapper, a ctx, a Python backward under the GIL), which
// is more than the whole saving of a fused small layer. This is a
// torch::autograd::Function (a CppNode: hooks, saved-tensor checks, retain_graph,
// create_graph and compiled autograd as any C++ custom Function), and its
// backward adds into the engine's buffers by the rules of
// ctx.input_grad_buffers (engine_buffers, fused_linear.h: the extension's
// lookup on torch 2.6 to 2.14, torch's own on a torch that provides the
// property, 2.15, where this file is built with advise()'s watch).
//
// fused_linear(x, weight, bias) takes the route only for what it computes
// exactly as the Python Function does, and returns None for anything else, so
// that FusedLinear runs the Python Function there: plain CPU tensors (no
// subclass, no torch function mode, no dispatch mode, no autocast, no
// functorch transform, no forward AD), one floating dtype, an input of two
// dimensions stored row by row or of more (Conv1D's: that folds into a
// matrix as a view).
#include "fused_linear.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/_unsafe_view.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/forward_grad.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <atomic>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace torch_ctxext {

namespace fused_linear_detail {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<uint64_t> lookups{0};
std::atomic<uint64_t> additions{0};

// A vector of ones per (device, dtype), grown as needed: the bias's fused
// row sum (addmv_) allocates nothing at each add (as _matmul.ones). One per
// thread: no lock to take in the engine, none to be held across a fork().
thread_local std::vector<std::pair<std::pair<c10::Device, at::ScalarType>, at::Tensor>> ones;

at::Tensor ones_rows(int64_t rows, const at::Tensor& like) {
  const std::pair<c10::Device, at::ScalarType> key{like.device(), like.scalar_type()};
  auto it = std::find_if(ones.begin(), ones.end(),
                         [&](const auto& entry) { return entry.first == key; });
  if (it == ones.end()) {
    ones.emplace_back(key, at::Tensor());
    it = std::prev(ones.end());
  }
  if (!it->second.defined() || it->second.numel() < rows) {
    it->second = at::ones({std::max<int64_t>(rows, 1024)}, like.options());
  }
  return it->second.narrow(0, 0, rows);
}

// _matmul._viewable: whether x's leading dimensions fold into one without a
// copy.
bool viewable(const at::Tensor& x) {
  if (x.is_contiguous()) {
    return true;
  }
  const auto sizes = x.sizes();
  const auto strides = x.strides();
  for (int64_t i = 0; i + 2 < x.dim(); ++i) {
    if (strides[i] != strides[i + 1] * sizes[i + 1]) {
      return false;
    }
  }
  return x.numel() > 0;
}

}  // namespace fused_linear_detail

// The Function, with a bias or without (an absent bias would be no variable
// input: no edge, no needs_input_grad(2)), for a weight stored out x in
// (nn.Linear: y = x @ weight.t() + bias) or in x out (transformers' Conv1D:
// y = x @ weight + bias, FusedConv1DFunction). CppNode names its node after it
// ("torch_ctxext::FusedLinearFunction<true, true, true>" for nn.Linear's). It
// keeps nothing but its saved tensors: the input's shape is the output
// gradient's, with the input's features. kFuseInput false is
// FusedProjectionFunction (nn/attention.py): the input's gradient is returned,
// never added into, as FusedMultiheadAttention promises.
template <bool kBias, bool kOutIn, bool kFuseInput = true>
struct FusedLinearFunction
    : public torch::autograd::Function<FusedLinearFunction<kBias, kOutIn, kFuseInput>> {
  // Compiled autograd may trace the backward (2.6 refuses to otherwise): it
  // reads nothing but its saved tensors and gradients there, since the
  // engine's buffers are looked up only for the node the engine is running.
  static constexpr bool is_traceable = true;

  static at::Tensor forward(fused_linear_detail::AutogradContext* ctx,
                            const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias) {
    if (!kOutIn) {  // Conv1D's forward, op for op
      save(ctx, x, weight);
      std::vector<int64_t> size_out(x.sizes().begin(), x.sizes().end());
      size_out.back() = weight.size(1);
      return at::addmm(bias, x.view({-1, x.size(-1)}), weight).view(size_out);
    }
    const at::Tensor folded = fold(x, weight);
    save(ctx, folded, weight);
    if (folded.defined() && !folded.is_same(x)) {
      return unfold(at::linear(folded, weight, bias), x, weight);
    }
    return at::linear(x, weight, bias);
  }

  static at::Tensor forward(fused_linear_detail::AutogradContext* ctx,
                            const at::Tensor& x, const at::Tensor& weight) {
    const at::Tensor folded = fold(x, weight);
    save(ctx, folded, weight);
    if (folded.defined() && !folded.is_same(x)) {
      return unfold(at::linear(folded, weight), x, weight);
    }
    return at::linear(x, weight);
  }

  // _matmul.fold: what of x aten::linear multiplies and saves. x itself
  // where it is a matrix or folds into one as a view; else, where the
  // weight's gradient needs it, the folded copy (made with grad mode on, as
  // aten::matmul makes it: a double backward differentiates the weight's
  // gradient through it), which the backward then reads, copying nothing;
  // else nothing (F.linear multiplies x as a batch).
  static at::Tensor fold(const at::Tensor& x, const at::Tensor& weight) {
    if (x.dim() <= 2 || fused_linear_detail::viewable(x)) {
      return x;
    }
    if (!weight.requires_grad()) {
      return at::Tensor();
    }
    at::AutoGradMode enable_grad(true);
    return x.flatten(0, -2);
  }

  // The product of a folded copy in x's shape, with the weight's features.
  static at::Tensor unfold(const at::Tensor& product, const at::Tensor& x,
                           const at::Tensor& weight) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = weight.size(0);
    return at::_unsafe_view(product, shape);
  }

  // What the stock layer saves: the (folded) input only where the weight's
  // gradient needs it.
  static void save(fused_linear_detail::AutogradContext* ctx,
                   const at::Tensor& x, const at::Tensor& weight) {
    ctx->save_for_backward({weight.requires_grad() ? x : at::Tensor(), weight});
  }

  // _matmul.linear_grads, op for op (the same bits): where nothing is added
  // into, nn.Linear's (or Conv1D's) own backward products.
  static fused_linear_detail::variable_list backward(
      fused_linear_detail::AutogradContext* ctx,
      fused_linear_detail::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const bool needs[3] = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                           kBias && ctx->needs_input_grad(2)};
    const at::Tensor& grad_out = grads[0];
    std::vector<at::Tensor> buffers;
    if (!at::GradMode::is_enabled()) {  // create_graph: the differentiable fallback
      buffers = fused_linear_detail::own_buffers<FusedLinearFunction>(ctx);
    }
    torch::autograd::variable_list result(kBias ? 3 : 2);
    const at::Tensor g0 = grad_out.dim() == 2
                              ? grad_out
                              : grad_out.reshape({-1, grad_out.size(-1)});
    const at::Tensor g = g0.scalar_type() == weight.scalar_type()
                             ? g0
                             : g0.to(weight.scalar_type());
    auto buffer = [&](size_t i) {
      return i < buffers.size() && buffers[i].defined() &&
                     buffers[i].scalar_type() == g.scalar_type()
                 ? buffers[i]
                 : at::Tensor();
    };
    // The weight as the input's gradient multiplies it: out x in.
    const at::Tensor w_x = kOutIn ? weight : weight.t();
    if (needs[0]) {
      const at::Tensor x_buf = kFuseInput ? buffer(0) : at::Tensor();
      const int64_t in = w_x.size(1);
      if (x_buf.defined() && x_buf.is_contiguous()) {
        x_buf.view({-1, in}).addmm_(g, w_x);
        fused_linear_detail::additions++;
      } else if (x_buf.defined() && x_buf.dim() == 2 && x_buf.t().is_contiguous()) {
        x_buf.t().addmm_(w_x.t(), g.t());
        fused_linear_detail::additions++;
      } else {
        at::Tensor product = g.mm(w_x);
        if (grad_out.dim() == 2) {
          result[0] = std::move(product);
        } else {  // the input's shape: the output's, with the input's features
          std::vector<int64_t> shape(grad_out.sizes().begin(), grad_out.sizes().end());
          shape.back() = in;
          result[0] = at::_unsafe_view(product, shape);
        }
      }
    }
    if (needs[1]) {
      const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
      const at::Tensor a = kOutIn ? g.t() : x2.t();
      const at::Tensor b = kOutIn ? x2 : g;
      const at::Tensor w_buf = buffer(1);
      if (w_buf.defined()) {
        w_buf.addmm_(a, b);
        fused_linear_detail::additions++;
      } else {
        result[1] = a.mm(b);
      }
    }
    if (needs[2]) {
      const at::Tensor b_buf = buffer(2);
      if (b_buf.defined()) {
        b_buf.addmv_(g.t(), fused_linear_detail::ones_rows(g.size(0), g));
        fused_linear_detail::additions++;
      } else {
        result.back() = g.sum(0);
      }
    }
    return result;
  }

};

namespace fused_linear_detail {

PyObject* parameter_type = nullptr;  // torch.nn.Parameter

// torch.Tensor or nn.Parameter itself: no __torch_function__ to honour.
bool plain_type(PyObject* obj) {
  auto* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  return type == THPVariableClass || type == parameter_type;
}

// A dense CPU tensor with autograd and nothing else (no conjugate or negative
// bit, no zero tensor, no functorch wrapper, no Python key): the keys
// TensorImpl gives a CPU tensor (AutocastCPU among them: this thread's
// dispatch excludes it unless autocast is on).
bool plain_cpu(const at::Tensor& t) {
  static const c10::DispatchKeySet keys =
      c10::DispatchKeySet(c10::DispatchKey::CPU) |
      c10::getAutogradRelatedKeySetFromBackend(c10::BackendComponent::CPUBit) |
      c10::getAutocastRelatedKeySetFromBackend(c10::BackendComponent::CPUBit);
  return t.key_set() == keys && t.layout() == at::kStrided;
}

// Whether this thread dispatches as eager code does by default: nothing
// included beyond what every thread includes (no dispatch mode, no
// functorch transform), nothing excluded beyond the autocast keys (not
// inference mode or a C++ below-autograd guard), and CPU autocast off.
bool default_dispatch() {
  static const c10::DispatchKeySet always_included(
      {c10::DispatchKey::BackendSelect, c10::DispatchKey::ADInplaceOrView});
  const auto local = c10::impl::tls_local_dispatch_key_set();
  return (local.included_ - always_included).empty() &&
         (local.excluded_ - c10::autocast_dispatch_keyset).empty() &&
         local.excluded_.has(c10::DispatchKey::AutocastCPU);
}

// Whether the input is one the route computes as the Python Function does:
// at least a matrix, not empty; for nn.Linear's a matrix stored row by row
// (FusedLinearFunction returns a column-major matrix's gradient column-major)
// or more dimensions (folded as _matmul.fold folds them: FusedLinearFunction's
// forward), for Conv1D's more dimensions only where they fold into a matrix
// as a view (its forward requires it of any input: x.view(-1, in)).
bool routable_input(const at::Tensor& x, bool out_in) {
  if (x.dim() < 2 || x.numel() == 0) {
    return false;
  }
  if (x.dim() == 2) {
    const auto sizes = x.sizes();
    const auto strides = x.strides();
    return !out_in ||
           !(strides[0] == 1 &&
             (sizes[1] == 1 || strides[1] >= std::max<int64_t>(1, sizes[0])));
  }
  return out_in || viewable(x);
}

// Whether (x, weight, bias) is a product the C++ Function computes as the
// Python Function does, from Python objects: bias may be None (Py_None).
bool routable(PyObject* x_obj, PyObject* weight_obj, PyObject* bias_obj, bool out_in) {
  const bool has_bias = bias_obj != Py_None;
  // Conv1D always has a bias (its forward is addmm): a None there is a call
  // the Python Function reports, not one to route.
  if (!plain_type(x_obj) || !plain_type(weight_obj) ||
      !(has_bias ? plain_type(bias_obj) : out_in)) {
    return false;
  }
  const at::Tensor& x = THPVariable_Unpack(x_obj);
  const at::Tensor& weight = THPVariable_Unpack(weight_obj);
  const auto dtype = weight.scalar_type();
  if (!at::isFloatingType(dtype) || x.scalar_type() != dtype ||
      !plain_cpu(x) || !plain_cpu(weight) || weight.dim() != 2 ||
      x.size(-1) != weight.size(out_in ? 1 : 0) || !routable_input(x, out_in)) {
    return false;
  }
  if (!has_bias) {
    return true;
  }
  const at::Tensor& bias = THPVariable_Unpack(bias_obj);
  return bias.scalar_type() == dtype && plain_cpu(bias) && bias.dim() == 1;
}

bool default_modes() {
  return !at::impl::torch_function_mode_enabled() && default_dispatch() &&
         torch::autograd::ForwardADLevel::try_get_by_idx(0) == nullptr;
}

// One product of a routable call: the C++ Function where a gradient may
// flow, F.linear (no node) where none can (Conv1D's forward is its own).
template <bool kOutIn, bool kFuseInput>
at::Tensor product(PyObject* x_obj, PyObject* weight_obj, PyObject* bias_obj) {
  const at::Tensor& x = THPVariable_Unpack(x_obj);
  const at::Tensor& weight = THPVariable_Unpack(weight_obj);
  if (bias_obj == Py_None) {
    if (!at::GradMode::is_enabled() || !(x.requires_grad() || weight.requires_grad())) {
      return at::linear(x, weight);
    }
    return FusedLinearFunction<false, true, kFuseInput>::apply(x, weight);
  }
  const at::Tensor& bias = THPVariable_Unpack(bias_obj);
  const bool needs_node = at::GradMode::is_enabled() &&
      (x.requires_grad() || weight.requires_grad() || bias.requires_grad());
  if (!needs_node && kOutIn) {
    return at::linear(x, weight, bias);
  }
  return FusedLinearFunction<true, kOutIn, kFuseInput>::apply(x, weight, bias);
}

bool check_nargs(Py_ssize_t nargs, Py_ssize_t expected, const char* names) {
  if (nargs == expected) {
    return true;
  }
  PyErr_Format(PyExc_TypeError, "takes %zd arguments: %s", expected, names);
  return false;
}

// fused_linear(x, weight, bias), fused_projection(x, weight, bias) and
// fused_conv1d(x, weight, bias): the output, or None where the Python
// Function must run. METH_FASTCALL functions (pybind11's dispatch costs about
// half a microsecond a call): the drop-ins call them at every call.
template <bool kOutIn, bool kFuseInput>
PyObject* apply_route(PyObject* /*module*/, PyObject* const* args,
                      Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!check_nargs(nargs, 3, "x, weight, bias")) {
    return nullptr;
  }
  if (!default_modes() || !routable(args[0], args[1], args[2], kOutIn)) {
    Py_RETURN_NONE;
  }
  return THPVariable_Wrap(product<kOutIn, kFuseInput>(args[0], args[1], args[2]));
  END_HANDLE_TH_ERRORS
}

// A hidden or cell state the cell's arithmetic reads: a plain CPU tensor
// (a subclass would see its Python ops, not these).
bool plain_state(PyObject* obj) {
  return plain_type(obj) && plain_cpu(THPVariable_Unpack(obj));
}

// fused_gru_cell(x, h, weight_ih, weight_hh, bias_ih, bias_hh): FusedGRUCell's
// step on batched inputs (nn/gru.py), its two products by the C++ Function
// and the rest as aten::gru_cell computes it on the CPU, op for op (the
// Python code's order: the same nodes, the same bits), or None.
PyObject* gru_cell(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!check_nargs(nargs, 6, "x, h, weight_ih, weight_hh, bias_ih, bias_hh")) {
    return nullptr;
  }
  if (!default_modes() || !routable(args[0], args[2], args[4], true) ||
      !routable(args[1], args[3], args[5], true) || !plain_state(args[1])) {
    Py_RETURN_NONE;
  }
  const at::Tensor& h = THPVariable_Unpack(args[1]);
  const auto igates = product<true, true>(args[0], args[2], args[4]).unsafe_chunk(3, 1);
  const auto hgates = product<true, true>(args[1], args[3], args[5]).unsafe_chunk(3, 1);
  const auto reset_gate = hgates[0].add_(igates[0]).sigmoid_();
  const auto input_gate = hgates[1].add_(igates[1]).sigmoid_();
  const auto new_gate = igates[2].add(hgates[2].mul_(reset_gate)).tanh_();
  return THPVariable_Wrap((h - new_gate).mul_(input_gate).add_(new_gate));
  END_HANDLE_TH_ERRORS
}

// fused_lstm_cell(x, h, c, weight_ih, weight_hh, bias_ih, bias_hh):
// FusedLSTMCell's step on batched inputs (nn/rnn.py), as aten::lstm_cell on
// the CPU with its products by the C++ Function: (hy, cy), or None.
PyObject* lstm_cell(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!check_nargs(nargs, 7, "x, h, c, weight_ih, weight_hh, bias_ih, bias_hh")) {
    return nullptr;
  }
  if (!default_modes() || !routable(args[1], args[4], args[6], true) ||
      !routable(args[0], args[3], args[5], true) || !plain_state(args[2])) {
    Py_RETURN_NONE;
  }
  const at::Tensor& c = THPVariable_Unpack(args[2]);
  const at::Tensor hgates = product<true, true>(args[1], args[4], args[6]);
  const auto gates = hgates.add_(product<true, true>(args[0], args[3], args[5])).unsafe_chunk(4, 1);
  const auto in_gate = gates[0].sigmoid_();
  const auto forget_gate = gates[1].sigmoid_();
  const auto cell_gate = gates[2].tanh_();
  const auto out_gate = gates[3].sigmoid_();
  auto cy = (forget_gate * c).add_(in_gate * cell_gate);
  auto hy = out_gate * cy.tanh();
  PyObject* result = PyTuple_New(2);
  if (result == nullptr) {
    return nullptr;
  }
  PyTuple_SET_ITEM(result, 0, THPVariable_Wrap(std::move(hy)));
  PyTuple_SET_ITEM(result, 1, THPVariable_Wrap(std::move(cy)));
  return result;
  END_HANDLE_TH_ERRORS
}

PyMethodDef route_defs[] = {
    {"fused_linear",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(apply_route<true, true>)),
     METH_FASTCALL,
     "FusedLinear's Function in C++: fused_linear(x, weight, bias) is its output, "
     "or None where the Python Function must run (torch_ctxext/nn/linear.py)"},
    {"fused_projection",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(apply_route<true, false>)),
     METH_FASTCALL,
     "FusedProjectionFunction in C++ (FusedMultiheadAttention's products: the "
     "input's gradient is returned, never added into): fused_projection(x, weight, "
     "bias) is its output, or None where the Python Function must run "
     "(torch_ctxext/nn/attention.py)"},
    {"fused_gru_cell",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(gru_cell)),
     METH_FASTCALL,
     "FusedGRUCell's step in C++: fused_gru_cell(x, h, weight_ih, weight_hh, bias_ih, "
     "bias_hh) is the new hidden state, or None where the Python code must run "
     "(torch_ctxext/nn/gru.py)"},
    {"fused_lstm_cell",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(lstm_cell)),
     METH_FASTCALL,
     "FusedLSTMCell's step in C++: fused_lstm_cell(x, h, c, weight_ih, weight_hh, "
     "bias_ih, bias_hh) is (hy, cy), or None where the Python code must run "
     "(torch_ctxext/nn/rnn.py)"},
    {"fused_conv1d",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(apply_route<false, true>)),
     METH_FASTCALL,
     "FusedConv1D's Function in C++: fused_conv1d(x, weight, bias) (weight in x out) "
     "is its output, or None where the Python Function must run (torch_ctxext/nn/conv1d.py)"},
};

}  // namespace fused_linear_detail

void register_fused_linear(py::module_& m, py::module_& testing) {
  fused_linear_detail::parameter_type =
      py::module_::import("torch.nn").attr("Parameter").cast<py::object>().release().ptr();
  for (auto& def : fused_linear_detail::route_defs) {
    PyObject* function = PyCFunction_New(&def, nullptr);
    if (function == nullptr) {
      throw py::error_already_set();
    }
    m.add_object(def.ml_name, py::reinterpret_steal<py::object>(function));
  }
  register_fused_embedding(m);
  testing.def("fused_linear_lookups",
              []() { return fused_linear_detail::lookups.load(); },
              "How many of fused_linear's backward calls looked for the "
              "engine's buffers");
  testing.def("fused_linear_additions",
              []() { return fused_linear_detail::additions.load(); },
              "How many gradients fused_linear's backward added into the "
              "engine's buffers");
}

}  // namespace torch_ctxext
