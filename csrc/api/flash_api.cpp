// The only translation unit that includes torch: op schemas, checks, FwdParams, dispatch.
// The Python layer (flash_attn_hopper/interface.py) validates arguments with named errors first; the checks here
// are the safety net for direct torch.ops calls.

#include <cmath>
#include <atomic>
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "api/varlen_rows.hpp"
#include "flash/common/block_range.hpp"
#include "flash/common/tile_order.hpp"
#include "flash/config.hpp"
#include "flash/fwd/tile_choice.hpp"
#include "flash/dispatch.hpp"
#include "flash/params.hpp"

namespace {

using FwdFn = cudaError_t (*)(flash::FwdParams const&, cudaStream_t);
using BwdFn = cudaError_t (*)(flash::BwdParams const&, cudaStream_t);

struct Kernels {
  FwdFn fwd = nullptr;
  BwdFn bwd = nullptr;
};

// Rows per tensor (seqlen, or total tokens for varlen): the kernels' mask sums reach seqlen_q + seqlen_k plus two
// tiles of headroom (flash/common/mask.hpp), within int32 below this.
constexpr int64_t kMaxRows = (int64_t(1) << 30) - flash::kWindowHeadroom;

// The backward's tile width for a head_dim: the smallest of 64, 128, 256 that holds it (head_dim a multiple of 8 in
// [8, 256]; the kernels zero-fill the columns past it on load and never store them). 0: no kernel can.
int padded_head_dim(int64_t head_dim) {
  if (head_dim <= 0 || head_dim > 256 || head_dim % 8 != 0) { return 0; }
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

// The forward's: the smallest of 64, 96, 128, 192, 256 that holds it (same rule).
int fwd_padded_head_dim(int64_t head_dim) {
  int const padded = padded_head_dim(head_dim);
  return padded == 128 && head_dim <= 96 ? 96 : padded == 256 && head_dim <= 192 ? 192 : padded;
}

// The head_dim that picks the kernels: the larger of q/k's and v's (the tile width holds both; the narrower one's
// padded columns are zeros on load and never stored).
int kernel_head_dim(at::Tensor const& q, at::Tensor const& v) { return int(std::max(q.size(-1), v.size(-1))); }

Kernels select_kernels(int head_dim, at::ScalarType dtype) {
  bool const bf16 = dtype == at::kBFloat16;
  int const fwd_padded = fwd_padded_head_dim(head_dim), bwd_padded = padded_head_dim(head_dim);
  Kernels k;
#define FAH_FWD_CASE(HDIM, NAME, IS_BF16) \
  if (fwd_padded == HDIM && bf16 == IS_BF16) { k.fwd = &flash::run_fwd_hdim##HDIM##_##NAME; }
#define FAH_BWD_CASE(HDIM, NAME, IS_BF16) \
  if (bwd_padded == HDIM && bf16 == IS_BF16) { k.bwd = &flash::run_bwd_hdim##HDIM##_##NAME; }
#if defined(FAH_FP16)
#if defined(FAH_HDIM64)
  FAH_FWD_CASE(64, fp16, false)
  FAH_BWD_CASE(64, fp16, false)
#endif
#if defined(FAH_HDIM96)
  FAH_FWD_CASE(96, fp16, false)
#endif
#if defined(FAH_HDIM128)
  FAH_FWD_CASE(128, fp16, false)
  FAH_BWD_CASE(128, fp16, false)
#endif
#if defined(FAH_HDIM192)
  FAH_FWD_CASE(192, fp16, false)
#endif
#if defined(FAH_HDIM256)
  FAH_FWD_CASE(256, fp16, false)
  FAH_BWD_CASE(256, fp16, false)
#endif
#endif
#if defined(FAH_BF16)
#if defined(FAH_HDIM64)
  FAH_FWD_CASE(64, bf16, true)
  FAH_BWD_CASE(64, bf16, true)
#endif
#if defined(FAH_HDIM96)
  FAH_FWD_CASE(96, bf16, true)
#endif
#if defined(FAH_HDIM128)
  FAH_FWD_CASE(128, bf16, true)
  FAH_BWD_CASE(128, bf16, true)
#endif
#if defined(FAH_HDIM192)
  FAH_FWD_CASE(192, bf16, true)
#endif
#if defined(FAH_HDIM256)
  FAH_FWD_CASE(256, bf16, true)
  FAH_BWD_CASE(256, bf16, true)
#endif
#endif
#undef FAH_FWD_CASE
#undef FAH_BWD_CASE
  return k;
}

// The forward's tile height (query rows per CTA tile) for a problem, as the launcher picks it
// (flash/fwd/tile_choice.hpp; FAH_FWD_BLOCK_M forces it), for tests and benchmarks. Arguments as attention's;
// num_sms: the GPU's SM count.
int64_t fwd_block_m(int64_t head_dim, int64_t head_dim_v, int64_t batch, int64_t nheads, int64_t seqlen_q,
                    int64_t seqlen_k, bool causal, int64_t window_left, int64_t window_right, int64_t num_sms) {
  int const padded = fwd_padded_head_dim(std::max(head_dim, head_dim_v));
  TORCH_CHECK(padded != 0 && padded_head_dim(std::min(head_dim, head_dim_v)) != 0,
              "fwd_block_m: head_dim and head_dim_v must be multiples of 8 in [8, 256], got ", head_dim, " and ",
              head_dim_v);
  TORCH_CHECK(batch >= 1 && batch <= 65535 && nheads >= 1 && nheads <= 65535,
              "fwd_block_m: batch and nheads must be in [1, 65535], got ", batch, " and ", nheads);
  TORCH_CHECK(num_sms >= 1 && num_sms <= 65535, "fwd_block_m: num_sms must be in [1, 65535], got ", num_sms);
  TORCH_CHECK(seqlen_q >= 0 && seqlen_k >= 0 && seqlen_q < kMaxRows && seqlen_k < kMaxRows,
              "fwd_block_m: seqlen_q and seqlen_k must be in [0, 2^30 - 256), got ", seqlen_q, " and ", seqlen_k);
  TORCH_CHECK(window_left >= -1 && window_right >= -1 && (!causal || window_right <= 0),
              "fwd_block_m: window sides must be >= -1 (right 0 or -1 when causal)");
  auto side = [](int64_t w) { return w < 0 || w > INT32_MAX ? -1 : int(w); };
  return flash::fwd_block_m(padded, int(seqlen_q), int(seqlen_k), side(window_left), causal ? 0 : side(window_right),
                            batch * nheads, int(num_sms));
}

std::string build_config() {
  std::string hdims, dtypes;
#ifdef FAH_HDIM64
  hdims += "64,";
#endif
#ifdef FAH_HDIM96
  hdims += "96,";
#endif
#ifdef FAH_HDIM128
  hdims += "128,";
#endif
#ifdef FAH_HDIM192
  hdims += "192,";
#endif
#ifdef FAH_HDIM256
  hdims += "256,";
#endif
#ifdef FAH_FP16
  dtypes += "fp16,";
#endif
#ifdef FAH_BF16
  dtypes += "bf16,";
#endif
  return "head_dims=" + hdims + ";dtypes=" + dtypes;
}

// head_dim: the last dim t must have (q's for k, v's for out and dout; -1: not checked here).
void check_qkv(at::Tensor const& t, char const* name, at::Tensor const& q, int64_t head_dim) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == q.device(), name, " must be on the same device as q");
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), name, " must have the dtype of q");
  TORCH_CHECK(t.dim() == 4, name, " must have rank 4 (batch, seqlen, nheads, head_dim)");
  TORCH_CHECK(t.size(0) == q.size(0), name, " must match q in batch");
  TORCH_CHECK(head_dim < 0 || t.size(3) == head_dim, name, " must have head_dim ", head_dim, ", got ", t.size(3));
}

// The checks fwd and bwd share: dtypes, ranks, devices, batch, head_dim (k's that of q; v's head_dim_v may differ);
// k and v share seqlen_k and nheads_k, which divides q's nheads (GQA/MQA when smaller); the scale; the grid limits of
// batch and nheads.
void check_attention_inputs(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale) {
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, "q must be float16 or bfloat16");
  check_qkv(q, "q", q, -1);
  check_qkv(k, "k", q, q.size(3));
  check_qkv(v, "v", q, -1);
  int64_t const nheads = q.size(2), nheads_k = k.size(2);
  TORCH_CHECK(v.size(2) == nheads_k, "k and v must have the same nheads_k");
  TORCH_CHECK(nheads_k == 0 ? nheads == 0 : nheads % nheads_k == 0,
              "q's nheads must be a multiple of k's and v's nheads_k, got ", nheads, " and ", nheads_k);
  TORCH_CHECK(k.size(1) == v.size(1), "k and v must have the same seqlen_k");
  TORCH_CHECK(padded_head_dim(q.size(3)) != 0, "head_dim must be a multiple of 8 in [8, 256], got ", q.size(3));
  TORCH_CHECK(padded_head_dim(v.size(3)) != 0, "v's head_dim must be a multiple of 8 in [8, 256], got ", v.size(3));
  TORCH_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0, "softmax_scale must be finite and > 0");
  TORCH_CHECK(nheads <= 65535 && q.size(0) <= 65535, "nheads and batch must be at most 65535");
  // The kernels' mask and tile sums (flash/common/mask.hpp) stay in int below kMaxRows.
  TORCH_CHECK(q.size(1) < kMaxRows && k.size(1) < kMaxRows, "seqlen_q and seqlen_k must be below 2^30 - 256");
}

// Causal, window and softcap as the params take them: causal is the window's right side 0 (a right side other
// than -1 or 0 beside causal is a contradiction); -1 leaves a side unbounded; softcap 0 is off.
struct ScoreOptions {
  int window_left, window_right;
  float softcap;
};

ScoreOptions check_score_options(double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                                 double softcap) {
  TORCH_CHECK(window_left >= -1 && window_right >= -1, "window_size entries must be >= -1 (-1: unbounded), got (",
              window_left, ", ", window_right, ")");
  TORCH_CHECK(!causal || window_right <= 0, "causal=True fixes the window's right side at 0, got window_size (",
              window_left, ", ", window_right, ")");
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0, "softcap must be finite and >= 0, got ", softcap);
  // The kernels also take softmax_scale itself as a float32 (dQ's and dK's scale; the scores' without a softcap),
  // which must neither round to 0 or inf nor be flushed as subnormal (the build uses fast math).
  float const scale32 = float(softmax_scale);
  TORCH_CHECK(std::isnormal(scale32) && scale32 > 0.f && std::isnormal(float(double(scale32) * M_LOG2E)),
              "softmax_scale must be a positive normal float32 value, also times log2(e), got ", softmax_scale);
  TORCH_CHECK(softcap == 0 || std::isnormal(float(softmax_scale / softcap)),
              "softmax_scale / softcap must be a normal float32 value");
  // The kernels take the exponent's scale (the softcap when there is one) times log2(e) as a float32 that must be
  // normal and positive (score_scales in flash/common/softmax.hpp; the backward launcher relies on it).
  double const exp_scale = softcap > 0 ? softcap : softmax_scale;
  float const exp_scale_log2 = float(double(float(exp_scale)) * M_LOG2E);
  TORCH_CHECK(std::isnormal(exp_scale_log2) && exp_scale_log2 > 0.f, softcap > 0 ? "softcap" : "softmax_scale",
              " times log2(e) must be a positive normal float32 value, got ", exp_scale);
  // Sides beyond INT_MAX are unbounded in effect (the kernels clamp to the sequence lengths).
  auto side = [](int64_t w) { return w < 0 || w > INT32_MAX ? -1 : int(w); };
  return {side(window_left), causal ? 0 : side(window_right), float(softcap)};
}

// The compiled entry point of (head_dim, dtype), or an error naming what this build holds.
template <class Run>
Run* require_kernel(Run* run, int head_dim, at::ScalarType dtype) {
  constexpr bool kForward = std::is_same_v<Run, std::remove_pointer_t<FwdFn>>;
  TORCH_CHECK(run != nullptr, "head_dim ", head_dim, " (run by the head_dim ",
              kForward ? fwd_padded_head_dim(head_dim) : padded_head_dim(head_dim), kForward ? " forward" : " backward",
              " kernels) with dtype ", dtype, " is not in this build (", build_config(), ")");
  return run;
}

// Development knobs for measuring the forward's scheduling: FAH_FWD_PINGPONG=0 turns ping-pong off,
// FAH_FWD_PERSISTENT=0 launches one CTA per tile instead of one persistent CTA per SM.
bool env_flag(char const* name) {
  char const* v = std::getenv(name);
  return v == nullptr || std::string(v) != "0";
}
bool fwd_pingpong() {
  static bool const enabled = env_flag("FAH_FWD_PINGPONG");
  return enabled;
}
bool fwd_persistent() {
  static bool const enabled = env_flag("FAH_FWD_PERSISTENT");
  return enabled;
}

// A device attribute asked once per device (attributes do not change; this runs on every call).
constexpr int kMaxDevices = 64;
int cached_device_attribute(std::atomic<int> (&cache)[kMaxDevices], cudaDeviceAttr attr, int dev) {
  int value = dev < kMaxDevices ? cache[dev].load(std::memory_order_relaxed) : 0;
  if (value == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, dev));
    if (dev < kMaxDevices) { cache[dev].store(value, std::memory_order_relaxed); }
  }
  return value;
}

void check_sm90(at::Tensor const& q) {
  static std::atomic<bool> passed[kMaxDevices] = {};  // the answer does not change: ask the driver once
  int const dev = q.device().index();
  if (dev >= 0 && dev < kMaxDevices && passed[dev].load(std::memory_order_relaxed)) { return; }
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  TORCH_CHECK(major == 9 && minor == 0, "flash_attn_hopper needs an sm90 GPU (H100/H200); ", q.device(),
              " has compute capability ", major, ".", minor);
  if (dev >= 0 && dev < kMaxDevices) { passed[dev].store(true, std::memory_order_relaxed); }
}

int num_sms(at::Tensor const& q) {
  static std::atomic<int> cache[kMaxDevices] = {};
  return cached_device_attribute(cache, cudaDevAttrMultiProcessorCount, q.device().index());
}

// TMA reads in place only a 16-byte aligned base with nonzero 16-byte multiple strides (size-1 dims excepted)
// and a unit last stride; other views are copied once. Packed qkv slices and transposed gradients of the usual
// shapes qualify and are not copied.
at::Tensor tma_ready(at::Tensor const& t) {
  bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int d = 0; d < t.dim() - 1 && ok; ++d) {
    ok = t.size(d) == 1 || (t.stride(d) != 0 && (t.stride(d) * t.element_size()) % 16 == 0);
  }
  if (ok) { return t; }
  at::Tensor c = t.contiguous();
  // contiguous() returns the tensor itself when only a size-1 dim's stride or the alignment was off.
  return c.data_ptr() == t.data_ptr() ? t.clone(at::MemoryFormat::Contiguous) : c;
}

// A zero-filled workspace by one cudaMemsetAsync on the current stream: cheaper on the host than at::zeros (no
// operator dispatch, no fill kernel launch), which matters for the small buffers of every call.
at::Tensor zeroed(at::IntArrayRef sizes, at::TensorOptions const& options) {
  at::Tensor t = at::empty(sizes, options);
  if (t.numel() > 0) {
    C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(),
                                   c10::cuda::getCurrentCUDAStream(t.device().index()).stream()));
  }
  return t;
}

// Variable-length batches: the (batch + 1) int32 offsets on q's device, and the rows they cover (values are checked
// in Python, where they can be read; here only what needs no device read).
// Float -inf as bits, for fill_uncovered.
constexpr uint32_t kNegInfBits = 0xff800000u;

// flash::fill_uncovered_rows on a fresh contiguous (outer, rows, inner) tensor of 2- or 4-byte elements.
void fill_uncovered(at::Tensor const& t, uint32_t value_bits, int64_t outer, int64_t rows, int64_t inner,
                    int const* cu_seqlens, int batch, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(t.is_contiguous() && t.numel() == outer * rows * inner);
  cudaError_t const err = flash::fill_uncovered_rows(t.data_ptr(), int(t.element_size()), value_bits, outer, rows,
                                                     inner, cu_seqlens, batch, stream);
  TORCH_CHECK(err == cudaSuccess, "flash_attn_hopper: filling rows outside the sequences failed: ",
              cudaGetErrorString(err));
}

struct Varlen {
  int const* cu_seqlens_q = nullptr;
  int const* cu_seqlens_k = nullptr;
  int batch = 0, max_seqlen_q = 0, max_seqlen_k = 0;
};

Varlen check_varlen(at::Tensor const& q, at::Tensor const& k, at::Tensor const& cu_seqlens_q,
                    at::Tensor const& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  for (auto [name, t] : {std::pair<char const*, at::Tensor const*>{"cu_seqlens_q", &cu_seqlens_q},
                         std::pair<char const*, at::Tensor const*>{"cu_seqlens_k", &cu_seqlens_k}}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->device() == q.device() && t->dim() == 1 && t->is_contiguous() &&
                    t->numel() >= 1,
                name, " must be a contiguous 1-D int32 tensor of length batch + 1 on q's device");
  }
  TORCH_CHECK(cu_seqlens_q.numel() == cu_seqlens_k.numel(), "cu_seqlens_q and cu_seqlens_k must have the same length");
  TORCH_CHECK(cu_seqlens_q.numel() - 1 <= 65535, "at most 65535 sequences");
  TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0 && max_seqlen_q <= INT32_MAX && max_seqlen_k <= INT32_MAX,
              "max_seqlen_q and max_seqlen_k must be in [0, 2^31)");
  // No sequence is longer than its tensor: clamping the maxima is exact and keeps the kernels' index sums in range.
  return {cu_seqlens_q.data_ptr<int>(), cu_seqlens_k.data_ptr<int>(), int(cu_seqlens_q.numel() - 1),
          int(std::min<int64_t>(max_seqlen_q, q.size(0))), int(std::min<int64_t>(max_seqlen_k, k.size(0)))};
}

// Documents of a dense batch (packed sequences in each row): the kernels' per-position bounds, or nulls.
struct Documents {
  at::Tensor storage;  // an aligned copy when the caller's bounds were not 8-byte aligned, else the caller's tensor
  int const* bounds = nullptr;
};

// The bounds of the runs of equal consecutive [doc_start, doc_end] pairs of each row: the identity on bounds made from
// document ids (interface.document_bounds: one pair per document), and a partition of each row whatever the values.
// The deterministic backward needs one: its dQ turns count the key blocks that a query block's row-side hull reaches,
// and only for a partition does each of them visit that query block through its own key-side hull (a turn that never
// comes is a hang, as for cu_seqlens in monotone_offsets). CUDA tensors: varlen_rows.cu; other devices
// (the CPU tests' reference, meta): ATen ops.
at::Tensor doc_bounds_partition(at::Tensor const& b) {
  TORCH_CHECK(b.scalar_type() == at::kInt && b.dim() == 3 && b.size(2) == 2,
              "doc_bounds must be an int32 (batch, seqlen, 2) tensor");
  int64_t const batch = b.size(0), seqlen = b.size(1);
  if (seqlen == 0 || batch == 0) { return b.clone(at::MemoryFormat::Contiguous); }
  if (b.is_cuda()) {
    TORCH_CHECK(seqlen <= INT32_MAX && batch <= INT32_MAX, "doc_bounds: batch and seqlen must be below 2^31");
    c10::cuda::CUDAGuard guard(b.device());
    at::Tensor const in = b.contiguous();
    at::Tensor out = at::empty({batch, seqlen, 2}, b.options());
    at::Tensor row_bad = at::zeros({batch}, b.options());
    cudaError_t const err = flash::doc_bounds_partition(in.data_ptr<int>(), out.data_ptr<int>(),
                                                        row_bad.data_ptr<int>(), batch, int(seqlen),
                                                        c10::cuda::getCurrentCUDAStream(b.device().index()).stream());
    TORCH_CHECK(err == cudaSuccess, "flash_attn_hopper: doc_bounds_partition failed: ", cudaGetErrorString(err));
    return out;
  }
  at::Tensor starts = at::ones({batch, seqlen}, b.options().dtype(at::kBool));
  if (seqlen > 1) { starts.slice(1, 1).copy_(b.slice(1, 1).ne(b.slice(1, 0, seqlen - 1)).any(-1)); }
  at::Tensor const pos = at::arange(seqlen, b.options()).expand({batch, seqlen});
  at::Tensor const doc_start = std::get<0>(at::where(starts, pos, 0).cummax(1));
  // doc_end[i]: the first start after i, else seqlen
  at::Tensor const after = at::cat({at::where(starts, pos, seqlen).slice(1, 1), at::full({batch, 1}, seqlen,
                                                                                            b.options())}, 1);
  at::Tensor const doc_end = std::get<0>(after.flip({1}).cummin(1)).flip({1});
  return at::stack({doc_start, doc_end}, -1);  // int32 (arange on b's options), contiguous
}

// doc_bounds: None, or the int32 (batch, seqlen, 2) [doc_start, doc_end] tensor that flash_attn_hopper's Python layer
// derives from document_ids (interface._document_bounds). Its values are trusted: the kernels clamp every index they
// read into the row, so bad values cannot make them read out of bounds; partition (the deterministic backward) takes
// doc_bounds_partition of them, so bad values cannot make it hang either.
Documents check_documents(std::optional<at::Tensor> const& doc_bounds, at::Tensor const& q, at::Tensor const& k,
                          bool partition = false) {
  if (!doc_bounds.has_value()) { return {}; }
  at::Tensor const& b = *doc_bounds;
  TORCH_CHECK(q.size(1) == k.size(1), "documents need self-attention lengths: seqlen_q ", q.size(1),
              " != seqlen_k ", k.size(1));
  TORCH_CHECK(b.is_cuda() && b.device() == q.device() && b.scalar_type() == at::kInt && b.is_contiguous() &&
                  b.dim() == 3 && b.size(0) == q.size(0) && b.size(1) == q.size(1) && b.size(2) == 2,
              "doc_bounds must be a contiguous int32 (batch, seqlen, 2) tensor on q's device");
  if (partition) {
    at::Tensor const parts = doc_bounds_partition(b);  // a fresh allocation: aligned
    return {parts, parts.data_ptr<int>()};
  }
  // The kernels read a position's [doc_start, doc_end] as one int2 (8-byte) load. A contiguous int32 tensor may sit
  // 4 bytes off: a slice of a larger buffer, or one handed back by saved-tensor hooks (an offloader's arena); copy it.
  if (reinterpret_cast<uintptr_t>(b.data_ptr()) % (2 * sizeof(int)) != 0) {
    at::Tensor const copy = b.clone(at::MemoryFormat::Contiguous);
    return {copy, copy.data_ptr<int>()};
  }
  return {b, b.data_ptr<int>()};
}

// Forward of checked (batch, rows, nheads, head_dim) views into out (same layout, 3-D for varlen) and lse.
void launch_fwd(FwdFn run, at::Tensor const& q_in, at::Tensor const& k_in, at::Tensor const& v_in,
                at::Tensor const& out, at::Tensor const& lse, Varlen const& varlen, double softmax_scale,
                ScoreOptions const& opts, Documents const& docs = {}) {
  bool const is_varlen = varlen.cu_seqlens_q != nullptr;
  int const head_dim = q_in.size(3), head_dim_v = v_in.size(3);
  at::Tensor q = tma_ready(q_in), k = tma_ready(k_in), v = tma_ready(v_in);
  at::Tensor o = out.dim() == 3 ? out.unsqueeze(0) : out;

  flash::FwdParams p{};
  p.q_ptr = q.data_ptr();
  p.k_ptr = k.data_ptr();
  p.v_ptr = v.data_ptr();
  p.o_ptr = o.data_ptr();
  p.lse_ptr = lse.data_ptr<float>();
  p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_row_stride = k.stride(1), p.k_head_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_row_stride = v.stride(1), p.v_head_stride = v.stride(2);
  p.o_batch_stride = o.stride(0), p.o_row_stride = o.stride(1), p.o_head_stride = o.stride(2);
  p.nheads = q.size(2), p.nheads_k = int(k.size(2)), p.head_dim = head_dim, p.head_dim_v = head_dim_v;
  if (is_varlen) {
    p.batch = varlen.batch, p.seqlen_q = varlen.max_seqlen_q, p.seqlen_k = varlen.max_seqlen_k;
    p.cu_seqlens_q = varlen.cu_seqlens_q, p.cu_seqlens_k = varlen.cu_seqlens_k;
    p.total_q = int(q.size(1)), p.total_k = int(k.size(1));
  } else {
    p.batch = q.size(0), p.seqlen_q = q.size(1), p.seqlen_k = k.size(1);
  }
  p.softmax_scale = float(softmax_scale);
  p.softcap = opts.softcap;
  p.window_left = opts.window_left, p.window_right = opts.window_right;
  p.doc_bounds = docs.bounds;
  p.pingpong = fwd_pingpong();
  p.num_sms = num_sms(q);
  // One zeroed buffer: the persistent kernel's tile counter and the exact-rows flag (flash/params.hpp).
  at::Tensor const counters = zeroed({2}, q.options().dtype(at::kInt));
  if (fwd_persistent()) { p.tile_counter = counters.data_ptr<int>(); }
  p.exact_rows_flag = counters.data_ptr<int>() + 1;
  cudaError_t err = run(p, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, "flash_attn_hopper forward launch failed: ", cudaGetErrorString(err));
}

// `deterministic` only travels to the backward (autograd saves the forward's inputs); the forward is deterministic.
std::tuple<at::Tensor, at::Tensor> fwd(at::Tensor const& q_in, at::Tensor const& k_in, at::Tensor const& v_in,
                                       double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                                       double softcap, bool /*deterministic*/,
                                       std::optional<at::Tensor> const& doc_bounds) {
  check_attention_inputs(q_in, k_in, v_in, softmax_scale);
  ScoreOptions const opts = check_score_options(softmax_scale, causal, window_left, window_right, softcap);
  Documents const docs = check_documents(doc_bounds, q_in, k_in);
  int const batch = q_in.size(0), seqlen_q = q_in.size(1), nheads = q_in.size(2), head_dim_v = v_in.size(3);
  int const seqlen_k = k_in.size(1), kernel_hdim = kernel_head_dim(q_in, v_in);
  FwdFn const run =
      require_kernel(select_kernels(kernel_hdim, q_in.scalar_type()).fwd, kernel_hdim, q_in.scalar_type());

  c10::cuda::CUDAGuard guard(q_in.device());
  check_sm90(q_in);
  at::Tensor out = at::empty({batch, seqlen_q, nheads, head_dim_v}, q_in.options());
  at::Tensor lse = at::empty({batch, nheads, seqlen_q}, q_in.options().dtype(at::kFloat));
  if (out.numel() == 0 || seqlen_k == 0) {  // nothing to attend to: rows are 0, LSE -inf; no launch
    out.zero_();
    lse.fill_(-INFINITY);
    return {out, lse};
  }
  launch_fwd(run, q_in, k_in, v_in, out, lse, Varlen{}, softmax_scale, opts, docs);
  return {out, lse};
}

// q (total_q, nheads, head_dim), k (total_k, nheads_k, head_dim), v (total_k, nheads_k, head_dim_v) -> out
// (total_q, nheads, head_dim_v), lse (nheads, total_q). Rows no sequence covers (past cu_seqlens[-1]) get out 0 and
// LSE -inf. The values of cu_seqlens and max_seqlen are trusted here (the Python layer checks them on the host): with
// decreasing offsets or a max_seqlen below a sequence's length, rows may be left unwritten.
std::tuple<at::Tensor, at::Tensor> fwd_varlen(at::Tensor const& q_in, at::Tensor const& k_in, at::Tensor const& v_in,
                                              at::Tensor const& cu_seqlens_q, at::Tensor const& cu_seqlens_k,
                                              int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                                              bool causal, int64_t window_left, int64_t window_right,
                                              double softcap, bool /*deterministic*/) {
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && v_in.dim() == 3,
              "q, k, v must have rank 3 (total_tokens, nheads, head_dim) for variable-length attention");
  at::Tensor q = q_in.unsqueeze(0), k = k_in.unsqueeze(0), v = v_in.unsqueeze(0);
  check_attention_inputs(q, k, v, softmax_scale);
  ScoreOptions const opts = check_score_options(softmax_scale, causal, window_left, window_right, softcap);
  Varlen const varlen = check_varlen(q_in, k_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  int const kernel_hdim = kernel_head_dim(q, v);
  FwdFn const run = require_kernel(select_kernels(kernel_hdim, q.scalar_type()).fwd, kernel_hdim, q.scalar_type());

  c10::cuda::CUDAGuard guard(q_in.device());
  check_sm90(q_in);
  at::Tensor out = at::empty({q_in.size(0), q_in.size(1), v_in.size(2)}, q_in.options());
  at::Tensor lse = at::empty({q_in.size(1), q_in.size(0)}, q_in.options().dtype(at::kFloat));
  if (varlen.batch == 0 || out.numel() == 0 || k_in.size(0) == 0 || max_seqlen_q == 0 || max_seqlen_k == 0) {
    out.zero_();
    lse.fill_(-INFINITY);
    return {out, lse};
  }
  // Rows before cu_seqlens_q[0] or past cu_seqlens_q[-1] belong to no sequence: 0 and LSE -inf, written here;
  // the kernel writes every other row.
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(q_in.device().index()).stream();
  fill_uncovered(out, 0u, 1, q_in.size(0), q_in.size(1) * v_in.size(2), varlen.cu_seqlens_q, varlen.batch, stream);
  fill_uncovered(lse, kNegInfBits, q_in.size(1), q_in.size(0), 1, varlen.cu_seqlens_q, varlen.batch, stream);
  launch_fwd(run, q, k, v, out, lse, varlen, softmax_scale, opts);
  return {out, lse};
}

at::Tensor contiguous_dlse(std::optional<at::Tensor> const& dlse_in, at::Tensor const& lse, at::Tensor const& q) {
  if (!dlse_in.has_value()) { return at::Tensor(); }
  TORCH_CHECK(dlse_in->device() == q.device() && dlse_in->scalar_type() == at::kFloat &&
                  dlse_in->sizes() == lse.sizes(),
              "dlse must be a float32 tensor of lse's shape on q's device");
  return dlse_in->contiguous();  // the gradient of lse.sum() arrives expanded (stride 0)
}

// Backward of checked (batch, rows, nheads, head_dim) views (batch 1 and packed rows when varlen; v, out, dout with
// head_dim_v) into dq, dk, dv (allocated by the caller, in the layout of q, k, v).
void launch_bwd(BwdFn run, at::Tensor const& dout_in, at::Tensor const& q_in, at::Tensor const& k_in,
                at::Tensor const& v_in, at::Tensor const& out_in, at::Tensor const& lse, at::Tensor const& dlse, at::Tensor const& dq,
                at::Tensor const& dk, at::Tensor const& dv, Varlen const& varlen, double softmax_scale,
                ScoreOptions const& opts, bool deterministic, Documents const& docs = {}) {
  bool const is_varlen = varlen.cu_seqlens_q != nullptr;
  int const nheads = q_in.size(2), head_dim = q_in.size(3), head_dim_v = v_in.size(3), nheads_k = k_in.size(2);
  at::Tensor q = tma_ready(q_in), k = tma_ready(k_in), v = tma_ready(v_in);
  at::Tensor out = tma_ready(out_in), dout = tma_ready(dout_in);

  int const batch = is_varlen ? varlen.batch : q.size(0);
  int const seqlen_q = is_varlen ? varlen.max_seqlen_q : q.size(1);
  int const seqlen_k = is_varlen ? varlen.max_seqlen_k : k.size(1);
  constexpr int64_t kRound = flash::kBwdSeqlenQRounding;
  // Workspace rows per (batch, head), or per head when varlen (each sequence starting on a whole tile).
  int64_t const rows = is_varlen ? (q.size(1) + int64_t(batch) * kRound + kRound - 1) / kRound * kRound
                                 : (seqlen_q + kRound - 1) / kRound * kRound;
  TORCH_CHECK(rows <= INT32_MAX, "too many query rows for the backward's workspace");
  int64_t const ws_outer = is_varlen ? int64_t(nheads) : int64_t(batch) * nheads;
  auto f32 = q.options().dtype(at::kFloat);
  // Rows of the kernel's width (that of the larger head dim): the kernels index the dQ accumulator with it.
  int const kernel_head_dim = padded_head_dim(std::max(head_dim, head_dim_v));
  int kernel_left, kernel_right;
  flash::kernel_window(opts.window_left, opts.window_right, seqlen_q, seqlen_k, kernel_left, kernel_right);
  // A window wider than the sequences counts as none here (a speed choice only: the results do not depend on it).
  bool const full_rows =
      docs.bounds == nullptr && flash::window_hides_nothing(kernel_left, kernel_right, seqlen_q, seqlen_k);
  int const dq_lanes = flash::bwd_dq_lanes(kernel_head_dim, deterministic, full_rows, seqlen_k,
                                           ws_outer * rows * kernel_head_dim * int64_t(sizeof(float)));
  at::Tensor dq_accum = zeroed({dq_lanes * ws_outer, rows, int64_t(kernel_head_dim)}, f32);
  at::Tensor lse_log2 = at::empty({ws_outer, rows}, f32);
  at::Tensor dpsum = at::empty({ws_outer, rows}, f32);
  // GQA/MQA: one CTA runs a whole group's query heads over its K/V tile where that grid fills the GPU (dK/dV written
  // directly); else the query heads of a group add their dK/dV into fp32 sums, converted to the dtype afterwards.
  flash::BwdMask const mask = full_rows ? flash::BwdMask::kNone
                              : docs.bounds == nullptr && flash::causal_like(kernel_left, kernel_right, seqlen_q, seqlen_k)
                                  ? flash::BwdMask::kCausalLike
                                  : flash::BwdMask::kOther;
  int const heads_per_cta = flash::bwd_heads_per_cta(std::max(head_dim, head_dim_v), seqlen_k, batch, nheads, nheads_k,
                                                     num_sms(q), mask);
  bool const sums = nheads_k != nheads && heads_per_cta == 1;
  at::Tensor dk_accum, dv_accum;
  if (sums) {
    dk_accum = zeroed(k.sizes(), f32);
    dv_accum = zeroed(v.sizes(), f32);
  }
  // Deterministic mode: counters sized for the smallest tile (64 rows or keys) of any head_dim's configuration.
  at::Tensor dq_semaphore, dkv_semaphore;
  if (deterministic) {
    auto i32 = q.options().dtype(at::kInt);
    dq_semaphore = zeroed({dq_lanes * ws_outer * rows / 64}, i32);  // per 64 workspace rows and lane (dq_turn)
    if (sums) { dkv_semaphore = zeroed({int64_t(batch) * nheads_k * ((seqlen_k + 63) / 64)}, i32); }
  }
  at::Tensor dq4 = dq.dim() == 3 ? dq.unsqueeze(0) : dq;
  at::Tensor dk4 = dk.dim() == 3 ? dk.unsqueeze(0) : dk;
  at::Tensor dv4 = dv.dim() == 3 ? dv.unsqueeze(0) : dv;

  flash::BwdParams p{};
  p.q_ptr = q.data_ptr();
  p.k_ptr = k.data_ptr();
  p.v_ptr = v.data_ptr();
  p.o_ptr = out.data_ptr();
  p.do_ptr = dout.data_ptr();
  p.lse_ptr = lse.data_ptr<float>();
  p.dlse_ptr = dlse.defined() ? dlse.data_ptr<float>() : nullptr;
  p.dq_ptr = dq4.data_ptr();
  p.dk_ptr = dk4.data_ptr();
  p.dv_ptr = dv4.data_ptr();
  p.dq_accum_ptr = dq_accum.data_ptr<float>();
  p.lse_log2_ptr = lse_log2.data_ptr<float>();
  p.dpsum_ptr = dpsum.data_ptr<float>();
  p.dk_accum_ptr = sums ? dk_accum.data_ptr<float>() : nullptr;
  p.dv_accum_ptr = sums ? dv_accum.data_ptr<float>() : nullptr;
  p.heads_per_cta = heads_per_cta;
  p.num_sms = num_sms(q);
  p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_row_stride = k.stride(1), p.k_head_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_row_stride = v.stride(1), p.v_head_stride = v.stride(2);
  p.o_batch_stride = out.stride(0), p.o_row_stride = out.stride(1), p.o_head_stride = out.stride(2);
  p.do_batch_stride = dout.stride(0), p.do_row_stride = dout.stride(1), p.do_head_stride = dout.stride(2);
  p.dq_batch_stride = dq4.stride(0), p.dq_row_stride = dq4.stride(1), p.dq_head_stride = dq4.stride(2);
  p.dk_batch_stride = dk4.stride(0), p.dk_row_stride = dk4.stride(1), p.dk_head_stride = dk4.stride(2);
  p.dv_batch_stride = dv4.stride(0), p.dv_row_stride = dv4.stride(1), p.dv_head_stride = dv4.stride(2);
  p.batch = batch, p.nheads = nheads, p.nheads_k = nheads_k, p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k;
  p.seqlen_q_rounded = int(rows), p.head_dim = head_dim, p.head_dim_v = head_dim_v;
  if (is_varlen) {
    p.cu_seqlens_q = varlen.cu_seqlens_q, p.cu_seqlens_k = varlen.cu_seqlens_k;
    p.total_q = int(q.size(1)), p.total_k = int(k.size(1));
  }
  p.softmax_scale = float(softmax_scale);
  p.softcap = opts.softcap;
  p.window_left = opts.window_left, p.window_right = opts.window_right;
  p.doc_bounds = docs.bounds;
  p.dq_semaphore = dq_semaphore.defined() ? dq_semaphore.data_ptr<int>() : nullptr;
  p.dkv_semaphore = dkv_semaphore.defined() ? dkv_semaphore.data_ptr<int>() : nullptr;
  p.dq_lanes = dq_lanes;

  cudaError_t err = run(p, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, "flash_attn_hopper backward launch failed: ", cudaGetErrorString(err));
  if (sums) {
    dk4.copy_(dk_accum);
    dv4.copy_(dv_accum);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(at::Tensor const& dout_in, at::Tensor const& q_in,
                                                   at::Tensor const& k_in, at::Tensor const& v_in,
                                                   at::Tensor const& out_in, at::Tensor const& lse,
                                                   std::optional<at::Tensor> const& dlse_in, double softmax_scale,
                                                   bool causal, int64_t window_left, int64_t window_right,
                                                   double softcap, bool deterministic,
                                                   std::optional<at::Tensor> const& doc_bounds) {
  check_attention_inputs(q_in, k_in, v_in, softmax_scale);
  ScoreOptions const opts = check_score_options(softmax_scale, causal, window_left, window_right, softcap);
  int const batch = q_in.size(0), seqlen_q = q_in.size(1), nheads = q_in.size(2), head_dim_v = v_in.size(3);
  check_qkv(out_in, "out", q_in, head_dim_v);
  check_qkv(dout_in, "dout", q_in, head_dim_v);
  TORCH_CHECK(out_in.sizes() == dout_in.sizes() && out_in.size(1) == seqlen_q && out_in.size(2) == nheads,
              "out and dout must be (batch, seqlen_q, nheads, head_dim_v): q's shape with v's head_dim");
  TORCH_CHECK(lse.is_cuda() && lse.device() == q_in.device() && lse.scalar_type() == at::kFloat &&
                  lse.is_contiguous() && lse.dim() == 3 && lse.size(0) == batch && lse.size(1) == nheads &&
                  lse.size(2) == seqlen_q,
              "lse must be the contiguous float32 (batch, nheads, seqlen_q) tensor of the forward");
  at::Tensor dlse = contiguous_dlse(dlse_in, lse, q_in);
  int const kernel_hdim = kernel_head_dim(q_in, v_in);
  BwdFn const run =
      require_kernel(select_kernels(kernel_hdim, q_in.scalar_type()).bwd, kernel_hdim, q_in.scalar_type());

  c10::cuda::CUDAGuard guard(q_in.device());
  check_sm90(q_in);
  // After the sm90 check: the deterministic backward's partition is a kernel launch.
  Documents const docs = check_documents(doc_bounds, q_in, k_in, deterministic);
  if (q_in.numel() == 0 || k_in.numel() == 0) {
    return {at::zeros(q_in.sizes(), q_in.options()), at::zeros(k_in.sizes(), k_in.options()),
            at::zeros(v_in.sizes(), v_in.options())};
  }
  at::Tensor dq = at::empty(q_in.sizes(), q_in.options());
  at::Tensor dk = at::empty(k_in.sizes(), k_in.options());
  at::Tensor dv = at::empty(v_in.sizes(), v_in.options());
  launch_bwd(run, dout_in, q_in, k_in, v_in, out_in, lse, dlse, dq, dk, dv, Varlen{}, softmax_scale, opts, deterministic,
             docs);
  return {dq, dk, dv};
}

// Gradients of fwd_varlen. dq, dk, dv have the layouts of q, k, v; rows that no sequence covers get 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_varlen(
    at::Tensor const& dout_in, at::Tensor const& q_in, at::Tensor const& k_in, at::Tensor const& v_in,
    at::Tensor const& out_in, at::Tensor const& lse, std::optional<at::Tensor> const& dlse_in,
    at::Tensor const& cu_seqlens_q, at::Tensor const& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double softmax_scale, bool causal, int64_t window_left, int64_t window_right, double softcap,
    bool deterministic) {
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && v_in.dim() == 3 && out_in.dim() == 3 && dout_in.dim() == 3,
              "q, k, v, out, dout must have rank 3 (total_tokens, nheads, head_dim) for variable-length attention");
  at::Tensor q = q_in.unsqueeze(0), k = k_in.unsqueeze(0), v = v_in.unsqueeze(0);
  at::Tensor out = out_in.unsqueeze(0), dout = dout_in.unsqueeze(0);
  check_attention_inputs(q, k, v, softmax_scale);
  ScoreOptions const opts = check_score_options(softmax_scale, causal, window_left, window_right, softcap);
  check_qkv(out, "out", q, v.size(3));
  check_qkv(dout, "dout", q, v.size(3));
  TORCH_CHECK(out.sizes() == dout.sizes() && out.size(1) == q.size(1) && out.size(2) == q.size(2),
              "out and dout must be (total_q, nheads, head_dim_v): q's shape with v's head_dim");
  Varlen const varlen = check_varlen(q_in, k_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  TORCH_CHECK(lse.is_cuda() && lse.device() == q_in.device() && lse.scalar_type() == at::kFloat &&
                  lse.is_contiguous() && lse.dim() == 2 && lse.size(0) == q_in.size(1) && lse.size(1) == q_in.size(0),
              "lse must be the contiguous float32 (nheads, total_q) tensor of the forward");
  at::Tensor dlse = contiguous_dlse(dlse_in, lse, q_in);
  int const kernel_hdim = kernel_head_dim(q, v);
  BwdFn const run = require_kernel(select_kernels(kernel_hdim, q.scalar_type()).bwd, kernel_hdim, q.scalar_type());

  c10::cuda::CUDAGuard guard(q_in.device());
  check_sm90(q_in);
  if (varlen.batch == 0 || q_in.numel() == 0 || k_in.numel() == 0 || max_seqlen_q == 0 || max_seqlen_k == 0) {
    return {at::zeros(q_in.sizes(), q_in.options()), at::zeros(k_in.sizes(), k_in.options()),
            at::zeros(v_in.sizes(), v_in.options())};
  }
  at::Tensor dq = at::empty(q_in.sizes(), q_in.options());
  at::Tensor dk = at::empty(k_in.sizes(), k_in.options());
  at::Tensor dv = at::empty(v_in.sizes(), v_in.options());
  // Rows no sequence covers get 0 here (the kernels write every row of every sequence, zeros where nothing
  // reaches it).
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(q_in.device().index()).stream();
  int64_t const total_q = q_in.size(0), total_k = k_in.size(0);
  fill_uncovered(dq, 0u, 1, total_q, q_in.size(1) * q_in.size(2), varlen.cu_seqlens_q, varlen.batch, stream);
  fill_uncovered(dk, 0u, 1, total_k, k_in.size(1) * k_in.size(2), varlen.cu_seqlens_k, varlen.batch, stream);
  fill_uncovered(dv, 0u, 1, total_k, v_in.size(1) * v_in.size(2), varlen.cu_seqlens_k, varlen.batch, stream);
  // Deterministic mode finds each sequence's dQ turn counters from its workspace rows (bwd_workspace_row), so offsets
  // that go back (a direct op caller's: the Python functions check or enforce the order) would give two sequences
  // the same counters, and a turn that never comes is a hang. The kernels get the running maximum of the offsets:
  // valid offsets unchanged, bad ones a wrong result instead of a hang.
  Varlen ordered = varlen;
  at::Tensor monotone;
  if (deterministic) {
    int const n = varlen.batch + 1;
    monotone = at::empty({2 * int64_t(n)}, cu_seqlens_q.options());
    int* const ordered_q = monotone.data_ptr<int>();
    int* const ordered_k = ordered_q + n;
    cudaError_t err = flash::monotone_offsets(varlen.cu_seqlens_q, ordered_q, n, int(total_q), stream);
    if (err == cudaSuccess) { err = flash::monotone_offsets(varlen.cu_seqlens_k, ordered_k, n, int(total_k), stream); }
    TORCH_CHECK(err == cudaSuccess, "flash_attn_hopper: ordering cu_seqlens failed: ", cudaGetErrorString(err));
    ordered.cu_seqlens_q = ordered_q, ordered.cu_seqlens_k = ordered_k;
  }
  launch_bwd(run, dout, q, k, v, out, lse, dlse, dq, dk, dv, ordered, softmax_scale, opts, deterministic);
  return {dq, dk, dv};
}

// ------------------------------------------------------------------------------------------------------ autograd
// The autograd formulas of fwd and fwd_varlen, in C++ so that an eager training step pays no Python on the way in or
// out of the backward (the Python layer only checks arguments). Saved: q, k, v, out, lse (+ cu_seqlens); the backward
// is the FlashAttention-3 backward op (paper §2.1), which recomputes P from lse. lse is differentiable: its gradient
// enters the backward op as dlse (dS gains P ∘ dLSE). Both ops are called through the dispatcher, so torch.compile's
// fake tensors reach the fake kernels registered in Python.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using FwdOpSig = std::tuple<at::Tensor, at::Tensor>(at::Tensor const&, at::Tensor const&, at::Tensor const&, double,
                                                    bool, int64_t, int64_t, double, bool,
                                                    std::optional<at::Tensor> const&);
using BwdOpSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(at::Tensor const&, at::Tensor const&,
                                                                at::Tensor const&, at::Tensor const&,
                                                                at::Tensor const&, at::Tensor const&,
                                                                std::optional<at::Tensor> const&, double, bool,
                                                                int64_t, int64_t, double, bool,
                                                                std::optional<at::Tensor> const&);
// max_seqlen_q/k are SymInt in the varlen schemas (torch.compile keeps them symbolic instead of a graph per value);
// the autograd kernels pass them on as SymInt, the CUDA kernels take them as int64_t (always concrete there).
using FwdVarlenOpSig = std::tuple<at::Tensor, at::Tensor>(at::Tensor const&, at::Tensor const&, at::Tensor const&,
                                                          at::Tensor const&, at::Tensor const&, c10::SymInt,
                                                          c10::SymInt, double, bool, int64_t, int64_t, double, bool);
using BwdVarlenOpSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor const&,
    std::optional<at::Tensor> const&, at::Tensor const&, at::Tensor const&, c10::SymInt, c10::SymInt, double, bool,
    int64_t, int64_t, double, bool);

template <class Sig>
c10::TypedOperatorHandle<Sig> find_op(char const* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}
// One handle per op, looked up once.
c10::TypedOperatorHandle<FwdOpSig> const& fwd_op() {
  static auto const handle = find_op<FwdOpSig>("flash_attn_hopper::fwd");
  return handle;
}
c10::TypedOperatorHandle<BwdOpSig> const& bwd_op() {
  static auto const handle = find_op<BwdOpSig>("flash_attn_hopper::bwd");
  return handle;
}
c10::TypedOperatorHandle<FwdVarlenOpSig> const& fwd_varlen_op() {
  static auto const handle = find_op<FwdVarlenOpSig>("flash_attn_hopper::fwd_varlen");
  return handle;
}
c10::TypedOperatorHandle<BwdVarlenOpSig> const& bwd_varlen_op() {
  static auto const handle = find_op<BwdVarlenOpSig>("flash_attn_hopper::bwd_varlen");
  return handle;
}

// The scalar arguments every op takes after its tensors, kept in the autograd context.
struct ScoreArgs {
  double softmax_scale;
  bool causal;
  int64_t window_left, window_right;
  double softcap;
  bool deterministic;

  void save(AutogradContext* ctx) const {
    ctx->saved_data["softmax_scale"] = softmax_scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["deterministic"] = deterministic;
  }
  static ScoreArgs load(AutogradContext* ctx) {
    auto& d = ctx->saved_data;
    return {d["softmax_scale"].toDouble(), d["causal"].toBool(),     d["window_left"].toInt(),
            d["window_right"].toInt(),     d["softcap"].toDouble(), d["deterministic"].toBool()};
  }
};

// dout undefined: the loss uses only lse. dlse undefined: the loss uses only out.
std::pair<at::Tensor, std::optional<at::Tensor>> output_grads(variable_list const& grads, at::Tensor const& out) {
  at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
  std::optional<at::Tensor> dlse;
  if (grads[1].defined()) { dlse = grads[1]; }
  return {dout, dlse};
}

struct AttentionAutograd : public torch::autograd::Function<AttentionAutograd> {
  static variable_list forward(AutogradContext* ctx, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                               double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                               double softcap, bool deterministic, std::optional<at::Tensor> const& doc_bounds) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = fwd_op().call(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                    deterministic, doc_bounds);
    ctx->save_for_backward({q, k, v, out, lse, doc_bounds.value_or(at::Tensor())});
    ScoreArgs{softmax_scale, causal, window_left, window_right, softcap, deterministic}.save(ctx);
    ctx->set_materialize_grads(false);
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto const saved = ctx->get_saved_variables();
    auto const [dout, dlse] = output_grads(grads, saved[3]);
    ScoreArgs const a = ScoreArgs::load(ctx);
    // Saved-tensor hooks may hand back the LSE and the bounds in another layout; the op takes them contiguous.
    auto [dq, dk, dv] = bwd_op()
                            .call(dout, saved[0], saved[1], saved[2], saved[3], saved[4].contiguous(), dlse,
                                  a.softmax_scale, a.causal, a.window_left, a.window_right, a.softcap,
                                  a.deterministic,
                                  saved[5].defined() ? std::optional<at::Tensor>(saved[5].contiguous()) : std::nullopt);
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

struct AttentionVarlenAutograd : public torch::autograd::Function<AttentionVarlenAutograd> {
  static variable_list forward(AutogradContext* ctx, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                               at::Tensor const& cu_seqlens_q, at::Tensor const& cu_seqlens_k, c10::SymInt max_seqlen_q,
                               c10::SymInt max_seqlen_k, double softmax_scale, bool causal, int64_t window_left,
                               int64_t window_right, double softcap, bool deterministic) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = fwd_varlen_op()
                          .call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                causal, window_left, window_right, softcap, deterministic);
    ctx->save_for_backward({q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k});
    ScoreArgs{softmax_scale, causal, window_left, window_right, softcap, deterministic}.save(ctx);
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    ctx->set_materialize_grads(false);
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto const saved = ctx->get_saved_variables();
    auto const [dout, dlse] = output_grads(grads, saved[3]);
    ScoreArgs const a = ScoreArgs::load(ctx);
    auto [dq, dk, dv] = bwd_varlen_op()
                            .call(dout, saved[0], saved[1], saved[2], saved[3], saved[4].contiguous(), dlse,
                                  saved[5].contiguous(), saved[6].contiguous(),  // as in AttentionAutograd
                                  ctx->saved_data["max_seqlen_q"].toSymInt(), ctx->saved_data["max_seqlen_k"].toSymInt(),
                                  a.softmax_scale, a.causal, a.window_left, a.window_right, a.softcap,
                                  a.deterministic);
    variable_list grads_in(13);  // one per forward argument; only q, k, v are differentiable
    grads_in[0] = dq, grads_in[1] = dk, grads_in[2] = dv;
    return grads_in;
  }
};

// The backward ops' autograd: their results (dq, dk, dv) are not differentiable again. With create_graph=True the
// graph records this node, and differentiating through it raises instead of silently dropping the second-order
// terms (torch's fallback for an op without an Autograd kernel only warns).
struct NoDoubleBackward : public torch::autograd::Function<NoDoubleBackward> {
  template <class Op, class... Args>
  static variable_list forward(AutogradContext* ctx, Op const* op, Args&&... args) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dq, dk, dv] = op->call(std::forward<Args>(args)...);
    return {dq, dk, dv};
  }
  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false,
                "flash_attn_hopper: double backward (differentiating dq, dk or dv again, e.g. after "
                "create_graph=True) is not supported");
    return {};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_autograd(
    at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor const& out,
    at::Tensor const& lse, std::optional<at::Tensor> const& dlse, double softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, double softcap, bool deterministic,
    std::optional<at::Tensor> const& doc_bounds) {
  auto g = NoDoubleBackward::apply(&bwd_op(), dout, q, k, v, out, lse, dlse, softmax_scale, causal, window_left,
                                   window_right, softcap, deterministic, doc_bounds);
  return {g[0], g[1], g[2]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_varlen_autograd(
    at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor const& out,
    at::Tensor const& lse, std::optional<at::Tensor> const& dlse, at::Tensor const& cu_seqlens_q,
    at::Tensor const& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, double softmax_scale,
    bool causal, int64_t window_left, int64_t window_right, double softcap, bool deterministic) {
  auto g = NoDoubleBackward::apply(&bwd_varlen_op(), dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k,
                                   max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                                   softcap, deterministic);
  return {g[0], g[1], g[2]};
}

std::tuple<at::Tensor, at::Tensor> fwd_autograd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                                double softmax_scale, bool causal, int64_t window_left,
                                                int64_t window_right, double softcap, bool deterministic,
                                                std::optional<at::Tensor> const& doc_bounds) {
  auto outs = AttentionAutograd::apply(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                       deterministic, doc_bounds);
  return {outs[0], outs[1]};
}

std::tuple<at::Tensor, at::Tensor> fwd_varlen_autograd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                                       at::Tensor const& cu_seqlens_q, at::Tensor const& cu_seqlens_k,
                                                       c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                                                       double softmax_scale, bool causal, int64_t window_left,
                                                       int64_t window_right, double softcap, bool deterministic) {
  auto outs = AttentionVarlenAutograd::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             softmax_scale, causal, window_left, window_right, softcap, deterministic);
  return {outs[0], outs[1]};
}

}  // namespace

TORCH_LIBRARY(flash_attn_hopper, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, int window_left, int window_right,"
      " float softcap, bool deterministic, Tensor? doc_bounds=None) -> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, float softmax_scale,"
      " bool causal, int window_left, int window_right, float softcap, bool deterministic,"
      " Tensor? doc_bounds=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q,"
      " SymInt max_seqlen_k, float softmax_scale, bool causal, int window_left, int window_right, float softcap,"
      " bool deterministic) -> (Tensor out, Tensor lse)");
  m.def(
      "bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse,"
      " Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale,"
      " bool causal, int window_left, int window_right, float softcap, bool deterministic)"
      " -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("build_config() -> str", &build_config);
  m.def("doc_bounds_partition(Tensor doc_bounds) -> Tensor");
  m.def(
      "fwd_block_m(int head_dim, int head_dim_v, int batch, int nheads, int seqlen_q, int seqlen_k, bool causal,"
      " int window_left, int window_right, int num_sms) -> int",
      &fwd_block_m);
}

// A direct op call with CPU tensors: a RuntimeError naming the op and the first CPU tensor argument, where the
// dispatcher's own error lists every backend without naming either. One boxed kernel serves the four ops.
static void refuse_cpu_tensors(c10::OperatorHandle const& op, torch::jit::Stack* stack) {
  c10::FunctionSchema const& schema = op.schema();
  size_t const n = schema.arguments().size();
  std::string name = "a tensor argument";
  for (size_t i = 0; i < n && n <= stack->size(); ++i) {
    c10::IValue const& value = (*stack)[stack->size() - n + i];
    if (value.isTensor() && value.toTensor().device().is_cpu()) {
      name = schema.arguments()[i].name();
      break;
    }
  }
  TORCH_CHECK(false, schema.name(), ": ", name, " is a CPU tensor; the ops run on CUDA tensors of an sm90 GPU");
}

TORCH_LIBRARY_IMPL(flash_attn_hopper, CPU, m) {
  for (char const* op : {"fwd", "fwd_varlen", "bwd", "bwd_varlen"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&refuse_cpu_tensors>());
  }
}

TORCH_LIBRARY_IMPL(flash_attn_hopper, CUDA, m) {
  m.impl("fwd", &fwd);
  m.impl("fwd_varlen", &fwd_varlen);
  m.impl("bwd_varlen", &bwd_varlen);
  m.impl("bwd", &bwd);
}

TORCH_LIBRARY_IMPL(flash_attn_hopper, CompositeExplicitAutograd, m) {
  m.impl("doc_bounds_partition", &doc_bounds_partition);
}

TORCH_LIBRARY_IMPL(flash_attn_hopper, Autograd, m) {
  m.impl("fwd", &fwd_autograd);
  m.impl("fwd_varlen", &fwd_varlen_autograd);
  m.impl("bwd", &bwd_autograd);
  m.impl("bwd_varlen", &bwd_varlen_autograd);
}
