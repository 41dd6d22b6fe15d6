// torch_ctxext._C on a torch that provides every member of the contract
// natively (torch 2.15): advise()'s C++ watch alone.
//
// There torch_ctxext patches nothing and `import torch_ctxext` loads no
// library. advise() alone loads this one (torch_ctxext/_ext/advise_module.py),
// under a name of its own, only from a binary made for exactly the running
// torch (a wheel's, or `python -m torch_ctxext build`'s), and never builds it:
// without it advise() watches in Python, as it always could. It reads nothing
// by layout (advise_watch.cpp uses public headers: ctx_node.h), installs no
// hook into the engine itself and no fork handler (advise_watch's locks are
// per watch: docs/reliability.md), and claims nothing in torch._C.
// _torch_ctxext_build/sources.py compiles it, with advise_watch.cpp, in place of every other
// source on such a torch, and never elsewhere.
#include "advise_watch.h"

#include <pybind11/pybind11.h>

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_ctxext: advise()'s C++ watch, for a torch that provides the whole ctx contract";
  m.attr("built_for_torch") = TORCH_CTXEXT_BUILT_FOR_TORCH;
  m.attr("built_for_git_version") = TORCH_CTXEXT_BUILT_FOR_GIT;
  m.attr("advise_only") = true;
  torch_ctxext::bind_advise_watch(m);
}
