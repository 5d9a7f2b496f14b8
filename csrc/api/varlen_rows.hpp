// Host entry of csrc/api/varlen_rows.cu (compiled by nvcc, called from flash_api.cpp).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace flash {

// Writes value_bits (a 2- or 4-byte word: 0 for zeros, 0xff800000 for float -inf) into the rows of a contiguous
// (outer, rows, inner) tensor that lie before cu_seqlens[0] or at/after cu_seqlens[batch] (int32, on the device).
cudaError_t fill_uncovered_rows(void* tensor, int word_bytes, uint32_t value_bits, int64_t outer, int64_t rows,
                                int64_t inner, int const* cu_seqlens, int batch, cudaStream_t stream);

// out[i] = the largest of cu_seqlens[0..i], each clamped to [0, total] (n entries, int32, on the device): offsets that
// are already non-negative, non-decreasing and within total come back unchanged.
cudaError_t monotone_offsets(int const* cu_seqlens, int* out, int n, int total, cudaStream_t stream);

// The runs of equal consecutive [doc_start, doc_end] pairs of each row of a contiguous int32 (batch, seqlen, 2) tensor,
// written to out (same shape, contiguous, on the device): flash_api.cpp doc_bounds_partition on CUDA tensors.
// row_bad: batch zeroed ints of workspace (rows that are not already their own partition get 1 and are scanned).
cudaError_t doc_bounds_partition(int const* bounds, int* out, int* row_bad, int64_t batch, int seqlen,
                                 cudaStream_t stream);

}  // namespace flash
