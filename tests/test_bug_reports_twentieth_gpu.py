"""Twentieth round of the bug hunt (tests/bug_report_sources.md, "Twentieth round"), GPU part.

EN: one torch.compile'd function called on shapes that change in every size (pytorch/pytorch#148545: SDPA under
torch.compile gave NaN for the second shape): out, LSE and gradients right by the rule at each call.
EO: a compiled backward over q, k, v of different shapes (pytorch/pytorch#110832: "returned an invalid gradient at
index 2" once v's head_dim differed from q's): fullgraph, static and dynamic, gradients of the inputs' shapes and
right by the rule.
EP: hooks on the library's autograd node (pytorch/pytorch#35802): a pre-hook doubling dO and a post-hook tripling the
input gradients take effect (deterministic backward: bitwise 3 x the gradients of 2 x dO).

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build lacks
the head_dim / dtype."""

import pytest
import torch

from flash_attn_hopper import attention
from gpu_helpers import attention_inputs, check_attention, require_built

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v)
_SHAPES = [(8, 900, 900, 20, 20, 64, 64), (1, 1536, 1536, 24, 24, 128, 128), (3, 203, 333, 4, 2, 128, 64),
           (2, 113, 77, 8, 1, 64, 128)]


def _compiled_run(fn, q, k, v, dout):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, lse = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), lse.detach(), grads


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_compiled_calls_on_changing_shapes(dynamic):
    """EN, EO: one fullgraph torch.compile'd causal attention (inductor) called on four shapes in a row (the report's
    two, then GQA with head_dim_v below and above head_dim, seqlen_q above and below seqlen_k): each call right by the
    rule, gradients of the inputs' shapes."""
    def f(q, k, v):
        return attention(q, k, v, causal=True, return_lse=True)

    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    for shape in _SHAPES:
        require_built(max(shape[5], shape[6]), torch.bfloat16)
    for shape in _SHAPES:
        # (shape[6] is head_dim_v: passed by keyword; attention_inputs' 7th positional argument is dtype)
        q, k, v, dout = attention_inputs(*shape[:6], torch.bfloat16, head_dim_v=shape[6])
        out, lse, grads = _compiled_run(compiled, q, k, v, dout)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        check_attention(out, lse, grads, q, k, v, dout, f"compiled {shape}", causal=True)


def test_node_hooks_take_effect():
    """EP: out.grad_fn.register_prehook doubling dO and register_hook tripling dq, dk, dv (GQA, causal,
    deterministic): the gradients are bitwise 3 x those of a plain backward with 2 x dO."""
    require_built(128, torch.bfloat16)
    q, k, v, dout = attention_inputs(2, 203, 203, 4, 2, 128, torch.bfloat16)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    out = attention(*leaves, causal=True, deterministic=True)
    calls = []
    out.grad_fn.register_prehook(lambda grads: (calls.append("pre"), tuple(None if g is None else 2 * g
                                                                             for g in grads))[1])
    out.grad_fn.register_hook(lambda grads_in, grads_out: (calls.append("post"), tuple(None if g is None else 3 * g
                                                                                       for g in grads_in))[1])
    hooked = torch.autograd.grad(out, leaves, dout)
    plain = torch.autograd.grad(attention(*leaves, causal=True, deterministic=True), leaves, 2 * dout)
    assert calls == ["pre", "post"]
    for name, a, b in zip(("dq", "dk", "dv"), hooked, plain):
        assert torch.equal(a, 3 * b), name
