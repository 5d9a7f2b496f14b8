// Sequence-length and causal masking of one S tile, and the range of key blocks a query block must visit.
#pragma once

#include <cute/tensor.hpp>

#include "flash/common/utils.hpp"

namespace flash {

using namespace cute;

// Key blocks [n_block_min, n_block_max) that hold at least one key visible to query block m_block.
// Causal is bottom-right aligned: row i sees key j iff j <= i + seqlen_k - seqlen_q.
template <int kBlockM, int kBlockN>
struct BlockRange {
  int n_block_min;
  int n_block_max;

  CUTLASS_DEVICE BlockRange(int m_block, int seqlen_q, int seqlen_k, bool is_causal) {
    n_block_min = 0;
    n_block_max = cute::ceil_div(seqlen_k, kBlockN);
    if (is_causal) {
      int const last_row = min((m_block + 1) * kBlockM, seqlen_q) - 1;
      int const cols_visible = last_row + 1 + seqlen_k - seqlen_q;  // keys [0, cols_visible) for the last row
      n_block_max = min(n_block_max, cute::ceil_div(max(cols_visible, 0), kBlockN));
    }
  }
  CUTLASS_DEVICE bool empty() const { return n_block_max <= n_block_min; }
};

template <int kBlockM, int kBlockN>
struct Mask {
  int seqlen_q, seqlen_k;
  bool is_causal;

  // Whether some element of tile (m_block, n_block) is masked: the tile crosses seqlen_k or the causal diagonal.
  CUTLASS_DEVICE bool needs_mask(int m_block, int n_block) const {
    int const last_col = (n_block + 1) * kBlockN - 1;
    if (last_col >= seqlen_k) { return true; }
    return is_causal && last_col > m_block * kBlockM + seqlen_k - seqlen_q;
  }

  // tSrS: the S accumulator; tScS: the same partition of an identity tensor (row, col within the tile).
  template <class TensorS, class TensorC>
  CUTLASS_DEVICE void apply(TensorS& tSrS, TensorC const& tScS, int m_block, int n_block) const {
    Tensor s = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));  // (rows, cols)
    Tensor c = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
    int const col_limit_seqlen = seqlen_k - n_block * kBlockN;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      int const row = m_block * kBlockM + get<0>(c(r, 0));
      // Columns (tile-local) at or past the limit are masked.
      int col_limit = col_limit_seqlen;
      if (is_causal) { col_limit = min(col_limit, row + 1 + seqlen_k - seqlen_q - n_block * kBlockN); }
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(s); ++j) {
        if (get<1>(c(r, j)) >= col_limit) { s(r, j) = -INFINITY; }
      }
    }
  }

  // The same for a transposed tile: tStS holds Sᵀ, tStC the (key, row) coordinates within the tile.
  template <class TensorS, class TensorC>
  CUTLASS_DEVICE void apply_transposed(TensorS& tStS, TensorC const& tStC, int m_block, int n_block) const {
    int const key_limit_seqlen = seqlen_k - n_block * kBlockN;
    // Row `row` sees tile-local keys below row + causal_offset.
    int const causal_offset = m_block * kBlockM + 1 + seqlen_k - seqlen_q - n_block * kBlockN;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tStS); ++i) {
      int const key = get<0>(tStC(i)), row = get<1>(tStC(i));
      int const key_limit = is_causal ? min(key_limit_seqlen, row + causal_offset) : key_limit_seqlen;
      if (key >= key_limit) { tStS(i) = -INFINITY; }
    }
  }
};

}  // namespace flash
