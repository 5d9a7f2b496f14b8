// The host -> kernel contract: plain pointers, int64 strides (in elements) and sizes. No torch types.
#pragma once

#include <cstdint>

namespace flash {

struct FwdParams {
  // q: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads, head_dim); last dim stride 1.
  void const* q_ptr;
  void const* k_ptr;
  void const* v_ptr;
  void* o_ptr;      // (batch, seqlen_q, nheads, head_dim), written
  float* lse_ptr;   // (batch, nheads, seqlen_q) contiguous, natural log, written

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;

  int batch;
  int nheads;
  int seqlen_q;
  int seqlen_k;
  int head_dim;

  float softmax_scale;       // > 0
  float softmax_scale_log2;  // softmax_scale * log2(e), so exp(x * scale) == exp2(x * scale_log2)
  bool is_causal;            // bottom-right aligned
};

}  // namespace flash
