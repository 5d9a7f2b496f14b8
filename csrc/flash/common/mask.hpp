// Masking of S tiles and the ranges of blocks a tile must visit, for one rule that covers causal, sliding-window and
// sequence-length bounds (DESIGN.md §2): query row i sees key j iff 0 <= j < seqlen_k and
//   i + offset - window_left <= j <= i + offset + window_right,   offset = seqlen_k - seqlen_q (bottom-right),
// and, with documents (packed sequences in one row; self-attention, seqlen_q == seqlen_k), doc_start[i] <= j <
// doc_end[i]: the first position of row i's document and one past its last. Membership is symmetric (j is in i's
// document iff i is in j's), so the key side uses the same arrays; both are nondecreasing and every row is in its own
// document and window, so the rows of a block see one contiguous run of keys (and the keys of a block one run of
// rows): the block ranges below are exact hulls, the same tiles from either side.
// The host passes an unbounded side as a value no distance can exceed (kernel_window), so there is one code path;
// causal is (unbounded, 0). The sums below reach seqlen_q + seqlen_k + 2 * kWindowHeadroom: within int for the
// API's limit of fewer than 2^30 - kWindowHeadroom rows per tensor.
#pragma once

#include <cute/tensor.hpp>

#include "flash/common/block_range.hpp"
#include "flash/common/seqlen.hpp"
#include "flash/common/utils.hpp"

namespace flash {

using namespace cute;

template <int kBlockM, int kBlockN, bool kDocuments = true>  // kDocuments false: document bounds compiled out
struct Window {
  int seqlen_q, seqlen_k;
  int window_left, window_right;  // >= 0
  int2 const* docs = nullptr;  // this batch element's (doc_start, doc_end) per position; null: no documents

  CUTLASS_DEVICE int offset() const { return seqlen_k - seqlen_q; }
  CUTLASS_DEVICE bool documents() const {
    if constexpr (kDocuments) { return docs != nullptr; } else { return false; }
  }
  // Document bounds of position i (one 8-byte load), clamped into the row (rows past seqlen_q are padding whose
  // results are dropped).
  CUTLASS_DEVICE int2 doc(int i) const { return __ldg(docs + max(min(i, seqlen_q - 1), 0)); }
  CUTLASS_DEVICE int doc_lo(int i) const { return doc(i).x; }
  CUTLASS_DEVICE int doc_hi(int i) const { return doc(i).y; }

  // Key blocks [n_block_min, n_block_max) holding at least one key visible to some row of query block m_block. The
  // host's key_block_range (flash/common/block_range.hpp) is the same sums; the kernels keep this form, the one
  // measured on the H200 (sharing that one compiled the backward's deterministic kernels to other instructions).
  CUTLASS_DEVICE void n_block_range(int m_block, int& n_block_min, int& n_block_max) const {
    int const first_row = m_block * kBlockM;
    int const last_row = cute::min(first_row + kBlockM, seqlen_q) - 1;
    int lo = cute::max(first_row + offset() - window_left, 0);             // first visible key of any row
    int hi = cute::min(last_row + offset() + window_right + 1, seqlen_k);  // one past the last one
    if (documents()) {
      lo = cute::max(lo, doc_lo(first_row));
      hi = cute::min(hi, doc_hi(last_row));
    }
    n_block_min = lo / kBlockN;
    n_block_max = hi <= lo ? n_block_min : cute::ceil_div(hi, kBlockN);
  }

  // Query blocks [m_block_min, m_block_max) holding at least one row that sees some key of key block n_block.
  CUTLASS_DEVICE void m_block_range(int n_block, int& m_block_min, int& m_block_max) const {
    int const first_key = n_block * kBlockN;
    int const last_key = min(first_key + kBlockN, seqlen_k) - 1;
    int lo = max(first_key - offset() - window_right, 0);             // first row that sees some key
    int hi = min(last_key - offset() + window_left + 1, seqlen_q);    // one past the last such row
    if (documents()) {
      lo = max(lo, doc_lo(first_key));
      hi = min(hi, doc_hi(last_key));
    }
    m_block_min = lo / kBlockM;
    m_block_max = hi <= lo ? m_block_min : cute::ceil_div(hi, kBlockM);
  }

  // Interior tiles (every element visible, seqlen_k not crossed; rows past seqlen_q count as rows, their results
  // are discarded) form a contiguous run of blocks along either axis. Each consumer computes its run once, so the
  // per-tile test is two compares on two registers (what keeps the register-tight kernels spill-free).
  // Key blocks [lo, hi) interior for query block m_block:
  CUTLASS_DEVICE void interior_n_blocks(int m_block, int& lo, int& hi) const {
    int const first_row = m_block * kBlockM, last_row = first_row + kBlockM - 1;
    lo = cute::ceil_div(max(last_row + offset() - window_left, 0), kBlockN);          // first_col >= left edge
    hi = max(min(first_row + offset() + window_right + 1, seqlen_k), 0) / kBlockN;   // last_col <= right edge
    if (documents()) {  // the last row's document starts latest, the first row's ends first
      lo = max(lo, cute::ceil_div(doc_lo(last_row), kBlockN));
      hi = min(hi, doc_hi(first_row) / kBlockN);
    }
  }
  // Query blocks [lo, hi) interior for key block n_block:
  CUTLASS_DEVICE void interior_m_blocks(int n_block, int& lo, int& hi) const {
    int const first_col = n_block * kBlockN, last_col = first_col + kBlockN - 1;
    lo = cute::ceil_div(max(last_col - offset() - window_right, 0), kBlockM);
    hi = last_col >= seqlen_k ? 0 : max(first_col - offset() + window_left + 1, 0) / kBlockM;
    if (documents()) {
      lo = max(lo, cute::ceil_div(doc_lo(last_col), kBlockM));
      hi = min(hi, doc_hi(first_col) / kBlockM);
    }
  }

  // Tile-local key limits [lo, hi) of query row `row` (global index) in key block n_block.
  CUTLASS_DEVICE void key_limits(int row, int n_block, int& lo, int& hi) const {
    int const base = row + offset() - n_block * kBlockN;
    lo = base - window_left;
    hi = min(base + window_right + 1, seqlen_k - n_block * kBlockN);
    if (documents()) {
      int2 const d = doc(row);
      lo = max(lo, d.x - n_block * kBlockN);
      hi = min(hi, d.y - n_block * kBlockN);
    }
  }

  // Tile-local row limits [lo, hi) of the rows that see key `key` (global index) in query block m_block.
  CUTLASS_DEVICE void row_limits(int key, int m_block, int& lo, int& hi) const {
    int const base = key - offset() - m_block * kBlockM;
    lo = base - window_right;
    hi = key < seqlen_k ? base + window_left + 1 : 0;
    if (documents()) {
      int2 const d = doc(key);
      lo = max(lo, d.x - m_block * kBlockM);
      hi = min(hi, d.y - m_block * kBlockM);
    }
  }

  // tSrS: the S accumulator; tScS: the same partition of an identity tensor (row, col within the tile).
  // kOneSided: the limits are taken relative to this thread's first column c(0, 0), its smallest in the WGMMA
  // accumulator layout (each compare then has a constant operand), and where no row of the thread has its left limit
  // past that column (a causal diagonal, seqlen_k's cut) one compare per element replaces two
  // (tests/test_mask_math_cpu.py ports it). Used by the forward kernels with two consumer warpgroups (head_dim 64's
  // 192-row kernels spilled 200-290 B with it). H200, 2026-12-03 (session 31 call 2, three rounds): head_dim 64 causal
  // 512, 1024 and 4096 +1.5-1.7 %, head_dim 128 softcap causal +1.6-2.5 % (no longer spilling), window and softcap
  // non-causal up to +2.4 %, the rest level.
  template <bool kOneSided = false, class TensorS, class TensorC>
  CUTLASS_DEVICE void apply(TensorS& tSrS, TensorC const& tScS, int m_block, int n_block) const {
    Tensor s = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));  // (rows, cols)
    Tensor c = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
    if constexpr (kOneSided) {
      constexpr int kR = decltype(size<0>(s))::value;
      int const col0 = get<1>(c(0, 0));
      int lo[kR], hi[kR];
      bool left = false;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kR; ++r) {
        key_limits(m_block * kBlockM + get<0>(c(r, 0)), n_block, lo[r], hi[r]);
        lo[r] -= col0;
        hi[r] -= col0;
        left |= lo[r] > 0;
      }
      if (!left) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kR; ++r) {
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size<1>(s); ++j) {
            if (get<1>(c(r, j)) - col0 >= hi[r]) { s(r, j) = -INFINITY; }
          }
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kR; ++r) {
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size<1>(s); ++j) {
            int const dc = get<1>(c(r, j)) - col0;
            if (dc < lo[r] || dc >= hi[r]) { s(r, j) = -INFINITY; }
          }
        }
      }
    } else {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < size<0>(s); ++r) {
        int lo, hi;
        key_limits(m_block * kBlockM + get<0>(c(r, 0)), n_block, lo, hi);
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < size<1>(s); ++j) {
          int const col = get<1>(c(r, j));
          if (col < lo || col >= hi) { s(r, j) = -INFINITY; }
        }
      }
    }
  }

  // The same for a transposed tile: tStS holds Sᵀ, tStC the (key, row) coordinates within the tile; limits per key
  // (a thread holds few keys and many rows). kOneSided: apply's idea mirrored. On a causal diagonal a key's first
  // visible row lies inside the block and its last one past it, so where no key of the thread has its upper row limit
  // inside the block only the lower test remains (one compare per element, against the thread's first column). The
  // upper limits are not kept: the backward's consumers are short of registers (head_dim 128 spilled 12/24 B with
  // them). Untimed; ptxas, bf16: head_dim 128 masked iteration ~685 -> ~585 instructions on that path, no spills;
  // head_dim 64 loop LDL 3 -> 0.
  template <bool kOneSided = false, class TensorS, class TensorC>
  CUTLASS_DEVICE void apply_transposed(TensorS& tStS, TensorC const& tStC, int m_block, int n_block) const {
    Tensor s = make_tensor(tStS.data(), acc_rowcol(tStS.layout()));  // (keys, rows)
    Tensor c = make_tensor(tStC.data(), acc_rowcol(tStC.layout()));
    if constexpr (kOneSided) {
      constexpr int kR = decltype(size<0>(s))::value;
      int const col0 = get<1>(c(0, 0));
      int lo[kR];
      bool upper = false;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kR; ++r) {
        int hi;
        row_limits(n_block * kBlockN + get<0>(c(r, 0)), m_block, lo[r], hi);
        upper |= hi < kBlockM;
        lo[r] -= col0;
      }
      if (!upper) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kR; ++r) {
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size<1>(s); ++j) {
            if (get<1>(c(r, j)) - col0 < lo[r]) { s(r, j) = -INFINITY; }
          }
        }
        return;
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      int lo, hi;
      row_limits(n_block * kBlockN + get<0>(c(r, 0)), m_block, lo, hi);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(s); ++j) {
        int const row = get<1>(c(r, j));
        if (row < lo || row >= hi) { s(r, j) = -INFINITY; }
      }
    }
  }
};

// The window of one (dense or varlen) batch element from a kernel's Params (window_left/right as kernel_window gives
// them; doc_bounds: null, or the (batch, seqlen_q, 2) int32 [doc_start, doc_end] of a dense batch).
template <int kBlockM, int kBlockN, bool kDocuments = true, class Params>
CUTLASS_DEVICE Window<kBlockM, kBlockN, kDocuments> make_window(Params const& params, SeqlenInfo const& info) {
  Window<kBlockM, kBlockN, kDocuments> w{info.seqlen_q, info.seqlen_k, params.window_left, params.window_right};
  if (kDocuments && params.doc_bounds != nullptr) {
    w.docs = reinterpret_cast<int2 const*>(params.doc_bounds) + int64_t(info.batch_idx) * info.seqlen_q;
  }
  return w;
}

}  // namespace flash
