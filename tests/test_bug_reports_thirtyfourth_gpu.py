"""Thirty-fourth round of the bug hunt (tests/bug_report_sources.md, "Thirty-fourth round"), GPU part.

GG: window sides between the two sequence lengths and at the values where a library turns a wide side into
"unbounded". csrc/flash/common/block_range.hpp kernel_window keeps a right side up to seqlen_q and a left side up to
seqlen_k and makes wider ones unbounded; window_hides_nothing takes left >= seqlen_k - 1 and right >= seqlen_q - 1 as
no mask. Bottom-right aligned windows need a right side up to seqlen_q - 1 (not seqlen_k) to reach every key when
seqlen_q > seqlen_k, and a left side up to seqlen_k - 1 (not seqlen_q) when seqlen_k > seqlen_q:
Dao-AILab/flash-attention#895 (a right side above max_seqlen_k reset to unbounded drops the mask of the first
seqlen_q - seqlen_k rows), flashinfer-ai/flashinfer#4972 (a finite left side, unbounded right, qo_len < kv_len: the
first query tile attended keys left of its window), flashinfer-ai/flashinfer#4873 (review: an unbounded side read as
0 when sizing the key range), Dao-AILab/flash-attention#2574 and #2624 (a side of 0 taken as unbounded by `or`).
Each side runs through seqlen_k - 1, seqlen_k, seqlen_k + 1, the first value that leaves no row empty, seqlen_q - 2,
seqlen_q - 1, seqlen_q and seqlen_q + 1 (and the mirror), dense at head_dim 64 (128-row tiles at these sizes) and 256
(64-key blocks), and through attention_varlen, where the maxima (max_seqlen_q / max_seqlen_k) are not any one sequence's
lengths; zero sides with seqlen_q != seqlen_k. Checked: out, LSE, dQ, dK, dV by the rule; rows that see no key exactly
as the window rule says (LSE -inf, out and dQ exactly 0); keys no row sees get dK = dV = 0 exactly.

GH: the forward of a GQA / MQA call must give the bits of the MHA call over K and V repeated per query head: a row's
bits depend on the row, the keys and values it sees and the options (docs/conventions.md, "Forward: what a row's bits
depend on"), and query head h reads K/V head h // group. Reports where packing a group's query heads into the rows of
one tile went wrong: Dao-AILab/flash-attention#2528 (the pack-GQA row division applied to rows that were not packed:
wrong causal limit per row, wrong key-block range from the second query block on), ROCm/rocm-libraries#7221 (review:
the packing folded rows across sequence boundaries in group (varlen) mode), Dao-AILab/flash-attention#2438 (pack_gqa
paths that failed). Cases: causal with seqlen_q < and > seqlen_k (rows that see no key), a window, softcap, an MQA
decode row against 4099 keys, a speculative-decoding verify block (4 rows), head dims 64, 96, 128, 192 / 128 and 256;
varlen with empty and one-token sequences.

GI: attention_varlen's backward over many short sequences whose lengths sit at 64 / 128 multiples +-1 (and 1, 0),
queries without keys and keys without queries, at each backward block height: the dQ workspace gives each sequence
its own whole 128-row tile (docs/conventions.md, "Variable length"), while the backward's query blocks are 128
(head_dim <= 64) or 64 rows (72-256). Dao-AILab/flash-attention#2337 (FlashAttention 4: the preprocess kernel placed
each sequence's dQ accumulator rows by a 128-row tile while the buffer was padded by 64: past the buffer with enough
sequences). Atomic and deterministic (causal) backward, memory poisoned with NaN.

GJ: K and V read from KV-cache slices: `cache[:, :L]` of a preallocated cache (batch stride capacity x row, not L x
row), K and V halves of one block-major cache (`cache[:, 0, :L]`, `cache[:, 1, :L]`, V one whole capacity past K) and
of a token-interleaved one (`cache[:, :L, 0]`, `cache[:, :L, 1]`: row stride twice the head row), each with the cache's
unused tail NaN: a key bound taken from the capacity (or from the batch stride) reads NaN. Decode (seqlen_q 1),
a verify block (5 rows, causal) and a chunked-prefill step (77 rows against 300 keys, causal), forward and backward.
Checked: out, LSE, dQ, dK, dV by the rule against contiguous copies, out and LSE bitwise equal to the call on those
copies, the cache unchanged. Dao-AILab/flash-attention#1417 (outputs of a sliced KV cache differ from those of the
full one over the same lengths), Dao-AILab/flash-attention#772 (with a cache of 4096 positions a prefill wrote into
another batch element's cache rows), ROCm/aiter#3498 (a decode kernel assumed the paged cache contiguous; K / V halves
of an interleaved cache, stride twice that, read the wrong memory). The varlen twin: packed K / V rows as a prefix of
a larger NaN-tailed pool (and K / V interleaved per row).

Inputs are Gaussian (never zeros) from the per-test seed (tests/conftest.py). Skipped, with the reason, without an
sm90 GPU and the built extension (conftest.py), and per test when the build lacks a head_dim / dtype.
tests/test_bug_reports_thirtyfourth_cpu.py checks the premises: that each GG window straddles kernel_window's and
window_hides_nothing's thresholds and masks what the cited faults would not, the GH construction's head mapping
(float64 references), and GI's lengths."""

import pytest
import torch

import flash_attn_hopper
import gpu_helpers
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_varlen_ref, local_mask
from gpu_helpers import (assert_same_bits, attention_inputs, bits, built_dtype, check_attention,
                         check_attention_varlen, cu_seqlens, randn, run_attention, run_attention_varlen)

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

NHEADS, NHEADS_K = 4, 2


# ----------------------------------------------------------------------------------- shared checks of what rows see


def _assert_zero(t, name):
    if not torch.equal(t, torch.zeros_like(t)):
        raise AssertionError(f"{name}: not exactly 0 ({int((t != 0).sum())} nonzero elements)")


def _check_visibility_dense(out, lse, grads, seqlen_q, seqlen_k, window, name):
    """Rows that see no key under the window rule: LSE -inf, out and dQ rows exactly 0; rows that see keys: LSE finite.
    Keys that no row sees: dK, dV exactly 0."""
    visible = local_mask(seqlen_q, seqlen_k, window, device=out.device)
    empty_rows = ~visible.any(dim=1)  # (seqlen_q,)
    unseen_keys = ~visible.any(dim=0)  # (seqlen_k,)
    got_empty = torch.isneginf(lse)  # (batch, nheads, seqlen_q)
    if not torch.equal(got_empty, empty_rows.view(1, 1, -1).expand_as(got_empty)):
        wrong = (got_empty != empty_rows.view(1, 1, -1)).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: rows with LSE -inf differ from the window rule at (b, h, row) {wrong}")
    if empty_rows.any():
        _assert_zero(out[:, empty_rows], f"{name}: out rows that see no key")
        _assert_zero(grads[0][:, empty_rows], f"{name}: dq rows that see no key")
    if unseen_keys.any():
        _assert_zero(grads[1][:, unseen_keys], f"{name}: dk of keys no row sees")
        _assert_zero(grads[2][:, unseen_keys], f"{name}: dv of keys no row sees")


def _run_window_case(head_dim, seqlen_q, seqlen_k, window, name):
    dtype = built_dtype(head_dim)
    q, k, v, dout = attention_inputs(2, seqlen_q, seqlen_k, NHEADS, NHEADS_K, head_dim, dtype)
    opts = dict(window_size=window)
    out, lse, grads = run_attention(q, k, v, dout, **opts)
    check_attention(out, lse, grads, q, k, v, dout, name, **opts)
    _check_visibility_dense(out, lse, grads, seqlen_q, seqlen_k, window, name)


def _varlen_case(lengths_q, lengths_k, head_dim, **opts):
    """Gaussian (q, k, v, dout, cu_q, cu_k) for these lengths, GQA NHEADS / NHEADS_K, and run_attention_varlen's
    results."""
    dtype = built_dtype(head_dim)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    q = randn(sum(lengths_q), NHEADS, head_dim, dtype=dtype)
    k = randn(sum(lengths_k), NHEADS_K, head_dim, dtype=dtype)
    v = randn(sum(lengths_k), NHEADS_K, head_dim, dtype=dtype)
    dout = randn(sum(lengths_q), NHEADS, head_dim, dtype=dtype)
    inputs = (q, k, v, dout, cu_q, cu_k)
    return inputs, run_attention_varlen(*inputs, max(lengths_q), max(lengths_k), **opts)


# ----------------------------------------------------------- GG: window sides between the lengths and at thresholds

# seqlen_q 300 > seqlen_k 100: row i sees keys j <= i - 200 + right. Right 99 / 100 / 101: around seqlen_k (FA #895's
# reset); 199: row 0 empty, 200: the first value with no empty row; 298: the last key hidden from row 0; 299:
# hides nothing (window_hides_nothing); 300: kept by kernel_window; 301: made unbounded by it.
GG_SIDES = (99, 100, 101, 199, 200, 298, 299, 300, 301)
GG_DENSE = ([(300, 100, (-1, r)) for r in GG_SIDES]
            + [(100, 300, (left, -1)) for left in GG_SIDES]  # the mirror: row i sees keys j >= i + 200 - left
            + [(300, 4096, (333, -1))])  # flashinfer #4972's case: finite left, unbounded right, qo_len < kv_len
GG_DENSE_IDS = [f"{sq}x{sk}-w{w[0]}_{w[1]}" for sq, sk, w in GG_DENSE]


@pytest.mark.parametrize("seqlen_q,seqlen_k,window", GG_DENSE, ids=GG_DENSE_IDS)
@pytest.mark.parametrize("head_dim", [64, 256])
def test_window_side_between_the_two_lengths(head_dim, seqlen_q, seqlen_k, window):
    """A window side between seqlen_k and seqlen_q (or the mirror), at the thresholds where a wide side becomes
    unbounded: the rule's mask exactly, GQA 4/2, forward and backward by the rule from NaN-poisoned memory."""
    _run_window_case(head_dim, seqlen_q, seqlen_k, window, f"{seqlen_q}x{seqlen_k} window {window} d{head_dim}")


GG_ZERO = [(300, 300, (0, -1)), (200, 500, (0, -1)), (500, 200, (0, -1)), (500, 200, (0, 37)), (200, 500, (37, 0)),
           (500, 200, (-1, 0))]


@pytest.mark.parametrize("seqlen_q,seqlen_k,window", GG_ZERO, ids=[f"{a}x{b}-w{w[0]}_{w[1]}" for a, b, w in GG_ZERO])
def test_zero_window_side_is_a_bound(seqlen_q, seqlen_k, window):
    """A side of 0 bounds the window at the diagonal (FA #2574 / #2624 read 0 as unbounded through `or`), without
    causal=True, with seqlen_q != seqlen_k on either side: the rule's rows and keys exactly, by the rule."""
    _run_window_case(128, seqlen_q, seqlen_k, window, f"{seqlen_q}x{seqlen_k} window {window}")


# The maxima are not one sequence's lengths: A's max_seqlen_q 300 comes from sequence 0 (100 keys), max_seqlen_k 120
# from sequence 3; B's max_seqlen_q 100 from sequence 0 (300 keys), max_seqlen_k 400 from sequence 1 (5 queries).
GG_VARLEN_LENGTHS = {
    "A": ([300, 5, 1, 130, 0, 17], [100, 100, 64, 120, 7, 0]),
    "B": ([100, 5, 64, 1, 0, 9], [300, 400, 64, 1, 5, 0]),
}
GG_VARLEN = ([("A", (-1, r)) for r in (120, 121, 150, 299, 301)]
             + [("B", (left, -1)) for left in (99, 100, 101, 350, 401)])


GG_VARLEN_IDS = [f"{n}-w{w[0]}_{w[1]}" for n, w in GG_VARLEN]


@pytest.mark.parametrize("lengths,window", GG_VARLEN, ids=GG_VARLEN_IDS)
def test_window_side_between_the_two_maxima_varlen(lengths, window):
    """attention_varlen with a window side between max_seqlen_k and max_seqlen_q (FA #895 reset a right side above
    max_seqlen_k to unbounded) or the mirror: each sequence's rows and keys exactly as the rule says for its own
    lengths; out, LSE, dQ, dK, dV by the rule per sequence."""
    lq, lk = GG_VARLEN_LENGTHS[lengths]
    (q, k, v, dout, cu_q, cu_k), (out, lse, grads) = _varlen_case(lq, lk, 128, window_size=window)
    name = f"varlen {lengths} window {window}"
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, name, window_size=window)
    for b, (sq, sk) in enumerate(zip(lq, lk)):  # each sequence as a batch of one
        rows, keys = slice(sum(lq[:b]), sum(lq[:b + 1])), slice(sum(lk[:b]), sum(lk[:b + 1]))
        one = [t[idx].unsqueeze(0) for t, idx in zip(grads, (rows, keys, keys))]
        _check_visibility_dense(out[rows].unsqueeze(0), lse[:, rows].unsqueeze(0), one, sq, sk, window,
                                f"{name}: sequence {b}")


# ----------------------------------------------------------- GH: GQA / MQA forward bits equal MHA over repeated K/V

# (id, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v, opts)
GH_DENSE = [
    ("causal-q<k", 2, 300, 500, 6, 2, 128, 128, dict(causal=True)),
    ("causal-q>k", 2, 500, 300, 6, 2, 128, 128, dict(causal=True)),  # 200 rows per head see no key
    ("window-mqa", 2, 333, 333, 5, 1, 128, 128, dict(window_size=(40, 8))),
    ("softcap-causal", 2, 257, 700, 16, 2, 128, 128, dict(causal=True, softcap=20.0)),
    ("mqa-decode", 1, 1, 4099, 16, 1, 128, 128, {}),
    ("verify-block", 3, 4, 777, 8, 2, 64, 64, dict(causal=True)),
    ("d96-window", 2, 200, 450, 12, 4, 96, 96, dict(window_size=(100, 0))),
    ("d192-v128", 2, 129, 300, 8, 2, 192, 128, dict(causal=True)),
    ("d256", 2, 300, 300, 6, 3, 256, 256, dict(causal=True)),
]


def _repeat_heads(t, group):
    """K or V with each K/V head repeated for the query heads that read it (head h reads h // group), contiguous."""
    return t.repeat_interleave(group, dim=-2).contiguous()


def _check_gqa_against_mha(call, ref, q, k, v, name, cu_q=None):
    """call(q, k, v) -> (out, lse) under test, ref(q, k, v, upcast=...) -> the reference's: the GQA call's out and
    LSE are the bits of the MHA call over K, V repeated per query head, and right by the rule."""
    group = q.shape[-2] // k.shape[-2]
    gpu_helpers.poison_attention_memory(q, v, cu_q)
    out, lse = call(q, k, v)
    gpu_helpers.poison_attention_memory(q, v, cu_q)
    out_mha, lse_mha = call(q, _repeat_heads(k, group), _repeat_heads(v, group))
    why = " (the GQA forward computes a row differently from the MHA forward over the same keys)"
    assert_same_bits(out, out_mha, f"{name} out", why)
    assert_same_bits(lse, lse_mha, f"{name} lse", why)
    (ref_out, ref_lse), (naive, naive_lse) = ref(q, k, v, upcast=True), ref(q, k, v, upcast=False)
    assert_close_by_rule(out, ref_out, naive, f"{name} out")
    assert_close_by_rule(lse, ref_lse, naive_lse, f"{name} lse")


@pytest.mark.parametrize("case", GH_DENSE, ids=[c[0] for c in GH_DENSE])
def test_gqa_forward_bits_equal_mha_over_repeated_kv(case):
    """out and LSE of the GQA / MQA call are the bits of the MHA call over K, V repeated per query head, and right by
    the rule: no query-head packing (or none that changes a row's mask, key range or sums)."""
    name, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v, opts = case
    dtype = built_dtype(max(head_dim, head_dim_v))  # (the pair runs on the kernels of the larger)
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k = randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    v = randn(batch, seqlen_k, nheads_k, head_dim_v, dtype=dtype)
    _check_gqa_against_mha(lambda *qkv: flash_attn_hopper.attention(*qkv, return_lse=True, **opts),
                           lambda *qkv, upcast: attention_ref(*qkv, upcast=upcast, **opts), q, k, v, name)


GH_VARLEN = [("causal", dict(causal=True)), ("window", dict(window_size=(64, 16))), ("softcap", dict(softcap=15.0))]


@pytest.mark.parametrize("opts", [c[1] for c in GH_VARLEN], ids=[c[0] for c in GH_VARLEN])
def test_gqa_forward_bits_equal_mha_over_repeated_kv_varlen(opts):
    """attention_varlen, 8 query heads on 2 K/V heads, sequences of 1, 0, 130, 257, 64 and 129 queries against 300,
    5, 130, 257, 1 and 0 keys (a packing of query heads must not cross a sequence boundary): the MHA call's bits over
    K, V repeated per query head, and right by the rule."""
    head_dim, nheads, nheads_k = 128, 8, 2
    dtype = built_dtype(head_dim)
    lq, lk = [1, 0, 130, 257, 64, 129], [300, 5, 130, 257, 1, 0]
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    q = randn(sum(lq), nheads, head_dim, dtype=dtype)
    k = randn(sum(lk), nheads_k, head_dim, dtype=dtype)
    v = randn(sum(lk), nheads_k, head_dim, dtype=dtype)
    args = (cu_q, cu_k, max(lq), max(lk))
    _check_gqa_against_mha(lambda *qkv: flash_attn_hopper.attention_varlen(*qkv, *args, return_lse=True, **opts),
                           lambda *qkv, upcast: attention_varlen_ref(*qkv, cu_q, cu_k, upcast=upcast, **opts),
                           q, k, v, "varlen", cu_q)


# ------------------------------------------------- GI: varlen dQ workspace offsets at each backward block height

GI_REPEATS = 6
GI_Q = [1, 63, 64, 65, 127, 128, 129, 0] * GI_REPEATS
GI_K = [65, 127, 128, 129, 0, 1, 63, 64] * GI_REPEATS  # (127, 0): queries without keys; (0, 64): keys, no queries
GI_MODES = {"atomic": ({}, {}), "deterministic-causal": (dict(causal=True, deterministic=True), dict(causal=True))}


@pytest.mark.parametrize("mode", list(GI_MODES))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_varlen_dq_workspace_offsets_at_each_backward_block_height(head_dim, mode):
    """48 sequences at 64 / 128 multiples +-1 (and 1, 0), GQA 4/2: each sequence's dQ accumulator rows start on its own
    128-row tile while the backward's query blocks are 128 (head_dim 64) or 64 rows (128, 256); out, LSE, dQ, dK, dV
    by the rule per sequence, rows that see no key exactly 0, from NaN-poisoned memory."""
    call_opts, ref_opts = GI_MODES[mode]
    inputs, (out, lse, grads) = _varlen_case(GI_Q, GI_K, head_dim, **call_opts)
    q, k, v, dout, cu_q, cu_k = inputs
    if call_opts.get("deterministic"):
        _, _, grads2 = run_attention_varlen(*inputs, max(GI_Q), max(GI_K), **call_opts)
        for gname, a, b in zip(gpu_helpers.GRAD_NAMES, grads, grads2):
            assert_same_bits(a, b, f"deterministic {gname}", " (two deterministic backwards differ)")
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, f"varlen d{head_dim} {mode}", **ref_opts)


# ------------------------------------------------------------------------------ GJ: K and V from KV-cache slices

GJ_CAPACITY = 4608
GJ_CALLS = {  # (seqlen_q, keys L, opts)
    "decode": (1, 4097, {}),
    "verify": (5, 777, dict(causal=True)),
    "chunk": (77, 300, dict(causal=True)),
}
GJ_LAYOUTS = ("separate", "block-major", "token-interleaved")


def _cache_views(layout, batch, length, nheads_k, head_dim, dtype):
    """(cache, k, v): k and v as views of the first `length` positions of NaN-filled caches of GJ_CAPACITY positions,
    their first `length` positions filled with Gaussian values; cache is the list of the underlying tensors."""
    nan = float("nan")
    if layout == "separate":
        caches = [torch.full((batch, GJ_CAPACITY, nheads_k, head_dim), nan, dtype=dtype, device="cuda")
                  for _ in range(2)]
        k, v = (c[:, :length] for c in caches)
    elif layout == "block-major":  # (batch, 2, capacity, heads, dim): V one whole capacity past K
        caches = [torch.full((batch, 2, GJ_CAPACITY, nheads_k, head_dim), nan, dtype=dtype, device="cuda")]
        k, v = caches[0][:, 0, :length], caches[0][:, 1, :length]
    else:  # (batch, capacity, 2, heads, dim): K and V of a position side by side
        caches = [torch.full((batch, GJ_CAPACITY, 2, nheads_k, head_dim), nan, dtype=dtype, device="cuda")]
        k, v = caches[0][:, :length, 0], caches[0][:, :length, 1]
    for t in (k, v):
        t.copy_(torch.randn(t.shape, dtype=dtype, device="cuda"))
    return caches, k, v


@pytest.mark.parametrize("call", list(GJ_CALLS))
@pytest.mark.parametrize("layout", GJ_LAYOUTS)
def test_attention_over_kv_cache_slices(layout, call):
    """K, V views of the filled part of a NaN-tailed KV cache (batch stride beyond seqlen_k rows): right by the rule
    against contiguous copies, out and LSE bitwise those of the copies, gradients finite and right, cache untouched."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    seqlen_q, length, opts = GJ_CALLS[call]
    batch = 2
    caches, k, v = _cache_views(layout, batch, length, NHEADS_K, head_dim, dtype)
    if not (k.stride(0) > length * k.stride(1) and not k.is_contiguous() and not v.is_contiguous()):
        raise AssertionError("premise: k, v are slices whose batch stride passes their own rows")
    q = randn(batch, seqlen_q, NHEADS, head_dim, dtype=dtype)
    dout = randn(batch, seqlen_q, NHEADS, head_dim, dtype=dtype)
    before = [bits(c) for c in caches]
    out, lse, grads = run_attention(q, k, v, dout, **opts)
    torch.cuda.synchronize()
    for c, saved in zip(caches, before):
        if not torch.equal(bits(c), saved):
            raise AssertionError(f"{layout} {call}: the cache changed")
    kc, vc = k.contiguous(), v.contiguous()
    name = f"{layout} {call}"
    check_attention(out, lse, grads, q, kc, vc, dout, name, **opts)
    out_c, lse_c = flash_attn_hopper.attention(q, kc, vc, return_lse=True, **opts)
    why = " (the cache slice is read differently from its contiguous copy)"
    assert_same_bits(out, out_c, f"{name} out", why)
    assert_same_bits(lse, lse_c, f"{name} lse", why)


@pytest.mark.parametrize("layout", ["prefix", "interleaved"])
def test_varlen_over_a_kv_pool_slice(layout):
    """attention_varlen with packed K / V rows as the first total_k rows of a NaN-tailed pool (prefix), or as the two
    halves of a pool that keeps K and V of a row side by side (row stride twice the head row): right by the rule, rows
    that see no key 0, the pool untouched."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    lq, lk = [1, 5, 77, 0, 129], [300, 64, 77, 9, 257]
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    total_k, pool_rows = sum(lk), sum(lk) + 1000
    nan = float("nan")
    if layout == "prefix":
        pools = [torch.full((pool_rows, NHEADS_K, head_dim), nan, dtype=dtype, device="cuda") for _ in range(2)]
        k, v = pools[0][:total_k], pools[1][:total_k]
    else:
        pools = [torch.full((pool_rows, 2, NHEADS_K, head_dim), nan, dtype=dtype, device="cuda")]
        k, v = pools[0][:total_k, 0], pools[0][:total_k, 1]
    for t in (k, v):
        t.copy_(torch.randn(t.shape, dtype=dtype, device="cuda"))
    q = randn(sum(lq), NHEADS, head_dim, dtype=dtype)
    dout = randn(sum(lq), NHEADS, head_dim, dtype=dtype)
    before = [bits(p) for p in pools]
    out, lse, grads = run_attention_varlen(q, k, v, dout, cu_q, cu_k, max(lq), max(lk), causal=True)
    torch.cuda.synchronize()
    for p, saved in zip(pools, before):
        if not torch.equal(bits(p), saved):
            raise AssertionError(f"{layout}: the pool changed")
    check_attention_varlen(out, lse, grads, q, k.contiguous(), v.contiguous(), dout, cu_q, cu_k,
                           f"pool {layout}", causal=True)
