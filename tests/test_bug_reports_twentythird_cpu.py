"""Twenty-third round of the bug hunt (tests/bug_report_sources.md, "Twenty-third round"), CPU part: the constructions
of tests/test_bug_reports_twentythird_gpu.py run through the CPU stand-ins of the ops (tests/cpu_stand_ins.py), so that
they are known to do what they say before a GPU runs them.

EZ: the long-context inputs (near-uniform attention over 40,003 keys whose values are of one sign, far from zero) put
the unnormalised accumulator Σ P̃ V far past fp16's range while out stays inside the dtype's; a kernel right by DESIGN.md
§1 (the stand-ins: float32 throughout, P recomputed from the saved LSE, D from the saved out) passes the rule forward and
backward, and one whose O accumulator is kept in the input dtype (as ggml-org/llama.cpp#13975's Metal kernels kept it in
F16) fails it, in both dtypes.
FB: every (head_dim, head_dim_v) pair of the GPU test passes the Python layer's checks and the rule through the
stand-ins, dense and varlen (the pairs are ones the library takes).
FA needs ~25 GiB of device memory at its peak; its construction is only on the GPU.
"""

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref

from cpu_stand_ins import ops_on_cpu, stand_ins
from gpu_helpers import check_attention, check_attention_varlen
from test_bug_reports_gpu import _leaves
from test_bug_reports_twentythird_gpu import (V_WIDTH_PAIRS, assert_accumulator_far_past_fp16, check_long_context,
                                              long_context_inputs)

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
# batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim: the GPU test's keys and head_dim, fewer query rows and heads
# (the construction is per row; the CPU's naive fp16 / bf16 references are slow)
LONG = (1, 9, 40_003, 2, 1, 128)


def _run(q, k, v, dout, **opts):
    """gpu_helpers.run_attention without its CUDA allocator poisoning (the stand-ins run on the CPU)."""
    leaves = _leaves(q, k, v)
    out, lse = attention(*leaves, return_lse=True, **opts)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), lse.detach(), grads


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_long_context_construction_passes_a_right_kernel(monkeypatch, dtype, causal):
    """EZ's inputs (the GPU test's keys, 9 query rows): the construction's own assertion holds (spread attention,
    accumulator past 8 x 65504, out inside the dtype's range), and the stand-ins meet the GPU test's checks (out, dQ,
    dK, dV finite; out, LSE, dV by the rule)."""
    torch.manual_seed(23)
    q, k, v, dout = long_context_inputs(dtype, *LONG, device="cpu")
    assert_accumulator_far_past_fp16(q, k, v, "construction", causal=causal)
    with stand_ins(monkeypatch):
        out, lse, grads = _run(q, k, v, dout, causal=causal)
    check_long_context(out, lse, grads, q, k, v, dout, f"stand-in {dtype} causal={causal}", causal=causal)


def _narrow_accumulator_fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic,
                            doc_bounds=None):
    """A faulty forward: the online softmax over key blocks of 128 with the running max and sum in float32 but O's
    unnormalised accumulator (and its rescale) in the input dtype, divided by the row sum at the end."""
    dtype = q.dtype
    qf = q.float().permute(0, 2, 1, 3)  # (b, h, sq, d)
    group = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    vf = v.float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    sq, sk = q.shape[1], k.shape[1]
    m = torch.full(qf.shape[:-1], float("-inf"))
    ell = torch.zeros(qf.shape[:-1])
    acc = torch.zeros(*qf.shape[:-1], v.shape[-1], dtype=dtype)
    rows = torch.arange(sq).unsqueeze(1)
    for j0 in range(0, sk, 128):
        s = torch.einsum("bhqd,bhkd->bhqk", qf, kf[:, :, j0:j0 + 128]) * softmax_scale
        if causal:
            cols = torch.arange(j0, min(j0 + 128, sk)).unsqueeze(0)
            s = s.masked_fill(cols > rows + sk - sq, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
        p = torch.exp(s - safe.unsqueeze(-1))
        alpha = torch.exp(m - safe)
        ell = ell * alpha + p.sum(-1)
        acc = (acc.float() * alpha.unsqueeze(-1)).to(dtype) + torch.einsum(
            "bhqk,bhkd->bhqd", p.to(dtype).float(), vf[:, :, j0:j0 + 128]).to(dtype)
        m = m_new
    out = (acc.float() / ell.unsqueeze(-1)).to(dtype).permute(0, 2, 1, 3).contiguous()
    return out, (m + torch.log(ell)).contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_long_context_construction_fails_a_narrow_accumulator(monkeypatch, dtype):
    """EZ's construction catches the fault it is for: with O accumulated in the input dtype (fp16: inf past 65504;
    bf16: addends lost against a sum of ~2^15 times their size), out fails the rule."""
    torch.manual_seed(23)
    q, k, v, _ = long_context_inputs(dtype, *LONG, device="cpu")
    with ops_on_cpu(monkeypatch, {"fwd": _narrow_accumulator_fwd}, "its op schemas"):
        out = attention(q, k, v)
    ref, _ = attention_ref(q, k, v)
    naive, _ = attention_ref(q, k, v, upcast=False)
    with pytest.raises(AssertionError):
        assert_close_by_rule(out, ref, naive, f"narrow accumulator {dtype}")


def test_long_context_varlen_construction_passes_a_right_kernel(monkeypatch):
    """EZ's varlen case (two sequences against 40,003 / 30,001 keys, fp16, causal; 9 and 5 query rows here, 77 and 50 on
    the GPU): each sequence's construction holds, and the stand-ins meet the GPU test's checks."""
    torch.manual_seed(24)
    lq, lk = [9, 5], [40_003, 30_001]
    parts = [long_context_inputs(torch.float16, 1, sq, sk, 2, 1, 128, device="cpu") for sq, sk in zip(lq, lk)]
    for i, (q, k, v, _) in enumerate(parts):
        assert_accumulator_far_past_fp16(q, k, v, f"sequence {i}", causal=True)
    q, k, v, dout = (torch.cat([p[j][0] for p in parts]) for j in range(4))
    cu_q = torch.tensor([0, 9, 14], dtype=torch.int32)
    cu_k = torch.tensor([0, 40_003, 70_004], dtype=torch.int32)
    with stand_ins(monkeypatch):
        leaves = _leaves(q, k, v)
        out, lse = attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)
        grads = torch.autograd.grad(out, leaves, dout)
    check_long_context(out.detach(), lse.detach(), grads, q, k, v, dout, "stand-in varlen", cu_q, cu_k, causal=True)


@pytest.mark.parametrize("head_dim,head_dim_v", V_WIDTH_PAIRS, ids=[f"{d}-{dv}" for d, dv in V_WIDTH_PAIRS])
def test_head_dim_v_widths_pass_the_checks_and_the_stand_ins(monkeypatch, head_dim, head_dim_v):
    """FB's pairs: attention and attention_varlen take them (no refusal), and the stand-ins meet the rule, dense (GQA
    6/2, causal, 203 x 141) and varlen (lengths (1, 30, 0, 17) / (5, 41, 9, 0), GQA 4/2, causal), bf16."""
    torch.manual_seed(head_dim * 1000 + head_dim_v)
    dtype = torch.bfloat16
    q = torch.randn(2, 203, 6, head_dim, dtype=dtype)
    k = torch.randn(2, 141, 2, head_dim, dtype=dtype)
    v = torch.randn(2, 141, 2, head_dim_v, dtype=dtype)
    dout = torch.randn(2, 203, 6, head_dim_v, dtype=dtype)
    lq, lk = [1, 30, 0, 17], [5, 41, 9, 0]
    vq = torch.randn(sum(lq), 4, head_dim, dtype=dtype)
    vk = torch.randn(sum(lk), 2, head_dim, dtype=dtype)
    vv = torch.randn(sum(lk), 2, head_dim_v, dtype=dtype)
    vdout = torch.randn(sum(lq), 4, head_dim_v, dtype=dtype)
    cu_q = torch.tensor([0, 1, 31, 31, 48], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 46, 55, 55], dtype=torch.int32)
    with stand_ins(monkeypatch):
        out, lse, grads = _run(q, k, v, dout, causal=True)
        leaves = _leaves(vq, vk, vv)
        vout, vlse = attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)
        vgrads = torch.autograd.grad(vout, leaves, vdout)
    name = f"{head_dim}/{head_dim_v}"
    check_attention(out, lse, grads, q, k, v, dout, name, causal=True)
    check_attention_varlen(vout.detach(), vlse.detach(), vgrads, vq, vk, vv, vdout, cu_q, cu_k, f"{name} varlen",
                           causal=True)
