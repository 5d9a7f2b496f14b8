"""Twenty-fourth round of the bug hunt (tests/bug_report_sources.md, "Twenty-fourth round"), CPU part: the
constructions of tests/test_bug_reports_twentyfourth_gpu.py run through the CPU stand-ins of the ops
(tests/cpu_stand_ins.py: the extension's op schemas, fake kernels and C++ autograd node; float32 references for the
kernels), and each check is shown to fail for a stand-in with the fault its reports describe.

FC: self-overlapping views (Longformer chunks sharing rows between batch elements, heads sharing columns): the Python
layer and the C++ node take them, the rule holds per view and the bases' gradients are the sums of the views'
(autograd's unfold / as_strided backward); a backward that writes its gradients through the inputs' own strides
(later chunks over earlier ones, as PaddlePaddle/Paddle#79718's overlapping-view backward did) fails the checks.
FD: a compiled graph (aot_eager, fullgraph) over rows / batch elements picked by a boolean mask, run with none and one
picked: one graph, the eager call's bits, empty out and LSE, zero gradients; a forward that refuses an empty batch (as
CK's "batch size must be positive", pytorch/pytorch#195812) fails it.
FE: one latent buffer read as K (192 columns) and V (its first 128): the rule holds and the buffer's gradient is dK +
dV; a forward that steps V's rows by head_dim_v (ikawrakow/ik_llama.cpp#2031's V pointer) fails the rule.
"""

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen

from cpu_stand_ins import STAND_INS, bwd_stand_in, fwd_stand_in, ops_on_cpu, stand_ins
from gpu_helpers import check_attention, check_attention_varlen
from test_bug_reports_twentyfourth_gpu import (_chunked, _overlapping_heads, _picked_batch, _picked_rows, _run,
                                              assert_fold)

DTYPE = torch.bfloat16


# ------------------------------------------------------------------------------- FC: self-overlapping input views


def _chunk_case(w=24, chunks=5, head_dim=64):
    torch.manual_seed(240)
    rows = (chunks + 1) * w
    bases = [torch.randn(1, rows, h, head_dim, dtype=DTYPE).requires_grad_(True) for h in (4, 2, 2)]
    views = [_chunked(b, w) for b in bases]
    dout = torch.randn(chunks, 2 * w, 4, head_dim, dtype=DTYPE)
    return bases, views, dout


def _check_chunks(bases, views, dout, w, causal):
    out, lse = attention(*views, causal=causal, return_lse=True)
    grads = torch.autograd.grad(out, [*views, *bases], dout)
    check_attention(out.detach(), lse.detach(), grads[:3], *(t.detach() for t in views), dout, "chunks",
                    causal=causal)
    for base_grad, view_grad in zip(grads[3:], grads[:3]):
        parts = [(view_grad[c], (0, slice(c * w, c * w + 2 * w))) for c in range(view_grad.shape[0])]
        assert_fold(base_grad, parts, "chunks base")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_overlapping_chunks_pass_a_right_kernel(monkeypatch, causal):
    """FC's chunks (5 chunks of 48 rows every 24 rows, GQA 4/2, bf16): the views overlap as the GPU test asserts, the
    library takes them, and the stand-ins meet the GPU test's checks."""
    bases, views, dout = _chunk_case()
    q = views[0]
    assert q.stride(0) < q.shape[1] * q.stride(1) and q.stride(-1) == 1
    with stand_ins(monkeypatch):
        _check_chunks(bases, views, dout, 24, causal)


def _written_through_strides(g, t):
    """g laid out with t's own (overlapping) strides in a fresh buffer, batch element after batch element: where t's
    elements share memory the later one's gradient is kept (a kernel storing dK with k's strides)."""
    extent = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    view = torch.zeros(extent, dtype=g.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
    for b in range(t.shape[0]):
        view[b] = g[b]
    return view


def _bwd_through_input_strides(dout, q, k, v, *args, **kwargs):
    dq, dk, dv = bwd_stand_in(dout, q, k, v, *args, **kwargs)
    return _written_through_strides(dq, q), _written_through_strides(dk, k), _written_through_strides(dv, v)


def test_overlapping_chunks_fail_a_backward_writing_through_the_input_strides(monkeypatch):
    """FC's checks catch the fault: gradients written with the views' own strides lose the overlapped rows' earlier
    contributions, and the per-view gradients fail by the rule (the bases' folds are PyTorch's and still agree)."""
    bases, views, dout = _chunk_case()
    with ops_on_cpu(monkeypatch, {**STAND_INS, "bwd": _bwd_through_input_strides}, "its op schemas"):
        with pytest.raises(AssertionError):
            _check_chunks(bases, views, dout, 24, causal=True)


def test_overlapping_heads_pass_a_right_kernel(monkeypatch):
    """FC's overlapping heads (head stride half the head_dim), causal GQA 4/2 at head_dim 128, smaller sequences than
    the GPU test: per-view rule and the bases' gradients the sums of the heads'."""
    torch.manual_seed(241)
    bases = [torch.randn(2, s, (h + 1) * 64, dtype=DTYPE).requires_grad_(True) for s, h in ((37, 4), (29, 2), (29, 2))]
    views = [_overlapping_heads(b, h, 128) for b, h in zip(bases, (4, 2, 2))]
    assert views[0].stride(2) == 64 and views[0].stride(1) == 5 * 64
    dout = torch.randn(2, 37, 4, 128, dtype=DTYPE)
    with stand_ins(monkeypatch):
        out, lse = attention(*views, causal=True, return_lse=True)
        grads = torch.autograd.grad(out, [*views, *bases], dout)
    check_attention(out.detach(), lse.detach(), grads[:3], *(t.detach() for t in views), dout, "heads", causal=True)
    for base_grad, view_grad in zip(grads[3:], grads[:3]):
        parts = [(view_grad[:, :, h], (slice(None), slice(None), slice(h * 64, h * 64 + 128)))
                 for h in range(view_grad.shape[2])]
        assert_fold(base_grad, parts, "heads base")


def test_fold_check_catches_a_dropped_contribution():
    """assert_fold fails when one overlapping contribution is missing (Paddle #79718's write instead of add)."""
    torch.manual_seed(242)
    g = torch.randn(3, 8, 2, 4, dtype=DTYPE)
    parts = [(g[c], (0, slice(c * 4, c * 4 + 8))) for c in range(3)]
    base = torch.zeros(1, 16, 2, 4, dtype=torch.float64)
    for c in range(3):
        base[0, c * 4:c * 4 + 8] = g[c].double()  # written, not added: the shared rows keep the later chunk
    with pytest.raises(AssertionError):
        assert_fold(base.to(DTYPE), parts, "written over")
    for c in range(3):
        base[0, c * 4:c * 4 + 8] = 0
    for c in range(3):
        base[0, c * 4:c * 4 + 8] += g[c].double()
    assert_fold(base.to(DTYPE), parts, "summed")


# ----------------------------------------------------------------------- FD: zero / one rows from a compiled graph


def _compiled_picks(what, counts):
    """Runs the GPU test's construction on the CPU (smaller): compiled (aot_eager, fullgraph) against eager for each
    picked count; raises AssertionError on a difference, a wrong shape, a nonzero gradient for none picked, or a
    recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(243)
    batch, seqlen = (2, 45) if what == "rows" else (5, 33)
    q = torch.randn(batch, seqlen, 4, 64, dtype=DTYPE)
    k = torch.randn(batch, seqlen, 2, 64, dtype=DTYPE)
    v = torch.randn(batch, seqlen, 2, 64, dtype=DTYPE)
    fn = _picked_rows if what == "rows" else _picked_batch
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            for kept in counts:
                n = batch if what == "batch" else seqlen
                keep = torch.zeros(n, dtype=torch.bool)
                keep[torch.randperm(n)[:kept]] = True
                out_shape = (batch, kept, 4, 64) if what == "rows" else (kept, seqlen, 4, 64)
                dout = torch.randn(*out_shape)
                comp = _run(compiled, q, k, v, dout, keep)  # first: a fault must show in the compiled graph
                eager = _run(fn, q, k, v, dout, keep)
                for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), eager, comp):
                    if not (a.shape == b.shape and torch.equal(a, b)):
                        raise AssertionError(f"{what} {kept}: compiled {label} differs from eager")
                if comp[0].shape != out_shape or comp[1].shape != (out_shape[0], 4, out_shape[1]):
                    raise AssertionError(f"{what} {kept}: shapes {comp[0].shape}, {comp[1].shape}")
                if kept == 0 and any(torch.count_nonzero(g).item() for g in comp[2:]):
                    raise AssertionError(f"{what} 0: a gradient is not 0")
        if counter.frame_count != 1:
            raise AssertionError(f"{what}: {counter.frame_count} graphs")
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("what", ["rows", "batch"])
def test_compiled_graph_handed_zero_or_one_rows(monkeypatch, what):
    """FD on the CPU: 7 / 3 picked, then none, one, 20 / 4: one graph, eager's bits, empty results, zero gradients."""
    with stand_ins(monkeypatch):
        _compiled_picks(what, (7, 0, 1, 20) if what == "rows" else (3, 0, 1, 4))


def _fwd_refusing_empty(q, *args, **kwargs):
    if q.numel() == 0:
        raise RuntimeError("batch size must be positive")
    return fwd_stand_in(q, *args, **kwargs)


@pytest.mark.parametrize("what", ["rows", "batch"])
def test_compiled_zero_rows_fail_a_forward_refusing_empty_input(monkeypatch, what):
    """FD's run catches the fault of PyTorch #195812 (an op aborting on the empty batch a compiled graph hands it)."""
    with ops_on_cpu(monkeypatch, {**STAND_INS, "fwd": _fwd_refusing_empty}, "its op schemas"):
        with pytest.raises(RuntimeError, match="positive"):
            _compiled_picks(what, (3, 0))


# ------------------------------------------------------------------ FE: absorbed-MLA buffer read as K and as V


def _mla(seqlen_q, seqlen_k, seed):
    torch.manual_seed(seed)
    q = torch.randn(2, seqlen_q, 8, 192, dtype=DTYPE).requires_grad_(True)
    buf = torch.randn(2, seqlen_k, 1, 192, dtype=DTYPE).requires_grad_(True)
    return q, buf, buf[..., :], buf[..., :128], torch.randn(2, seqlen_q, 8, 128, dtype=DTYPE)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 300), (67, 150)], ids=["decode", "prefill"])
def test_mla_buffer_passes_a_right_kernel(monkeypatch, seqlen_q, seqlen_k):
    """FE (MQA on one latent buffer, 8 query heads, causal): out, LSE, dQ, dK, dV by the rule and dbuf = dK + dV."""
    q, buf, k, v, dout = _mla(seqlen_q, seqlen_k, 244)
    assert v.data_ptr() == k.data_ptr() and v.stride(1) == 192
    with stand_ins(monkeypatch):
        out, lse = attention(q, k, v, causal=True, return_lse=True)
        dq, dk, dv, dbuf = torch.autograd.grad(out, [q, k, v, buf], dout)
    check_attention(out.detach(), lse.detach(), (dq, dk, dv), q.detach(), k.detach(), v.detach(), dout, "mla",
                    causal=True)
    assert_fold(dbuf, [(dk, (Ellipsis, slice(None))), (dv, (Ellipsis, slice(0, 128)))], "mla buffer")


def test_mla_buffer_varlen_passes_a_right_kernel(monkeypatch):
    """FE through attention_varlen (lengths (1, 30, 0, 17) against (130, 41, 9, 17), one latent head)."""
    torch.manual_seed(245)
    lq, lk = [1, 30, 0, 17], [130, 41, 9, 17]
    q = torch.randn(sum(lq), 8, 192, dtype=DTYPE).requires_grad_(True)
    buf = torch.randn(sum(lk), 1, 192, dtype=DTYPE).requires_grad_(True)
    k, v = buf[..., :], buf[..., :128]
    dout = torch.randn(sum(lq), 8, 128, dtype=DTYPE)
    cu_q = torch.tensor([0, 1, 31, 31, 48], dtype=torch.int32)
    cu_k = torch.tensor([0, 130, 171, 180, 197], dtype=torch.int32)
    with stand_ins(monkeypatch):
        out, lse = attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)
        dq, dk, dv, dbuf = torch.autograd.grad(out, [q, k, v, buf], dout)
    check_attention_varlen(out.detach(), lse.detach(), (dq, dk, dv), q.detach(), k.detach(), v.detach(), dout, cu_q,
                           cu_k, "mla varlen", causal=True)
    assert_fold(dbuf, [(dk, (Ellipsis, slice(None))), (dv, (Ellipsis, slice(0, 128)))], "mla varlen buffer")


def _fwd_v_rows_by_head_dim_v(q, k, v, *args, **kwargs):
    """A faulty forward: V's rows stepped by head_dim_v (a contiguous layout of v's own width over v's memory), as
    ik_llama.cpp #2031's vec kernel stepped V by Dv while K stepped Dk."""
    b, s, h, d = v.shape
    stepped = torch.as_strided(v, v.shape, (s * h * d, h * d, d, 1), v.storage_offset())
    return fwd_stand_in(q, k, stepped, *args, **kwargs)


def test_mla_buffer_fails_a_forward_stepping_v_by_its_own_width(monkeypatch):
    """FE's check catches the fault: out off the rule (a decode row against 300 keys)."""
    q, buf, k, v, dout = _mla(1, 300, 246)
    with ops_on_cpu(monkeypatch, {**STAND_INS, "fwd": _fwd_v_rows_by_head_dim_v}, "its op schemas"):
        out, lse = attention(q, k, v, causal=True, return_lse=True)
        dq, dk, dv = torch.autograd.grad(out, [q, k, v], dout)
    with pytest.raises(AssertionError):
        check_attention(out.detach(), lse.detach(), (dq, dk, dv), q.detach(), k.detach(), v.detach(), dout, "mla",
                        causal=True)
