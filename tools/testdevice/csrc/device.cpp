// The device runtime of torch_ctxext's test device: device guard, streams,
// events, allocator and the PrivateUse1 hooks, plus the small Python module
// (_C) that the package's stream and device functions call.
//
// What the autograd engine needs of an accelerator, and where it gets it:
//   * a thread per device: Engine::start_device_threads counts the devices of
//     every registered DeviceGuardImplInterface (deviceCount());
//   * a stream per node and per InputBuffer slot: InputMetadata records the
//     current stream of its device (getStream()) when the forward runs, and
//     the engine guards onto it (exchangeStream()) for the backward;
//   * synchronization between streams: InputBuffer::add and the end of a
//     graph task record an event on one stream and block another on it
//     (record(), block(), queryEvent());
//   * the caller's streams, saved per device (GraphTask::stash_current_streams
//     asks the PrivateUse1 hooks whether the device has a primary context).
// Work runs synchronously on the calling thread, so every event is complete
// once recorded; the counters below let tests see that the engine made the
// calls.
#include "device.h"

#include <Python.h>

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>

namespace torch_ctxext_testdevice {
namespace {

constexpr auto kType = c10::DeviceType::PrivateUse1;

// What the device and the engine did, for tests.
struct Counters {
  std::atomic<int64_t> live_allocations{0};
  std::atomic<int64_t> live_bytes{0};
  std::atomic<int64_t> events_recorded{0};
  std::atomic<int64_t> events_blocked{0};
  std::atomic<int64_t> stream_exchanges{0};
  // Calls of the guard's deviceCount(): the device query, as
  // cudaGetDeviceCount is CUDA's (the engine's start makes one).
  std::atomic<int64_t> device_count_queries{0};
};
Counters counters;

// The current device and each device's current stream are per thread, as on
// CUDA: a stream set on one thread is not current on another.
thread_local c10::DeviceIndex current_index = 0;
thread_local std::array<c10::StreamId, kDeviceCount> current_streams{};

// New streams come from a pool of the non-default streams, in turn.
std::atomic<uint64_t> next_pool_stream{0};

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < kDeviceCount, "testdevice: no device ",
              static_cast<int>(index), ": the test device has ",
              static_cast<int>(kDeviceCount), " devices, testdevice:0 to testdevice:",
              static_cast<int>(kDeviceCount - 1));
}

c10::DeviceIndex index_of(c10::Device device) {
  TORCH_CHECK(device.type() == kType, "testdevice: expected a testdevice device, got ",
              device);
  return device.has_index() ? device.index() : current_index;
}

void check_stream(const c10::Stream& stream) {
  check_index(index_of(stream.device()));
  TORCH_CHECK(stream.id() >= 0 && stream.id() < kStreamsPerDevice,
              "testdevice: no stream ", stream.id(), " on ", stream.device(),
              ": each device has streams 0 (the default) to ", kStreamsPerDevice - 1);
}

c10::DeviceIndex safe_index(c10::Device device) noexcept {
  const auto index = device.has_index() ? device.index() : current_index;
  return index >= 0 && index < kDeviceCount ? index : 0;
}

c10::Stream make_stream(c10::DeviceIndex index, c10::StreamId id) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, index), id);
}

c10::Stream pool_stream(c10::Device device) {
  const auto index = index_of(device);
  check_index(index);
  const auto id = 1 + static_cast<c10::StreamId>(next_pool_stream++ % (kStreamsPerDevice - 1));
  return make_stream(index, id);
}

// An event remembers the stream it was last recorded on.
struct Event {
  c10::Stream stream;
};

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }

  c10::Device exchangeDevice(c10::Device device) const override {
    const auto previous = getDevice();
    setDevice(device);
    return previous;
  }
  c10::Device getDevice() const override { return c10::Device(kType, current_index); }
  void setDevice(c10::Device device) const override {
    const auto index = index_of(device);
    check_index(index);
    current_index = index;
  }
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0 && device.index() < kDeviceCount) {
      current_index = device.index();
    }
  }

  // noexcept: torch 2.6 declares getStream and exchangeStream so (a stricter
  // specification overrides the later, throwing declarations too), so these
  // two never throw: an index out of range reads as device 0.
  c10::Stream getStream(c10::Device device) const noexcept override {
    const auto index = safe_index(device);
    return make_stream(index, current_streams[index]);
  }
  c10::Stream getDefaultStream(c10::Device device) const override {
    const auto index = index_of(device);
    check_index(index);
    return make_stream(index, 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device device, bool /*high priority*/) const override {
    return pool_stream(device);
  }
  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    return pool_stream(device);
  }
  c10::Stream exchangeStream(c10::Stream stream) const noexcept override {
    const auto index = safe_index(stream.device());
    const auto previous = make_stream(index, current_streams[index]);
    if (stream.id() >= 0 && stream.id() < kStreamsPerDevice) {
      current_streams[index] = stream.id();
    }
    counters.stream_exchanges++;
    return previous;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    counters.device_count_queries++;
    return kDeviceCount;
  }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag /*flag*/) const override {
    check_stream(stream);
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(),
                "testdevice: an event of device ", static_cast<int>(device_index),
                " cannot be recorded on ", stream);
    if (*event == nullptr) {
      *event = new Event{stream};
    } else {
      static_cast<Event*>(*event)->stream = stream;
    }
    counters.events_recorded++;
  }
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) {
      return;  // an event never recorded: nothing to wait for (as on CUDA)
    }
    check_stream(stream);
    counters.events_blocked++;
  }
  bool queryEvent(void* /*event*/) const override { return true; }
  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    delete static_cast<Event*>(event);
  }
  // Work is synchronous: every stream, event and device is always idle.
  bool queryStream(const c10::Stream& stream) const override {
    check_stream(stream);
    return true;
  }
  void synchronizeStream(const c10::Stream& stream) const override { check_stream(stream); }
  void synchronizeEvent(void* /*event*/) const override {}
  void recordDataPtrOnStream(const c10::DataPtr& /*data_ptr*/,
                             const c10::Stream& stream) const override {
    check_stream(stream);
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// Host memory, with the size kept in front of the block so the deleter can
// account for it.
constexpr size_t kHeader = 64;  // keeps the data 64-byte aligned

void release(void* data) {
  if (data == nullptr) {
    return;
  }
  auto* base = static_cast<char*>(data) - kHeader;
  size_t size = 0;
  std::memcpy(&size, base, sizeof(size));
  counters.live_allocations--;
  counters.live_bytes -= static_cast<int64_t>(size);
  std::free(base);
}

struct HostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t size) override {
    const auto device = c10::Device(kType, current_index);
    if (size == 0) {
      return {nullptr, nullptr, &release, device};
    }
    const size_t total = (kHeader + size + kHeader - 1) / kHeader * kHeader;
    auto* base = static_cast<char*>(std::aligned_alloc(kHeader, total));
    TORCH_CHECK(base != nullptr, "testdevice: out of memory allocating ", size, " bytes");
    std::memcpy(base, &size, sizeof(size));
    void* data = base + kHeader;
    std::memset(data, 0xFF, size);
    counters.live_allocations++;
    counters.live_bytes += static_cast<int64_t>(size);
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

HostAllocator host_allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &host_allocator);

struct Hooks final : at::PrivateUse1HooksInterface {
  bool hasPrimaryContext(c10::DeviceIndex index) const override {
    return index >= 0 && index < kDeviceCount;
  }
  // Not virtual on every release: no `override` (where they are virtual,
  // these still override them).
  bool isBuilt() const { return true; }
  bool isAvailable() const { return true; }
};

const bool hooks_registered [[maybe_unused]] = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

// --- the Python module: the package's device and stream functions ----------

PyObject* py_current_device(PyObject*, PyObject*) {
  return PyLong_FromLong(current_index);
}

// The device index `arg` names, or false with a Python error set: arg is no
// int, or names no device (ValueError; with `say_count`, it tells how many
// devices there are).
bool parse_device_index(PyObject* arg, long* index, bool say_count) {
  *index = PyLong_AsLong(arg);
  if (*index == -1 && PyErr_Occurred()) {
    return false;
  }
  if (*index >= 0 && *index < kDeviceCount) {
    return true;
  }
  if (say_count) {
    PyErr_Format(PyExc_ValueError, "testdevice: no device %ld: the test device has %d devices",
                 *index, static_cast<int>(kDeviceCount));
  } else {
    PyErr_Format(PyExc_ValueError, "testdevice: no device %ld", *index);
  }
  return false;
}

PyObject* py_set_device(PyObject*, PyObject* arg) {
  long index = 0;
  if (!parse_device_index(arg, &index, /*say_count=*/true)) {
    return nullptr;
  }
  current_index = static_cast<c10::DeviceIndex>(index);
  Py_RETURN_NONE;
}

bool parse_device_stream(PyObject* args, int* index, long long* id) {
  if (!PyArg_ParseTuple(args, "iL", index, id)) {
    return false;
  }
  if (*index < 0 || *index >= kDeviceCount || *id < 0 || *id >= kStreamsPerDevice) {
    PyErr_Format(PyExc_ValueError,
                 "testdevice: no stream %lld on device %d: %d devices, streams 0 to %d",
                 *id, *index, static_cast<int>(kDeviceCount),
                 static_cast<int>(kStreamsPerDevice - 1));
    return false;
  }
  return true;
}

// current_stream_id(index) -> the calling thread's current stream on that device
PyObject* py_current_stream_id(PyObject*, PyObject* arg) {
  long index = 0;
  if (!parse_device_index(arg, &index, /*say_count=*/false)) {
    return nullptr;
  }
  return PyLong_FromLongLong(current_streams[index]);
}

// exchange_stream_id(index, id) -> the previous current stream's id
PyObject* py_exchange_stream_id(PyObject*, PyObject* args) {
  int index = 0;
  long long id = 0;
  if (!parse_device_stream(args, &index, &id)) {
    return nullptr;
  }
  const auto previous = current_streams[index];
  current_streams[index] = id;
  return PyLong_FromLongLong(previous);
}

// new_stream_id(index) -> a stream from the device's pool
PyObject* py_new_stream_id(PyObject*, PyObject* arg) {
  long index = 0;
  if (!parse_device_index(arg, &index, /*say_count=*/false)) {
    return nullptr;
  }
  return PyLong_FromLongLong(pool_stream(c10::Device(kType, static_cast<c10::DeviceIndex>(index))).id());
}

PyObject* py_counters(PyObject*, PyObject*) {
  return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L}",
                       "live_allocations", static_cast<long long>(counters.live_allocations.load()),
                       "live_bytes", static_cast<long long>(counters.live_bytes.load()),
                       "events_recorded", static_cast<long long>(counters.events_recorded.load()),
                       "events_blocked", static_cast<long long>(counters.events_blocked.load()),
                       "stream_exchanges", static_cast<long long>(counters.stream_exchanges.load()),
                       "device_count_queries", static_cast<long long>(counters.device_count_queries.load()));
}

PyMethodDef methods[] = {
    {"current_device", py_current_device, METH_NOARGS, "The calling thread's current device index."},
    {"set_device", py_set_device, METH_O, "Set the calling thread's current device index."},
    {"current_stream_id", py_current_stream_id, METH_O, "The calling thread's current stream id on a device."},
    {"exchange_stream_id", py_exchange_stream_id, METH_VARARGS, "Make a stream current on a device; returns the previous id."},
    {"new_stream_id", py_new_stream_id, METH_O, "A non-default stream of a device, from its pool."},
    {"counters", py_counters, METH_NOARGS, "What the device and the engine did: allocations, events, stream exchanges."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "torch_ctxext's test device runtime.", -1, methods};

}  // namespace

c10::Allocator* allocator() { return &host_allocator; }

c10::DeviceIndex current_device() { return current_index; }

}  // namespace torch_ctxext_testdevice

PyMODINIT_FUNC PyInit__C() {
  PyObject* m = PyModule_Create(&torch_ctxext_testdevice::module);
  if (m == nullptr) {
    return nullptr;
  }
  PyModule_AddIntConstant(m, "DEVICE_COUNT", torch_ctxext_testdevice::kDeviceCount);
  PyModule_AddIntConstant(m, "STREAMS_PER_DEVICE", torch_ctxext_testdevice::kStreamsPerDevice);
  PyModule_AddIntConstant(m, "DEVICE_TYPE", static_cast<int>(c10::DeviceType::PrivateUse1));
  return m;
}
