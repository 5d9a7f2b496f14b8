"""CPU checks of the test machinery itself: the reference ``attention_ref`` against PyTorch's SDPA in float64,
its LSE against ``torch.logsumexp``, the bottom-right causal mask, the backward references (``attention_bwd_ref``,
written from the paper's equations, and ``attention_ref_grads``) against torch autograd in float64, and that
``assert_close_by_rule`` can fail."""

import math

import pytest
import torch
import torch.nn.functional as F

from flash_attn_hopper.testing import (
    assert_close_by_rule,
    attention_bwd_ref,
    attention_ref,
    attention_ref_grads,
    causal_mask,
)

BATCH, NHEADS = 2, 3
# (seqlen_q, seqlen_k): equal, seqlen 1, and seqlen_q != seqlen_k both ways (incl. rows that see no key when causal).
SEQLENS = [(1, 1), (1, 17), (17, 1), (13, 29), (29, 13), (32, 32), (64, 7)]
F64_TOL = dict(rtol=1e-12, atol=1e-12)


def _rand(batch, seqlen, nheads, head_dim, dtype=torch.float64):
    return torch.randn(batch, seqlen, nheads, head_dim, dtype=dtype)


def _sdpa(q, k, v, scale, mask):
    """SDPA in our layout; mask is a boolean (seqlen_q, seqlen_k), True = may attend, or None."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2)


def _scores_f64(q, k, scale, mask):
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
def test_reference_matches_sdpa_float64(seqlen_q, seqlen_k, causal, head_dim):
    q, k, v = _rand(BATCH, seqlen_q, NHEADS, head_dim), _rand(BATCH, seqlen_k, NHEADS, head_dim), _rand(
        BATCH, seqlen_k, NHEADS, head_dim
    )
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = attention_ref(q, k, v, causal=causal, upcast=True)
    assert out.dtype == torch.float64, "float64 inputs must stay float64"
    assert out.shape == (BATCH, seqlen_q, NHEADS, head_dim)
    assert lse.dtype == torch.float32 and lse.shape == (BATCH, NHEADS, seqlen_q)

    mask = causal_mask(seqlen_q, seqlen_k) if causal else None
    # SDPA's is_causal is top-left aligned; ours is bottom-right, so SDPA gets the explicit mask.
    expected = _sdpa(q, k, v, scale, mask)
    sees_key = mask.any(dim=1) if causal else torch.ones(seqlen_q, dtype=torch.bool)
    torch.testing.assert_close(out[:, sees_key], expected[:, sees_key], **F64_TOL)

    # Rows that see no key: output exactly 0 and LSE -inf in our reference (SDPA may give NaN there).
    empty = ~sees_key
    if causal and seqlen_q > seqlen_k:
        assert empty.sum().item() == seqlen_q - seqlen_k
    else:
        assert not empty.any()
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.isneginf(lse[:, :, empty]).all()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()

    # LSE against torch.logsumexp of the float64 scaled scores (the reference stores LSE in float32).
    expected_lse = torch.logsumexp(_scores_f64(q, k, scale, mask), dim=-1)
    torch.testing.assert_close(lse, expected_lse.float())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reference_honours_softmax_scale(causal):
    seqlen_q, seqlen_k, head_dim, scale = 21, 34, 32, 0.3
    q, k, v = _rand(BATCH, seqlen_q, NHEADS, head_dim), _rand(BATCH, seqlen_k, NHEADS, head_dim), _rand(
        BATCH, seqlen_k, NHEADS, head_dim
    )
    mask = causal_mask(seqlen_q, seqlen_k) if causal else None
    out, lse = attention_ref(q, k, v, softmax_scale=scale, causal=causal)
    torch.testing.assert_close(out, _sdpa(q, k, v, scale, mask), **F64_TOL)
    torch.testing.assert_close(lse, torch.logsumexp(_scores_f64(q, k, scale, mask), dim=-1).float())
    # and the scale matters: the default scale gives a different answer
    out_default, _ = attention_ref(q, k, v, causal=causal)
    assert (out_default - out).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,expected",
    [
        (3, 3, [[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
        (2, 4, [[1, 1, 1, 0], [1, 1, 1, 1]]),
        (4, 2, [[0, 0], [0, 0], [1, 0], [1, 1]]),
        (1, 3, [[1, 1, 1]]),
        (3, 1, [[0], [0], [1]]),
    ],
)
def test_causal_mask_is_bottom_right(seqlen_q, seqlen_k, expected):
    assert torch.equal(causal_mask(seqlen_q, seqlen_k), torch.tensor(expected, dtype=torch.bool))


def test_causal_mask_differs_from_sdpa_top_left_when_lengths_differ():
    # is_causal=True in SDPA masks j > i; ours masks j > i + seqlen_k - seqlen_q.
    q, k, v = _rand(1, 4, 2, 16), _rand(1, 9, 2, 16), _rand(1, 9, 2, 16)
    ours, _ = attention_ref(q, k, v, causal=True)
    top_left = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    assert (ours - top_left).abs().max().item() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_reference_upcast_and_naive(dtype):
    """upcast=True computes in float32 (close to float64 math on the same low-precision inputs);
    upcast=False computes in the input dtype and is measurably less accurate."""
    q, k, v = (_rand(BATCH, 37, NHEADS, 64, dtype) for _ in range(3))
    out, lse = attention_ref(q, k, v, causal=True)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    out64, lse64 = attention_ref(q.double(), k.double(), v.double(), causal=True)
    torch.testing.assert_close(out, out64.float())
    torch.testing.assert_close(lse, lse64)
    naive, naive_lse = attention_ref(q, k, v, causal=True, upcast=False)
    assert naive.dtype == dtype and naive_lse.dtype == torch.float32
    assert (naive.double() - out64).abs().max().item() > (out.double() - out64).abs().max().item()


# ---------------------------------------------------------------------------------------------------------------
# Backward references: the seed's equations (attention_bwd_ref) and autograd of attention_ref agree in float64.


def _autograd_f64(q, k, v, dout, scale, causal):
    """torch autograd of attention_ref, written out here so attention_ref_grads is checked too."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = attention_ref(*leaves, softmax_scale=scale, causal=causal)
    return torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("softmax_scale", [None, 0.3], ids=["default_scale", "scale0.3"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
def test_bwd_equations_match_autograd_float64(seqlen_q, seqlen_k, causal, softmax_scale):
    head_dim = 16
    q, k, v = (_rand(BATCH, s, NHEADS, head_dim) for s in (seqlen_q, seqlen_k, seqlen_k))
    dout = _rand(BATCH, seqlen_q, NHEADS, head_dim)
    before = [t.clone() for t in (q, k, v, dout)]
    expected = _autograd_f64(q, k, v, dout, softmax_scale, causal)
    by_equations = attention_bwd_ref(q, k, v, dout, softmax_scale=softmax_scale, causal=causal)
    by_helper = attention_ref_grads(q, k, v, dout, softmax_scale=softmax_scale, causal=causal)
    for name, exp, eq, helper, like in zip(("dq", "dk", "dv"), expected, by_equations, by_helper, (q, k, v)):
        assert eq.dtype == torch.float64 and eq.shape == like.shape, name
        assert not torch.isnan(eq).any() and not torch.isnan(exp).any(), name
        torch.testing.assert_close(eq, exp, **F64_TOL, msg=lambda m: f"{name} (equations): {m}")
        torch.testing.assert_close(helper, exp, **F64_TOL, msg=lambda m: f"{name} (attention_ref_grads): {m}")
    for t, b in zip((q, k, v, dout), before):
        assert torch.equal(t, b), "the references must not modify their inputs"

    # Rows that see no key: dQ rows exactly 0 (they add nothing to dK and dV: checked through the match above).
    sees_key = causal_mask(seqlen_q, seqlen_k).any(dim=1) if causal else torch.ones(seqlen_q, dtype=torch.bool)
    assert torch.equal(by_equations[0][:, ~sees_key], torch.zeros_like(by_equations[0][:, ~sees_key]))
    if seqlen_k == 1:
        # Softmax over one key is constant: dQ = dK = 0 (up to the rounding of dP - D, two sums of the same products
        # in different orders) and dV = the sum of dO over the rows that see the key.
        torch.testing.assert_close(by_equations[0], torch.zeros_like(q), **F64_TOL)
        torch.testing.assert_close(by_equations[1], torch.zeros_like(k), **F64_TOL)
        torch.testing.assert_close(by_equations[2], dout[:, sees_key].sum(dim=1, keepdim=True), **F64_TOL)


def test_bwd_equations_match_sdpa_autograd_float64():
    """An independent implementation: autograd through PyTorch's SDPA with the explicit bottom-right mask (every row
    sees a key here, so SDPA has no NaN rows)."""
    seqlen_q, seqlen_k, head_dim, scale = 23, 31, 32, 0.2
    q, k, v = (_rand(BATCH, s, NHEADS, head_dim) for s in (seqlen_q, seqlen_k, seqlen_k))
    dout = _rand(BATCH, seqlen_q, NHEADS, head_dim)
    for causal in (False, True):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        mask = causal_mask(seqlen_q, seqlen_k) if causal else None
        expected = torch.autograd.grad(_sdpa(*leaves, scale, mask), leaves, dout)
        got = attention_bwd_ref(q, k, v, dout, softmax_scale=scale, causal=causal)
        for name, e, g in zip(("dq", "dk", "dv"), expected, got):
            torch.testing.assert_close(g, e, **F64_TOL, msg=lambda m: f"{name} causal={causal}: {m}")


def test_bwd_equations_dq_invariant_to_key_shift():
    """Adding one vector c to every key adds a constant to each row of S, which the softmax ignores, so P and dS are
    unchanged, and dQ = α dS (K + 1 cᵀ) = α dS K + α (dS 1) cᵀ. The second term is 0 only because every row of dS
    sums to 0, i.e. because D = rowsum(dO ∘ O) equals rowsum(P ∘ dP) (DESIGN.md §1): a wrong D fails here."""
    q, k, v = (_rand(1, s, 2, 16) for s in (9, 14, 14))
    dout = _rand(1, 9, 2, 16)
    shift = _rand(1, 1, 2, 16)
    for causal in (False, True):
        grads = attention_bwd_ref(q, k, v, dout, causal=causal)
        shifted = attention_bwd_ref(q, k + shift, v, dout, causal=causal)
        for name, g, s in zip(("dq", "dk", "dv"), grads, shifted):
            torch.testing.assert_close(g, s, **F64_TOL, msg=lambda m: f"{name} causal={causal}: {m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_bwd_references_upcast_and_naive(dtype):
    """upcast=True gives float32 gradients close to float64 math on the same inputs; upcast=False gives gradients in
    the input dtype that are measurably less accurate (the naive reference of the rule)."""
    q, k, v = (_rand(BATCH, s, NHEADS, 64, dtype) for s in (37, 45, 45))
    dout = _rand(BATCH, 37, NHEADS, 64, dtype)
    exact = attention_bwd_ref(q.double(), k.double(), v.double(), dout.double(), causal=True)
    for fn in (attention_ref_grads, attention_bwd_ref):
        upcast = fn(q, k, v, dout, causal=True)
        naive = fn(q, k, v, dout, causal=True, upcast=False)
        for name, u, n, e in zip(("dq", "dk", "dv"), upcast, naive, exact):
            assert u.dtype == torch.float32 and n.dtype == dtype, (fn.__name__, name)
            torch.testing.assert_close(u, e.float(), msg=lambda m: f"{fn.__name__} {name}: {m}")
            assert (n.double() - e).abs().max().item() > (u.double() - e).abs().max().item(), (fn.__name__, name)
    # and the rule accepts the float32 gradients rounded to the input dtype
    ref = attention_ref_grads(q, k, v, dout, causal=True)
    naive = attention_ref_grads(q, k, v, dout, causal=True, upcast=False)
    for name, r, n in zip(("dq", "dk", "dv"), ref, naive):
        assert_close_by_rule(r.to(dtype), r, n, name)


# ---------------------------------------------------------------------------------------------------------------
# assert_close_by_rule: accepts a correct answer, rejects wrong ones.


def _rule_case(dtype=torch.float16, causal=False, seqlen_q=48, seqlen_k=40):
    q, k, v = (_rand(BATCH, s, NHEADS, 64, dtype) for s in (seqlen_q, seqlen_k, seqlen_k))
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    naive, naive_lse = attention_ref(q, k, v, causal=causal, upcast=False)
    return q, k, v, ref, ref_lse, naive, naive_lse


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rule_accepts_correctly_rounded_answer(dtype, causal):
    _, _, _, ref, ref_lse, naive, naive_lse = _rule_case(dtype, causal, seqlen_q=48, seqlen_k=40)
    assert_close_by_rule(ref.to(dtype), ref, naive, "out")
    assert_close_by_rule(ref_lse.clone(), ref_lse, naive_lse, "lse")


def _wrong_outputs(q, k, v, ref, causal):
    dtype = q.dtype
    shifted = ref.clone()
    shifted[0, 5, 1, 7] += 0.25
    return {
        "one_element_off": shifted.to(dtype),
        "zeros": torch.zeros_like(ref, dtype=dtype),
        "wrong_scale": attention_ref(q, k, v, softmax_scale=1.0, causal=causal)[0].to(dtype),
        "wrong_mask": attention_ref(q, k, v, causal=not causal)[0].to(dtype),
        "heads_swapped": ref.flip(2).to(dtype),
        "keys_dropped": attention_ref(q, k[:, :-1], v[:, :-1], causal=causal)[0].to(dtype),
    }


@pytest.mark.parametrize(
    "wrong", ["one_element_off", "zeros", "wrong_scale", "wrong_mask", "heads_swapped", "keys_dropped"]
)
def test_rule_rejects_wrong_output(wrong):
    q, k, v, ref, _, naive, _ = _rule_case(torch.float16, causal=False)
    bad = _wrong_outputs(q, k, v, ref, causal=False)[wrong]
    with pytest.raises(AssertionError):
        assert_close_by_rule(bad, ref, naive, "out")


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_rule_rejects_nan(where):
    _, _, _, ref, ref_lse, naive, naive_lse = _rule_case(torch.float16)
    out = ref.to(torch.float16).contiguous()
    idx = {"first": 0, "middle": out.numel() // 2, "last": out.numel() - 1}[where]
    out.view(-1)[idx] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_by_rule(out, ref, naive, "out")
    lse = ref_lse.clone().contiguous()
    lse.view(-1)[idx % lse.numel()] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_by_rule(lse, ref_lse, naive_lse, "lse")


def test_rule_rejects_infinity_mismatch():
    # causal with seqlen_q > seqlen_k: the reference LSE holds -inf for rows that see no key
    _, _, _, ref, ref_lse, naive, naive_lse = _rule_case(torch.float16, causal=True, seqlen_q=48, seqlen_k=40)
    assert torch.isneginf(ref_lse).any()
    finite_instead = ref_lse.masked_fill(torch.isneginf(ref_lse), -1e30)
    with pytest.raises(AssertionError, match="infinities"):
        assert_close_by_rule(finite_instead, ref_lse, naive_lse, "lse")
    spurious_inf = ref_lse.clone()
    spurious_inf[0, 0, -1] = float("-inf")
    with pytest.raises(AssertionError, match="infinities"):
        assert_close_by_rule(spurious_inf, ref_lse, naive_lse, "lse")


def test_rule_rejects_wrong_shape():
    _, _, _, ref, _, naive, _ = _rule_case(torch.float16)
    with pytest.raises(AssertionError, match="shape"):
        assert_close_by_rule(ref[:, :-1].half(), ref, naive, "out")


def test_rule_rejects_error_just_over_the_bound():
    """The bound is 2 x naive error + floor: an error a little above it fails, one a little below passes."""
    _, _, _, ref, _, naive, _ = _rule_case(torch.float16)
    base = (naive.double() - ref.double()).abs().max().item()
    assert base > 0
    floor = 1e-4
    bound = 2 * base + floor
    out = ref.clone()  # float32, so the perturbation is not rounded away
    out[1, 2, 0, 3] += 1.5 * bound
    with pytest.raises(AssertionError, match="max abs error"):
        assert_close_by_rule(out, ref, naive, "out", floor=floor)
    out = ref.clone()
    out[1, 2, 0, 3] += 0.5 * bound
    assert_close_by_rule(out, ref, naive, "out", floor=floor)


def test_rule_rejects_when_naive_reference_is_infinite():
    _, _, _, ref, _, naive, _ = _rule_case(torch.float16)
    naive = naive.clone()
    naive[0, 0, 0, 0] = float("inf")  # e.g. a naive fp16 reference that overflowed
    with pytest.raises(AssertionError):
        assert_close_by_rule(torch.zeros_like(ref, dtype=torch.float16) + 100, ref, naive, "out")


@pytest.mark.parametrize("nheads_k", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_references_match_sdpa_with_repeated_heads_float64(nheads_k, causal):
    """GQA/MQA: query head h reads K/V head h // (nheads // nheads_k). An independent check: SDPA on K/V heads
    repeated by hand (index_select, not repeat_kv), whose autograd sums dK/dV over each group."""
    nheads, seqlen_q, seqlen_k, head_dim, scale = 6, 13, 21, 16, 0.25
    q = _rand(BATCH, seqlen_q, nheads, head_dim)
    k, v = (_rand(BATCH, seqlen_k, nheads_k, head_dim) for _ in range(2))
    dout = _rand(BATCH, seqlen_q, nheads, head_dim)
    head_of = torch.arange(nheads) // (nheads // nheads_k)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    mask = causal_mask(seqlen_q, seqlen_k) if causal else None
    expected_out = _sdpa(leaves[0], leaves[1].index_select(2, head_of), leaves[2].index_select(2, head_of), scale, mask)
    if causal:  # rows that see no key: SDPA gives NaN, the references 0 (DESIGN.md); none here since seqlen_k > seqlen_q
        assert causal_mask(seqlen_q, seqlen_k).any(dim=1).all()
    expected_grads = torch.autograd.grad(expected_out, leaves, dout)
    out, _ = attention_ref(q, k, v, softmax_scale=scale, causal=causal)
    torch.testing.assert_close(out, expected_out.detach(), **F64_TOL)
    for name, got_all in (("equations", attention_bwd_ref(q, k, v, dout, softmax_scale=scale, causal=causal)),
                          ("autograd", attention_ref_grads(q, k, v, dout, softmax_scale=scale, causal=causal))):
        for g, e, like, gname in zip(got_all, expected_grads, (q, k, v), ("dq", "dk", "dv")):
            assert g.shape == like.shape, (name, gname)
            torch.testing.assert_close(g, e, **F64_TOL, msg=lambda m: f"{name} {gname}: {m}")


@pytest.mark.parametrize("nheads_k", [1, 3], ids=["mqa", "mha"])
@pytest.mark.parametrize("head_dim,head_dim_v", [(24, 16), (16, 40)])
def test_references_with_head_dim_v_match_sdpa_float64(head_dim, head_dim_v, nheads_k):
    """v (and so out, dout, dv) with its own head_dim: the references against SDPA (which allows it), repeated heads by
    hand; the default scale is 1/sqrt(q's head_dim)."""
    seqlen_q, seqlen_k = 13, 21
    q = _rand(BATCH, seqlen_q, NHEADS, head_dim)
    k, v = _rand(BATCH, seqlen_k, nheads_k, head_dim), _rand(BATCH, seqlen_k, nheads_k, head_dim_v)
    dout = _rand(BATCH, seqlen_q, NHEADS, head_dim_v)
    head_of = torch.arange(NHEADS) // (NHEADS // nheads_k)
    for causal in (False, True):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        mask = causal_mask(seqlen_q, seqlen_k) if causal else None
        expected_out = _sdpa(leaves[0], leaves[1].index_select(2, head_of), leaves[2].index_select(2, head_of),
                             1 / math.sqrt(head_dim), mask)
        expected_grads = torch.autograd.grad(expected_out, leaves, dout)
        out, _ = attention_ref(q, k, v, causal=causal)
        torch.testing.assert_close(out, expected_out.detach(), **F64_TOL)
        for name, got_all in (("equations", attention_bwd_ref(q, k, v, dout, causal=causal)),
                              ("autograd", attention_ref_grads(q, k, v, dout, causal=causal))):
            for g, e, like, gname in zip(got_all, expected_grads, (q, k, v), ("dq", "dk", "dv")):
                assert g.shape == like.shape, (name, gname)
                torch.testing.assert_close(g, e, **F64_TOL, msg=lambda m: f"{name} {gname} causal={causal}: {m}")
