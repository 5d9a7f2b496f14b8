"""Helpers shared by the GPU test modules (test_fwd_gpu.py, test_bwd_gpu.py): what this build compiles, random CUDA
inputs, and a NaN-poisoned caching allocator so that memory a kernel never writes shows up as NaN."""

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper.interface import kernel_head_dim

DTYPES = [torch.float16, torch.bfloat16]


def require_built(head_dim, dtype):
    """Skip unless this build compiles (head_dim, dtype); a head_dim between the kernel sizes needs the kernel that
    runs it (interface.kernel_head_dim)."""
    cfg = flash_attn_hopper.build_config()
    if kernel_head_dim(head_dim) not in cfg["head_dims"] or dtype not in cfg["dtypes"]:
        pytest.skip(f"head_dim {head_dim} / {dtype} not in this build (FAH_HDIMS/FAH_DTYPES)")


def built_dtype(head_dim):
    """A dtype this build compiles for head_dim (fp16 preferred), else skip."""
    cfg = flash_attn_hopper.build_config()
    for dtype in DTYPES:
        if kernel_head_dim(head_dim) in cfg["head_dims"] and dtype in cfg["dtypes"]:
            return dtype
    pytest.skip(f"head_dim {head_dim} not in this build (FAH_HDIMS/FAH_DTYPES)")


def poison_allocator(*nbytes):
    """Fill the CUDA caching allocator with NaN: allocate blocks of these sizes on the current stream, fill them
    with 0xFF bytes (NaN in fp16, bf16 and fp32) and free them, so the next allocations of these sizes on this
    stream (a kernel's fresh outputs and workspaces) reuse NaN-filled memory. Synchronizes the device (empty_cache)."""
    torch.cuda.empty_cache()  # drop other cached blocks, so the poisoned ones are the best fit
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda") for n in nbytes if n > 0]
    del blocks


def randn(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, device="cuda")
