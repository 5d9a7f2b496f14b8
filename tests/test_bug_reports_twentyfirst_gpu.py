"""Twenty-first round of the bug hunt (tests/bug_report_sources.md, "Twenty-first round"), GPU part.

ET: results returned as views of padded buffers (Dao-AILab/flash-attention#1347: the head-dim padding of
FlashAttention 2 moved to Python, whose interface returns `out_padded[..., :head_size_og]`, a non-contiguous slice that
keeps the padding; vllm-project/vllm-gaudi#505: `.view` of such a sliced attention output failed). Here head dims off
the kernel sizes run on a wider kernel (40 and 72 on the 64 and 96 / 128 kernels, the backward's 96 and 192 on 128 and
256): out, LSE, dq, dk, dv of the real ops must be contiguous, own exactly their storage (no padded columns or rows kept)
and be right by the rule.
The CPU part (tests/test_bug_reports_twentyfirst_cpu.py) covers EQ, ER and ES (flash_attn_hopper.testing) and what the
Python layer pads for attention_varlen.

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build lacks
the head_dim / dtype."""

import pytest
import torch

from flash_attn_hopper import attention_varlen
from gpu_helpers import (attention_inputs, check_attention, check_attention_varlen, cu_seqlens, randn, require_built,
                         run_attention)

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]


def _owns_exactly_its_storage(t):
    """Contiguous, at offset 0 of a storage of exactly its own bytes, and flattenable by .view (what a slice of a
    padded buffer is not)."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            and t.view(t.shape[0], -1).shape == (t.shape[0], t.numel() // max(t.shape[0], 1)))


@pytest.mark.parametrize("head_dims", [(40, 40), (40, 72), (72, 40), (192, 128)],
                         ids=["40", "40_v72", "72_v40", "192_v128"])
def test_dense_results_own_exactly_their_storage(head_dims):
    """ET: attention's out, LSE, dq, dk, dv (GQA 6/2, causal, 203 x 141, head dims run on wider kernels, head_dim_v
    above and below head_dim): contiguous, each owning exactly its storage, `.view(batch, -1)` works; right by the
    rule."""
    head_dim, head_dim_v = head_dims
    require_built(max(head_dim, head_dim_v), torch.bfloat16)
    q, k, v, dout = attention_inputs(2, 203, 141, 6, 2, head_dim, torch.bfloat16, head_dim_v=head_dim_v)
    out, lse, grads = run_attention(q, k, v, dout, causal=True)
    for name, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        if not _owns_exactly_its_storage(t):
            raise AssertionError(f"{head_dims} {name}: stride {t.stride()}, offset {t.storage_offset()}, storage "
                                 f"{t.untyped_storage().nbytes()} bytes for {t.numel()} elements")
    check_attention(out, lse, grads, q, k, v, dout, f"storage {head_dims}", causal=True)


@pytest.mark.parametrize("rows", ["no_tail", "rows_past_the_last_sequence"])
def test_varlen_results_own_exactly_their_storage(rows):
    """ET: attention_varlen's out, LSE, dq, dk, dv at head_dim 40 / head_dim_v 72 (lengths (77, 0, 130, 5) /
    (9, 33, 200, 0), GQA 4/2, causal), with and without 19 query rows past the last sequence (the Python layer's
    padding): contiguous, each owning exactly its storage; right by the rule."""
    require_built(72, torch.bfloat16)
    lq, lk = [77, 0, 130, 5], [9, 33, 200, 0]
    tail = 19 if rows == "rows_past_the_last_sequence" else 0
    q = randn(sum(lq) + tail, 4, 40, dtype=torch.bfloat16)
    k = randn(sum(lk), 2, 40, dtype=torch.bfloat16)
    v = randn(sum(lk), 2, 72, dtype=torch.bfloat16)
    dout = randn(sum(lq) + tail, 4, 72, dtype=torch.bfloat16)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, lse = attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)
    grads = torch.autograd.grad(out, leaves, dout)
    for name, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        if not _owns_exactly_its_storage(t):
            raise AssertionError(f"{rows} {name}: stride {t.stride()}, offset {t.storage_offset()}, storage "
                                 f"{t.untyped_storage().nbytes()} bytes for {t.numel()} elements")
    check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, dout, cu_q, cu_k, f"storage varlen {rows}",
                           causal=True)
