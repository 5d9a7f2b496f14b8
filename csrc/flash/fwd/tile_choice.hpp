// Host: the forward tile height for a problem, in plain C++ (also compiled into the torch API layer, which exposes it
// as the op fwd_block_m for tests). Only head_dim 64 has two (flash/config.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "flash/common/block_range.hpp"
#include "flash/config.hpp"

namespace flash {

// Query-key pairs that forward tiles of block_m x block_n compute for one (sequence, head): the key-block ranges of
// the query blocks times the tile area. Long sequences are sampled (every step-th query block, at most ~512 of them),
// which keeps this a few hundred integer operations per call. window_left/right as kernel_window gives them.
// Comparing heights by these counts also settles a window side equal to the sequence length as unmasked.
inline double fwd_tile_pairs(int block_m, int block_n, int seqlen_q, int seqlen_k, int window_left, int window_right) {
  int const num_m_blocks = (seqlen_q + block_m - 1) / block_m;
  int const step = std::max(1, num_m_blocks / 256);
  int64_t blocks = 0;
  for (int m_block = 0; m_block < num_m_blocks; m_block += step) {
    int lo, hi;
    key_block_range(block_m, block_n, seqlen_q, seqlen_k, window_left, window_right, m_block, lo, hi);
    blocks += hi - lo;
  }
  return double(blocks) * step * block_m * block_n;
}

// head_dim 64: 192-row tiles unless their estimated time is longer than that of 128-row tiles. The estimate is the
// time per computed pair (kFwd64WideCost*, relative to 128-row tiles) times the pairs a tile computes, times the waves
// of tiles over the SMs' CTAs, i.e. pairs / min(tiles, num_sms) per SM: a causal diagonal or narrow window, a last
// query block mostly past seqlen_q, or fewer tiles than SMs (a 192-row tile takes longer and there is no next wave to
// balance it) tip the choice to 128 rows. window_left/right: the user's (-1 unbounded; causal is right = 0);
// num_head_batches: nheads * batch (varlen: the sequences, with seqlen_q/k their maxima). FAH_FWD_BLOCK_M=128 or 192
// forces one (development; read once per process).
inline int fwd_block_m_hdim64(int seqlen_q, int seqlen_k, int window_left, int window_right, int64_t num_head_batches,
                              int num_sms) {
  using Wide = FwdTileConfig<64>;
  using Narrow = FwdTileConfig64Narrow;
  static int const forced = [] {
    char const* v = std::getenv("FAH_FWD_BLOCK_M");
    int const m = v == nullptr ? 0 : std::atoi(v);
    return m == Wide::kBlockM || m == Narrow::kBlockM ? m : 0;
  }();
  if (forced != 0) { return forced; }
  if (seqlen_q <= 0 || seqlen_k <= 0) { return Narrow::kBlockM; }  // nothing to compute: either runs it
  int left, right;
  kernel_window(window_left, window_right, seqlen_q, seqlen_k, left, right);
  // kernel_window turns a side that masks nothing into one past the sequence.
  bool const masked = left < seqlen_k || right < seqlen_q;
  double const cost = masked ? kFwd64WideCostMasked : kFwd64WideCostFull;
  auto per_sm = [&](int block_m, int block_n) {
    double const tiles = double((seqlen_q + block_m - 1) / block_m) * double(std::max<int64_t>(1, num_head_batches));
    double const ctas = std::min(tiles, double(std::max(1, num_sms)));
    return fwd_tile_pairs(block_m, block_n, seqlen_q, seqlen_k, left, right) / ctas;
  };
  bool const wide = cost * per_sm(Wide::kBlockM, Wide::kBlockN) <= per_sm(Narrow::kBlockM, Narrow::kBlockN);
  return wide ? Wide::kBlockM : Narrow::kBlockM;
}

// The tile height the forward runs a problem with on the kernel of kernel_head_dim (64, 96, 128, 192 or 256).
inline int fwd_block_m(int kernel_head_dim, int seqlen_q, int seqlen_k, int window_left, int window_right,
                       int64_t num_head_batches, int num_sms) {
  if (kernel_head_dim == 64) {
    return fwd_block_m_hdim64(seqlen_q, seqlen_k, window_left, window_right, num_head_batches, num_sms);
  }
  switch (kernel_head_dim) {
    case 96: return FwdTileConfig<96>::kBlockM;
    case 128: return FwdTileConfig<128>::kBlockM;
    case 192: return FwdTileConfig<192>::kBlockM;
    default: return FwdTileConfig<256>::kBlockM;
  }
}

}  // namespace flash
