"""Deterministic backward (issue 7 item 4) on an sm90 GPU: with ``deterministic=True`` repeated backward passes give
bitwise-identical dQ, dK, dV (the partial sums of dQ, and of dK/dV across a GQA group, are added in a fixed order),
at every head dim, with masks, GQA and varlen; the gradients also satisfy the reference rule. Each repetition runs
with other allocations in between (memory pressure changes the placement of the workspaces). Skipped, with the
reason, without an sm90 GPU and the built extension."""

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref_grads
from gpu_helpers import built_dtype as _built_dtype
from gpu_helpers import randn as _randn
from gpu_helpers import require_built as _require_built

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

REPEATS = 20


def _repeat_grads(run):
    """REPEATS backward passes of run() -> (dq, dk, dv), each after a differently sized spacer allocation."""
    results, spacers = [], []
    for i in range(REPEATS):
        spacers.append(torch.empty((i + 1) * 1_000_003, dtype=torch.uint8, device="cuda"))
        results.append(tuple(g.clone() for g in run()))
    return results


def _assert_identical(results, name):
    first = results[0]
    for i, r in enumerate(results[1:], start=1):
        for gname, a, b in zip(("dq", "dk", "dv"), first, r):
            assert torch.equal(a, b), f"{name}: {gname} of run {i} differs from run 0 (max {(a - b).abs().max()})"


@pytest.mark.parametrize(
    "head_dim,causal,nheads_k,window",
    [(64, False, 4, (-1, -1)), (128, True, 4, (-1, -1)), (256, False, 4, (-1, -1)), (128, False, 2, (-1, -1)),
     (256, True, 1, (-1, -1)), (64, False, 4, (100, 20)), (128, True, 2, (300, 0))],
    ids=["64", "128-causal", "256", "128-gqa", "256-causal-mqa", "64-window", "128-causal-window-gqa"],
)
def test_deterministic_repeats_are_bitwise_equal(head_dim, causal, nheads_k, window):
    dtype = _built_dtype(head_dim)
    batch, seqlen_q, seqlen_k, nheads = 2, 1000, 1100, 4
    q = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k = _randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    v = _randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    dout = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = attention(*leaves, causal=causal, window_size=window, deterministic=True)

    def run():
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    results = _repeat_grads(run)
    _assert_identical(results, f"head_dim {head_dim}")
    ref = attention_ref_grads(q, k, v, dout, causal=causal, window_size=window)
    naive = attention_ref_grads(q, k, v, dout, causal=causal, window_size=window, upcast=False)
    for gname, g, r, n in zip(("dq", "dk", "dv"), results[0], ref, naive):
        assert_close_by_rule(g, r, n, f"deterministic {gname}")


def test_deterministic_varlen():
    dtype = _built_dtype(128)
    lengths = [0, 300, 77, 513, 1]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    total = sum(lengths)
    q = _randn(total, 4, 128, dtype=dtype)
    k, v = (_randn(total, 2, 128, dtype=dtype) for _ in range(2))
    dout = _randn(total, 4, 128, dtype=dtype)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = attention_varlen(*leaves, cu, cu, max(lengths), max(lengths), causal=True, deterministic=True)
    _assert_identical(_repeat_grads(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)), "varlen")


def test_torch_deterministic_mode_turns_it_on():
    """Under torch.use_deterministic_algorithms(True), deterministic=False (the default) still runs the deterministic
    backward, as PyTorch's own operators pick their deterministic implementation in that mode: dense GQA and varlen
    gradients bitwise equal to those of deterministic=True outside the mode, and no operator of the library raises
    for lack of a deterministic implementation. With 6 key blocks per query block, the default mode's atomic sums
    would differ from the fixed order in some last bits."""
    dtype = _built_dtype(128)
    q, dout = (_randn(2, 700, 4, 128, dtype=dtype) for _ in range(2))
    k, v = (_randn(2, 700, 2, 128, dtype=dtype) for _ in range(2))
    lengths = [300, 0, 700, 77]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    packed = [t.reshape(-1, *t.shape[2:])[: sum(lengths)] for t in (q, k, v, dout)]

    def grads(det, varlen):
        if varlen:
            leaves = [t.detach().requires_grad_(True) for t in packed[:3]]
            out = attention_varlen(*leaves, cu, cu, max(lengths), max(lengths), causal=True, deterministic=det)
            return torch.autograd.grad(out, leaves, packed[3])
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        return torch.autograd.grad(attention(*leaves, causal=True, deterministic=det), leaves, dout)

    for varlen in (False, True):
        expected = grads(True, varlen)
        was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
        torch.use_deterministic_algorithms(True)
        try:
            got = grads(False, varlen)
        finally:
            torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        for gname, a, b in zip(("dq", "dk", "dv"), got, expected):
            assert torch.equal(a, b), f"varlen={varlen}: {gname} under torch's deterministic mode differs"


def test_default_mode_is_the_same_math():
    """deterministic=True changes the order of the sums only: within the reference rule of the default mode's result."""
    dtype = _built_dtype(128)
    _require_built(128, dtype)
    q, k, v, dout = (_randn(1, 700, 4, 128, dtype=dtype) for _ in range(4))
    grads = {}
    for det in (False, True):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = attention(*leaves, causal=True, deterministic=det)
        grads[det] = torch.autograd.grad(out, leaves, dout)
    ref = attention_ref_grads(q, k, v, dout, causal=True)
    naive = attention_ref_grads(q, k, v, dout, causal=True, upcast=False)
    for det, g in grads.items():
        for gname, a, r, n in zip(("dq", "dk", "dv"), g, ref, naive):
            assert_close_by_rule(a, r, n, f"deterministic={det} {gname}")


@pytest.mark.parametrize("head_dim,causal", [(256, False), (128, True)], ids=["256", "128-causal"])
def test_deterministic_many_waves_gqa(head_dim, causal):
    """seqlen 8192, 8 query heads over 2 K/V heads: over a thousand key-block CTAs, several waves of the GPU, so CTAs
    wait on CTAs that started in an earlier wave; dQ (TMA reduce-add or atomics) and the GQA dK/dV sums bitwise equal
    over repeats, and finite (the float32 reference is too large at this size; the smaller cases check the values)."""
    dtype = _built_dtype(head_dim)
    seqlen, nheads, nheads_k = 8192, 8, 2
    q = _randn(1, seqlen, nheads, head_dim, dtype=dtype)
    k, v = (_randn(1, seqlen, nheads_k, head_dim, dtype=dtype) for _ in range(2))
    dout = _randn(1, seqlen, nheads, head_dim, dtype=dtype)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = attention(*leaves, causal=causal, deterministic=True)
    results = _repeat_grads(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
    _assert_identical(results, f"waves head_dim {head_dim}")
    for g in results[0]:
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("lanes", ["1", "2"])
@pytest.mark.parametrize("case", ["window", "causal", "varlen-gqa"])
def test_deterministic_dq_lanes_head_dim_256(monkeypatch, lanes, case):
    """The head_dim 256 kernel's two dQ accumulator copies (flash/config.hpp bwd_dq_lanes, chosen by default only
    without masks or under a window that hides no key), forced on and off with FAH_BWD_DQ_LANES on masks, varlen and GQA: tiles seen by an odd number of
    key blocks (one lane has one more), empty and one-row sequences; bitwise equal over repeats and within the
    reference rule; a sequence without keys gets dQ = 0."""
    monkeypatch.setenv("FAH_BWD_DQ_LANES", lanes)
    dtype = _built_dtype(256)
    if case in ("window", "causal"):
        kwargs = {"window_size": (300, 40)} if case == "window" else {"causal": True}
        q, dout = (_randn(2, 1000, 4, 256, dtype=dtype) for _ in range(2))
        k, v = (_randn(2, 1100, 2, 256, dtype=dtype) for _ in range(2))
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = attention(*leaves, deterministic=True, **kwargs)
        results = _repeat_grads(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
        _assert_identical(results, f"lanes {lanes} {case}")
        ref = attention_ref_grads(q, k, v, dout, **kwargs)
        naive = attention_ref_grads(q, k, v, dout, upcast=False, **kwargs)
        for gname, g, r, n in zip(("dq", "dk", "dv"), results[0], ref, naive):
            assert_close_by_rule(g, r, n, f"lanes {lanes} {case} {gname}")
        return
    lengths_q, lengths_k = [0, 300, 77, 513, 1], [10, 1100, 77, 0, 130]
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
                  for n in (lengths_q, lengths_k))
    q, dout = (_randn(sum(lengths_q), 4, 256, dtype=dtype) for _ in range(2))
    k, v = (_randn(sum(lengths_k), 2, 256, dtype=dtype) for _ in range(2))
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = attention_varlen(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), deterministic=True)
    results = _repeat_grads(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
    _assert_identical(results, f"lanes {lanes} varlen")
    for b in range(len(lengths_q)):
        sq, sk = slice(cu_q[b].item(), cu_q[b + 1].item()), slice(cu_k[b].item(), cu_k[b + 1].item())
        if lengths_k[b] == 0:
            assert torch.equal(results[0][0][sq], torch.zeros_like(results[0][0][sq])), f"sequence {b}: dq not 0"
            continue
        if lengths_q[b] == 0:
            continue  # no query: nothing to compare here (test_varlen_gpu.py checks its keys' zero dK, dV)
        args = [t[None, s] for t, s in ((q, sq), (k, sk), (v, sk), (dout, sq))]
        ref = attention_ref_grads(*args)
        naive = attention_ref_grads(*args, upcast=False)
        for gname, g, r, n, s in zip(("dq", "dk", "dv"), results[0], ref, naive, (sq, sk, sk)):
            assert_close_by_rule(g[s][None], r, n, f"lanes {lanes} varlen sequence {b} {gname}")


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,window,lanes",
    [(2000, 2000, (5000, 5000), "2"), (2000, 2000, (1999, 1999), "2"), (2000, 2000, (1998, 1999), "1"),
     (2000, 2000, (1999, 1998), "1"), (1000, 2000, (1999, 999), "2"), (1000, 2000, (999, 1999), "1")],
    ids=["wider", "hides_nothing", "left_one_short", "right_one_short", "sq_lt_sk_hides_nothing", "sq_lt_sk_swapped"])
def test_deterministic_dq_lanes_window_hiding_nothing(monkeypatch, seqlen_q, seqlen_k, window, lanes):
    """A window that hides no key (left >= seqlen_k - 1, right >= seqlen_q - 1) takes the dQ accumulator copies of no
    window (flash/config.hpp bwd_dq_lanes: two at head_dim 256 without a mask), one that hides a key (one side one
    short, or the sides swapped when seqlen_q < seqlen_k) one copy: dQ bitwise equal to that of the expected number
    of copies forced (FAH_BWD_DQ_LANES) and unequal to the other's (which sums in another order), within the rule."""
    dtype = _built_dtype(256)
    q, dout = (_randn(1, seqlen_q, 4, 256, dtype=dtype) for _ in range(2))
    k, v = (_randn(1, seqlen_k, 4, 256, dtype=dtype) for _ in range(2))
    grads = {}
    for forced in (None, "2", "1"):
        if forced is None:
            monkeypatch.delenv("FAH_BWD_DQ_LANES", raising=False)
        else:
            monkeypatch.setenv("FAH_BWD_DQ_LANES", forced)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = attention(*leaves, deterministic=True, window_size=window)
        grads[forced] = torch.autograd.grad(out, leaves, dout)
    other = "1" if lanes == "2" else "2"
    assert torch.equal(grads[None][0], grads[lanes][0]), f"window {window}: dQ is not that of {lanes} copies"
    assert not torch.equal(grads[other][0], grads[lanes][0]), "one and two copies gave dQ bitwise equal"
    ref = attention_ref_grads(q, k, v, dout, window_size=window)
    naive = attention_ref_grads(q, k, v, dout, upcast=False, window_size=window)
    for gname, a, r, n in zip(("dq", "dk", "dv"), grads[None], ref, naive):
        assert_close_by_rule(a, r, n, f"window {window} {gname}")


def test_deterministic_dq_lanes_take_effect(monkeypatch):
    """Two accumulator copies sum dQ in another order than one: the bits differ (so the lanes tests above do run two
    configurations), both are repeatable and within the reference rule, and dK, dV (no lanes) are bitwise the same."""
    dtype = _built_dtype(256)
    q, dout = (_randn(1, 2000, 4, 256, dtype=dtype) for _ in range(2))
    k, v = (_randn(1, 2000, 4, 256, dtype=dtype) for _ in range(2))
    grads = {}
    for lanes in ("1", "2"):
        monkeypatch.setenv("FAH_BWD_DQ_LANES", lanes)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = attention(*leaves, deterministic=True)
        runs = [torch.autograd.grad(out, leaves, dout, retain_graph=True) for _ in range(3)]
        _assert_identical(runs, f"lanes {lanes}")
        grads[lanes] = runs[0]
    assert not torch.equal(grads["1"][0], grads["2"][0]), "FAH_BWD_DQ_LANES=2 gave dQ bitwise equal to 1 copy"
    assert torch.equal(grads["1"][1], grads["2"][1]) and torch.equal(grads["1"][2], grads["2"][2])
    ref = attention_ref_grads(q, k, v, dout)
    naive = attention_ref_grads(q, k, v, dout, upcast=False)
    for lanes, g in grads.items():
        for gname, a, r, n in zip(("dq", "dk", "dv"), g, ref, naive):
            assert_close_by_rule(a, r, n, f"lanes {lanes} {gname}")
