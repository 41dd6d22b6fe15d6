// Writing a code pointer into memory the dynamic loader made read-only.
//
// Three engine hooks replace one function pointer each: PyNode's `apply`
// vtable slot (the boxed-grads path on torch 2.12), and two of libtorch_cpu's
// GOT entries (GotHook, below): InputBuffer::add's (validation of producers
// that reach an exposed buffer later) and validate_outputs' (gradients left
// uncast by set_output_grad_dtype(None) on torch 2.9 and older). All three
// live on pages the loader may have made read-only (vtables, RELRO), so the
// page is made writable for the one store and then gets back exactly the
// protection it had, read from /proc/self/maps.
//
// No torch header here: nothing in it depends on how torch is laid out.
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>
#include <string>

namespace torch_ctxext {

// Store `value` at `*slot`, keeping the page's protection as it was.
// Throws std::runtime_error (saying why) when the page cannot be written.
void write_code_pointer(void** slot, void* value);

// The address of the GOT entry through which the shared library whose path
// contains `library` calls the function `symbol` (its PLT relocation), or
// nullptr when that library makes no such call through its GOT (a direct or
// an inlined call cannot be hooked this way).
void** find_got_slot(const std::string& library, const std::string& symbol);

// Whether [start, start + length) lies inside one readable segment (a
// PT_LOAD with PF_R, as the dynamic loader mapped it) of a loaded shared
// object; with `anchor`, of the object that contains `anchor`. Reads only
// the loader's own program headers: an address from a file (a layout
// verdict) is checked with it before anything is read through it.
bool readable_loaded(const void* start, size_t length, const void* anchor = nullptr);

// An engine hook on a GOT entry: the entry through which a library of torch
// calls one function, routed to a function of this library instead (the
// validation of later producers on InputBuffer::add, set_output_grad_dtype's
// wrapper of validate_outputs). Placed by the first place(), once per
// process, when a feature first needs it: a process that never needs it pays
// nothing. Concurrent callers wait for that first one; one that threw (the
// page could not be written) leaves the next call to try again.
class GotHook {
 public:
  // `find_slot`: the GOT entry to route, or nullptr where the library makes
  // no call to the function through its GOT (a direct or an inlined call),
  // and the hook is never placed. Called by the first place() only.
  GotHook(void** (*find_slot)(), void* replacement)
      : find_slot_(find_slot), replacement_(replacement) {}
  GotHook(const GotHook&) = delete;
  GotHook& operator=(const GotHook&) = delete;

  // Route the entry to the replacement, the first time; whether it is routed.
  bool place();
  bool placed() const {
    return placed_.load();
  }

 private:
  void** (*const find_slot_)();
  void* const replacement_;
  std::once_flag attempt_;
  std::atomic<bool> placed_{false};
};

}  // namespace torch_ctxext
