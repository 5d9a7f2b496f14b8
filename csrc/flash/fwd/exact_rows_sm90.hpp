// The forward's exact pass for rows whose scaled scores are too large for the main kernel's exponent (one FFMA
// against a rounded maximum: flash/common/softmax.hpp, kExactRowsLimitLog2). Launched after every forward kernel as
// a programmatic dependent launch; it returns at once unless the forward set its flag, so it costs a launch and a
// load. When the flag is set, every row whose LSE is non-finite or of magnitude kExactRowsSelectLog2 or more (in
// log2 units; softmax.hpp says why such a row's own maximum set the flag) is recomputed: one warp per row, Q, K and V
// from global memory, float32 dot products, each scaled score (natural units) rounded before the row's rounded maximum
// is subtracted (P = 1 at the maximum, never above), and O rescaled between the same rounded maxima. Slow (no tensor
// cores), and meant only for inputs past that bound.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "flash/common/block_range.hpp"
#include "flash/common/seqlen.hpp"
#include "flash/common/softmax.hpp"
#include "flash/params.hpp"

namespace flash {

// The forward's own parameters plus what its launcher derives (window sides as kernel_window gives them).
struct ExactRowsParams {
  FwdParams fwd;
  float score_scale, softcap_pre;  // ScoreScales' (score_scale without log2 e: the pass works in natural units)
  int window_left, window_right;
};

constexpr int kExactRowsThreads = 256;
constexpr int kExactRowsMaxDimsPerLane = 8;  // head_dim_v <= 256

template <class Element>
__global__ void __launch_bounds__(kExactRowsThreads) fwd_exact_rows_kernel(__grid_constant__ ExactRowsParams const p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the forward kernel has completed and its writes are visible
#endif
  FwdParams const& f = p.fwd;
  if (*f.exact_rows_flag == 0) { return; }
  bool const varlen = f.cu_seqlens_q != nullptr;
  int64_t const lse_batch_stride = varlen ? 0 : int64_t(f.nheads) * f.seqlen_q;  // as the forward kernel's
  int64_t const lse_head_stride = varlen ? int64_t(f.total_q) : int64_t(f.seqlen_q);
  int const qheads_per_kvhead = f.nheads / f.nheads_k;
  int const lane = threadIdx.x % 32;
  int64_t const warps = int64_t(gridDim.x) * (kExactRowsThreads / 32);
  int64_t const rows = int64_t(f.batch) * f.nheads * f.seqlen_q;
  for (int64_t w = blockIdx.x * int64_t(kExactRowsThreads / 32) + threadIdx.x / 32; w < rows; w += warps) {
    int const i = int(w % f.seqlen_q);
    int const bidh = int(w / f.seqlen_q % f.nheads);
    int const batch_idx = int(w / f.seqlen_q / f.nheads);
    SeqlenInfo const info(f.cu_seqlens_q, f.cu_seqlens_k, f.seqlen_q, f.seqlen_k, batch_idx, f.total_q, f.total_k);
    if (i >= info.seqlen_q) { continue; }
    float* lse = f.lse_ptr + info.bidb * lse_batch_stride + bidh * lse_head_stride + info.offset_q + i;
    if (fabsf(*lse) * float(M_LOG2E) < kExactRowsSelectLog2) { continue; }  // (NaN and +-inf go on)
    // Visible keys [lo, hi) (flash/common/mask.hpp's rule).
    int64_t const base = int64_t(i) + info.seqlen_k - info.seqlen_q;
    int64_t lo = cute::max(base - p.window_left, int64_t(0));
    int64_t hi = cute::min(base + p.window_right + 1, int64_t(info.seqlen_k));
    if (f.doc_bounds != nullptr) {
      int2 const d = reinterpret_cast<int2 const*>(f.doc_bounds)[int64_t(batch_idx) * info.seqlen_q + i];
      lo = cute::max(lo, int64_t(d.x));
      hi = cute::min(hi, int64_t(d.y));
    }
    int const bidh_k = bidh / qheads_per_kvhead;
    Element const* q = static_cast<Element const*>(f.q_ptr) + info.bidb * f.q_batch_stride +
                       (info.offset_q + int64_t(i)) * f.q_row_stride + bidh * f.q_head_stride;
    Element const* k = static_cast<Element const*>(f.k_ptr) + info.bidb * f.k_batch_stride +
                       int64_t(info.offset_k) * f.k_row_stride + bidh_k * f.k_head_stride;
    Element const* v = static_cast<Element const*>(f.v_ptr) + info.bidb * f.v_batch_stride +
                       int64_t(info.offset_k) * f.v_row_stride + bidh_k * f.v_head_stride;
    // Natural units (exp, not exp2): a finite score's scaled value overflows only where the float32 reference's does
    // (softmax_scale > 1), not from ~2.4e38 / softmax_scale on as in log2 units.
    float const c = p.score_scale;
    float m = -INFINITY;  // the row's largest rounded scaled score so far
    float l = 0.f;
    bool nan = false;  // a NaN score makes the row NaN, as in the reference (fmaxf would skip it)
    float o[kExactRowsMaxDimsPerLane];
    for (int t = 0; t < kExactRowsMaxDimsPerLane; ++t) { o[t] = 0.f; }
    for (int64_t key0 = lo; key0 < hi; key0 += 32) {
      int64_t const key = key0 + lane;
      float y = -INFINITY;
      bool overflow = false;  // a finite score whose scaled value is not: NaN, never a silent 0 row
      if (key < hi) {
        float s = 0.f;
        for (int d = 0; d < f.head_dim; ++d) { s = fmaf(float(q[d]), float(k[key * f.k_row_stride + d]), s); }
        y = __fmul_rn(f.softcap > 0.f ? tanhf(s * p.softcap_pre) : s, c);
        overflow = fabsf(y) == INFINITY && fabsf(s) < INFINITY;
      }
      nan |= __any_sync(0xffffffffu, y != y || overflow);
      float m_new = fmaxf(m, y);
      for (int off = 16; off > 0; off /= 2) { m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, off)); }
      if (m_new == -INFINITY) { continue; }  // (warp-uniform) nothing visible yet
      float const pr = y == -INFINITY ? 0.f : expf(y - m_new);
      float const rescale = m == -INFINITY ? 0.f : expf(m - m_new);
      m = m_new;
      float sum = pr;
      for (int off = 16; off > 0; off /= 2) { sum += __shfl_xor_sync(0xffffffffu, sum, off); }
      l = l * rescale + sum;
      for (int t = 0; t < kExactRowsMaxDimsPerLane; ++t) { o[t] *= rescale; }
      int const n = int(cute::min(int64_t(32), hi - key0));
      for (int src = 0; src < n; ++src) {
        float const ps = __shfl_sync(0xffffffffu, pr, src);
        Element const* v_row = v + (key0 + src) * f.v_row_stride;
        for (int t = 0; t < kExactRowsMaxDimsPerLane; ++t) {
          int const d = lane + 32 * t;
          if (d < f.head_dim_v) { o[t] = fmaf(ps, float(v_row[d]), o[t]); }
        }
      }
    }
    // As the kernel's finalize: a row that saw no key gets 0 and LSE -inf; a NaN sum stays NaN.
    if (nan) { l = NAN; }
    bool const empty = l == 0.f;
    float const inv = empty ? 0.f : 1.f / l;
    Element* out = static_cast<Element*>(f.o_ptr) + info.bidb * f.o_batch_stride +
                   (info.offset_q + int64_t(i)) * f.o_row_stride + bidh * f.o_head_stride;
    for (int t = 0; t < kExactRowsMaxDimsPerLane; ++t) {
      int const d = lane + 32 * t;
      if (d < f.head_dim_v) { out[d] = Element(o_in_range<Element>(o[t] * inv)); }  // (fp16: clamped)
    }
    if (lane == 0) { *lse = empty ? -INFINITY : m + logf(l); }
  }
}

// Launches the exact pass after the forward kernel on `stream` (window sides as kernel_window gives them).
template <class Element>
cudaError_t launch_fwd_exact_rows(FwdParams const& p, ScoreScales const& scales, int window_left, int window_right,
                                  cudaStream_t stream) {
  ExactRowsParams const ep{p, scales.score_scale, scales.softcap_pre, window_left, window_right};
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(std::max(p.num_sms, 1));
  config.blockDim = dim3(kExactRowsThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, fwd_exact_rows_kernel<Element>, ep);
}

}  // namespace flash
