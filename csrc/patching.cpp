#include "patching.h"

#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace torch_ctxext {

namespace {

// The protection of the mapping that contains `address`, from /proc/self/maps
// (the kernel's own record: mprotect has no getter). -1 when not mapped.
int page_protection(uintptr_t address) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    uintptr_t start = 0, end = 0;
    char perms[5] = {0};
    if (std::sscanf(line.c_str(), "%lx-%lx %4s", &start, &end, perms) != 3) {
      continue;
    }
    if (address < start || address >= end) {
      continue;
    }
    int prot = PROT_NONE;
    prot |= perms[0] == 'r' ? PROT_READ : 0;
    prot |= perms[1] == 'w' ? PROT_WRITE : 0;
    prot |= perms[2] == 'x' ? PROT_EXEC : 0;
    return prot;
  }
  return -1;
}

}  // namespace

void write_code_pointer(void** slot, void* value) {
  const auto address = reinterpret_cast<uintptr_t>(slot);
  const int original = page_protection(address);
  if (original < 0) {
    throw std::runtime_error("torch_ctxext: the address to patch is not mapped");
  }
  if (original & PROT_WRITE) {
    __atomic_store_n(slot, value, __ATOMIC_SEQ_CST);
    return;
  }
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  auto* start = reinterpret_cast<void*>(address & ~(page - 1));
  // A pointer-aligned slot never straddles two pages.
  if (mprotect(start, page, original | PROT_WRITE) != 0) {
    throw std::runtime_error(std::string("torch_ctxext: cannot make the page writable: ") +
                             std::strerror(errno));
  }
  __atomic_store_n(slot, value, __ATOMIC_SEQ_CST);
  if (mprotect(start, page, original) != 0) {
    throw std::runtime_error(std::string("torch_ctxext: cannot restore the page's protection: ") +
                             std::strerror(errno));
  }
}

namespace {

struct GotSearch {
  const std::string* library;
  const std::string* symbol;
  void** slot = nullptr;
  bool found_library = false;
};

// The value of a dynamic-section entry, or 0 when absent. glibc relocates
// the d_ptr entries to absolute addresses in place; other loaders leave them
// relative to the load base: both are handled.
ElfW(Addr) dynamic_entry(const ElfW(Dyn)* dyn, ElfW(Sxword) tag, ElfW(Addr) base) {
  for (; dyn->d_tag != DT_NULL; ++dyn) {
    if (dyn->d_tag == tag) {
      const ElfW(Addr) value = dyn->d_un.d_ptr;
      if (tag == DT_PLTRELSZ) {
        return value;
      }
      return value < base ? value + base : value;
    }
  }
  return 0;
}

int search_object(struct dl_phdr_info* info, size_t, void* data) {
  auto* search = static_cast<GotSearch*>(data);
  if (info->dlpi_name == nullptr ||
      std::strstr(info->dlpi_name, search->library->c_str()) == nullptr) {
    return 0;
  }
  search->found_library = true;
  const ElfW(Dyn)* dynamic = nullptr;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) {
      dynamic = reinterpret_cast<const ElfW(Dyn)*>(info->dlpi_addr +
                                                   info->dlpi_phdr[i].p_vaddr);
    }
  }
  if (dynamic == nullptr) {
    return 1;
  }
  const ElfW(Addr) base = info->dlpi_addr;
  const auto* relocs = reinterpret_cast<const ElfW(Rela)*>(
      dynamic_entry(dynamic, DT_JMPREL, base));
  const auto size = static_cast<size_t>(dynamic_entry(dynamic, DT_PLTRELSZ, base));
  const auto* symbols = reinterpret_cast<const ElfW(Sym)*>(
      dynamic_entry(dynamic, DT_SYMTAB, base));
  const auto* names = reinterpret_cast<const char*>(dynamic_entry(dynamic, DT_STRTAB, base));
  if (relocs == nullptr || size == 0 || symbols == nullptr || names == nullptr) {
    return 1;
  }
  for (size_t i = 0; i < size / sizeof(ElfW(Rela)); ++i) {
#if defined(__x86_64__)
    if (ELF64_R_TYPE(relocs[i].r_info) != R_X86_64_JUMP_SLOT) {
      continue;
    }
#elif defined(__aarch64__)
    if (ELF64_R_TYPE(relocs[i].r_info) != R_AARCH64_JUMP_SLOT) {
      continue;
    }
#else
    return 1;  // an architecture whose PLT relocations we do not know
#endif
    const auto& sym = symbols[ELF64_R_SYM(relocs[i].r_info)];
    if (*search->symbol == names + sym.st_name) {
      search->slot = reinterpret_cast<void**>(base + relocs[i].r_offset);
      return 1;
    }
  }
  return 1;
}

}  // namespace

namespace {

struct ReadableSearch {
  uintptr_t start, end, anchor;
  bool found = false;
};

bool segment_contains(const dl_phdr_info* info, const ElfW(Phdr)& segment,
                      uintptr_t start, uintptr_t end) {
  const uintptr_t low = info->dlpi_addr + segment.p_vaddr;
  return segment.p_type == PT_LOAD && start >= low && end <= low + segment.p_memsz;
}

int search_readable(dl_phdr_info* info, size_t, void* data) {
  auto* search = static_cast<ReadableSearch*>(data);
  if (search->anchor != 0) {
    bool holds_anchor = false;
    for (int i = 0; i < info->dlpi_phnum && !holds_anchor; ++i) {
      holds_anchor = segment_contains(info, info->dlpi_phdr[i], search->anchor, search->anchor + 1);
    }
    if (!holds_anchor) {
      return 0;
    }
  }
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if ((info->dlpi_phdr[i].p_flags & PF_R) &&
        segment_contains(info, info->dlpi_phdr[i], search->start, search->end)) {
      search->found = true;
      return 1;
    }
  }
  return search->anchor != 0 ? 1 : 0;  // the anchor's object does not hold it
}

}  // namespace

bool readable_loaded(const void* start, size_t length, const void* anchor) {
  const auto low = reinterpret_cast<uintptr_t>(start);
  if (low == 0 || length == 0 || low + length < low) {
    return false;
  }
  ReadableSearch search{low, low + length, reinterpret_cast<uintptr_t>(anchor)};
  dl_iterate_phdr(search_readable, &search);
  return search.found;
}

void** find_got_slot(const std::string& library, const std::string& symbol) {
  GotSearch search{&library, &symbol};
  dl_iterate_phdr(search_object, &search);
  return search.slot;
}

bool GotHook::place() {
  std::call_once(attempt_, [this] {
    if (void** slot = find_slot_()) {
      write_code_pointer(slot, replacement_);
      placed_.store(true);
    }
  });
  return placed_.load();
}

}  // namespace torch_ctxext
