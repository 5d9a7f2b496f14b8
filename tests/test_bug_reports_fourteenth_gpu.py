"""Fourteenth round of the bug hunt (tests/bug_report_sources.md, "Fourteenth round"), GPU part.

DG: the transformers integration's mask recognition under a CUDA default device (``torch.set_default_device("cuda")``):
the index tensors it evaluates a model's mask function on were made on the default device, so each recognition ran
small GPU kernels and synchronised the host (``bool(torch.equal(...))``), which fails under
``torch.cuda.set_sync_debug_mode("error")`` and inside a CUDA graph capture. tests/test_bug_reports_fourteenth_cpu.py
shows the fault on the CPU with a meta default device; here the real CUDA default.

DH: q, k, v, dO and cu_seqlens with PyTorch's lazy negative bit (the memory holds the negation of the values): the real
kernels read memory, so the ops must get the tensors resolved (the dispatcher's Negative fallback); out, LSE, dQ, dK,
dV bitwise those of the same values without the bit (deterministic backward), and right by the rule.

DI: the backward over partial tiles (query rows past seqlen_q, keys past seqlen_k in the last tiles, which TMA fills
with zeros) when every real score of a row is far below 0. A zero-filled key or row scores exactly 0; the backward
recomputes P = exp(S - LSE), and with LSE near -1024 an unmasked zero score gives exp(+1024) = inf, which 0 * inf
turns into NaN in dQ, dK or dV (flashinfer-ai/flashinfer#5090: zero-filled keys past seqlen_k scored 0 and took
softmax weight; class S covers the forward of rows whose scores all lie far below 0, not the backward).

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build lacks
the head_dim / dtype."""

import pytest
import torch

import flash_attn_hopper
from gpu_helpers import (attention_inputs, bits, built_dtype, check_attention, check_attention_varlen, cu_seqlens,
                         randn, run_attention)

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]


# ------------------------------------------------------------------------------ DG

def test_mask_recognition_under_a_cuda_default_device():
    """DG: with the default device set to CUDA, flash_attn_hopper_mask recognises a sliding-window causal mask, a
    bidirectional band and a bidirectional overlay (None: the kernel masks) without synchronising the host (sync debug
    mode "error") and inside a CUDA graph capture, whose replay still runs."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
    from transformers.masking_utils import (bidirectional_mask_function, causal_mask_function, or_masks,
                                            sliding_window_bidirectional_mask_function,
                                            sliding_window_causal_mask_function)

    import flash_attn_hopper.integrations.transformers as fah_tf

    fah_tf.register()
    common = dict(batch_size=1, q_length=16, kv_length=16, allow_is_causal_skip=True, dtype=torch.bfloat16)
    cases = [dict(mask_function=sliding_window_causal_mask_function(5), local_size=5),
             dict(mask_function=sliding_window_bidirectional_mask_function(4), local_size=4),
             dict(mask_function=or_masks(causal_mask_function, bidirectional_mask_function))]
    static = torch.zeros(8, device="cuda")
    torch.cuda.synchronize()
    torch.set_default_device("cuda")
    try:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for kwargs in cases:
                assert fah_tf.flash_attn_hopper_mask(**kwargs, **common) is None
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for kwargs in cases:
                assert fah_tf.flash_attn_hopper_mask(**kwargs, **common) is None
            static.add_(1.0)
    finally:
        torch.set_default_device(None)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, torch.ones(8, device="cuda")), "the captured graph did not run as captured"


# ------------------------------------------------------------------------------ DH

def _neg_view(t):
    view = torch._neg_view(-t)
    assert view.is_neg() and torch.equal(view, t)
    return view


def test_negative_bit_views_dense():
    """DH, dense: GQA 6/2 causal with a softcap, 203 x 141 rows, head_dim 128."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    q, k, v, dout = attention_inputs(2, 141, 203, 6, 2, head_dim, dtype)
    opts = dict(causal=True, softcap=30.0)
    plain = run_attention(q, k, v, dout, deterministic=True, **opts)
    neg = run_attention(_neg_view(q), _neg_view(k), _neg_view(v), _neg_view(dout), deterministic=True, **opts)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (plain[0], plain[1], *plain[2]), (neg[0], neg[1], *neg[2])):
        assert torch.equal(bits(a), bits(b)), f"{name} differs for negative-bit views of the same values"
    check_attention(neg[0], neg[1], neg[2], q, k, v, dout, "negative-bit views", **opts)


def test_negative_bit_views_varlen():
    """DH, varlen: lengths (0, 77, 130, 5) on the query side and (9, 0, 200, 5) on the key side, GQA 4/2, a causal
    window (50, 0); q, k, v, dO, cu_seqlens_q and cu_seqlens_k as negative-bit views."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    lq, lk = [0, 77, 130, 5], [9, 0, 200, 5]
    q, dout = randn(sum(lq), 4, head_dim, dtype=dtype), randn(sum(lq), 4, head_dim, dtype=dtype)
    k, v = randn(sum(lk), 2, head_dim, dtype=dtype), randn(sum(lk), 2, head_dim, dtype=dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    opts = dict(causal=True, window_size=(50, 0))

    def run(q, k, v, dout, cu_q, cu_k):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out, lse = flash_attn_hopper.attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), return_lse=True,
                                                      deterministic=True, **opts)
        return out.detach(), lse.detach(), torch.autograd.grad(out, leaves, dout)

    plain = run(q, k, v, dout, cu_q, cu_k)
    neg = run(_neg_view(q), _neg_view(k), _neg_view(v), _neg_view(dout), _neg_view(cu_q), _neg_view(cu_k))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (plain[0], plain[1], *plain[2]), (neg[0], neg[1], *neg[2])):
        assert torch.equal(bits(a), bits(b)), f"varlen {name} differs for negative-bit views"
    check_attention_varlen(neg[0], neg[1], neg[2], q, k, v, dout, cu_q, cu_k, "negative-bit views", **opts)


# ------------------------------------------------------------------------------ DI

@pytest.mark.parametrize("shape", ["full_203x141", "causal_141x203"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_backward_over_partial_tiles_with_every_score_far_below_zero(head_dim, shape):
    """DI: every raw score is -64, -64.5, -65 or -65.5 (exact in fp16 and bf16: q's first column 1, k's first column
    the score, k's other columns 0; q's other columns random), softmax_scale 16, so the scaled scores lie in
    [-1048, -1024] and LSE near -1020, while seqlen_q and seqlen_k are off every tile height (203 and 141). A key or
    query row past the ends (zero-filled) scores 0, and exp(0 - LSE) overflows to inf: the backward must mask it.
    GQA 6/2; out, LSE, dQ, dK, dV finite and by the rule."""
    dtype = built_dtype(head_dim)
    seqlen_q, seqlen_k = (203, 141) if shape.startswith("full") else (141, 203)
    causal = shape.startswith("causal")
    q, k, v, dout = attention_inputs(2, seqlen_q, seqlen_k, 6, 2, head_dim, dtype)
    q[..., 0] = 1.0
    k.zero_()
    steps = torch.randint(0, 4, (2, seqlen_k, 2), device="cuda").to(dtype)
    k[..., 0] = -64.0 - 0.5 * steps
    scale = 16.0
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(3, dim=2)) * scale
    assert scores.max().item() <= -1024.0 and scores.min().item() >= -1048.0, "the construction's scores"
    opts = dict(softmax_scale=scale, causal=causal)
    out, lse, grads = run_attention(q, k, v, dout, **opts)
    for name, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        assert torch.isfinite(t).all(), f"{shape} head_dim {head_dim}: {name} is not finite"
    assert lse.max().item() < -1000.0, "LSE must lie far below 0 for the construction to test anything"
    check_attention(out, lse, grads, q, k, v, dout, f"{shape} head_dim {head_dim}", **opts)
