// Rows that no variable-length sequence covers: [0, cu_seqlens[0]) and [cu_seqlens[batch], rows) of a freshly
// allocated output or gradient. The attention kernels write every row inside [cu_seqlens[0], cu_seqlens[batch])
// (zeros and LSE -inf for rows that see no key, dK = dV = 0 for keys no query sees), so only these rows need a
// value; filling the whole tensor first cost 10 % of a varlen forward+backward at 16 sequences of 1024 (H200,
// 2026-11-30, scripts/varlen_gap.py). The bounds are read on the device: no host synchronisation.
#include "api/varlen_rows.hpp"

#include <algorithm>
#include <cstdint>

#include <cub/block/block_scan.cuh>

namespace {

// tensor: (outer, rows, inner) contiguous elements of `Word`; each uncovered row of each outer slice gets `value`.
// The common case (every row covered) reads two ints per block and exits.
template <class Word>
__global__ void fill_uncovered_rows_kernel(Word* __restrict__ tensor, Word value, int64_t rows, int64_t inner,
                                           int const* __restrict__ cu_seqlens, int batch) {
  int64_t const lo = min(int64_t(max(cu_seqlens[0], 0)), rows);
  int64_t const hi = max(min(int64_t(cu_seqlens[batch]), rows), lo);
  int64_t const count = (lo + rows - hi) * inner;
  Word* const slice = tensor + int64_t(blockIdx.y) * rows * inner;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < count; e += int64_t(gridDim.x) * blockDim.x) {
    int64_t const r = e / inner;
    int64_t const row = r < lo ? r : hi + (r - lo);
    slice[row * inner + e % inner] = value;
  }
}

// One block: a running maximum in chunks of blockDim.x entries (a max-scan per warp, then over the warps' totals).
__global__ void monotone_offsets_kernel(int const* __restrict__ in, int* __restrict__ out, int n, int total) {
  __shared__ int warp_max[32];
  __shared__ int carry;  // the maximum of the chunks before
  int const lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (threadIdx.x == 0) { carry = 0; }
  __syncthreads();
  for (int base = 0; base < n; base += blockDim.x) {
    int const i = base + threadIdx.x;
    int v = i < n ? min(max(in[i], 0), total) : 0;  // (0 is the identity: every value is >= 0)
    for (int o = 1; o < 32; o *= 2) {
      int const t = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) { v = max(v, t); }
    }
    if (lane == 31) { warp_max[warp] = v; }
    __syncthreads();
    if (warp == 0) {
      int w = lane < warps ? warp_max[lane] : 0;
      for (int o = 1; o < 32; o *= 2) {
        int const t = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) { w = max(w, t); }
      }
      if (lane < warps) { warp_max[lane] = w; }
    }
    __syncthreads();
    v = max(max(v, warp > 0 ? warp_max[warp - 1] : 0), carry);
    if (i < n) { out[i] = v; }
    __syncthreads();  // every thread has read carry
    if (threadIdx.x == blockDim.x - 1) { carry = v; }
    __syncthreads();
  }
}

// The running carry of a chunked block scan: cub calls it from the first warp with each chunk's total and applies
// the value it returns (lane 0's) as the chunk's prefix.
template <class Op>
struct ScanCarry {
  int carry;
  __device__ int operator()(int total) {
    int const before = carry;
    carry = Op{}(carry, total);
    return before;
  }
};
struct MaxOp {
  __device__ int operator()(int a, int b) const { return max(a, b); }
};
struct MinOp {
  __device__ int operator()(int a, int b) const { return min(a, b); }
};

// The common case first, in parallel: a row whose pairs already are their runs' bounds (every row that
// interface.document_bounds makes) is its own partition. Each position is copied and checked: a run's first
// position must start there and its last must end one past it (inside a run the pairs are equal, so that is all).
// row_bad[row] (zeroed by the caller) becomes 1 for a row that fails anywhere; only those rows are scanned below.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) doc_bounds_copy_if_partition_kernel(int const* __restrict__ in,
                                                                                int* __restrict__ out,
                                                                                int* __restrict__ row_bad,
                                                                                int64_t batch, int seqlen) {
  int64_t const i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  for (int64_t r = blockIdx.y; r < batch; r += gridDim.y) {
    bool bad = false;
    if (i < seqlen) {
      int const* const b = in + r * seqlen * 2;
      int const s = b[2 * i], e = b[2 * i + 1];
      bool const first = i == 0 || s != b[2 * i - 2] || e != b[2 * i - 1];
      bool const last = i + 1 == seqlen || s != b[2 * i + 2] || e != b[2 * i + 3];
      bad = (first && s != i) || (last && e != i + 1);
      out[r * seqlen * 2 + 2 * i] = s;
      out[r * seqlen * 2 + 2 * i + 1] = e;
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) { row_bad[r] = 1; }
  }
}

// One block per row of (batch, seqlen, 2) int32 pairs; `in` is read as ints (a caller's tensor may sit 4 bytes
// off an int2 boundary). doc_start: a max-scan of the run starts, forwards; doc_end: a min-scan of the next run's
// start, backwards. kItems consecutive positions per thread, so that a chunk is kThreads * kItems positions.
template <int kThreads, int kItems>
__global__ void __launch_bounds__(kThreads) doc_bounds_partition_kernel(int const* __restrict__ in,
                                                                        int* __restrict__ out,
                                                                        int const* __restrict__ row_bad, int seqlen) {
  if (row_bad[blockIdx.x] == 0) { return; }  // copied as it is by the kernel above
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  int64_t const row = int64_t(blockIdx.x) * seqlen * 2;
  int const* const b = in + row;
  int* const o = out + row;
  // whether a run of equal pairs starts at position i (0 < i < seqlen)
  auto starts = [&](int64_t i) { return b[2 * i] != b[2 * i - 2] || b[2 * i + 1] != b[2 * i - 1]; };
  constexpr int kChunk = kThreads * kItems;
  ScanCarry<MaxOp> start_carry{0};  // 0 is the identity: positions are >= 0
  for (int64_t base = 0; base < seqlen; base += kChunk) {
    int v[kItems];
    for (int j = 0; j < kItems; ++j) {
      int64_t const i = base + int(threadIdx.x) * kItems + j;
      v[j] = i < seqlen && (i == 0 || starts(i)) ? int(i) : 0;
    }
    Scan(temp).InclusiveScan(v, v, MaxOp{}, start_carry);
    for (int j = 0; j < kItems; ++j) {
      int64_t const i = base + int(threadIdx.x) * kItems + j;
      if (i < seqlen) { o[2 * i] = v[j]; }
    }
    __syncthreads();  // temp is reused
  }
  ScanCarry<MinOp> end_carry{seqlen};  // seqlen is the identity: every next start is <= seqlen
  for (int64_t base = 0; base < seqlen; base += kChunk) {
    int v[kItems];
    for (int j = 0; j < kItems; ++j) {
      int64_t const i = seqlen - 1 - (base + int(threadIdx.x) * kItems + j);  // walking backwards
      v[j] = i >= 0 && i + 1 < seqlen && starts(i + 1) ? int(i + 1) : seqlen;
    }
    Scan(temp).InclusiveScan(v, v, MinOp{}, end_carry);
    for (int j = 0; j < kItems; ++j) {
      int64_t const i = seqlen - 1 - (base + int(threadIdx.x) * kItems + j);
      if (i >= 0) { o[2 * i + 1] = v[j]; }
    }
    __syncthreads();
  }
}

}  // namespace

namespace flash {

cudaError_t monotone_offsets(int const* cu_seqlens, int* out, int n, int total, cudaStream_t stream) {
  if (n <= 0) { return cudaSuccess; }
  monotone_offsets_kernel<<<1, 1024, 0, stream>>>(cu_seqlens, out, n, total);
  return cudaGetLastError();
}

cudaError_t doc_bounds_partition(int const* bounds, int* out, int* row_bad, int64_t batch, int seqlen,
                                 cudaStream_t stream) {
  if (batch <= 0 || seqlen <= 0) { return cudaSuccess; }
  if (batch > INT32_MAX) { return cudaErrorInvalidValue; }
  constexpr int kCopyThreads = 256;
  dim3 const copy_grid(unsigned((int64_t(seqlen) + kCopyThreads - 1) / kCopyThreads),
                       unsigned(std::min<int64_t>(batch, 65535)));
  doc_bounds_copy_if_partition_kernel<kCopyThreads><<<copy_grid, kCopyThreads, 0, stream>>>(bounds, out, row_bad,
                                                                                            batch, seqlen);
  doc_bounds_partition_kernel<256, 4><<<unsigned(batch), 256, 0, stream>>>(bounds, out, row_bad, seqlen);
  return cudaGetLastError();
}

cudaError_t fill_uncovered_rows(void* tensor, int word_bytes, uint32_t value_bits, int64_t outer, int64_t rows,
                                int64_t inner, int const* cu_seqlens, int batch, cudaStream_t stream) {
  if (outer <= 0 || rows <= 0 || inner <= 0) { return cudaSuccess; }
  if (outer > 65535 || batch < 0) { return cudaErrorInvalidValue; }
  // Enough blocks to stream a large uncovered range at full bandwidth; most calls find nothing to write.
  dim3 const grid(unsigned(outer >= 264 ? 1 : 264 / outer), unsigned(outer));
  constexpr int kThreads = 256;
  if (word_bytes == 2) {
    fill_uncovered_rows_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(
        static_cast<uint16_t*>(tensor), uint16_t(value_bits), rows, inner, cu_seqlens, batch);
  } else if (word_bytes == 4) {
    fill_uncovered_rows_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(
        static_cast<uint32_t*>(tensor), value_bits, rows, inner, cu_seqlens, batch);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace flash
