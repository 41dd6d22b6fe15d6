// What advise() watches of one backward, without Python in the engine.
//
// advise() (torch_ctxext/_advise/graph.py) needs, for every slot of a backward
// into which two or more producers return a gradient: what each producer
// returned (nothing, a gradient of some bytes, or a write into the exposed
// buffer) and whether the engine summed out of place. In Python that takes a
// walk over every node (a Python object per node and per edge) and a Python
// hook on every producer and consumer, which torch calls with every gradient
// wrapped as a Python tensor, under the GIL, and whose wrappers torch then
// keeps alive until the engine frees the gradients (about 5 us a hook, and
// up to 1.15 times the step of an unrolled LSTMCell). Here the walk runs over
// the C++ graph and the hooks are C++ ones that record sizes and addresses
// under a mutex of their own: Python sees only the slots, and what reached
// them when the backward is over, as the named tuples of graph.py (Found,
// Producer, Outcome, Arrival) whose types and kinds it hands over by name.
#pragma once

#include <Python.h>

#include <pybind11/pybind11.h>

namespace torch_ctxext {

// Binds torch_ctxext._C.advise_watch and its AdviseWatch (module.cpp).
void bind_advise_watch(pybind11::module_& m);

}  // namespace torch_ctxext
