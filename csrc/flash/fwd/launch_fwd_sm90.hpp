// Host side of the forward kernel: TMA descriptors from FwdParams, grid, shared memory, launch.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "flash/common/tile_order.hpp"
#include "flash/common/tma.hpp"
#include "flash/config.hpp"
#include "flash/fwd/exact_rows_sm90.hpp"
#include "flash/fwd/kernel_fwd_sm90.hpp"
#include "flash/fwd/tile_choice.hpp"
#include "flash/params.hpp"

namespace flash {

// kFwdPersistentMaxKeyBlocks, or FAH_FWD_PERSISTENT_MAX_KEY_BLOCKS (development A/B, read once per process; a value
// other than the default also turns kPersistentUnmasked off).
inline int fwd_persistent_max_key_blocks() {
  static int const value = [] {
    char const* v = std::getenv("FAH_FWD_PERSISTENT_MAX_KEY_BLOCKS");
    return v == nullptr ? kFwdPersistentMaxKeyBlocks : std::atoi(v);
  }();
  return value;
}

// Sectioned tile order for causal-like launches (Params::section_heads): (head, batch) pairs whose K and V fit in this
// many MiB of L2 form a section; FAH_FWD_SECTION_MIB=0 keeps the head-major order. Why: in a list-scheduling model of
// 132 SMs (scripts/tile_order_model.py) head-major reaches 0.89 of the ideal makespan at head_dim 256 causal 1024 and
// 2048 and 0.94-0.97 elsewhere; sections 0.97-0.995 (the model is not monotone in the size, hence the divisor rule).
// H200, 2026-12-03 (benchmarks/NOTES.md, session 32), bf16 causal against head-major, two 3-round runs: head_dim 256
// 1024-4096 +4-7 %, head_dim 128 512-4096 +2-4 % (one run read 2048 at -6 %, the other +3 %), head_dim 64 1024-16384
// +2-3 %; at 512 head_dim 64 and 256 lose 2-3 %. 24 MiB beat 8 and 12 MiB at 1024-4096.
inline int fwd_section_mib() {
  static int const value = [] {
    char const* v = std::getenv("FAH_FWD_SECTION_MIB");
    return v == nullptr ? 24 : std::atoi(v);
  }();
  return value;
}

// Sections only from this many query blocks per (head, batch) pair (FAH_FWD_SECTION_MIN_M_BLOCKS; 0 = always). With
// few query blocks the tiles differ little in length. H200, 2026-12-03 (benchmarks/NOTES.md, session 33), bf16 causal
// 512 (4 blocks of 128 rows), 8 against 0, 2 rounds: head_dim 64 +2-4 %, 256 +3.5 %, 128 -1 %.
inline int fwd_section_min_m_blocks() {
  static int const value = [] {
    char const* v = std::getenv("FAH_FWD_SECTION_MIN_M_BLOCKS");
    return v == nullptr ? 8 : std::atoi(v);
  }();
  return value;
}

template <class Element, int kHeadDim, class Cfg>
cudaError_t run_fwd_sm90_cfg(FwdParams const& p, cudaStream_t stream) {
  using Traits = FwdKernelTraits<Element, kHeadDim, Cfg::kBlockM, Cfg::kBlockN, Cfg::kStages, Cfg::kPersistent,
                                 Cfg::kDocuments>;
  // Any head_dim that is a multiple of 8 (16-byte rows for TMA) up to the tile width: the columns past it are
  // zero-filled on load and never stored.
  // V (and O) may have their own head_dim_v (the kernel is the one of the larger): same rule.
  for (int d : {p.head_dim, p.head_dim_v}) {
    if (d <= 0 || d > kHeadDim || d % 8 != 0) { return cudaErrorInvalidValue; }
  }
  if (p.nheads_k <= 0 || p.nheads % p.nheads_k != 0 || !(p.softcap >= 0.f)) { return cudaErrorInvalidValue; }
  if (!Cfg::kDocuments && p.doc_bounds != nullptr) { return cudaErrorInvalidValue; }
  ScoreScales const scales = score_scales(p.softmax_scale, p.softcap);
  int const num_m_blocks = cute::ceil_div(p.seqlen_q, Traits::kBlockM);
  int64_t const num_tiles = int64_t(num_m_blocks) * p.nheads * p.batch;
  if (num_tiles > INT32_MAX || (p.tile_counter != nullptr && p.num_sms <= 0) || p.exact_rows_flag == nullptr) {
    return cudaErrorInvalidValue;
  }
  int window_left, window_right;
  kernel_window(p.window_left, p.window_right, p.seqlen_q, p.seqlen_k, window_left, window_right);
  // Persistent when the build has it and each tile sees few key blocks (config.hpp, kFwdPersistentMaxKeyBlocks), or
  // no mask applies and the configuration says so (kPersistentUnmasked).
  int64_t const keys_per_tile = std::min<int64_t>(p.seqlen_k, int64_t(window_left) + window_right + Traits::kBlockM);
  bool const unmasked = window_left >= p.seqlen_k && window_right >= p.seqlen_q;  // kernel_window's "unbounded"
  bool const persistent =
      Traits::kPersistent && p.tile_counter != nullptr &&
      ((Cfg::kPersistentUnmasked && unmasked && fwd_persistent_max_key_blocks() == kFwdPersistentMaxKeyBlocks) ||
       cute::ceil_div(keys_per_tile, int64_t(Traits::kBlockN)) <= fwd_persistent_max_key_blocks());
  // Sections only where tile lengths grow with the query block (causal_like); windowed tiles cost about the same
  // each, and without a mask sections lost (session 5). Bytes per pair: the K and V it reads, shared by the query
  // heads of a GQA group.
  int const section_heads =
      causal_like(window_left, window_right, p.seqlen_q, p.seqlen_k) && num_m_blocks >= fwd_section_min_m_blocks()
          ? l2_section_pairs(int64_t(p.nheads) * p.batch,
                             double(p.seqlen_k) * (p.head_dim + p.head_dim_v) * sizeof(Element) /
                                 double(p.nheads / p.nheads_k),
                             fwd_section_mib())
          : 0;
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
  auto mO_in = gmem(p.o_ptr, rows_q, p.head_dim_v, p.nheads, p.o_row_stride, p.o_head_stride, p.o_batch_stride);
  auto mO = make_tensor(make_gmem_ptr(static_cast<Element*>(p.o_ptr)), mO_in.layout());

  typename Traits::Params kp{
      make_tma_copy(SM90_TMA_LOAD{}, mQ, typename Traits::SmemLayoutQ{},
                    Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename Traits::SmemLayoutKV{}),
                    Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mV, take<0, 2>(typename Traits::SmemLayoutKV{}),
                    Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, mO, typename Traits::SmemLayoutOWG{}, Shape<_64, Int<kHeadDim>>{}, _1{}),
      mQ.shape(),
      mK.shape(),
      mV.shape(),
      mO.shape(),
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
      p.total_q,
      p.total_k,
      p.nheads / p.nheads_k,
      scales.score_scale,
      scales.score_scale_log2,
      scales.softcap_pre,
      window_left,
      window_right,
      p.doc_bounds,
      p.pingpong && Cfg::kPingpong,
      num_m_blocks,
      int(num_tiles),
      persistent ? p.tile_counter : nullptr,
      section_heads,
      p.exact_rows_flag,
  };

  // A softcap's fixed maximum: bf16 only (an fp16 P would underflow below it, flash/common/softmax.hpp); the fp16
  // kernels are not compiled with it.
  constexpr bool kBf16 = std::is_same_v<Element, cutlass::bfloat16_t>;
  int const mode = p.softcap <= 0.f                               ? kNoSoftcap
                   : kBf16 && p.softcap <= kSoftcapFixedMaxLimit ? kSoftcapFixedMax
                                                                  : kSoftcapOnline;
  constexpr int smem_bytes = Traits::kSmemBytes;
  auto launch = [&](auto mode_c) {
    constexpr int kMode = decltype(mode_c)::value;
    auto kernel = flash_fwd_sm90_kernel<Traits, kMode>;
    cudaError_t err = set_max_dynamic_smem_once<cute::tuple<Traits, cute::C<kMode>>>(kernel, smem_bytes);
    if (err != cudaSuccess) { return err; }
    dim3 grid(persistent ? int(std::min<int64_t>(num_tiles, p.num_sms)) : int(num_tiles));
    kernel<<<grid, Traits::NumThreads, smem_bytes, stream>>>(kp);
    err = cudaGetLastError();
    // (the fixed maximum bounds the scores by the softcap: no row is ever marked)
    if (err != cudaSuccess || kMode == kSoftcapFixedMax) { return err; }
    return launch_fwd_exact_rows<Element>(p, scales, window_left, window_right, stream);
  };
  if (mode == kNoSoftcap) { return launch(cute::C<int(kNoSoftcap)>{}); }
  if constexpr (kBf16) {
    if (mode == kSoftcapFixedMax) { return launch(cute::C<int(kSoftcapFixedMax)>{}); }
  }
  return launch(cute::C<int(kSoftcapOnline)>{});
}

// head_dim 64: 192 or 128 rows per tile (flash/fwd/tile_choice.hpp); documents always take the 128-row tiles (the
// 192-row kernel is compiled without them, config.hpp).
template <class Element>
cudaError_t run_fwd_sm90_hdim64(FwdParams const& p, cudaStream_t stream) {
  int const block_m = p.doc_bounds != nullptr ? FwdTileConfig64Narrow::kBlockM
                                              : fwd_block_m_hdim64(p.seqlen_q, p.seqlen_k, p.window_left,
                                                                   p.window_right, int64_t(p.nheads) * p.batch,
                                                                   p.num_sms);
  return block_m == FwdTileConfig<64>::kBlockM ? run_fwd_sm90_cfg<Element, 64, FwdTileConfig<64>>(p, stream)
                                               : run_fwd_sm90_cfg<Element, 64, FwdTileConfig64Narrow>(p, stream);
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
