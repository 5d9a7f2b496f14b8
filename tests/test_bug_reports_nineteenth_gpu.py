"""Nineteenth round of the bug hunt (tests/bug_report_sources.md, "Nineteenth round"), GPU part.

EG: the caller lowered the float32 matmul precision (torch.set_float32_matmul_precision("high"): TF32 on cuBLAS;
pytorch/pytorch#158979, triton-lang/triton#1671): the float32 references of flash_attn_hopper.testing must stay float32,
so their error against a float64 reference stays that of the full-precision run, not TF32's.
EH: the references called inside a CUDA autocast region (RL-Align/RL-Kernel#170): the same, with autocast's fp16 / bf16
products in place of TF32.
EL: q broadcast over the batch with stride 0 (learned latent queries expanded over the batch, as Perceiver / Q-Former
cross-attention does; huggingface/candle#3744: a stride-zero broadcast batch on the left operand of a batched product
silently wrong): out, LSE and the gradients, dQ summed over the batch by autograd, right by the rule.

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build lacks
the head_dim / dtype."""

import pytest
import torch

from flash_attn_hopper import attention, testing
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref
from gpu_helpers import GRAD_NAMES, attention_inputs, built_dtype, poison_allocator, randn

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]


# ------------------------------------------------------------------------------------------------------ EG, EH

def _float32_references(q, k, v, dout, dlse):
    """(name, tensors) of the float32 references of one causal call: out and LSE, the gradients by autograd and
    from the equations."""
    return [
        ("attention_ref", testing.attention_ref(q, k, v, causal=True, upcast=True)),
        ("attention_ref_grads", testing.attention_ref_grads(q, k, v, dout, causal=True, upcast=True, dlse=dlse)),
        ("attention_bwd_ref", testing.attention_bwd_ref(q, k, v, dout, causal=True, upcast=True, dlse=dlse)),
    ]


def _errors(results, exact):
    """Max |result - float64 result| per tensor, with each result's dtype."""
    return [[(t.dtype, (t.double() - x.double()).abs().max().item()) for t, x in zip(ts, xs)]
            for (_, ts), (_, xs) in zip(results, exact)]


def _inputs():
    # fp16: 11-bit mantissas, which TF32's 10 bits round (bf16 values would pass through TF32 exactly); MHA
    q, k, v, dout = attention_inputs(2, 203, 203, 4, 4, 128, torch.float16)
    return q, k, v, dout, torch.randn(2, 4, 203, device="cuda")


def _check_as_full_precision(got, full, name):
    """Each error of `got` (against float64) at most 4x the full-precision run's: TF32 or fp16 products give tens to
    hundreds of times more; the same float32 computation gives the same error."""
    for i, (g, f) in enumerate(zip(got, full)):
        for j, ((gd, ge), (fd, fe)) in enumerate(zip(g, f)):
            assert gd == fd == torch.float32, f"{name} reference {i} tensor {j}: dtype {gd}"
            assert ge <= 4 * fe + 1e-12, f"{name} reference {i} tensor {j}: error {ge:.3e} vs full float32 {fe:.3e}"


def test_float32_references_stay_float32_under_tf32():
    """EG: with torch.set_float32_matmul_precision("high") the float32 references (out, LSE, gradients by autograd
    and from the equations) are as close to the float64 ones as in full precision, and the caller's setting is back
    afterwards. Skipped where TF32 changes no float32 product of these inputs (the test could not fail there)."""
    q, k, v, dout, dlse = _inputs()
    exact = _float32_references(q.double(), k.double(), v.double(), dout.double(), dlse.double())
    full = _errors(_float32_references(q, k, v, dout, dlse), exact)
    plain = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float())
    torch.set_float32_matmul_precision("high")
    try:
        if torch.equal(torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()), plain):
            pytest.skip("TF32 changes no float32 product on this GPU")
        lowered = _errors(_float32_references(q, k, v, dout, dlse), exact)
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.set_float32_matmul_precision("highest")  # (what the conftest fixture set)
    _check_as_full_precision(lowered, full, "TF32")


@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_float32_references_stay_float32_under_autocast(autocast_dtype):
    """EH: the float32 references called inside torch.autocast("cuda") are float32 and as close to the float64 ones
    as outside it."""
    q, k, v, dout, dlse = _inputs()
    exact = _float32_references(q.double(), k.double(), v.double(), dout.double(), dlse.double())
    full = _errors(_float32_references(q, k, v, dout, dlse), exact)
    with torch.autocast("cuda", dtype=autocast_dtype):
        inside = _errors(_float32_references(q, k, v, dout, dlse), exact)
    _check_as_full_precision(inside, full, f"autocast {autocast_dtype}")


# ------------------------------------------------------------------------------------------------------ EL

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_queries_broadcast_over_the_batch_with_stride_zero(causal):
    """EL: q of shape (1, seqlen_q, nheads, head_dim) expanded over a batch of 3 (batch stride 0), GQA k/v of
    their own per batch element, seqlen_q 77 and seqlen_k 203: out and LSE right by the rule, and dQ (the gradient of
    the unexpanded q: autograd sums the per-element gradients), dK, dV right by the rule against the reference run on
    the same expanded views."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    batch, seqlen_q, seqlen_k, nheads, nheads_k = 3, 77, 203, 4, 2
    q1 = randn(1, seqlen_q, nheads, head_dim, dtype=dtype)
    k = randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    v = randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    dout = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)

    def build(q1, k, v):
        return q1.expand(batch, -1, -1, -1), k, v

    leaves = [t.detach().requires_grad_(True) for t in (q1, k, v)]
    qx, kx, vx = build(*leaves)
    assert qx.stride(0) == 0
    e = q1.element_size()
    poison_allocator(batch * seqlen_q * nheads * head_dim * e, batch * nheads * seqlen_q * 4)
    out, lse = attention(qx, kx, vx, causal=causal, return_lse=True)
    ref, ref_lse = attention_ref(*build(q1, k, v), causal=causal, upcast=True)
    naive, naive_lse = attention_ref(*build(q1, k, v), causal=causal, upcast=False)
    assert out.shape == (batch, seqlen_q, nheads, head_dim) and out.dtype == dtype
    assert_close_by_rule(out.detach(), ref, naive, "broadcast q out")
    assert_close_by_rule(lse.detach(), ref_lse, naive_lse, "broadcast q lse")
    poison_allocator(batch * seqlen_q * nheads * head_dim * e, k.numel() * e)
    grads = torch.autograd.grad(out, leaves, dout)

    def ref_grads(upcast):
        compute = torch.float32 if upcast else dtype
        xs = [t.detach().to(compute).requires_grad_(True) for t in (q1, k, v)]
        with torch.enable_grad():
            o, _ = attention_ref(*build(*xs), causal=causal, upcast=upcast)
            return torch.autograd.grad(o, xs, dout.to(o.dtype))

    ref_g, naive_g = ref_grads(True), ref_grads(False)
    for gname, g, t, r, n in zip(GRAD_NAMES, grads, (q1, k, v), ref_g, naive_g):
        assert g.shape == t.shape and g.dtype == t.dtype, gname
        assert torch.isfinite(n).all(), f"{gname}: the naive reference is not finite"
        assert_close_by_rule(g, r, n, f"broadcast q {gname}")
