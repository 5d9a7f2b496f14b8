// Warp-specialized backward attention kernel for sm_90a (FlashAttention-3 paper §2.1 gradient equations,
// §3 Hopper execution model; the K/V-stationary loop of FlashAttention-2 §3.2).
//
// One CTA per (n_block of kBlockN keys, head, batch), or (GQA, heads_per_cta) per (n_block, K/V head, batch)
// running the group's query heads one after another; K and V stay resident in shared memory.
//   warpgroup 0        Producer: one thread loads K, V once (TMA), then Q and dO tiles of kBlockM query rows
//                      (and, kSwapSdP, their LSE and D) through a kStages-deep pipeline (PipelineTmaAsync); warp 1
//                      adds finished dQ tiles into the fp32 accumulator (TMA reduce-add).
//   warpgroups 1..2    Consumers. Per Q tile: S = Q Kᵀ and dP = dO Vᵀ, P = exp2(S·scale_log2 − LSE_log2),
//                      dS = P ∘ (dP − D), dV += Pᵀ dO, dK += dSᵀ Q, dQ_tile = dS K.
//                      kSwapSdP (head_dim <= 128): Sᵀ/dPᵀ per warpgroup of 64 keys, Pᵀ and dSᵀ stay in registers
//                      as the A operands of dV/dK; dS goes to shared memory for dQ only.
//                      Otherwise (head_dim 256): P and dS go to shared memory for every GEMM; dQ_tile, in two
//                      passes of 128 columns, goes to shared memory for the same writer warp (the first pass to
//                      its own buffer, the second to the tile's Q stage); dO has a one-stage pipeline of its own.
//                      dK and dV stay in registers across the loop and are written once (dK scaled by α).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include "flash/common/mask.hpp"
#include "flash/common/semaphore.hpp"
#include "flash/common/seqlen.hpp"
#include "flash/config.hpp"
#include "flash/common/utils.hpp"

namespace flash {

using namespace cute;

// What both backward variants share: tile sizes, thread roles, the Q/dO/K/V shared-memory layouts, the Q/dO
// pipeline, the TMA descriptors and the kernel parameters.
// kStagesdO: dO's pipeline depth (a pipeline of its own when it differs from Q's kStages). SmemLayoutDQChunk: one box
// of a dQ tile as the dQ writer warp adds it into the fp32 workspace, seen as (rows, kDQAccumCols).
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, int kStagesdO_,
          class SmemLayoutDQChunk_, int kDQAccumCols_>
struct BwdTraitsBase {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kStagesdO = kStagesdO_;
  static constexpr bool kSeparatedO = kStagesdO != kStages;
  static constexpr int NumMmaWarpGroups = 2;
  static constexpr int NumMmaThreads = NumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr int NumThreads = NumMmaThreads + cutlass::NumThreadsPerWarpGroup;

  template <int kRows, int kCols>
  using KMajorAtom = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element,
                                                                                  Int<kRows>, Int<kCols>>());
  // Q and dO: (kBlockM, head_dim, stages); K and V: (kBlockN, head_dim).
  template <int kS>
  using SmemLayoutRows = decltype(tile_to_shape(KMajorAtom<kBlockM, kHeadDim>{},
                                                Shape<Int<kBlockM>, Int<kHeadDim>, Int<kS>>{}));
  using SmemLayoutQ = SmemLayoutRows<kStages>;
  using SmemLayoutdO = SmemLayoutRows<kStagesdO>;
  using SmemLayoutKV = decltype(tile_to_shape(KMajorAtom<kBlockN, kHeadDim>{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // The same bytes read transposed: MN-major operands of the dK/dV and dQ GEMMs.
  template <int kS>
  using SmemLayoutRowsT = decltype(composition(
      SmemLayoutRows<kS>{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kS>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutQt = SmemLayoutRowsT<kStages>;
  using SmemLayoutdOt = SmemLayoutRowsT<kStagesdO>;
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  using PipelinedO = cutlass::PipelineTmaAsync<kStagesdO>;  // used when kSeparatedO
  using PipelinedOState = typename PipelinedO::PipelineState;
  static constexpr uint32_t kTmaBytesKV = 2 * kBlockN * kHeadDim * sizeof(Element);

  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen, head_dim, nheads, batch)
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                          make_layout(ShapeQKV{}, StrideQKV{})));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKV{},
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  // dQ tiles reach the fp32 workspace through shared memory and TMA reduce-add (the dQ writer warp), in boxes of
  // SmemLayoutDQChunk over the workspace seen as (rows, kDQAccumCols); one box per warpgroup and pass.
  using SmemLayoutDQChunk = SmemLayoutDQChunk_;
  static constexpr int kDQAccumCols = kDQAccumCols_;
  static constexpr int kDQChunkRows = decltype(size<0>(SmemLayoutDQChunk{}))::value;
  static constexpr int kDQChunkCols = decltype(size<1>(SmemLayoutDQChunk{}))::value;
  static constexpr int kDQChunkFloats = kDQChunkRows * kDQChunkCols;
  static_assert(decltype(cosize(SmemLayoutDQChunk{}))::value == kDQChunkFloats, "a chunk is one dense box");
  using DQAccumTensor = decltype(make_tensor(make_gmem_ptr(static_cast<float*>(nullptr)),
                                             make_layout(make_shape(int32_t(0), Int<kDQAccumCols>{}),
                                                         make_stride(Int<kDQAccumCols>{}, _1{}))));
  using TmaDQ = decltype(make_tma_copy(SM90_TMA_REDUCE_ADD{}, DQAccumTensor{}, SmemLayoutDQChunk{}));
  // dK and dV leave through sK and sV (store_dkv_tma): K/V-shaped tiles, stored.
  using GmemTensorOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)),
                                             make_layout(ShapeQKV{}, StrideQKV{})));
  using TmaDKV = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutKV{},
                                        Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  struct Params {
    TmaQ tma_q;
    TmaQ tma_do;
    TmaKV tma_k;
    TmaKV tma_v;
    TmaDQ tma_dq;
    TmaDKV tma_dk;  // dK as K's shape (seqlen or total rows, head_dim, nheads, batch); only when dkv_tma
    TmaDKV tma_dv;
    ShapeQKV shape_q;
    ShapeQKV shape_do;  // dO and V: head_dim_v in place of head_dim
    ShapeQKV shape_k;
    ShapeQKV shape_v;
    int32_t dq_accum_rows;  // rows of the (rows, kDQAccumCols) view of the dQ accumulator
    Element* dk_ptr;
    Element* dv_ptr;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
    // The caller's, <= kHeadDim (multiples of 8): dK columns at or past head_dim, dV ones at or past head_dim_v are
    // not written.
    int head_dim, head_dim_v;
    float* dq_accum_ptr;  // (rows, kHeadDim): the workspace keeps the padded width
    float const* lse_log2_ptr;
    float const* dpsum_ptr;
    float* dk_accum_ptr;  // GQA/MQA with heads_per_cta 1: fp32 (batch, seqlen_k, nheads_k, head_dim) or (total_k, ...)
                          // sums, rows of the caller's head_dim; else null
    float* dv_accum_ptr;  // as dk_accum_ptr with head_dim_v
    int nheads, nheads_k, seqlen_q, seqlen_k;  // varlen: upper bounds of the lengths
    int seqlen_q_rounded;                      // workspace rows per (batch, head), or per head when varlen
    int const* cu_seqlens_q;                   // varlen: (batch + 1) row offsets; else null
    int const* cu_seqlens_k;
    int total_q, total_k;                      // varlen: rows of q and k (SeqlenInfo clamps offsets to them)
    // Deterministic mode (else null): zeroed counters ordering the sums into each dQ tile, per (batch, head, m_block,
    // lane), and (GQA sums) into each dK/dV tile, per (batch, K/V head, n_block) (flash/common/semaphore.hpp).
    int* dq_semaphore;
    int* dkv_semaphore;
    float softmax_scale;  // α: scales dK here and dQ in the postprocess
    // Forward's score transform (flash/common/softmax.hpp, score_scales): P = exp2(x * score_scale_log2 − LSE_log2)
    // with x = S_raw, or x = tanh(S_raw * softcap_pre) under a softcap.
    float score_scale_log2, softcap_pre;
    int window_left, window_right;  // >= 0, unbounded sides already replaced (flash/common/mask.hpp)
    int const* doc_bounds;          // documents (dense self-attention): (batch, seqlen_q, 2) int32; else null
    bool dkv_tma;  // dK/dV stored by TMA (no GQA sums, TMA-compatible views); else per-thread stores
    // Query heads per CTA, one after another over the same K/V tile: 1, or (GQA) the whole group, whose dK/dV then
    // stay in registers across the group's heads and are stored once (no fp32 sums).
    int heads_per_cta;
    int dq_lanes;  // copies of the dQ accumulator, one after another (BwdParams::dq_lanes)
    // > 0: CTAs in sections of this many (head group, batch) pairs, key blocks in order (the longest first under a
    // causal-like mask) across a section's pairs (the kernel's renumbering); 0: the grid's own order. Ignored in
    // deterministic mode, whose CTAs wait only for key blocks launched before them, and by head_dim 64's softcap
    // kernel.
    int section_pairs;
  };
};

// Variant for head_dim <= 128 (kSwapSdP): S and dP are computed transposed, Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, with the
// warpgroups splitting the keys, so each warpgroup holds Pᵀ and dSᵀ for its 64 keys in the accumulator layout that
// is also the register A operand of dV += Pᵀ dO and dK += dSᵀ Q (RS WGMMA: P never goes to shared memory). dS goes
// to shared memory (double-buffered, one barrier per iteration) only for dQ = dS K, which sums over all keys.
// LSE and D of the tile's rows come with Q and dO (bulk copies into the same pipeline stage): each thread needs
// them per column of Sᵀ. dQ_tile goes to shared memory in the accumulator's register order (conflict-free 16-byte
// stores) and a writer warp adds it into the fp32 workspace with TMA reduce-add, so the consumers issue no atomics;
// the workspace therefore holds each tile in that register order, which the postprocess undoes.
// dQ chunks of the kSwapSdP variant: the workspace seen as (rows, 128), boxes of (32, 128) = 16 KiB, one warpgroup's
// half of a (kBlockM, head_dim) dQ tile in the dQ GEMM's register order (the tiled postprocess undoes it).
using BwdSwapDQChunk = Layout<Shape<_32, _128>, Stride<_128, _1>>;

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct BwdSwapKernelTraits
    : BwdTraitsBase<Element_, kHeadDim_, kBlockM_, kBlockN_, kStages_, kStages_, BwdSwapDQChunk, 128> {
  using Base = BwdTraitsBase<Element_, kHeadDim_, kBlockM_, kBlockN_, kStages_, kStages_, BwdSwapDQChunk, 128>;
  using typename Base::Element;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDim, Base::kStages;
  static constexpr bool kSwapSdP = true;  // also: LSE/D travel with Q/dO into shared memory
  // Per consumer thread at head_dim 128: dK + dV 128, Sᵀ + dPᵀ 64, their 16-bit copies 32, dQ 32; at head_dim 64
  // (kBlockM 128): dK + dV 64, Sᵀ + dPᵀ 128, copies 64, dQ 32. Budgets with the fewest spills (2026-11-29):
  // 40/232 leaves head_dim 128 spill-free (24/240 spilled 72 bytes in the producer); head_dim 64 spills ~20
  // words inside the consumer loop at 232, so it keeps 240.
  static constexpr int kProducerRegs = kHeadDim <= 64 ? 24 : 40;
  static constexpr int kConsumerRegs = kHeadDim <= 64 ? 240 : 232;
  static_assert(register_budget_fits<Base::NumThreads, kProducerRegs, kConsumerRegs>());
  static_assert(kBlockN == 64 * Base::NumMmaWarpGroups, "each warpgroup owns 64 keys");
  static_assert(kBlockM % 64 == 0 && kHeadDim <= 128);

  // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: (M = kBlockN keys, N = kBlockM rows, K = head_dim), warpgroups split M.
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM>, Int<kHeadDim>>>(),
      Layout<Shape<_2, _1, _1>>{}));
  // dV += Pᵀ dO and dK += dSᵀ Q, A from registers: (M = kBlockN keys, N = head_dim, K = kBlockM rows).
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockM>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));
  // dQ_tile = dS K: (M = kBlockM rows, N = head_dim, K = kBlockN keys). With 64 rows per warpgroup (head_dim 64's
  // kBlockM 128) the warpgroups split M: each reads only its own rows of dS, with N the whole head_dim (m64n64k16,
  // as FlashAttention-3/4 run head_dim 64), instead of all of dS twice at N = head_dim / 2. Else they split N.
  // H200, 2026-12-03 (session 35, bf16, 3 rounds, TFLOP/s): head_dim 64 backward 2048-16384 +3-6 % (e.g. non-causal
  // 16384 468-472 -> 485-490), HGMMAs per iteration 40 -> 32.
  static constexpr bool kDQSplitRows = kBlockM == 64 * Base::NumMmaWarpGroups;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kDQSplitRows ? 64 : kBlockM>, Int<kDQSplitRows ? kHeadDim : kHeadDim / 2>,
                                 Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kDQSplitRows ? 2 : 1>, Int<kDQSplitRows ? 1 : 2>, _1>>{}));

  // dS: (kBlockM, kBlockN, 2 buffers), keys contiguous (K-major A operand of dQ); written through the transposed
  // view from the dSᵀ accumulator layout.
  using SmemLayoutdS = decltype(tile_to_shape(typename Base::template KMajorAtom<kBlockM, kBlockN>{},
                                              Shape<Int<kBlockM>, Int<kBlockN>, _2>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, _2>{}, Step<_2, _1, _3>{})));

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutQ>, 1024> smem_q;
    cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutQ>, 1024> smem_do;
    cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutKV>, 1024> smem_k;
    cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutKV>, 1024> smem_v;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdS>, 1024> smem_ds;
    cute::array_aligned<float, kBlockM * kHeadDim, 1024> smem_dq;  // two chunks, one per warpgroup
    cute::array_aligned<float, kBlockM * kStages, 128> smem_lse;
    cute::array_aligned<float, kBlockM * kStages, 128> smem_dpsum;
    cutlass::arch::ClusterTransactionBarrier barrier_kv;
    typename Base::Pipeline::SharedStorage pipeline_q;  // Q, dO, LSE and D
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "tile configuration exceeds the shared memory of one CTA");
  static constexpr uint32_t kStatBytes = kBlockM * sizeof(float);
  static_assert(kStatBytes % 16 == 0, "bulk copies move multiples of 16 bytes");
  static constexpr uint32_t kTmaBytesQdO = 2 * kBlockM * kHeadDim * sizeof(Element) + 2 * kStatBytes;
  static_assert(kBlockM * kHeadDim == 2 * Base::kDQChunkFloats, "one dQ chunk per warpgroup");
  static constexpr int kDQChunksPerBlock = 2;
  static constexpr bool kDQPass1InQ = false;  // (the head_dim 256 variant's option)
  // (row tile, column tile) of chunk i of Q tile m_block in the (rows, 128) view of the workspace, tiled by chunks;
  // row_base: the first workspace row of this (batch, head).
  CUTLASS_DEVICE static auto dq_chunk_tile(int64_t row_base, int m_block, int i) {
    return make_coord(int(row_base * kHeadDim / Base::kDQChunkFloats + int64_t(m_block) * 2 + i), 0);
  }
  // Named barriers (user ids; CUTLASS offsets them past its reserved ones): 1 all consumers; per warpgroup w,
  // 2 + w "dQ chunk written" and 4 + w "dQ chunk free", between that warpgroup and the dQ writer warp.
  static constexpr int kBarrierDQFull = 2, kBarrierDQEmpty = 4, kBarrierDQFull1 = 6;  // (no second pass here)
  static constexpr int kDQBarrierThreads = cutlass::NumThreadsPerWarpGroup + cutlass::NumThreadsPerWarp;
};

// dQ chunks of the head_dim 256 variant: one warpgroup's (64 rows, 64 columns) of a dQ pass over the row-major
// (rows, head_dim) workspace, 128-byte swizzled so the accumulator's float2 stores conflict 2-way at most (4-way
// row-major; bank simulation, session 14 review).
using BwdDQChunk64x64 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{}, Shape<_64, _64>{}));

// Variant for head_dim 256: S and dP as (rows, keys) with the warpgroups splitting the keys; P and dS go to shared
// memory and every GEMM reads both operands from there. kDKVSplitD: the dK/dV GEMMs split head_dim across the two
// warpgroups (each owns all kBlockN = 64 keys and half of head_dim) instead of splitting the keys. dO has its own
// pipeline of kStagesdO stages (1 at head_dim 256: its shared memory holds the dQ staging buffer instead).
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, int kStagesdO_, bool kDKVSplitD_>
struct BwdKernelTraits
    : BwdTraitsBase<Element_, kHeadDim_, kBlockM_, kBlockN_, kStages_, kStagesdO_, BwdDQChunk64x64, kHeadDim_> {
  using Base = BwdTraitsBase<Element_, kHeadDim_, kBlockM_, kBlockN_, kStages_, kStagesdO_, BwdDQChunk64x64, kHeadDim_>;
  using typename Base::Element;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDim, Base::kStages;
  static_assert(Base::kSeparatedO, "Q and dO have separate pipelines here");
  static constexpr bool kSwapSdP = false;
  static constexpr bool kDKVSplitD = kDKVSplitD_;
  // setmaxnreg budgets, 24/240 or 56/224 (x 128 + x 256 = 64512 of the 65536 registers per SM), whichever spilled
  // least on 2026-11-29: head_dim 128 spilled ~16 words inside the consumer loop at 56/224 and a few loop-invariant
  // words at 24/240; head_dim 256 spilled 20 bytes at 56/224 and 184 bytes (mostly producer) at 24/240.
  static constexpr int kProducerRegs = kHeadDim > 128 ? 56 : 24;
  static constexpr int kConsumerRegs = kHeadDim > 128 ? 224 : 240;
  static_assert(register_budget_fits<Base::NumThreads, kProducerRegs, kConsumerRegs>());
  // dQ_tile is computed in head_dim slices so its accumulator stays at 32 registers per thread beside the 128 of
  // dK and dV (a whole head_dim 256 tile needs 64 and spills).
  static constexpr int kDQPasses = kHeadDim > 128 ? 2 : 1;
  static constexpr int kDQCols = kHeadDim / kDQPasses;
  static_assert(kBlockM == 64, "one 64-row WGMMA tile of queries per iteration");
  static_assert(kDKVSplitD ? kBlockN == 64 : kBlockN == 128);

  // S = Q Kᵀ and dP = dO Vᵀ: (M = kBlockM rows, N = kBlockN keys, K = head_dim), warpgroups split N.
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kBlockN / 2>, Int<kHeadDim>>>(),
      Layout<Shape<_1, _2, _1>>{}));
  // dV += Pᵀ dO and dK += dSᵀ Q: (M = kBlockN keys, N = head_dim, K = kBlockM rows); both operands MN-major.
  using AtomLayoutdKV = std::conditional_t<kDKVSplitD, Layout<Shape<_1, _2, _1>>, Layout<Shape<_2, _1, _1>>>;
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<_64, Int<kDKVSplitD ? kHeadDim / 2 : kHeadDim>, Int<kBlockM>>, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      AtomLayoutdKV{}));
  // dQ_tile = dS K: (M = kBlockM rows, N = kDQCols of head_dim per pass, K = kBlockN keys), warpgroups split N.
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kDQCols / 2>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_1, _2, _1>>{}));

  // P and dS: (kBlockM, kBlockN), and the same bytes read transposed.
  using SmemLayoutPdS = decltype(tile_to_shape(typename Base::template KMajorAtom<kBlockM, kBlockN>{},
                                               Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Step<_2, _1>{})));

  // One dQ pass (kBlockM, kDQCols) in shared memory: warpgroup w's chunk is columns [64 w, 64 w + 64), the
  // contiguous floats [w, w + 1) * kDQChunkFloats laid out as SmemLayoutDQChunk.
  using SmemLayoutDQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{},
                                              Shape<Int<kBlockM>, Int<kDQCols>>{}));
  static_assert(kDQCols == 2 * Base::kDQChunkCols && kBlockM == Base::kDQChunkRows, "one dQ chunk per warpgroup");
  static constexpr int kDQChunksPerBlock = 2 * kDQPasses;  // per Q tile, in (pass, warpgroup) order
  // The second pass is staged in the tile's own Q stage, which its GEMMs have finished reading by then (warpgroup w
  // writes the half that only its dK GEMM reads: head_dim columns [128 w, 128 w + 128)), so the writer has until the
  // next tile to drain it instead of the few hundred cycles of one dQ GEMM. The consumers hand the stage back to the
  // producer once the writer has read it (kBarrierDQEmpty, which then covers both passes' chunks).
  static constexpr bool kDQPass1InQ = kDQPasses == 2;
  // Its release waits for the next tile, so the producer needs a second Q stage to load that tile into; and the
  // other warpgroup must not read the half being written (true when dK/dV split head_dim).
  static_assert(!kDQPass1InQ || (kStages >= 2 && kDKVSplitD), "the second dQ pass needs its warpgroup's own Q half");
  static_assert(!kDQPass1InQ || kBlockM * kHeadDim == 2 * cute::cosize_v<SmemLayoutDQ>, "a Q stage holds one pass");
  // As in the kSwapSdP variant, over the row-major (rows, head_dim) workspace: chunk i holds columns [64 i, 64 i + 64).
  CUTLASS_DEVICE static auto dq_chunk_tile(int64_t row_base, int m_block, int i) {
    return make_coord(int(row_base / kBlockM + m_block), i);
  }

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutQ>, 1024> smem_q;
    cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutdO>, 1024> smem_do;
    cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutKV>, 1024> smem_k;
    cute::array_aligned<Element, cute::cosize_v<typename Base::SmemLayoutKV>, 1024> smem_v;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutPdS>, 1024> smem_p;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutPdS>, 1024> smem_ds;
    cute::array_aligned<float, cute::cosize_v<SmemLayoutDQ>, 1024> smem_dq;
    cutlass::arch::ClusterTransactionBarrier barrier_kv;
    typename Base::Pipeline::SharedStorage pipeline_q;
    typename Base::PipelinedO::SharedStorage pipeline_do;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "tile configuration exceeds the shared memory of one CTA");
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesdO = kTmaBytesQ;
  // Named barriers as in the kSwapSdP variant: 1 all consumers; 2 + w and 4 + w between warpgroup w and the writer;
  // 6 + w: warpgroup w's second-pass chunk written.
  static constexpr int kBarrierDQFull = 2, kBarrierDQEmpty = 4, kBarrierDQFull1 = 6;
  static constexpr int kDQBarrierThreads = cutlass::NumThreadsPerWarpGroup + cutlass::NumThreadsPerWarp;
};

// Softcap: one element of t = tanh(S_raw * softcap_pre) (−inf where masked) and dP in; P and
// dS = P ∘ (dP − D) ∘ (1 − t²) out (the chain rule through c·tanh(α S_raw / c); α is applied to dQ and dK later).
// The clamp keeps a masked element's factor at 0 instead of 0·(1 − ∞).
CUTLASS_DEVICE void softcap_p_ds(float& s, float& dp, float score_scale_log2, float lse_log2, float d) {
  float const t = s;
  s = exp2f(fmaf(t, score_scale_log2, -lse_log2));
  float const tc = fmaxf(t, -1.f);
  dp = s * (dp - d) * (1.f - tc * tc);
}

// Producer perspective.
template <class Traits>
CUTLASS_DEVICE void bwd_producer(typename Traits::Params const& params, typename Traits::SharedStorage& ss,
                                 typename Traits::Pipeline& pipeline, typename Traits::PipelinedO& pipeline_do,
                                 int n_block, int bidh0, SeqlenInfo const& info, int m_block_min, int m_block_max) {
  using BarrierType = cutlass::arch::ClusterTransactionBarrier::ValueType;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;

  Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q.data()), typename Traits::SmemLayoutQ{});    // (M, d, stages)
  Tensor sdO = make_tensor(make_smem_ptr(ss.smem_do.data()), typename Traits::SmemLayoutdO{});  // (M, d, stages)
  Tensor sK = make_tensor(make_smem_ptr(ss.smem_k.data()), typename Traits::SmemLayoutKV{});   // (N, d)
  Tensor sV = make_tensor(make_smem_ptr(ss.smem_v.data()), typename Traits::SmemLayoutKV{});   // (N, d)

  int const bidh_kv = bidh0 / (params.nheads / params.nheads_k);
  Tensor mK = domain_offset(make_coord(info.offset_k, _0{}),
                            params.tma_k.get_tma_tensor(params.shape_k)(_, _, bidh_kv, info.bidb));
  Tensor mV = domain_offset(make_coord(info.offset_k, _0{}),
                            params.tma_v.get_tma_tensor(params.shape_v)(_, _, bidh_kv, info.bidb));
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));  // (N, d)
  Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));  // (N, d)
  auto [tKgK, tKsK] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
  auto [tVgV, tVsV] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

  ss.barrier_kv.arrive_and_expect_tx(Traits::kTmaBytesKV);
  copy(params.tma_k.with(reinterpret_cast<BarrierType&>(ss.barrier_kv), 0), tKgK, tKsK);
  copy(params.tma_v.with(reinterpret_cast<BarrierType&>(ss.barrier_kv), 0), tVgV, tVsV);

  auto write_state = cutlass::make_producer_start_state<typename Traits::Pipeline>();
  auto write_state_do = cutlass::make_producer_start_state<typename Traits::PipelinedO>();
  // The CTA's query heads (params.heads_per_cta: 1, or a whole GQA group sharing this K/V tile), one after another.
  for (int bidh = bidh0; bidh < bidh0 + params.heads_per_cta; ++bidh) {
    // This sequence's rows (varlen: from its row offset; rows past it are loaded but never used).
    auto rows_q = [&](auto const& tma, auto const& shape) {
      return domain_offset(make_coord(info.offset_q, _0{}), tma.get_tma_tensor(shape)(_, _, bidh, info.bidb));
    };
    Tensor mQ = rows_q(params.tma_q, params.shape_q);
    Tensor mdO = rows_q(params.tma_do, params.shape_do);
    Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));    // (M, d, m_blocks)
    Tensor gdO = local_tile(mdO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (M, d, m_blocks)
    auto [tQgQ, tQsQ] =
        tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tdOgdO, tdOsdO] =
        tma_partition(params.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
    for (int m_block = m_block_min; m_block < m_block_max; ++m_block) {
      pipeline.producer_acquire(write_state);
      BarrierType* full = pipeline.producer_get_barrier(write_state);
      copy(params.tma_q.with(*full, 0), tQgQ(_, m_block), tQsQ(_, write_state.index()));
      if constexpr (Traits::kSeparatedO) {
        // dO's stage frees up once the dV GEMM has read it, which is earlier in an iteration than Q's.
        pipeline_do.producer_acquire(write_state_do);
        copy(params.tma_do.with(*pipeline_do.producer_get_barrier(write_state_do), 0), tdOgdO(_, m_block),
             tdOsdO(_, write_state_do.index()));
        ++write_state_do;
      } else {
        copy(params.tma_do.with(*full, 0), tdOgdO(_, m_block), tdOsdO(_, write_state.index()));
      }
      if constexpr (Traits::kSwapSdP) {
        // LSE_log2 and D of the tile's rows (workspace rows come in whole tiles, so every tile is whole).
        int64_t const row0 = bwd_workspace_row<kBwdSeqlenQRounding>(params.cu_seqlens_q != nullptr, params.nheads,
                                                                     params.seqlen_q_rounded, info, bidh) +
                             m_block * kBlockM;
        int const off = write_state.index() * kBlockM;
        SM90_BULK_COPY_G2S::copy(params.lse_log2_ptr + row0, full, ss.smem_lse.data() + off, Traits::kStatBytes);
        SM90_BULK_COPY_G2S::copy(params.dpsum_ptr + row0, full, ss.smem_dpsum.data() + off, Traits::kStatBytes);
      }
      ++write_state;
    }
  }
  pipeline.producer_tail(write_state);
  if constexpr (Traits::kSeparatedO) { pipeline_do.producer_tail(write_state_do); }
}

// log2 of the dQ accumulator copies a key block chooses among (BwdParams::dq_lanes is 1 or 2; always 1 for kSwapSdP):
// key block n adds into copy n & dq_lane_bits, and a lane's turns and counters are indexed with it.
template <class Traits>
CUTLASS_DEVICE int dq_lane_bits(typename Traits::Params const& params) {
  return Traits::kSwapSdP ? 0 : params.dq_lanes - 1;
}

// Deterministic mode: the dQ tile (m_block) of this (sequence, head) takes the sums of the key blocks that see it in
// decreasing n_block order, in each lane (dq_lanes: key block n adds into copy n % dq_lanes of the accumulator, with
// a counter of its own); returns that counter and this CTA's turn. Each CTA walks its query blocks upwards from
// the one nearest the diagonal, where (causal or windowed) it is the highest key block and so goes first: no CTA
// waits for one that reaches the tile later. The kernel launches key blocks in reverse order in this mode, so a CTA
// only ever waits for CTAs launched before it (no deadlock when a head has more key blocks than SMs).
template <class Traits>
CUTLASS_DEVICE int* dq_turn(typename Traits::Params const& params, SeqlenInfo const& info, int bidh, int m_block,
                            int n_block, int& turn) {
  int n_block_min, n_block_max;
  make_window<Traits::kBlockM, Traits::kBlockN>(params, info).n_block_range(m_block, n_block_min, n_block_max);
  // Key blocks past the grid (a max_seqlen_k below a sequence's length, trusted under torch.compile) never run: count
  // turns among the launched ones, so that a wrong maximum drops their sums, as in the default mode, but never hangs.
  // Turns count the launched key blocks above this one in its lane.
  int const lane_bits = dq_lane_bits<Traits>(params);
  turn = (min(n_block_max, int(gridDim.x)) - 1 - n_block) >> lane_bits;
  // One counter per kBlockM rows of the dQ workspace and lane (in bounds wherever the workspace is, whatever
  // max_seqlen says).
  int64_t const row = bwd_workspace_row<kBwdSeqlenQRounding>(params.cu_seqlens_q != nullptr, params.nheads,
                                                               params.seqlen_q_rounded, info, bidh);
  return params.dq_semaphore + ((row / Traits::kBlockM + m_block) << lane_bits) + (n_block & lane_bits);
}

// Walks an accumulator fragment of a (seqlen, head_dim) tile as pairs of adjacent columns, rows at or past
// `row_limit` and columns at or past `col_limit` (even, so a pair is in or out whole) skipped:
// f(element offset row * row_stride + col, value of col, value of col + 1).
template <class TensorAcc, class TensorCoord, class F>
CUTLASS_DEVICE void for_each_row_pair(TensorAcc const& acc, TensorCoord const& coord, int64_t row_stride,
                                      int row_offset, int row_limit, int col_limit, F&& f) {
  Tensor a = make_tensor(acc.data(), acc_rowcol(acc.layout()));
  Tensor c = make_tensor(coord.data(), acc_rowcol(coord.layout()));
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < size<0>(a); ++r) {
    int const row = row_offset + get<0>(c(r, 0));
    if (row < row_limit) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(a); j += 2) {
        int const col = get<1>(c(r, j));
        if (col < col_limit) { f(row * row_stride + col, a(r, j), a(r, j + 1)); }
      }
    }
  }
}

// Epilogue of both consumers: dV and α·dK for the keys of this block that exist (zeros when no query sees them),
// written directly (MHA, or a CTA that ran a whole GQA group) or added into the group's fp32 sums (dk_accum_ptr);
// only the caller's head_dim (dK) and head_dim_v (dV) columns.
template <class Traits, bool kDeterministic, class TensorAcc>
CUTLASS_DEVICE void store_dkv(typename Traits::Params const& params, TensorAcc const& tdVrdV,
                              TensorAcc const& tdKrdK, int mma_tidx, int n_block, int bidh, SeqlenInfo const& info) {
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  typename Traits::TiledMmadKV tiled_mma_dkv;
  Tensor tdKVcdKV =
      tiled_mma_dkv.get_thread_slice(mma_tidx).partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  int const key_offset = n_block * kBlockN;
  int const group = params.nheads / params.nheads_k;
  int const bidh_kv = bidh / group;  // MHA: bidh; a CTA that ran a whole GQA group: bidh is the group's first head
  if (params.dk_accum_ptr != nullptr) {
    // Rows (b, key) of nheads_k * head_dim{,_v} floats: the host's contiguous k- and v-shaped sums.
    int64_t const row = (int64_t(info.bidb) * params.seqlen_k + info.offset_k) * params.nheads_k + bidh_kv;
    // float2 atomics: the query heads of a group add into the same rows; in deterministic mode in head order.
    int* sem = nullptr;
    if constexpr (kDeterministic) {
      int const num_n_blocks = cute::ceil_div(params.seqlen_k, kBlockN);
      sem = params.dkv_semaphore + (int64_t(info.batch_idx) * params.nheads_k + bidh_kv) * num_n_blocks + n_block;
      if (mma_tidx == 0) { semaphore_wait(sem, bidh - bidh_kv * group); }
      cutlass::arch::NamedBarrier::sync(Traits::NumMmaThreads, 1);
    }
    auto add = [](float* base, float scale) {
      return [=](int64_t idx, float x0, float x1) {
        atomicAdd(reinterpret_cast<float2*>(base + idx), make_float2(x0 * scale, x1 * scale));
      };
    };
    for_each_row_pair(tdVrdV, tdKVcdKV, int64_t(params.nheads_k) * params.head_dim_v, key_offset, info.seqlen_k,
                      params.head_dim_v, add(params.dv_accum_ptr + row * params.head_dim_v, 1.f));
    for_each_row_pair(tdKrdK, tdKVcdKV, int64_t(params.nheads_k) * params.head_dim, key_offset, info.seqlen_k,
                      params.head_dim, add(params.dk_accum_ptr + row * params.head_dim, params.softmax_scale));
    if constexpr (kDeterministic) {
      __threadfence();
      cutlass::arch::NamedBarrier::sync(Traits::NumMmaThreads, 1);
      if (mma_tidx == 0) { semaphore_release(sem); }
    }
  } else {
    // dK/dV of nheads_k heads: MHA, or a CTA that ran a whole GQA group (heads_per_cta).
    using Element = typename Traits::Element;
    auto store = [](Element* base, float scale) {
      return [=](int64_t idx, float x0, float x1) {
        cutlass::Array<Element, 2> pair;
        pair[0] = Element(x0 * scale);
        pair[1] = Element(x1 * scale);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(base + idx) = pair;
      };
    };
    for_each_row_pair(tdVrdV, tdKVcdKV, params.dv_row_stride, key_offset, info.seqlen_k, params.head_dim_v,
                      store(params.dv_ptr + info.bidb * params.dv_batch_stride + info.offset_k * params.dv_row_stride +
                                bidh_kv * params.dv_head_stride,
                            1.f));
    for_each_row_pair(tdKrdK, tdKVcdKV, params.dk_row_stride, key_offset, info.seqlen_k, params.head_dim,
                      store(params.dk_ptr + info.bidb * params.dk_batch_stride + info.offset_k * params.dk_row_stride +
                                bidh_kv * params.dk_head_stride,
                            params.softmax_scale));
  }
}

// dK and dV through shared memory and TMA stores instead of per-thread ones (each warp instruction of those touches
// 8 rows with 4 bytes per thread; in the forward the same change halved the per-tile cost). They go over sK and sV,
// which every GEMM of the CTA has finished reading once both consumer warpgroups reach the first barrier (each waited
// for all its WGMMAs at the end of its last tile; with no tile, K and V were never loaded). Returns false, having done
// nothing, where TMA cannot store: GQA sums or views TMA cannot take (!dkv_tma), or a varlen key block reaching past
// its sequence (a TMA store clips only at the packed tensor's end, so it would write into the next sequence's rows).
template <class Traits, class TensorAcc>
CUTLASS_DEVICE bool store_dkv_tma(typename Traits::Params const& params, typename Traits::SharedStorage& ss,
                                  TensorAcc const& tdVrdV, TensorAcc const& tdKrdK, int mma_tidx, int n_block,
                                  int bidh, SeqlenInfo const& info) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  if (!params.dkv_tma || (params.cu_seqlens_k != nullptr && (n_block + 1) * kBlockN > info.seqlen_k)) { return false; }
  Tensor rdV = make_tensor_like<Element>(tdVrdV);
  Tensor rdK = make_tensor_like<Element>(tdKrdK);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(tdVrdV); ++i) {
    rdV(i) = Element(tdVrdV(i));
    rdK(i) = Element(tdKrdK(i) * params.softmax_scale);
  }
  Tensor sK = make_tensor(make_smem_ptr(ss.smem_k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.smem_v.data()), typename Traits::SmemLayoutKV{});
  typename Traits::TiledMmadKV tiled_mma_dkv;
  auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, tiled_mma_dkv);
  auto thr_copy = smem_copy.get_thread_slice(mma_tidx);
  cutlass::arch::NamedBarrier::sync(Traits::NumMmaThreads, 1);  // no GEMM reads sK or sV any more
  copy(smem_copy, thr_copy.retile_S(rdV), thr_copy.partition_D(sV));
  copy(smem_copy, thr_copy.retile_S(rdK), thr_copy.partition_D(sK));
  tma_store_fence();  // the generic-proxy writes above, before the async proxy reads them
  cutlass::arch::NamedBarrier::sync(Traits::NumMmaThreads, 1);
  if (mma_tidx == 0) {
    auto tile = [&](auto const& tma, auto const& shape) {
      int const bidh_kv = bidh / (params.nheads / params.nheads_k);  // MHA, or a whole GQA group in this CTA
      Tensor m = domain_offset(make_coord(info.offset_k, _0{}), tma.get_tma_tensor(shape)(_, _, bidh_kv, info.bidb));
      return local_tile(m, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));  // (N, d)
    };
    Tensor gdK = tile(params.tma_dk, params.shape_k);
    Tensor gdV = tile(params.tma_dv, params.shape_v);
    auto [tdKgdK, tdKsdK] =
        tma_partition(params.tma_dk, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gdK));
    auto [tdVgdV, tdVsdV] =
        tma_partition(params.tma_dv, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gdV));
    copy(params.tma_dk, tdKsdK, tdKgdK);
    copy(params.tma_dv, tdVsdV, tdVgdV);
    tma_store_arrive();
    tma_store_wait<0>();  // shared memory must outlive the reads: the CTA exits next
  }
  return true;
}

// dQ writer warp: for each Q tile, adds the consumers' dQ chunks (Traits::kDQChunksPerBlock, in (pass, warpgroup)
// order) from shared memory into the fp32 workspace (TMA reduce-add, one elected lane). Each warpgroup arrives once
// per tile and pass on that pass's barrier (kBarrierDQFull, kBarrierDQFull1) once its chunk is written (one
// arrival per barrier per tile: a second one before the writer's sync would complete it early); the writer hands
// the chunks back on
// kBarrierDQEmpty once TMA has read them: for every tile but the last, or (kDQPass1InQ, the second pass staged in
// the tile's Q stage, which the consumers return to the producer only then) for every tile.
template <class Traits, bool kDeterministic>
CUTLASS_DEVICE void bwd_dq_writer(typename Traits::Params const& params, typename Traits::SharedStorage& ss,
                                  int n_block, int bidh0, SeqlenInfo const& info, int m_block_min, int m_block_max) {
  constexpr int kPasses = Traits::kDQChunksPerBlock / 2;
  static_assert(kPasses == 1 || (kPasses == 2 && Traits::kDQPass1InQ), "one staging buffer per pass");
  using ChunkShape = Shape<Int<Traits::kDQChunkRows>, Int<Traits::kDQChunkCols>>;
  Tensor sDQ = make_tensor(make_smem_ptr(ss.smem_dq.data()),
                           tile_to_shape(typename Traits::SmemLayoutDQChunk{},
                                         Shape<Int<Traits::kDQChunkRows>, Int<Traits::kDQChunkCols>, _2>{}));
  Tensor mDQ = params.tma_dq.get_tma_tensor(make_shape(params.dq_accum_rows, Int<Traits::kDQAccumCols>{}));
  Tensor gDQ = local_tile(mDQ, ChunkShape{}, make_coord(_, _));  // (rows, cols, row tiles, column tiles)
  auto [tDQgDQ, tDQsDQ] =
      tma_partition(params.tma_dq, _0{}, Layout<_1>{}, group_modes<0, 2>(sDQ), group_modes<0, 2>(gDQ));
  // kDQPass1InQ: the Q stages seen as chunks, (rows, cols, warpgroup + 2 * stage).
  Tensor sDQq = make_tensor(make_smem_ptr(reinterpret_cast<float*>(ss.smem_q.data())),
                            tile_to_shape(typename Traits::SmemLayoutDQChunk{},
                                          Shape<Int<Traits::kDQChunkRows>, Int<Traits::kDQChunkCols>,
                                                Int<2 * Traits::kStages>>{}));
  Tensor tDQsDQq = get<1>(
      tma_partition(params.tma_dq, _0{}, Layout<_1>{}, group_modes<0, 2>(sDQq), group_modes<0, 2>(gDQ)));
  bool const leader = cute::elect_one_sync();
  constexpr bool deterministic = kDeterministic;
  // This key block's copy of the accumulator (dq_lanes), as a row-tile offset in the chunk view.
  int const lane_bits = kDeterministic ? dq_lane_bits<Traits>(params) : 0;
  int const lane_row_tiles = (n_block & lane_bits) * ((params.dq_accum_rows >> lane_bits) / Traits::kDQChunkRows);
  int const num_tiles = params.heads_per_cta * (m_block_max - m_block_min);
  int tile_idx = 0;  // over the CTA's (head, m_block) tiles, the order the consumers take them in
  for (int bidh = bidh0; bidh < bidh0 + params.heads_per_cta; ++bidh) {
    int64_t const row_base = bwd_workspace_row<kBwdSeqlenQRounding>(params.cu_seqlens_q != nullptr, params.nheads,
                                                                     params.seqlen_q_rounded, info, bidh);
    for (int m_block = m_block_min; m_block < m_block_max; ++m_block) {
      int* sem = nullptr;
      int turn = 0;
      if (deterministic) { sem = dq_turn<Traits>(params, info, bidh, m_block, n_block, turn); }
      int const stage = tile_idx % Traits::kStages;  // the consumers' Q stage of this tile
      CUTLASS_PRAGMA_UNROLL
      for (int pass = 0; pass < kPasses; ++pass) {
        CUTLASS_PRAGMA_UNROLL
        for (int wg = 0; wg < 2; ++wg) {
          cutlass::arch::NamedBarrier::sync(Traits::kDQBarrierThreads,
                                            (pass == 0 ? Traits::kBarrierDQFull : Traits::kBarrierDQFull1) + wg);
          if (leader) {
            if (deterministic && pass == 0 && wg == 0) { semaphore_wait_for_bulk(sem, turn); }
            auto const tile = Traits::dq_chunk_tile(row_base, m_block, 2 * pass + wg);
            int const row_tile = lane_row_tiles + get<0>(tile);
            if (pass == 1) {
              copy(params.tma_dq, tDQsDQq(_, wg + 2 * stage), tDQgDQ(_, row_tile, get<1>(tile)));
            } else {
              copy(params.tma_dq, tDQsDQ(_, wg), tDQgDQ(_, row_tile, get<1>(tile)));
            }
            tma_store_arrive();
          }
        }
      }
      // Deterministic mode: the next CTA's turn once the sums are performed. The head_dim 256 variant hands the
      // staging buffers back before that round trip, once TMA has read them; the kSwapSdP variant after it (H200,
      // session 19 call 2, deterministic TFLOP/s against handing back after: head_dim 256 +4 to +8.5 %, head_dim 128
      // non-causal 4096 -7.7 %, causal level).
      constexpr bool kEmptyBeforeRelease = !Traits::kSwapSdP;
      auto release_turn = [&] {
        if (deterministic && leader) {
          bulk_reductions_complete();
          semaphore_release(sem);
        }
      };
      if (!kEmptyBeforeRelease) { release_turn(); }
      if (leader) { tma_store_wait<0>(); }  // every chunk read out of shared memory (a no-op after release_turn)
      __syncwarp();
      if (Traits::kDQPass1InQ || tile_idx + 1 < num_tiles) {
        CUTLASS_PRAGMA_UNROLL
        for (int wg = 0; wg < 2; ++wg) {
          cutlass::arch::NamedBarrier::arrive(Traits::kDQBarrierThreads, Traits::kBarrierDQEmpty + wg);
        }
      }
      if (kEmptyBeforeRelease) { release_turn(); }
      ++tile_idx;
    }
  }
  if (leader) { tma_store_wait<0>(); }
}

// Consumer of the kSwapSdP variant (mma_tidx in [0, NumMmaThreads)). Per Q tile and warpgroup (64 keys):
//   Sᵀ, dPᵀ (SS) -> Pᵀ = exp2(Sᵀ·scale_log2 − LSE_log2), dSᵀ = Pᵀ ∘ (dPᵀ − D) -> dS to shared memory
//   -> dV += Pᵀ dO (RS), one barrier -> dQ_tile = dS K (SS) and dK += dSᵀ Q (RS) -> dQ_tile to shared memory
//   for the writer warp while dK runs.
template <class Traits, bool kSoftcap, bool kDeterministic>
CUTLASS_DEVICE void bwd_consumer_swapped(typename Traits::Params const& params, typename Traits::SharedStorage& ss,
                                         typename Traits::Pipeline& pipeline, int mma_tidx, int n_block, int bidh0,
                                         SeqlenInfo const& info, int m_block_min, int m_block_max) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  auto consumers_sync = [] { cutlass::arch::NamedBarrier::sync(Traits::NumMmaThreads, 1); };

  typename Traits::TiledMmaSdP tiled_mma_sdp;
  typename Traits::TiledMmadKV tiled_mma_dkv;
  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(mma_tidx);
  auto thr_mma_dkv = tiled_mma_dkv.get_thread_slice(mma_tidx);
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(mma_tidx);

  Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.smem_do.data()), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.smem_q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.smem_do.data()), typename Traits::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(ss.smem_k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.smem_v.data()), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.smem_k.data()), typename Traits::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.smem_ds.data()), typename Traits::SmemLayoutdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.smem_ds.data()), typename Traits::SmemLayoutdSt{});

  Tensor tSrK = thr_mma_sdp.partition_fragment_A(sK);       // (MMA, MMA_M, MMA_K)
  Tensor tSrQ = thr_mma_sdp.partition_fragment_B(sQ);       // (MMA, MMA_N, MMA_K, stages)
  Tensor tdPrV = thr_mma_sdp.partition_fragment_A(sV);      // (MMA, MMA_M, MMA_K)
  Tensor tdPrdO = thr_mma_sdp.partition_fragment_B(sdO);    // (MMA, MMA_N, MMA_K, stages)
  Tensor tdVrdOt = thr_mma_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stages)
  Tensor tdKrQt = thr_mma_dkv.partition_fragment_B(sQt);    // (MMA, MMA_N, MMA_K, stages)
  Tensor tdQrdS = thr_mma_dq.partition_fragment_A(sdS);     // (MMA, MMA_M, MMA_K, 2)
  Tensor tdQrKt = thr_mma_dq.partition_fragment_B(sKt);     // (MMA, MMA_N, MMA_K)

  // dSᵀ registers -> dS in shared memory: transposing stmatrix, in the Sᵀ accumulator's thread layout.
  auto smem_copy_ds = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, Element>{}, tiled_mma_sdp);
  auto thr_copy_ds = smem_copy_ds.get_thread_slice(mma_tidx);
  Tensor tdSsdS = thr_copy_ds.partition_D(sdSt);  // (CPY, CPY_M, CPY_N, 2)

  Tensor tdVrdV = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tdKrdK = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(tdVrdV);
  clear(tdKrdK);

  // (key, row) of each Sᵀ element this thread holds.
  Tensor tScS = thr_mma_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Window<kBlockM, kBlockN> const window = make_window<kBlockM, kBlockN>(params, info);
  int interior_lo, interior_hi;
  window.interior_m_blocks(n_block, interior_lo, interior_hi);
  int const warpgroup = mma_tidx / cutlass::NumThreadsPerWarpGroup;
  int const wg_tidx = mma_tidx % cutlass::NumThreadsPerWarpGroup;
  float* sdq_chunk = ss.smem_dq.data() + warpgroup * Traits::kDQChunkFloats;
  static_assert(decltype(size(partition_fragment_C(tiled_mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{})))::value *
                    cutlass::NumThreadsPerWarpGroup == Traits::kDQChunkFloats);

  if (m_block_max > m_block_min) {
    ss.barrier_kv.wait(0);
    typename Traits::PipelineState read_state;
    int ds_buf = 0;
    for (int bidh = bidh0; bidh < bidh0 + params.heads_per_cta; ++bidh) {  // the CTA's query heads
      for (int m_block = m_block_min; m_block < m_block_max; ++m_block) {
        int const stage = read_state.index();
        float const* lse_log2 = ss.smem_lse.data() + stage * kBlockM;
        float const* dpsum = ss.smem_dpsum.data() + stage * kBlockM;

        Tensor tSrS = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        Tensor tdPrdP = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        pipeline.consumer_wait(read_state);
        wgmma</*zero_init=*/true>(tiled_mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
        wgmma</*zero_init=*/true>(tiled_mma_sdp, tdPrV, tdPrdO(_, _, _, stage), tdPrdP);
        // Padded rows have LSE_log2 = +inf: P = 0 there.
        Tensor s = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));     // (keys, rows)
        Tensor dp = make_tensor(tdPrdP.data(), acc_rowcol(tdPrdP.layout()));  // (keys, rows)
        if constexpr (!kSoftcap) {
          warpgroup_wait<1>();  // Sᵀ is ready; dPᵀ may still be in flight
          if (m_block < interior_lo || m_block >= interior_hi) {
            window.template apply_transposed<true>(tSrS, tScS, m_block, n_block);
          }
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size<1>(s); ++j) {
            float const lse = lse_log2[get<1>(tScS_rc(0, j))];
            CUTLASS_PRAGMA_UNROLL
            for (int r = 0; r < size<0>(s); ++r) { s(r, j) = exp2f(fmaf(s(r, j), params.score_scale_log2, -lse)); }
          }
          warpgroup_wait<0>();
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size<1>(dp); ++j) {
            float const d = dpsum[get<1>(tScS_rc(0, j))];
            CUTLASS_PRAGMA_UNROLL
            for (int r = 0; r < size<0>(dp); ++r) { dp(r, j) = s(r, j) * (dp(r, j) - d); }
          }
        } else {
          // dS needs tanh' = 1 − t² beside P: t replaces Sᵀ in its registers while the dPᵀ GEMM runs (+2-6 % at
          // head_dim 128, benchmarks/NOTES.md session 21), and P and dS come in one pass once it is done. ptxas sinks
          // register-only work below a wgmma wait; a branch it cannot resolve (score_scale_log2 is positive,
          // run_bwd_sm90) keeps the tanh ahead of it. The dense exponentials stay where ptxas puts them: ahead of the
          // wait they ran slower (same notes).
          warpgroup_wait<1>();
          if (__float_as_uint(params.score_scale_log2) != 0u) {
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < size(tSrS); ++i) { tSrS(i) = softcap_tanh<Element>(tSrS(i) * params.softcap_pre); }
            if (m_block < interior_lo || m_block >= interior_hi) {
              // head_dim 64's softcap consumers keep the two-sided mask: the other spilled more in their loop.
              window.template apply_transposed<(kHeadDim > 64)>(tSrS, tScS, m_block, n_block);
            }
          }
          warpgroup_wait<0>();
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size<1>(s); ++j) {
            float const lse = lse_log2[get<1>(tScS_rc(0, j))];
            float const d = dpsum[get<1>(tScS_rc(0, j))];
            CUTLASS_PRAGMA_UNROLL
            for (int r = 0; r < size<0>(s); ++r) { softcap_p_ds(s(r, j), dp(r, j), params.score_scale_log2, lse, d); }
          }
        }
        Tensor tdVrP = make_tensor<Element>(acc_to_a_operand(tSrS.layout()));
        Tensor tdKrdS = make_tensor<Element>(acc_to_a_operand(tdPrdP.layout()));
        convert_type_into(tSrS, tdVrP);
        convert_type_into(tdPrdP, tdKrdS);

        // dS (both warpgroups' keys) for dQ, stored before dV is issued (FlashAttention-3/4's order: dS reaches the
        // barrier sooner, and its stores do not meet dV's dOᵀ reads); the buffer written here was last read by the dQ
        // GEMM two iterations ago, which every warpgroup finished before the previous iteration's barrier. H200,
        // 2026-12-03 (session 35, bf16, 3 rounds): head_dim 128 +1-2.5 %, head_dim 64 a further +2-5 % over the row
        // split (non-causal 16384 485-490 -> 504-514) though its spills grow from 24/32 to 56/72 B. Issuing dK before
        // the barrier as well lost 3-9 % at head_dim 128 from 4096 (won 3 % at non-causal 1024): the dQ tile's stores
        // then no longer overlap dK, we think.
        Tensor tdSrdS = make_tensor(tdKrdS.data(), tdPrdP.layout());  // accumulator view of the same registers
        copy(smem_copy_ds, thr_copy_ds.retile_S(tdSrdS), tdSsdS(_, _, _, ds_buf));
        // dV reads no dS, so it is issued before the proxy fence, which may stall until the dS stores land. H100,
        // 2026-12-05 (session 51, bf16, 8 rounds, medians): head_dim 128 non-causal 16384 +7 % (its samples are
        // bimodal; this order sat in the fast mode 6 rounds of 8, the old one 3: weak evidence), causal 16384 +2 %,
        // the other head_dim 64 / 128 points at 4096 / 16384 within +-0.7 %.
        wgmma</*zero_init=*/false>(tiled_mma_dkv, tdVrP, tdVrdOt(_, _, _, stage), tdVrdV);
        cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> WGMMA (async proxy) reads
        consumers_sync();

        Tensor tdQrdQ = partition_fragment_C(tiled_mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
        wgmma</*zero_init=*/true>(tiled_mma_dq, tdQrdS(_, _, _, ds_buf), tdQrKt, tdQrdQ);
        wgmma</*zero_init=*/false>(tiled_mma_dkv, tdKrdS, tdKrQt(_, _, _, stage), tdKrdK);
        warpgroup_wait<1>();  // dV and dQ_tile done; dK still running
        warpgroup_fence_operand(tdVrP);  // registers read by an in-flight WGMMA must stay untouched until now
        // dQ_tile (unscaled; the postprocess applies softmax_scale) into this warpgroup's chunk while dK runs, once
        // the writer has finished reading the previous one.
        if (bidh > bidh0 || m_block > m_block_min) {
          cutlass::arch::NamedBarrier::sync(Traits::kDQBarrierThreads, Traits::kBarrierDQEmpty + warpgroup);
        }
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tdQrdQ); i += 4) {
          *reinterpret_cast<float4*>(sdq_chunk + (i * cutlass::NumThreadsPerWarpGroup + 4 * wg_tidx)) =
              make_float4(tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2), tdQrdQ(i + 3));
        }
        cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> TMA (async proxy) reads
        cutlass::arch::NamedBarrier::arrive(Traits::kDQBarrierThreads, Traits::kBarrierDQFull + warpgroup);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tdKrdS);
        pipeline.consumer_release(read_state);
        ++read_state;
        ds_buf ^= 1;
      }
    }
  }

  if (!store_dkv_tma<Traits>(params, ss, tdVrdV, tdKrdK, mma_tidx, n_block, bidh0, info)) {
    store_dkv<Traits, kDeterministic>(params, tdVrdV, tdKrdK, mma_tidx, n_block, bidh0, info);
  }
}

// Consumer perspective (mma_tidx in [0, NumMmaThreads)).
template <class Traits, bool kSoftcap, bool kDeterministic>
CUTLASS_DEVICE void bwd_consumer(typename Traits::Params const& params, typename Traits::SharedStorage& ss,
                                 typename Traits::Pipeline& pipeline, typename Traits::PipelinedO& pipeline_do,
                                 int mma_tidx, int n_block, int bidh0,
                                 SeqlenInfo const& info, int m_block_min, int m_block_max) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  // The consumers' own named barrier: user id 1 (CUTLASS offsets user ids past its reserved ones).
  auto consumers_sync = [] { cutlass::arch::NamedBarrier::sync(Traits::NumMmaThreads, 1); };

  typename Traits::TiledMmaSdP tiled_mma_sdp;
  typename Traits::TiledMmadKV tiled_mma_dkv;
  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(mma_tidx);
  auto thr_mma_dkv = tiled_mma_dkv.get_thread_slice(mma_tidx);
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(mma_tidx);

  Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.smem_do.data()), typename Traits::SmemLayoutdO{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.smem_q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.smem_do.data()), typename Traits::SmemLayoutdOt{});
  Tensor sK = make_tensor(make_smem_ptr(ss.smem_k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.smem_v.data()), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.smem_k.data()), typename Traits::SmemLayoutKt{});
  Tensor sP = make_tensor(make_smem_ptr(ss.smem_p.data()), typename Traits::SmemLayoutPdS{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.smem_ds.data()), typename Traits::SmemLayoutPdS{});
  Tensor sPt = make_tensor(make_smem_ptr(ss.smem_p.data()), typename Traits::SmemLayoutPdSt{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.smem_ds.data()), typename Traits::SmemLayoutPdSt{});

  Tensor tSrQ = thr_mma_sdp.partition_fragment_A(sQ);      // (MMA, MMA_M, MMA_K, stages)
  Tensor tSrK = thr_mma_sdp.partition_fragment_B(sK);      // (MMA, MMA_N, MMA_K)
  Tensor tdPrdO = thr_mma_sdp.partition_fragment_A(sdO);   // (MMA, MMA_M, MMA_K, stages)
  Tensor tdPrV = thr_mma_sdp.partition_fragment_B(sV);     // (MMA, MMA_N, MMA_K)
  Tensor tdVrPt = thr_mma_dkv.partition_fragment_A(sPt);   // (MMA, MMA_M, MMA_K)
  Tensor tdVrdOt = thr_mma_dkv.partition_fragment_B(sdOt); // (MMA, MMA_N, MMA_K, stages)
  Tensor tdKrdSt = thr_mma_dkv.partition_fragment_A(sdSt); // (MMA, MMA_M, MMA_K)
  Tensor tdKrQt = thr_mma_dkv.partition_fragment_B(sQt);   // (MMA, MMA_N, MMA_K, stages)
  Tensor tdQrdS = thr_mma_dq.partition_fragment_A(sdS);    // (MMA, MMA_M, MMA_K)

  // Register -> shared copies of P and dS with stmatrix, in the S accumulator's thread layout.
  auto smem_copy_pds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, tiled_mma_sdp);
  auto thr_copy_pds = smem_copy_pds.get_thread_slice(mma_tidx);
  Tensor tPsP = thr_copy_pds.partition_D(sP);
  Tensor tdSsdS = thr_copy_pds.partition_D(sdS);

  Tensor tdVrdV = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tdKrdK = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(tdVrdV);
  clear(tdKrdK);

  Tensor tScS = thr_mma_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  constexpr int kDQCols = Traits::kDQCols;
  // This warpgroup's chunk of a dQ pass in shared memory, in the accumulator's (rows, column pairs) view.
  Tensor sDQ = make_tensor(make_smem_ptr(ss.smem_dq.data()), typename Traits::SmemLayoutDQ{});
  Tensor tdQsdQ = thr_mma_dq.partition_C(sDQ);
  Tensor tdQsdQ_rc = make_tensor(tdQsdQ.data(), acc_rowcol(tdQsdQ.layout()));
  // kDQPass1InQ: the same view over Q stage `stage` (its offset added per tile).
  Tensor sDQq = make_tensor(make_smem_ptr(reinterpret_cast<float*>(ss.smem_q.data())), typename Traits::SmemLayoutDQ{});
  Tensor tdQsdQq = thr_mma_dq.partition_C(sDQq);
  Tensor tdQsdQq_rc = make_tensor(tdQsdQq.data(), acc_rowcol(tdQsdQq.layout()));
  constexpr int kQStageFloats = kBlockM * kHeadDim * int(sizeof(Element)) / int(sizeof(float));
  float* const ss_q_floats = reinterpret_cast<float*>(ss.smem_q.data());
  int const warpgroup = mma_tidx / cutlass::NumThreadsPerWarpGroup;
  Window<kBlockM, kBlockN> const window = make_window<kBlockM, kBlockN>(params, info);
  int interior_lo, interior_hi;
  window.interior_m_blocks(n_block, interior_lo, interior_hi);

  if (m_block_max > m_block_min) {
    ss.barrier_kv.wait(0);
    typename Traits::PipelineState read_state;
    typename Traits::PipelineState prev_read_state;  // kDQPass1InQ: the Q stage still held for the writer
    typename Traits::PipelinedOState read_state_do;
    for (int bidh = bidh0; bidh < bidh0 + params.heads_per_cta; ++bidh) {  // the CTA's query heads
      int64_t const row_base = bwd_workspace_row<kBwdSeqlenQRounding>(params.cu_seqlens_q != nullptr, params.nheads,
                                                                       params.seqlen_q_rounded, info, bidh);
      float const* lse_log2 = params.lse_log2_ptr + row_base;
      float const* dpsum = params.dpsum_ptr + row_base;
      for (int m_block = m_block_min; m_block < m_block_max; ++m_block) {
        int const stage = read_state.index(), stage_do = read_state_do.index();
        // Per-row statistics of the two rows this thread holds (padded rows: LSE_log2 = +inf gives P = 0).
        float lse_row[kRows], dpsum_row[kRows];
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) {
          int const row = m_block * kBlockM + get<0>(tScS_rc(r, 0));
          lse_row[r] = lse_log2[row];
          dpsum_row[r] = dpsum[row];
        }

        Tensor tSrS = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
        Tensor tdPrdP = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
        pipeline.consumer_wait(read_state);
        wgmma</*zero_init=*/true>(tiled_mma_sdp, tSrQ(_, _, _, stage), tSrK, tSrS);
        pipeline_do.consumer_wait(read_state_do);
        wgmma</*zero_init=*/true>(tiled_mma_sdp, tdPrdO(_, _, _, stage_do), tdPrV, tdPrdP);
        Tensor s = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
        Tensor dp = make_tensor(tdPrdP.data(), acc_rowcol(tdPrdP.layout()));
        if constexpr (!kSoftcap) {
          warpgroup_wait<1>();  // S is ready; dP may still be in flight
          if (m_block < interior_lo || m_block >= interior_hi) { window.apply(tSrS, tScS, m_block, n_block); }
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < kRows; ++r) {
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < size<1>(s); ++j) {
              s(r, j) = exp2f(fmaf(s(r, j), params.score_scale_log2, -lse_row[r]));
            }
          }
          warpgroup_wait<0>();
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < kRows; ++r) {
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < size<1>(dp); ++j) { dp(r, j) = s(r, j) * (dp(r, j) - dpsum_row[r]); }
          }
        } else {  // as in bwd_consumer_swapped: tanh under the dP GEMM
          warpgroup_wait<1>();
          if (__float_as_uint(params.score_scale_log2) != 0u) {
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < size(tSrS); ++i) { tSrS(i) = softcap_tanh<Element>(tSrS(i) * params.softcap_pre); }
            if (m_block < interior_lo || m_block >= interior_hi) { window.apply(tSrS, tScS, m_block, n_block); }
          }
          warpgroup_wait<0>();
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < kRows; ++r) {
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < size<1>(s); ++j) {
              softcap_p_ds(s(r, j), dp(r, j), params.score_scale_log2, lse_row[r], dpsum_row[r]);
            }
          }
        }
        Tensor tPrP = convert_type<Element>(tSrS);
        Tensor tdSrdS = convert_type<Element>(tdPrdP);

        // The previous iteration's GEMMs (all warpgroups) have finished reading sP and sdS.
        consumers_sync();
        copy(smem_copy_pds, thr_copy_pds.retile_S(tPrP), tPsP);
        copy(smem_copy_pds, thr_copy_pds.retile_S(tdSrdS), tdSsdS);
        // Generic-proxy stores must be visible to the WGMMA (async proxy) of every consumer warpgroup.
        cutlass::arch::fence_view_async_shared();
        consumers_sync();

        static_assert(Traits::kDQPass1InQ, "dQ passes staged in smem_dq and the Q stage");
        wgmma</*zero_init=*/false>(tiled_mma_dkv, tdVrPt, tdVrdOt(_, _, _, stage_do), tdVrdV);
        wgmma</*zero_init=*/false>(tiled_mma_dkv, tdKrdSt, tdKrQt(_, _, _, stage), tdKrdK);
        // Once the writer has read the previous tile's dQ chunks, its Q stage goes back to the producer (and smem_dq
        // may take this tile's first pass). Awaited with dV and dK issued (neither reads that stage or smem_dq), so
        // that the tensor cores run while the writer drains its reduce-adds or waits for its turn (H100, session 58,
        // head_dim 256 bwd: default +0-5 %, deterministic +0-3 %; after the first dQ pass's GEMM instead: -1-2 %).
        if (bidh > bidh0 || m_block > m_block_min) {
          cutlass::arch::NamedBarrier::sync(Traits::kDQBarrierThreads, Traits::kBarrierDQEmpty + warpgroup);
          pipeline.consumer_release(prev_read_state);
        }
        CUTLASS_PRAGMA_UNROLL
        for (int pass = 0; pass < Traits::kDQPasses; ++pass) {
          // Columns [pass * kDQCols, (pass + 1) * kDQCols) of dQ_tile = dS K.
          Tensor tdQrKt = thr_mma_dq.partition_fragment_B(
              local_tile(sKt, Shape<Int<kDQCols>, Int<kBlockN>>{}, make_coord(pass, _0{})));  // (MMA, MMA_N, MMA_K)
          Tensor tdQrdQ = partition_fragment_C(tiled_mma_dq, Shape<Int<kBlockM>, Int<kDQCols>>{});
          wgmma</*zero_init=*/true>(tiled_mma_dq, tdQrdS, tdQrKt, tdQrdQ);
          if (pass == 0) {
            warpgroup_wait<2>();  // dV is done: dO's stage can take the next tile
            pipeline_do.consumer_release(read_state_do);
            ++read_state_do;
          }
          warpgroup_wait<0>();
          bool const in_q_stage = pass == 1;
          // Pass 0 done: this warpgroup's dK is too, so its half of the Q stage may take the second pass (the traits).
          if (pass == 0) {
            prev_read_state = read_state;  // released next tile, or after the loop
            ++read_state;
          }
          // dQ_tile (unscaled; the postprocess applies softmax_scale) into this warpgroup's chunk of the pass.
          Tensor dq = make_tensor(tdQrdQ.data(), acc_rowcol(tdQrdQ.layout()));
          float* const q_stage = in_q_stage ? ss_q_floats + prev_read_state.index() * kQStageFloats : nullptr;
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < size<0>(dq); ++r) {
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < size<1>(dq); j += 2) {  // a column pair is 8 contiguous bytes under the swizzle
              float* dst = in_q_stage ? q_stage + (&tdQsdQq_rc(r, j) - ss_q_floats) : &tdQsdQ_rc(r, j);
              *reinterpret_cast<float2*>(dst) = make_float2(dq(r, j), dq(r, j + 1));
            }
          }
          // To the writer's TMA reduce-add, on the pass's own barrier (one arrival per barrier per tile).
          cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> TMA (async proxy) reads
          int const full_barrier = (pass == 0 ? Traits::kBarrierDQFull : Traits::kBarrierDQFull1) + warpgroup;
          cutlass::arch::NamedBarrier::arrive(Traits::kDQBarrierThreads, full_barrier);
        }
      }
    }
    // The last tile's Q stage (the producer's tail waits for it).
    cutlass::arch::NamedBarrier::sync(Traits::kDQBarrierThreads, Traits::kBarrierDQEmpty + warpgroup);
    pipeline.consumer_release(prev_read_state);
  }

  if (!store_dkv_tma<Traits>(params, ss, tdVrdV, tdKrdK, mma_tidx, n_block, bidh0, info)) {
    store_dkv<Traits, kDeterministic>(params, tdVrdV, tdKrdK, mma_tidx, n_block, bidh0, info);
  }
}

// Producer warpgroup: producer role; thread 0 initialises the barriers and issues the loads.
template <class Pipeline, class Traits>
CUTLASS_DEVICE typename Pipeline::Params bwd_pipeline_params(uint32_t transaction_bytes) {
  typename Pipeline::Params pp;
  pp.transaction_bytes = transaction_bytes;
  pp.role = cutlass::canonical_warp_group_idx() == 0 ? Pipeline::ThreadCategory::Producer
                                                     : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = Traits::NumMmaThreads;
  return pp;
}

template <class Traits, bool kSoftcap, bool kDeterministic>
__global__ void __launch_bounds__(Traits::NumThreads, 1)
    flash_bwd_sm90_kernel(CUTE_GRID_CONSTANT typename Traits::Params const params) {
  using Pipeline = typename Traits::Pipeline;
  extern __shared__ char smem_buf[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);

  int const warp_idx = cutlass::canonical_warp_idx_sync();
  int const warp_group_idx = cutlass::canonical_warp_group_idx();
  bool const lane_predicate = cute::elect_one_sync();
  // Causal: the first key blocks are seen by the most query blocks; start them first. Deterministic mode: the last
  // first (see dq_turn).
  int n_block = kDeterministic ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  int head_group = blockIdx.y, bidb = blockIdx.z;
  // Not in deterministic mode (see Params::section_pairs), nor in head_dim 64's softcap consumers, whose loop spills
  // more with the renumbered coordinates live instead of re-read special registers (ptxas: loop LDL 4 -> 10).
  constexpr bool kSectioned = !kDeterministic && !(kSoftcap && Traits::kHeadDim <= 64);
  if (kSectioned && params.section_pairs > 0) {
    // CTAs start in launch order (blockIdx.x fastest): renumber them so that a section's pairs take each key block
    // in turn, as the forward's decode_tile does with query blocks.
    int const pairs = int(gridDim.y * gridDim.z), per_section = params.section_pairs * int(gridDim.x);
    int const cta = int(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
    int const section = cta / per_section, first = section * params.section_pairs;
    int const in_section = min(params.section_pairs, pairs - first);
    int const within = cta - section * per_section;
    n_block = within / in_section;
    int const pair = first + within - n_block * in_section;
    head_group = pair % int(gridDim.y);
    bidb = pair / int(gridDim.y);
  }
  int const bidh = head_group * params.heads_per_cta;  // the CTA's first query head
  SeqlenInfo const info(params.cu_seqlens_q, params.cu_seqlens_k, params.seqlen_q, params.seqlen_k, bidb,
                        params.total_q, params.total_k);
  // Varlen: the grid covers the longest sequence's key blocks; a block past this sequence's keys has nothing to do.
  if (n_block * Traits::kBlockN >= info.seqlen_k) { return; }

  if (warp_idx == 0 && lane_predicate) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_dq.get_tma_descriptor());
    if (params.dkv_tma) {
      cute::prefetch_tma_descriptor(params.tma_dk.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_dv.get_tma_descriptor());
    }
    ss.barrier_kv.init(/*arrive_count=*/1);
  }

  // The rest of the kernel, given the Q pipeline and dO's (the same object unless kSeparatedO).
  auto run = [&](Pipeline& pipeline, typename Traits::PipelinedO& pipeline_do) {
    cutlass::arch::fence_barrier_init();
    __syncthreads();

    int m_block_min, m_block_max;
    make_window<Traits::kBlockM, Traits::kBlockN>(params, info).m_block_range(n_block, m_block_min, m_block_max);

    if (warp_group_idx == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
      // The pipelines' leader (thread 0) is the one thread that issues every TMA load.
      if (threadIdx.x == 0 && m_block_max > m_block_min) {
        bwd_producer<Traits>(params, ss, pipeline, pipeline_do, n_block, bidh, info, m_block_min, m_block_max);
      }
      if (warp_idx == 1 && m_block_max > m_block_min) {
        bwd_dq_writer<Traits, kDeterministic>(params, ss, n_block, bidh, info, m_block_min, m_block_max);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
      int const mma_tidx = threadIdx.x - cutlass::NumThreadsPerWarpGroup;
      if constexpr (Traits::kSwapSdP) {
        bwd_consumer_swapped<Traits, kSoftcap, kDeterministic>(params, ss, pipeline, mma_tidx, n_block, bidh, info,
                                                               m_block_min, m_block_max);
      } else {
        bwd_consumer<Traits, kSoftcap, kDeterministic>(params, ss, pipeline, pipeline_do, mma_tidx, n_block, bidh,
                                                       info, m_block_min, m_block_max);
      }
    }
  };
  if constexpr (Traits::kSeparatedO) {
    Pipeline pipeline(ss.pipeline_q, bwd_pipeline_params<Pipeline, Traits>(Traits::kTmaBytesQ), Shape<_1, _1, _1>{});
    using PipelinedO = typename Traits::PipelinedO;
    PipelinedO pipeline_do(ss.pipeline_do, bwd_pipeline_params<PipelinedO, Traits>(Traits::kTmaBytesdO),
                           Shape<_1, _1, _1>{});
    run(pipeline, pipeline_do);
  } else {
    Pipeline pipeline(ss.pipeline_q, bwd_pipeline_params<Pipeline, Traits>(Traits::kTmaBytesQdO), Shape<_1, _1, _1>{});
    run(pipeline, pipeline);
  }
}

}  // namespace flash
