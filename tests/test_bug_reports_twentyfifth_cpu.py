"""Twenty-fifth round of the bug hunt (tests/bug_report_sources.md, "Twenty-fifth round"), CPU part: the constructions
of tests/test_bug_reports_twentyfifth_gpu.py run through the CPU stand-ins of the ops (tests/cpu_stand_ins.py: the
extension's op schemas, fake kernels and C++ autograd node; float32 references for the kernels), and each check is
shown to fail for a stand-in with the fault its reports describe. The CPU has no streams or graphs: what runs here is
each test's arithmetic and its checks, with the fault modelled by what it does to the results.

FF: the two branches of the forked-stream graph (dense deterministic with dLSE, varlen), "replayed" by rerunning them on
fresh values written into the same static tensors: the checks pass; a forward whose launches escaped the capture
(SageAttention #371: the replay keeps the capture's outputs) is modelled by a stand-in that returns its first result
again, and the checks catch it.
FG: dO and dLSE written late into buffers that held other values: the checks pass for a backward that reads them after
the write and fail for one that read the stale values (a launch not ordered after the caller's stream).
FH: a compiled (aot_eager) step differentiated twice through one graph: both passes are the eager step's bits; a
backward op that converts its saved LSE to base 2 in place gives a different second pass, and the check catches it.
"""

import math

import pytest
import torch

from flash_attn_hopper import attention

from cpu_stand_ins import STAND_INS, bwd_stand_in, fwd_stand_in, ops_on_cpu, stand_ins
from gpu_helpers import check_attention, check_attention_varlen
from test_bug_reports_twentyfifth_gpu import (LK, LQ, _assert_bits, _compiled_twice, _dense_step, _loss_step, _raw,
                                             _varlen_step)

DTYPE = torch.bfloat16


def _dense(seed, head_dim=64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 37, 4, head_dim, dtype=DTYPE, generator=g)
    k = torch.randn(2, 29, 2, head_dim, dtype=DTYPE, generator=g)
    v = torch.randn(2, 29, 2, head_dim, dtype=DTYPE, generator=g)
    dout = torch.randn(2, 37, 4, head_dim, dtype=DTYPE, generator=g)
    return [q, k, v, dout, torch.randn(2, 4, 37, generator=g)]


def _varlen(seed, head_dim=64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(LQ), 4, head_dim, dtype=DTYPE, generator=g)
    k = torch.randn(sum(LK), 2, head_dim, dtype=DTYPE, generator=g)
    v = torch.randn(sum(LK), 2, head_dim, dtype=DTYPE, generator=g)
    return [q, k, v, torch.randn(sum(LQ), 4, head_dim, dtype=DTYPE, generator=g)]


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


# --------------------------------------------------------------------- FF: a CUDA graph captured across two streams


def _replays(seeds):
    """The GPU test's two branches on static tensors, rerun after each fresh copy; raises AssertionError when a run's
    results are not those of its values."""
    dense, varlen = _dense(250), _varlen(251)
    cu_q, cu_k = _cu(LQ), _cu(LK)
    dense_leaves = [t.requires_grad_(True) for t in dense[:3]]
    varlen_leaves = [t.requires_grad_(True) for t in varlen[:3]]
    _dense_step(dense_leaves, dense[3], dense[4])  # the capture
    _varlen_step(varlen_leaves, varlen[3], cu_q, cu_k)
    for seed in seeds:
        fresh_dense, fresh_varlen = _dense(seed), _varlen(seed + 1)
        with torch.no_grad():
            for dst, src in zip(dense + varlen, fresh_dense + fresh_varlen):
                dst.copy_(src)
        d_out, d_lse, d_grads = _dense_step(dense_leaves, dense[3], dense[4])
        v_out, v_lse, v_grads = _varlen_step(varlen_leaves, varlen[3], cu_q, cu_k)
        check_attention(d_out.detach(), d_lse.detach(), d_grads, *fresh_dense[:4], "dense replay",
                        dlse=fresh_dense[4], causal=True)
        check_attention_varlen(v_out.detach(), v_lse.detach(), v_grads, *fresh_varlen, cu_q, cu_k, "varlen replay",
                               causal=True)


def test_forked_branches_replayed_pass_a_right_kernel(monkeypatch):
    """FF's branches and checks on two sets of fresh values: they pass through the stand-ins."""
    with stand_ins(monkeypatch):
        _replays((252, 254))


def _first_result_kept(impl):
    kept = {}

    def fwd(q, *args, **kwargs):
        key = (tuple(q.shape), q.dtype)
        if key not in kept:
            kept[key] = impl(q, *args, **kwargs)
        return tuple(t.clone() for t in kept[key])
    return fwd


def test_forked_branches_replayed_fail_a_forward_that_escaped_the_capture(monkeypatch):
    """FF's checks catch a replay that kept the capture's forward results (SageAttention #371's stale outputs)."""
    impls = {**STAND_INS, "fwd": _first_result_kept(fwd_stand_in)}
    with ops_on_cpu(monkeypatch, impls, "its op schemas"):
        with pytest.raises(AssertionError):
            _replays((252,))


# ----------------------------------------------------------------------- FG: the backward on the forward's stream

STALE = {}


def _late_gradients(q, k, v, dout, dlse):
    """The GPU test's sequence: forward with the LSE, then dO and dLSE written into buffers holding other values, the
    backward through autograd.grad; (out, lse, grads)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = attention(*leaves, causal=True, return_lse=True, deterministic=True)
    dout_buf, dlse_buf = torch.randn_like(dout), torch.randn_like(dlse)
    STALE["dout"], STALE["dlse"] = dout_buf.clone(), dlse_buf.clone()
    dout_buf.copy_(dout)
    dlse_buf.copy_(dlse)
    grads = torch.autograd.grad([out, lse], leaves, [dout_buf, dlse_buf])
    return out.detach(), lse.detach(), grads


def test_late_output_gradients_pass_a_right_kernel(monkeypatch):
    """FG's construction: the gradients by the rule against the fresh dO and dLSE."""
    q, k, v, dout, dlse = _dense(255)
    with stand_ins(monkeypatch):
        out, lse, grads = _late_gradients(q, k, v, dout, dlse)
    check_attention(out, lse, grads, q, k, v, dout, "late dO", dlse=dlse, causal=True)


def _bwd_reading_stale(dout, q, k, v, out, lse, dlse, *args, **kwargs):
    return bwd_stand_in(STALE["dout"], q, k, v, out, lse, STALE["dlse"], *args, **kwargs)


def test_late_output_gradients_fail_a_backward_reading_the_stale_values(monkeypatch):
    """FG's check catches a backward that ran before the caller's writes landed (it read the buffers' old values)."""
    q, k, v, dout, dlse = _dense(256)
    with ops_on_cpu(monkeypatch, {**STAND_INS, "bwd": _bwd_reading_stale}, "its op schemas"):
        out, lse, grads = _late_gradients(q, k, v, dout, dlse)
    with pytest.raises(AssertionError):
        check_attention(out, lse, grads, q, k, v, dout, "stale dO", dlse=dlse, causal=True)


# ------------------------------------------------------------ FH: a compiled step differentiated twice (retain_graph)


def _twice(return_lse, seed=257):
    """The GPU test's step compiled with aot_eager (fullgraph): the two passes (the first with retain_graph=True)
    bit for bit the eager step's gradients, else AssertionError."""
    q, k, v, dout, dlse = _dense(seed)

    step = _loss_step(return_lse, dout, dlse)
    eager_leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(step(*eager_leaves), eager_leaves)
    first, second = _compiled_twice(step, "aot_eager", (q, k, v))
    for which, grads in (("first", first), ("second", second)):
        for g, w in zip(grads, want):
            if not torch.equal(_raw(g), _raw(w)):
                raise AssertionError(f"{which} backward differs from the eager step's")


@pytest.mark.parametrize("return_lse", [False, True], ids=["loss_out", "loss_out_lse"])
def test_compiled_step_twice_passes_a_right_kernel(monkeypatch, return_lse):
    """FH through the stand-ins: both passes are the eager step's bits."""
    with stand_ins(monkeypatch):
        _twice(return_lse)


def _bwd_converting_lse_in_place(dout, q, k, v, out, lse, *args, **kwargs):
    grads = bwd_stand_in(dout, q, k, v, out, lse, *args, **kwargs)
    lse.mul_(1 / math.log(2))  # the saved LSE turned into log2 units in place (a kernel's own workspace, misplaced)
    return grads


@pytest.mark.parametrize("return_lse", [False, True], ids=["loss_out", "loss_out_lse"])
def test_compiled_step_twice_fails_a_backward_writing_its_saved_lse(monkeypatch, return_lse):
    """FH's check catches a backward op that writes into its saved LSE: the second pass differs."""
    with ops_on_cpu(monkeypatch, {**STAND_INS, "bwd": _bwd_converting_lse_in_place}, "its op schemas"):
        with pytest.raises(AssertionError, match="second backward"):
            _twice(return_lse)


def test_bits_helper_tells_float32_apart():
    """_assert_bits (the GPU tests' bitwise comparison) fails on one changed float32 bit and passes on copies."""
    a = [torch.randn(3, 5, dtype=DTYPE), torch.randn(3, 5)] + [torch.randn(2, 3, dtype=DTYPE) for _ in range(3)]
    _assert_bits("copies", a, [t.clone() for t in a])
    b = [t.clone() for t in a]
    b[1][0, 0] = torch.nextafter(b[1][0, 0], torch.tensor(math.inf))
    with pytest.raises(AssertionError, match="lse"):
        _assert_bits("one bit", a, b)
