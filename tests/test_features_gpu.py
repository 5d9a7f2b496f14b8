"""Sliding window, softcap and the differentiable LSE on an sm90 GPU (issue 5), forward and backward, against the
float32 reference by the rule of DESIGN.md §3 (flash_attn_hopper.testing: ``local_mask``, ``attention_ref`` and
``attention_ref_grads`` with window_size / softcap / dlse). Outputs and gradients come from NaN-poisoned memory, so
an element the kernels never write shows up. Skipped, with the reason, without an sm90 GPU and the built extension."""

import pytest
import torch

from flash_attn_hopper import attention
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_ref_grads
from gpu_helpers import built_dtype as _built_dtype
from gpu_helpers import poison_allocator as _poison_allocator
from gpu_helpers import randn as _randn
from gpu_helpers import require_built as _require_built

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
HEAD_DIMS = [64, 128, 256]
BWD_SEQLEN_Q_ROUNDING = 128  # csrc/flash/config.hpp


def _inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, scale=1.0):
    q = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype) * scale
    k = _randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype) * scale
    v = _randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    dout = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    return q, k, v, dout


def _poison(q, k):
    batch, seqlen_q, nheads, head_dim = q.shape
    rows = batch * nheads * (-(-seqlen_q // BWD_SEQLEN_Q_ROUNDING) * BWD_SEQLEN_Q_ROUNDING)
    e = q.element_size()
    _poison_allocator(q.numel() * e, k.numel() * e, batch * nheads * seqlen_q * 4, rows * head_dim * 4, rows * 4)


def _run_and_check(q, k, v, dout, name, dlse=None, **opts):
    """Forward (out, LSE) and backward (dQ, dK, dV; through out, and through LSE when dlse is given) against the
    float32 reference with the same options, by the rule. Rows that see no key: output and dQ exactly 0, LSE -inf.
    The inputs are left unmodified."""
    before = [t.clone() for t in (q, k, v, dout)]
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    _poison(q, k)
    out, lse = attention(*leaves, return_lse=True, **opts)
    ref, ref_lse = attention_ref(q, k, v, upcast=True, **opts)
    naive, naive_lse = attention_ref(q, k, v, upcast=False, **opts)
    assert torch.isfinite(naive).all(), f"{name}: the naive reference is not finite"
    assert_close_by_rule(out, ref, naive, f"{name} out")
    assert_close_by_rule(lse, ref_lse, naive_lse, f"{name} lse")
    empty = torch.isneginf(ref_lse)  # (batch, nheads, seqlen_q)
    if empty.any():
        rows = out.detach().permute(0, 2, 1, 3)[empty]
        assert torch.equal(rows, torch.zeros_like(rows)), f"{name}: rows that see no key are not exactly 0"

    _poison(q, k)
    outputs, grads_in = [out], [dout]
    if dlse is not None:
        outputs.append(lse)
        grads_in.append(dlse)
    grads = torch.autograd.grad(outputs, leaves, grads_in)
    ref_g = attention_ref_grads(q, k, v, dout, upcast=True, dlse=dlse, **opts)
    naive_g = attention_ref_grads(q, k, v, dout, upcast=False, dlse=dlse, **opts)
    for gname, g, r, n in zip(("dq", "dk", "dv"), grads, ref_g, naive_g):
        assert g.shape == r.shape and g.dtype == q.dtype
        assert torch.isfinite(n).all(), f"{name} {gname}: the naive reference is not finite"
        assert_close_by_rule(g, r, n, f"{name} {gname}")
    if empty.any():
        rows = grads[0].permute(0, 2, 1, 3)[empty]
        assert torch.equal(rows, torch.zeros_like(rows)), f"{name}: dQ rows that see no key are not exactly 0"
    for t, b in zip((q, k, v, dout), before):
        assert torch.equal(t, b), f"{name}: an input was modified"
    return ref_lse


# ------------------------------------------------------------------------------------------------ sliding window

WINDOWS = [(0, 0), (17, 3), (128, 0), (-1, 5), (64, -1)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", WINDOWS, ids=[f"w{l}_{r}" for l, r in WINDOWS])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_window_513x700(dtype, head_dim, window, causal):
    """The issue's windows at seqlen_q 513, seqlen_k 700 (bottom-right aligned), with and without causal (which
    fixes the right side at 0; a window whose right side is > 0 then raises ValueError)."""
    _require_built(head_dim, dtype)
    q, k, v, dout = _inputs(2, 513, 700, 3, 3, head_dim, dtype)
    if causal and window[1] > 0:
        with pytest.raises(ValueError, match="causal"):
            attention(q, k, v, causal=True, window_size=window)
        return
    _run_and_check(q, k, v, dout, f"window {window} causal={causal}", causal=causal, window_size=window)


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,window",
    [
        (300, 100, (20, 1000)),  # the case: wider than the sequence on one side, never wrongly clamped
        (100, 300, (1000, 20)),
        (700, 513, (0, 0)),  # many rows see no key
        (1, 239, (5, 5)),
        (239, 1, (3, 0)),
        (128, 128, (127, 0)),  # exactly one tile of keys per row block edge
        (1023, 1024, (256, 256)),
        (200, 200, (2**31 - 1, 2**40)),  # beyond int32: unbounded
    ],
)
def test_window_edges(seqlen_q, seqlen_k, window):
    head_dim = 128
    dtype = _built_dtype(head_dim)
    q, k, v, dout = _inputs(2, seqlen_q, seqlen_k, 2, 2, head_dim, dtype)
    _run_and_check(q, k, v, dout, f"{seqlen_q}x{seqlen_k} window {window}", window_size=window)


def test_window_unbounded_equals_dense_and_causal():
    """(-1, -1) is the dense kernel and (-1, 0) the causal one: bitwise the same results."""
    dtype = _built_dtype(128)
    q, k, v, _ = _inputs(2, 333, 257, 3, 3, 128, dtype)
    assert torch.equal(attention(q, k, v, window_size=(-1, -1)), attention(q, k, v))
    assert torch.equal(attention(q, k, v, window_size=(-1, 0)), attention(q, k, v, causal=True))
    # a window wider than both sequences is unbounded too
    assert torch.equal(attention(q, k, v, window_size=(5000, 5000)), attention(q, k, v))


@pytest.mark.parametrize("nheads_k", [2, 1], ids=["gqa", "mqa"])
def test_window_gqa(nheads_k):
    dtype = _built_dtype(64)
    q, k, v, dout = _inputs(2, 400, 333, 6, nheads_k, 64, dtype)
    _run_and_check(q, k, v, dout, f"window gqa {nheads_k}", window_size=(50, 7))


# -------------------------------------------------------------------------------------------------------- softcap


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS + [96, 192])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softcap(dtype, head_dim, causal):
    """softcap 15 on inputs scaled by 2 (scores reach the cap's curved part), seqlens 239 x 377; bf16 takes the fixed
    maximum, fp16 the online one, on every forward kernel width (96 and 192 included)."""
    _require_built(head_dim, dtype)
    q, k, v, dout = _inputs(2, 239, 377, 3, 3, head_dim, dtype, scale=2.0)
    _run_and_check(q, k, v, dout, f"softcap causal={causal}", causal=causal, softcap=15.0)


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, causal",
    [(300, 512, False), (64, 128, False), (1000, 1024, False), (129, 640, True), (640, 640, True)],
)
@pytest.mark.parametrize("cap", [15.0, 30.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softcap_whole_key_blocks(dtype, cap, seqlen_q, seqlen_k, causal):
    """seqlen_k a multiple of 128: key blocks without a mask, the first one a tile visits included, next to the
    masked causal blocks (bf16 head_dim 128 with cap <= 30 runs the fixed-maximum softmax on QKᵀ in two halves).
    Inputs scaled by 2 so scores reach the cap's curved part."""
    _require_built(128, dtype)
    q, k, v, dout = _inputs(2, seqlen_q, seqlen_k, 3, 3, 128, dtype, scale=2.0)
    _run_and_check(q, k, v, dout, f"softcap {cap} {seqlen_q}x{seqlen_k} causal={causal}", causal=causal, softcap=cap)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softcap_with_window_and_gqa(dtype):
    """Each dtype (both compute tanh with tanh.approx.f32, whose error is about one fp16 rounding)."""
    _require_built(128, dtype)
    q, k, v, dout = _inputs(2, 513, 700, 4, 2, 128, dtype, scale=2.0)
    _run_and_check(q, k, v, dout, "softcap+window+gqa", window_size=(64, 16), softcap=30.0, softmax_scale=0.2)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softcap_small_cap_saturates(dtype):
    """softcap 1 with large logits: tanh saturates at ±1 for most scores; results stay finite and by the rule."""
    _require_built(64, dtype)
    q, k, v, dout = _inputs(1, 200, 300, 2, 2, 64, dtype, scale=4.0)
    _run_and_check(q, k, v, dout, "softcap 1", softcap=1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softcap_large_cap(dtype):
    """softcap 50 (Gemma 2's attention cap) on inputs scaled by 4, so scores spread over the cap's range: the
    approximation error of tanh grows with the cap."""
    _require_built(128, dtype)
    q, k, v, dout = _inputs(2, 301, 257, 4, 4, 128, dtype, scale=4.0)
    _run_and_check(q, k, v, dout, "softcap 50", causal=True, softcap=50.0)


@pytest.mark.parametrize("cap", [30.0, 30.5], ids=["fixed-max", "online-max"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softcap_rows_at_the_floor(dtype, cap):
    """Rows whose every score sits near -cap (q anti-aligned with every key), where a softmax shifted by the cap
    instead of the row maximum has its smallest values, exp(-2 cap): bf16 with cap <= 30 takes that fixed maximum,
    30.5 and fp16 the online one; results by the rule, the LSE included. Some rows see one key (causal, seqlen_q >
    seqlen_k runs rows with none: LSE -inf, output 0)."""
    _require_built(128, dtype)
    q, k, v, dout = _inputs(2, 300, 200, 4, 4, 128, dtype)
    direction = torch.randn(1, 1, 4, 128, device="cuda")
    direction = direction / direction.norm(dim=-1, keepdim=True)
    # q . k ~ -900 * softmax_scale per pair: every tanh near -1, spread by the random parts.
    q = (q.float() * 0.5 + 30 * direction).to(dtype)
    k = (k.float() * 0.5 - 30 * direction).to(dtype)
    _run_and_check(q, k, v, dout, f"softcap {cap} floor", causal=True, softcap=cap)


# ----------------------------------------------------------------------------------------------- differentiable LSE


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_lse_gradient_out_plus_lse(head_dim, causal):
    """loss = out·dO + lse·dLSE with random dLSE (the issue's out.sum() + lse.sum(), with random weights), including
    causal rows with no key (seqlen_q > seqlen_k), whose LSE is -inf and pass no gradient."""
    dtype = _built_dtype(head_dim)
    q, k, v, dout = _inputs(2, 203, 113, 3, 3, head_dim, dtype)
    dlse = torch.randn(2, 3, 203, device="cuda")
    ref_lse = _run_and_check(q, k, v, dout, "out+lse", dlse=dlse, causal=causal)
    assert causal == bool(torch.isneginf(ref_lse).any())


def test_lse_gradient_sum_form():
    """The literal out.sum() + lse.sum() through .backward(): lse's gradient arrives as an expanded (stride 0)
    tensor."""
    dtype = _built_dtype(128)
    q, k, v, _ = _inputs(2, 150, 260, 2, 2, 128, dtype)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, lse = attention(*leaves, return_lse=True, window_size=(40, 40))
    (out.float().sum() + lse.sum()).backward()
    dout = torch.ones_like(q)
    dlse = torch.ones(2, 2, 150, device="cuda")
    ref = attention_ref_grads(q, k, v, dout, window_size=(40, 40), dlse=dlse)
    naive = attention_ref_grads(q, k, v, dout, upcast=False, window_size=(40, 40), dlse=dlse)
    for name, leaf, r, n in zip(("dq", "dk", "dv"), leaves, ref, naive):
        assert_close_by_rule(leaf.grad, r, n, f"sum form {name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_lse_only_loss(dtype):
    """A loss of the LSE alone: out gets no gradient (None), the op treats it as zero; dV is then exactly 0."""
    _require_built(64, dtype)
    q, k, v, dout = _inputs(1, 100, 180, 2, 2, 64, dtype)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    _, lse = attention(*leaves, return_lse=True, softcap=20.0)
    dlse = torch.randn_like(lse)
    dq, dk, dv = torch.autograd.grad(lse, leaves, dlse)
    assert torch.equal(dv, torch.zeros_like(dv))
    zeros = torch.zeros_like(dout)
    ref = attention_ref_grads(q, k, v, zeros, softcap=20.0, dlse=dlse)
    naive = attention_ref_grads(q, k, v, zeros, upcast=False, softcap=20.0, dlse=dlse)
    for name, g, r, n in zip(("dq", "dk"), (dq, dk), ref, naive):
        assert_close_by_rule(g, r, n, f"lse only {name}")


# ------------------------------------------------------------------------------------------- eager autograd path


def test_eager_path_matches_registered_op():
    """attention() runs the registered op, whose autograd formula is the C++ one (AttentionAutograd in flash_api.cpp),
    the same node torch.compile records; called through attention() or directly, out, LSE, dK and dV (MHA: written
    without atomics) are bitwise equal, and dQ (summed with atomics in a varying order) passes the rule on both."""
    dtype = _built_dtype(128)
    q, k, v, dout = _inputs(2, 257, 300, 3, 3, 128, dtype)
    dlse = torch.randn(2, 3, 257, device="cuda")
    opts = dict(window_size=(100, 0), softcap=10.0)
    ref_dq = attention_ref_grads(q, k, v, dout, dlse=dlse, **opts)[0]
    naive_dq = attention_ref_grads(q, k, v, dout, upcast=False, dlse=dlse, **opts)[0]
    results = []
    for path in ("attention", "op"):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        if path == "attention":
            out, lse = attention(*leaves, return_lse=True, **opts)
        else:
            out, lse = torch.ops.flash_attn_hopper.fwd(*leaves, 128**-0.5, False, 100, 0, 10.0, False)
        assert "AttentionAutograd" in out.grad_fn.name(), out.grad_fn.name()
        dq, dk, dv = torch.autograd.grad([out, lse], leaves, [dout, dlse])
        assert_close_by_rule(dq, ref_dq, naive_dq, f"{path} dq")
        results.append((out, lse, dk, dv))
    for name, a, b in zip(("out", "lse", "dk", "dv"), *results):
        assert torch.equal(a, b), name


def test_no_grad_calls_skip_autograd():
    """Without requires_grad (or under no_grad) the result has no graph."""
    dtype = _built_dtype(64)
    q, k, v, _ = _inputs(1, 64, 64, 2, 2, 64, dtype)
    assert attention(q, k, v).grad_fn is None
    with torch.no_grad():
        assert attention(q.requires_grad_(True), k, v).grad_fn is None
