// torch_ctxext's test device: what the device runtime (device.cpp) offers its
// operators (operators.cpp).
//
// The device is PrivateUse1, emulated on host memory: kDeviceCount devices,
// kStreamsPerDevice streams each, a thread-local current device and current
// stream per device, events, and an allocator. Work runs synchronously on
// the calling thread, so an event is complete when it is recorded; what the
// device emulates is the bookkeeping the autograd engine reads (which
// device, which stream) and the calls it makes (record, block, query).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace torch_ctxext_testdevice {

constexpr c10::DeviceIndex kDeviceCount = 2;
constexpr int64_t kStreamsPerDevice = 4;  // stream 0 is each device's default stream

// The allocator of every device: host memory, poisoned on allocation (every
// byte 0xFF, a NaN for every floating dtype) so that reading memory nobody
// wrote shows in the results instead of passing as zeros.
c10::Allocator* allocator();

// The calling thread's current device (what DeviceGuard sets).
c10::DeviceIndex current_device();

}  // namespace torch_ctxext_testdevice
