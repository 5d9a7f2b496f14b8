// Host side of the forward kernel: TMA descriptors from FwdParams, grid, shared memory, launch.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "flash/common/tma.hpp"
#include "flash/config.hpp"
#include "flash/fwd/kernel_fwd_sm90.hpp"
#include "flash/params.hpp"

namespace flash {

template <class Element, int kHeadDim, class Cfg>
cudaError_t run_fwd_sm90_cfg(FwdParams const& p, cudaStream_t stream) {
  using Traits = FwdKernelTraits<Element, kHeadDim, Cfg::kBlockM, Cfg::kBlockN, Cfg::kStages, Cfg::kIntraWGOverlap,
                                 Cfg::kPersistent>;
  // Any head_dim that is a multiple of 8 (16-byte rows for TMA) up to the tile width: the columns past it are
  // zero-filled on load and never stored.
  // V (and O) may have their own head_dim_v (the kernel is the one of the larger): same rule.
  for (int d : {p.head_dim, p.head_dim_v}) {
    if (d <= 0 || d > kHeadDim || d % 8 != 0) { return cudaErrorInvalidValue; }
  }
  if (p.nheads_k <= 0 || p.nheads % p.nheads_k != 0 || !(p.softcap >= 0.f)) { return cudaErrorInvalidValue; }
  ScoreScales const scales = score_scales(p.softmax_scale, p.softcap);
  int const num_m_blocks = cute::ceil_div(p.seqlen_q, Traits::kBlockM);
  int64_t const num_tiles = int64_t(num_m_blocks) * p.nheads * p.batch;
  if (num_tiles > INT32_MAX || (p.tile_counter != nullptr && p.num_sms <= 0)) { return cudaErrorInvalidValue; }
  int window_left, window_right;
  kernel_window(p.window_left, p.window_right, p.seqlen_q, p.seqlen_k, window_left, window_right);
  // Persistent when the build has it and each tile sees few key blocks (config.hpp, kFwdPersistentMaxKeyBlocks).
  int64_t const keys_per_tile = std::min<int64_t>(p.seqlen_k, int64_t(window_left) + window_right + Traits::kBlockM);
  bool const persistent = Traits::kPersistent && p.tile_counter != nullptr &&
                          cute::ceil_div(keys_per_tile, int64_t(Traits::kBlockN)) <= kFwdPersistentMaxKeyBlocks;
  // Varlen: the packed rows as one batch element; sequences are found by row offsets in the kernel.
  bool const varlen = p.cu_seqlens_q != nullptr;
  if (varlen != (p.cu_seqlens_k != nullptr)) { return cudaErrorInvalidValue; }
  int const rows_q = varlen ? p.total_q : p.seqlen_q, rows_k = varlen ? p.total_k : p.seqlen_k;
  auto gmem = [&](void const* ptr, int seqlen, int head_dim, int nheads, int64_t row, int64_t head, int64_t batch) {
    return make_qkv_gmem<Element>(ptr, seqlen, head_dim, nheads, varlen ? 1 : p.batch, row, head, batch);
  };
  auto mQ = gmem(p.q_ptr, rows_q, p.head_dim, p.nheads, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto mK = gmem(p.k_ptr, rows_k, p.head_dim, p.nheads_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
  auto mV = gmem(p.v_ptr, rows_k, p.head_dim_v, p.nheads_k, p.v_row_stride, p.v_head_stride, p.v_batch_stride);

  typename Traits::Params kp{
      make_tma_copy(SM90_TMA_LOAD{}, mQ, typename Traits::SmemLayoutQ{},
                    Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename Traits::SmemLayoutKV{}),
                    Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mV, take<0, 2>(typename Traits::SmemLayoutKV{}),
                    Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{}),
      mQ.shape(),
      mK.shape(),
      mV.shape(),
      static_cast<Element*>(p.o_ptr),
      p.o_batch_stride,
      p.o_row_stride,
      p.o_head_stride,
      p.head_dim_v,
      p.lse_ptr,
      varlen ? 0 : int64_t(p.nheads) * p.seqlen_q,
      varlen ? int64_t(p.total_q) : int64_t(p.seqlen_q),
      p.nheads,
      p.seqlen_q,
      p.seqlen_k,
      p.cu_seqlens_q,
      p.cu_seqlens_k,
      p.nheads / p.nheads_k,
      scales.score_scale,
      scales.score_scale_log2,
      scales.softcap_pre,
      window_left,
      window_right,
      p.pingpong,
      num_m_blocks,
      int(num_tiles),
      persistent ? p.tile_counter : nullptr,
  };

  bool const softcap = p.softcap > 0.f;
  auto kernel = softcap ? flash_fwd_sm90_kernel<Traits, true> : flash_fwd_sm90_kernel<Traits, false>;
  constexpr int smem_bytes = Traits::kSmemBytes;
  cudaError_t err = softcap ? set_max_dynamic_smem_once<cute::tuple<Traits, cute::true_type>>(kernel, smem_bytes)
                            : set_max_dynamic_smem_once<cute::tuple<Traits, cute::false_type>>(kernel, smem_bytes);
  if (err != cudaSuccess) { return err; }
  dim3 grid(persistent ? int(std::min<int64_t>(num_tiles, p.num_sms)) : int(num_tiles));
  kernel<<<grid, Traits::NumThreads, smem_bytes, stream>>>(kp);
  return cudaGetLastError();
}

// Query-key pairs that forward tiles of kBlockM x kBlockN compute for one (sequence, head): the key-block ranges of
// the query blocks (flash/common/mask.hpp) times the tile area. Long sequences are sampled (at most ~256 query
// blocks), which keeps this a few hundred integer operations per call.
template <int kBlockM, int kBlockN>
double fwd_tile_pairs(int seqlen_q, int seqlen_k, int window_left, int window_right) {
  Window<kBlockM, kBlockN> const window{seqlen_q, seqlen_k, window_left, window_right};
  int const num_m_blocks = cute::ceil_div(seqlen_q, kBlockM);
  int const step = std::max(1, num_m_blocks / 256);
  int64_t blocks = 0;
  for (int m_block = 0; m_block < num_m_blocks; m_block += step) {
    int lo, hi;
    window.n_block_range(m_block, lo, hi);
    blocks += hi - lo;
  }
  return double(blocks) * step * kBlockM * kBlockN;
}

// head_dim 64 tiles (config.hpp): 192 rows unless they would compute more than 1 / kFwd64WideCost* times the pairs of
// 128-row tiles (a causal diagonal or narrow window, a last query block mostly past seqlen_q). FAH_FWD_BLOCK_M=128 or
// 192 forces one (development).
template <class Element>
cudaError_t run_fwd_sm90_hdim64(FwdParams const& p, cudaStream_t stream) {
  using Wide = FwdTileConfig<64>;
  using Narrow = FwdTileConfig64Narrow;
  static int const forced = [] {
    char const* v = std::getenv("FAH_FWD_BLOCK_M");
    return v == nullptr ? 0 : std::atoi(v);
  }();
  bool wide = forced == Wide::kBlockM;
  if (forced != Wide::kBlockM && forced != Narrow::kBlockM) {
    int window_left, window_right;
    kernel_window(p.window_left, p.window_right, p.seqlen_q, p.seqlen_k, window_left, window_right);
    double const pairs_wide =
        fwd_tile_pairs<Wide::kBlockM, Wide::kBlockN>(p.seqlen_q, p.seqlen_k, window_left, window_right);
    double const pairs_narrow =
        fwd_tile_pairs<Narrow::kBlockM, Narrow::kBlockN>(p.seqlen_q, p.seqlen_k, window_left, window_right);
    // kernel_window turns a side wider than the sequence into one past it: such a side masks nothing.
    bool const masked = window_left <= p.seqlen_k || window_right <= p.seqlen_q;
    wide = pairs_wide * (masked ? kFwd64WideCostMasked : kFwd64WideCostFull) <= pairs_narrow;
  }
  return wide ? run_fwd_sm90_cfg<Element, 64, Wide>(p, stream) : run_fwd_sm90_cfg<Element, 64, Narrow>(p, stream);
}

template <class Element, int kHeadDim>
cudaError_t run_fwd_sm90(FwdParams const& p, cudaStream_t stream) {
  if constexpr (kHeadDim == 64) {
    return run_fwd_sm90_hdim64<Element>(p, stream);
  } else {
    return run_fwd_sm90_cfg<Element, kHeadDim, FwdTileConfig<kHeadDim>>(p, stream);
  }
}

}  // namespace flash

// One translation unit per (head_dim, dtype) defines the entry point declared in csrc/flash/dispatch.hpp.
#define FLASH_FWD_INSTANTIATE(HDIM, DTYPE_NAME, ELEMENT)                                               \
  namespace flash {                                                                                    \
  cudaError_t run_fwd_hdim##HDIM##_##DTYPE_NAME(FwdParams const& p, cudaStream_t stream) {             \
    return run_fwd_sm90<ELEMENT, HDIM>(p, stream);                                                     \
  }                                                                                                    \
  }
