// Process-global locks that the autograd engine takes without the GIL, made
// safe across fork().
//
// fork() copies only the calling thread into the child, and every mutex in
// whatever state it is in at that moment: one that another thread holds
// stays held forever in the child, whose first attempt to take it never
// returns. Python forks (os.fork: multiprocessing's fork start method,
// DataLoader workers) with the GIL held, so a lock only ever taken under the
// GIL cannot be held by another thread across that fork. The locks here are
// taken by engine threads without the GIL (engine hooks on validate_outputs
// and InputBuffer::add), so nothing orders them against a fork: a thread
// training while the main thread starts a worker could leave one locked in
// the worker, and the worker's first backward() would then hang.
//
// Each ForkSafeMutex is therefore covered by pthread_atfork handlers, as
// torch's engine covers its own thread pool: before fork() the forking
// thread takes every such lock (it waits for an engine thread inside to
// leave: the regions they guard are short, and make no call that needs the
// GIL or another of these locks), the parent releases them after, and the
// child, alone in its process, gets them unlocked. What they guard is
// therefore never copied half-modified.
//
// No region holds two of these locks at once; the handlers take them in
// construction order.
//
// Each copy of this library in a process (a second path, a package that
// vendors torch_ctxext under another name) has its own list: the extension
// is compiled with hidden visibility (_torch_ctxext_build/sources.py), so the
// inline variables below are this library's, not STB_GNU_UNIQUE symbols the
// dynamic linker would merge across copies. A copy refused at load
// (module.cpp, PyInit__C) constructs its locks into its own list, registers
// no handler and changes nothing in the process: the handlers are
// registered by the module's initialisation, which only the copy that
// claims the engine hooks runs (install_fork_handlers).
#pragma once

#include <Python.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace torch_ctxext {

class ForkSafeMutex;

namespace fork_safety {

// Every ForkSafeMutex of this library, in construction order. They are
// namespace-scope objects constructed while the library loads, before any
// thread can reach them, and live until the process ends; the array is
// written only then. A lock past kMaxMutexes is not listed (a constructor
// must not throw: the process would abort while loading the library) and
// the module's initialisation refuses the import instead.
constexpr int kMaxMutexes = 8;
inline ForkSafeMutex* mutexes[kMaxMutexes] = {};
inline int count = 0;
inline bool overflowed = false;
inline bool handlers_installed = false;  // by install_fork_handlers, under the GIL

// A test-only hook (test/hardening/test_hardening_fork.py): the next acquisition of
// `park_target` made without the GIL holds the lock for up to park_ms, or
// until released, so that a test can fork while an engine thread is inside
// the locked region, deterministically. One relaxed load per lock otherwise.
inline std::atomic<ForkSafeMutex*> park_target{nullptr};
inline std::atomic<int> park_ms{0};
inline std::atomic<bool> parked{false};
inline std::atomic<bool> park_released{false};

inline void prepare();
inline void parent();
inline void child();

}  // namespace fork_safety

class ForkSafeMutex {
 public:
  explicit ForkSafeMutex(const char* name) : name_(name) {
    using namespace fork_safety;
    if (count == kMaxMutexes) {
      overflowed = true;  // install_fork_handlers() refuses the import
      return;
    }
    mutexes[count++] = this;
  }
  ForkSafeMutex(const ForkSafeMutex&) = delete;
  ForkSafeMutex& operator=(const ForkSafeMutex&) = delete;

  void lock() {
    mutex_.lock();
    if (fork_safety::park_target.load(std::memory_order_relaxed) == this) {
      park_for_test();
    }
  }
  void unlock() {
    mutex_.unlock();
  }
  const char* name() const {
    return name_;
  }

 private:
  friend void fork_safety::prepare();
  friend void fork_safety::parent();
  friend void fork_safety::child();

  void park_for_test() {
    using namespace fork_safety;
    // Only an acquisition without the GIL: the path a fork can freeze (a
    // fork from Python waits for the GIL, hence for any holder that has it).
    ForkSafeMutex* expected = this;
    if (PyGILState_Check() ||
        !park_target.compare_exchange_strong(expected, nullptr)) {
      return;
    }
    parked.store(true);
    const auto deadline = std::chrono::steady_clock::now() +
        std::chrono::milliseconds(park_ms.load());
    while (!park_released.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    parked.store(false);
  }

  const char* name_;
  std::mutex mutex_;
};

namespace fork_safety {

inline void prepare() {
  for (int i = 0; i < count; ++i) {
    mutexes[i]->mutex_.lock();
  }
}

inline void parent() {
  for (int i = count - 1; i >= 0; --i) {
    mutexes[i]->mutex_.unlock();
  }
}

inline void child() {
  // The child's one thread holds them all (taken in prepare()), under the
  // parent's thread id: start each afresh rather than unlock it.
  for (int i = 0; i < count; ++i) {
    new (&mutexes[i]->mutex_) std::mutex();
  }
  park_target.store(nullptr);
  parked.store(false);
}

// Cover this library's locks with the handlers above. Called once by the
// module's initialisation, after it claimed the engine hooks (under the
// GIL, before any hook that takes a lock is placed); throws, and the import
// fails, if a lock could not be listed or the handlers not registered.
inline void install_fork_handlers() {
  if (overflowed) {
    throw std::logic_error(
        "torch_ctxext: more fork-safe locks than fork_safety::kMaxMutexes "
        "(csrc/fork_safety.h): raise it");
  }
  if (handlers_installed || count == 0) {
    return;
  }
  const int error = pthread_atfork(&prepare, &parent, &child);
  if (error != 0) {
    throw std::runtime_error(
        std::string("torch_ctxext: pthread_atfork failed: ") + std::strerror(error));
  }
  handlers_installed = true;
}

// The names of the locks so covered (for tests and `info`).
inline std::vector<std::string> names() {
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i) {
    out.emplace_back(mutexes[i]->name());
  }
  return out;
}

// Arm the test hook on the lock named `name`; throws std::invalid_argument
// when there is none.
inline void park_next(const std::string& name, int milliseconds) {
  for (int i = 0; i < count; ++i) {
    if (name == mutexes[i]->name()) {
      park_ms.store(milliseconds);
      park_released.store(false);
      park_target.store(mutexes[i]);
      return;
    }
  }
  throw std::invalid_argument("torch_ctxext: no fork-safe lock named " + name);
}

// Whether an acquisition is parked now; end the parking (and disarm).
inline bool is_parked() {
  return parked.load();
}
inline void release_parked() {
  park_target.store(nullptr);
  park_released.store(true);
}

}  // namespace fork_safety

}  // namespace torch_ctxext
