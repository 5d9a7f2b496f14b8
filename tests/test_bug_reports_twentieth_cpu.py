"""Twentieth round of the bug hunt (tests/bug_report_sources.md, "Twentieth round"), CPU part.

EM: comparisons and references that broadcast mis-shaped arguments (pytorch/pytorch#47449: torch.testing.assert_allclose
took tensors of different shapes as close; jax-ml/jax#513, the same in assertAllClose). FAULT: in
flash_attn_hopper.testing, assert_close_by_rule broadcast a naive reference of another shape (a batch-1 naive run bounded
every batch element, so a wrong output passed), max_abs_err broadcast its operands, the references took a k or v of
batch 1, a k with one key or head_dim 1, a dout or dlse of batch 1 and document_ids of shape (1, seqlen) through
einsum's broadcasting (shapes attention refuses), and the varlen reference clipped cu_seqlens past the rows and ignored
extra entries. Fixed: ValueError naming the argument, the references refusing what attention / attention_varlen refuse.
EN: torch.compile over consecutive calls whose every size changes (pytorch/pytorch#148545: SDPA compiled, the second
case of another shape came out NaN). No fault: automatic dynamic shapes recompile (head_dim specialises, as the
kernels are per head_dim) and every call equals eager, out, LSE and gradients, dense and varlen.
EO: a compiled backward over q, k, v of different shapes (pytorch/pytorch#110832: "returned an invalid gradient at
index 2" once v's head_dim differed). No fault: head_dim_v above and below head_dim, seqlen_k != seqlen_q, GQA, static
and dynamic=True, dense and varlen: gradients of the inputs' shapes, eager's bits.
EP: backward hooks around the library's autograd node (pytorch/pytorch#35802: a hook not run under autograd.grad;
pytorch/pytorch#131753: multi-grad hooks and FlopCounterMode under autograd.grad): Node pre- and post-hooks on
out.grad_fn (as FSDP2 and DDP register), register_multi_grad_hook, post-accumulate-grad hooks. No fault: each hook runs
once with the gradients' shapes and what it returns is used. (A multi-grad hook in "all" mode over leaves under
torch.autograd.grad is refused by PyTorch itself, for any op: #131753; tested with backward().)

The ops run through the CPU stand-ins of tests/cpu_stand_ins.py.
"""

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen, testing

import cpu_stand_ins
from cpu_stand_ins import dense_inputs as _dense, varlen_inputs as _varlen


def _cu(values):
    return torch.tensor(values, dtype=torch.int32)


def _equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# ------------------------------------------------------------------------------------------------------ EM

def _wrong_output():
    """(q, k, v, ref, naive, wrong): a causal reference run and an output whose batch element 1 has its rows reversed
    (off by ~4, far past the rule's bound of ~0.03)."""
    q, k, v = _dense()
    ref, _ = testing.attention_ref(q, k, v, causal=True)
    naive, _ = testing.attention_ref(q, k, v, causal=True, upcast=False)
    wrong = ref.clone()
    wrong[1] = wrong[1].flip(0)
    return q, k, v, ref, naive, wrong.to(q.dtype)


@pytest.mark.parametrize("cut", ["batch1", "no_batch", "one_row", "one_column"])
def test_rule_refuses_a_naive_reference_of_another_shape(cut):
    """EM: assert_close_by_rule with a naive reference that broadcasts against ref raises a ValueError naming
    ref_naive; before the fix each of these let the wrong output pass (its naive "error" then measured one batch
    element, row or column against all the others, ~4.4-5)."""
    _, _, _, ref, naive, wrong = _wrong_output()
    with pytest.raises(AssertionError, match="max abs error"):  # the control: the right naive shape catches it
        testing.assert_close_by_rule(wrong, ref, naive, "out")
    cut_naive = {"batch1": naive[:1], "no_batch": naive[0], "one_row": naive[:, :1],
                 "one_column": naive[..., :1]}[cut]
    with pytest.raises(ValueError, match=r"^out: ref_naive has shape .* but ref has \(2, 17, 4, 64\)"):
        testing.assert_close_by_rule(wrong, ref, cut_naive, "out")


def test_max_abs_err_refuses_operands_of_different_shapes():
    """EM: max_abs_err of a (2, 17, 4, 64) tensor and its first batch element raises a ValueError naming both shapes
    (it returned the broadcast difference: 4.98 here); equal shapes still give the difference."""
    _, _, _, ref, _, wrong = _wrong_output()
    with pytest.raises(ValueError, match=r"one shape, got \(2, 17, 4, 64\) and \(1, 17, 4, 64\)"):
        testing.max_abs_err(ref, ref[:1])
    assert testing.max_abs_err(ref, ref) == 0.0
    assert testing.max_abs_err(wrong, ref) > 1.0


def _dense_cases():
    q, k, v = _dense()  # q (2, 17, 4, 64); k, v (2, 17, 2, 64)
    dout, dlse = torch.randn_like(q), torch.randn(2, 4, 17)
    ids = torch.zeros(2, 17, dtype=torch.long)
    return {
        # (function, args, kwargs, argument named, does attention itself refuse the same shapes)
        "k_batch1": (testing.attention_ref, (q, k[:1], v[:1]), {}, "k", True),
        "v_batch1": (testing.attention_ref, (q, k, v[:1]), {}, "v", True),
        "k_one_key": (testing.attention_ref, (q, k[:, :1], v), {}, "k and v", True),
        "k_head_dim1": (testing.attention_ref, (q, k[..., :1], v), {}, "k", True),
        "v_heads": (testing.attention_ref, (q, k, v[:, :, :1]), {}, "v", True),
        "heads_not_dividing": (testing.attention_ref, (q[:, :, :3], k, v), {}, "k", True),
        "documents_batch1": (testing.attention_ref, (q, k, v), {"document_ids": ids[:1]}, "document_ids", True),
        "documents_one_position": (testing.attention_ref, (q, k, v), {"document_ids": ids[:, :1]}, "document_ids",
                                   True),
        "bwd_ref_dout_batch1": (testing.attention_bwd_ref, (q, k, v, dout[:1]), {}, "dout", False),
        "bwd_ref_dlse_batch1": (testing.attention_bwd_ref, (q, k, v, dout), {"dlse": dlse[:1]}, "dlse", False),
        "ref_grads_dout_batch1": (testing.attention_ref_grads, (q, k, v, dout[:1]), {}, "dout", False),
        "ref_grads_dlse_one_row": (testing.attention_ref_grads, (q, k, v, dout), {"dlse": dlse[..., :1]}, "dlse",
                                   False),
    }


@pytest.mark.parametrize("case", list(_dense_cases()))
def test_references_refuse_shapes_that_broadcast(case, cpu_ops):
    """EM: the public references raise a ValueError naming the argument for shapes that broadcast. Before the fix 9
    of these cases ran and returned (2, 17, 4, 64) results for a rule no kernel has (batch element 0's keys for both,
    k's single key or single column for every key or column, v's one head for both K/V heads, one document id row or
    column for all, dO / dLSE of batch element 0 for both); heads_not_dividing and the two attention_ref_grads cases
    failed inside einsum, autograd or an elementwise product, naming no argument. Where attention refuses the same
    call (its shape checks come before the device check, so the stand-ins are not reached), it names the same
    argument."""
    fn, args, kwargs, name, library_refuses = _dense_cases()[case]
    with pytest.raises(ValueError, match=rf"^{name} ") as ref_error:
        fn(*args, causal=True, **kwargs)
    if library_refuses:
        q, k, v = (t.to(torch.bfloat16) for t in args[:3])
        with pytest.raises(ValueError, match=rf"^{name} ") as library_error:
            attention(q, k, v, causal=True, **kwargs)
        assert str(library_error.value).split()[:2] == str(ref_error.value).split()[:2]
    assert cpu_stand_ins.CALLS == []


@pytest.mark.parametrize("case", ["k_past_its_rows", "extra_k_entry", "decreasing", "v_heads"])
def test_varlen_reference_refuses_what_attention_varlen_refuses(case, cpu_ops):
    """EM: attention_varlen_ref with cu_seqlens_k ending past k's 34 rows (slicing clipped the last sequence to the
    rows that exist), with one more entry in cu_seqlens_k than in cu_seqlens_q (ignored), with decreasing offsets (an
    empty slice), or with v of other heads than k (v's head broadcast): a ValueError naming the argument, as
    attention_varlen raises; before the fix all four returned a reference. The right call still runs."""
    q, k, v = _varlen()
    cu_q, cu_k, v_used, name = _cu([0, 12, 30]), _cu([0, 20, 34]), v, None
    if case == "k_past_its_rows":
        cu_k, name = _cu([0, 20, 40]), "cu_seqlens_k"
    elif case == "extra_k_entry":
        cu_k, name = _cu([0, 20, 30, 34]), "cu_seqlens_q and cu_seqlens_k"
    elif case == "decreasing":
        cu_q, name = _cu([0, 20, 12]), "cu_seqlens_q"
    else:
        v_used, name = v[:, :1], "v"
    with pytest.raises(ValueError, match=rf"^{name} "):
        testing.attention_varlen_ref(q, k, v_used, cu_q, cu_k, causal=True)
    with pytest.raises(ValueError, match=rf"^{name} "):
        attention_varlen(q, k, v_used, cu_q, cu_k, 20, 20, causal=True)
    out, lse = testing.attention_varlen_ref(q, k, v, _cu([0, 12, 30]), _cu([0, 20, 34]), causal=True)
    assert out.shape == (30, 4, 64) and lse.shape == (4, 30)


def test_repeat_kv_refuses_head_counts_that_do_not_divide():
    """EM: repeat_kv of 3 K/V heads to 4 query heads returned the 3 heads (4 // 3 = 1 repeat), of 2 to 5 returned 4;
    now a ValueError. The dividing case repeats each head in turn."""
    k = torch.arange(3.0).view(1, 1, 3, 1)
    for nheads in (4, 5):
        with pytest.raises(ValueError, match="does not divide nheads"):
            testing.repeat_kv(k, nheads)
    assert testing.repeat_kv(k, 6).flatten().tolist() == [0, 0, 1, 1, 2, 2]


def test_references_take_zero_query_heads_over_kv_heads():
    """EM's check is interface._check_tensor_args' own (_check_shapes_agree), which takes q with no heads over k, v with some (an empty
    problem: nheads_k divides 0): the references too (the first version of the check refused it), dense and varlen,
    with empty results of the right shapes and zero K/V gradients; k, v with no heads under q with some stay refused."""
    from flash_attn_hopper import interface

    q, k, v = torch.randn(2, 5, 0, 16), torch.randn(2, 7, 2, 16), torch.randn(2, 7, 2, 24)
    interface._check_tensor_args(q.half(), k.half(), v.half())  # attention takes it
    out, lse = testing.attention_ref(q, k, v, causal=True)
    assert out.shape == (2, 5, 0, 24) and lse.shape == (2, 0, 5)
    dout = torch.randn(2, 5, 0, 24)
    for grads in (testing.attention_ref_grads(q, k, v, dout), testing.attention_bwd_ref(q, k, v, dout)):
        assert [tuple(g.shape) for g in grads] == [(2, 5, 0, 16), (2, 7, 2, 16), (2, 7, 2, 24)]
        assert not grads[1].any() and not grads[2].any()
    out, lse = testing.attention_varlen_ref(q[0], k[0], v[0], _cu([0, 2, 5]), _cu([0, 3, 7]))
    assert out.shape == (5, 0, 24) and lse.shape == (0, 5)
    with pytest.raises(ValueError, match="^k has 0 heads"):
        testing.attention_ref(torch.randn(2, 5, 2, 16), k[:, :, :0], v[:, :, :0])


# ------------------------------------------------------------------------------------------------------ EN

def _inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v):
    g = torch.Generator().manual_seed(batch * 1000 + seqlen_q * 10 + head_dim)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, generator=g)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, generator=g)
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim_v, generator=g)
    return [t.to(torch.bfloat16).requires_grad_(True) for t in (q, k, v)]


def _dense_run(fn, q, k, v):
    out, lse = fn(q, k, v)
    grads = torch.autograd.grad(out.float().square().sum() + lse.sum(), (q, k, v))
    return (out.detach(), lse.detach(), *grads)


# the report's first two shapes (8 x 900 x 20 x 64, then 1 x 1536 x 24 x 128), scaled down, then GQA and head_dim_v
_SHAPES = [(8, 45, 45, 5, 5, 64, 64), (1, 77, 77, 6, 6, 128, 128), (3, 33, 50, 4, 2, 64, 32),
           (2, 17, 9, 8, 1, 96, 96), (4, 5, 70, 6, 3, 32, 128)]


def test_compiled_calls_with_every_size_changing(cpu_ops):
    """EN: one torch.compile'd function (aot_eager, automatic dynamic shapes) called on five shapes in a row, batch,
    seqlen_q, seqlen_k, nheads, nheads_k, head_dim and head_dim_v all changing (causal, softcap): out, LSE, dQ, dK,
    dV bit for bit eager's at each (the report's second call was NaN)."""
    def f(q, k, v):
        return attention(q, k, v, causal=True, softcap=20.0, return_lse=True)

    compiled = torch.compile(f, backend="aot_eager")
    for shape in _SHAPES:
        inputs = _inputs(*shape)
        got, expected = _dense_run(compiled, *inputs), _dense_run(f, *inputs)
        assert all(_equal(a, b) for a, b in zip(got, expected)), shape
        assert torch.isfinite(got[0]).all(), shape


def test_compiled_varlen_calls_with_every_size_changing(cpu_ops):
    """EN: the same for attention_varlen: total tokens, sequence count, maxima, heads and head dims change from call
    to call; out and the gradients equal eager's."""
    def f(q, k, v, cu_q, cu_k, max_q, max_k):
        return attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)

    compiled = torch.compile(f, backend="aot_eager")
    for lengths_q, lengths_k, nheads, nheads_k, head_dim, head_dim_v in (
            ([12, 18], [20, 14], 4, 2, 64, 64), ([5, 1, 30, 7], [9, 1, 30, 3], 6, 6, 128, 128),
            ([40], [41], 8, 1, 32, 96)):
        q, k, v = (t[0] for t in _inputs(1, sum(lengths_q), sum(lengths_k), nheads, nheads_k, head_dim, head_dim_v))
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        cu_q = _cu([0] + torch.tensor(lengths_q).cumsum(0).tolist())
        cu_k = _cu([0] + torch.tensor(lengths_k).cumsum(0).tolist())
        results = []
        for fn in (compiled, f):
            out = fn(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k))
            results.append((out.detach(), *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
        assert all(_equal(a, b) for a, b in zip(*results)), (lengths_q, nheads, head_dim)


# ------------------------------------------------------------------------------------------------------ EO

@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("head_dim_v", [32, 128])
def test_compiled_backward_over_inputs_of_different_shapes(cpu_ops, dynamic, head_dim_v):
    """EO: fullgraph torch.compile (aot_eager) of forward and backward with v's head_dim below or above q's (64),
    23 queries against 41 keys, 4 query heads over 2 K/V heads, a window: each gradient has its input's shape (the
    report's dV came back in q's) and eager's bits."""
    def f(q, k, v):
        return attention(q, k, v, window_size=(7, 3), return_lse=True)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    inputs = _inputs(2, 23, 41, 4, 2, 64, head_dim_v)
    got, expected = _dense_run(compiled, *inputs), _dense_run(f, *inputs)
    assert [tuple(g.shape) for g in got[2:]] == [tuple(t.shape) for t in inputs]
    assert all(_equal(a, b) for a, b in zip(got, expected))


def test_compiled_varlen_backward_over_inputs_of_different_shapes(cpu_ops):
    """EO: the same for attention_varlen (dynamic=True, fullgraph): v's head_dim 32 beside 64, fewer query tokens than
    key tokens, GQA; gradients of the inputs' shapes, eager's bits."""
    def f(q, k, v, cu_q, cu_k):
        return attention_varlen(q, k, v, cu_q, cu_k, 18, 20, causal=True, return_lse=True)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    q, k, v = (t[0].detach().requires_grad_(True) for t in _inputs(1, 30, 34, 4, 2, 64, 32))
    cu_q, cu_k = _cu([0, 12, 30]), _cu([0, 20, 34])
    results = []
    for fn in (compiled, f):
        out, lse = fn(q, k, v, cu_q, cu_k)
        results.append((out.detach(), lse.detach(),
                        *torch.autograd.grad(out.float().square().sum() + lse.sum(), (q, k, v))))
    assert [tuple(g.shape) for g in results[0][2:]] == [(30, 4, 64), (34, 2, 64), (34, 2, 32)]
    assert all(_equal(a, b) for a, b in zip(*results))


# ------------------------------------------------------------------------------------------------------ EP

def _leaves():
    return [t.requires_grad_(True) for t in _dense()]


def _grads(q, k, v, dout, **opts):
    return torch.autograd.grad(attention(q, k, v, causal=True, **opts), (q, k, v), dout)


@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_node_pre_and_post_hooks_run_and_take_effect(cpu_ops, api):
    """EP: a pre-hook on out.grad_fn (the library's C++ node) doubling dO, and a post-hook tripling the input
    gradients: each runs once, sees out's and the inputs' shapes (LSE's gradient None: not used), and the gradients
    are 3 x those of 2 x dO, rounded as the hook rounds them."""
    if api == "dense":
        q, k, v = _leaves()
        run = lambda q, k, v: attention(q, k, v, causal=True)  # noqa: E731
    else:
        q, k, v = (t.requires_grad_(True) for t in _varlen())
        run = lambda q, k, v: attention_varlen(q, k, v, _cu([0, 12, 30]), _cu([0, 20, 34]), 18, 20)  # noqa: E731
    out = run(q, k, v)
    dout = torch.randn_like(out)
    seen = {}

    def pre(grad_outputs):
        seen.setdefault("pre", []).append([None if g is None else tuple(g.shape) for g in grad_outputs])
        return tuple(None if g is None else 2 * g for g in grad_outputs)

    def post(grad_inputs, grad_outputs):
        seen.setdefault("post", []).append([None if g is None else tuple(g.shape) for g in grad_inputs])
        return tuple(None if g is None else 3 * g for g in grad_inputs)

    out.grad_fn.register_prehook(pre)
    out.grad_fn.register_hook(post)
    hooked = torch.autograd.grad(out, (q, k, v), dout)
    plain = torch.autograd.grad(run(q, k, v), (q, k, v), 2 * dout)
    assert seen["pre"] == [[tuple(out.shape), None]]
    assert seen["post"][0][:3] == [tuple(t.shape) for t in (q, k, v)] and len(seen["post"]) == 1
    assert all(_equal(a, 3 * b) for a, b in zip(hooked, plain))


def test_multi_grad_hooks_over_the_inputs(cpu_ops):
    """EP: register_multi_grad_hook over q, k, v: mode "all" with backward() gets the three gradients once (equal to
    .grad), mode "any" with torch.autograd.grad runs once with one of them; the gradients are those without hooks."""
    from torch.autograd.graph import register_multi_grad_hook

    q, k, v = _leaves()
    dout = torch.randn_like(q)
    expected = _grads(q, k, v, dout)
    got = []
    handle = register_multi_grad_hook((q, k, v), got.append, mode="all")
    attention(q, k, v, causal=True).backward(dout)
    handle.remove()
    assert len(got) == 1 and all(_equal(a, b) for a, b in zip(got[0], expected))
    assert all(_equal(t.grad, e) for t, e in zip((q, k, v), expected))
    got.clear()
    handle = register_multi_grad_hook((q, k, v), got.append, mode="any")
    again = _grads(q, k, v, dout)
    handle.remove()
    assert len(got) == 1 and any(_equal(got[0], e) for e in expected)
    assert all(_equal(a, b) for a, b in zip(again, expected))


def test_post_accumulate_grad_hooks_and_flop_counting_in_backward(cpu_ops):
    """EP: post-accumulate-grad hooks on q, k, v (optimizer-in-backward) run once each after .grad is set, with the
    gradients without hooks; under FlopCounterMode (which registers its own module hooks) the same backward counts
    the forward and backward formulas of the op."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = _leaves()
    dout = torch.randn_like(q)
    expected = _grads(q, k, v, dout)
    seen = []
    handles = [t.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.clone())) for t in (q, k, v)]
    with FlopCounterMode(display=False) as counter:
        attention(q, k, v, causal=True).backward(dout)
    for h in handles:
        h.remove()
    assert len(seen) == 3 and all(any(_equal(s, e) for e in expected) for s in seen)
    assert all(_equal(t.grad, e) for t, e in zip((q, k, v), expected))
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert counts["flash_attn_hopper.fwd"] > 0 and counts["flash_attn_hopper.bwd"] > 0, counts
