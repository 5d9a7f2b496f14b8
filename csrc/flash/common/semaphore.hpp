// Ordering of the backward's cross-CTA sums for deterministic mode: a zeroed int32 per output tile counts the CTAs
// that have added into it; CTA number t (in a fixed order) waits for the count t, adds, and increments it.
// CTAs that wait only on lower-numbered CTAs of the same grid never deadlock: those were launched first (x fastest).
#pragma once

#include <cutlass/cutlass.h>

namespace flash {

// Raw PTX: CuTe/CUTLASS have no acquire-load spin or release-increment on a global int for these semantics.
CUTLASS_DEVICE void semaphore_wait(int const* sem, int target) {
  int value;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(sem) : "memory");
  } while (value != target);
}

// The same, then ordered before this thread's next bulk (TMA) operations.
CUTLASS_DEVICE void semaphore_wait_for_bulk(int const* sem, int target) {
  semaphore_wait(sem, target);
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

CUTLASS_DEVICE void semaphore_release(int* sem) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(sem) : "memory");
}

// After bulk (TMA) reductions into global memory: wait until they are performed, not just read from shared memory
// (CuTe's tma_store_wait waits for the reads only), and order them before the semaphore release for the other CTAs'
// bulk operations (async proxy).
CUTLASS_DEVICE void bulk_reductions_complete() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

}  // namespace flash
