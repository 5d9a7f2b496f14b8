"""Twenty-fifth round of the bug hunt (tests/bug_report_sources.md, "Twenty-fifth round"), GPU part.

FF: a CUDA graph captured across several streams: inside ``torch.cuda.graph`` the capture stream forks two side streams
(``wait_stream``), a dense forward and backward runs on one and a varlen forward and backward on the other, and both
join back before the capture ends (the multi-stream overlap that serving engines capture). Every launch must go to the
current stream of its branch: a kernel launched on the legacy default stream invalidates the capture (CUDA's global
capture mode raises), one on a stream remembered from another call is not recorded (thu-ml/SageAttention#371: the
replayed graph silently kept stale attention outputs; huggingface/candle#3596: hard-coded stream 0, a race in
multi-stream setups and nothing recorded in a capture), and one on the capture origin stream instead of its branch
is unordered with the branch's own earlier work (its forward's out and LSE), a race that may not show every run. Class A
captured on one stream, class 25 and Y ran side streams eagerly.
FG: autograd's streaming backward: the forward runs on stream A, the backward is called from stream B, where dO and
dLSE are written late (B held busy first) and where the gradients are read right after, without a synchronisation.
The engine runs the op's backward on A after making A wait for B, and makes B wait for A before returning
(pytorch/pytorch#7601, #8354, #45787, #47028, #59844 / #60127, the engine's own bugs at each step). The library's
backward must launch on the stream the engine makes current and allocate there: a launch on the legacy default
stream or on a library-private stream reads dO before the late writes (a launch on the caller's stream B would still
see them, so this test does not catch that one). Class 25 ran forward and backward on one side stream.
FH: a torch.compile'd training step differentiated twice (``retain_graph=True``): AOTAutograd may mark saved
activations that are not outputs as donated buffers that the compiled backward reuses (pytorch/pytorch#129496,
#130580, #131038, #139669); it compiles the backward at its first call and, when that call retains the graph, donates
nothing, so the second backward must give the first's gradients again. A backward op that writes into its saved out
or LSE (a log2 conversion in place), hidden from the graph by its schema, gives a different second backward.

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py: "no CUDA GPU: GPU tests need an sm90
GPU (H100/H200)"), and per test when the build lacks the head_dim / dtype."""

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen
from gpu_helpers import (GRAD_NAMES, attention_inputs, bits, built_dtype, check_attention, check_attention_varlen,
                         cu_seqlens, randn)

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: holds a stream busy for ~0.1 s on an H100 / H200
DENSE = (2, 203, 141, 4, 2, 128)  # batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim
LQ, LK = [1, 130, 0, 77], [40, 129, 33, 77]  # varlen lengths (a sequence without queries, rows that see no key)


def _dense_step(leaves, dout, dlse):
    """Causal GQA forward with the LSE, then dQ, dK, dV of the loss <out, dout> + <lse, dlse> (deterministic order)."""
    out, lse = attention(*leaves, causal=True, return_lse=True, deterministic=True)
    return out, lse, torch.autograd.grad([out, lse], leaves, [dout, dlse])


def _varlen_step(leaves, dout, cu_q, cu_k):
    out, lse = attention_varlen(*leaves, cu_q, cu_k, max(LQ), max(LK), causal=True, return_lse=True)
    return out, lse, torch.autograd.grad(out, leaves, dout)


def _varlen_inputs(dtype, head_dim=128):
    q = randn(sum(LQ), 4, head_dim, dtype=dtype)
    k = randn(sum(LK), 2, head_dim, dtype=dtype)
    v = randn(sum(LK), 2, head_dim, dtype=dtype)
    return q, k, v, randn(sum(LQ), 4, head_dim, dtype=dtype)


def _eager_dense(q, k, v, dout, dlse):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse, grads = _dense_step(leaves, dout, dlse)
    return out.detach(), lse.detach(), grads


def _raw(t):
    """A bitwise copy (NaN == NaN) of an fp16 / bf16 (gpu_helpers.bits) or float32 tensor."""
    return t.detach().contiguous().view(torch.int32).clone() if t.dtype == torch.float32 else bits(t)


def _assert_bits(name, got, want):
    """got and want: (out, lse, dq, dk, dv), bit for bit."""
    for label, a, b in zip(("out", "lse", *GRAD_NAMES), got, want):
        if not (a.shape == b.shape and a.dtype == b.dtype and torch.equal(_raw(a), _raw(b))):
            raise AssertionError(f"{name}: {label} differs from the same deterministic call run eagerly")


# --------------------------------------------------------------------- FF: a CUDA graph captured across two streams


def test_cuda_graph_captured_across_forked_streams():
    """FF (SageAttention #371, candle #3596): inside one capture, the capture stream forks two side streams; a dense
    causal GQA 4/2 forward and backward with dLSE (deterministic) runs on the first, a varlen causal forward and
    backward on the second, and both join back. After a warm-up of the same forked step, the graph is replayed twice
    with fresh values in the static inputs (outputs NaN-filled before each replay): the dense branch's out, LSE, dQ,
    dK, dV bit for bit those of the eager deterministic call on the same values, and by the rule; the varlen branch's
    by the rule, rows that see no key 0. A launch on the legacy default stream fails the capture itself; one not
    recorded, or unordered within its branch, leaves NaN or the previous replay's values."""
    head_dim = DENSE[-1]
    dtype = built_dtype(head_dim)
    dense = list(attention_inputs(*DENSE, dtype)) + [randn(DENSE[0], DENSE[3], DENSE[1], dtype=torch.float32)]
    varlen = list(_varlen_inputs(dtype, head_dim))
    cu_q, cu_k = cu_seqlens(LQ), cu_seqlens(LK)
    dense_leaves = [t.requires_grad_(True) for t in dense[:3]]
    varlen_leaves = [t.requires_grad_(True) for t in varlen[:3]]
    branches = [torch.cuda.Stream(), torch.cuda.Stream()]

    def forked_step():
        origin = torch.cuda.current_stream()
        for s in branches:
            s.wait_stream(origin)
        with torch.cuda.stream(branches[0]):
            a = _dense_step(dense_leaves, dense[3], dense[4])
        with torch.cuda.stream(branches[1]):
            b = _varlen_step(varlen_leaves, varlen[3], cu_q, cu_k)
        for s in branches:
            origin.wait_stream(s)
        return a, b

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forked_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (d_out, d_lse, d_grads), (v_out, v_lse, v_grads) = forked_step()
    for replay in range(2):
        fresh_dense = list(attention_inputs(*DENSE, dtype)) + [
            randn(DENSE[0], DENSE[3], DENSE[1], dtype=torch.float32)]
        fresh_varlen = list(_varlen_inputs(dtype, head_dim))
        with torch.no_grad():
            for dst, src in zip(dense + varlen, fresh_dense + fresh_varlen):
                dst.copy_(src)
            for t in (d_out, d_lse, *d_grads, v_out, v_lse, *v_grads):
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        name = f"forked-stream graph replay {replay}"
        got = (d_out.detach(), d_lse.detach(), *d_grads)
        eager = _eager_dense(*fresh_dense)
        _assert_bits(f"{name} dense", got, (eager[0], eager[1], *eager[2]))
        check_attention(got[0], got[1], d_grads, *fresh_dense[:4], f"{name} dense", dlse=fresh_dense[4],
                        causal=True)
        check_attention_varlen(v_out.detach(), v_lse.detach(), v_grads, *fresh_varlen, cu_q, cu_k,
                               f"{name} varlen", causal=True)


# ----------------------------------------------------------------------- FG: the backward on the forward's stream


@pytest.mark.parametrize("how", ["autograd_grad", "backward"])
def test_backward_called_from_another_stream_with_late_output_gradients(how):
    """FG (PyTorch #7601, #8354, #45787, #47028, #59844): forward (causal GQA 4/2, deterministic, with the LSE) on
    stream A; from stream B, held busy, dO and dLSE are written into buffers that held other values, the backward is
    called (torch.autograd.grad: gradients out of place; .backward(): accumulated into .grad) and its gradients are
    copied on B at once. The copies, read after a device synchronisation, are bit for bit the gradients of the same
    call run on one stream, and right by the rule: a backward launched on the legacy default stream or a
    library-private stream (before the late writes), or read on B before it finished, gives the stale dO's gradients
    or NaN."""
    head_dim = DENSE[-1]
    dtype = built_dtype(head_dim)
    q, k, v, dout = attention_inputs(*DENSE, dtype)
    dlse = randn(DENSE[0], DENSE[3], DENSE[1], dtype=torch.float32)
    want = _eager_dense(q, k, v, dout, dlse)
    dout_buf, dlse_buf = torch.randn_like(dout), torch.randn_like(dlse)  # stale values, replaced on B after a sleep
    fwd_stream, caller = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    fwd_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(fwd_stream):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = attention(*leaves, causal=True, return_lse=True, deterministic=True)
    caller.wait_stream(fwd_stream)
    with torch.cuda.stream(caller):
        torch.cuda._sleep(SLEEP_CYCLES)
        dout_buf.copy_(dout)
        dlse_buf.copy_(dlse)
        if how == "autograd_grad":
            grads = torch.autograd.grad([out, lse], leaves, [dout_buf, dlse_buf])
        else:
            torch.autograd.backward([out, lse], [dout_buf, dlse_buf])
            grads = [t.grad for t in leaves]
        taken = [g.clone() for g in grads]  # read on B at once
        seen = (out.detach().clone(), lse.detach().clone())
    torch.cuda.synchronize()
    _assert_bits(f"backward from another stream ({how})", (*seen, *taken), (want[0], want[1], *want[2]))
    check_attention(seen[0], seen[1], taken, q, k, v, dout, f"backward from another stream ({how})", dlse=dlse,
                    causal=True)


def test_varlen_backward_called_from_another_stream():
    """FG through attention_varlen: forward on stream A, dO written late on a busy stream B, the backward called there
    and its gradients copied on B at once; by the rule against the fresh dO (rows that see no key 0)."""
    dtype = built_dtype(128)
    q, k, v, dout = _varlen_inputs(dtype)
    cu_q, cu_k = cu_seqlens(LQ), cu_seqlens(LK)
    dout_buf = torch.randn_like(dout)
    fwd_stream, caller = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    fwd_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(fwd_stream):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = attention_varlen(*leaves, cu_q, cu_k, max(LQ), max(LK), causal=True, return_lse=True)
    caller.wait_stream(fwd_stream)
    with torch.cuda.stream(caller):
        torch.cuda._sleep(SLEEP_CYCLES)
        dout_buf.copy_(dout)
        taken = [g.clone() for g in torch.autograd.grad(out, leaves, dout_buf)]
        seen = (out.detach().clone(), lse.detach().clone())
    torch.cuda.synchronize()
    check_attention_varlen(seen[0], seen[1], taken, q, k, v, dout, cu_q, cu_k, "varlen backward from another stream",
                           causal=True)


# ------------------------------------------------------------ FH: a compiled step differentiated twice (retain_graph)


def _compiled_twice(step, backend, inputs):
    """torch.compile(step)'s loss gradients on fresh leaves, twice through one graph (retain_graph=True first)."""
    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, backend=backend, fullgraph=True)
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        loss = compiled(*leaves)
        first = torch.autograd.grad(loss, leaves, retain_graph=True)
        return first, torch.autograd.grad(loss, leaves)
    finally:
        torch._dynamo.reset()


def _loss_step(return_lse, dout, dlse):
    """FH's step: the scalar loss <out, dout> (+ <lse, dlse> when return_lse) of a causal deterministic call."""
    def step(q, k, v):
        if return_lse:
            out, lse = attention(q, k, v, causal=True, return_lse=True, deterministic=True)
            return (out * dout).sum() + (lse * dlse).sum()
        return (attention(q, k, v, causal=True, deterministic=True) * dout).sum()
    return step


@pytest.mark.parametrize("return_lse", [False, True], ids=["loss_out", "loss_out_lse"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_step_differentiated_twice(backend, return_lse):
    """FH (PyTorch #129496, #130580, #139669): torch.compile(fullgraph=True) of a causal GQA 4/2 step (deterministic)
    whose loss reads out (and the LSE when returned); two backward passes through one graph, the first with
    retain_graph=True. PyTorch compiles the backward at its first call, and with retain_graph=True it does so
    without donated buffers (#129496's refusal then never arises; out and LSE are both saved, neither is an output of
    the step), so both passes must be bit for bit the eager step's gradients (deterministic), which are right by the
    rule. A backward op that writes into its saved out or LSE gives a different second pass."""
    head_dim = DENSE[-1]
    dtype = built_dtype(head_dim)
    q, k, v, dout = attention_inputs(*DENSE, dtype)
    dlse = randn(DENSE[0], DENSE[3], DENSE[1], dtype=torch.float32)

    step = _loss_step(return_lse, dout, dlse)
    eager_leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(step(*eager_leaves), eager_leaves)
    out, lse = attention(q, k, v, causal=True, return_lse=True, deterministic=True)
    check_attention(out, lse, want, q, k, v, dout, "eager step", dlse=dlse if return_lse else None, causal=True)

    first, second = _compiled_twice(step, backend, (q, k, v))
    for which, grads in (("first", first), ("second", second)):
        for gname, g, w in zip(GRAD_NAMES, grads, want):
            if not (g.shape == w.shape and g.dtype == w.dtype and torch.equal(_raw(g), _raw(w))):
                raise AssertionError(f"{backend} {which} backward: {gname} differs from the eager step's")
