// The operators of torch_ctxext's test device.
//
// Only what cannot be borrowed from the CPU is implemented here: creating
// tensors with the device's allocator, views (which must alias the device's
// memory), copies across the device boundary, and resizing. Every other
// operator runs on the CPU through PyTorch's boxed CPU fallback, which copies
// the arguments to the CPU, runs the CPU kernel and copies the results (and
// the mutated arguments) back: slow, exact, and enough for the tests.
#include "device.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cstring>

namespace torch_ctxext_testdevice {
namespace {

constexpr auto kKeys = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout,
                               std::optional<at::Device> device,
                               std::optional<bool> /*pin_memory*/,
                               std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout || *layout == at::kStrided, "testdevice: only strided tensors");
  const c10::OptionalDeviceGuard guard(device);  // the allocator allocates on the current device
  return at::detail::empty_generic(size, allocator(), kKeys,
                                   dtype.value_or(c10::get_default_dtype_as_scalartype()),
                                   memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                         std::optional<at::Device> device, std::optional<bool> /*pin_memory*/) {
  TORCH_CHECK(!layout || *layout == at::kStrided, "testdevice: only strided tensors");
  const c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_strided_generic(size, stride, allocator(), kKeys,
                                           dtype.value_or(c10::get_default_dtype_as_scalartype()));
}

// The same memory seen as a CPU tensor (the device's memory is host memory),
// so that CPU kernels can read or write it in place.
at::Tensor host_alias(const at::Tensor& t) {
  if (t.device().is_cpu()) {
    return t;
  }
  auto alias = at::from_blob(t.data_ptr(), t.sizes(), t.strides(),
                             t.options().device(at::kCPU));
  if (t.is_conj()) {
    alias = alias.conj();
  }
  if (t.is_neg()) {
    alias = alias._neg_view();
  }
  return alias;
}

// copy_ from or to the device (the CPU kernel converts dtypes and strides).
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  if (dst.numel() == 0) {
    return dst;
  }
  TORCH_CHECK(!dst.is_conj() && !dst.is_neg(),
              "testdevice: copy_ into a conjugate or negative view is not emulated");
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  if (self.sizes() == size && !memory_format) {
    return self;
  }
  impl->set_sizes_contiguous(size);
  if (memory_format && *memory_format != at::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*memory_format);
  }
  const size_t needed = at::detail::computeStorageNbytes(
      impl->sizes(), impl->strides(), self.dtype().itemsize(),
      static_cast<size_t>(impl->storage_offset()));
  auto* storage = impl->storage().unsafeGetStorageImpl();
  if (needed > storage->nbytes()) {
    TORCH_CHECK(storage->resizable(), "testdevice: cannot resize a tensor whose storage is not resizable");
    const c10::DeviceGuard guard(self.device());
    auto data = allocator()->allocate(needed);
    if (storage->nbytes() > 0) {
      std::memcpy(data.get(), storage->data(), storage->nbytes());
    }
    storage->set_data_ptr_noswap(std::move(data));
    storage->set_nbytes(needed);
  }
  return self;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

void fallback_to_cpu(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::native::cpu_fallback(op, stack);
}

}  // namespace
}  // namespace torch_ctxext_testdevice

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace torch_ctxext_testdevice;
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("resize_", TORCH_FN(resize_));
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&torch_ctxext_testdevice::fallback_to_cpu>());
}
