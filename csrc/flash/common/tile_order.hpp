// Host: the size of the L2-sized sections in which the forward (decode_tile) and the backward (its kernel's CTA
// renumbering) order the tiles of causal-like launches: (head, batch) pairs whose reused bytes fit the budget, query
// or key blocks longest first across a section, so the last wave is short tiles of many pairs rather than one pair's
// long ones (scripts/tile_order_model.py; H200 measurements in launch_fwd_sm90.hpp and benchmarks/NOTES.md).
#pragma once

#include <algorithm>
#include <cstdint>

namespace flash {

// Tile lengths grow with the query block (forward) and shrink with the key block (backward) only under a right limit
// and no left one: causal, or a window (-1, r); window sides as kernel_window gives them.
inline bool causal_like(int window_left, int window_right, int seqlen_q, int seqlen_k) {
  return window_left >= seqlen_k && window_right < seqlen_q;
}

// Lowers a section size fit (1 <= fit <= pairs) to the largest size above fit / 2 (rounded down) that divides the pair
// count evenly (a short last section leaves a ragged tail in the model, which is not monotone in the size), else keeps
// fit itself.
inline int even_section_pairs(int64_t pairs, int64_t fit) {
  int64_t s = fit;
  while (s > fit / 2 && pairs % s != 0) { --s; }
  return int(pairs % s == 0 ? s : fit);
}

// Pairs per section: those whose bytes fit budget_mib, lowered by even_section_pairs; 0 (no sections) for a budget of
// 0 or a single pair.
inline int l2_section_pairs(int64_t pairs, double bytes_per_pair, int budget_mib) {
  if (budget_mib <= 0 || pairs <= 1) { return 0; }
  double const fit_d = double(budget_mib) * (1 << 20) / std::max(bytes_per_pair, 1.0);
  int64_t const fit = int64_t(std::min(fit_d, 1024.0));
  return even_section_pairs(pairs, std::clamp<int64_t>(fit, 1, std::min<int64_t>(pairs, 1024)));
}

// Pairs per section for the backward's GQA group CTAs: as many pairs as one wave of resident CTAs holds (wave_ctas /
// ctas_per_pair, at least 1), lowered by even_section_pairs; 0 for a single pair or an empty grid.
inline int wave_section_pairs(int64_t pairs, int64_t ctas_per_pair, int64_t wave_ctas) {
  if (pairs <= 1 || ctas_per_pair <= 0 || wave_ctas <= 0) { return 0; }
  int64_t const fit = wave_ctas / ctas_per_pair;
  return even_section_pairs(pairs, std::clamp<int64_t>(fit, 1, std::min<int64_t>(pairs, 1024)));
}

}  // namespace flash
