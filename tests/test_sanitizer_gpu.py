"""compute-sanitizer racecheck (shared-memory hazards) and synccheck (barrier misuse) over the kernels on an sm90 GPU
(tests/bug_report_sources.md, eleventh round, class CC; memcheck runs in test_head_dims_gpu.py and friends).

The workload is sized so that every pipeline wraps: 700 keys are four or more key blocks at every tile width, so each
K/V stage is refilled while another is read; 48 query heads of 520 rows are more forward tiles than the H200 has
SMs, so a persistent forward CTA (head_dim 64, 96, 128) runs a second tile on buffers its first one used; GQA 4 and
both masks, forward and backward in both deterministic modes, then a two-sequence varlen batch. Each head dim runs
with the launch choices this shape gets (head_dim 64: 192-row forward tiles; the GQA backward: fp32 sums over the
group) and, where another kernel exists, forced the other way (FAH_FWD_BLOCK_M=128: head_dim 64's 128-row tiles, 3
stages, no ping-pong; FAH_BWD_GQA_GROUP_CTA=1: one backward CTA per K/V head group). racecheck sees shared-memory
accesses made by threads (the softmax's and epilogue's traffic, the LSE / D bulk copies read by the consumers); TMA
and WGMMA operand traffic is not attributed to threads, so it is outside what it can check. One test per case keeps
each run under the GPU check's per-test time guard. Skipped, with the reason, without an sm90 GPU, the built
extension or compute-sanitizer."""

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


_OTHER_TILES = {"FAH_FWD_BLOCK_M": "128", "FAH_BWD_GQA_GROUP_CTA": "1"}
_GROUP_CTA = {"FAH_BWD_GQA_GROUP_CTA": "1"}
CASES = [(64, "bfloat16", {}), (64, "float16", _OTHER_TILES), (96, "float16", {}), (128, "float16", {}),
         (128, "bfloat16", _GROUP_CTA), (192, "bfloat16", {}), (256, "bfloat16", {}), (256, "float16", _GROUP_CTA)]
IDS = [f"d{d}-{t}" + "".join(f"-{k[4:].lower()}{v}" for k, v in env.items()) for d, t, env in CASES]


@pytest.mark.parametrize("head_dim,dtype,env", CASES, ids=IDS)
def test_racecheck_reports_no_shared_memory_hazard(head_dim, dtype, env):
    """racecheck finds no shared-memory hazard (error or warning) among the threads' accesses: the softmax's and
    epilogue's staging, the backward's LSE / D and dQ buffers, ordered by the pipelines' barriers."""
    require_built(head_dim, getattr(torch, dtype))
    run_sanitizer(_script(head_dim, dtype), "racecheck", env)


@pytest.mark.parametrize("head_dim,dtype,env", CASES, ids=IDS)
def test_synccheck_reports_no_barrier_misuse(head_dim, dtype, env):
    """synccheck finds no invalid or divergent use of the block's and the named barriers (ping-pong hand-over, the
    producer / consumer split, the epilogue's barrier)."""
    require_built(head_dim, getattr(torch, dtype))
    run_sanitizer(_script(head_dim, dtype), "synccheck", env)
