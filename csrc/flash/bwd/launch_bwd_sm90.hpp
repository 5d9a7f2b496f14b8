// Host side of the backward: preprocess, main kernel (TMA descriptors, grid, shared memory), postprocess.
#pragma once

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "flash/bwd/kernel_bwd_sm90.hpp"
#include "flash/bwd/prepost_bwd_sm90.hpp"
#include "flash/common/mask.hpp"
#include "flash/common/softmax.hpp"
#include "flash/common/tile_order.hpp"
#include "flash/common/tma.hpp"
#include "flash/config.hpp"
#include "flash/params.hpp"

namespace flash {

// The backward's sections (Params::section_pairs): (head group, batch) pairs whose Q, dO and dQ accumulator rows fit
// in this many MiB of L2; FAH_BWD_SECTION_MIB=0 keeps the grid's order (each pair's key blocks in turn). Model
// (scripts/tile_order_model.py --bwd, session 32, CPU only): the grid's order reaches 0.93-0.95 of the ideal makespan
// at head_dim 128 and 256 causal 1024-8192 and 0.97 at head_dim 64; sections 0.98-1.00. H200, 2026-12-03
// (benchmarks/NOTES.md, session 33), bf16, 24 MiB against 0, median of 3 rounds: causal head_dim 128 1024-16384
// +0-3.5 %, head_dim 256 2048-8192 +2-3.3 %, head_dim 64 1024-8192 +1-2.5 %; non-causal level (no sections there).
inline int bwd_section_mib() {
  static int const value = [] {
    char const* v = std::getenv("FAH_BWD_SECTION_MIB");
    return v == nullptr ? 24 : std::atoi(v);
  }();
  return value;
}

// GQA group CTAs (heads_per_cta > 1) under a causal-like mask at head_dim <= 128: sections of as many pairs as one
// wave of CTAs holds (wave_section_pairs), longest first within each. A group CTA runs heads_per_cta times the query
// blocks of a per-head one, so in 24 MiB L2 sections (often one pair) the next section's long CTAs wait behind this
// one's short ones (scripts/tile_order_model.py --bwd-gqa: 0.78-0.84 of the ideal makespan at 16 query heads on 4).
// One order over all pairs (session 36; H200 +6-15 % over the L2 sections at 2048-8192) balances but keeps every
// pair's Q, dO and dQ rows live at once, which an H100's lower bandwidth does not hide. One wave balances as well in
// the model with a quarter to a half of the live pairs. H100, 2026-12-05 (session 52, benchmarks/NOTES.md; bf16, 16
// query heads, 16k tokens, causal, medians of 2 rounds, TFLOP/s one order -> one wave): head_dim 128 16/4 1024
// 225 -> 298, 2048 348 -> 410, 4096 410 -> 431 (the L2 sections 289, 382, 445); 16/8 186 -> 329, 303 -> 443, 485 ->
// 520; head_dim 64 16/4 243 -> 293, 377 -> 388, 435 -> 454; 16/2 240 -> 258, 322 -> 360, 407 -> 437. Not at head_dim
// 256 (64-key CTAs: twice the bytes per FLOP), where one wave (FAH_BWD_SECTION_MIB at its bytes) read +1-6 % at 16/8
// and 16/4 1024-4096 but -8 % / -14 % at 16/2 2048 / 4096 against the L2 sections. Sections do not apply to
// deterministic mode or head_dim 64's softcap kernel (Params::section_pairs): grid order there.
// FAH_BWD_GQA_ORDER=global (one section) or l2 (the L2 sections) instead, for measurements and the tests of each order.
enum class BwdGqaOrder { kWave, kGlobal, kL2 };
inline BwdGqaOrder bwd_gqa_order(int kernel_head_dim, int heads_per_cta, int num_sms) {
  if (heads_per_cta <= 1 || kernel_head_dim > 128 || num_sms <= 0) { return BwdGqaOrder::kL2; }
  char const* v = std::getenv("FAH_BWD_GQA_ORDER");
  if (v != nullptr && std::string_view(v) == "global") { return BwdGqaOrder::kGlobal; }
  if (v != nullptr && std::string_view(v) == "l2") { return BwdGqaOrder::kL2; }
  return BwdGqaOrder::kWave;
}

template <class Element, int kHeadDim>
cudaError_t run_bwd_sm90(BwdParams const& p, cudaStream_t stream) {
  using Cfg = BwdTileConfig<kHeadDim>;
  using Traits = std::conditional_t<
      Cfg::kSwapSdP, BwdSwapKernelTraits<Element, kHeadDim, Cfg::kBlockM, Cfg::kBlockN, Cfg::kStages>,
      BwdKernelTraits<Element, kHeadDim, Cfg::kBlockM, Cfg::kBlockN, Cfg::kStages, Cfg::kStagesdO, Cfg::kDKVSplitD>>;
  // Any head_dim that is a multiple of 8 up to the tile width (as the forward): Q, dO, K, V columns past it load as
  // zeros, so the padded columns of dQ, dK, dV are zeros too, and they are never stored to the caller's tensors.
  // V, O, dO, dV have their own head_dim_v (the kernel is the one of the larger): same rule.
  for (int d : {p.head_dim, p.head_dim_v}) {
    if (d <= 0 || d > kHeadDim || d % 8 != 0) { return cudaErrorInvalidValue; }
  }
  if (p.nheads_k <= 0 || p.nheads % p.nheads_k != 0) { return cudaErrorInvalidValue; }
  // A second dQ accumulator: deterministic mode and the untiled postprocess only (BwdParams::dq_lanes).
  if (p.dq_lanes != 1 && (p.dq_lanes != 2 || p.dq_semaphore == nullptr || Cfg::kSwapSdP)) {
    return cudaErrorInvalidValue;
  }
  bool const gqa = p.nheads_k != p.nheads;
  // GQA sums dK/dV in fp32 across CTAs unless one CTA runs the whole group (heads_per_cta).
  bool const sums = gqa && p.heads_per_cta == 1;
  // Deterministic mode needs the dQ counters, and with the sums the dK/dV ones too.
  bool const half_deterministic = (p.dq_semaphore != nullptr) && sums && (p.dkv_semaphore == nullptr);
  if ((p.heads_per_cta != 1 && p.heads_per_cta != p.nheads / p.nheads_k) || sums != (p.dk_accum_ptr != nullptr) ||
      sums != (p.dv_accum_ptr != nullptr) || half_deterministic ||
      (p.dq_semaphore == nullptr && p.dkv_semaphore != nullptr)) {
    return cudaErrorInvalidValue;
  }
  // The workspaces' rows: whole tiles of every kBlockM (bulk copies of LSE/D, dQ chunks, postprocess grid); varlen
  // sequences each start on a tile (flash/common/seqlen.hpp), which needs up to one tile more per sequence.
  bool const varlen = p.cu_seqlens_q != nullptr;
  int64_t const min_rows = varlen ? int64_t(p.total_q) + int64_t(p.batch) * kBwdSeqlenQRounding : p.seqlen_q;
  if (varlen != (p.cu_seqlens_k != nullptr) || p.seqlen_q_rounded < min_rows ||
      p.seqlen_q_rounded % kBwdSeqlenQRounding != 0 || !(p.softcap >= 0.f)) {
    return cudaErrorInvalidValue;
  }
  // Grids cover the longest sequence (seqlen_q/k: the maxima when varlen); blocks past a sequence's end return.
  int const max_rows_q = cute::round_up(p.seqlen_q, kBwdSeqlenQRounding);
  ScoreScales const scales = score_scales(p.softmax_scale, p.softcap);
  // The softcap consumers run the tanh behind a test of score_scale_log2's bits (bwd_consumer_swapped): nonzero.
  if (!(scales.score_scale_log2 > 0.f) || __builtin_isinf(scales.score_scale_log2)) { return cudaErrorInvalidValue; }
  int window_left, window_right;
  kernel_window(p.window_left, p.window_right, p.seqlen_q, p.seqlen_k, window_left, window_right);

  {
    dim3 grid(cute::ceil_div(max_rows_q, preprocess_rows_per_block<kHeadDim>()), p.nheads, p.batch);
    flash_bwd_preprocess_kernel<Element, kHeadDim><<<grid, kPreprocessThreads, 0, stream>>>(p);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) { return err; }
  }

  // Varlen: the packed rows as one batch element; sequences are found by row offsets in the kernels.
  int const rows_q = varlen ? p.total_q : p.seqlen_q, rows_k = varlen ? p.total_k : p.seqlen_k;
  auto gmem = [&](void const* ptr, int seqlen, int head_dim, int nheads, int64_t row, int64_t head, int64_t batch) {
    return make_qkv_gmem<Element>(ptr, seqlen, head_dim, nheads, varlen ? 1 : p.batch, row, head, batch);
  };
  auto mQ = gmem(p.q_ptr, rows_q, p.head_dim, p.nheads, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto mdO = gmem(p.do_ptr, rows_q, p.head_dim_v, p.nheads, p.do_row_stride, p.do_head_stride, p.do_batch_stride);
  auto mK = gmem(p.k_ptr, rows_k, p.head_dim, p.nheads_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
  auto mV = gmem(p.v_ptr, rows_k, p.head_dim_v, p.nheads_k, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
  auto q_tile = Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{};
  auto kv_tile = Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{};
  auto q_smem = take<0, 2>(typename Traits::SmemLayoutQ{});
  // The dQ accumulator is the host's workspace, with rows of kHeadDim floats (padded, not the caller's head_dim).
  int64_t const dq_accum_rows =
      int64_t(p.dq_lanes) * (varlen ? 1 : p.batch) * p.nheads * p.seqlen_q_rounded * kHeadDim / Traits::kDQAccumCols;
  if (dq_accum_rows > INT32_MAX) { return cudaErrorInvalidValue; }
  Tensor mDQaccum = make_tensor(make_gmem_ptr(p.dq_accum_ptr),
                                make_layout(make_shape(int32_t(dq_accum_rows), Int<Traits::kDQAccumCols>{}),
                                            make_stride(Int<Traits::kDQAccumCols>{}, _1{})));

  // dK/dV by TMA store (store_dkv_tma) where the views allow it: 16-byte aligned base and strides (modes of extent 1
  // aside). The GQA fp32 sums (heads_per_cta 1) take none; descriptors are then made over K and V and never used.
  auto tma_aligned = [](void const* ptr, int64_t row, int rows, int64_t head, int nheads, int64_t batch, int nb) {
    auto ok = [](int64_t stride, int extent) {
      return extent <= 1 || (stride > 0 && (stride * int64_t(sizeof(Element))) % 16 == 0);
    };
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && ok(row, rows) && ok(head, nheads) && ok(batch, nb);
  };
  int const batch_views = varlen ? 1 : p.batch;
  bool const dkv_tma =
      !sums &&
      tma_aligned(p.dk_ptr, p.dk_row_stride, rows_k, p.dk_head_stride, p.nheads_k, p.dk_batch_stride, batch_views) &&
      tma_aligned(p.dv_ptr, p.dv_row_stride, rows_k, p.dv_head_stride, p.nheads_k, p.dv_batch_stride, batch_views);
  auto out_gmem = [&](void* ptr, auto const& fallback, int head_dim, int64_t row, int64_t head, int64_t batch) {
    auto view = dkv_tma ? gmem(ptr, rows_k, head_dim, p.nheads_k, row, head, batch) : fallback;
    return make_tensor(make_gmem_ptr(const_cast<Element*>(view.data().get())), view.layout());
  };
  auto mdK = out_gmem(p.dk_ptr, mK, p.head_dim, p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride);
  auto mdV = out_gmem(p.dv_ptr, mV, p.head_dim_v, p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride);

  typename Traits::Params kp{
      make_tma_copy(SM90_TMA_LOAD{}, mQ, q_smem, q_tile, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mdO, q_smem, q_tile, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mK, typename Traits::SmemLayoutKV{}, kv_tile, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mV, typename Traits::SmemLayoutKV{}, kv_tile, _1{}),
      make_tma_copy(SM90_TMA_REDUCE_ADD{}, mDQaccum, typename Traits::SmemLayoutDQChunk{}),
      make_tma_copy(SM90_TMA_STORE{}, mdK, typename Traits::SmemLayoutKV{}, kv_tile, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, mdV, typename Traits::SmemLayoutKV{}, kv_tile, _1{}),
      mQ.shape(),
      mdO.shape(),
      mK.shape(),
      mV.shape(),
      int32_t(dq_accum_rows),
      static_cast<Element*>(p.dk_ptr),
      static_cast<Element*>(p.dv_ptr),
      p.dk_batch_stride,
      p.dk_row_stride,
      p.dk_head_stride,
      p.dv_batch_stride,
      p.dv_row_stride,
      p.dv_head_stride,
      p.head_dim,
      p.head_dim_v,
      p.dq_accum_ptr,
      p.lse_log2_ptr,
      p.dpsum_ptr,
      p.dk_accum_ptr,
      p.dv_accum_ptr,
      p.nheads,
      p.nheads_k,
      p.seqlen_q,
      p.seqlen_k,
      p.seqlen_q_rounded,
      p.cu_seqlens_q,
      p.cu_seqlens_k,
      p.total_q,
      p.total_k,
      p.dq_semaphore,
      p.dkv_semaphore,
      p.softmax_scale,
      scales.score_scale_log2,
      scales.softcap_pre,
      window_left,
      window_right,
      p.doc_bounds,
      dkv_tma,
      p.heads_per_cta,
      p.dq_lanes,
      0,  // section_pairs, set below with the grid
  };
  // Softcap and deterministic mode are template arguments: either one's code in the loop (softcap's registers; the
  // memory fences of deterministic mode, which turn every fire-and-forget dQ reduction into a waited-for atomic)
  // would slow the plain kernel down.
  dim3 grid(cute::ceil_div(p.seqlen_k, Traits::kBlockN), p.nheads / p.heads_per_cta, p.batch);
  // Sections under a causal-like mask outside deterministic mode (Params::section_pairs), where the CTA count fits
  // an int. Bytes per pair: the Q and dO rows its CTAs all read and the fp32 dQ rows they all add into.
  if (p.dq_semaphore == nullptr && causal_like(window_left, window_right, p.seqlen_q, p.seqlen_k) &&
      int64_t(grid.x) * grid.y * grid.z <= INT32_MAX) {
    int64_t const pairs = int64_t(grid.y) * grid.z;
    // One CTA per SM: the shared memory (checked here) and the register budget of the warpgroups' setmaxnreg.
    static_assert(Traits::kSmemBytes > 114 * 1024, "wave_section_pairs assumes one backward CTA per SM");
    BwdGqaOrder const order = bwd_gqa_order(kHeadDim, p.heads_per_cta, p.num_sms);
    kp.section_pairs =
        order == BwdGqaOrder::kGlobal ? (pairs > 1 ? int(pairs) : 0)
        : order == BwdGqaOrder::kWave ? wave_section_pairs(pairs, grid.x, p.num_sms)
                                      : l2_section_pairs(pairs,
                                                         double(p.seqlen_q) * p.heads_per_cta *
                                                             ((p.head_dim + p.head_dim_v) * sizeof(Element) +
                                                              kHeadDim * 4.0),
                                                         bwd_section_mib());
  }
  auto launch = [&](auto softcap_c, auto deterministic_c) {
    constexpr bool kSoftcap = decltype(softcap_c)::value, kDeterministic = decltype(deterministic_c)::value;
    auto kernel = flash_bwd_sm90_kernel<Traits, kSoftcap, kDeterministic>;
    constexpr int smem_bytes = Traits::kSmemBytes;
    cudaError_t err = set_max_dynamic_smem_once<cute::tuple<Traits, decltype(softcap_c), decltype(deterministic_c)>>(
        kernel, smem_bytes);
    if (err != cudaSuccess) { return err; }
    kernel<<<grid, Traits::NumThreads, smem_bytes, stream>>>(kp);
    return cudaGetLastError();
  };
  bool const softcap = p.softcap > 0.f, deterministic = p.dq_semaphore != nullptr;
  cudaError_t err = softcap ? (deterministic ? launch(cute::true_type{}, cute::true_type{})
                                             : launch(cute::true_type{}, cute::false_type{}))
                            : (deterministic ? launch(cute::false_type{}, cute::true_type{})
                                             : launch(cute::false_type{}, cute::false_type{}));
  if (err != cudaSuccess) { return err; }

  if constexpr (Traits::kSwapSdP) {
    // dQ accumulator tiles in the dQ GEMM's register order (see bwd_dq_writer).
    dim3 grid(max_rows_q / Traits::kBlockM, p.nheads, p.batch);
    flash_bwd_postprocess_tiled_kernel<Traits><<<grid, Traits::NumMmaThreads, 0, stream>>>(p);
  } else {
    constexpr int kThreads = 256;
    dim3 grid(cute::ceil_div(int64_t(p.seqlen_q) * kHeadDim / 8, int64_t(kThreads)), p.nheads, p.batch);
    flash_bwd_postprocess_kernel<Element, kHeadDim><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace flash

#define FLASH_BWD_INSTANTIATE(HDIM, DTYPE_NAME, ELEMENT)                                               \
  namespace flash {                                                                                    \
  cudaError_t run_bwd_hdim##HDIM##_##DTYPE_NAME(BwdParams const& p, cudaStream_t stream) {             \
    return run_bwd_sm90<ELEMENT, HDIM>(p, stream);                                                     \
  }                                                                                                    \
  }
