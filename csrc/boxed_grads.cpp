// The boxed-grads apply path for torch <= 2.12.
//
// torch 2.13 lets a Function set `boxed_grads_call = True`: the engine then
// moves the grads into one Python list, which holds the only references, so
// a backward that drops an entry frees that gradient at once. On 2.12,
// PyNode::apply wraps the grads into a tuple while the engine's own vector
// keeps them alive until backward returns; nothing in Python can release
// them. We therefore replace PyNode's `apply` vtable slot with a function
// that, for boxed Functions only, moves the grads out of the engine's vector
// into a list, points the ctx's `apply` at `apply_boxed(list)` for this one
// call, and hands the original PyNode::apply tiny placeholders instead (its
// output processing and error messages stay torch's own). Other Functions go
// straight to the original.
#include "boxed_grads.h"

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <typeinfo>
#include <string>
#include <vector>

namespace torch_ctxext {

#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR <= 12

namespace {

using torch::autograd::PyNode;
using torch::autograd::variable_list;
using ApplyFn = variable_list (*)(Node*, variable_list&&);

ApplyFn original_apply = nullptr;
// Python: entry(ctx, grads_list, *placeholders) -> ctx.apply_boxed(grads_list)
PyObject* boxed_entry = nullptr;
PyObject* functools_partial = nullptr;

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

bool is_boxed(PyObject* ctx) {
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
  return truth == 1;
}

// For the duration of one call, ctx.apply (which PyNode::apply looks up on
// the object) is partial(entry, ctx, grads): the engine's call then reaches
// ctx.apply_boxed(grads), as on torch 2.13. A ctx's own instance attribute
// `apply`, if any, is put back afterwards.
class ApplyRedirect {
 public:
  ApplyRedirect(PyObject* ctx, PyObject* grads) : ctx_(ctx) {
    PyObject** dict = _PyObject_GetDictPtr(ctx);
    if (dict != nullptr && *dict != nullptr) {
      PyObject* own = PyDict_GetItemString(*dict, "apply");  // borrowed
      if (own != nullptr) {
        Py_INCREF(own);
        saved_ = own;
      }
    }
    THPObjectPtr redirect(PyObject_CallFunctionObjArgs(
        functools_partial, boxed_entry, ctx, grads, nullptr));
    if (!redirect || PyObject_SetAttrString(ctx, "apply", redirect.get()) < 0) {
      Py_XDECREF(saved_);
      throw python_error();
    }
  }
  ~ApplyRedirect() {
    pybind11::gil_scoped_acquire gil;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (saved_ != nullptr) {
      PyObject_SetAttrString(ctx_, "apply", saved_);
      Py_DECREF(saved_);
    } else {
      PyObject_DelAttrString(ctx_, "apply");
    }
    PyErr_Clear();
    PyErr_Restore(type, value, traceback);
  }

 private:
  PyObject* ctx_;
  PyObject* saved_ = nullptr;
};

variable_list boxed_apply(Node* self, variable_list&& inputs) {
  std::unique_ptr<ApplyRedirect> redirect;
  {
    pybind11::gil_scoped_acquire gil;
    PyObject* ctx = static_cast<PyNode*>(self)->obj;
    if (is_boxed(ctx)) {
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
      redirect = std::make_unique<ApplyRedirect>(ctx, grads.get());
    }
  }
  if (!redirect) {
    return original_apply(self, std::move(inputs));
  }
  // Placeholders keep PyNode::apply from materializing zeros we already made.
  variable_list placeholders(inputs.size(), at::empty({0}));
  return original_apply(self, std::move(placeholders));
}

}  // namespace

void install_boxed_grads_path(PyObject* sample_ctx, PyObject* entry) {
  if (boxed_entry == nullptr) {
    THPObjectPtr functools(PyImport_ImportModule("functools"));
    if (!functools) {
      throw python_error();
    }
    functools_partial = PyObject_GetAttrString(functools.get(), "partial");
    if (functools_partial == nullptr) {
      throw python_error();
    }
    Py_INCREF(entry);
    boxed_entry = entry;
  }
  Node* node = node_of(as_ctx(sample_ctx));
  if (node == nullptr) {
    throw std::invalid_argument("torch_ctxext: the sample ctx has no node");
  }
  void** vtable = *reinterpret_cast<void***>(node);
  const size_t slot = apply_slot();
  if (vtable[slot] == reinterpret_cast<void*>(&boxed_apply)) {
    return;
  }
  // Refuse unless this is PyNode's vtable (its RTTI, one slot before the
  // first virtual function, names the type) and the slot points into
  // libtorch_python. PyNode::apply itself is not an exported symbol.
  const auto* type = reinterpret_cast<const std::type_info*>(vtable[-1]);
  Dl_info info;
  if (type == nullptr ||
      std::strcmp(type->name(), "N5torch8autograd6PyNodeE") != 0 ||
      dladdr(vtable[slot], &info) == 0 || info.dli_fname == nullptr ||
      std::strstr(info.dli_fname, "libtorch_python") == nullptr) {
    throw std::runtime_error(
        "torch_ctxext: could not find PyNode::apply in the vtable of this "
        "torch build; boxed_grads_call is unavailable");
  }
  original_apply = reinterpret_cast<ApplyFn>(vtable[slot]);
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  auto* start = reinterpret_cast<void*>(
      reinterpret_cast<uintptr_t>(&vtable[slot]) & ~(page - 1));
  if (mprotect(start, page, PROT_READ | PROT_WRITE) != 0) {
    throw std::runtime_error("torch_ctxext: cannot patch PyNode's vtable");
  }
  vtable[slot] = reinterpret_cast<void*>(&boxed_apply);
  mprotect(start, page, PROT_READ);
}

#else  // torch >= 2.13 has boxed_grads_call natively

void install_boxed_grads_path(PyObject*, PyObject*) {
  throw std::logic_error("torch_ctxext: boxed grads are native on this torch");
}

#endif

}  // namespace torch_ctxext
