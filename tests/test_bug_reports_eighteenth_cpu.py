"""Eighteenth round of the bug hunt (tests/bug_report_sources.md, "Eighteenth round"), CPU part.

EB: a torch.masked.MaskedTensor as q, k or v (pytorch/pytorch#92350: MaskedTensor's dispatch of an op it does not know
fails with "no implementation found ... on types that implement __torch_dispatch__", naming neither the argument nor
the cause, after a UserWarning). FAULT: the library's checks let it through and the op's dispatch failed the same way
("Multiple dispatch failed for 'torch._ops.flash_attn_hopper.fwd.default'"). Fixed: a TypeError naming the argument,
saying the mask would not be applied and how to express one, before any op runs.
EC: a learnable temperature passed as softmax_scale (a 0-d tensor or nn.Parameter; Amshaker/unetr_plus_plus#80,
pytorch/helion#969): float() of it would drop its gradient silently. No fault: refused by name (TypeError) in eager
and in a compiled function (which falls back to eager and raises the same), and no op runs.
ED: torch.compiler.allow_in_graph around a user's function calling attention / attention_varlen (what the graph-break
message of FlashAttention 3 told users to do, pytorch/pytorch#144540, Dao-AILab/flash-attention#1435): the function
then runs under AOTAutograd's fake tensors, so no host read of cu_seqlens may be baked into the graph. No fault: the
compiled calls equal eager's, and a second varlen call with other cu_seqlens values reuses the graph and follows the
new values.

The ops run through the CPU stand-ins of tests/cpu_stand_ins.py.
"""

import warnings

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen

import cpu_stand_ins
from cpu_stand_ins import dense_inputs as _dense, varlen_inputs as _varlen


# ------------------------------------------------------------------------------------------------------ EB

def _masked(t, keep_rows):
    from torch.masked import masked_tensor

    mask = torch.zeros_like(t, dtype=torch.bool)
    mask[..., :keep_rows, :, :] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (MaskedTensor's "prototype stage" warning)
        return masked_tensor(t, mask)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_masked_tensor_inputs_are_refused_by_name(cpu_ops, which):
    """EB: attention with one of q, k, v a MaskedTensor (fp16: MaskedTensor takes no bf16) raises a TypeError that
    starts with the argument's name and says the mask would not be applied; no op ran and no warning was issued
    (before the fix: MaskedTensor's "fwd is not implemented" UserWarning, then "Multiple dispatch failed")."""
    q, k, v = _dense(torch.float16)
    args = {"q": q, "k": k, "v": v}
    args[which] = _masked(args[which], keep_rows=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        message = rf"^{which} is a torch\.masked\.MaskedTensor; its mask would not be applied"
        with pytest.raises(TypeError, match=message):
            attention(args["q"], args["k"], args["v"], causal=True)
    assert cpu_stand_ins.CALLS == []


def test_masked_tensor_varlen_input_is_refused_by_name(cpu_ops):
    """EB: attention_varlen with k a MaskedTensor: the same refusal naming k, before cu_seqlens are read."""
    q, k, v = (t.half() for t in _varlen())
    cu_q = torch.tensor([0, 12, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 34], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^k is a torch\.masked\.MaskedTensor"):
        attention_varlen(q, _masked_3d(k), v, cu_q, cu_k, 18, 20)
    assert cpu_stand_ins.CALLS == []


def _masked_3d(t):
    from torch.masked import masked_tensor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return masked_tensor(t, torch.ones_like(t, dtype=torch.bool))


# ------------------------------------------------------------------------------------------------------ EC

@pytest.mark.parametrize("argument", ["softmax_scale", "softcap"])
@pytest.mark.parametrize("kind", ["tensor", "parameter"])
def test_learnable_temperature_is_refused_not_detached(cpu_ops, argument, kind):
    """EC: a 0-d tensor (or an nn.Parameter that requires grad) as softmax_scale or softcap raises a TypeError naming
    the argument, eager and inside torch.compile (no fullgraph: the compiled function falls back to eager, which
    raises); no op ran, so no result without the temperature's gradient was returned."""
    q, k, v = _dense()
    value = torch.tensor(0.125 if argument == "softmax_scale" else 5.0)
    if kind == "parameter":
        value = torch.nn.Parameter(value)

    def f(q, k, v):
        return attention(q, k, v, causal=True, **{argument: value})

    for fn in (f, torch.compile(f, backend="aot_eager")):
        with pytest.raises(TypeError, match=rf"^{argument} must be a real number"):
            fn(q, k, v)
    assert cpu_stand_ins.CALLS == []
    # the control: the same value as a Python float runs
    out = attention(q, k, v, causal=True, **{argument: float(value.detach())})
    assert out.shape == (2, 17, 4, 64) and cpu_stand_ins.CALLS == [("fwd", False, None, None)]


# ------------------------------------------------------------------------------------------------------ ED

def test_allow_in_graph_dense_equals_eager(cpu_ops):
    """ED: torch.compiler.allow_in_graph around a caller of attention, in a fullgraph compile (aot_eager): out and
    dq bit for bit eager's, packed documents included (their bounds computed in the graph)."""
    # (a wrapper of the user's, as the workaround is applied: allow_in_graph of the library function itself would
    # change how every later compiled call of it in this process is traced)
    wrapped = torch.compiler.allow_in_graph(lambda *args, **kwargs: attention(*args, **kwargs))
    ids = torch.tensor([[0] * 5 + [1] * 12, [3] * 17])

    def f(fn, q, k, v):
        return fn(q, k, v, causal=True, window_size=(6, 0), softcap=5.0, document_ids=ids)

    compiled = torch.compile(lambda q, k, v: f(wrapped, q, k, v), backend="aot_eager", fullgraph=True)
    results = []
    for fn in (lambda q, k, v: f(attention, q, k, v), compiled):
        q, k, v = _dense()
        q.requires_grad_(True)
        out = fn(q, k, v)
        (dq,) = torch.autograd.grad(out.float().square().sum(), q)
        results.append((out.detach(), dq))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_allow_in_graph_varlen_follows_new_cu_seqlens(cpu_ops):
    """ED: allow_in_graph around a caller of attention_varlen, fullgraph: the first call equals eager; a second call
    with other cu_seqlens values (same shapes, same maxima) runs the same graph (error_on_recompile) and equals eager
    on the new values (a host read at trace time would have kept the first call's cut and boundaries)."""
    wrapped = torch.compiler.allow_in_graph(lambda *args, **kwargs: attention_varlen(*args, **kwargs))
    compiled = torch.compile(lambda q, k, v, cq, ck: wrapped(q, k, v, cq, ck, 20, 24, causal=True),
                             backend="aot_eager", fullgraph=True)
    q, k, v = _varlen()
    # the second call's last sequence ends before the rows do: rows past it must come back as 0 / -inf as in eager
    results = []
    for cu_q, cu_k in ((torch.tensor([0, 12, 30], dtype=torch.int32), torch.tensor([0, 10, 34], dtype=torch.int32)),
                       (torch.tensor([0, 20, 27], dtype=torch.int32), torch.tensor([0, 24, 31], dtype=torch.int32))):
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = compiled(q, k, v, cu_q, cu_k)
        expected = attention_varlen(q, k, v, cu_q, cu_k, 20, 24, causal=True)
        assert torch.equal(got, expected), cu_q.tolist()
        results.append(got)
    assert not torch.equal(results[0], results[1])  # (the two boundaries give different answers: the check can fail)
