// The only translation unit that includes torch: op schemas, checks, FwdParams, dispatch.
// The Python layer (flash_attn_hopper/interface.py) validates arguments with named errors first; the checks here
// are the safety net for direct torch.ops calls.

#include <cmath>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "flash/config.hpp"
#include "flash/dispatch.hpp"
#include "flash/params.hpp"

namespace {

using FwdFn = cudaError_t (*)(flash::FwdParams const&, cudaStream_t);
using BwdFn = cudaError_t (*)(flash::BwdParams const&, cudaStream_t);

struct Kernels {
  FwdFn fwd = nullptr;
  BwdFn bwd = nullptr;
};

Kernels select_kernels(int head_dim, at::ScalarType dtype) {
  bool const bf16 = dtype == at::kBFloat16;
#define FAH_CASE(HDIM, NAME, IS_BF16)                                                                       \
  if (head_dim == HDIM && bf16 == IS_BF16) {                                                                \
    return Kernels{&flash::run_fwd_hdim##HDIM##_##NAME, &flash::run_bwd_hdim##HDIM##_##NAME};               \
  }
#if defined(FAH_HDIM64) && defined(FAH_FP16)
  FAH_CASE(64, fp16, false)
#endif
#if defined(FAH_HDIM64) && defined(FAH_BF16)
  FAH_CASE(64, bf16, true)
#endif
#if defined(FAH_HDIM128) && defined(FAH_FP16)
  FAH_CASE(128, fp16, false)
#endif
#if defined(FAH_HDIM128) && defined(FAH_BF16)
  FAH_CASE(128, bf16, true)
#endif
#if defined(FAH_HDIM256) && defined(FAH_FP16)
  FAH_CASE(256, fp16, false)
#endif
#if defined(FAH_HDIM256) && defined(FAH_BF16)
  FAH_CASE(256, bf16, true)
#endif
#undef FAH_CASE
  return Kernels{};
}

std::string build_config() {
  std::string hdims, dtypes;
#ifdef FAH_HDIM64
  hdims += "64,";
#endif
#ifdef FAH_HDIM128
  hdims += "128,";
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

void check_qkv(at::Tensor const& t, char const* name, at::Tensor const& q) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == q.device(), name, " must be on the same device as q");
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), name, " must have the dtype of q");
  TORCH_CHECK(t.dim() == 4, name, " must have rank 4 (batch, seqlen, nheads, head_dim)");
  TORCH_CHECK(t.size(0) == q.size(0) && t.size(3) == q.size(3), name, " must match q in batch and head_dim");
}

// The checks fwd and bwd share: dtypes, ranks, devices, batch and head_dim; k and v share seqlen_k and nheads_k,
// which divides q's nheads (GQA/MQA when smaller); the scale; the grid limits of batch and nheads.
void check_attention_inputs(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale) {
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, "q must be float16 or bfloat16");
  check_qkv(q, "q", q);
  check_qkv(k, "k", q);
  check_qkv(v, "v", q);
  int64_t const nheads = q.size(2), nheads_k = k.size(2);
  TORCH_CHECK(v.size(2) == nheads_k, "k and v must have the same nheads_k");
  TORCH_CHECK(nheads_k == 0 ? nheads == 0 : nheads % nheads_k == 0,
              "q's nheads must be a multiple of k's and v's nheads_k, got ", nheads, " and ", nheads_k);
  TORCH_CHECK(k.size(1) == v.size(1), "k and v must have the same seqlen_k");
  TORCH_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0, "softmax_scale must be finite and > 0");
  TORCH_CHECK(nheads <= 65535 && q.size(0) <= 65535, "nheads and batch must be at most 65535");
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
  TORCH_CHECK(softcap == 0 || std::isnormal(float(softmax_scale / softcap)),
              "softmax_scale / softcap must be a normal float32 value");
  // Sides beyond INT_MAX are unbounded in effect (the kernels clamp to the sequence lengths).
  auto side = [](int64_t w) { return w < 0 || w > INT32_MAX ? -1 : int(w); };
  return {side(window_left), causal ? 0 : side(window_right), float(softcap)};
}

// The compiled entry point of (head_dim, dtype), or an error naming what this build holds.
template <class Run>
Run* require_kernel(Run* run, int head_dim, at::ScalarType dtype) {
  TORCH_CHECK(run != nullptr, "head_dim ", head_dim, " with dtype ", dtype, " is not in this build (", build_config(),
              ")");
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
  int major = 0, minor = 0;
  int const dev = q.device().index();
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  TORCH_CHECK(major == 9 && minor == 0, "flash_attn_hopper needs an sm90 GPU (H100/H200); ", q.device(),
              " has compute capability ", major, ".", minor);
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

std::tuple<at::Tensor, at::Tensor> fwd(at::Tensor const& q_in, at::Tensor const& k_in, at::Tensor const& v_in,
                                       double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                                       double softcap) {
  check_attention_inputs(q_in, k_in, v_in, softmax_scale);
  ScoreOptions const opts = check_score_options(softmax_scale, causal, window_left, window_right, softcap);
  int const batch = q_in.size(0), seqlen_q = q_in.size(1), nheads = q_in.size(2), head_dim = q_in.size(3);
  int const seqlen_k = k_in.size(1);
  auto* run = require_kernel(select_kernels(head_dim, q_in.scalar_type()).fwd, head_dim, q_in.scalar_type());

  c10::cuda::CUDAGuard guard(q_in.device());
  check_sm90(q_in);
  at::Tensor out = at::empty({batch, seqlen_q, nheads, head_dim}, q_in.options());
  at::Tensor lse = at::empty({batch, nheads, seqlen_q}, q_in.options().dtype(at::kFloat));
  if (out.numel() == 0 || seqlen_k == 0) {  // nothing to attend to: rows are 0, LSE -inf; no launch
    out.zero_();
    lse.fill_(-INFINITY);
    return {out, lse};
  }
  at::Tensor q = tma_ready(q_in), k = tma_ready(k_in), v = tma_ready(v_in);

  flash::FwdParams p{};
  p.q_ptr = q.data_ptr();
  p.k_ptr = k.data_ptr();
  p.v_ptr = v.data_ptr();
  p.o_ptr = out.data_ptr();
  p.lse_ptr = lse.data_ptr<float>();
  p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_row_stride = k.stride(1), p.k_head_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_row_stride = v.stride(1), p.v_head_stride = v.stride(2);
  p.o_batch_stride = out.stride(0), p.o_row_stride = out.stride(1), p.o_head_stride = out.stride(2);
  p.batch = batch, p.nheads = nheads, p.nheads_k = int(k.size(2)), p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k;
  p.head_dim = head_dim;
  p.softmax_scale = float(softmax_scale);
  p.softcap = opts.softcap;
  p.window_left = opts.window_left, p.window_right = opts.window_right;
  p.pingpong = fwd_pingpong();
  at::Tensor tile_counter;
  if (fwd_persistent()) {
    tile_counter = at::zeros({1}, q.options().dtype(at::kInt));
    p.tile_counter = tile_counter.data_ptr<int>();
    p.num_sms = num_sms(q);
  }

  cudaError_t err = run(p, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, "flash_attn_hopper forward launch failed: ", cudaGetErrorString(err));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(at::Tensor const& dout_in, at::Tensor const& q_in,
                                                   at::Tensor const& k_in, at::Tensor const& v_in,
                                                   at::Tensor const& out_in, at::Tensor const& lse,
                                                   std::optional<at::Tensor> const& dlse_in, double softmax_scale,
                                                   bool causal, int64_t window_left, int64_t window_right,
                                                   double softcap) {
  check_attention_inputs(q_in, k_in, v_in, softmax_scale);
  ScoreOptions const opts = check_score_options(softmax_scale, causal, window_left, window_right, softcap);
  check_qkv(out_in, "out", q_in);
  check_qkv(dout_in, "dout", q_in);
  TORCH_CHECK(out_in.sizes() == q_in.sizes() && dout_in.sizes() == q_in.sizes(),
              "out and dout must have the shape of q");
  int const batch = q_in.size(0), seqlen_q = q_in.size(1), nheads = q_in.size(2), head_dim = q_in.size(3);
  int const seqlen_k = k_in.size(1);
  TORCH_CHECK(lse.is_cuda() && lse.device() == q_in.device() && lse.scalar_type() == at::kFloat &&
                  lse.is_contiguous() && lse.dim() == 3 && lse.size(0) == batch && lse.size(1) == nheads &&
                  lse.size(2) == seqlen_q,
              "lse must be the contiguous float32 (batch, nheads, seqlen_q) tensor of the forward");
  at::Tensor dlse;
  if (dlse_in.has_value()) {
    TORCH_CHECK(dlse_in->device() == q_in.device() && dlse_in->scalar_type() == at::kFloat &&
                    dlse_in->sizes() == lse.sizes(),
                "dlse must be a float32 tensor of lse's shape (batch, nheads, seqlen_q) on q's device");
    dlse = dlse_in->contiguous();  // the gradient of lse.sum() arrives expanded (stride 0)
  }
  auto* run = require_kernel(select_kernels(head_dim, q_in.scalar_type()).bwd, head_dim, q_in.scalar_type());

  c10::cuda::CUDAGuard guard(q_in.device());
  check_sm90(q_in);
  if (q_in.numel() == 0 || k_in.numel() == 0) {
    return {at::zeros(q_in.sizes(), q_in.options()), at::zeros(k_in.sizes(), k_in.options()),
            at::zeros(v_in.sizes(), v_in.options())};
  }
  at::Tensor q = tma_ready(q_in), k = tma_ready(k_in), v = tma_ready(v_in);
  at::Tensor out = tma_ready(out_in), dout = tma_ready(dout_in);

  int const seqlen_q_rounded =
      (seqlen_q + flash::kBwdSeqlenQRounding - 1) / flash::kBwdSeqlenQRounding * flash::kBwdSeqlenQRounding;
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dq_accum = at::zeros({batch, nheads, seqlen_q_rounded, head_dim}, f32);
  at::Tensor lse_log2 = at::empty({batch, nheads, seqlen_q_rounded}, f32);
  at::Tensor dpsum = at::empty({batch, nheads, seqlen_q_rounded}, f32);
  // GQA/MQA: the query heads of a group add their dK/dV into fp32 sums, converted to the dtype afterwards.
  int const nheads_k = k.size(2);
  bool const gqa = nheads_k != nheads;
  at::Tensor dk_accum, dv_accum;
  if (gqa) {
    dk_accum = at::zeros({batch, seqlen_k, nheads_k, head_dim}, f32);
    dv_accum = at::zeros({batch, seqlen_k, nheads_k, head_dim}, f32);
  }

  flash::BwdParams p{};
  p.q_ptr = q.data_ptr();
  p.k_ptr = k.data_ptr();
  p.v_ptr = v.data_ptr();
  p.o_ptr = out.data_ptr();
  p.do_ptr = dout.data_ptr();
  p.lse_ptr = lse.data_ptr<float>();
  p.dlse_ptr = dlse.defined() ? dlse.data_ptr<float>() : nullptr;
  p.dq_ptr = dq.data_ptr();
  p.dk_ptr = dk.data_ptr();
  p.dv_ptr = dv.data_ptr();
  p.dq_accum_ptr = dq_accum.data_ptr<float>();
  p.lse_log2_ptr = lse_log2.data_ptr<float>();
  p.dpsum_ptr = dpsum.data_ptr<float>();
  p.dk_accum_ptr = gqa ? dk_accum.data_ptr<float>() : nullptr;
  p.dv_accum_ptr = gqa ? dv_accum.data_ptr<float>() : nullptr;
  p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_row_stride = k.stride(1), p.k_head_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_row_stride = v.stride(1), p.v_head_stride = v.stride(2);
  p.o_batch_stride = out.stride(0), p.o_row_stride = out.stride(1), p.o_head_stride = out.stride(2);
  p.do_batch_stride = dout.stride(0), p.do_row_stride = dout.stride(1), p.do_head_stride = dout.stride(2);
  p.dq_batch_stride = dq.stride(0), p.dq_row_stride = dq.stride(1), p.dq_head_stride = dq.stride(2);
  p.dk_batch_stride = dk.stride(0), p.dk_row_stride = dk.stride(1), p.dk_head_stride = dk.stride(2);
  p.dv_batch_stride = dv.stride(0), p.dv_row_stride = dv.stride(1), p.dv_head_stride = dv.stride(2);
  p.batch = batch, p.nheads = nheads, p.nheads_k = nheads_k, p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k;
  p.seqlen_q_rounded = seqlen_q_rounded, p.head_dim = head_dim;
  p.softmax_scale = float(softmax_scale);
  p.softcap = opts.softcap;
  p.window_left = opts.window_left, p.window_right = opts.window_right;

  cudaError_t err = run(p, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, "flash_attn_hopper backward launch failed: ", cudaGetErrorString(err));
  if (gqa) {
    dk.copy_(dk_accum);
    dv.copy_(dv_accum);
  }
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY(flash_attn_hopper, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, int window_left, int window_right,"
      " float softcap) -> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, float softmax_scale,"
      " bool causal, int window_left, int window_right, float softcap) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("build_config() -> str", &build_config);
}

TORCH_LIBRARY_IMPL(flash_attn_hopper, CUDA, m) {
  m.impl("fwd", &fwd);
  m.impl("bwd", &bwd);
}
