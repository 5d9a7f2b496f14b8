// Register-fragment helpers shared by the kernels: WGMMA issue, accumulator views, conversions, quad reductions.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace flash {

using namespace cute;

// setmaxnreg only moves registers between the warpgroups of a CTA, within what the launch gave it (65536 / threads
// per thread, in steps of 8: 168 at 384 threads). Consumers that ask for more than the producer frees wait in
// setmaxnreg forever: a hang, not an error (session 15: 32/240/240 at 384 threads hung the head_dim 128 backward).
template <int kThreads, int kProducerRegs, int kConsumerRegs>
constexpr bool register_budget_fits() {
  constexpr int kWarpGroups = kThreads / 128;
  return kProducerRegs + (kWarpGroups - 1) * kConsumerRegs <= kWarpGroups * (65536 / kThreads / 8 * 8);
}

// Issues one asynchronous WGMMA over all k-blocks of A and B into C and commits it as one batch.
// The caller waits (warpgroup_wait<N>) before reading C. zero_init overwrites C instead of accumulating.
template <bool zero_init, class TiledMma, class TensorA, class TensorB, class TensorC>
CUTLASS_DEVICE void wgmma(TiledMma& tiled_mma, TensorA const& tCrA, TensorB const& tCrB, TensorC& tCrC) {
  // An A operand in registers must be fenced too, or the compiler may move its writes past the WGMMA.
  constexpr bool kARegs =
      !cute::is_same_v<cute::remove_cvref_t<decltype(tCrA.data())>, GMMA::DescriptorIterator>;
  if constexpr (kARegs) { warpgroup_fence_operand(const_cast<TensorA&>(tCrA)); }
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  if constexpr (zero_init) { tiled_mma.accumulate_ = GMMA::ScaleOut::Zero; }
  CUTLASS_PRAGMA_UNROLL
  for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
    cute::gemm(tiled_mma, tCrA(_, _, k_block), tCrB(_, _, k_block), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(tCrC);
  if constexpr (kARegs) { warpgroup_fence_operand(const_cast<TensorA&>(tCrA)); }
}

// WGMMA accumulator ((2, 2, V), MMA_M, MMA_N) viewed as (rows, cols) = ((2, MMA_M), (2, V, MMA_N)):
// per thread, two rows (r and r + 8 of each 16-row slab) and pairs of adjacent columns.
template <class Layout>
CUTLASS_HOST_DEVICE constexpr auto acc_rowcol(Layout const& acc) {
  static_assert(decltype(rank<0>(acc))::value == 3, "expects a WGMMA accumulator layout");
  auto v = get<0>(acc);
  return make_layout(make_layout(get<1>(v), get<1>(acc)), make_layout(get<0>(v), get<2>(v), get<2>(acc)));
}

// The accumulator of S = Q Kᵀ re-read as the register A operand of O += P V (16-bit inputs): the C fragment of
// an m64nNk16 WGMMA holds, per 8 columns, the same (column pair, row pair) as the A fragment of k16 per 8 k's,
// so grouping the column blocks in twos is the whole conversion: ((2,2,V),M,N) -> ((2,2,2),M,(V/2,N)).
template <class Layout>
CUTLASS_HOST_DEVICE constexpr auto acc_to_a_operand(Layout const& acc) {
  static_assert(decltype(rank<0>(acc))::value == 3, "expects a WGMMA accumulator layout");
  auto v = get<0>(acc);
  auto col_blocks = logical_divide(get<2>(v), Int<2>{});  // (2, V/2)
  return make_layout(make_layout(get<0>(v), get<1>(v), get<0>(col_blocks)), get<1>(acc),
                     coalesce(make_layout(get<1>(col_blocks), get<2>(acc))));
}

// Element-wise conversion of a register fragment, vectorised by CUTLASS (packed cvt for pairs).
template <class To, class Engine, class Layout>
CUTLASS_DEVICE auto convert_type(Tensor<Engine, Layout> const& src) {
  using From = typename Engine::value_type;
  constexpr int N = decltype(cute::size(src))::value;
  cutlass::NumericArrayConverter<To, From, N> convert;
  Tensor dst = make_tensor<To>(src.layout());
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, N> const*>(src.data()));
  return dst;
}

// Element-wise conversion into an existing register fragment of the same size (layouts may differ: the values are
// taken in storage order, which is what re-viewing an accumulator as an A operand keeps).
template <class EngineS, class LayoutS, class EngineD, class LayoutD>
CUTLASS_DEVICE void convert_type_into(Tensor<EngineS, LayoutS> const& src, Tensor<EngineD, LayoutD>& dst) {
  using From = typename EngineS::value_type;
  using To = typename EngineD::value_type;
  constexpr int N = decltype(cute::size(src))::value;
  static_assert(N == decltype(cute::size(dst))::value);
  cutlass::NumericArrayConverter<To, From, N> convert;
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, N> const*>(src.data()));
}

// The four threads of a quad hold the same accumulator rows; reduce across them.
CUTLASS_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

CUTLASS_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// tanh for the softcap, by tanh.approx.f32 (one MUFU operation, relative error ~2^-11); Element is the input dtype.
// Forward and backward call the same instance, so P recomputed in the backward matches the forward's LSE. NaN stays
// NaN; +-inf and large |x| give +-1. The exact form (1 - 2 / (exp(2x) + 1)) takes two MUFU operations and left the
// softcap forward MUFU-bound (3 operations per score against the dense kernel's 1). H200, head_dim 128, 2026-11-30:
// bf16 forward 0.66x -> 0.84x dense; fp16 0.60-0.69x -> 0.75-0.85x (non-causal); the accuracy rule (DESIGN.md
// section 3) passes for both dtypes (every softcap and LSE test, fp16 build with the approximation: 88 passed). The
// backward's softcap kernels spill a few bytes more with it (ptxas: head_dim 128 0 -> 4 B), as bf16's did before.
template <class Element>
CUTLASS_DEVICE float softcap_tanh(float x) {
  static_assert(cute::is_same_v<Element, cutlass::bfloat16_t> || cute::is_same_v<Element, cutlass::half_t>,
                "softcap_tanh: a new input dtype needs its own accuracy decision");
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(x));
  return t;
}

}  // namespace flash
