"""Fifteenth round of the bug hunt (tests/bug_report_sources.md, "Fifteenth round"), GPU part.

DJ: dO or dLSE given as an efficient zero tensor (``torch._efficientzerotensor``: no storage). The kernels read memory,
so the ops must get them materialised (the dispatcher's ZeroTensor fallback); the gradients must be bitwise those of
real zeros (deterministic backward) and right by the rule.

DK: q, k, v unbound from one fused projection (views of a non-leaf) and the returned out and LSE, with retain_grad():
the retained gradients are bitwise what torch.autograd.grad gives (deterministic backward), dense and varlen with rows
past the last sequence (attention_varlen pads out and LSE there).

DL: a loss of the LSE alone inside torch.utils.checkpoint (reentrant and not): dO reaches the backward as zeros and
dLSE as a float32 tensor; the gradients are bitwise those of the call without checkpointing and right by the rule.

tests/test_bug_reports_fifteenth_cpu.py checks the same paths through the CPU stand-ins (and DM, which needs no GPU).
Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build lacks
the head_dim / dtype."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import flash_attn_hopper
from gpu_helpers import (attention_inputs, built_dtype, check_attention, check_attention_varlen, cu_seqlens,
                         poison_attention_memory, randn)

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

HEAD_DIM = 64


def _varlen_inputs(lq, lk, tail, dtype):
    """q with `tail` rows past the last sequence, k, v, dout on the GPU; 4 query heads, 2 KV heads."""
    q = randn(sum(lq) + tail, 4, HEAD_DIM, dtype=dtype)
    k = randn(sum(lk), 2, HEAD_DIM, dtype=dtype)
    v = randn(sum(lk), 2, HEAD_DIM, dtype=dtype)
    dout = randn(sum(lq) + tail, 4, HEAD_DIM, dtype=dtype)
    return q, k, v, dout, cu_seqlens(lq), cu_seqlens(lk)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


# ------------------------------------------------------------------------------ DJ

@pytest.mark.parametrize("zero", ["dout", "dlse"])
@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_efficient_zero_output_gradients(api, zero):
    """DJ: dO (the loss on the LSE) or dLSE (the loss on out) as torch._efficientzerotensor: dQ, dK, dV bitwise those
    of torch.zeros in its place (deterministic), and right by the rule (GQA 4/2, causal)."""
    dtype = built_dtype(HEAD_DIM)
    opts = dict(causal=True)
    if api == "dense":
        q, k, v, dout = attention_inputs(2, 141, 203, 4, 2, HEAD_DIM, dtype)
        lq = lk = cu_q = cu_k = None
    else:
        lq, lk = [77, 0, 130], [90, 40, 130]
        q, k, v, dout, cu_q, cu_k = _varlen_inputs(lq, lk, 0, dtype)
    runs = []
    for make in (torch._efficientzerotensor, torch.zeros):
        leaves = _leaves(q, k, v)
        if api == "dense":
            out, lse = flash_attn_hopper.attention(*leaves, return_lse=True, deterministic=True, **opts)
        else:
            out, lse = flash_attn_hopper.attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), return_lse=True,
                                                          deterministic=True, **opts)
        g = torch.Generator(device="cuda").manual_seed(7)
        dlse = torch.randn(lse.shape, device="cuda", generator=g)
        d_out = dout
        if zero == "dout":
            d_out = make(out.shape, dtype=out.dtype, device="cuda")
        else:
            dlse = make(lse.shape, dtype=lse.dtype, device="cuda")
        poison_attention_memory(q, v, cu_q)
        grads = torch.autograd.grad((out, lse), leaves, (d_out, dlse))
        runs.append((out.detach(), lse.detach(), grads, d_out, dlse))
    for name, a, b in zip(("dq", "dk", "dv"), runs[0][2], runs[1][2]):
        assert torch.equal(a, b), f"{api} {zero}: {name} differs between an efficient zero tensor and zeros"
    out, lse, grads, d_out, dlse = runs[1]
    if api == "dense":
        check_attention(out, lse, grads, q, k, v, d_out, f"zero {zero}", dlse=dlse, **opts)
    else:
        check_attention_varlen(out, lse, grads, q, k, v, d_out, cu_q, cu_k, f"zero {zero}", dlse=dlse, **opts)


# ------------------------------------------------------------------------------ DK

@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_retained_gradients_of_fused_views_and_outputs(api):
    """DK: q, k, v unbound from a fused (.., 3, nheads, head_dim) non-leaf, out and LSE, with retain_grad(): each .grad
    is bitwise torch.autograd.grad's for the same loss (deterministic), and dQ, dK, dV are right by the rule."""
    dtype = built_dtype(HEAD_DIM)
    lq = [77, 130]
    rows, tail = (sum(lq) + 5, 5) if api == "varlen" else (203, 0)
    lead = (rows,) if api == "varlen" else (2, rows)
    base = randn(*lead, 3, 4, HEAD_DIM, dtype=dtype).requires_grad_(True)
    dout = randn(*lead, 4, HEAD_DIM, dtype=dtype)
    cu = cu_seqlens(lq)

    def forward():
        fused = base * 1  # a non-leaf
        q, k, v = fused.unbind(-3)
        if api == "varlen":
            out, lse = flash_attn_hopper.attention_varlen(q, k, v, cu, cu, max(lq), max(lq), causal=True,
                                                          return_lse=True, deterministic=True)
        else:
            out, lse = flash_attn_hopper.attention(q, k, v, causal=True, return_lse=True, deterministic=True)
        return fused, (q, k, v), out, lse

    def loss_of(out, lse):
        finite = torch.isfinite(lse)
        return (out.float() * dout.float()).sum() + torch.where(finite, lse, 0).sum()

    fused, qkv, out, lse = forward()
    expected = torch.autograd.grad(loss_of(out, lse), (*qkv, out, lse))
    fused, qkv, out, lse = forward()
    for t in (*qkv, out, lse):
        t.retain_grad()
    loss_of(out, lse).backward()
    for name, t, e in zip(("q", "k", "v", "out", "lse"), (*qkv, out, lse), expected):
        assert t.grad is not None and torch.equal(t.grad, e), f"{api}: retained {name}.grad differs from autograd.grad"
    q, k, v = (t.detach() for t in qkv)
    dlse = torch.isfinite(lse).float()
    grads = tuple(t.grad for t in qkv)
    if api == "varlen":
        check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, dout, cu, cu, "retained", dlse=dlse,
                               causal=True)
    else:
        check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, "retained", dlse=dlse, causal=True)


# ------------------------------------------------------------------------------ DL

@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_lse_only_loss_under_checkpoint(api, use_reentrant):
    """DL: the loss is the sum of the finite LSE entries (out unused) of a checkpointed call: dQ, dK, dV bitwise those
    of the plain call (deterministic), dV exactly 0, and dQ, dK right by the rule (dO zeros, dLSE ones)."""
    dtype = built_dtype(HEAD_DIM)
    opts = dict(causal=True, window_size=(100, 0))
    if api == "dense":
        q, k, v, _ = attention_inputs(2, 203, 141, 4, 2, HEAD_DIM, dtype)  # causal rows that see no key
        lq = lk = cu_q = cu_k = None

        def block(*qkv):
            return flash_attn_hopper.attention(*qkv, return_lse=True, deterministic=True, **opts)
    else:
        lq, lk = [77, 0, 130], [50, 40, 130]
        q, k, v, _, cu_q, cu_k = _varlen_inputs(lq, lk, 6, dtype)

        def block(*qkv):
            return flash_attn_hopper.attention_varlen(*qkv, cu_q, cu_k, max(lq), max(lk), return_lse=True,
                                                      deterministic=True, **opts)

    def run(wrapped):
        leaves = _leaves(q, k, v)
        out, lse = checkpoint(block, *leaves, use_reentrant=use_reentrant) if wrapped else block(*leaves)
        poison_attention_memory(q, v, cu_q)
        torch.where(torch.isfinite(lse), lse, 0).sum().backward()
        return out.detach(), lse.detach(), tuple(t.grad for t in leaves)

    out, lse, grads = run(True)
    _, _, plain = run(False)
    for name, a, b in zip(("dq", "dk", "dv"), grads, plain):
        assert torch.equal(a, b), f"{api} reentrant={use_reentrant}: {name} differs from the plain call"
    assert torch.equal(grads[2], torch.zeros_like(grads[2])), "dV must be exactly 0 when the loss ignores out"
    dout, dlse = torch.zeros_like(out), torch.isfinite(lse).float()
    name = f"lse-only checkpoint reentrant={use_reentrant}"
    if api == "dense":
        check_attention(out, lse, grads, q, k, v, dout, name, dlse=dlse, **opts)
    else:
        check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, name, dlse=dlse, **opts)
