"""GPU tests modelled on bug reports filed against other attention kernels (FlashAttention 2/3/4, xformers, cuDNN /
PyTorch SDPA, Triton and Pallas flash attention, ...). Each test targets one kind of fault that such a report
describes and would catch it in this library; the report is cited by URL in the comment above the test. The tests
are this project's own: only the shapes and conditions of the reports are taken over.

Every result is checked by the rule of DESIGN.md §3 (``flash_attn_hopper.testing.assert_close_by_rule`` against the
float32 reference, with the error of the same reference run in the input dtype as the yardstick), outputs and
gradients come from NaN-poisoned memory where the helpers allow it, and the conventions of DESIGN.md §2 (bottom-right
masks, rows that see no key give output 0 / LSE -inf / dQ 0, inputs never modified, the current stream) are asserted
exactly. Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the
build lacks a head_dim / dtype (``require_built``)."""

import math
import traceback

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen, testing
from flash_attn_hopper.testing import (
    assert_close_by_rule,
    attention_ref,
    attention_ref_grads,
    attention_varlen_ref,
    attention_varlen_ref_grads,
    local_mask,
    repeat_kv,
)
from gpu_helpers import attention_inputs, bits, built_dtype, check_attention, check_attention_varlen
from gpu_helpers import check_grads_where_required, cu_seqlens, in_canary_buffers
from gpu_helpers import poison_allocator, randn, require_built, run_attention

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
GRAD_NAMES = ("dq", "dk", "dv")


# ------------------------------------------------------------------------------------------------------- helpers


def _leaves(*tensors):
    """Leaves that require grad and share the tensors' memory and strides."""
    return [t.detach().requires_grad_(True) for t in tensors]


def _assert_blind_rows_zero(out, lse, dq, name):
    """Dense layout. Call after the rule check (which makes lse's -inf pattern the reference's): rows whose LSE is
    -inf (they see no key) have an output row and a dQ row of exactly 0; no LSE is NaN."""
    assert not torch.isnan(lse).any(), f"{name}: LSE holds NaN"
    empty = torch.isneginf(lse)  # (batch, nheads, seqlen_q)
    if empty.any():
        for what, t in (("out", out), ("dq", dq)):
            rows = t.permute(0, 2, 1, 3)[empty]
            assert torch.equal(rows, torch.zeros_like(rows)), f"{name}: {what} rows that see no key are not exactly 0"
    return empty


def _varlen_inputs(lengths_q, lengths_k, nheads, nheads_k, head_dim, dtype, scale=1.0):
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = (randn(total_q, nheads, head_dim, dtype=torch.float32) * scale).to(dtype)
    k = (randn(total_k, nheads_k, head_dim, dtype=torch.float32) * scale).to(dtype)
    v = randn(total_k, nheads_k, head_dim, dtype=dtype)
    dout = randn(total_q, nheads, head_dim, dtype=dtype)
    return q, k, v, dout


def _varlen_run(q, k, v, dout, cu_q, cu_k, max_q, max_k, dlse=None, **opts):
    """attention_varlen forward and backward on leaves, NaN poisoned before each pass: (out, lse, (dq, dk, dv))."""
    leaves = _leaves(q, k, v)
    e = q.element_size()
    poison_allocator(q.shape[0] * q.shape[1] * v.shape[-1] * e, q.shape[0] * q.shape[1] * 4)
    out, lse = attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, return_lse=True, **opts)
    poison_allocator(q.numel() * e, k.numel() * e, v.numel() * e)
    outputs, grads_in = ([out, lse], [dout, dlse]) if dlse is not None else ([out], [dout])
    grads = torch.autograd.grad(outputs, leaves, grads_in)
    return out.detach(), lse.detach(), grads


def _ref_grads_through(build, leaves, dout, upcast, **opts):
    """Gradients of the reference attention with respect to `leaves`, where build(*leaves) makes (q, k, v) from them
    (expands, splits): float32 (upcast) or the naive input dtype."""
    compute = torch.float32 if upcast else leaves[0].dtype
    xs = [t.detach().to(compute).requires_grad_(True) for t in leaves]
    with torch.enable_grad():
        out, _ = attention_ref(*build(*xs), upcast=upcast, **opts)
        with testing._reference_mode(out.device.type):  # the backward in the references' mode too (round 43's HJ)
            return torch.autograd.grad(out, xs, dout.to(out.dtype))


def _with_layout(kind, batch, seqlen, nheads, head_dim, dtype):
    """A random (batch, seqlen, nheads, head_dim) tensor laid out as `kind` says (stride(-1) == 1 always)."""
    if kind == "contiguous":
        t = randn(batch, seqlen, nheads, head_dim, dtype=dtype)
    elif kind == "offset":  # a view with storage offset 64 elements (128 bytes) into a larger buffer
        flat = randn(64 + batch * seqlen * nheads * head_dim, dtype=dtype)
        t = flat[64:].view(batch, seqlen, nheads, head_dim)
        assert t.storage_offset() == 64 and t.is_contiguous()
    elif kind == "transposed":  # made in SDPA's (batch, nheads, seqlen, head_dim) layout
        t = randn(batch, nheads, seqlen, head_dim, dtype=dtype).transpose(1, 2)
        assert nheads == 1 or not t.is_contiguous()  # with one head it is contiguous after all
    elif kind == "sliced":  # the last head_dim columns of a wider tensor: base 16 bytes in, row stride head_dim + 8
        t = randn(batch, seqlen, nheads, head_dim + 8, dtype=dtype)[..., 8:]
        assert t.storage_offset() == 8 and not t.is_contiguous()
    elif kind == "expanded":  # one batch element broadcast over the batch (stride 0)
        t = randn(1, seqlen, nheads, head_dim, dtype=dtype).expand(batch, seqlen, nheads, head_dim)
        assert t.stride(0) == 0
    else:
        raise AssertionError(kind)
    assert t.shape == (batch, seqlen, nheads, head_dim) and t.stride(-1) == 1
    return t


def _require_free_memory(nbytes):
    torch.cuda.empty_cache()  # blocks cached by earlier tests do not count as free
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes:
        pytest.skip(f"needs {nbytes / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")


# ---------------------------------------------------------------------------------------------- sequence lengths


# https://github.com/NVIDIA/TransformerEngine/pull/399
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 777), (255, 1), (1, 128), (128, 1)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_seqlen_one_on_either_side(dtype, head_dim, causal, seqlen_q, seqlen_k):
    """Decoding (one query against a long KV sequence, GQA 4/2) and a single key, forward and backward. Bottom-right
    causal: the single query row is the last row and sees every key; with one key only the last query row sees it
    (its output is that key's value row) and every earlier row is empty. With one key P is 1, so dQ and dK are 0 up
    to rounding and the naive reference is exactly 0: there each dK sums over one head's rows only (MHA)."""
    require_built(head_dim, dtype)
    nheads_k = 4 if seqlen_k == 1 else 2
    q, k, v, dout = attention_inputs(2, seqlen_q, seqlen_k, 4, nheads_k, head_dim, dtype)
    out, lse, grads = run_attention(q, k, v, dout, causal=causal)
    name = f"{seqlen_q}x{seqlen_k} causal={causal}"
    check_attention(out, lse, grads, q, k, v, dout, name, causal=causal)
    empty = _assert_blind_rows_zero(out, lse, grads[0], name)
    expected_empty = causal and seqlen_q > seqlen_k
    assert bool(empty.any()) == expected_empty, f"{name}: rows without keys where none (or all) were expected"
    if seqlen_q == 1:
        assert torch.isfinite(lse).all(), f"{name}: the decoding query must see every key"


# https://github.com/jax-ml/jax/issues/27224
@pytest.mark.parametrize(
    "seqlen_q,seqlen_k", [(9, 12), (12, 9), (17, 17), (127, 129), (129, 127), (255, 257), (1023, 137)]
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_lengths_off_the_tile_grid(dtype, head_dim, causal, seqlen_q, seqlen_k):
    """Lengths shorter than one tile (9, 12: NaN from unmasked loads in SageAttention's report) and one past or
    short of a tile multiple on either side (137: FlexAttention's report), forward and backward."""
    require_built(head_dim, dtype)
    q, k, v, dout = attention_inputs(2, seqlen_q, seqlen_k, 3, 3, head_dim, dtype)
    out, lse, grads = run_attention(q, k, v, dout, causal=causal)
    name = f"{seqlen_q}x{seqlen_k} causal={causal}"
    check_attention(out, lse, grads, q, k, v, dout, name, causal=causal)
    _assert_blind_rows_zero(out, lse, grads[0], name)


BLIND_CASES = [
    (700, 301, dict(causal=True)),
    (700, 301, dict(causal=True, window_size=(64, 0))),
    (129, 40, dict(window_size=(32, 64))),  # a window that misses every key of the first rows (FA issue 2199)
]


# https://github.com/Dao-AILab/flash-attention/issues/1778
@pytest.mark.parametrize("seqlen_q,seqlen_k,opts", BLIND_CASES, ids=["causal", "causal-window", "window"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rows_that_see_no_key(dtype, seqlen_q, seqlen_k, opts):
    """seqlen_q > seqlen_k with bottom-right masks, GQA 6/2: the first rows see no key. Their output and dQ rows are
    exactly 0, their LSE -inf, and they add nothing to dK and dV: giving them a huge dO leaves dK, dV where the
    original reference is."""
    head_dim = 128
    require_built(head_dim, dtype)
    q, k, v, dout = attention_inputs(2, seqlen_q, seqlen_k, 6, 2, head_dim, dtype)
    out, lse, grads = run_attention(q, k, v, dout, **opts)
    check_attention(out, lse, grads, q, k, v, dout, "blind rows", **opts)
    empty = _assert_blind_rows_zero(out, lse, grads[0], "blind rows")
    assert empty.any() and not empty.all(), "the construction must leave some rows without keys"
    dout2 = dout.clone()
    blind = empty.permute(0, 2, 1)  # (batch, seqlen_q, nheads)
    dout2[blind] = randn(int(blind.sum()), head_dim, dtype=dtype) * 100
    _, _, grads2 = run_attention(q, k, v, dout2, **opts)
    ref = attention_ref_grads(q, k, v, dout, upcast=True, **opts)
    naive = attention_ref_grads(q, k, v, dout, upcast=False, **opts)
    for i in (1, 2):
        assert_close_by_rule(grads2[i], ref[i], naive[i], f"{GRAD_NAMES[i]} with the blind rows' dO changed")


WINDOW_COUNT_CASES = [
    (300, 300, (299, 0), True),  # (S - 1, 0) under causal: exactly the causal mask (FA issue 1133)
    (300, 300, (63, 0), True),  # a sliding window of 64 keys, the query's own included
    (300, 300, (0, 0), False),  # the diagonal only
    (300, 300, (17, 3), False),
    (200, 300, (50, 10), False),  # bottom-right aligned
]


# https://github.com/huggingface/transformers/issues/39408
@pytest.mark.parametrize("seqlen_q,seqlen_k,window,causal", WINDOW_COUNT_CASES)
def test_window_size_counts_keys(seqlen_q, seqlen_k, window, causal):
    """Off-by-one windows: every key holds the same (random) row, so a row's scores are all equal and its LSE is
    score + log(number of keys it sees); that count must be what DESIGN.md §2's window rule says
    (i + sk - sq - left <= j <= i + sk - sq + right), key for key. Output (the mean of the visible values) and
    gradients by the rule."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    batch, nheads, nheads_k = 2, 4, 2
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k_row = randn(batch, 1, nheads_k, head_dim, dtype=dtype)
    k = k_row.expand(batch, seqlen_k, nheads_k, head_dim).contiguous()
    v = randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    dout = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    opts = dict(causal=causal, window_size=window)
    out, lse, grads = run_attention(q, k, v, dout, **opts)
    check_attention(out, lse, grads, q, k, v, dout, f"window {window}", **opts)
    visible = local_mask(seqlen_q, seqlen_k, window, causal, device=q.device).sum(dim=1)  # (seqlen_q,)
    assert (visible > 0).all(), "the construction must give every row a key"
    score = torch.einsum("bqhd,bhd->bhq", q.double(), repeat_kv(k_row, nheads)[:, 0].double()) / math.sqrt(head_dim)
    counts = torch.exp(lse.double() - score)  # (batch, nheads, seqlen_q)
    expected = visible.double().expand_as(counts)
    assert torch.equal(torch.round(counts), expected), (
        f"window {window} causal={causal}: keys seen per row differ from the window rule at rows "
        f"{(torch.round(counts) != expected).nonzero()[:5].tolist()}"
    )


# ---------------------------------------------------------------------------------------------- variable length


# https://github.com/Dao-AILab/flash-attention/issues/443
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_one_key_per_sequence_causal(dtype):
    """The report's batch: query sequences of 76, 34 and 146 rows, one key each, causal, head_dim 32, inputs scaled
    by 3 (NaN in dQ). Bottom-right: only each sequence's last query row sees its key."""
    head_dim = 32  # runs on the 64-wide kernels
    require_built(head_dim, dtype)
    lq, lk = [76, 34, 146], [1, 1, 1]
    q, k, v, dout = _varlen_inputs(lq, lk, 1, 1, head_dim, dtype, scale=3.0)
    v = v * 3
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    out, lse, grads = _varlen_run(q, k, v, dout, cu_q, cu_k, max(lq), max(lk), causal=True)
    for gname, g in zip(GRAD_NAMES, grads):
        assert not torch.isnan(g).any(), f"{gname} holds NaN"
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, "one key per sequence", causal=True)
    assert int(torch.isfinite(lse).sum()) == len(lq), "exactly one row per sequence sees a key"


# https://github.com/Dao-AILab/flash-attention/issues/2562
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_empty_query_sequences_gqa(dtype, head_dim, causal):
    """The report's padding trick: cu_seqlens_q [0, 0, 1208, 2048, 2048] against cu_seqlens_k [0, 2538, 4280, 5120,
    8192], 4 query heads on 1 KV head. Keys whose query sequence is empty get dK and dV of exactly 0."""
    require_built(head_dim, dtype)
    lq, lk = [0, 1208, 840, 0], [2538, 1742, 840, 3072]
    q, k, v, dout = _varlen_inputs(lq, lk, 4, 1, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    out, lse, grads = _varlen_run(q, k, v, dout, cu_q, cu_k, max(lq), max(lk), causal=causal)
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, "empty query sequences", causal=causal)
    for gname, g in (("dk", grads[1]), ("dv", grads[2])):
        for lo, hi in ((0, 2538), (5120, 8192)):
            rows = g[lo:hi]
            assert torch.equal(rows, torch.zeros_like(rows)), f"{gname} rows {lo}:{hi} (no queries) are not exactly 0"


# https://github.com/facebookresearch/xformers/pull/1042
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_empty_key_sequences_in_canary_buffers(head_dim, causal):
    """Key sequences of length 0 between non-empty ones (NaN output there in xformers; out-of-bounds writes for
    zero-length KV in FlashAttention PR 1155): q, k, v and dO live inside NaN-filled buffers, which must come out
    unchanged (nothing written around the tensors) with no NaN read into any result; the sequences without keys
    get output 0, LSE -inf and dQ 0."""
    dtype = built_dtype(head_dim)
    # Key sequences of 37 and 45 between the empty ones, not 2: at exactly two keys the backward's D = rowsum(dO * O),
    # taken from the rounded O as in every FlashAttention backward, can put dQ / dK just past the rule
    # (docs/conventions.md, Accuracy at very short key ranges); this test is about the empty ones.
    lq, lk = [1, 2, 1, 2, 130], [0, 37, 0, 45, 0]
    q, k, v, dout = _varlen_inputs(lq, lk, 2, 2, head_dim, dtype)
    (qc, kc, vc, dc), check = in_canary_buffers(q, k, v, dout)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    out, lse, grads = _varlen_run(qc, kc, vc, dc, cu_q, cu_k, max(lq), max(lk), causal=causal)
    check(out, lse, grads)
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, "empty key sequences", causal=causal)
    no_keys = torch.cat([torch.full((n,), m == 0, dtype=torch.bool) for n, m in zip(lq, lk)]).cuda()
    assert torch.isneginf(lse[:, no_keys]).all(), "rows of sequences without keys must have LSE -inf"


# https://github.com/Dao-AILab/flash-attention/issues/1537
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_max_seqlen_one_with_empty_sequences(dtype, causal):
    """The report's batch: query lengths [0, 1, 0, 1] (max_seqlen_q 1) against key lengths [0, 3, 0, 5], 9 query
    heads on 3 KV heads, softmax_scale 1.0."""
    head_dim = 64
    require_built(head_dim, dtype)
    lq, lk = [0, 1, 0, 1], [0, 3, 0, 5]
    q, k, v, dout = _varlen_inputs(lq, lk, 9, 3, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    opts = dict(causal=causal, softmax_scale=1.0)
    out, lse, grads = _varlen_run(q, k, v, dout, cu_q, cu_k, 1, 5, **opts)
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, "max_seqlen 1", **opts)
    assert torch.isfinite(lse).all(), "both query rows see keys"


# https://github.com/Dao-AILab/flash-attention/issues/1619
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_fewer_tokens_than_sequences(dtype):
    """Four sequences holding one token in all (cu_seqlens [0, 0, 0, 0, 1]), 21 query heads on 7 KV heads, head_dim
    120, softmax_scale sqrt(120) as in the report: the one query sees the one key, so out is v's row (out and LSE by
    the rule). With P = 1, dV is the sum of the group's three dO rows (to one rounding of the output) and dQ, dK
    vanish up to float32 rounding of dS = dP - D (bounded by a few float32 ulps of the dP terms). Then the same heads
    with 3 query and 5 key tokens in the last of four sequences, checked in full."""
    head_dim = 120  # runs on the 128-wide kernels
    require_built(head_dim, dtype)
    cu = torch.tensor([0, 0, 0, 0, 1], dtype=torch.int32, device="cuda")
    q, k, v, dout = _varlen_inputs([1], [1], 21, 7, head_dim, dtype)
    scale = math.sqrt(head_dim)
    out, lse, grads = _varlen_run(q, k, v, dout, cu, cu, 1, 1, softmax_scale=scale)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu, cu, softmax_scale=scale)
    naive, naive_lse = attention_varlen_ref(q, k, v, cu, cu, softmax_scale=scale, upcast=False)
    assert_close_by_rule(out, ref, naive, "one token out")
    assert_close_by_rule(lse, ref_lse, naive_lse, "one token lse")
    for gname, g, t in zip(GRAD_NAMES, grads, (q, k, v)):
        assert g.shape == t.shape and torch.isfinite(g).all(), f"one token {gname}"
    dq, dk, dv = (g.float() for g in grads)
    dv_ref = dout.float().view(1, 7, 3, head_dim).sum(2)  # query heads 3g..3g+2 read KV head g
    eps = torch.finfo(dtype).eps
    assert ((dv - dv_ref).abs() <= eps * dv_ref.abs() + 1e-6).all(), "one token dv: not the sum of the group's dO rows"
    # dP = dO . v and D = dO . O (O = v exactly) are float32 sums of at most 128 products: each within 128 x 2^-24 of
    # sum |dO| |v|, so |dS| <= 2^-16 of it; dQ = softmax_scale dS k, dK sums three query heads' softmax_scale dS q.
    dp_mag = (dout.float().abs() * v.float().abs().repeat_interleave(3, dim=1)).sum(-1).max().item()
    bound = scale * dp_mag * 2.0**-16 * max(q.float().abs().max().item(), k.float().abs().max().item()) * 3
    for gname, g in (("dq", dq), ("dk", dk)):
        assert g.abs().max().item() <= bound, f"one token {gname}: {g.abs().max().item():.3e} > {bound:.3e} (should cancel)"

    lq, lk = [0, 0, 0, 3], [0, 0, 0, 5]
    q, k, v, dout = _varlen_inputs(lq, lk, 21, 7, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    out, lse, grads = _varlen_run(q, k, v, dout, cu_q, cu_k, 3, 5, causal=True)
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, "3 tokens in 4 sequences", causal=True)


# https://github.com/pytorch/pytorch/issues/81077
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_many_empty_sequences_and_one_long(causal):
    """257 sequences, nearly all empty on both sides, one of 1500 queries x 1700 keys, one with 40 keys and no
    queries, one with 3 queries and no keys (NaN from zero-length sequences in PyTorch's report)."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    lq, lk = [0] * 257, [0] * 257
    lq[100], lk[100] = 1500, 1700
    lk[7] = 40
    lq[200] = 3
    q, k, v, dout = _varlen_inputs(lq, lk, 4, 2, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    out, lse, grads = _varlen_run(q, k, v, dout, cu_q, cu_k, max(lq), max(lk), causal=causal)
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, "many empty", causal=causal)
    for gname, g in (("dk", grads[1]), ("dv", grads[2])):
        rows = g[:40]  # sequence 7's keys: no query sees them
        assert torch.equal(rows, torch.zeros_like(rows)), f"{gname} of keys without queries is not exactly 0"
    assert torch.isneginf(lse[:, 1500:]).all(), "sequence 200's queries have no keys"


# https://github.com/unslothai/unsloth/pull/10879
def test_varlen_cu_seqlens_updated_in_place():
    """attention_varlen keeps what it read from a cu_seqlens tensor while the tensor is unchanged (README): writing
    new boundaries into the same tensor must be seen, both by the kernels (results for the new sequences) and by the
    host check (a max_seqlen below the new longest sequence raises)."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    q, k, v, dout = _varlen_inputs([300], [300], 4, 2, head_dim, dtype)
    cu = cu_seqlens([100, 50, 150])
    first = attention_varlen(q, k, v, cu, cu, 150, 150, causal=True)
    ref, _ = attention_varlen_ref(q, k, v, cu, cu, causal=True)
    naive, _ = attention_varlen_ref(q, k, v, cu, cu, causal=True, upcast=False)
    assert_close_by_rule(first, ref, naive, "first boundaries")

    cu.copy_(cu_seqlens([20, 200, 80]))
    out, lse, grads = _varlen_run(q, k, v, dout, cu, cu, 200, 200, causal=True)
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu, cu, "boundaries written in place", causal=True)

    cu[1:] = cu_seqlens([10, 10, 280])[1:]
    with pytest.raises(ValueError, match="holds a sequence of length 280"):
        attention_varlen(q, k, v, cu, cu, 200, 200, causal=True)


# https://github.com/Dao-AILab/flash-attention/pull/2544
@pytest.mark.parametrize("opts", [{}, dict(causal=True), dict(window_size=(64, 16))], ids=["full", "causal", "window"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_softcap_backward(dtype, opts):
    """Softcap 15 through the varlen backward (wrong dQ in FlashAttention's report), GQA 6/2, lengths 217 x 128 as in
    the report plus empty and one-row sequences, inputs scaled by 2 so the scores reach the cap's curved part, and a
    loss that also uses the LSE."""
    head_dim = 128
    require_built(head_dim, dtype)
    lq, lk = [217, 128, 0, 300, 1], [128, 217, 50, 0, 9]
    q, k, v, dout = _varlen_inputs(lq, lk, 6, 2, head_dim, dtype, scale=2.0)
    dlse = torch.randn(6, sum(lq), device="cuda")
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    opts = dict(opts, softcap=15.0)
    out, lse, grads = _varlen_run(q, k, v, dout, cu_q, cu_k, max(lq), max(lk), dlse=dlse, **opts)
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, "varlen softcap", dlse=dlse, **opts)


# ------------------------------------------------------------------------------------------------ memory layouts


# https://github.com/Dao-AILab/flash-attention/issues/355
@pytest.mark.parametrize("how", ["transpose", "sum", "cat_unaligned", "cat_offset", "cat_heads"])
def test_dout_layouts_made_by_autograd(how):
    """dO as autograd hands it over after the ops that follow attention: a transposed view (the output used in
    SDPA's layout), an expanded scalar (out.sum(), xformers PR 282), and slices of a torch.cat's gradient (FA issue
    91) whose row stride or base is not 16-byte aligned, or that run along the heads. The gradients must be those of
    dO's values."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    batch, seqlen_q, seqlen_k, nheads = 2, 203, 113, 4
    q, k, v, _ = attention_inputs(batch, seqlen_q, seqlen_k, nheads, 2, head_dim, dtype)
    leaves = _leaves(q, k, v)
    out = attention(*leaves, causal=True)
    seen = {}

    def note_layout(g):  # what the attention backward receives as dO
        seen["dout"] = (g.stride(), g.data_ptr() % 16, g.is_contiguous())

    out.register_hook(note_layout)
    if how == "transpose":
        w = randn(batch, nheads, seqlen_q, head_dim, dtype=dtype)
        loss = (out.transpose(1, 2) * w).sum()
        dout = w.transpose(1, 2)
    elif how == "sum":
        loss = out.sum()
        dout = torch.ones_like(out)
    elif how in ("cat_unaligned", "cat_offset"):
        extra = randn(batch, seqlen_q, nheads, 4, dtype=dtype)
        w = randn(batch, seqlen_q, nheads, head_dim + 4, dtype=dtype)
        pieces = [out, extra] if how == "cat_unaligned" else [extra, out]
        loss = (torch.cat(pieces, dim=-1) * w).sum()
        dout = w[..., :head_dim] if how == "cat_unaligned" else w[..., 4:]
    else:
        extra = randn(batch, seqlen_q, 3, head_dim, dtype=dtype)
        w = randn(batch, seqlen_q, nheads + 3, head_dim, dtype=dtype)
        loss = (torch.cat([out, extra], dim=2) * w).sum()
        dout = w[:, :, :nheads]
    poison_allocator(q.numel() * q.element_size(), k.numel() * k.element_size())
    grads = torch.autograd.grad(loss, leaves)
    stride, misalign, contiguous = seen["dout"]
    layout_ok = {
        "transpose": not contiguous and stride[1] == head_dim,
        "sum": stride == (0, 0, 0, 0),
        "cat_unaligned": (stride[2] * q.element_size()) % 16 != 0,
        "cat_offset": misalign != 0,
        "cat_heads": not contiguous and stride[1] == (nheads + 3) * head_dim,
    }[how]
    assert layout_ok, f"construction: dO reached attention with strides {stride}, base offset {misalign} mod 16"
    ref = attention_ref_grads(q, k, v, dout.contiguous(), causal=True)
    naive = attention_ref_grads(q, k, v, dout.contiguous(), causal=True, upcast=False)
    for gname, g, r, n in zip(GRAD_NAMES, grads, ref, naive):
        assert_close_by_rule(g, r, n, f"dO {how} {gname}")


MIXED = [("offset", "transposed", "sliced"), ("transposed", "contiguous", "offset"), ("sliced", "sliced", "transposed")]


# https://github.com/Dao-AILab/flash-attention/pull/818
@pytest.mark.parametrize("nheads_k", [4, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("layouts", MIXED, ids=["-".join(m) for m in MIXED])
def test_mixed_input_layouts(layouts, nheads_k):
    """q, k and v each in its own layout (a storage offset, SDPA's transposed layout, a slice of a wider tensor), dO
    transposed: each tensor's own strides must be used (FlashAttention's backward mixed up k's and v's). Forward and
    backward by the rule; the inputs unchanged."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    batch, seqlen_q, seqlen_k, nheads = 2, 203, 113, 4
    q = _with_layout(layouts[0], batch, seqlen_q, nheads, head_dim, dtype)
    k = _with_layout(layouts[1], batch, seqlen_k, nheads_k, head_dim, dtype)
    v = _with_layout(layouts[2], batch, seqlen_k, nheads_k, head_dim, dtype)
    dout = _with_layout("transposed", batch, seqlen_q, nheads, head_dim, dtype)
    before = [t.clone() for t in (q, k, v, dout)]
    out, lse, grads = run_attention(q, k, v, dout, causal=True)
    check_attention(out, lse, grads, q, k, v, dout, f"layouts {layouts}", causal=True)
    for t, b in zip((q, k, v, dout), before):
        assert torch.equal(t, b), "an input was modified"


# https://github.com/NVIDIA/TransformerEngine/issues/1195
@pytest.mark.parametrize("mask", [dict(window_size=(-1, 0)), dict(causal=True)], ids=["window-1_0", "causal"])
@pytest.mark.parametrize("nheads_k", [1, 2])
def test_qkv_split_along_heads_gqa(nheads_k, mask):
    """One projection output (batch, seqlen, 16 + 2 * nheads_k, head_dim) split along the heads into q, k, v (the
    report's GQA/MQA layout, where a fused kernel ignored the strides). The gradient of the packed tensor holds dQ,
    dK, dV in its three head ranges."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    batch, seqlen, nheads = 2, 513, 16
    qkv = randn(batch, seqlen, nheads + 2 * nheads_k, head_dim, dtype=dtype)
    before = qkv.clone()
    qkv.requires_grad_(True)
    q, k, v = qkv.split([nheads, nheads_k, nheads_k], dim=2)
    assert not q.is_contiguous() and k.stride(1) == (nheads + 2 * nheads_k) * head_dim
    dout = randn(batch, seqlen, nheads, head_dim, dtype=dtype)
    poison_allocator(q.numel() * q.element_size(), batch * nheads * seqlen * 4)
    out, lse = attention(q, k, v, return_lse=True, **mask)
    poison_allocator(qkv.numel() * qkv.element_size())
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert torch.equal(qkv.detach(), before), "the packed input was modified"
    grads = dqkv.split([nheads, nheads_k, nheads_k], dim=2)
    check_attention(out.detach(), lse.detach(), grads, *(t.detach() for t in (q, k, v)), dout, "split qkv", **mask)


# https://github.com/pytorch/pytorch/issues/191937
@pytest.mark.parametrize("seqlen_k", [33, 97])
@pytest.mark.parametrize("broadcast", ["batch", "heads"])
def test_broadcast_kv_with_stride_zero(broadcast, seqlen_k):
    """k and v broadcast with stride 0 (the report: wrong output for expanded k/v with kv length = 1 mod 32), over the
    batch (one KV set for all rows) or over the KV heads; the gradients reach the unexpanded tensors summed over the
    broadcast dimension."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    batch, seqlen_q, nheads, nheads_k = 3, 150, 4, 2
    shape = (batch, seqlen_k, nheads_k, head_dim)
    base_shape = (1, seqlen_k, nheads_k, head_dim) if broadcast == "batch" else (batch, seqlen_k, 1, head_dim)
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k1, v1 = randn(*base_shape, dtype=dtype), randn(*base_shape, dtype=dtype)
    dout = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)

    def build(q, k1, v1):
        return q, k1.expand(shape), v1.expand(shape)

    leaves = _leaves(q, k1, v1)
    qx, kx, vx = build(*leaves)
    assert 0 in kx.stride() and 0 in vx.stride()
    poison_allocator(q.numel() * q.element_size(), batch * nheads * seqlen_q * 4)
    out, lse = attention(qx, kx, vx, return_lse=True)
    ref, ref_lse = attention_ref(*build(q, k1, v1), upcast=True)
    naive, naive_lse = attention_ref(*build(q, k1, v1), upcast=False)
    assert_close_by_rule(out.detach(), ref, naive, "broadcast out")
    assert_close_by_rule(lse.detach(), ref_lse, naive_lse, "broadcast lse")
    poison_allocator(q.numel() * q.element_size(), batch * seqlen_k * nheads_k * head_dim * q.element_size())
    grads = torch.autograd.grad(out, leaves, dout)
    ref_g = _ref_grads_through(build, (q, k1, v1), dout, upcast=True)
    naive_g = _ref_grads_through(build, (q, k1, v1), dout, upcast=False)
    for gname, g, t, r, n in zip(GRAD_NAMES, grads, (q, k1, v1), ref_g, naive_g):
        assert g.shape == t.shape, gname
        assert_close_by_rule(g, r, n, f"broadcast {broadcast} {gname}")


# https://github.com/Dao-AILab/flash-attention/pull/2298
def test_layout_changes_between_calls():
    """The same shapes and options called with q, k, v laid out differently from one call to the next (contiguous,
    transposed, a stride-0 broadcast, slices, contiguous again) and fresh values each time: nothing set up for one
    call's layout (a cached kernel, descriptor or check keyed without the strides) may serve the next."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    batch, seqlen_q, seqlen_k, nheads, nheads_k = 2, 257, 203, 4, 2
    for kind in ("contiguous", "transposed", "expanded", "sliced", "contiguous"):
        q = _with_layout(kind, batch, seqlen_q, nheads, head_dim, dtype)
        k = _with_layout(kind, batch, seqlen_k, nheads_k, head_dim, dtype)
        v = _with_layout(kind, batch, seqlen_k, nheads_k, head_dim, dtype)
        dout = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
        out, lse, grads = run_attention(q, k, v, dout, causal=True)
        check_attention(out, lse, grads, q, k, v, dout, f"layout {kind}", causal=True)


# ---------------------------------------------------------------------------------------------------- big shapes


def _releasing_memory(body, *args):
    """body(*args), then whatever it allocated is given back, also when it fails: the frames of a failed call's
    traceback (which pytest keeps for post-mortem debugging) would otherwise hold its tensors, tens of GiB here, for
    the rest of the session."""
    try:
        body(*args)
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        torch.cuda.empty_cache()


def _grid_beyond_65535(batch, seqlen, nheads):
    head_dim = 64
    dtype = built_dtype(head_dim)
    _require_free_memory(48 * 2**30)
    assert batch * nheads > 65535
    q, k, v, dout = attention_inputs(batch, seqlen, seqlen, nheads, nheads, head_dim, dtype)
    out, lse, grads = run_attention(q, k, v, dout, causal=True)
    check_attention(out, lse, grads, q, k, v, dout, f"grid {batch}x{nheads}", causal=True)


# https://github.com/Dao-AILab/flash-attention/issues/1311
@pytest.mark.parametrize("batch,seqlen,nheads", [(28800, 15, 16), (2, 17, 65535)])
def test_grid_beyond_65535(batch, seqlen, nheads):
    """batch * nheads far above 65535 (the report's [28800, 15, 16, 72] batch, and the largest nheads accepted): a
    launch that puts batch * nheads, batch or nheads on a grid dimension capped at 65535 fails or skips work
    (PyTorch PR 176096, MagiAttention PR 40). Forward and backward by the rule on every element. head_dim 64 (the
    report's 72 runs on the 96/128-wide kernels)."""
    _releasing_memory(_grid_beyond_65535, batch, seqlen, nheads)


def _offsets_beyond_int32():
    head_dim = 128
    dtype = built_dtype(head_dim)
    batch, seqlen, nheads = 8200, 128, 16
    _require_free_memory(72 * 2**30)
    q, k, v, dout = attention_inputs(batch, seqlen, seqlen, nheads, nheads, head_dim, dtype)
    assert q.numel() > 2**31
    out, lse, grads = run_attention(q, k, v, dout, causal=True)
    for name, t in zip(("out",) + GRAD_NAMES, (out,) + tuple(grads)):
        assert torch.isfinite(t).all(), f"{name}: not finite (unwritten or wrongly addressed)"
    assert not torch.isnan(lse).any()
    idx = torch.tensor([0, 1, batch // 2, batch - 2, batch - 1], device="cuda")
    check_attention(out[idx], lse[idx], tuple(g[idx] for g in grads), q[idx], k[idx], v[idx], dout[idx],
                    "int32 offsets", causal=True)
    del out, lse, grads
    torch.cuda.empty_cache()

    cu = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * seqlen
    qv, kv, vv = (t.view(batch * seqlen, nheads, head_dim) for t in (q, k, v))
    poison_allocator(q.numel() * q.element_size(), q.numel() // head_dim * 4)
    out, lse = attention_varlen(qv, kv, vv, cu, cu, seqlen, seqlen, causal=True, return_lse=True)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any(), "varlen: not finite"
    out4 = out.view(batch, seqlen, nheads, head_dim)
    lse4 = lse.view(nheads, batch, seqlen).transpose(0, 1)
    ref, ref_lse = attention_ref(q[idx], k[idx], v[idx], causal=True)
    naive, naive_lse = attention_ref(q[idx], k[idx], v[idx], causal=True, upcast=False)
    assert_close_by_rule(out4[idx], ref, naive, "varlen int32 offsets out")
    assert_close_by_rule(lse4[idx], ref_lse, naive_lse, "varlen int32 offsets lse")


# https://github.com/Dao-AILab/flash-attention/pull/1500
def test_offsets_beyond_int32():
    """q, k, v, dO, out, dQ, dK, dV of 2^31 + 2^21 elements each (8200 x 128 x 16 x 128), so the last batch
    elements start past 2^31 elements (and past 2^32 bytes; in the fp32 dQ accumulator past 2^33): an element or row
    offset computed in 32 bits reads or writes the wrong place (FlashAttention's dQ accumulator offset at batch
    10k-15k). Forward and backward, then attention_varlen on the same memory as 8200 sequences; first, middle and
    last batch elements by the rule, every element finite (from NaN-poisoned memory). About 45 GiB."""
    _releasing_memory(_offsets_beyond_int32)


# --------------------------------------------------------------------------------------------------- numerics


LARGE_LOGITS = [(torch.float16, 8.0), (torch.bfloat16, 8.0), (torch.bfloat16, 30.0), (torch.bfloat16, 100.0)]


# https://github.com/pytorch/pytorch/issues/119131
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype,amp", LARGE_LOGITS, ids=["fp16-x8", "bf16-x8", "bf16-x30", "bf16-x100"])
def test_large_logits(dtype, amp, causal):
    """q and k of large magnitude (the report: |q| up to 576, NaN from overflow): logits with a standard deviation of
    amp² (64 to 10^4; fp16 at 8, where the naive fp16 reference still fits). No inf or NaN anywhere; out, LSE and the
    gradients by the rule."""
    head_dim = 64
    require_built(head_dim, dtype)
    q = (randn(2, 300, 4, head_dim, dtype=torch.float32) * amp).to(dtype)
    k = (randn(2, 257, 2, head_dim, dtype=torch.float32) * amp).to(dtype)
    v = randn(2, 257, 2, head_dim, dtype=dtype)
    dout = randn(2, 300, 4, head_dim, dtype=dtype)
    out, lse, grads = run_attention(q, k, v, dout, causal=causal)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any(), "out or LSE overflowed"
    for gname, g in zip(GRAD_NAMES, grads):
        assert torch.isfinite(g).all(), f"{gname} overflowed"
    check_attention(out, lse, grads, q, k, v, dout, f"logits x{amp}", causal=causal)


# https://github.com/Dao-AILab/flash-attention/issues/648
@pytest.mark.parametrize("nheads_k", [8, 1], ids=["gqa8", "mqa"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gqa_lse_and_group_gradients(dtype, nheads_k):
    """The report's shapes (64 query heads on 8 KV heads, seqlen 256, head_dim 128: softmax_lse off the manual value)
    and MQA, with the KV heads scaled differently so that a wrong query-to-KV head mapping changes the LSE; the loss
    uses out and LSE, so dK and dV sum the P ∘ dLSE terms of every query head of a group too."""
    head_dim = 128
    require_built(head_dim, dtype)
    q, k, v, dout = attention_inputs(1, 256, 256, 64, nheads_k, head_dim, dtype)
    k = (k.float() * torch.linspace(0.5, 2.0, nheads_k, device="cuda").view(1, 1, -1, 1)).to(dtype)
    dlse = torch.randn(1, 64, 256, device="cuda")
    out, lse, grads = run_attention(q, k, v, dout, dlse=dlse)
    check_attention(out, lse, grads, q, k, v, dout, f"gqa 64/{nheads_k}", dlse=dlse)


# https://github.com/pytorch/pytorch/issues/181645
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_lse_merges_partial_results(dtype):
    """The LSE must be the natural-log log-sum-exp (flex attention returned it off by ln 2): attention over two
    halves of the keys (split at 173, off the tile grid; the second half a view at a storage offset), merged as ring
    attention merges them with the LSEs, gives the attention over all keys, out and LSE by the rule."""
    head_dim = 128
    require_built(head_dim, dtype)
    q, k, v, _ = attention_inputs(2, 200, 300, 4, 2, head_dim, dtype)
    split = 173
    o1, l1 = attention(q, k[:, :split], v[:, :split], return_lse=True)
    o2, l2 = attention(q, k[:, split:], v[:, split:], return_lse=True)
    lse = torch.logaddexp(l1.double(), l2.double())  # (batch, nheads, seqlen_q)

    def weight(part):
        return torch.exp(part.double() - lse).transpose(1, 2).unsqueeze(-1)  # (batch, seqlen_q, nheads, 1)

    merged = (weight(l1) * o1.double() + weight(l2) * o2.double()).float()
    ref, ref_lse = attention_ref(q, k, v, upcast=True)
    naive, naive_lse = attention_ref(q, k, v, upcast=False)
    assert_close_by_rule(merged, ref, naive, "merged out")
    assert_close_by_rule(lse.float(), ref_lse, naive_lse, "merged lse")


# ------------------------------------------------------------------------------------- side effects and repeats


# https://github.com/Dao-AILab/flash-attention/issues/638
@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_inputs_and_saved_tensors_untouched(api):
    """A call modified tensors it was not given to write (position_ids in the report): q, k, v and dO sit inside
    NaN-filled buffers that must come out bit for bit unchanged, with no NaN read into any result; the forward's out
    and LSE (saved for the backward and held by the caller) are not changed by the backward; cu_seqlens unchanged.
    GQA, causal, window and softcap, a loss through out and LSE."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    opts = dict(causal=True, window_size=(100, 0), softcap=20.0)
    if api == "dense":
        q, k, v, dout = attention_inputs(2, 203, 300, 6, 2, head_dim, dtype)
    else:
        lq, lk = [203, 0, 77], [300, 40, 77]
        q, k, v, dout = _varlen_inputs(lq, lk, 6, 2, head_dim, dtype)
        cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
        cu_before = (cu_q.clone(), cu_k.clone())
    (qc, kc, vc, dc), check = in_canary_buffers(q, k, v, dout)
    leaves = _leaves(qc, kc, vc)
    if api == "dense":
        out, lse = attention(*leaves, return_lse=True, **opts)
    else:
        out, lse = attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), return_lse=True, **opts)
    saved = (bits(out), bits(lse))
    dlse = torch.randn_like(lse)
    grads = torch.autograd.grad([out, lse], leaves, [dc, dlse])
    check(out, lse, grads)
    assert torch.equal(bits(out), saved[0]) and torch.equal(bits(lse), saved[1]), "the backward changed out or LSE"
    if api == "dense":
        check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, "untouched", dlse=dlse, **opts)
    else:
        assert torch.equal(cu_q, cu_before[0]) and torch.equal(cu_k, cu_before[1]), "cu_seqlens changed"
        check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, dout, cu_q, cu_k, "untouched", dlse=dlse, **opts)


# https://github.com/ROCm/triton/issues/953
def test_forward_bitwise_repeatable():
    """Run-to-run differences in a flash-attention forward (a race in the report): the same call three times, with
    other calls of other shapes in between and NaN-poisoned output memory before each, gives bit-identical out and
    LSE; dense (about 1000 tiles for the persistent scheduler, GQA, causal, softcap) and varlen."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    q, k, v, _ = attention_inputs(16, 1000, 1100, 8, 2, head_dim, dtype)  # 16 x 8 x 8 = 1024 tiles over 132 SMs
    opts = dict(causal=True, softcap=20.0)
    lq, lk = [300, 0, 513, 1], [257, 33, 600, 1]
    qv, kv, vv, _ = _varlen_inputs(lq, lk, 8, 2, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    dense, varlen = [], []
    for _ in range(3):
        poison_allocator(q.numel() * q.element_size(), q.shape[0] * q.shape[2] * q.shape[1] * 4)
        dense.append(attention(q, k, v, return_lse=True, **opts))
        attention(q[:, :77], k[:, :500], v[:, :500])
        poison_allocator(qv.numel() * qv.element_size(), qv.shape[0] * qv.shape[1] * 4)
        varlen.append(attention_varlen(qv, kv, vv, cu_q, cu_k, max(lq), max(lk), return_lse=True, causal=True))
        attention(q[:1, :300], k[:1], v[:1], window_size=(50, 50))
    for name, runs in (("dense", dense), ("varlen", varlen)):
        for i, (out, lse) in enumerate(runs[1:], 1):
            assert torch.equal(bits(out), bits(runs[0][0])), f"{name}: out of run {i} differs from run 0"
            assert torch.equal(bits(lse), bits(runs[0][1])), f"{name}: LSE of run {i} differs from run 0"
    out, lse = dense[0]
    ref, ref_lse = attention_ref(q, k, v, upcast=True, **opts)
    naive, naive_lse = attention_ref(q, k, v, upcast=False, **opts)
    assert_close_by_rule(out, ref, naive, "repeat out")
    assert_close_by_rule(lse, ref_lse, naive_lse, "repeat lse")
    out, lse = varlen[0]
    ref, ref_lse = attention_varlen_ref(qv, kv, vv, cu_q, cu_k, causal=True)
    naive, naive_lse = attention_varlen_ref(qv, kv, vv, cu_q, cu_k, causal=True, upcast=False)
    assert_close_by_rule(out, ref, naive, "repeat varlen out")
    assert_close_by_rule(lse, ref_lse, naive_lse, "repeat varlen lse")


# https://github.com/Dao-AILab/flash-attention/issues/359
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward_repeats_many_query_blocks_per_key_block(dtype):
    """The report's shape (batch 60, 2048 queries, 128 keys, one head, inputs scaled by 3: wrong gradients on some of
    50 backward passes, a race): each key block gathers 32 query blocks (kBlockM 64). With deterministic=True five backward passes
    are bit-identical; in the default mode each of three is within the rule."""
    head_dim = 128
    require_built(head_dim, dtype)
    q, k, v, dout = attention_inputs(60, 2048, 128, 1, 1, head_dim, dtype)
    q, k, v = q * 3, k * 3, v * 3
    ref = attention_ref_grads(q, k, v, dout)
    naive = attention_ref_grads(q, k, v, dout, upcast=False)
    for deterministic, repeats in ((True, 5), (False, 3)):
        leaves = _leaves(q, k, v)
        out = attention(*leaves, deterministic=deterministic)
        runs = []
        for _ in range(repeats):
            poison_allocator(q.numel() * q.element_size(), k.numel() * k.element_size())
            runs.append(torch.autograd.grad(out, leaves, dout, retain_graph=True))
        for grads in runs:
            for gname, g, r, n in zip(GRAD_NAMES, grads, ref, naive):
                assert_close_by_rule(g, r, n, f"deterministic={deterministic} {gname}")
        if deterministic:
            for grads in runs[1:]:
                for gname, a, b in zip(GRAD_NAMES, runs[0], grads):
                    assert torch.equal(a, b), f"deterministic {gname} differs between backward passes"


# https://github.com/Dao-AILab/flash-attention/pull/2505
def test_varlen_on_a_busy_side_stream():
    """attention_varlen's forward and backward launched from a side stream that is still busy writing their inputs
    (the report: a kernel launched on the default stream instead of the current one). The cu_seqlens were checked
    by an earlier call, so no host read waits for the side stream; a kernel on any other stream would read the
    stale inputs."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    lq, lk = [300, 0, 129], [257, 33, 129]
    q, k, v, dout = _varlen_inputs(lq, lk, 4, 2, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)  # the host check of these cu_seqlens
    stale = [torch.randn_like(t) for t in (q, k, v, dout)]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    assert side != torch.cuda.current_stream()
    with torch.cuda.stream(side):
        poison_allocator(q.numel() * q.element_size(), k.numel() * k.element_size())  # synchronizes: before the sleep
        torch.cuda._sleep(100_000_000)  # keeps `side` busy for tens of ms
        for dst, src in zip(stale, (q, k, v, dout)):
            dst.copy_(src)
        leaves = [t.requires_grad_(True) for t in stale[:3]]
        out, lse = attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)
        grads = torch.autograd.grad(out, leaves, stale[3])
    torch.cuda.current_stream().wait_stream(side)
    for t in stale + [cu_q, cu_k]:
        t.record_stream(side)
    check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, dout, cu_q, cu_k, "side stream", causal=True)


# https://github.com/pytorch/pytorch/issues/148476
@pytest.mark.parametrize("which", ["q", "k", "v", "kv"])
def test_varlen_gradients_for_some_inputs_only(which):
    """Backward with only some of q, k, v requiring grad (PyTorch's SDPA read an LSE it had not saved when only one
    input wanted a gradient), varlen GQA causal, a loss through out and LSE: the inputs that require grad get the
    right gradients, the others none."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    lq, lk = [130, 0, 77], [100, 20, 77]
    q, k, v, dout = _varlen_inputs(lq, lk, 4, 2, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    dlse = torch.randn(4, sum(lq), device="cuda")
    leaves = {name: t.detach().requires_grad_(name in which) for name, t in zip("qkv", (q, k, v))}
    out, lse = attention_varlen(leaves["q"], leaves["k"], leaves["v"], cu_q, cu_k, max(lq), max(lk), causal=True,
                                return_lse=True)
    assert out.requires_grad
    # the LSE does not depend on v: whether it carries a graph when only v requires grad is the op's choice
    outputs, grads_in = zip(*[(t, g) for t, g in ((out, dout), (lse, dlse)) if t.requires_grad])
    poison_allocator(q.numel() * q.element_size(), k.numel() * k.element_size())
    torch.autograd.backward(outputs, grads_in)
    ref = attention_varlen_ref_grads(q, k, v, dout, cu_q, cu_k, dlse=dlse, causal=True)
    naive = attention_varlen_ref_grads(q, k, v, dout, cu_q, cu_k, upcast=False, dlse=dlse, causal=True)
    check_grads_where_required(leaves, which, ref, naive, dtype, f"only {which}")


# https://github.com/Dao-AILab/flash-attention/issues/54
def test_tensors_on_another_device_than_the_current():
    """Tensors on cuda:1 while cuda:0 is current (the report: all-zero output on cuda:1): the kernels run on the
    tensors' device, under a device guard, forward and backward. Needs two sm90 GPUs."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    if torch.cuda.get_device_capability(1) != (9, 0):
        pytest.skip("cuda:1 is not an sm90 GPU")
    head_dim = 128
    dtype = built_dtype(head_dim)
    device = torch.device("cuda", 1)
    with torch.cuda.device(0):
        q = torch.randn(2, 203, 4, head_dim, dtype=dtype, device=device)
        k = torch.randn(2, 300, 2, head_dim, dtype=dtype, device=device)
        v = torch.randn(2, 300, 2, head_dim, dtype=dtype, device=device)
        dout = torch.randn(2, 203, 4, head_dim, dtype=dtype, device=device)
        leaves = _leaves(q, k, v)
        out, lse = attention(*leaves, causal=True, return_lse=True)
        grads = torch.autograd.grad(out, leaves, dout)
        torch.cuda.synchronize(device)
        assert out.device == device and lse.device == device and all(g.device == device for g in grads)
        check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, "cuda:1", causal=True)
