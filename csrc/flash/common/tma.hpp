// Host helpers for building TMA descriptors from caller strides.
#pragma once

#include <cstdint>

namespace flash {

// TMA wants every non-unit-extent stride a nonzero multiple of 16 bytes; a size-1 mode's stride is never used, so
// give it a harmless legal value instead of whatever the caller's view carried.
inline int64_t tma_stride(int64_t stride, int64_t extent, int64_t elems_per_16b) {
  return extent == 1 ? elems_per_16b : stride;
}

}  // namespace flash
