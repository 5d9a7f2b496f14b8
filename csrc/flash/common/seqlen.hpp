// Where one batch element's rows lie: dense batches (fixed lengths, batch strides) or variable-length batches
// (sequences packed along the rows, cu_seqlens offsets).
#pragma once

#include <cutlass/cutlass.h>

namespace flash {

struct SeqlenInfo {
  int offset_q, offset_k;  // first row of this sequence in the packed tensors; 0 for dense batches
  int seqlen_q, seqlen_k;
  int bidb;                // batch index for batch strides and TMA coordinates: 0 when varlen (rows carry it)
  int batch_idx;           // the sequence's index in the batch

  SeqlenInfo() = default;
  // cu_seqlens_q/k: int32 (batch + 1) prefix sums, or null for dense batches of seqlen_q x seqlen_k. Offsets are
  // clamped to [0, total] and lengths to >= 0, so that offsets no host check saw (direct op callers) cannot move a
  // sequence outside the packed tensors; valid offsets pass unchanged.
  CUTLASS_DEVICE SeqlenInfo(int const* cu_seqlens_q, int const* cu_seqlens_k, int seqlen_q_, int seqlen_k_,
                            int bidb_, int total_q, int total_k) {
    batch_idx = bidb_;
    if (cu_seqlens_q != nullptr) {
      offset_q = min(max(cu_seqlens_q[bidb_], 0), total_q);
      seqlen_q = min(max(cu_seqlens_q[bidb_ + 1], offset_q), total_q) - offset_q;
      offset_k = min(max(cu_seqlens_k[bidb_], 0), total_k);
      seqlen_k = min(max(cu_seqlens_k[bidb_ + 1], offset_k), total_k) - offset_k;
      bidb = 0;
    } else {
      offset_q = offset_k = 0;
      seqlen_q = seqlen_q_;
      seqlen_k = seqlen_k_;
      bidb = bidb_;
    }
  }
};

// First row of (sequence, head) in the backward's per-row workspaces (fp32 dQ accumulator, LSE_log2, D), whose
// rows come in whole tiles of kRounding: dense batches hold rows_per_head = seqlen_q rounded up per (batch, head);
// varlen sequences start at multiples of kRounding inside rows_per_head = (total_q + batch * kRounding) rounded up
// per head (sequence b at ((cu_seqlens_q[b] + b * kRounding) / kRounding) * kRounding: the regions cannot overlap
// for non-decreasing offsets).
template <int kRounding>
CUTLASS_DEVICE int64_t bwd_workspace_row(bool varlen, int nheads, int rows_per_head, SeqlenInfo const& info,
                                         int bidh) {
  if (varlen) {  // info.offset_q is clamped to [0, total_q]: the region stays inside rows_per_head
    int64_t const start = (int64_t(info.offset_q) + int64_t(info.batch_idx) * kRounding) / kRounding * kRounding;
    return int64_t(bidh) * rows_per_head + start;
  }
  return (int64_t(info.batch_idx) * nheads + bidh) * rows_per_head;
}

}  // namespace flash
