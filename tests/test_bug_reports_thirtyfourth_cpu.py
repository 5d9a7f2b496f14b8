"""Thirty-fourth round of the bug hunt (tests/bug_report_sources.md, "Thirty-fourth round"), CPU part: the premises of
tests/test_bug_reports_thirtyfourth_gpu.py, without a GPU or the extension.

- GG: each dense window case straddles the thresholds it is there for: tests/test_mask_math_cpu.py's port of
  kernel_window (csrc/flash/common/block_range.hpp) keeps the side up to the sequence length and makes the next one
  unbounded, and the window rule (flash_attn_hopper.testing.local_mask) hides keys below seqlen_q - 1 (seqlen_k - 1 for
  a left side) and leaves rows empty below the first value that reaches a key. The cited faults' readings of the side
  (Dao-AILab/flash-attention#895: a right side above seqlen_k taken as unbounded; #2574 / #2624: a side of 0 taken as
  unbounded) give another mask on the cases that test them. The varlen cases' sides lie between max_seqlen_k and
  max_seqlen_q (or the mirror) and hide keys of some sequence that the maxima's reading would not.
- GH: the construction's head mapping: the float64 reference of a GQA call equals that of the MHA call over K and V
  repeated with repeat_interleave (query head h reads K/V head h // group).
- GI: the lengths reach what the class is about (64 / 128 multiples +-1 on both sides, queries without keys, keys
  without queries)."""

import pytest
import torch

import test_bug_reports_thirtyfourth_gpu as gpu_file
from flash_attn_hopper.testing import attention_ref, local_mask
from test_mask_math_cpu import kernel_window


def test_gg_dense_windows_straddle_the_kernels_thresholds():
    kept, made_unbounded, hides, empties, fa895_differs = set(), set(), set(), set(), set()
    for seqlen_q, seqlen_k, window in gpu_file.GG_DENSE:
        left, right = kernel_window(window[0], window[1], seqlen_q, seqlen_k)
        side, length = (right, seqlen_q) if window[0] == -1 else (left, seqlen_k)
        given = window[1] if window[0] == -1 else window[0]
        (made_unbounded if side > length else kept).add((seqlen_q, seqlen_k, window))
        if side <= length:
            assert side == given, "kernel_window changed a side it keeps"
        visible = local_mask(seqlen_q, seqlen_k, window)
        if not visible.all():
            hides.add(window)
        if not visible.any(dim=1).all():
            empties.add(window)
        if window[0] == -1 and window[1] > seqlen_k:  # FA #895: such a right side reset to unbounded
            if not torch.equal(visible, local_mask(seqlen_q, seqlen_k, (-1, -1))):
                fa895_differs.add(window)
    # the thresholds of the right-side family at 300 x 100 (the left-side family mirrors it at 100 x 300)
    for r in gpu_file.GG_SIDES:
        assert ((-1, r) in hides) == (r < 299), r
        assert ((-1, r) in empties) == (r < 200), r
        assert ((r, -1) in hides) == (r < 299), r
        assert ((r, -1) in empties) is False, r  # a left side never empties a row when the right is unbounded
    assert (300, 100, (-1, 300)) in kept and (300, 100, (-1, 301)) in made_unbounded
    assert (100, 300, (300, -1)) in kept and (100, 300, (301, -1)) in made_unbounded
    assert {(-1, r) for r in (101, 199, 200, 298)} <= fa895_differs
    # flashinfer #4972's case hides keys left of the window from every row of the first query tile
    first_tile = local_mask(300, 4096, (333, -1))[:128]
    assert not first_tile[:, :3796 - 333].any() and first_tile[:, -1].all()


def test_gg_zero_sides_are_bounds():
    for seqlen_q, seqlen_k, window in gpu_file.GG_ZERO:
        visible = local_mask(seqlen_q, seqlen_k, window)
        as_unbounded = local_mask(seqlen_q, seqlen_k, tuple(-1 if w == 0 else w for w in window))
        assert not torch.equal(visible, as_unbounded), f"{window}: a 0 side read as unbounded gives the same mask"
        assert visible.any(), window
    # (-1, 0) without causal is the causal mask (bottom-right)
    assert torch.equal(local_mask(500, 200, (-1, 0)), local_mask(500, 200, causal=True))


@pytest.mark.parametrize("lengths,window", gpu_file.GG_VARLEN, ids=gpu_file.GG_VARLEN_IDS)
def test_gg_varlen_windows_between_the_maxima(lengths, window):
    lq, lk = gpu_file.GG_VARLEN_LENGTHS[lengths]
    max_q, max_k = max(lq), max(lk)
    hidden = 0
    for sq, sk in zip(lq, lk):
        hidden += int((~local_mask(sq, sk, window)).sum())
    if window[0] == -1:
        assert max_k < max_q
        if window[1] < max_q - 1:
            assert hidden > 0, "the window hides keys of some sequence"
    else:
        assert max_q < max_k
        if window[0] < max_k - 1:
            assert hidden > 0, "the window hides keys of some sequence"
    # no sequence of one query row sees exactly two keys (docs/conventions.md: the documented short-key accuracy)
    assert all(not (sq <= 4 and sk == 2) for sq, sk in zip(lq, lk))


def test_gh_gqa_reference_equals_mha_over_repeat_interleave():
    g = torch.Generator().manual_seed(34)
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim = 2, 9, 13, 6, 2, 8
    q = torch.randn(batch, seqlen_q, nheads, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim, generator=g, dtype=torch.float64)
    group = nheads // nheads_k
    for opts in (dict(causal=True), dict(window_size=(3, 1)), dict(softcap=5.0)):
        out, lse = attention_ref(q, k, v, **opts)
        out_m, lse_m = attention_ref(q, gpu_file._repeat_heads(k, group), gpu_file._repeat_heads(v, group), **opts)
        assert torch.equal(out, out_m) and torch.equal(lse, lse_m), opts
    # a mapping h -> h % nheads_k (tile instead of repeat) would give another result
    tiled = k.repeat(1, 1, group, 1)
    assert not torch.equal(attention_ref(q, tiled, v.repeat(1, 1, group, 1))[0], attention_ref(q, k, v)[0])


def test_gi_lengths_reach_the_tile_edges():
    lq, lk = gpu_file.GI_Q, gpu_file.GI_K
    assert len(lq) == len(lk) == 8 * gpu_file.GI_REPEATS
    for lengths in (lq, lk):
        for edge in (64, 128):
            assert {edge - 1, edge, edge + 1} <= set(lengths)
    assert any(sq > 0 and sk == 0 for sq, sk in zip(lq, lk)), "a sequence with queries and no keys"
    assert any(sq == 0 and sk > 0 for sq, sk in zip(lq, lk)), "a sequence with keys and no queries"
    # sequences whose rows end inside a 64-row block and inside a 128-row one (the backward's two query block heights)
    assert any(n % 64 != 0 and n % 128 > 64 for n in lq) and any(n % 64 != 0 and n % 128 < 64 for n in lq)
