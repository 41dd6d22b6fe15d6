// The boxed-grads apply path for torch <= 2.12.
//
// torch 2.13 lets a Function set `boxed_grads_call = True`: the engine then
// moves the grads into one Python list, which holds the only references, so
// a backward that drops an entry frees that gradient at once, and calls
// `ctx.apply_boxed(list)` instead of `ctx.apply(*grads)`. On 2.12,
// PyNode::apply wraps the grads into a tuple while the engine's own vector
// keeps them alive until backward returns; nothing in Python can release
// them. We therefore replace PyNode's `apply` vtable slot with a function
// that, for boxed Functions only, does what torch 2.13's PyNode::apply does
// (python_function.cpp): it moves the grads out of the engine's vector into
// a list, calls `ctx.apply_boxed(list)`, and checks and converts the result
// with torch's own rules and texts. Each call builds its own list: nothing
// shared is mutated, so threads running backward through one retained graph
// each get their own grads. Other Functions go straight to the original.
#include "boxed_grads.h"

#include "patching.h"

#include <dlfcn.h>

#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <unordered_map>

namespace torch_ctxext {

#if TORCH_CTXEXT_NO_NATIVE_BOXED_GRADS

namespace {

using torch::autograd::PyNode;
using torch::autograd::variable_list;
using ApplyFn = variable_list (*)(Node*, variable_list&&);

ApplyFn original_apply = nullptr;

// Itanium C++ ABI: a pointer to a virtual member function holds 1 + the byte
// offset of its slot in the vtable. (Node::apply is protected: a derived
// class may name it.)
struct ApplySlot : Node {
  static auto member() {
    return &ApplySlot::apply;
  }
};

size_t apply_slot() {
  auto pmf = ApplySlot::member();
  uintptr_t raw[2];
  static_assert(sizeof(pmf) == sizeof(raw), "Itanium member pointer");
  std::memcpy(raw, &pmf, sizeof(raw));
  if ((raw[0] & 1) == 0) {
    throw std::runtime_error("torch_ctxext: unexpected member-pointer layout");
  }
  return (raw[0] - 1) / sizeof(void*);
}

// --- is this Function boxed? (under the GIL) --------------------------------
//
// Asked on every PyNode apply, so cached per ctx class. A class's
// tp_version_tag changes whenever an attribute of it or of a base is set
// (PyType_Modified), as CPython's own method cache relies on: an entry is
// used only while both the ctx class's and its Function class's tags are the
// ones it was computed under. A class freed and another allocated at its
// address gets a new tag.

bool version_tag_valid(PyTypeObject* type) {
#ifdef Py_TPFLAGS_VALID_VERSION_TAG
  return PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG) &&
      type->tp_version_tag != 0;
#else
  return type->tp_version_tag != 0;
#endif
}

struct BoxedEntry {
  unsigned int ctx_tag;
  PyTypeObject* function_cls;  // alive while the ctx class is (_forward_cls)
  unsigned int function_tag;
  bool boxed;
};

std::unordered_map<PyTypeObject*, BoxedEntry> boxed_cache;

bool lookup_boxed(PyObject* ctx, PyObject** function_cls) {
  THPObjectPtr cls(PyObject_GetAttrString(ctx, "_forward_cls"));
  if (!cls) {
    PyErr_Clear();
    return false;
  }
  THPObjectPtr flag(PyObject_GetAttrString(cls.get(), "boxed_grads_call"));
  if (!flag) {
    PyErr_Clear();
    return false;
  }
  const int truth = PyObject_IsTrue(flag.get());
  if (truth < 0) {
    PyErr_Clear();
  }
  *function_cls = cls.get();  // borrowed: the ctx class holds it
  return truth == 1;
}

bool is_boxed(PyObject* ctx) {
  PyTypeObject* ctx_cls = Py_TYPE(ctx);
  auto it = boxed_cache.find(ctx_cls);
  if (it != boxed_cache.end() && version_tag_valid(ctx_cls) &&
      ctx_cls->tp_version_tag == it->second.ctx_tag &&
      version_tag_valid(it->second.function_cls) &&
      it->second.function_cls->tp_version_tag == it->second.function_tag) {
    return it->second.boxed;
  }
  PyObject* function_cls = nullptr;
  const bool boxed = lookup_boxed(ctx, &function_cls);
  if (function_cls != nullptr && PyType_Check(function_cls) &&
      version_tag_valid(ctx_cls) &&
      version_tag_valid(reinterpret_cast<PyTypeObject*>(function_cls))) {
    if (boxed_cache.size() >= 4096) {
      boxed_cache.clear();  // classes made in a loop: keep the cache small
    }
    auto* fn_type = reinterpret_cast<PyTypeObject*>(function_cls);
    boxed_cache[ctx_cls] = {ctx_cls->tp_version_tag, fn_type,
                            fn_type->tp_version_tag, boxed};
  }
  return boxed;
}

// torch 2.13's PyNode::to_variable_list (a local symbol of libtorch_python,
// so not callable from here): the results of backward as the engine's list,
// with its checks and texts.
variable_list to_variable_list(PyObject* outputs, const THPFunction* fn) {
  const auto& is_variable_input = fn->is_variable_input;
  const auto num_outputs = PyTuple_GET_SIZE(outputs);
  variable_list results;
  results.reserve(static_cast<size_t>(num_outputs));
  for (Py_ssize_t i = 0; i != num_outputs; ++i) {
    PyObject* output = PyTuple_GET_ITEM(outputs, i);
    if (!is_variable_input[static_cast<size_t>(i)]) {
      TORCH_CHECK(output == Py_None, "function ", Py_TYPE(fn)->tp_name,
                  " returned a gradient different than None at position ",
                  i + 1,
                  ", but the corresponding forward input was not a Variable");
      continue;
    }
    if (output == Py_None) {
      results.emplace_back();
    } else {
      TORCH_CHECK(THPVariable_Check(output), "expected Variable or None (got ",
                  Py_TYPE(output)->tp_name, ")");
      results.emplace_back(THPVariable_Unpack(output));
    }
  }
  return results;
}

// torch 2.13's PyNode::apply for a boxed Function.
variable_list apply_boxed(Node* self, PyObject* ctx, variable_list&& inputs) {
  auto* fn = reinterpret_cast<THPFunction*>(ctx);
  at::OptionalDeviceGuard device_guard;
  THPObjectPtr grads(PyList_New(static_cast<Py_ssize_t>(inputs.size())));
  if (!grads) {
    throw python_error();
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    at::Tensor grad = std::move(inputs[i]);  // the engine keeps nothing
    // Materialize as PyNode::apply would (python_function.cpp, to_py_args).
    if (!grad.defined() && fn->materialize_grads &&
        !(self->input_metadata(i).was_default_constructed() &&
          !fn->materialize_non_diff_grads) &&
        i < fn->output_info.size()) {
      pybind11::gil_scoped_release no_gil;
      grad = fn->output_info[i].zeros(device_guard);
    }
    PyObject* item = THPVariable_Wrap(std::move(grad));
    if (item == nullptr) {
      throw python_error();
    }
    PyList_SET_ITEM(grads.get(), static_cast<Py_ssize_t>(i), item);
  }
  inputs.clear();
  THPObjectPtr apply_fn(PyObject_GetAttrString(ctx, "apply_boxed"));
  if (!apply_fn) {
    throw python_error();
  }
  THPObjectPtr args(PyTuple_Pack(1, grads.get()));
  if (!args) {
    throw python_error();
  }
  grads = nullptr;  // the list in args holds the only references now
  THPObjectPtr r(PyObject_CallObject(apply_fn.get(), args.get()));
  args = nullptr;
  if (!r) {
    throw python_error();
  }
  torch::autograd::ensure_tuple(r);
  auto num_outputs = PyTuple_GET_SIZE(r.get());
  const auto num_forward_inputs =
      static_cast<Py_ssize_t>(fn->is_variable_input.size());
  // Returning too many results is ok, but only as long as they're all None.
  if (num_outputs > num_forward_inputs) {
    bool all_none = true;
    for (Py_ssize_t i = num_forward_inputs; i < num_outputs; ++i) {
      all_none &= PyTuple_GET_ITEM(r.get(), i) == Py_None;
    }
    if (all_none) {
      num_outputs = num_forward_inputs;
      r = PyTuple_GetSlice(r.get(), 0, num_forward_inputs);
      if (!r) {
        throw python_error();
      }
    }
  }
  TORCH_CHECK(num_outputs == num_forward_inputs, "function ",
              Py_TYPE(ctx)->tp_name,
              " returned an incorrect number of gradients (expected ",
              num_forward_inputs, ", got ", num_outputs, ")");
  return to_variable_list(r.get(), fn);
}

variable_list boxed_apply(Node* self, variable_list&& inputs) {
  // PyNode::apply takes the GIL first thing; taking it here instead costs no
  // extra round trip (its own acquire then only counts).
  pybind11::gil_scoped_acquire gil;
  PyObject* ctx = static_cast<PyNode*>(self)->obj;
  if (!is_boxed(ctx)) {
    return original_apply(self, std::move(inputs));
  }
  return apply_boxed(self, ctx, std::move(inputs));
}

// Whether `vtable` is PyNode's: its RTTI, one slot before the first virtual
// function, names the type, and its apply slot points into libtorch_python.
// PyNode::apply itself is not an exported symbol. Every address is checked
// to lie in memory the loader mapped readable before it is read: `vtable`
// may come from a file (the verdict's offset), and a wrong one must read as
// "not PyNode's", never crash the process.
bool is_pynode_vtable(void** vtable, size_t slot) {
  const void* libtorch_python = reinterpret_cast<const void*>(&THPVariableClass);
  if (reinterpret_cast<uintptr_t>(vtable) % alignof(void*) != 0 ||
      !readable_loaded(vtable - 1, (slot + 2) * sizeof(void*), libtorch_python)) {
    return false;
  }
  // std::type_info, as the Itanium C++ ABI lays it out: its own vtable
  // pointer, then its name (read here as data, not through name()).
  const auto* type = static_cast<const char* const*>(vtable[-1]);
  if (type == nullptr || reinterpret_cast<uintptr_t>(type) % alignof(void*) != 0 ||
      !readable_loaded(type, 2 * sizeof(void*))) {
    return false;
  }
  static constexpr char kName[] = "N5torch8autograd6PyNodeE";
  const char* name = type[1];
  if (name == nullptr || !readable_loaded(name, 1)) {
    return false;
  }
  if (*name == '*') {  // a name marked local to its library: name() skips it
    ++name;
  }
  Dl_info info;
  return readable_loaded(name, sizeof(kName)) && std::memcmp(name, kName, sizeof(kName)) == 0 &&
      dladdr(vtable[slot], &info) != 0 && info.dli_fname != nullptr &&
      std::strstr(info.dli_fname, "libtorch_python") != nullptr;
}

// Where libtorch_python is loaded in this process.
char* libtorch_python_base() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&THPVariableClass), &info) == 0 ||
      info.dli_fbase == nullptr) {
    throw std::runtime_error("torch_ctxext: libtorch_python is not loaded");
  }
  return static_cast<char*>(info.dli_fbase);
}

[[noreturn]] void no_pynode_vtable() {
  throw std::runtime_error(
      "torch_ctxext: could not find PyNode::apply in the vtable of this "
      "torch build; boxed_grads_call is unavailable");
}

}  // namespace

std::ptrdiff_t pynode_vtable_offset(PyObject* sample_ctx) {
  Node* node = node_of(as_ctx(sample_ctx, "pynode_vtable_offset"));
  if (node == nullptr) {
    throw std::invalid_argument("torch_ctxext: the sample ctx has no node");
  }
  void** vtable = *reinterpret_cast<void***>(node);
  const size_t slot = apply_slot();
  if (vtable[slot] != reinterpret_cast<void*>(&boxed_apply) &&
      !is_pynode_vtable(vtable, slot)) {
    no_pynode_vtable();
  }
  return reinterpret_cast<char*>(vtable) - libtorch_python_base();
}

namespace {

// PyNode's vtable at `vtable_offset` from libtorch_python's load address (or
// its apply slot already routed here), else nullptr. Nothing is read before
// the address is known to lie in libtorch_python's readable segments.
void** pynode_vtable_at(std::ptrdiff_t vtable_offset) {
  char* base = libtorch_python_base();
  // Beyond any library's size: refused before the sum can wrap.
  if (vtable_offset <= 0 || vtable_offset >= (std::ptrdiff_t{1} << 40)) {
    return nullptr;
  }
  void** vtable = reinterpret_cast<void**>(base + vtable_offset);
  const size_t slot = apply_slot();
  if (reinterpret_cast<uintptr_t>(vtable) % alignof(void*) == 0 &&
      readable_loaded(vtable - 1, (slot + 2) * sizeof(void*), base) &&
      vtable[slot] == reinterpret_cast<void*>(&boxed_apply)) {
    return vtable;
  }
  return is_pynode_vtable(vtable, slot) ? vtable : nullptr;
}

}  // namespace

bool is_pynode_vtable_offset(std::ptrdiff_t vtable_offset) {
  return pynode_vtable_at(vtable_offset) != nullptr;
}

void install_boxed_grads_path(std::ptrdiff_t vtable_offset) {
  // The offset comes from the layout verdict of this very libtorch_python
  // (keyed by its build id); still, it is data from a file: bounded first.
  void** vtable = pynode_vtable_at(vtable_offset);
  if (vtable == nullptr) {
    no_pynode_vtable();
  }
  const size_t slot = apply_slot();
  if (vtable[slot] == reinterpret_cast<void*>(&boxed_apply)) {
    return;
  }
  original_apply = reinterpret_cast<ApplyFn>(vtable[slot]);
  write_code_pointer(&vtable[slot], reinterpret_cast<void*>(&boxed_apply));
}

#else  // torch >= 2.13 has boxed_grads_call natively

std::ptrdiff_t pynode_vtable_offset(PyObject*) {
  throw std::logic_error("torch_ctxext: boxed grads are native on this torch");
}

bool is_pynode_vtable_offset(std::ptrdiff_t) {
  throw std::logic_error("torch_ctxext: boxed grads are native on this torch");
}

void install_boxed_grads_path(std::ptrdiff_t) {
  throw std::logic_error("torch_ctxext: boxed grads are native on this torch");
}

#endif

void register_boxed_grads(pybind11::module_& m, pybind11::module_& /*testing*/) {
  // The layout probe (_torch_ctxext_build/layout_check.py) finds PyNode's
  // vtable, the loader checks the offset a verdict records, and the backport
  // (torch_ctxext/_backport/boxed_grads.py) routes apply through it.
  m.def(
      "pynode_vtable_offset",
      [](pybind11::handle ctx) { return pynode_vtable_offset(ctx.ptr()); },
      pybind11::arg("sample_ctx"));
  m.def("is_pynode_vtable_offset", &is_pynode_vtable_offset,
        pybind11::arg("vtable_offset"));
  m.def("install_boxed_grads_path", &install_boxed_grads_path,
        pybind11::arg("vtable_offset"));
}

}  // namespace torch_ctxext
