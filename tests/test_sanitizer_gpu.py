"""compute-sanitizer racecheck (shared-memory hazards) and synccheck (barrier misuse) over the kernels on an sm90 GPU
(tests/bug_report_sources.md, eleventh round, class CC; memcheck runs in test_head_dims_gpu.py and friends).

The workload is sized so that every pipeline wraps: 700 keys are four or more key blocks at every tile width, so each
K/V stage is refilled while the other is read; 48 query heads of 520 rows are more forward tiles than the H200 has
SMs, so a persistent CTA runs a second tile on buffers its first one used; GQA 4 and both masks, forward and
backward in both deterministic modes, then a two-sequence varlen batch. One test per head dim keeps each run under
the GPU check's per-test time guard. Skipped, with the reason, without an sm90 GPU, the built extension or
compute-sanitizer."""

import pytest
import torch

from gpu_helpers import require_built, run_sanitizer

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]


def _script(head_dim, dtype):
    return f"""
import torch
from flash_attn_hopper import attention, attention_varlen
torch.manual_seed(0)
dtype = torch.{dtype}
q = torch.randn(1, 520, 48, {head_dim}, device="cuda", dtype=dtype, requires_grad=True)
k = torch.randn(1, 700, 12, {head_dim}, device="cuda", dtype=dtype, requires_grad=True)
v = torch.randn(1, 700, 12, {head_dim}, device="cuda", dtype=dtype, requires_grad=True)
for causal in (False, True):
    for deterministic in (False, True):
        out, lse = attention(q, k, v, causal=causal, deterministic=deterministic, return_lse=True)
        ((out * torch.randn_like(out)).sum() + lse.sum()).backward()
cu_q = torch.tensor([0, 300, 520], dtype=torch.int32, device="cuda")
cu_k = torch.tensor([0, 450, 700], dtype=torch.int32, device="cuda")
qv, kv, vv = (t.detach()[0].clone().requires_grad_(True) for t in (q, k, v))
out = attention_varlen(qv, kv, vv, cu_q, cu_k, 300, 450, causal=True)
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print("done")
"""


CASES = [(64, "bfloat16"), (128, "float16"), (256, "bfloat16")]


@pytest.mark.parametrize("head_dim,dtype", CASES, ids=[f"d{d}-{t}" for d, t in CASES])
def test_racecheck_reports_no_shared_memory_hazard(head_dim, dtype):
    """racecheck with every report level (errors and warnings) finds no shared-memory hazard between the producer's
    TMA loads, the consumers' WGMMA reads, the softmax's and epilogue's shared-memory traffic and the barriers that
    order them."""
    require_built(head_dim, getattr(torch, dtype))
    run_sanitizer(_script(head_dim, dtype), "racecheck")


@pytest.mark.parametrize("head_dim,dtype", CASES, ids=[f"d{d}-{t}" for d, t in CASES])
def test_synccheck_reports_no_barrier_misuse(head_dim, dtype):
    """synccheck finds no invalid or divergent use of the block's and the named barriers (ping-pong hand-over, the
    producer / consumer split, the epilogue's barrier)."""
    require_built(head_dim, getattr(torch, dtype))
    run_sanitizer(_script(head_dim, dtype), "synccheck")
