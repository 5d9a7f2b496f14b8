// Online softmax in the exp2 domain (FlashAttention-3 paper §3.1; FlashAttention-2 §3.1 for the recurrence).
#pragma once

#include <cfloat>
#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>

#include "flash/common/utils.hpp"

namespace flash {

using namespace cute;

// Host: how raw scores S_raw = Q Kᵀ enter the softmax. Without softcap, x = S_raw and the exponent scale is
// softmax_scale; with a softcap c, x = tanh(S_raw * softmax_scale / c) and the scale is c, so the softmax sees
// c * tanh(softmax_scale * S_raw / c). score_scale_log2 folds log2(e) in for exp2.
struct ScoreScales {
  float score_scale, score_scale_log2, softcap_pre;
};
// Largest softcap that runs with a fixed maximum (OnlineSoftmax::step_fixed_max): P >= exp(-2 * 30) = 8.8e-27, and
// P times any V element of magnitude 2^-39 or more stays a normal float32 in the P V accumulator.
constexpr float kSoftcapFixedMaxLimit = 30.f;
// add_rounding tells a masked key by its P being exactly 0: a visible key's P must stay a normal float32 (not flushed).
static_assert(2.f * kSoftcapFixedMaxLimit * 1.4426950408889634f < 125.f, "a visible key's P would flush to zero");
// Conditional rescaling: a row keeps its running maximum until the new one exceeds it by more than a factor 2^8 in P,
// so unnormalised P stays <= 256 (bf16 and fp16 hold it; O's float32 accumulator grows by at most that factor) and
// most key blocks skip the O rescale.
constexpr float kRescaleThresholdLog2 = 8.f;
// P = exp2(fma(s, scale_log2, -M)) with M = round(m * scale_log2) is exp2(s * scale_log2 - M), the exact product: P at
// a row's maximum is 2^r, r = m * scale_log2 - M up to half an ulp of |M|. Every P of a row shares that factor while
// the maximum stays (the O rescale is then exactly 1), so the normalisation cancels it while it is small. At a move the
// rescale exp2((m_old - m_new) * scale_log2) is within an ulp of |M| of the factor between the two blocks' P (taking it
// exactly from the rounded maxima read 1-2 % slower at head_dim 64, H200 session 40; the error is comparable to the
// float32 reference's own rounding of scores that large).
// Rows whose |M| reaches this limit (below it |r| < 2^-8) are flagged at the tile's end (from kExactRowsFlagLog2,
// below) and recomputed exactly after the kernel (flash/fwd/exact_rows_sm90.hpp): past ~2^31 P overflowed or
// vanished (NaN or zero rows; bf16 q = k = v = 133120, PyTorch issue 121558) and fp16's P could not hold 2^r from
// ~2^27.
constexpr float kExactRowsLimitLog2 = 65536.f;  // 2^16
// The exact pass picks rows by their LSE (non-finite, or |LSE| * log2 e at kExactRowsSelectLog2 or more) and runs only
// when the forward set its flag, from a row's |M| at kExactRowsFlagLog2 or more. A row's LSE lies within [m, m +
// log2(keys)] for its true maximum m (fewer than 2^31 keys), and the kept M within [m - kRescaleThresholdLog2, m], up
// to roundings far below the margins (31 + 8 < 64), so every finite row the pass picks has set the flag itself:
// whether a row is redone depends on that row alone, not on the other rows of the call (before session 66 the pass
// picked rows from 2^15 but ran only when some row reached 2^16). Every row at or past the limit is picked, since
// |LSE| >= |m| - 31 there.
constexpr float kExactRowsSelectLog2 = kExactRowsLimitLog2 - 64.f;
constexpr float kExactRowsFlagLog2 = kExactRowsSelectLog2 - 64.f;

// O's value before its store as Element: for fp16, finite values clamped to fp16's range (inf and NaN pass). O is a
// convex combination of V's rows, so |O| <= 65504, but the forward's weights may sum to a little more than 1: P rounded
// to fp16 for P V over the sum l of the unrounded P (up to 1 + 2^-11), or the exact pass's float32 sum over many keys
// (V at 65504 and every P equal reach 65520 from about 16,400 keys); values at 65504 then came out as inf (the
// thirty-first round, tests/bug_report_sources.md). (Normalising by the sum of the rounded P instead, as
// Dao-AILab/flash-attention#2721 proposes, also ends the one-ulp bias, but cost the forward 5-16 % with the sum on the
// CUDA cores, 2-10 % with it in P V's WGMMAs and 5-28 % through mma.sync, on an H100: benchmarks/NOTES.md, sessions
// 63-64.)
template <class Element>
CUTLASS_HOST_DEVICE float o_in_range(float o) {
  if constexpr (std::is_same_v<Element, cutlass::half_t>) {
    if (fabsf(o) <= FLT_MAX) { return fminf(fmaxf(o, -65504.f), 65504.f); }
  }
  return o;
}

inline ScoreScales score_scales(float softmax_scale, float softcap) {
  float const scale = softcap > 0.f ? softcap : softmax_scale;
  return {scale, float(double(scale) * M_LOG2E), softcap > 0.f ? softmax_scale / softcap : 0.f};
}

// Running row max m (of raw scores) and per-thread partial row sum l for the rows a thread holds. With the fixed
// maximum of the softcap the caller also keeps a rounding sum per row: how much rounding P to bf16 for P V changed l
// on boundary key blocks (add_rounding).
// scale_log2 = score_scale * log2(e) > 0 so that exp(scale * (s - m)) = exp2(s * scale_log2 - m * scale_log2),
// one FFMA per element. (m stays raw: kept as the rounded scaled value instead, the forward read 1-3 % slower at
// head_dim 64 on the H200 with no more instructions per block; session 40.)
// kChains / kSumChains: independent dependency chains per row for the max and the sum reductions
// (FwdKernelTraits::kSoftmaxChains / kSoftmaxSumChains).
template <int kRows, int kChains = 1, int kSumChains = kChains>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];
  float const scale_log2;

  CUTLASS_DEVICE explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // A thread's part of each row's maximum, in kChains independent chains per row: with one, the compiler keeps a
  // chain of dependent FMNMX 32 deep per row at kBlockN 128. max is exact in any order, so the result is the same.
  static_assert((kChains == 1 || kChains == 4) && (kSumChains == 1 || kSumChains == 4));
  template <class TensorRC>
  CUTLASS_DEVICE static void row_maxima(TensorRC const& s, float (&out)[kRows]) {
    constexpr int kCols = decltype(size<1>(s))::value;
    static_assert(kCols % kChains == 0);
    float part[kRows][kChains];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kChains; ++c) { part[r][c] = s(r, c); }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int j = kChains; j < kCols; j += kChains) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < kChains; ++c) { part[r][c] = fmaxf(part[r][c], s(r, j + c)); }
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) { out[r] = combine(part[r], [](float a, float b) { return fmaxf(a, b); }); }
  }
  template <int kN, class Op>
  CUTLASS_DEVICE static float combine(float const (&part)[kN], Op op) {
    if constexpr (kN == 4) {
      return op(op(part[0], part[1]), op(part[2], part[3]));
    } else {
      return part[0];
    }
  }
  // Row r's sum over this thread's columns in kSumChains independent chains. The chain count sets the float32 sum's
  // rounding, so kernels whose rows must agree bit for bit (head_dim 64's two tile heights) share it.
  template <class TensorRC>
  CUTLASS_DEVICE static float row_total(TensorRC const& s, int r) {
    constexpr int kCols = decltype(size<1>(s))::value;
    static_assert(kCols % kSumChains == 0);
    float part[kSumChains];
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kSumChains; ++c) { part[c] = s(r, c); }
    CUTLASS_PRAGMA_UNROLL
    for (int j = kSumChains; j < kCols; j += kSumChains) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kSumChains; ++c) { part[c] += s(r, j + c); }
    }
    return combine(part, [](float a, float b) { return a + b; });
  }

  // Turns the S tile into unnormalised P in place and returns, warp-uniformly, whether O must be rescaled; `rescale`
  // then holds per row the factor (exp of the old maximum minus the new one; 1 where the row kept its maximum).
  // kLazy (FlashAttention-4's conditional rescaling): the running maximum moves only when a row's new maximum
  // exceeds it by more than kRescaleThresholdLog2; below that P stays <= 2^8 and O needs no rescale. Without it every
  // step moves the maximum and returns true (cheaper where the O rescale is: FwdKernelTraits::kLazyRescale).
  template <bool kLazy, class TensorS>
  CUTLASS_DEVICE bool step(TensorS& tSrS, cute::array<float, kRows>& rescale) {
    Tensor s = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
    static_assert(decltype(size<0>(s))::value == kRows);
    bool moved = false;
    float block_max[kRows];
    row_maxima(s, block_max);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float m = quad_max(fmaxf(row_max[r], block_max[r]));
      // A row with no visible key so far keeps max -inf; subtracting 0 then maps every -inf score to P = 0
      // instead of NaN.
      float m_scaled;
      if constexpr (kLazy) {
        // A row's first finite maximum always moves it (m - -inf = inf; O and the sum are still zero then). A row
        // that still sees no key (-inf - -inf = NaN) and a NaN maximum compare false: no move, so such a row does
        // not make its warp rescale O every block; NaN scores propagate through P as before.
        bool const move = (m - row_max[r]) * scale_log2 > kRescaleThresholdLog2;
        rescale[r] = 1.f;
        if (move) {
          rescale[r] = row_max[r] == -INFINITY ? 1.f : exp2f((row_max[r] - m) * scale_log2);
          row_max[r] = m;
          moved = true;
        }
        m_scaled = row_max[r] == -INFINITY ? 0.f : row_max[r] * scale_log2;
      } else {
        m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
        // From the difference of the maxima: exactly 1 while the maximum stays. (An FFMA of the old maximum against
        // the new rounded one multiplied O by 2^r at every key block: an error growing with the number of blocks.)
        rescale[r] = m == -INFINITY ? 1.f : exp2f((row_max[r] - m) * scale_log2);
        row_max[r] = m;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(s); ++j) { s(r, j) = exp2f(fmaf(s(r, j), scale_log2, -m_scaled)); }
      row_sum[r] = row_sum[r] * rescale[r] + row_total(s, r);
    }
    if constexpr (kLazy) {
      return __any_sync(0xffffffffu, moved);
    } else {
      return true;
    }
  }

  // Whether a row of this thread has a finite maximum whose scaled magnitude is kExactRowsFlagLog2 or more (past
  // kExactRowsLimitLog2 its P carry a rounding factor 2^r that may not cancel), infinite scaled values included: a
  // finite score whose scaled value (log2 units) overflows leaves the row's P all 0 or infinite here (a silent 0 row or
  // NaN); the pass, in natural units, gets the float32 reference's answer for it (scores past ~2.4e38 /
  // softmax_scale). Rows with no key (-inf) or a non-finite maximum (inf or NaN scores, which propagate as in the
  // reference) are not flagged.
  CUTLASS_DEVICE bool needs_exact_rows() const {
    bool any = false;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      any |= fabsf(row_max[r]) < INFINITY && fabsf(row_max[r] * scale_log2) >= kExactRowsFlagLog2;
    }
    return any;
  }

  // Softcap with a fixed maximum: the scores the softmax sees, c * x with x = tanh(..) in [-1, 1], never exceed the
  // cap, so exp(c * (x - 1)) in [exp(-2c), 1] needs no running maximum: no max reduction and no rescaling of O.
  // Valid while exp(-2c) stays far from float32's (and bf16's) smallest normal (kSoftcapFixedMaxLimit); an fp16 P
  // would underflow (its smallest normal is 6e-5), so only bf16 takes it. Call fix_max() once before the first step,
  // add_rounding after the conversion of P on key blocks that the mask crosses (it adds for the rows whose own mask
  // cuts the block), and finalize<true>.
  CUTLASS_DEVICE void fix_max() {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) { row_max[r] = 1.f; }
  }
  template <class TensorS>
  CUTLASS_DEVICE void step_fixed_max(TensorS& tSrS) {
    Tensor s = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(s); ++j) { s(r, j) = exp2f(fmaf(s(r, j), scale_log2, -scale_log2)); }
      row_sum[r] += row_total(s, r);
    }
  }
  // The fixed maximum leaves a key's P anywhere in [exp(-2c), 1], so rounding P to bf16 for P V changes it, and O
  // normalised by the unrounded sum gets weights that sum to sum(bf16(p)) / sum(p): a row that sees one key came out
  // as v * bf16(p) / p, up to one bf16 ulp off v (an online maximum gives that key a P within 1e-6 of 1, which rounds
  // to exactly 1). Adds sum(bf16(p) - p) of this block to the row's rounding sum (tSrS: P in float32; tOrP: P as P V
  // reads it, in S's register order), and O is normalised by l plus that sum (finalize<true>). Called on boundary key
  // blocks only, and adds only for the rows whose own mask cuts the block: a row that sees fewer keys than a block
  // holds has them all in such blocks, so its O is normalised by the sum of the P it used, up to float32 summation (one
  // key: p + (bf16(p) - p) = bf16(p) exactly, each step exact); on blocks a row sees whole a long row's rounding errors
  // average out as in the online softmax. The LSE keeps the unrounded sum, from which the backward recomputes P: a
  // one-key row's P is within ~1e-5 of 1 there, rounds to 1, and the key's dV is the exact dO.
  // rounding: this thread's rounding sums, row r at rounding[r * stride]: shared memory at head_dim 96/128 (out of the
  // main loop's registers, where two more live values made ptxas reload others from local memory every key block),
  // else a register array of the caller.
  template <class TensorS, class TensorP>
  CUTLASS_DEVICE void add_rounding(TensorS const& tSrS, TensorP const& tOrP, float* rounding, int stride) {
    Tensor s = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
    Tensor p = make_tensor(tOrP.data(), acc_rowcol(tSrS.layout()));
    static_assert(decltype(size<0>(p))::value == kRows);
    constexpr int kCols = decltype(size<1>(p))::value;
    static_assert(kCols % 4 == 0);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float sum[4] = {0.f, 0.f, 0.f, 0.f};  // four dependency chains instead of one
      bool masked_key = false;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kCols; ++j) {
        sum[j % 4] += float(p(r, j)) - s(r, j);
        masked_key |= s(r, j) == 0.f;
      }
      // Only rows that the mask crosses in this block (a masked key's P is exactly 0, a visible key's at least
      // exp(-2c) > 0): whether a row is corrected then depends on its own keys alone, not on the tile it shares
      // with other rows, so a row's bits are the same in a prefill, a decode call or a chunk (round 32's GA).
      if (quad_max(masked_key ? 1.f : 0.f) != 0.f) { rounding[r * stride] += (sum[0] + sum[1]) + (sum[2] + sum[3]); }
    }
  }

  // Multiplies the rows of an accumulator (O) by per-row factors.
  template <class TensorO>
  CUTLASS_DEVICE static void scale_rows(TensorO& tOrO, cute::array<float, kRows> const& factor) {
    Tensor o = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(o); ++j) { o(r, j) *= factor[r]; }
    }
  }

  // Completes the row sums across the quad; returns 1/l per row (0 for a row that saw no key) and writes the
  // natural-log LSE = m * score_scale + log(l) (-inf for such a row; score_scale: ScoreScales). kRounding (the fixed maximum): O's 1/l from
  // l plus the rounding sum instead (add_rounding); both are 0 exactly when the row saw no key (P >= exp(-2c) is a
  // normal bf16 number).
  template <bool kRounding = false>
  CUTLASS_DEVICE cute::array<float, kRows> finalize(float score_scale, cute::array<float, kRows>& lse,
                                                    float const* rounding = nullptr, int stride = 0) {
    cute::array<float, kRows> inv_sum;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float const l = quad_sum(row_sum[r]);
      float l_o = l;
      if constexpr (kRounding) { l_o = l + quad_sum(rounding[r * stride]); }
      bool const empty = l == 0.f;  // a NaN sum (NaN input) stays NaN in O and LSE rather than reading as "no key"
      inv_sum[r] = empty ? 0.f : 1.f / l_o;
      lse[r] = empty ? -INFINITY : row_max[r] * score_scale + logf(l);
    }
    return inv_sum;
  }
};

}  // namespace flash
