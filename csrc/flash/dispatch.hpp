// Entry points of the compiled kernel instantiations, one per (head_dim, dtype); defined in csrc/instantiations/.
#pragma once

#include <cuda_runtime.h>

#include "flash/params.hpp"

namespace flash {

#define FLASH_DECLARE(HDIM, DTYPE_NAME)                                                             \
  cudaError_t run_fwd_hdim##HDIM##_##DTYPE_NAME(FwdParams const& p, cudaStream_t stream); \
  cudaError_t run_bwd_hdim##HDIM##_##DTYPE_NAME(BwdParams const& p, cudaStream_t stream);

FLASH_DECLARE(64, fp16)
FLASH_DECLARE(64, bf16)
FLASH_DECLARE(128, fp16)
FLASH_DECLARE(128, bf16)
FLASH_DECLARE(256, fp16)
FLASH_DECLARE(256, bf16)

// Forward-only tile widths (the backward runs these head dims on 128 and 256).
#define FLASH_DECLARE_FWD(HDIM, DTYPE_NAME) \
  cudaError_t run_fwd_hdim##HDIM##_##DTYPE_NAME(FwdParams const& p, cudaStream_t stream);

FLASH_DECLARE_FWD(96, fp16)
FLASH_DECLARE_FWD(96, bf16)
FLASH_DECLARE_FWD(192, fp16)
FLASH_DECLARE_FWD(192, bf16)

#undef FLASH_DECLARE
#undef FLASH_DECLARE_FWD

}  // namespace flash
