#include "direct_accumulation.h"

#include "fork_safety.h"
#include "patching.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace torch_ctxext {

std::optional<Refusal> direct_accumulation_refusal(
    const InputBuffer& buffer, size_t pos, const c10::Device& device,
    const std::optional<c10::Stream>& producer,
    const std::optional<c10::Stream>& consumer,
    std::thread::id exposing_thread) {
  Refusal refusal{};
  const auto buffer_device = buffer.buffer[pos].device();
  if (buffer_device != device) {
    refusal.kind = Refusal::Kind::kDevice;
    refusal.buffer_device = buffer_device;
    refusal.gradient_device = device;
    return refusal;
  }
  const auto this_thread = std::this_thread::get_id();
  if (this_thread != exposing_thread) {
    refusal.kind = Refusal::Kind::kThread;
    refusal.exposing_thread = exposing_thread;
    refusal.accessing_thread = this_thread;
    return refusal;
  }
  // The stream kinds report the producer and consumer streams they saw.
  refusal.producer = producer;
  refusal.consumer = consumer;
  if (is_accelerator(device.type())) {
    const auto accumulation = accumulation_stream(buffer, pos);
    const auto ready = ready_stream(buffer, pos);
    if (!accumulation || !ready) {
      // The engine records both for every accelerator slot it filled (from
      // torch 2.8; callers never expose an accelerator slot before).
      refusal.kind = Refusal::Kind::kSlotStreamsUnrecorded;
      return refusal;
    }
    if (!producer || !consumer) {
      refusal.kind = Refusal::Kind::kStreamsAbsent;
      return refusal;
    }
    if (!(*producer == *consumer && *producer == *accumulation &&
          *producer == *ready)) {
      refusal.kind = Refusal::Kind::kStream;
      refusal.accumulation = accumulation;
      refusal.ready = ready;
      return refusal;
    }
  } else if (producer || consumer) {
    refusal.kind = Refusal::Kind::kStreamsPresent;
    return refusal;
  }
  return std::nullopt;
}

std::string refusal_message(const Refusal& r) {
  std::ostringstream msg;
  switch (r.kind) {
    case Refusal::Kind::kDevice:
      msg << "Direct InputBuffer accumulation requires the buffer and gradient "
             "to be on the same device, but the buffer is on "
          << r.buffer_device << " and the gradient is on " << r.gradient_device;
      break;
    case Refusal::Kind::kThread:
      msg << "Direct InputBuffer accumulation requires the same autograd "
             "engine thread, but the buffer was exposed on thread "
          << r.exposing_thread << " and is now being accessed on thread "
          << r.accessing_thread;
      break;
    case Refusal::Kind::kSlotStreamsUnrecorded:
      msg << "torch_ctxext: the engine recorded no accumulation or ready "
             "stream for this accelerator buffer, so direct accumulation into "
             "it cannot be validated";
      break;
    case Refusal::Kind::kStreamsAbsent:
      msg << "Direct InputBuffer accumulation for an accelerator buffer "
             "requires producer and consumer streams, but got producer stream "
             "present: "
          << r.producer.has_value()
          << " and consumer stream present: " << r.consumer.has_value();
      break;
    case Refusal::Kind::kStream:
      msg << "Direct InputBuffer accumulation requires the same stream, but "
             "got producer "
          << *r.producer << ", consumer " << *r.consumer << ", accumulation "
          << *r.accumulation << ", and ready " << *r.ready;
      break;
    case Refusal::Kind::kStreamsPresent:
      msg << "Direct InputBuffer accumulation for a non-accelerator buffer "
             "requires producer and consumer streams to be absent, but got "
             "producer stream present: "
          << r.producer.has_value()
          << " and consumer stream present: " << r.consumer.has_value();
      break;
  }
  return msg.str();
}

void validate_direct_accumulation(const InputBuffer& buffer, size_t pos,
                                  const c10::Device& device,
                                  const std::optional<c10::Stream>& producer,
                                  const std::optional<c10::Stream>& consumer,
                                  std::thread::id exposing_thread) {
  if (auto refusal = direct_accumulation_refusal(
          buffer, pos, device, producer, consumer, exposing_thread)) {
    throw std::runtime_error(refusal_message(*refusal));
  }
}

bool direct_accumulation_checkable(const c10::Device& device) {
  return slots_record_streams() || !is_accelerator(device.type());
}

std::optional<c10::Stream> consumer_stream(const InputBuffer& buffer,
                                           Node* consumer) {
#if TORCH_CTXEXT_NO_STALE_CAPTURE_OVERRIDE
  (void)buffer;  // no stale-capture override before torch 2.13
  return consumer->stream();
#else
  if (buffer.opt_overridden_consumer_stream.has_value()) {
    return buffer.opt_overridden_consumer_stream;
  }
  return consumer->stream();
#endif
}

// --- state: exposed slots and nodes, per graph task ---------------------------

namespace {

// Records are keyed by raw addresses and hold their graph task weakly: they
// die with the task they belong to, and a new task at a freed task's address
// is not mistaken for it. A consumer node is unique among a task's nodes
// while the task runs (nodes created during backward are never run by it).
struct Key {
  const GraphTask* task;
  const Node* node;
  size_t pos;  // the consumer's input slot; 0 for marks

  bool operator==(const Key& other) const {
    return task == other.task && node == other.node && pos == other.pos;
  }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    const auto h = std::hash<const void*>{};
    return h(k.task) ^ (h(k.node) * 31) ^ (k.pos * 1000003);
  }
};

template <typename Value>
struct Records {
  struct Entry {
    std::weak_ptr<GraphTask> task;
    Value value;
  };
  std::unordered_map<Key, Entry, KeyHash> entries;
  size_t pruned_at = 0;

  const Value* find(const Key& key) const {
    auto it = entries.find(key);
    return it == entries.end() || it->second.task.expired() ? nullptr
                                                             : &it->second.value;
  }

  void add(GraphTask* task, const Key& key, Value value) {
    // Dropping the records of ended tasks each time the map has doubled
    // keeps every operation amortized O(1).
    if (entries.size() >= 2 * pruned_at + 16) {
      for (auto it = entries.begin(); it != entries.end();) {
        it = it->second.task.expired() ? entries.erase(it) : std::next(it);
      }
      pruned_at = entries.size();
    }
    entries.insert_or_assign(key, Entry{task->weak_from_this(), value});
  }
};

// Taken by the engine hook without the GIL: fork-safe (fork_safety.h).
ForkSafeMutex registry_mutex{"direct_accumulation"};
Records<std::thread::id> slots;  // exposed slots: the thread that exposed them
Records<bool> marks;              // nodes that handed out a buffer, per task
// How many slot records exist: the engine hook and exposures take the
// registry's mutex for slots only while there are any.
std::atomic<size_t> recorded_slots{0};

// --- the engine hook on InputBuffer::add ----------------------------------------

std::atomic<uint64_t> validated_count{0};

#if !TORCH_CTXEXT_ADD_WITHOUT_CONSUMER_NODE
// InputBuffer::add(size_t, Variable&&, const optional<Stream>& producer,
// const optional<Stream>& consumer, Node* consumer_node), the symbol the
// engine (libtorch_cpu) calls through its PLT from torch 2.10 on (no
// std::string in it: one spelling for both C++ ABIs).
constexpr const char* kAddSymbol =
    "_ZN5torch8autograd11InputBuffer3addEmON2at6TensorERKSt8optionalIN3c106StreamEESA_PNS0_4NodeE";

void add_with_validation(InputBuffer* self, size_t pos, at::Tensor&& var,
                         const std::optional<c10::Stream>& producer,
                         const std::optional<c10::Stream>& consumer,
                         Node* consumer_node) {
  if (recorded_slots.load(std::memory_order_acquire) != 0 && var.defined()) {
    // The engine adds with the producer's task installed on this thread.
    if (GraphTask* task = current_graph_task_unchecked()) {
      std::optional<std::thread::id> thread;
      {
        std::lock_guard<ForkSafeMutex> lock(registry_mutex);
        if (const auto* found = slots.find({task, consumer_node, pos})) {
          thread = *found;
        }
      }
      if (thread.has_value()) {
        validated_count.fetch_add(1, std::memory_order_relaxed);
        validate_direct_accumulation(*self, pos, var.device(), producer,
                                     consumer, *thread);
      }
    }
  }
  // Through this library's own PLT entry: the real InputBuffer::add.
  self->add(pos, std::move(var), producer, consumer, consumer_node);
}

GotHook producer_hook{[] { return find_got_slot("libtorch_cpu", kAddSymbol); },
                      reinterpret_cast<void*>(&add_with_validation)};

bool hook_placed() {
  return producer_hook.placed();
}

// Whether the hook is placed after this call; when it cannot be (libtorch_cpu
// makes no call to InputBuffer::add through its GOT), later_producers_validated()
// stays false: see there.
bool try_place_hook() {
  return producer_hook.place();
}
#else
// No consumer node to key the slot records by (engine_layout.h): no hook,
// and later_producers_validated() stays false where the hook is needed.
bool hook_placed() {
  return false;
}
bool try_place_hook() {
  return false;
}
#endif

// Whether the engine can run a graph task's nodes on more than one thread:
// it starts a thread per device of every registered non-CPU device type
// (Engine::start_device_threads). Without such threads every node of a task
// runs on the task's CPU thread, with no streams.
bool engine_may_use_device_threads() {
  for (size_t i = 0; i < c10::impl::device_guard_impl_registry.size(); ++i) {
    const auto type = static_cast<c10::DeviceType>(i);
    if (type == c10::DeviceType::CPU || type == c10::DeviceType::Meta) {
      continue;
    }
    const auto* impl = c10::impl::device_guard_impl_registry[i].load();
    if (impl != nullptr && impl->deviceCount() > 0) {
      return true;
    }
  }
  return false;
}

std::string hook_policy() {
  const char* value = std::getenv("TORCH_CTXEXT_VALIDATE_LATER_PRODUCERS");
  return value == nullptr ? "auto" : value;
}

// The process decides once: whether later producers need validating.
bool needs_hook() {
  static const bool needed = hook_policy() == "always" ||
      (hook_policy() != "never" && engine_may_use_device_threads());
  return needed;
}

}  // namespace

std::optional<std::thread::id> exposing_thread(const GraphTask* task,
                                               const Node* consumer,
                                               size_t pos) {
  if (recorded_slots.load(std::memory_order_acquire) == 0) {
    return std::nullopt;
  }
  std::lock_guard<ForkSafeMutex> lock(registry_mutex);
  const auto* found = slots.find({task, consumer, pos});
  return found ? std::optional<std::thread::id>(*found) : std::nullopt;
}

void record_exposure(GraphTask* task, const Node* consumer, size_t pos) {
  // Only where a slot can be reached from another engine thread: without
  // device threads every exposure and every producer of a task run on the
  // task's one thread, and the record could never fail a check.
  if (!needs_hook() && !hook_placed()) {
    return;
  }
  std::lock_guard<ForkSafeMutex> lock(registry_mutex);
  if (slots.find({task, consumer, pos}) == nullptr) {
    slots.add(task, {task, consumer, pos}, std::this_thread::get_id());
  }
  recorded_slots.store(slots.entries.size(), std::memory_order_release);
}

bool later_producers_validated() {
  return !needs_hook() || try_place_hook();
}

namespace {
// The mark this thread made last: a backward that reads the property in a
// loop marks the same (task, node) each time, and a mark lives as long as
// its task (records are dropped only once their task has ended). The task's
// 64-bit id tells a task apart from an earlier one at the same address.
struct LastMark {
  const GraphTask* task = nullptr;
  uint64_t id = 0;
  const Node* node = nullptr;
};
thread_local LastMark last_mark;
}  // namespace

void mark_exposed(GraphTask* task, const Node* node) {
  if (last_mark.task == task && last_mark.node == node &&
      last_mark.id == task_id(task)) {
    return;  // already marked in this task
  }
  {
    std::lock_guard<ForkSafeMutex> lock(registry_mutex);
    marks.add(task, {task, node, 0}, true);
  }
  last_mark = {task, task_id(task), node};
}

bool exposed_in(const GraphTask* task, const Node* node) {
  std::lock_guard<ForkSafeMutex> lock(registry_mutex);
  return marks.find({task, node, 0}) != nullptr;
}

uint64_t validated_later_producers() {
  return validated_count.load();
}

bool producer_hook_placed() {
  return hook_placed();
}

void place_producer_hook() {
#if TORCH_CTXEXT_ADD_WITHOUT_CONSUMER_NODE
  throw std::runtime_error(
      "torch_ctxext: InputBuffer::add takes no consumer node before torch "
      "2.10; later producers cannot be validated on this torch");
#else
  if (!try_place_hook()) {
    throw std::runtime_error(
        "torch_ctxext: libtorch_cpu makes no call to InputBuffer::add through "
        "its GOT on this build; later producers cannot be validated");
  }
#endif
}

void register_direct_accumulation(pybind11::module_& /*m*/, pybind11::module_& testing) {
  // The engine hook that validates later producers: how many it validated,
  // whether it is placed, and placing it where nothing needs it (no
  // accelerator), so that its validation can be tested there.
  testing.def("validated_later_producers", &validated_later_producers);
  testing.def("producer_hook_placed", &producer_hook_placed);
  testing.def("place_producer_hook", &place_producer_hook);
}

}  // namespace torch_ctxext
