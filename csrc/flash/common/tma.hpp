// Host helpers: TMA descriptors from caller strides, and kernel attributes set once.
#pragma once

#include <atomic>
#include <cstdint>

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

namespace flash {

// TMA wants every non-unit-extent stride a nonzero multiple of 16 bytes; a size-1 mode's stride is never used, so
// give it a harmless legal value instead of whatever the caller's view carried.
inline int64_t tma_stride(int64_t stride, int64_t extent, int64_t elems_per_16b) {
  return extent == 1 ? elems_per_16b : stride;
}

// A (batch, seqlen, nheads, head_dim) tensor with unit head_dim stride, viewed as TMA descriptors take it:
// (seqlen, head_dim, nheads, batch). head_dim is the caller's (runtime) one, which may be below the kernel's tile
// width kHeadDim: TMA loads then zero-fill the columns past it (zeros add nothing to any GEMM) and never read them.
template <class Element>
auto make_qkv_gmem(void const* ptr, int seqlen, int head_dim, int nheads, int batch, int64_t row_stride,
                   int64_t head_stride, int64_t batch_stride) {
  constexpr int64_t k16 = 16 / sizeof(Element);
  auto shape = cute::make_shape(int32_t(seqlen), int32_t(head_dim), int32_t(nheads), int32_t(batch));
  auto stride = cute::make_stride(tma_stride(row_stride, seqlen, k16), cute::_1{},
                                  tma_stride(head_stride, nheads, k16), tma_stride(batch_stride, batch, k16));
  return cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(ptr)), cute::make_layout(shape, stride));
}

// The kernel's dynamic shared-memory limit, set once per (kernel, device): it costs microseconds and the launchers
// run on every call. cudaFuncSetAttribute sets it only in the calling thread's current context, so a kernel first
// launched in another context (a green context, a context pushed by the caller) would keep the 48 KiB default and
// fail to launch; the context-independent kernel handle takes the limit for every context on the device.
// Tag: a type unique to the kernel (its traits and variant).
template <class Tag, class Kernel>
cudaError_t set_max_dynamic_smem_once(Kernel kernel, int bytes) {
  static std::atomic<uint64_t> done_devices{0};  // bit d: done on device d (devices past 63 set it every call)
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) { return err; }
  uint64_t const bit = device < 64 ? uint64_t(1) << device : 0;
  if (bit != 0 && (done_devices.load(std::memory_order_relaxed) & bit)) { return cudaSuccess; }
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);  // the current context
  if (err != cudaSuccess) { return err; }
#if CUDART_VERSION >= 12050  // the runtime's kernel handles
  cudaKernel_t handle = nullptr;
  if (cudaGetKernel(&handle, kernel) == cudaSuccess &&
      cudaKernelSetAttributeForDevice(handle, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes, device) ==
          cudaSuccess) {
    done_devices.fetch_or(bit, std::memory_order_relaxed);
    return cudaSuccess;
  }
  (void)cudaGetLastError();  // the failed call's error, not a launch's
#endif
  return cudaSuccess;  // not cached: set again on every call, so in whatever context is current
}

}  // namespace flash
