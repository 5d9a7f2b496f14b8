// Named forward tile configurations per head dim.
//
// Shared memory per CTA = (kBlockM + 2 * kStages * kBlockN) * kHeadDim * 2 bytes (Q once, K and V staged),
// within the 227 KiB a CTA may take of the H200's 228 KiB per SM:
//   hdim  64: 128 x 128, 2 stages ->  80 KiB
//   hdim 128: 128 x 128, 2 stages -> 160 KiB
//   hdim 256: 128 x  80, 2 stages -> 224 KiB (kBlockN 80 is the largest multiple of 16 that fits)
// Two consumer warpgroups of 64 query rows each (kBlockM = 128). First configuration (2026-11-29): chosen to fit,
// not yet tuned by measurement.
#pragma once

namespace flash {

template <int kHeadDim>
struct FwdTileConfig;

template <>
struct FwdTileConfig<64> {
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2;
};

template <>
struct FwdTileConfig<128> {
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2;
};

template <>
struct FwdTileConfig<256> {
  static constexpr int kBlockM = 128, kBlockN = 80, kStages = 2;
};

}  // namespace flash
