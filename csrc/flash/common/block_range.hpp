// The mask rule's host side in plain C++ (also compiled into the torch API layer, without CUDA): the window sides as
// the kernels take them, and the key-block range of a query block for the host's count of the pairs a tile shape
// computes (flash/fwd/tile_choice.hpp); the kernels' own range is Window::n_block_range (flash/common/mask.hpp), the
// same sums (both ported to Python and checked in tests/test_mask_math_cpu.py and tests/test_tile_choice_cpu.py).
#pragma once

#include <algorithm>
#include <cstdint>

namespace flash {

// Host: the user's window sides (-1 = unbounded) as the kernels take them: a side that no distance can exceed
// (left > seqlen_k, right > seqlen_q) becomes that bound plus a tile's worth of rows, so unbounded and very wide
// windows share one path and the padding rows of a last tile still see every key (no needless masking); with fewer
// than 2^30 - kWindowHeadroom rows per tensor (the API's limit) the kernels' sums stay within int.
constexpr int kWindowHeadroom = 256;  // >= every kBlockM and kBlockN
inline void kernel_window(int window_left, int window_right, int seqlen_q, int seqlen_k, int& left, int& right) {
  left = (window_left < 0 || window_left > seqlen_k) ? seqlen_k + kWindowHeadroom : window_left;
  right = (window_right < 0 || window_right > seqlen_q) ? seqlen_q + kWindowHeadroom : window_right;
}

// Whether a window (sides as kernel_window gives them) hides no key from any row: left >= seqlen_k - 1 and right >=
// seqlen_q - 1 (bottom-right aligned). Launch choices take such a window as no mask.
inline bool window_hides_nothing(int left, int right, int seqlen_q, int seqlen_k) {
  return left >= seqlen_k - 1 && right >= seqlen_q - 1;
}

// Key blocks [n_block_min, n_block_max) of block_n keys holding at least one key visible to some row of query block
// m_block (block_m rows); window sides as kernel_window gives them.
inline void key_block_range(int block_m, int block_n, int seqlen_q, int seqlen_k, int window_left, int window_right,
                            int m_block, int& n_block_min, int& n_block_max) {
  int64_t const offset = int64_t(seqlen_k) - seqlen_q;
  int64_t const first_row = int64_t(m_block) * block_m;
  int64_t const last_row = std::min<int64_t>(first_row + block_m, seqlen_q) - 1;
  int64_t const lo = std::max<int64_t>(first_row + offset - window_left, 0);             // first visible key of any row
  int64_t const hi = std::min<int64_t>(last_row + offset + window_right + 1, seqlen_k);  // one past the last one
  n_block_min = int(lo / block_n);
  n_block_max = hi <= lo ? n_block_min : int((hi + block_n - 1) / block_n);
}

}  // namespace flash
