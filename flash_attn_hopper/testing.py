"""Reference attention and the comparison rule of DESIGN.md §3, used by the tests and the benchmark."""

import math

import torch


def causal_mask(seqlen_q, seqlen_k, device=None):
    """Boolean (seqlen_q, seqlen_k), True where query i may see key j: j <= i + seqlen_k - seqlen_q (bottom-right)."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return j <= i + (seqlen_k - seqlen_q)


def attention_ref(q, k, v, softmax_scale=None, causal=False, upcast=True):
    """Plain attention in the layout of flash_attn_hopper.attention.

    q: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads, head_dim).
    upcast=True computes in float32 (float64 inputs stay float64); upcast=False computes in the input dtype,
    the naive same-precision reference whose error sets the tolerance.
    Returns (out in the compute dtype, lse float32 (batch, nheads, seqlen_q)). A row that sees no key gets
    output 0 and LSE -inf.
    """
    if upcast and q.dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        mask = causal_mask(q.shape[1], k.shape[1], device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores if scores.dtype == torch.float64 else scores.float(), dim=-1)
    empty = torch.isneginf(lse)
    # softmax of an all -inf row is NaN; such a row attends to nothing and its output is 0.
    attn = torch.softmax(scores, dim=-1).masked_fill(empty.unsqueeze(-1), 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", attn.to(v.dtype), v)
    return out, lse.float()


def max_abs_err(a, b):
    """Max |a - b| over finite-or-not elements; NaN if either holds a NaN where the other does not match."""
    a = a.double()
    b = b.double()
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    diff = (a - b).abs().masked_fill(both_inf, 0.0)
    if torch.isnan(diff).any():
        return float("nan")
    return diff.max().item() if diff.numel() else 0.0


def assert_close_by_rule(out, ref, ref_naive, name, floor=None):
    """DESIGN.md §3: max|out - ref| <= 2 * max|ref_naive - ref| + floor, with NaN never passing.

    The default floor is 1e-5 (float32 outputs) or 1e-4 (others) times max(1, max|ref|).

    ref is the float32 reference; ref_naive the same math run in the input dtype. Infinities must match exactly.
    """
    if floor is None:
        # Rounding noise of the output format, relative to the values' magnitude (an fp32 LSE near -115 has an
        # ulp of 7.6e-6): about 80 float32 ulps, or a fraction of one fp16/bf16 ulp.
        scale = max(1.0, ref.double().abs().masked_fill(torch.isinf(ref), 0).max().item() if ref.numel() else 1.0)
        floor = (1e-5 if out.dtype == torch.float32 else 1e-4) * scale
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{name}: holds NaN"
    inf_mismatch = (torch.isinf(out) | torch.isinf(ref)) & (out.double() != ref.double())
    assert not inf_mismatch.any(), f"{name}: infinities differ from the reference at {inf_mismatch.nonzero()[:5].tolist()}"
    err = max_abs_err(out, ref)
    base = max_abs_err(ref_naive, ref)
    # An infinite or NaN naive error would make the bound vacuous.
    assert math.isfinite(base), f"{name}: the naive reference differs from the reference by {base}; no usable bound"
    tol = 2 * base + floor
    assert err <= tol, f"{name}: max abs error {err:.3e} > 2 x naive error {base:.3e} + {floor:.0e}"
    return err, base
