// Memory-bound kernels around the backward main kernel.
//   preprocess:  D = rowsum(dO ∘ O) − dLSE in fp32 and LSE·log2(e) per query row (padding rows: D = 0,
//                LSE_log2 = +inf, and +inf too for rows that saw no key, so that P = exp2(x·scale_log2 − LSE_log2)
//                is 0 there). dLSE (when the loss uses the LSE) folds into D because dS = P ∘ (dP − D) + P ∘ dLSE.
//   postprocess: dQ = softmax_scale · dQ_accum, converted to the input dtype, into dQ's strided layout (with two
//                accumulator copies, dq_lanes, their sum: copy 0 + copy 1, a fixed order).
// dQ_accum rows are kHeadDim floats wide (the padded tile width); O and dO are read only in their first
// p.head_dim_v columns, dQ written only in its first p.head_dim (the caller's, multiples of 8: whole vectors of 8).
#pragma once

#include <cmath>

#include <cuda_runtime.h>
#include <cutlass/array.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include <cute/tensor.hpp>

#include "flash/common/seqlen.hpp"
#include "flash/config.hpp"
#include "flash/params.hpp"

namespace flash {

// Row `row` of sequence `info` (head bidh) in the forward's LSE: (batch, nheads, seqlen_q), or (nheads, total_q) when
// varlen.
CUTLASS_DEVICE int64_t lse_index(BwdParams const& p, SeqlenInfo const& info, int bidh, int row) {
  return p.cu_seqlens_q != nullptr ? int64_t(bidh) * p.total_q + info.offset_q + row
                                   : (int64_t(info.batch_idx) * p.nheads + bidh) * p.seqlen_q + row;
}

// Rows of the preprocess per 256-thread block: kHeadDim / 8 lanes per row (16-byte vectors), so a warp covers 4, 2
// or 1 rows at head_dim 64, 128, 256 (one row per warp left 24 of 32 lanes idle at head_dim 64: half the copy rate).
template <int kHeadDim>
constexpr int preprocess_lanes_per_row() {
  return kHeadDim / 8 < 32 ? kHeadDim / 8 : 32;
}
constexpr int kPreprocessThreads = 256;
template <int kHeadDim>
constexpr int preprocess_rows_per_block() {
  return kPreprocessThreads / preprocess_lanes_per_row<kHeadDim>();
}

// kHeadDim / 8 lanes per query row stride over head_dim in vectors of 8 elements (16 bytes). Covers each sequence's
// rows rounded up to whole workspace tiles.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kPreprocessThreads) flash_bwd_preprocess_kernel(BwdParams const p) {
  constexpr int kVec = 8, kLanes = preprocess_lanes_per_row<kHeadDim>();
  static_assert(32 % kLanes == 0 && kHeadDim % (kLanes * kVec) == 0);
  static_assert(kBwdSeqlenQRounding % (32 / kLanes) == 0);  // a warp's rows are all in or all out of the range
  int const lane = threadIdx.x % kLanes;
  int const row = blockIdx.x * preprocess_rows_per_block<kHeadDim>() + threadIdx.x / kLanes;
  int const bidh = blockIdx.y;
  SeqlenInfo const info(p.cu_seqlens_q, p.cu_seqlens_k, p.seqlen_q, p.seqlen_k, blockIdx.z, p.total_q, p.total_k);
  constexpr int kRound = kBwdSeqlenQRounding;
  if (row >= (info.seqlen_q + kRound - 1) / kRound * kRound) { return; }
  float dot = 0.f;
  if (row < info.seqlen_q) {
    int64_t const r = info.offset_q + row;
    auto const* o = static_cast<Element const*>(p.o_ptr) + info.bidb * p.o_batch_stride + r * p.o_row_stride +
                    bidh * p.o_head_stride;
    auto const* dout = static_cast<Element const*>(p.do_ptr) + info.bidb * p.do_batch_stride + r * p.do_row_stride +
                       bidh * p.do_head_stride;
    CUTLASS_PRAGMA_UNROLL
    for (int c0 = 0; c0 < kHeadDim; c0 += kLanes * kVec) {
      int const c = c0 + lane * kVec;
      if (c < p.head_dim_v) {
        auto ov = *reinterpret_cast<cutlass::Array<Element, kVec> const*>(o + c);
        auto dv = *reinterpret_cast<cutlass::Array<Element, kVec> const*>(dout + c);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kVec; ++i) { dot += float(ov[i]) * float(dv[i]); }
      }
    }
  }
  // Sum over the row's lanes (aligned groups of kLanes within the warp; the whole warp is here, see above).
  CUTLASS_PRAGMA_UNROLL
  for (int offset = kLanes / 2; offset > 0; offset /= 2) { dot += __shfl_xor_sync(0xffffffff, dot, offset); }
  if (lane == 0) {
    int64_t const idx =
        bwd_workspace_row<kBwdSeqlenQRounding>(p.cu_seqlens_q != nullptr, p.nheads, p.seqlen_q_rounded, info, bidh) +
        row;
    float lse_log2 = INFINITY;
    if (row < info.seqlen_q) {
      int64_t const row_idx = lse_index(p, info, bidh, row);
      float const lse = p.lse_ptr[row_idx];
      if (lse != -INFINITY) {  // a row that saw no key has P = 0: its dLSE (even inf or NaN) must not leak in
        lse_log2 = lse * float(M_LOG2E);
        // A finite LSE past ~2.4e38 (the forward's exact pass, in natural units) overflows here: NaN gradients, never
        // the +inf that marks a row with no key (P = 0: silently zero dQ and no share of dK, dV).
        if (fabsf(lse_log2) == INFINITY && fabsf(lse) < INFINITY) { lse_log2 = NAN; }
        if (p.dlse_ptr != nullptr) { dot -= p.dlse_ptr[row_idx]; }
      }
    }
    p.lse_log2_ptr[idx] = lse_log2;
    p.dpsum_ptr[idx] = dot;
  }
}

// One thread per 8 elements of dQ.
template <class Element, int kHeadDim>
__global__ void flash_bwd_postprocess_kernel(BwdParams const p) {
  constexpr int kVec = 8;
  int64_t const idx = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  int const bidh = blockIdx.y;
  SeqlenInfo const info(p.cu_seqlens_q, p.cu_seqlens_k, p.seqlen_q, p.seqlen_k, blockIdx.z, p.total_q, p.total_k);
  if (idx >= int64_t(info.seqlen_q) * kHeadDim) { return; }
  int const row = idx / kHeadDim, col = idx % kHeadDim;
  if (col >= p.head_dim) { return; }  // padded columns: zeros in the workspace, no column of dQ
  float const* acc =
      p.dq_accum_ptr +
      (bwd_workspace_row<kBwdSeqlenQRounding>(p.cu_seqlens_q != nullptr, p.nheads, p.seqlen_q_rounded, info, bidh) +
       row) * kHeadDim +
      col;
  auto a = *reinterpret_cast<cutlass::Array<float, kVec> const*>(acc);
  if (p.dq_lanes == 2) {
    int64_t const lane_floats =
        int64_t(p.cu_seqlens_q != nullptr ? 1 : p.batch) * p.nheads * p.seqlen_q_rounded * kHeadDim;
    auto const b = *reinterpret_cast<cutlass::Array<float, kVec> const*>(acc + lane_floats);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVec; ++i) { a[i] += b[i]; }
  }
  cutlass::Array<Element, kVec> out;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kVec; ++i) { out[i] = Element(a[i] * p.softmax_scale); }
  *reinterpret_cast<cutlass::Array<Element, kVec>*>(static_cast<Element*>(p.dq_ptr) + info.bidb * p.dq_batch_stride +
                                                    (info.offset_q + int64_t(row)) * p.dq_row_stride +
                                                    bidh * p.dq_head_stride + col) = out;
}

// Postprocess for the kSwapSdP main kernel, whose dQ accumulator holds each (kBlockM, head_dim) tile in the register
// order of its dQ GEMM: value i of consumer thread t at [(i / 4) * 128 + t % 128] * 4 + i % 4 of warpgroup t / 128's
// half. One CTA per tile, one thread per consumer thread: read that order, place the values through shared memory,
// write whole rows with 16-byte stores.
template <class Traits>
__global__ void __launch_bounds__(Traits::NumMmaThreads)
    flash_bwd_postprocess_tiled_kernel(BwdParams const p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim, kThreads = Traits::NumMmaThreads;
  constexpr int kPad = 8;  // elements: staggers rows across banks
  __shared__ __align__(16) Element tile[kBlockM][kHeadDim + kPad];
  int const m_block = blockIdx.x, bidh = blockIdx.y;
  SeqlenInfo const info(p.cu_seqlens_q, p.cu_seqlens_k, p.seqlen_q, p.seqlen_k, blockIdx.z, p.total_q, p.total_k);
  if (m_block * kBlockM >= info.seqlen_q) { return; }  // varlen: past this sequence (the grid fits the longest)
  int const t = threadIdx.x, wg = t / cutlass::NumThreadsPerWarpGroup, wg_tidx = t % cutlass::NumThreadsPerWarpGroup;

  typename Traits::TiledMmadQ tiled_mma_dq;
  Tensor tdQcdQ = tiled_mma_dq.get_thread_slice(t).partition_C(
      cute::make_identity_tensor(cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  constexpr int kValues = decltype(cute::size(tdQcdQ))::value;
  float const* src =
      p.dq_accum_ptr +
      (bwd_workspace_row<kBwdSeqlenQRounding>(p.cu_seqlens_q != nullptr, p.nheads, p.seqlen_q_rounded, info, bidh) +
       int64_t(m_block) * kBlockM) * kHeadDim +
      wg * Traits::kDQChunkFloats;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kValues; i += 4) {
    float4 const v = *reinterpret_cast<float4 const*>(src + (i * cutlass::NumThreadsPerWarpGroup + 4 * wg_tidx));
    float const vals[4] = {v.x, v.y, v.z, v.w};
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 4; ++k) {
      auto const coord = tdQcdQ(i + k);
      tile[cute::get<0>(coord)][cute::get<1>(coord)] = Element(vals[k] * p.softmax_scale);
    }
  }
  __syncthreads();
  constexpr int kVec = 8, kChunksPerRow = kHeadDim / kVec;
  CUTLASS_PRAGMA_UNROLL
  for (int c = t; c < kBlockM * kChunksPerRow; c += kThreads) {
    int const r = c / kChunksPerRow, col = (c % kChunksPerRow) * kVec;
    int const row = m_block * kBlockM + r;
    if (row < info.seqlen_q && col < p.head_dim) {
      *reinterpret_cast<cutlass::Array<Element, kVec>*>(static_cast<Element*>(p.dq_ptr) + info.bidb * p.dq_batch_stride +
                                                        (info.offset_q + int64_t(row)) * p.dq_row_stride +
                                                        bidh * p.dq_head_stride + col) =
          *reinterpret_cast<cutlass::Array<Element, kVec> const*>(&tile[r][col]);
    }
  }
}

}  // namespace flash
