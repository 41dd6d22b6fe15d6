// Writing a code pointer into memory the dynamic loader made read-only.
//
// Two engine hooks replace one function pointer each: PyNode's `apply` vtable
// slot (the boxed-grads path on torch 2.12) and libtorch_cpu's GOT entry for
// InputBuffer::add (validation of producers that reach an exposed buffer
// later). Both live on pages the loader may have made read-only (vtables,
// RELRO), so the page is made writable for the one store and then gets back
// exactly the protection it had, read from /proc/self/maps.
//
// No torch header here: this translation unit builds in a second.
#pragma once

#include <cstddef>
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

}  // namespace torch_ctxext
