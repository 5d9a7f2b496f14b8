// Host side of the forward kernel: TMA descriptors from FwdParams, grid, shared memory, launch.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "flash/common/tma.hpp"
#include "flash/config.hpp"
#include "flash/fwd/kernel_fwd_sm90.hpp"
#include "flash/params.hpp"

namespace flash {

template <class Element, int kHeadDim>
cudaError_t run_fwd_sm90(FwdParams const& p, cudaStream_t stream) {
  using Cfg = FwdTileConfig<kHeadDim>;
  using Traits = FwdKernelTraits<Element, kHeadDim, Cfg::kBlockM, Cfg::kBlockN, Cfg::kStages, Cfg::kIntraWGOverlap>;
  constexpr int64_t k16 = 16 / sizeof(Element);

  auto make_gmem = [&](void const* ptr, int seqlen, int64_t row, int64_t head, int64_t batch) {
    auto shape = make_shape(int32_t(seqlen), int32_t(kHeadDim), int32_t(p.nheads), int32_t(p.batch));
    auto stride = make_stride(tma_stride(row, seqlen, k16), _1{}, tma_stride(head, p.nheads, k16),
                              tma_stride(batch, p.batch, k16));
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), make_layout(shape, stride));
  };
  auto mQ = make_gmem(p.q_ptr, p.seqlen_q, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto mK = make_gmem(p.k_ptr, p.seqlen_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
  auto mV = make_gmem(p.v_ptr, p.seqlen_k, p.v_row_stride, p.v_head_stride, p.v_batch_stride);

  typename Traits::Params kp{
      make_tma_copy(SM90_TMA_LOAD{}, mQ, typename Traits::SmemLayoutQ{},
                    Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename Traits::SmemLayoutKV{}),
                    Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mV, take<0, 2>(typename Traits::SmemLayoutKV{}),
                    Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{}),
      mQ.shape(),
      mK.shape(),
      static_cast<Element*>(p.o_ptr),
      p.o_batch_stride,
      p.o_row_stride,
      p.o_head_stride,
      p.lse_ptr,
      p.nheads,
      p.seqlen_q,
      p.seqlen_k,
      p.softmax_scale,
      p.softmax_scale_log2,
      p.is_causal,
      p.pingpong,
  };

  auto kernel = flash_fwd_sm90_kernel<Traits>;
  constexpr int smem_bytes = Traits::kSmemBytes;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) { return err; }
  dim3 grid(cute::ceil_div(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch);
  kernel<<<grid, Traits::NumThreads, smem_bytes, stream>>>(kp);
  return cudaGetLastError();
}

}  // namespace flash

// One translation unit per (head_dim, dtype) defines the entry point declared in csrc/api/dispatch.h.
#define FLASH_FWD_INSTANTIATE(HDIM, DTYPE_NAME, ELEMENT)                                               \
  namespace flash {                                                                                    \
  cudaError_t run_fwd_hdim##HDIM##_##DTYPE_NAME(FwdParams const& p, cudaStream_t stream) {             \
    return run_fwd_sm90<ELEMENT, HDIM>(p, stream);                                                     \
  }                                                                                                    \
  }
