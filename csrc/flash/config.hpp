// Named forward tile configurations per head dim.
//
// Forward persistence: run persistent only when each tile sees at most this many key blocks (measured below: longer
// tiles gain nothing from overlapping the epilogue and lose to the tile loop's extra live registers), or, where a
// configuration sets kPersistentUnmasked, whenever no causal mask or window applies.
constexpr int kFwdPersistentMaxKeyBlocks = 32;

// Shared memory per CTA = (kQBuffers * kBlockM + 2 * kStages * kBlockN) * kHeadDim * 2 bytes (Q, K and V staged;
// persistent CTAs double-buffer Q) plus barriers and 1 KiB alignment, within the 227 KiB a CTA may take of the H200's
// 228 KiB per SM (static_assert in FwdKernelTraits):
//   hdim  64: 192 x 128, 2 stages, 2 Q -> 112 KiB (or 128 x 128, 3 stages -> 128 KiB, chosen per shape: see below)
//   hdim 128: 128 x 128, 2 stages, 2 Q -> 192 KiB
//   hdim 256: 128 x  64, 2 stages, 1 Q -> 192 KiB (80, the widest that fits, lost to 64 with a causal mask: below)
// Two consumer warpgroups of 64 query rows each (kBlockM = 128; head_dim 64 also three, below). First configuration
// (2026-11-29): chosen to fit, not yet tuned by measurement. Every configuration runs the intra-warpgroup overlap
// (fwd_consumer: QKᵀ of the next block issued before the softmax of this one), which needs S, P and O live at once:
// head_dim 192 and 256 ran without it until session 20 (spills of 104 and 76 B at 224 registers; the sequential variant
// was removed once no configuration used it); at 232 registers with Q's descriptors rebuilt per key block
// (FwdKernelTraits::kQDescriptorsPerBlock) neither spills. H200, 2026-12-02 (session 20 call 3, bf16 TFLOP/s, two
// rounds, without / with): head_dim 256 non-causal 1024 632 / 642, 2048 648-650 / 669-683, 4096 676-757 / 696-715 (757
// one reading), 16384 708 / 736-747, causal 1024 416-419 / 422, 2048 509-516 / 527-538, 4096 568-576 / 584-588, 16384
// 689 / 705-713; head_dim 192 (hidden 1536) non-causal 1024 559-560 / 581-582, 4096 663 / 704, 16384 691-707 / 733,
// causal 1024 379 / 391-394, 4096 556-573 / 578-584, 16384 677 / 697-712.
// kPersistent: one CTA per SM loops over tiles (the next tile's loads overlap this tile's epilogue), chosen at run
// time for short key ranges (run_fwd_sm90). H200, 2026-11-30, bf16 TFLOP/s persistent vs one CTA per tile (same
// build): head_dim 128 seqlen 512 416 vs 365, 2048 549 vs 529, causal 1024 364 vs 335, but causal 8192 538 vs 560;
// head_dim 64 causal 512 188 vs 155; head_dim 256 causal 4096-16384 486-566 vs 511-618, and its tile loop's live
// state made it spill (100 B), so head_dim 256 keeps one CTA per tile.
#pragma once

#include <cstdint>
#include <cstdlib>

namespace flash {

template <int kHeadDim>
struct FwdTileConfig;

template <>
struct FwdTileConfig<64> {
  static constexpr int kBlockM = 192, kBlockN = 128, kStages = 2;
  static constexpr bool kPersistent = true;
  static constexpr bool kPersistentUnmasked = false;
  // No documents (document_ids run on FwdTileConfig64Narrow): their bounds pointer added 8-16 B of spill to these
  // already spilling consumers, and the non-causal forward at 4096 fell to 0.996x cuDNN from 1.036x (H200,
  // 2026-11-30, session 8 runs 1 and 3, one run each).
  static constexpr bool kDocuments = false;
  static constexpr bool kPingpong = true;
};

// head_dim 64, 192 rows: three consumer warpgroups at 160 registers (producer 32), as FlashAttention-3 runs head_dim
// 64: the exp-bound softmax of one warpgroup hides under two others' GEMMs. Until session 23 the consumers spilled the
// softmax row state and four loop-invariant 64-bit values, reloaded every key block (ptxas: 164 B stores, 220 B
// loads); with the interior key blocks in a loop of their own (FwdKernelTraits::kSplitMaskLoop) 8/28 B remained (4/4
// since session 28's single consumer copy at head_dim 64), none in that loop, and the tiles gained 6 % from 4096
// (the costs below predate that). A 192-row tile computes more masked pairs on a causal diagonal and past
// seqlen_q, so the launcher estimates both: kFwd64WideCost* times the query-key pairs a 192-row tile computes
// against those of a 128-row tile, per SM (flash/fwd/tile_choice.hpp, which also counts waves of tiles over the
// SMs). The costs are the measured time per computed pair, 192 over 128 rows (H200, 2026-11-30, session 5 run 6,
// double-buffered Q, bf16 TFLOP/s forced 128 / 192): no mask 512 331/345, 1024
// 388/386, 2048 422/446, 4096 437/464, 8192 446/482, 16384 449/487 (0.85-0.92 per pair); causal 512 209/182, 1024
// 285/236, 2048 353/333, 4096 401/380, 8192 417/428, 16384 438/455 (0.85-0.97 per pair, 0.94-0.97 from 2048 up).
// The 128-row tiles take a third K/V stage (shared memory is plentiful at head_dim 64), so the producer runs a block
// further ahead and the next tile's first K and V are likelier to be there at the tile boundary (the likely reason;
// not profiled). kFwd64WideCost* above were measured against two stages. H200, 2026-11-30 (session 7 run 6, one
// device call, a process per build, bf16 TFLOP/s 2 / 3 stages): causal 512 211/220, 1024 287/302, 2048 352/360,
// 4096 400/396, train_lm's shape (batch 8, 12 heads, 2048, causal) 314/319; the unchanged 192-row points moved by up
// to 2 %, so only 512 and 1024 clear the noise. Re-measured after the 128-row tiles took the TMA-store epilogue (the
// 192-row ones then still had direct stores; H200, 2026-12-01, session 13 run 3, one round, bf16 TFLOP/s forced 128 /
// 192): no mask 512 350/340, 1024 407/390, 2048 436/438, 4096 447/456, 8192 449/473, 16384 449/484 (0.92-0.97 per
// pair); causal 512 222/184, 1024 299/246, 2048 365/341, 4096 401/390, 8192 418/426, 16384 447/449 (0.90-0.97).
// kFwd64WideCostFull 0.88 -> 0.94 puts non-causal 512 and 1024 on 128 rows; the masked cost stands. When the 192-row
// tiles took the same epilogue (run 4, two rounds: no mask 1024 413-415, 2048 444-446, 4096 459-470, 16384 488;
// causal 1024 258, 2048 345, 4096 387-390, 16384 457-461), non-causal 1024 became a tie (407 vs 413-415).
// Re-measured after session 23's loop split (H200, 2026-12-02, call 2, one round, forced 128 / 192): no mask 512
// 373/394, 1024 425/421, 2048 448/480, 4096 460/493, 16384 464/520 (0.84-0.91 per pair); causal 512 234/187, 1024
// 315/249, 2048 375/358, 4096 414/415, 16384 453/482 (0.91-0.95). The constants still pick the faster height except at
// non-causal 512 (192 rows 5 % faster; a lower kFwd64WideCostFull would also move 1024, 1 % slower there) and causal
// 4096 (a tie), so they stand.
// kPingpong (every configuration): the consumer warpgroups take turns at the tensor cores (FlashAttention-3 §3.1;
// FAH_FWD_PINGPONG=0 turns it off everywhere, for measurements). Off on these 128-row tiles, whose short tiles and
// exp-bound softmax gain from letting both warpgroups issue freely: H200, 2026-12-02 (session 24 call 5, bf16 TFLOP/s,
// two rounds, forced 128 rows, on / off): causal 1024 313-315 / 319-321, 4096 403 / 410-413, 2048 367-369 / 367-379;
// non-causal 1024 424-425 / 429-430 (2048 and 4096, where these tiles do not run without a mask: 442-450 / 440-441,
// 453-455 / 455). The flag against session 24's head, which took turns here too (session 25 call 2, the launcher's
// tiles, two rounds, head / flag): causal 512 234-236 / 239, 1024 316-317 / 322-323, 2048 379-380 / 378-383, 4096
// 410-411 / 412-415; non-causal 512 and 1024 level (371-373, 426-428).
struct FwdTileConfig64Narrow {
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 3;
  static constexpr bool kPersistent = true;
  static constexpr bool kPersistentUnmasked = false;
  static constexpr bool kDocuments = true;
  static constexpr bool kPingpong = false;  // see above
};
constexpr double kFwd64WideCostFull = 0.94;    // no causal mask or window
constexpr double kFwd64WideCostMasked = 0.95;  // causal or windowed

// kPersistentUnmasked: with the TMA-store epilogue, persistent CTAs won at every length without a mask (H200,
// 2026-12-01, session 13 runs 1-3, bf16 TFLOP/s persistent / one CTA per tile: 8192 630-642 / 626-632, 16384 639-649
// / 632-640), but not causal (16384 597 / 624, 8192 580 / 583; one run).
template <>
struct FwdTileConfig<128> {
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2;
  static constexpr bool kPersistent = true;
  static constexpr bool kPersistentUnmasked = true;
  static constexpr bool kDocuments = true;
  static constexpr bool kPingpong = true;
};

// head_dim 96 (2026-11-30, session 9): head_dim 128's shape; 144 KiB of shared memory with two Q buffers. Before, 96
// ran on the 128-wide kernel, a quarter of its GEMM work on zero columns.
template <>
struct FwdTileConfig<96> {
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2;
  static constexpr bool kPersistent = true;
  static constexpr bool kPersistentUnmasked = false;
  static constexpr bool kDocuments = true;
  static constexpr bool kPingpong = true;
};

// head_dim 192 (the DeepSeek-style 192 / 128 pair included; session 9): 128 x 112, 2 stages, 1 Q -> 217 KiB (112 is
// the largest multiple of 16 that fits, so one Q buffer and one CTA per tile); intra-warpgroup overlap since session 20
// (above). Before, 192 ran on the 256-wide kernel.
template <>
struct FwdTileConfig<192> {
  static constexpr int kBlockM = 128, kBlockN = 112, kStages = 2;
  static constexpr bool kPersistent = false;
  static constexpr bool kPersistentUnmasked = false;
  static constexpr bool kDocuments = true;
  static constexpr bool kPingpong = true;
};

// head_dim 256: kBlockN 64 rather than 80 (the widest that fits). Past what its rows see, a causal tile computes the
// diagonal's triangle (~64 keys per row) plus the padding of its last key block to a multiple of kBlockN: 0, 16, 32,
// 48 or 64 keys per row with 80-key blocks (~32 on average; 5.6 % of the computed pairs at seqlen 1024), none with 64
// when seqlen_k - seqlen_q is a multiple of 64 (128-row tiles end on a multiple of 64); the diagonal also crosses two
// mask blocks instead of two or three. A key block at head_dim 256 is long enough that the extra block boundaries
// cost little. H200, 2026-12-02 (session 22 call 3, bf16 TFLOP/s, two
// rounds, 80 / 64): causal 1024 432-434 / 448-449 (0.97 -> 1.01x cuDNN), 2048 537-539 / 545-550, 4096 596-597 /
// 606-608, 16384 714-720 / 716 (a 788 outlier); non-causal 1024 645-648 / 645-647, 4096 723-726 / 718-727, 16384
// 747-755 / 753.
template <>
struct FwdTileConfig<256> {
  static constexpr int kBlockM = 128, kBlockN = 64, kStages = 2;
  static constexpr bool kPersistent = false;
  static constexpr bool kPersistentUnmasked = false;
  static constexpr bool kDocuments = true;
  static constexpr bool kPingpong = true;
};

// Backward. kSwapSdP (head_dim <= 128): Sᵀ/dPᵀ per warpgroup of 64 keys, P and dS kept in registers for the
// dK/dV GEMMs, dS double-buffered in shared memory for dQ, dQ tiles staged in fp32 for the writer warp. Shared
// memory = (2 * kStages * kBlockM + 2 * kBlockN) * kHeadDim * 2 (Q, dO, K, V) + 2 * kBlockM * kBlockN * 2 (dS)
//   + kBlockM * kHeadDim * 4 (dQ) + 2 * kStages * kBlockM * 4 (LSE, D) bytes:
//   hdim  64: kBlockM 128 x kBlockN 128 -> 194 KiB (Sᵀ, dPᵀ 64 registers each per thread; dK + dV 64);
//   hdim 128: kBlockM  64 x kBlockN 128 -> 193 KiB (Sᵀ, dPᵀ 32 each; dK + dV 128).
// head_dim 256 (no swap): kBlockM 64 x kBlockN 64, P and dS both in shared memory, dK/dV split head_dim across the
//   warpgroups (64 keys x 128 columns of each of dK and dV per warpgroup = 128 accumulator registers per thread;
//   splitting keys would need 256). Q 2 stages (64 KiB) + dO 1 stage (32) + K, V (64) + P, dS (16) + a dQ pass
//   in fp32 (32) -> 208 KiB. dQ through shared memory and TMA reduce-add instead of per-thread float2 atomics:
//   H200, 2026-12-01 (session 14; Nsight Compute at 16384: the atomics held the L2 crossbar 80 % busy and the
//   tensor pipe at 30 %), bf16 bwd TFLOP/s before / after: 1024 239 / 313, 4096 275 / 382, 16384 290 / 396,
//   causal 4096 253 / 348 (runs 3 and 5); the second pass staged in the Q stage gave +4-8 % of that.
// Swap configurations: 2026-11-29 (session 2), replacing kBlockM 64 without swap at head_dim 64/128, which ran at
// 0.70-0.80x cuDNN (benchmarks/NOTES.md "Backward v2").
constexpr int kBwdSeqlenQRounding = 128;  // rows of the dQ accumulator / LSE / D workspaces: a multiple of kBlockM

template <int kHeadDim>
struct BwdTileConfig {
  static constexpr bool kSwapSdP = kHeadDim <= 128;
  static constexpr int kBlockM = kHeadDim <= 64 ? 128 : 64, kStages = 2;
  // dO's stages (a pipeline of its own when fewer than Q's): head_dim 256 gives one up to the dQ staging buffer.
  static constexpr int kStagesdO = kHeadDim > 128 ? 1 : kStages;
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;
  static constexpr bool kDKVSplitD = kHeadDim > 128;
  static_assert(kBwdSeqlenQRounding % kBlockM == 0);
};

// GQA backward: one CTA per (key block, K/V head) runs every query head of the group over its K/V tile, keeping dK/dV
// in registers across them and storing them once (no fp32 sums of the group's heads, their zero fill and conversion
// kernels), when the grid so formed still fills the GPU twice over; else one CTA per (key block, query head), summing
// in fp32. H200, 2026-12-01 (session 16 run 1, NOTES.md), bf16 head_dim 128, 16 heads on 4, 16k tokens, TFLOP/s sums /
// group: seqlen 1024 400-401 / 476-481, causal 278-279 / 321-322; 4096 533 / 558-562, causal 465 / 454-458.
// Below two waves the rule depends on the mask (H200, 2026-12-03/04, sessions 36 and 40, 16 query heads on 2 or 1,
// 16k tokens, bf16 TFLOP/s group / sums): with no mask the group won at 128 and 256 CTAs at head_dim 64 and 128
// (+3-17 %); under a causal-like mask (group CTAs in one longest-first order) it won at 256 CTAs at head_dim 64 only
// (+15 % at 2048, +1-5 % at 4096-8192), lost at 256 CTAs at head_dim 128 (0.87-0.95) and at 128 CTAs everywhere
// (0.58-0.73). So: no mask and head_dim <= 128 from 0.9 x SMs; causal-like at head_dim 64 from 1.9 x SMs; else 2 x SMs.
// Session 41 (the rule against each mode forced, 2 rounds, 1024-16384): without a mask +22-24 % at 1024, +5-14 % at
// 2048-4096, +2-4 % at 8192-16384; causal head_dim 64 16/2 +28 % at 1024, +5-15 % at 2048-4096, level to -2 % at
// 8192-16384 (left in: one shape, within two rounds' spread of level).
// Those causal-like measurements had the group CTAs in one global order; with the one-wave sections (session 52,
// H100) causal head_dim 128 16/2 still prefers the sums (group 225 / 296 / 374 against 265 / 384 / 460 TFLOP/s at
// 1024 / 2048 / 4096); the other thresholds were not measured again.
// Groups of 8 or more at head_dim > 128 under a causal-like mask take the sums at any grid: H100, 2026-12-06 (session
// 56, 2 rounds, 16k tokens, bf16 TFLOP/s group / sums), head_dim 256 causal 16/2 (512 CTAs) 151 / 215, 200 / 294,
// 268 / 332 at 1024 / 2048 / 4096, while 16/4 (1024 CTAs) kept the group ahead (225 / 207, 297 / 285, 333-338 /
// 300-311) and so did 16/2 without a mask (342-347 / 295-296 at 1024, 388-393 / 376-382 at 4096). With the rule
// (session 56 call 4, rule / group forced): head_dim 256 causal 16/2 213-214 / 150, 292-293 / 201, 344-348 / 268 at
// 1024 / 2048 / 4096; head_dim 192 causal 16/2 180-181 / 127, 277-278 / 222 at 1024 / 4096. Session 57 (H100, 2
// rounds, rule / group forced): head_dim 256 causal 16/2 380-384 / 286-288 at 8192, 404 / 309-319 at 16384 (dense
// 16/16 405-407, 411-415); deterministic 148 / 138 at 1024, 278-279 / 202-203 at 4096 (the sums then add dK / dV in
// head order). Not measured: groups of 8 above 512 CTAs, causal documents (kOther: they keep the older thresholds).
// Returns the query heads per CTA (1 or the group size). FAH_BWD_GQA_GROUP_CTA=1 or 0 forces either
// (tests/test_bwd_gqa_group_gpu.py runs the GQA tests under both).
enum class BwdMask { kNone, kCausalLike, kOther };
inline int bwd_heads_per_cta(int head_dim, int seqlen_k, int batch, int nheads, int nheads_k, int num_sms,
                             BwdMask mask) {
  if (nheads_k <= 0 || nheads == nheads_k || nheads % nheads_k != 0) { return 1; }
  if (char const* v = std::getenv("FAH_BWD_GQA_GROUP_CTA"); v != nullptr && (v[0] == '0' || v[0] == '1')) {
    return v[0] == '1' ? nheads / nheads_k : 1;
  }
  if (mask == BwdMask::kCausalLike && head_dim > 128 && nheads / nheads_k >= 8) { return 1; }
  int const block_n = head_dim <= 128 ? BwdTileConfig<128>::kBlockN : BwdTileConfig<256>::kBlockN;
  int64_t const ctas = int64_t((seqlen_k + block_n - 1) / block_n) * nheads_k * batch;
  int const tenths = mask == BwdMask::kNone && head_dim <= 128        ? 9
                     : mask == BwdMask::kCausalLike && head_dim <= 64 ? 19
                                                                       : 20;
  return 10 * ctas >= int64_t(tenths) * num_sms ? nheads / nheads_k : 1;
}

// Deterministic mode: copies of the dQ accumulator (BwdParams::dq_lanes). Where every key block sees every query
// block, each dQ tile's queue makes a head's last CTA wait for all the others' turns before its first sum (the CTAs of
// a head start at the same tile); two copies give two queues half as long. H200, 2026-12-02 (session 19), head_dim
// 256 non-causal deterministic bf16 TFLOP/s: a timing build with two queues over one accumulator (call 3) 4096
// 328 -> 360 (+10 %), 16384 +0.7 %, head_dim 128 4096 +2 % (less than a second copy's zero fill and read costs);
// the two copies (call 4) 4096 327 -> 350 (+6.6 %). So: the head_dim 256 kernel, no causal mask, documents or
// window that hides a key (full_rows), seqlen_k <= 8192 (a head's key blocks mostly co-resident), and the copy at
// most 1 GiB (copy_bytes: one copy's size; it grows with the query rows). The choice changes dQ's bits (another
// summation order), never its repeatability: the same call gives the same bits. FAH_BWD_DQ_LANES=1 or 2 forces
// either for that kernel (tests/test_deterministic_gpu.py).
inline int bwd_dq_lanes(int kernel_head_dim, bool deterministic, bool full_rows, int seqlen_k, int64_t copy_bytes) {
  if (!deterministic || kernel_head_dim <= 128) { return 1; }
  if (char const* v = std::getenv("FAH_BWD_DQ_LANES"); v != nullptr && (v[0] == '1' || v[0] == '2')) {
    return v[0] - '0';
  }
  return full_rows && seqlen_k <= 8192 && copy_bytes <= (int64_t(1) << 30) ? 2 : 1;
}

}  // namespace flash
