"""Variable-length batches (``attention_varlen``, issue 5) on an sm90 GPU: out, LSE and dQ, dK, dV against the float32
reference run per sequence (``flash_attn_hopper.testing.attention_varlen_ref``), by the rule of DESIGN.md §3, with
NaN-poisoned memory before each call. Skipped, with the reason, without an sm90 GPU and the built extension."""

import os

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import assert_close_by_rule, attention_varlen_ref
from gpu_helpers import built_dtype as _built_dtype
from gpu_helpers import check_attention_varlen as _check_attention_varlen
from gpu_helpers import poison_allocator as _poison_allocator
from gpu_helpers import randn as _randn
from gpu_helpers import require_built as _require_built

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def _inputs(lengths_q, lengths_k, nheads, nheads_k, head_dim, dtype, extra_q=0, extra_k=0, scale=1.0):
    total_q, total_k = sum(lengths_q) + extra_q, sum(lengths_k) + extra_k
    q = _randn(total_q, nheads, head_dim, dtype=dtype) * scale
    k = _randn(total_k, nheads_k, head_dim, dtype=dtype) * scale
    v = _randn(total_k, nheads_k, head_dim, dtype=dtype)
    dout = _randn(total_q, nheads, head_dim, dtype=dtype)
    return q, k, v, dout


def _run_and_check(q, k, v, dout, cu_q, cu_k, max_q, max_k, name, dlse=None, **opts):
    """Forward and backward against the reference (gpu_helpers.check_attention_varlen: out, LSE, dQ, dK, dV by the
    rule, rows that see no key: out and dQ 0, LSE -inf); dK, dV of key rows past cu_seqlens_k[-1] 0; memory poisoned
    before each pass; inputs unmodified."""
    before = [t.clone() for t in (q, k, v, dout, cu_q, cu_k)]
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    e = q.element_size()
    _poison_allocator(q.numel() * e, k.numel() * e, q.shape[0] * q.shape[1] * 4)
    out, lse = attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, return_lse=True, **opts)
    _poison_allocator(q.numel() * e, k.numel() * e)
    outputs, grads_in = [out], [dout]
    if dlse is not None:
        outputs.append(lse)
        grads_in.append(dlse)
    grads = torch.autograd.grad(outputs, leaves, grads_in)
    _check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, dout, cu_q, cu_k, name, dlse=dlse, **opts)
    last_k = int(cu_k[-1])
    for gname, g in (("dk", grads[1]), ("dv", grads[2])):
        tail = g[last_k:]
        assert torch.equal(tail, torch.zeros_like(tail)), f"{name}: {gname} rows past cu_seqlens_k[-1] are not 0"
    for t, b in zip((q, k, v, dout, cu_q, cu_k), before):
        assert torch.equal(t, b), f"{name}: an input was modified"
    return out, lse, grads


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_issue_case_causal(dtype, head_dim):
    """The issue's lengths: queries [0, 77, 0, 130, 5], keys [10, 77, 0, 60, 200], causal (bottom-right per sequence,
    so the 130-query sequence over 60 keys has 70 rows that see no key, and the 0-key sequence gives nothing), plus 3
    query rows and 2 key rows past the last sequence."""
    _require_built(head_dim, dtype)
    lq, lk = [0, 77, 0, 130, 5], [10, 77, 0, 60, 200]
    q, k, v, dout = _inputs(lq, lk, 4, 4, head_dim, dtype, extra_q=3, extra_k=2)
    _run_and_check(q, k, v, dout, _cu(lq), _cu(lk), max(lq), max(lk), "issue case", causal=True)


@pytest.mark.parametrize(
    "opts",
    [dict(), dict(causal=True), dict(window_size=(17, 3)), dict(softcap=15.0), dict(causal=True, window_size=(40, 0))],
    ids=["full", "causal", "window", "softcap", "causal-window"],
)
@pytest.mark.parametrize("nheads_k", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_varlen_options(opts, nheads_k):
    head_dim = 128
    dtype = _built_dtype(head_dim)
    lq, lk = [1, 300, 129, 0, 64], [5, 257, 129, 33, 0]
    scale = 2.0 if "softcap" in opts else 1.0
    q, k, v, dout = _inputs(lq, lk, 4, nheads_k, head_dim, dtype, scale=scale)
    # max_seqlen larger than the longest sequence is allowed
    _run_and_check(q, k, v, dout, _cu(lq), _cu(lk), max(lq) + 100, max(lk) + 7, f"options {opts}", **opts)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_softcap_each_dtype(dtype):
    """Softcap through the varlen kernels in both dtypes (both compute tanh with tanh.approx.f32)."""
    _require_built(128, dtype)
    lq, lk = [1, 300, 129, 0, 64], [5, 257, 129, 33, 0]
    q, k, v, dout = _inputs(lq, lk, 4, 2, 128, dtype, scale=2.0)
    _run_and_check(q, k, v, dout, _cu(lq), _cu(lk), max(lq), max(lk), f"softcap {dtype}", causal=True, softcap=15.0)


def test_varlen_lse_gradient():
    dtype = _built_dtype(64)
    lq, lk = [50, 0, 200], [70, 10, 150]
    q, k, v, dout = _inputs(lq, lk, 3, 3, 64, dtype)
    dlse = torch.randn(3, sum(lq), device="cuda")
    _run_and_check(q, k, v, dout, _cu(lq), _cu(lk), max(lq), max(lk), "dlse", dlse=dlse, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_equal_lengths_match_dense(causal):
    """Equal lengths: the same numbers as the dense kernel on the (batch, seqlen) view (both checked by the rule; the
    same tiles run, so out and LSE agree to the bit)."""
    dtype = _built_dtype(128)
    batch, seqlen, nheads = 3, 333, 4
    q, k, v, _ = _inputs([seqlen] * batch, [seqlen] * batch, nheads, nheads, 128, dtype)
    cu = _cu([seqlen] * batch)
    out, lse = attention_varlen(q, k, v, cu, cu, seqlen, seqlen, causal=causal, return_lse=True)
    dense_out, dense_lse = attention(
        *(t.view(batch, seqlen, nheads, 128) for t in (q, k, v)), causal=causal, return_lse=True
    )
    assert torch.equal(out.view(batch, seqlen, nheads, 128), dense_out)
    assert torch.equal(lse.view(nheads, batch, seqlen).transpose(0, 1), dense_lse)


def test_varlen_many_sequences_persistent():
    """~200 sequences of random lengths (0 to 300) and 8 heads: many more tiles than SMs, most past their sequence's
    end (the grid is sized by max_seqlen)."""
    dtype = _built_dtype(64)
    gen = torch.Generator().manual_seed(5)
    lq = torch.randint(0, 301, (200,), generator=gen).tolist()
    lk = torch.randint(0, 301, (200,), generator=gen).tolist()
    q, k, v, dout = _inputs(lq, lk, 8, 2, 64, dtype)
    _run_and_check(q, k, v, dout, _cu(lq), _cu(lk), max(lq), max(lk), "many", causal=True)


@pytest.mark.parametrize(
    "causal,softcap,max_q",
    [(False, 0.0, None), (True, 0.0, None), (True, 30.0, None), (False, 0.0, 1024)],
    ids=["full", "causal", "causal-softcap", "mostly-empty"],
)
def test_varlen_alternating_empty_tiles_persistent(causal, softcap, max_q):
    """head_dim 64's persistent 128-row tiles issue each tile's first QKᵀ during the previous tile's drain and
    epilogue, and one that is never read where the next tile sees no key or there is none (FwdKernelTraits::
    kCrossTile). 600 one-tile sequences over 4 heads (~18 tiles per CTA, in the tile counter's order), a third of
    them without keys; with max_seqlen_q 1024, seven tiles in eight lie past their sequence (runs of empty tiles,
    CTAs that end on them)."""
    if os.environ.get("FAH_FWD_BLOCK_M") == "192":
        pytest.skip("tests head_dim 64's 128-row tiles; FAH_FWD_BLOCK_M=192 forces the other height")
    dtype = _built_dtype(64)
    gen = torch.Generator().manual_seed(29)
    n = 600
    lq = torch.randint(1, 129, (n,), generator=gen).tolist()
    lk = [0 if i % 3 == 0 else int(x) for i, x in enumerate(torch.randint(1, 400, (n,), generator=gen))]
    max_q = max_q or max(lq)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = torch.ops.flash_attn_hopper.fwd_block_m(64, 64, n, 4, max_q, max(lk), causal, -1, -1, sms)
    assert rows == 128, f"this shape now runs {rows}-row tiles: pick one that runs 128"
    q, k, v, dout = _inputs(lq, lk, 4, 4, 64, dtype, scale=2.0 if softcap else 1.0)
    _run_and_check(q, k, v, dout, _cu(lq), _cu(lk), max_q, max(lk), "alternating", causal=causal, softcap=softcap)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_varlen_epilogue_slabs(head_dim):
    """The forward stores O of a warpgroup's 64 rows with one TMA store when they lie inside their sequence and copies
    them out row by row when they reach past its end (TMA would write into the next sequence's rows): lengths around
    the multiples of 64, in an order that puts both kinds of slab in one CTA's run of tiles, 150 sequences (head_dim
    192 and 256 stage O in the Q buffer; tests/test_fwd_tiles_gpu.py reruns the head_dim 64 case on 192-row tiles,
    whose third warpgroup's slab starts at row 128)."""
    dtype = _built_dtype(head_dim)
    edges = [1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256]
    gen = torch.Generator().manual_seed(7)
    lq = [edges[i] for i in torch.randint(0, len(edges), (150,), generator=gen).tolist()]
    lk = torch.randint(1, 300, (150,), generator=gen).tolist()
    q, k, v, dout = _inputs(lq, lk, 4, 2, head_dim, dtype)
    _run_and_check(q, k, v, dout, _cu(lq), _cu(lk), max(lq), max(lk), f"slabs hdim{head_dim}")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_varlen_dkv_store_blocks(head_dim):
    """The backward stores a key block's dK and dV with TMA when the block lies inside its sequence and thread by
    thread when it reaches past its end (TMA would write into the next sequence's rows), and only without GQA: MHA,
    key lengths around the multiples of 64 and 128 (the key block heights), so whole and partial blocks alternate
    between neighbouring sequences, both masks."""
    dtype = _built_dtype(head_dim)
    edges = [1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257]
    gen = torch.Generator().manual_seed(11)
    lk = [edges[i] for i in torch.randint(0, len(edges), (24,), generator=gen).tolist()]
    lq = torch.randint(1, 300, (24,), generator=gen).tolist()
    q, k, v, dout = _inputs(lq, lk, 3, 3, head_dim, dtype)
    for causal in (False, True):
        _run_and_check(q, k, v, dout, _cu(lq), _cu(lk), max(lq), max(lk), f"dkv blocks hdim{head_dim}", causal=causal)


def test_varlen_bad_cu_seqlens_raise():
    dtype = _built_dtype(64)
    q, k, v, _ = _inputs([10, 20], [10, 20], 2, 2, 64, dtype)
    good = _cu([10, 20])
    cases = [
        (good.to(torch.int64), good, "must have dtype torch.int32"),
        (good.cpu(), good, "cu_seqlens must be on q's device"),
        (good[None], good, "must be 1-D"),
        (good, _cu([10, 20, 0]), "same length"),
        (torch.tensor([0, 20, 10], dtype=torch.int32, device="cuda"), good, "non-decreasing"),
        (torch.tensor([0, 10, 31], dtype=torch.int32, device="cuda"), good, "past the 30 rows"),
        (torch.tensor([-1, 10, 30], dtype=torch.int32, device="cuda"), good, "offset >= 0"),
    ]
    for cu_q, cu_k, match in cases:
        with pytest.raises(ValueError, match=match):
            attention_varlen(q, k, v, cu_q, cu_k, 30, 30)
    with pytest.raises(ValueError, match="max_seqlen_q is 19 but cu_seqlens_q holds a sequence of length 20"):
        attention_varlen(q, k, v, good, good, 19, 20)
    with pytest.raises(TypeError, match="max_seqlen_k must be a Python int"):
        attention_varlen(q, k, v, good, good, 20, 20.0)


@pytest.mark.parametrize("nheads_k", [4, 1], ids=["mha", "mqa"])
def test_varlen_rows_outside_the_sequences(nheads_k):
    """cu_seqlens starting past row 0 and ending before the last row, for queries and keys: those rows get out 0, LSE
    -inf and dQ, dK, dV 0, from NaN-poisoned memory (the kernels write only the rows inside the sequences; the leading
    rows reach the fill kernel, the trailing ones are cut off by attention_varlen and padded back)."""
    dtype = _built_dtype(128)
    lq, lk = [33, 0, 150], [40, 12, 90]
    lead_q, tail_q, lead_k, tail_k = 5, 1700, 2500, 3
    q, k, v, dout = _inputs(lq, lk, 4, nheads_k, 128, dtype, extra_q=lead_q + tail_q, extra_k=lead_k + tail_k)
    cu_q, cu_k = _cu(lq) + lead_q, _cu(lk) + lead_k
    out, lse, (dq, dk, dv) = _run_and_check(q, k, v, dout, cu_q, cu_k, max(lq), max(lk), "outside rows", causal=True)
    end_q, end_k = lead_q + sum(lq), lead_k + sum(lk)
    for name, t, rows in (("out", out, (lead_q, end_q)), ("dq", dq, (lead_q, end_q)), ("dk", dk, (lead_k, end_k)),
                          ("dv", dv, (lead_k, end_k))):
        outside = torch.cat([t[: rows[0]], t[rows[1]:]])
        assert torch.equal(outside, torch.zeros_like(outside)), f"{name}: rows outside the sequences are not 0"
    assert torch.isneginf(lse[:, :lead_q]).all() and torch.isneginf(lse[:, end_q:]).all()


def test_varlen_op_fills_rows_past_the_last_sequence():
    """The ops called directly (as a torch.compile graph calls them; attention_varlen instead hands the kernels views
    without those rows) on tensors with rows past cu_seqlens[-1], from NaN-poisoned memory: out 0 and LSE -inf there,
    dQ, dK, dV 0 there (the fill kernel's tail branch); the covered rows equal attention_varlen's bitwise (the extra
    rows are finite, masked, and multiply P = 0)."""
    dtype = _built_dtype(128)
    lq, lk = [70, 100], [90, 33]
    q, k, v, dout = _inputs(lq, lk, 2, 2, 128, dtype, extra_q=1500, extra_k=40)
    cu_q, cu_k, nq, nk = _cu(lq), _cu(lk), sum(lq), sum(lk)
    args = (cu_q, cu_k, max(lq), max(lk), 128**-0.5, True, -1, 0, 0.0, False)
    e = q.element_size()
    _poison_allocator(q.numel() * e, q.shape[0] * q.shape[1] * 4)
    out, lse = torch.ops.flash_attn_hopper.fwd_varlen(q, k, v, *args)
    assert torch.equal(out[nq:], torch.zeros_like(out[nq:])), "out rows past the last sequence are not 0"
    assert torch.isneginf(lse[:, nq:]).all(), "LSE past the last sequence is not -inf"
    ref_out, ref_lse = attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)
    assert torch.equal(out[:nq], ref_out[:nq]) and torch.equal(lse[:, :nq], ref_lse[:, :nq])
    _poison_allocator(q.numel() * e, k.numel() * e)
    dq, dk, dv = torch.ops.flash_attn_hopper.bwd_varlen(dout, q, k, v, out, lse, None, *args)
    for name, g, n in (("dq", dq, nq), ("dk", dk, nk), ("dv", dv, nk)):
        assert torch.isfinite(g[:n]).all(), f"{name}: the covered rows are not finite"
        assert torch.equal(g[n:], torch.zeros_like(g[n:])), f"{name}: rows past the last sequence are not 0"


def test_varlen_rows_past_last_sequence_may_hold_nan():
    """A preallocated buffer with NaN in the rows past cu_seqlens[-1]: they belong to no sequence and reach no result
    (the last sequence's partial tile would otherwise load them); their outputs and gradients are 0 (LSE -inf)."""
    dtype = _built_dtype(128)
    lq, lk = [70, 100], [90, 33]
    q, k, v, dout = _inputs(lq, lk, 2, 2, 128, dtype, extra_q=50, extra_k=60)
    for t, n in ((q, sum(lq)), (k, sum(lk)), (v, sum(lk))):
        t[n:] = float("nan")
    ref, ref_lse = attention_varlen_ref(q, k, v, _cu(lq), _cu(lk), causal=True)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, lse = attention_varlen(*leaves, _cu(lq), _cu(lk), max(lq), max(lk), causal=True, return_lse=True)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert torch.equal(out[sum(lq):], torch.zeros_like(out[sum(lq):])) and torch.isneginf(lse[:, sum(lq):]).all()
    naive, _ = attention_varlen_ref(q, k, v, _cu(lq), _cu(lk), causal=True, upcast=False)
    n = sum(lq)
    assert_close_by_rule(out[:n], ref[:n], naive[:n], "nan tail out")
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    for name, g, rows in (("dq", dq, sum(lq)), ("dk", dk, sum(lk)), ("dv", dv, sum(lk))):
        assert torch.isfinite(g).all(), name
        assert torch.equal(g[rows:], torch.zeros_like(g[rows:])), name
