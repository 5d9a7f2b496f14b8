// The host -> kernel contract: plain pointers, int64 strides (in elements) and sizes. No torch types.
#pragma once

#include <cstdint>

namespace flash {

struct FwdParams {
  // q: (batch, seqlen_q, nheads, head_dim); k: (batch, seqlen_k, nheads_k, head_dim); v: (batch, seqlen_k,
  // nheads_k, head_dim_v); last dim stride 1.
  // nheads_k divides nheads: query head h reads K/V head h / (nheads / nheads_k) (GQA/MQA; MHA when equal).
  void const* q_ptr;
  void const* k_ptr;
  void const* v_ptr;
  void* o_ptr;      // (batch, seqlen_q, nheads, head_dim_v), written
  float* lse_ptr;   // (batch, nheads, seqlen_q) contiguous, natural log, written

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;

  int batch;
  int nheads;
  int nheads_k;
  int seqlen_q;
  int seqlen_k;
  // The caller's head dims of Q/K and of V/O: multiples of 8 up to the kernel's compile-time width kHeadDim (64, 128
  // or 256, holding the larger); the columns past them are zero-filled on load and never stored.
  int head_dim;
  int head_dim_v;
  // Variable-length batches (null for dense ones): q/o are (total_q, nheads, head_dim{,_v}) and k/v (total_k,
  // nheads_k, head_dim{,_v}), sequence b at rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and [cu_seqlens_k[b],
  // cu_seqlens_k[b + 1]); seqlen_q/k are then upper bounds of the lengths, batch strides are unused and lse is
  // (nheads, total_q).
  int const* cu_seqlens_q;
  int const* cu_seqlens_k;
  int total_q, total_k;

  float softmax_scale;  // > 0
  float softcap;        // > 0: scores become softcap * tanh(softmax_scale * QKᵀ / softcap); 0: none
  // Row i sees key j iff i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right
  // (bottom-right aligned); -1: that side unbounded. Causal is (-1, 0).
  int window_left, window_right;
  // Documents (dense batches with seqlen_q == seqlen_k; else null): (batch, seqlen_q, 2) int32 contiguous, per
  // position i [doc_start[i], doc_end[i]): row i sees only keys j in it. Both nondecreasing along a row, and
  // doc_start[i] <= i < doc_end[i].
  int const* doc_bounds;
  bool pingpong;  // consumer warpgroups take turns issuing GEMMs (named barriers)
  // Persistent launch: num_sms CTAs take (m_block, head, batch) tiles from this zeroed int32 counter. Null: one CTA
  // per tile.
  int* tile_counter;
  int num_sms;  // the device's SMs (also the head_dim 64 tile choice)
  // A zeroed int32: the kernel sets it when some row's scaled maximum is too large for its exponent's FFMA, and the
  // launch's exact-rows pass then recomputes the rows whose LSE shows it (flash/fwd/exact_rows_sm90.hpp).
  int* exact_rows_flag;
};

struct BwdParams {
  // Inputs of the forward (same layouts as FwdParams), out and its gradient dO (any strides, last dim 1).
  void const* q_ptr;
  void const* k_ptr;
  void const* v_ptr;
  void const* o_ptr;     // o and do: (batch, seqlen_q, nheads, head_dim_v)
  void const* do_ptr;
  float const* lse_ptr;  // (batch, nheads, seqlen_q) contiguous, natural log, from the forward
  void* dq_ptr;          // (batch, seqlen_q, nheads, head_dim), written
  void* dk_ptr;          // (batch, seqlen_k, nheads_k, head_dim), written by the kernel unless dk_accum_ptr is set
  void* dv_ptr;          // (batch, seqlen_k, nheads_k, head_dim_v), likewise
  // GQA/MQA (nheads_k < nheads) with heads_per_cta == 1: the query heads of a group add their dK (already scaled) and
  // dV into these zeroed fp32 contiguous buffers shaped like k and v instead; the host converts them. Else null.
  float* dk_accum_ptr;
  float* dv_accum_ptr;
  // Query heads per backward CTA: 1, or (GQA, dk_accum_ptr null) the whole group, which then writes dk/dv (nheads_k
  // heads) directly (flash/config.hpp bwd_heads_per_cta).
  int heads_per_cta = 1;
  // The GPU's SM count: the group CTAs' sections of one wave (launch_bwd_sm90.hpp bwd_gqa_order); 0 gives L2 sections.
  int num_sms = 0;

  // Workspace, per (batch, head) of seqlen_q_rounded rows (seqlen_q rounded up to kBwdSeqlenQRounding = 128; varlen:
  // per head, each sequence in whole tiles, flash/common/seqlen.hpp bwd_workspace_row):
  float* dq_accum_ptr;  // (batch, nheads, seqlen_q_rounded, kHeadDim) fp32, zeroed before the main kernel
  float* lse_log2_ptr;  // (batch, nheads, seqlen_q_rounded): LSE * log2(e); +inf for rows with no key or padding
  float* dpsum_ptr;     // (batch, nheads, seqlen_q_rounded): D = rowsum(dO * O); 0 for padding

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;

  int batch;
  int nheads;
  int nheads_k;
  int seqlen_q;
  int seqlen_k;
  int seqlen_q_rounded;  // workspace rows per (batch, head); varlen: per head (see flash/common/seqlen.hpp)
  int head_dim;          // as FwdParams; dq_accum rows are the kernel's kHeadDim wide, dk_accum rows head_dim
  int head_dim_v;        // of v, o, do, dv and dv_accum's rows
  // Variable-length batches, as FwdParams (null for dense ones); dq/dk/dv like q/k/v, lse and dlse (nheads, total_q).
  int const* cu_seqlens_q;
  int const* cu_seqlens_k;
  int total_q, total_k;

  // Gradient of the loss with respect to the forward's LSE (batch, nheads, seqlen_q) contiguous fp32, or null
  // when the loss does not use the LSE: dS gains P ∘ dLSE (d LSE_i / d S_ij = P_ij).
  float const* dlse_ptr;

  float softmax_scale;  // as FwdParams
  float softcap;
  int window_left, window_right;
  int const* doc_bounds;  // as FwdParams
  // Deterministic mode (else null): zeroed int32 counters, one per 64 rows of the dQ workspace for dQ and, with the
  // GQA fp32 sums (dk_accum_ptr), one per (batch, K/V head, 64-key block) for dK/dV, ordering the cross-CTA sums.
  int* dq_semaphore;
  int* dkv_semaphore;
  // Copies of dq_accum (deterministic mode, head_dim > 128 kernels only): 1, or 2, where key block n adds into copy
  // n % 2 (dq_accum then holds two workspaces one after another, and dq_semaphore two counters per 64 rows), so that
  // the CTAs of a head queue for each dQ tile in two independent orders; the postprocess adds the copies.
  int dq_lanes = 1;
};

}  // namespace flash
