"""CPU checks of the test machinery itself: the reference ``attention_ref`` against PyTorch's SDPA in float64,
its LSE against ``torch.logsumexp``, the bottom-right causal mask, and that ``assert_close_by_rule`` can fail."""

import math

import pytest
import torch
import torch.nn.functional as F

from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, causal_mask

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
