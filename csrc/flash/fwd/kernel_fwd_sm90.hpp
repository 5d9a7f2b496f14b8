// Warp-specialized forward attention kernel for sm_90a (FlashAttention-3 paper §3.1, Algorithm 1).
//
// Persistent: one CTA per SM takes (m_block, head, batch) tiles from a global counter, longest first within a head
// (or, with FAH_FWD_PERSISTENT=0, one CTA per tile). Warp roles:
//   warpgroup 0        Producer: one thread picks the tiles and issues TMA loads of each tile's Q and of K, V
//                      through a kStages-deep shared-memory pipeline (PipelineTmaAsync: full/empty mbarriers) that
//                      runs on across tiles, so the next tile's loads overlap this tile's last GEMMs and epilogue.
//   warpgroups 1..     Consumers (kBlockM / 64), 64 query rows each: S = Q Kᵀ (WGMMA, both operands in smem),
//                      mask, online softmax (exp2), O += P V (WGMMA, P from registers, V from smem); epilogue: O
//                      through shared memory and a TMA store per warpgroup (fwd_store_o_smem), LSE from registers.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include "flash/common/mask.hpp"
#include "flash/common/seqlen.hpp"
#include "flash/common/softmax.hpp"
#include "flash/common/utils.hpp"

// QKᵀ in two halves for the fixed-maximum softcap (kSplitQK in fwd_consumer); development builds may turn it off
// (-DFAH_SPLIT_QK=0) for A/B runs.
#ifndef FAH_SPLIT_QK
#define FAH_SPLIT_QK 1
#endif

namespace flash {

using namespace cute;

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kPersistent_,
          bool kDocuments_ = true>
struct FwdKernelTraits {
  using Element = Element_;
  static constexpr bool kPersistent = kPersistent_;  // else one tile per CTA, the tile loop compiled out
  static constexpr bool kDocuments = kDocuments_;    // else document bounds compiled out (doc_bounds must be null)
  static constexpr int kHeadDim = kHeadDim_;
  // Conditional O rescaling (OnlineSoftmax::step<true>) where O is wide enough for the skipped rescale to outweigh
  // the threshold test. H200, 2026-12-01 (session 10 run 1, bf16 TFLOP/s always / conditional, two rounds; records in
  // benchmarks/results/2026-12-01_h200_session10): head_dim 128 no mask 1024/4096/16384 541/555, 591-596/607-623,
  // 597/622, causal 379-380/380, 511-521/528-529, 592-597/619-661; 256 no mask +1-3 %; 192 within the spread. head_dim
  // 64 lost 5-10 % in an earlier try whose records were lost (NOTES.md, session 10): its loops grew longer.
  static constexpr bool kLazyRescale = kHeadDim_ >= 128;
  // Q's WGMMA descriptors rebuilt at each key block's QKᵀ rather than kept live through the loop: 12 or 16 of them
  // (24 or 32 registers) at head_dim 192 or 256, which is what lets those two run with intra-warpgroup overlap without
  // spilling (config.hpp). H200, 2026-12-02 (session 20 call 2, bf16 TFLOP/s, two rounds, kept / rebuilt, head_dim
  // 256 still without overlap): causal 1024 413-415 / 421, 4096 569-574 / 585-622, 16384 681 / 702-704, non-causal
  // 1024 +1 %, 4096 -1.5 %, 16384 +1-6 %. Rebuilt at head_dim 64 (four of them) -2.2 to -3.8 % at 1024/4096, +0.8 %
  // at 16384; at head_dim 128 (eight) -2.3 to +0.1 %: so kept live there.
  static constexpr bool kQDescriptorsPerBlock = kHeadDim_ > 128;
  // kSplitMaskLoop: the key blocks the mask crosses and the interior ones run separate copies of the main loop's body,
  // the interior one with no mask code (fwd_consumer); kSoftmaxChains: independent chains per row in the softmax's max
  // and (but at head_dim 64, kSoftmaxSumChains below) its sum (OnlineSoftmax). ptxas, head_dim 64 on 192-row tiles:
  // spills 164/220 B -> 8/28 B (softcap 300/316 -> 8/28, 284/232 -> 4/4) with none left in the interior loop, 434
  // instructions per key block there against 697 for the joint loop (mask path included); head_dim 128: 509 against
  // 762. H200, 2026-12-02 (session 23, bf16 TFLOP/s, rounds of one call each; benchmarks/NOTES.md): head_dim 64 192-row
  // tiles, neither / both, non-causal 4096 468-471 / 500-501, 16384 491 / 520, causal 16384 461-472 / 482-490 (call 2);
  // head_dim 128, both / chains only, non-causal 4096 630-641 / 626-632, 16384 646-653 / 626-646, causal 16384 622-641
  // / 614-627, softcap causal 4096 448-461 / 424-444, the rest level (call 3); both against neither at head_dim 128
  // non-causal 16384 666-672 / 649-658, 1024 620-621 / 624-626 (call 2). Not kept where they lost or gained nothing:
  // head_dim 64's 128-row tiles (non-causal 1024 426 neither, 414 split, 398-402 both; causal 1024 318 / 310 / 301;
  // call 1), head_dim 192 and 256 (within -3 to +1 %, call 2). head_dim 96 (head_dim 128's shape) takes both,
  // unmeasured. The split left head_dim 128's fixed-maximum softcap kernel spilling 12/32 B in the masked blocks' copy
  // of the loop, until session 31's one-sided mask (flash/common/mask.hpp) removed it.
  static constexpr bool kNarrow64 = kHeadDim_ == 64 && kBlockM_ == 128;
  static constexpr bool kSplitMaskLoop = kHeadDim_ <= 128 && !kNarrow64;
  static constexpr int kSoftmaxChains = kHeadDim_ <= 128 && !kNarrow64 ? 4 : 1;
  // The sum in one chain at head_dim 64 on both tile heights, so that they sum a row in the same order and a row's
  // bits do not depend on the height the launcher picks (tests/test_bug_reports_thirtysecond_gpu.py). Four sum chains
  // on the 128-row tiles instead cost them 3-7 % (H100, session 66).
  static constexpr int kSoftmaxSumChains = kHeadDim_ <= 128 && kHeadDim_ != 64 ? 4 : 1;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int NumMmaWarpGroups = kBlockM / 64;
  static constexpr int NumMmaThreads = NumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr int NumThreads = NumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  static constexpr int kTurnBarrierThreads = 2 * cutlass::NumThreadsPerWarpGroup;  // the waiter and the previous
  static constexpr int kEpilogueBarrier = 2 + NumMmaWarpGroups;  // named barriers: turns 2 + w, epilogue this + w
  // setmaxnreg budgets within the 65536 registers per SM: two consumer warpgroups 40 * 128 + 232 * 256 = 64512;
  // three 32 * 128 + 160 * 384 = 65536. ptxas, two consumers (session 20): 56/224 left head_dim 128's consumers 8 B of
  // spill stores and 36-44 B of loads (LDLs in the key-block loop) and head_dim 256 36/44 B; 40/232 spilled nothing at
  // head_dim 96/128/192 and 4/12 B at 256 (none since kQDescriptorsPerBlock); 24/240 moved 188 B of spills into the
  // producer's loop. H200, 2026-12-02 (session 20 call 2, bf16, two rounds, 40/232 against 56/224): head_dim 128 dense
  // -0.6 to +2.5 %, softcap -0.1 to +1.9 %; head_dim 256 (then without overlap) -1.5 to +0.4 %.
  static_assert(NumMmaWarpGroups == 2 || NumMmaWarpGroups == 3, "register budgets for two or three consumers");
  static constexpr int kProducerRegs = NumMmaWarpGroups == 2 ? 40 : 32;
  static constexpr int kConsumerRegs = NumMmaWarpGroups == 2 ? 232 : 160;
  static_assert(register_budget_fits<NumThreads, kProducerRegs, kConsumerRegs>());
  // head_dim: whole 32-element (64-byte) swizzle atoms of the K-major Q/K/V tiles (96 = 3 x 32); kBlockN: WGMMA's K.
  static_assert(kHeadDim % 32 == 0 && kBlockN % 16 == 0);

  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // S = Q Kᵀ: (M, N, K = head_dim)
  using TileShapePV = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;  // O = P V:   (M, N = head_dim, K)
  using AtomLayout = Layout<Shape<Int<NumMmaWarpGroups>, _1, _1>>;        // warpgroups split M
  using TiledMmaQK =
      decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileShapeQK>(), AtomLayout{}));
  // QKᵀ issued as two N halves, each its own commit group (kSplitQK in fwd_consumer).
  using TileShapeQKHalf = Shape<Int<kBlockM>, Int<kBlockN / 2>, Int<kHeadDim>>;
  using TiledMmaQKHalf =
      decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileShapeQKHalf>(), AtomLayout{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileShapePV, GMMA::Major::K, GMMA::Major::MN>(), AtomLayout{}));

  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element,
                                                                                 Int<kBlockM>, Int<kHeadDim>>());
  // Epilogue through shared memory and a TMA store. Each warpgroup's 64 rows are one contiguous SmemLayoutOWG block
  // (rows contiguous within a swizzle atom's width, so a TMA box spans all 64), stored by that warpgroup alone.
  // Persistent configurations have a buffer for O; with one CTA per tile (head_dim 192, 256: no room for one) O
  // takes the Q buffer, whose layout is then the same blocks, so that a warpgroup's O overwrites only its own rows of
  // Q while the other may still be reading its own (a one-CTA-per-tile configuration with three consumers has no place
  // for O: static_assert below). It replaced 32 direct 4-byte stores per thread, each warp instruction touching 8
  // rows: H200, 2026-12-01 (session 13 runs 2-4, benchmarks/NOTES.md): the forward's fixed cost per tile 2.76 -> 1.41
  // us (head_dim 128), dense 1024 +10 % (head_dim 128), +8-18 % at 512-2048 (256), +1-5 % on head_dim 64's 192-row
  // tiles (whose 160-register consumers spill a little more with it, ptxas: dense 156 -> 172 B of stores).
  static constexpr bool kOInQ = !kPersistent;
  static_assert(kPersistent || NumMmaWarpGroups == 2, "O is staged in the Q buffer only with two consumers");
  using SmemLayoutOWG = decltype(tile_to_shape(SmemAtomQ{}, Shape<_64, Int<kHeadDim>>{}));
  using SmemLayoutO = decltype(tile_to_shape(SmemLayoutOWG{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  static_assert(cute::cosize_v<SmemLayoutO> == NumMmaWarpGroups * cute::cosize_v<SmemLayoutOWG>);
  using SmemLayoutQ = cute::conditional_t<kOInQ, SmemLayoutO,
                                          decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}))>;
  using SmemAtomKV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element,
                                                                                  Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtomKV{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V stored (kBlockN, head_dim) head_dim-contiguous is, read transposed, the MN-major B operand of O += P V.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{},
      make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;

  // Persistent CTAs hold two Q buffers: the producer loads the next tile's Q (and starts its K/V) while this tile
  // still runs, instead of waiting for every consumer to finish this tile's last QKᵀ.
  static constexpr int kQBuffers = kPersistent ? 2 : 1;
  // The next tile's first QKᵀ issued before this tile's last P V completes and its epilogue runs (fwd_consumer), on
  // head_dim 64's persistent 128-row tiles, whose short tiles (4.5 key blocks on average at causal 1024) paid the
  // first QKᵀ's latency and the epilogue per tile with both warpgroups at the same point (no ping-pong there).
  // H200, 2026-12-03 (session 29 call 3, bf16 TFLOP/s, three rounds, without / with): non-causal 512 383 / 389-391,
  // 1024 419-424 / 424-427; causal 512 243-244 / 243-246, 1024 312-322 / 310-322, 2048 374-375 / 376-382; the
  // 192-row points of the same runs level. Also compiled into this kernel's one-tile-per-CTA run-time mode (no
  // tile counter), where each CTA issues one QKᵀ that is never read.
  static constexpr bool kCrossTile = kNarrow64 && kPersistent_;
  static_assert(!kCrossTile || !kOInQ, "a QKᵀ in flight during the epilogue reads the Q buffers");

  // A tile as decode_tile finds it. The producer decodes each tile once and hands it to the consumers through shared
  // memory with tile_idx: for varlen that spares every consumer thread the global loads of cu_seqlens at each tile
  // start, which short causal tiles (1024 tokens per sequence) exposed once the epilogue got shorter.
  struct TileInfo {
    SeqlenInfo info;
    int m_block, bidh, n_block_min, n_block_max;
  };

  // Shared-memory slots for the fixed-maximum softcap's per-row rounding sums (OnlineSoftmax::add_rounding), out of
  // the main loop's registers. H200, 2026-12-01 (session 19 call 1, bf16 softcap 30, means of two rounds, against
  // registers): head_dim 128 -0.6 to +1.2 %, causal 4096 +5 %; head_dim 64 -4.5 % at 16384 (its 192-row tile spills
  // either way), so it keeps registers; head_dim 192 and 256 (untried; 256 has had the room since its 64-key blocks)
  // keep registers too.
  static constexpr int kRoundingSlots = (kHeadDim > 64 && kHeadDim <= 128) ? 2 * NumMmaThreads : 0;
  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> smem_q[kQBuffers];
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> smem_k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> smem_v;
    cute::array_aligned<Element, kOInQ ? 1 : cute::cosize_v<SmemLayoutO>, 1024> smem_o;
    cutlass::arch::ClusterTransactionBarrier barrier_q[kQBuffers];  // Q of a tile loaded (and tile_idx written)
    cutlass::arch::ClusterBarrier barrier_q_empty[kQBuffers];       // consumers done with that sQ and tile_idx
    typename Pipeline::SharedStorage pipeline_k;
    typename Pipeline::SharedStorage pipeline_v;
    float rounding[kRoundingSlots > 0 ? kRoundingSlots : 1];  // the fixed-maximum softcap's row sums' rounding
    int tile_idx[kQBuffers];  // the producer's tile for the consumers; -1: no more tiles
    TileInfo tile_info[kQBuffers];  // that tile decoded (valid when tile_idx >= 0)
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "tile configuration exceeds the shared memory of one CTA");
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);

  // Global tensors as TMA sees them: (seqlen, head_dim, nheads, batch), head_dim contiguous.
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                          make_layout(ShapeQKV{}, StrideQKV{})));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutKV{}),
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using GmemTensorO = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)),
                                           make_layout(ShapeQKV{}, StrideQKV{})));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorO{}, SmemLayoutOWG{},
                                      Shape<_64, Int<kHeadDim>>{}, _1{}));

  struct Params {
    TmaQ tma_q;
    TmaKV tma_k;
    TmaKV tma_v;
    TmaO tma_o;  // O as (seqlen or total rows, head_dim_v, nheads, batch)
    ShapeQKV shape_q;
    ShapeQKV shape_k;
    ShapeQKV shape_v;  // head_dim_v in place of head_dim
    ShapeQKV shape_o;
    Element* o_ptr;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int head_dim_v;  // V's and O's, <= kHeadDim (a multiple of 8): O columns at or past it are not written
    float* lse_ptr;
    int64_t lse_batch_stride, lse_head_stride;  // LSE of row r: lse_ptr + b * batch + h * head + offset_q + r
    int nheads, seqlen_q, seqlen_k;             // varlen: the maxima (bound the tiles and the window)
    int const* cu_seqlens_q;                    // varlen: (batch + 1) row offsets into q/o and k/v; else null
    int const* cu_seqlens_k;
    int total_q, total_k;   // varlen: rows of q and k (SeqlenInfo clamps offsets to them)
    int qheads_per_kvhead;  // GQA/MQA group size (1 for MHA)
    // Scores enter the softmax as x * score_scale: x = S_raw, score_scale = softmax_scale; or, with a softcap c,
    // x = tanh(S_raw * softcap_pre) with softcap_pre = softmax_scale / c and score_scale = c.
    float score_scale, score_scale_log2, softcap_pre;
    int window_left, window_right;  // >= 0, unbounded sides already replaced (flash/common/mask.hpp)
    int const* doc_bounds;          // documents (dense self-attention): (batch, seqlen_q, 2) int32; else null
    bool pingpong;
    // Tiles (m_block, head, batch), numbered head-major with m_block descending, or in sections (section_heads;
    // decode_tile). A CTA starts at tile blockIdx.x and, when tile_counter is set (persistent launch, gridDim.x
    // CTAs), takes further tiles from that zeroed counter: next = atomicAdd(tile_counter, 1) + gridDim.x (compared
    // with num_tiles before the sum, which could pass INT32_MAX).
    int num_m_blocks, num_tiles;
    int* tile_counter;
    // > 0: tiles in sections of this many (head, batch) pairs, query blocks longest first across a section
    // (causal-like launches, no left limit: a shorter tail, with a section's K/V sized for L2); 0: head-major.
    int section_heads;
    // Zeroed int32 set to 1 by a tile with rows for fwd_exact_rows (softmax.hpp, kExactRowsFlagLog2).
    int* exact_rows_flag;
  };

  // Tile t: the heads' query blocks in order, the last query block first (with a causal mask it sees the most keys);
  // consecutive tiles read the same K/V (L2 reuse), and the query heads of a GQA group are adjacent. With sections,
  // each step of query blocks runs across the section's pairs, whose K/V the launcher sized to stay in L2. Also
  // returns the tile's sequence and its key-block range (empty for a query block past its sequence's end: varlen
  // tiles are counted with the longest sequence; such a tile writes nothing).
  CUTLASS_DEVICE static SeqlenInfo decode_tile(Params const& params, int tile, int& m_block, int& bidh,
                                               int& n_block_min, int& n_block_max) {
    int head_batch;
    if (params.section_heads > 0) {
      int const per_section = params.section_heads * params.num_m_blocks;
      int const section = tile / per_section, first = section * params.section_heads;
      int const heads = min(params.section_heads, params.num_tiles / params.num_m_blocks - first);
      int const within = tile - section * per_section, step = within / heads;
      m_block = params.num_m_blocks - 1 - step;
      head_batch = first + (within - step * heads);
    } else {
      head_batch = tile / params.num_m_blocks;
      m_block = params.num_m_blocks - 1 - (tile - head_batch * params.num_m_blocks);
    }
    bidh = head_batch % params.nheads;
    SeqlenInfo const info(params.cu_seqlens_q, params.cu_seqlens_k, params.seqlen_q, params.seqlen_k,
                          head_batch / params.nheads, params.total_q, params.total_k);
    n_block_min = n_block_max = 0;
    if (m_block * kBlockM < info.seqlen_q) {
      make_window<kBlockM, kBlockN, kDocuments>(params, info).n_block_range(m_block, n_block_min, n_block_max);
    }
    return info;
  }
};

// Producer perspective, one tile: loads Q, then K and V tiles from the last visible key block down to the first,
// continuing the K/V pipeline of the previous tile.
template <class Traits>
CUTLASS_DEVICE void fwd_producer(typename Traits::Params const& params, typename Traits::SharedStorage& ss,
                                 typename Traits::Pipeline& pipeline_k, typename Traits::Pipeline& pipeline_v,
                                 typename Traits::PipelineState& write_state, int q_buf, int m_block, int bidh,
                                 SeqlenInfo const& info, int n_block_min, int n_block_max) {
  using Element = typename Traits::Element;
  using BarrierType = cutlass::arch::ClusterTransactionBarrier::ValueType;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;

  Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q[q_buf].data()), typename Traits::SmemLayoutQ{});  // (M, d)
  Tensor sK = make_tensor(make_smem_ptr(ss.smem_k.data()), typename Traits::SmemLayoutKV{});  // (N, d, stages)
  Tensor sV = make_tensor(make_smem_ptr(ss.smem_v.data()), typename Traits::SmemLayoutKV{});  // (N, d, stages)

  // (seqlen, d) of this sequence: varlen sequences start at their row offset (TMA coordinates shift; rows past the
  // sequence are loaded but masked or never written, rows past the tensor are zero-filled).
  Tensor mQ = domain_offset(make_coord(info.offset_q, _0{}),
                            params.tma_q.get_tma_tensor(params.shape_q)(_, _, bidh, info.bidb));
  int const bidh_kv = bidh / params.qheads_per_kvhead;
  Tensor mK = domain_offset(make_coord(info.offset_k, _0{}),
                            params.tma_k.get_tma_tensor(params.shape_k)(_, _, bidh_kv, info.bidb));
  Tensor mV = domain_offset(make_coord(info.offset_k, _0{}),
                            params.tma_v.get_tma_tensor(params.shape_v)(_, _, bidh_kv, info.bidb));
  Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, _0{}));  // (M, d)
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (N, d, n_blocks)
  Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (N, d, n_blocks)

  auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
  auto [tKgK, tKsK] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
  auto [tVgV, tVsV] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

  ss.barrier_q[q_buf].arrive_and_expect_tx(Traits::kTmaBytesQ);
  copy(params.tma_q.with(reinterpret_cast<BarrierType&>(ss.barrier_q[q_buf]), 0), tQgQ, tQsQ);

  for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) {
    pipeline_k.producer_acquire(write_state);
    copy(params.tma_k.with(*pipeline_k.producer_get_barrier(write_state), 0), tKgK(_, n_block),
         tKsK(_, write_state.index()));
    pipeline_v.producer_acquire(write_state);
    copy(params.tma_v.with(*pipeline_v.producer_get_barrier(write_state), 0), tVgV(_, n_block),
         tVsV(_, write_state.index()));
    ++write_state;
  }
}

// The consumer side of a PipelineTmaAsync stage (one CTA, no cluster) straight on its barriers in shared memory:
// their addresses are offsets from the shared-memory base, so no registers carry the pipeline objects' barrier
// pointers through the main loop (with three consumer warpgroups at 160 registers those pointers were spilled and
// reloaded every key block).
template <class PipelineStorage, class State>
CUTLASS_DEVICE void stage_wait(PipelineStorage& storage, State const& state) {
  storage.full_barrier_[state.index()].wait(state.phase());
}
template <class PipelineStorage, class State>
CUTLASS_DEVICE void stage_release(PipelineStorage& storage, State const& state) {
  storage.empty_barrier_[state.index()].arrive();
}

// The epilogue's O through shared memory: a warpgroup writes its 64 rows of O (bf16/fp16 accumulator fragment
// tOrO_out) into its block of smem_o (or of the Q buffer, Traits::kOInQ), then one thread stores them with TMA. A TMA
// store clips at the tensor's rows, i.e. at seqlen_q for dense batches but only at the last packed row for varlen, so
// a varlen slab that reaches past its sequence (into the next one) is copied out by the warpgroup's threads, 16 bytes
// each, rows checked. The thread that issued a TMA store waits for its reads before the warpgroup writes the block
// again.
template <class Traits, class TiledMmaPV, class FragO>
CUTLASS_DEVICE void fwd_store_o_smem(typename Traits::Params const& params, typename Traits::SharedStorage& ss,
                                     TiledMmaPV const& tiled_mma_pv, FragO const& tOrO_out, int mma_tidx, int m_block,
                                     int bidh, SeqlenInfo const& info) {
  using Element = typename Traits::Element;
  using LayoutWG = typename Traits::SmemLayoutOWG;
  constexpr int kHeadDim = Traits::kHeadDim;
  int const wg = mma_tidx / cutlass::NumThreadsPerWarpGroup;
  int const wg_tidx = mma_tidx % cutlass::NumThreadsPerWarpGroup;
  // Opaque copies: without them the compiler computes the per-thread shared-memory addresses before the key-block
  // loop and keeps them live through it (head_dim 128: 140 B of spills).
  Element* smem_o = Traits::kOInQ ? ss.smem_q[0].data() : ss.smem_o.data();
  int tidx = mma_tidx;
  asm volatile("" : "+l"(smem_o), "+r"(tidx));
  Tensor sO = make_tensor(make_smem_ptr(smem_o), typename Traits::SmemLayoutO{});
  auto smem_tiled_copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, tiled_mma_pv);
  auto smem_thr_copy_o = smem_tiled_copy_o.get_thread_slice(tidx);
  Tensor taccOrO = smem_thr_copy_o.retile_S(tOrO_out);
  Tensor taccOsO = smem_thr_copy_o.partition_D(sO);
  if (wg_tidx == 0) { tma_store_wait<0>(); }
  cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, Traits::kEpilogueBarrier + wg);
  cute::copy(smem_tiled_copy_o, taccOrO, taccOsO);
  int const row0 = m_block * Traits::kBlockM + wg * 64;  // this warpgroup's first row in the sequence
  bool const whole = params.cu_seqlens_q == nullptr || row0 + 64 <= info.seqlen_q;
  if (whole) { tma_store_fence(); }  // the generic-proxy writes above, before the async proxy reads them
  cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, Traits::kEpilogueBarrier + wg);
  Tensor sO_wg = make_tensor(make_smem_ptr(smem_o + wg * cute::cosize_v<LayoutWG>), LayoutWG{});  // (64, d)
  if (whole) {
    if (wg_tidx == 0) {
      Tensor mO = domain_offset(make_coord(info.offset_q, _0{}),
                                params.tma_o.get_tma_tensor(params.shape_o)(_, _, bidh, info.bidb));
      Tensor gO = local_tile(mO, Shape<_64, Int<kHeadDim>>{}, make_coord(row0 / 64, _0{}));  // (64, d)
      auto [tOgO, tOsO] =
          tma_partition(params.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO_wg), group_modes<0, 2>(gO));
      copy(params.tma_o, tOsO, tOgO);
      tma_store_arrive();
    }
  } else {
    // 16-byte chunks: 8 columns each, contiguous in shared memory too (the swizzle moves whole 16-byte units).
    constexpr int kChunksPerRow = kHeadDim / 8;
    Element* o_base = params.o_ptr + info.bidb * params.o_batch_stride + int64_t(info.offset_q) * params.o_row_stride +
                      bidh * params.o_head_stride;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int i = wg_tidx; i < 64 * kChunksPerRow; i += cutlass::NumThreadsPerWarpGroup) {
      int const r = i / kChunksPerRow, col = (i % kChunksPerRow) * 8;
      if (row0 + r < info.seqlen_q && col < params.head_dim_v) {
        *reinterpret_cast<uint4*>(o_base + int64_t(row0 + r) * params.o_row_stride + col) =
            *reinterpret_cast<uint4 const*>(&sO_wg(r, col));
      }
    }
  }
}

// How raw scores enter the softmax: no softcap; softcap with the online maximum; softcap with a fixed maximum (bf16
// and c <= kSoftcapFixedMaxLimit: OnlineSoftmax::step_fixed_max).
enum SoftcapMode : int { kNoSoftcap = 0, kSoftcapOnline = 1, kSoftcapFixedMax = 2 };

template <bool kFirst, class T>
CUTLASS_DEVICE T& select_ref(T& first, T& second) {
  if constexpr (kFirst) { return first; } else { return second; }
}

// Consumer perspective (one of the MMA warpgroups; mma_tidx in [0, NumMmaThreads)). The softcap mode is a template
// argument, not a runtime flag: a softcap's live registers made head_dim 256 spill even with the flag off, and both
// softmax paths in one kernel took head_dim 128's softcap kernel from 8 to 40 B of spills. The Q buffer is a
// template argument too (kQBuf 0 or 1, one consumer copy per buffer), except at head_dim 64 (kQBuf -1: the run-time
// q_buf_index, one copy): there the single copy measured 1-2 % faster (H200, 2026-12-03: non-causal 4096 494 -> 497,
// 16384 513 -> 522 TFLOP/s, three rounds) and spills less on 192-row tiles (8/28 -> 4/4 B), while head_dim 128 lost
// 2.5-3 % with it at 16384 non-causal (655 -> 639) (benchmarks/NOTES.md, session 28).
//
// Traits::kCrossTile: the kernel issues each tile's first QKᵀ into tSrS_first ahead of the tile: before the tile
// loop for the first, and for every other in the previous tile's drain (issue_next(), right after its last P V), so
// that it overlaps that drain and epilogue. Where the next tile does not exist or sees no key block, it issues the
// same GEMM anyway, on whatever the buffers hold, and the result is never read: exactly one QKᵀ group is then in
// flight at every tile start and after every drain on every path, which ptxas needs (a wait or an issue in one
// branch only made it serialise every WGMMA, C7514, or wait before the epilogue, C7517). Elsewhere the consumer
// computes its first S into its own tensor and never calls issue_next.
template <class Traits, int kSoftcapMode, int kQBuf, class FragS, class IssueNext>
CUTLASS_DEVICE void fwd_consumer(typename Traits::Params const& params, typename Traits::SharedStorage& ss,
                                 typename Traits::PipelineState& k_state, typename Traits::PipelineState& v_state,
                                 int mma_tidx, int m_block, int bidh, SeqlenInfo const& info, int n_block_min,
                                 int n_block_max, int q_buf_index, FragS& tSrS_first, IssueNext&& issue_next) {
  static_assert(kQBuf >= -1 && kQBuf < Traits::kQBuffers);
  constexpr bool kCross = Traits::kCrossTile;
  int const q_buf = kQBuf >= 0 ? kQBuf : q_buf_index;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr bool kSoftcap = kSoftcapMode != kNoSoftcap, kFixedMax = kSoftcapMode == kSoftcapFixedMax;
  // QKᵀ as two N halves, each its own commit group, so the tanh of the first half runs while the tensor cores compute
  // the second: the fixed-maximum softcap at head_dim 128, where the softmax is longest. H200, 2026-12-01 (session 11
  // runs 7-8, bf16 TFLOP/s, two rounds; records in benchmarks/results/2026-12-01_h200_session11): softcap non-causal
  // 1024/4096/16384 456-458/526-532/544-550 -> 462/537/550-551, causal 334-338/436-445/531-543 -> 343-346/445-446/
  // 542; Nsight Compute 3.79 -> 3.66 ms at 16384. Without a softcap (the row maximum of the first half under the
  // second's GEMM) it lost 4-6 %: 16 HGMMAs of N = 64 to issue instead of 8, and 28 B of spills.
  constexpr bool kSplitQK = kHeadDim == 128 && kFixedMax && FAH_SPLIT_QK;

  typename Traits::TiledMmaQK tiled_mma_qk;
  typename Traits::TiledMmaPV tiled_mma_pv;
  auto thr_mma_qk = tiled_mma_qk.get_thread_slice(mma_tidx);
  auto thr_mma_pv = tiled_mma_pv.get_thread_slice(mma_tidx);

  Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q[q_buf].data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.smem_k.data()), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.smem_v.data()), typename Traits::SmemLayoutVt{});
  Tensor tSrQ = thr_mma_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_mma_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stages)
  Tensor tOrV = thr_mma_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stages)
  typename Traits::TiledMmaQKHalf tiled_mma_qk_half;
  auto thr_mma_qk_half = tiled_mma_qk_half.get_thread_slice(mma_tidx);
  Tensor tSrQh = thr_mma_qk_half.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_K)
  Tensor tSrKh = thr_mma_qk_half.partition_fragment_B(sK);  // (MMA, MMA_N = 2, MMA_K, stages)
  using SHalfLayout =  // one half's accumulator fragment, laid over the registers of S (kSplitQK)
      decltype(partition_fragment_C(tiled_mma_qk_half, Shape<Int<kBlockM>, Int<kBlockN / 2>>{}).layout());

  // Q's WGMMA descriptors (one 64-bit value per 16 columns of head_dim) in the key-block loop: rebuilt at each QKᵀ
  // from an opaque copy of sQ's address where Traits::kQDescriptorsPerBlock, else kept live through the loop by the
  // compiler.
  auto q_operand = [&]() {
    if constexpr (Traits::kQDescriptorsPerBlock) {
      Element* q_ptr = ss.smem_q[q_buf].data();
      asm volatile("" : "+l"(q_ptr));
      return thr_mma_qk.partition_fragment_A(make_tensor(make_smem_ptr(q_ptr), typename Traits::SmemLayoutQ{}));
    } else {
      return tSrQ;
    }
  };

  Tensor tOrO = partition_fragment_C(tiled_mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_N)
  Tensor tScS = thr_mma_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  constexpr int kRows = decltype(size<0>(acc_rowcol(tOrO.layout())))::value;
  OnlineSoftmax<kRows, Traits::kSoftmaxChains, Traits::kSoftmaxSumChains> softmax(params.score_scale_log2);
  auto const window = make_window<kBlockM, kBlockN, Traits::kDocuments>(params, info);
  int interior_lo, interior_hi;
  window.interior_n_blocks(m_block, interior_lo, interior_hi);
  auto boundary = [&](int n_block) { return n_block < interior_lo || n_block >= interior_hi; };  // the mask crosses it
  // Raw S -> the scores the softmax sees: softcap (before the mask, so masked scores stay -inf), then the mask on
  // tiles that cross a boundary.
  // masked: whether the block crosses the mask (boundary(n_block)); a compile-time constant in the main loop where
  // Traits::kSplitMaskLoop.
  auto prepare_scores = [&](auto& tSrS, int n_block, auto masked) {
    if constexpr (kSoftcap) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tSrS); ++i) { tSrS(i) = softcap_tanh<Element>(tSrS(i) * params.softcap_pre); }
    }
    if (masked) { window.template apply<Traits::NumMmaWarpGroups == 2>(tSrS, tScS, m_block, n_block); }
  };
  clear(tOrO);
  float rounding_regs[kRows];
  constexpr bool kRoundingInSmem = Traits::kRoundingSlots > 0;
  static_assert(!kRoundingInSmem || Traits::kRoundingSlots == kRows * Traits::NumMmaThreads);
  float* const rounding = kRoundingInSmem ? ss.rounding + mma_tidx : rounding_regs;  // this thread's own slots
  constexpr int rounding_stride = kRoundingInSmem ? Traits::NumMmaThreads : 1;
  if constexpr (kFixedMax) {
    softmax.fix_max();
    for (int r = 0; r < kRows; ++r) { rounding[r * rounding_stride] = 0.f; }
  }
  // The softmax of one key block; false when O needs no rescaling (no row maximum moved, or a softcap's fixed
  // maximum).
  auto softmax_step = [&](auto& tSrS, cute::array<float, kRows>& rescale) {
    if constexpr (kFixedMax) {
      softmax.step_fixed_max(tSrS);
      return false;
    } else {
      return softmax.template step<Traits::kLazyRescale>(tSrS, rescale);
    }
  };

  // P for P V; the fixed-maximum softcap then also keeps, on boundary blocks, what the rounding changed of the row
  // sums (OnlineSoftmax::add_rounding).
  auto convert_p = [&](auto const& tSrS, auto& tOrP, auto masked) {
    convert_type_into(tSrS, tOrP);
    if constexpr (kFixedMax) {
      if (masked) { softmax.add_rounding(tSrS, tOrP, rounding, rounding_stride); }
    }
  };

  // Ping-pong between the consumer warpgroups (FlashAttention-3 paper §3.1; a round robin with three): a warpgroup
  // issues its GEMMs only in its turn and hands the turn to the next right after, so one warpgroup's softmax runs
  // under the others' GEMMs. Named barrier (user id) 2 + w is warpgroup w's turn (its 128 threads wait, the previous
  // warpgroup's 128 arrive). All warpgroups take the same number of turns per tile; the last warpgroup's last
  // hand-over of a tile is warpgroup 0's first turn of the next (the kernel makes the first hand-over and takes the
  // last one), so none runs two arrivals ahead.
  int const wg = mma_tidx / cutlass::NumThreadsPerWarpGroup;
  bool const pingpong = !kCross && params.pingpong && n_block_max > n_block_min;  // (no turns with kCrossTile)
  auto wait_turn = [&] {
    if (pingpong) { cutlass::arch::NamedBarrier::sync(Traits::kTurnBarrierThreads, 2 + wg); }
  };
  auto pass_turn = [&] {
    if (pingpong) {
      int const next = wg + 1 == Traits::NumMmaWarpGroups ? 0 : wg + 1;
      cutlass::arch::NamedBarrier::arrive(Traits::kTurnBarrierThreads, 2 + next);
    }
  };

  if (n_block_max > n_block_min) {
    // Intra-warpgroup overlap (FlashAttention-3 paper §3.2, Algorithm 2): while the softmax of key block j runs
    // on the CUDA cores, the tensor cores already work on O += P_{j-1} V_{j-1}. K and V stages are read one
    // block apart, hence two read states (carried from tile to tile).
    auto S = [&] { return partition_fragment_C(tiled_mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{}); };
    Tensor tSrS_own = S();
    auto& tSrS = select_ref<kCross>(tSrS_first, tSrS_own);
    Tensor tOrP = make_tensor<Element>(acc_to_a_operand(tSrS.layout()));  // P of the previous block, A operand

    int n_block = n_block_max - 1;
    if constexpr (!kCross) {
      stage_wait(ss.pipeline_k, k_state);
      wait_turn();
      wgmma</*zero_init=*/true>(tiled_mma_qk, tSrQ, tSrK(_, _, _, k_state.index()), tSrS);
      pass_turn();
    }
    warpgroup_wait<0>();
    stage_release(ss.pipeline_k, k_state);
    ++k_state;
    bool const first_masked = boundary(n_block);
    prepare_scores(tSrS, n_block, first_masked);
    cute::array<float, kRows> rescale;
    softmax_step(tSrS, rescale);  // O is still zero: nothing to rescale
    convert_p(tSrS, tOrP, first_masked);
    // kCross: end this dead value's life, or the next tile's QKᵀ (its accumulator operands are asm inputs) keeps it
    // live through the key-block loop. Here no WGMMA is in flight on it; before that QKᵀ, on an empty tile's path, the
    // clear wrote registers a QKᵀ might still be writing (undefined in PTX). Level on the H200 (session 31 call 1).
    if constexpr (kCross) { clear(tSrS_first); }

    // One key block after the first; masked: whether the mask crosses it (boundary), a compile-time constant where
    // Traits::kSplitMaskLoop, so that the interior blocks run a loop with no mask code (or its live values) in it.
    auto step = [&](int n_block, auto masked) {
      Tensor tSrS = S();
      stage_wait(ss.pipeline_k, k_state);
      stage_wait(ss.pipeline_v, v_state);
      wait_turn();
      if constexpr (kSplitQK) {
        // Each half of S is its own commit group: the tanh of the first runs while the second is computed.
        constexpr int kHalf = decltype(size(tSrS))::value / 2;
        Tensor s0 = make_tensor(tSrS.data(), SHalfLayout{});
        Tensor s1 = make_tensor(tSrS.data() + kHalf, SHalfLayout{});
        int const stage = k_state.index();
        warpgroup_fence_operand(tSrS);
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < 2; ++h) {
          warpgroup_arrive();
          tiled_mma_qk_half.accumulate_ = GMMA::ScaleOut::Zero;
          CUTLASS_PRAGMA_UNROLL
          for (int k_block = 0; k_block < size<2>(tSrQh); ++k_block) {
            cute::gemm(tiled_mma_qk_half, tSrQh(_, 0, k_block), tSrKh(_, h, k_block, stage),
                       (h == 0 ? s0 : s1)(_, 0, 0));
            tiled_mma_qk_half.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
        }
        warpgroup_fence_operand(tSrS);
        wgmma</*zero_init=*/false>(tiled_mma_pv, tOrP, tOrV(_, _, _, v_state.index()), tOrO);
        pass_turn();
        warpgroup_wait<2>();  // the first half of S
        warpgroup_fence_operand(tSrS);
        // ptxas moves register-only work past a wgmma wait (the PTX order was right, the SASS had every tanh after
        // the second wait); a branch it cannot resolve (softcap_pre's bits are never 0 with a softcap) closes the
        // block, so the first half's tanh stays ahead of the wait for the second half. The test is on the bits, not
        // the float: under fast math a subnormal softcap_pre compares equal to 0.
        if (__float_as_uint(params.softcap_pre) != 0u) {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < kHalf; ++i) { tSrS(i) = softcap_tanh<Element>(tSrS(i) * params.softcap_pre); }
        }
        warpgroup_fence_operand(tSrS);
        warpgroup_wait<1>();  // the second half; P V of the previous block may still run
        warpgroup_fence_operand(tSrS);
        stage_release(ss.pipeline_k, k_state);
        ++k_state;
        CUTLASS_PRAGMA_UNROLL
        for (int i = kHalf; i < 2 * kHalf; ++i) { tSrS(i) = softcap_tanh<Element>(tSrS(i) * params.softcap_pre); }
        if (masked) { window.template apply<Traits::NumMmaWarpGroups == 2>(tSrS, tScS, m_block, n_block); }
      } else {
        wgmma</*zero_init=*/true>(tiled_mma_qk, q_operand(), tSrK(_, _, _, k_state.index()), tSrS);
        wgmma</*zero_init=*/false>(tiled_mma_pv, tOrP, tOrV(_, _, _, v_state.index()), tOrO);
        pass_turn();
        warpgroup_wait<1>();  // S of this block is ready; P V of the previous one may still run
        stage_release(ss.pipeline_k, k_state);
        ++k_state;
        prepare_scores(tSrS, n_block, masked);
      }
      bool const rescale_o = softmax_step(tSrS, rescale);
      warpgroup_wait<0>();  // O and the registers of P are free again
      stage_release(ss.pipeline_v, v_state);
      ++v_state;
      if (rescale_o) { OnlineSoftmax<kRows>::scale_rows(tOrO, rescale); }
      convert_p(tSrS, tOrP, masked);
    };
    // Blocks descend: those at or past interior_hi (the causal diagonal or a window's right edge, seqlen_k, a
    // document's end), then the interior run, then those below interior_lo (a window's left edge, a document's start);
    // with no interior run every block is masked.
    if constexpr (Traits::kSplitMaskLoop) {
      --n_block;
      while (n_block >= n_block_min) {
        if (boundary(n_block)) {
          step(n_block, cute::true_type{});
          --n_block;
        } else {
          int const n_end = cute::max(interior_lo, n_block_min);
          for (; n_block >= n_end; --n_block) { step(n_block, cute::false_type{}); }
        }
      }
    } else {
      for (--n_block; n_block >= n_block_min; --n_block) { step(n_block, boundary(n_block)); }
    }

    // Every QKᵀ of this tile has completed: sQ (and tile_idx) may take the next tile while P V and the epilogue run
    // (kCross: a QKᵀ never read may still read this sQ then).
    ss.barrier_q_empty[q_buf].arrive();
    stage_wait(ss.pipeline_v, v_state);
    wait_turn();
    wgmma</*zero_init=*/false>(tiled_mma_pv, tOrP, tOrV(_, _, _, v_state.index()), tOrO);
    pass_turn();
    if constexpr (kCross) {
      issue_next();
      warpgroup_wait<1>();  // this P V; the next tile's QKᵀ runs on
    } else {
      warpgroup_wait<0>();
    }
    stage_release(ss.pipeline_v, v_state);
    ++v_state;
  } else {
    ss.barrier_q_empty[q_buf].arrive();
    if constexpr (kCross) {
      issue_next();
      warpgroup_wait<1>();  // the QKᵀ issued for this tile (never read: no key block); the next one runs on
    }
  }

  // Rows too large for the one-FFMA exponent are redone after the kernel (kExactRowsFlagLog2; the fixed maximum
  // bounds them by the softcap).
  if constexpr (!kFixedMax) {
    if (__any_sync(0xffffffffu, softmax.needs_exact_rows()) && mma_tidx % 32 == 0) { *params.exact_rows_flag = 1; }
  }

  // Epilogue: O / l and LSE (rows past seqlen_q and columns past head_dim_v are not written).
  cute::array<float, kRows> lse;
  auto inv_sum = softmax.template finalize<kFixedMax>(params.score_scale, lse, rounding, rounding_stride);
  OnlineSoftmax<kRows>::scale_rows(tOrO, inv_sum);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(tOrO); ++i) { tOrO(i) = o_in_range<Element>(tOrO(i)); }  // (fp16: clamped to its range)
  Tensor tOrO_out = convert_type<Element>(tOrO);
  Tensor tOcO = thr_mma_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor c = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
  fwd_store_o_smem<Traits>(params, ss, tiled_mma_pv, tOrO_out, mma_tidx, m_block, bidh, info);
  float* lse_base =
      params.lse_ptr + info.bidb * params.lse_batch_stride + bidh * params.lse_head_stride + info.offset_q;
  if (mma_tidx % 4 == 0) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      int const row = m_block * kBlockM + get<0>(c(r, 0));
      if (row < info.seqlen_q) { lse_base[row] = lse[r]; }
    }
  }
}

template <class Traits, int kSoftcapMode>
__global__ void __launch_bounds__(Traits::NumThreads, 1)
    flash_fwd_sm90_kernel(CUTE_GRID_CONSTANT typename Traits::Params const params) {
  using Pipeline = typename Traits::Pipeline;
  extern __shared__ char smem_buf[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);

  int const warp_idx = cutlass::canonical_warp_idx_sync();
  int const warp_group_idx = cutlass::canonical_warp_group_idx();
  bool const lane_predicate = cute::elect_one_sync();

  if (warp_idx == 0 && lane_predicate) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    for (int b = 0; b < Traits::kQBuffers; ++b) {
      ss.barrier_q[b].init(/*arrive_count=*/1);
      ss.barrier_q_empty[b].init(/*arrive_count=*/Traits::NumMmaThreads);
    }
  }

  typename Pipeline::Params pipeline_params;
  pipeline_params.transaction_bytes = Traits::kTmaBytesKV;
  pipeline_params.role = warp_group_idx == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipeline_params.is_leader = threadIdx.x == 0;
  pipeline_params.num_consumers = Traits::NumMmaThreads;
  Pipeline pipeline_k(ss.pipeline_k, pipeline_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_v(ss.pipeline_v, pipeline_params, Shape<_1, _1, _1>{});
  // Barrier initialisation must be visible to every thread (and the async proxy) before first use.
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warp_group_idx == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    // The pipeline's leader (thread 0) is the one thread that issues every TMA load and picks the tiles: it hands
    // each tile to the consumers through tile_idx and tile_info, published by its arrival on barrier_q
    // (release/acquire).
    if (threadIdx.x == 0) {
      auto write_state = cutlass::make_producer_start_state<Pipeline>();
      int tile = blockIdx.x;
      for (int iter = 0;; ++iter) {
        // Tile iter goes to Q buffer iter % kQBuffers, once the consumers are done with its previous use.
        int const q_buf = iter % Traits::kQBuffers;
        if (iter >= Traits::kQBuffers) { ss.barrier_q_empty[q_buf].wait((iter / Traits::kQBuffers - 1) & 1); }
        if (tile >= params.num_tiles) {
          ss.tile_idx[q_buf] = -1;
          ss.barrier_q[q_buf].arrive();
          break;
        }
        // Ask for the next tile now: the atomic's latency passes while this tile's loads are issued.
        int next = params.num_tiles;
        if constexpr (Traits::kPersistent) {
          if (params.tile_counter != nullptr) {
            // r + gridDim.x would pass INT32_MAX (and wrap negative) within gridDim.x of 2^31 tiles: compare first
            int const r = atomicAdd(params.tile_counter, 1);
            next = r < params.num_tiles - int(gridDim.x) ? r + int(gridDim.x) : params.num_tiles;
          }
        }
        int m_block, bidh, n_block_min, n_block_max;
        SeqlenInfo const info = Traits::decode_tile(params, tile, m_block, bidh, n_block_min, n_block_max);
        ss.tile_idx[q_buf] = tile;
        ss.tile_info[q_buf] = typename Traits::TileInfo{info, m_block, bidh, n_block_min, n_block_max};
        if (n_block_max > n_block_min) {
          fwd_producer<Traits>(params, ss, pipeline_k, pipeline_v, write_state, q_buf, m_block, bidh, info,
                               n_block_min, n_block_max);
        } else {
          ss.barrier_q[q_buf].arrive();  // no key to see: the consumers write zeros and LSE -inf
        }
        if constexpr (!Traits::kPersistent) { break; }  // one tile per CTA: no hand-over of a next one
        tile = next;
      }
      // Keep the producer alive until the consumers have released every stage it filled.
      pipeline_k.producer_tail(write_state);
      pipeline_v.producer_tail(write_state);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    int const mma_tidx = threadIdx.x - cutlass::NumThreadsPerWarpGroup;
    int const wg = mma_tidx / cutlass::NumThreadsPerWarpGroup;
    bool const last_wg = wg + 1 == Traits::NumMmaWarpGroups;
    // Warpgroup 0 takes the first turn.
    if (params.pingpong && last_wg) { cutlass::arch::NamedBarrier::arrive(Traits::kTurnBarrierThreads, 2 + 0); }
    typename Traits::PipelineState k_state, v_state;
    typename Traits::TiledMmaQK tiled_mma_qk;
    auto tSrS_first = partition_fragment_C(tiled_mma_qk, Shape<Int<Traits::kBlockM>, Int<Traits::kBlockN>>{});
    // Traits::kCrossTile: the first QKᵀ of tile `it` into tSrS_first (see fwd_consumer). Its Q buffer's barrier is
    // waited on here and again at the top of the loop: its phase cannot move on before this CTA's consumers release
    // that buffer.
    auto issue_first_qk = [&](int it) {
      int const b = it % Traits::kQBuffers;
      ss.barrier_q[b].wait((it / Traits::kQBuffers) & 1);
      bool const has_blocks = ss.tile_idx[b] >= 0 && ss.tile_info[b].n_block_max > ss.tile_info[b].n_block_min;
      if (has_blocks) { stage_wait(ss.pipeline_k, k_state); }  // (k_state advances when the tile reads S)
      auto thr_mma_qk = tiled_mma_qk.get_thread_slice(mma_tidx);
      Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q[b].data()), typename Traits::SmemLayoutQ{});
      Tensor sK = make_tensor(make_smem_ptr(ss.smem_k.data()), typename Traits::SmemLayoutKV{});
      Tensor tSrQ = thr_mma_qk.partition_fragment_A(sQ);
      Tensor tSrK = thr_mma_qk.partition_fragment_B(sK);
      wgmma</*zero_init=*/true>(tiled_mma_qk, tSrQ, tSrK(_, _, _, k_state.index()), tSrS_first);
    };
    if constexpr (Traits::kCrossTile) { issue_first_qk(0); }
    for (int iter = 0;; ++iter) {
      int const q_buf = iter % Traits::kQBuffers;
      ss.barrier_q[q_buf].wait((iter / Traits::kQBuffers) & 1);
      int const tile = ss.tile_idx[q_buf];
      if (tile < 0) { break; }
      typename Traits::TileInfo const t = ss.tile_info[q_buf];
      SeqlenInfo const& info = t.info;
      int const m_block = t.m_block, bidh = t.bidh, n_block_min = t.n_block_min, n_block_max = t.n_block_max;
      auto issue_next = [&] { issue_first_qk(iter + 1); };
      if constexpr (Traits::kQBuffers == 1) {
        fwd_consumer<Traits, kSoftcapMode, 0>(params, ss, k_state, v_state, mma_tidx, m_block, bidh, info,
                                              n_block_min, n_block_max, 0, tSrS_first, issue_next);
      } else if constexpr (Traits::kHeadDim == 64) {
        fwd_consumer<Traits, kSoftcapMode, -1>(params, ss, k_state, v_state, mma_tidx, m_block, bidh, info,
                                               n_block_min, n_block_max, q_buf, tSrS_first, issue_next);
      } else if (q_buf == 0) {
        fwd_consumer<Traits, kSoftcapMode, 0>(params, ss, k_state, v_state, mma_tidx, m_block, bidh, info,
                                              n_block_min, n_block_max, 0, tSrS_first, issue_next);
      } else {
        fwd_consumer<Traits, kSoftcapMode, 1>(params, ss, k_state, v_state, mma_tidx, m_block, bidh, info,
                                              n_block_min, n_block_max, 1, tSrS_first, issue_next);
      }
      if constexpr (!Traits::kPersistent) { break; }
    }
    if constexpr (Traits::kCrossTile) { warpgroup_wait<0>(); }  // the QKᵀ issued for the tile that was not there
    // Shared memory must outlive the reads of the last TMA store of O.
    if (mma_tidx % cutlass::NumThreadsPerWarpGroup == 0) { tma_store_wait<0>(); }
    // The last warpgroup's last hand-over is left on warpgroup 0's barrier: take it.
    if (params.pingpong && wg == 0) { cutlass::arch::NamedBarrier::sync(Traits::kTurnBarrierThreads, 2 + 0); }
  }
}

}  // namespace flash
