#include "output_grad_dtype.h"

#include <stdexcept>
#include <string>

namespace torch_ctxext {

std::vector<bool> differentiable_outputs(PyObject* ctx_obj) {
  THPFunction* ctx = as_ctx(ctx_obj, "differentiable_outputs");
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
  THPFunction* ctx = as_ctx(ctx_obj, "set_output_grad_dtype");
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

namespace {

// Per thread: how many Function.apply calls are running, and how many
// declarations were made so far. Plain C thread-locals: the wrapper below
// runs on every Function.apply, and a Python-level wrapper alone would cost
// several percent of a small Function's forward+backward.
thread_local int apply_depth = 0;
thread_local uint64_t declarations = 0;
PyObject* original_apply = nullptr;  // Function.apply's function, unbound
PyObject* resolve = nullptr;  // resolve(depth, output, ok) in Python

// Function.apply(cls, *args, **kwargs), as a classmethod: the original, then,
// only if a declaration was made meanwhile, resolve() for this depth.
PyObject* apply_with_declarations(PyObject* /*module*/, PyObject* const* args,
                                  size_t nargsf, PyObject* kwnames) {
  const int depth = ++apply_depth;
  const uint64_t before = declarations;
  PyObject* output = PyObject_Vectorcall(original_apply, args, nargsf, kwnames);
  --apply_depth;
  if (declarations == before) {
    return output;
  }
  if (output == nullptr) {  // drop this depth's declarations, keep the error
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject* r = PyObject_CallFunction(resolve, "iOO", depth, Py_None, Py_False);
    Py_XDECREF(r);
    PyErr_Clear();
    PyErr_Restore(type, value, traceback);
    return nullptr;
  }
  PyObject* r = PyObject_CallFunction(resolve, "iOO", depth, output, Py_True);
  if (r == nullptr) {
    Py_DECREF(output);
    return nullptr;
  }
  Py_DECREF(r);
  return output;
}

PyMethodDef apply_def = {
    "apply", reinterpret_cast<PyCFunction>(
                 reinterpret_cast<void (*)(void)>(apply_with_declarations)),
    METH_FASTCALL | METH_KEYWORDS, nullptr};

}  // namespace

PyObject* make_apply(PyObject* original, PyObject* resolver) {
  Py_XDECREF(original_apply);
  Py_XDECREF(resolve);
  Py_INCREF(original);
  Py_INCREF(resolver);
  original_apply = original;
  resolve = resolver;
  return PyCFunction_New(&apply_def, nullptr);
}

int current_apply_depth() {
  return apply_depth;
}

void note_declaration() {
  ++declarations;
}

}  // namespace torch_ctxext
