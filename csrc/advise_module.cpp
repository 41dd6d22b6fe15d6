// torch_ctxext._C on a torch that provides every member of the contract
// natively (torch 2.15): advise()'s C++ watch and the drop-ins' C++ Functions
// (fused_linear.cpp, which reads the engine's buffers through torch's own
// get_current_input_grad_buffers there) alone.
//
// There torch_ctxext patches nothing and `import torch_ctxext` loads no
// library. advise() and FusedLinear alone load this one (torch_ctxext/_ext/advise_module.py),
// under a name of its own, only from a binary made for exactly the running
// torch (a wheel's, or `python -m torch_ctxext build`'s), and never builds it:
// without it advise() watches in Python and FusedLinear runs its Python
// Function, as they always could. It reads nothing by layout
// (advise_watch.cpp and fused_linear.cpp use public headers), installs no
// hook into the engine itself and no fork handler (advise_watch's locks are
// per watch: docs/reliability.md), and claims nothing in torch._C.
// _torch_ctxext_build/sources.py compiles it, with advise_watch.cpp and
// fused_linear.cpp, in place of every other source on such a torch, and never
// elsewhere.
#include "advise_watch.h"
#include "fused_linear.h"

#include <pybind11/pybind11.h>

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_ctxext: advise()'s C++ watch and the drop-ins' C++ Functions, for a torch that "
            "provides the whole ctx contract";
  m.attr("built_for_torch") = TORCH_CTXEXT_BUILT_FOR_TORCH;
  m.attr("built_for_git_version") = TORCH_CTXEXT_BUILT_FOR_GIT;
  m.attr("advise_only") = true;
  torch_ctxext::bind_advise_watch(m);
  pybind11::module_ testing = m.def_submodule("_testing", "What only torch_ctxext's tests call: counters");
  torch_ctxext::register_fused_linear(m, testing);
}
