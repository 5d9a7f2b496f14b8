"""More GPU tests modelled on bug reports filed against other attention kernels (FlashAttention 2/3/4, PyTorch SDPA and
FlexAttention, vLLM's and TileLang's attention, ...), for the kinds of fault that tests/test_bug_reports_gpu.py and
the other GPU test files do not yet exercise: CUDA graph capture and replay, autocast, inference mode, create_graph,
activation checkpointing and saved-tensor hooks, in-place changes of saved tensors, zero batch / zero heads, long
sequences (decoding against 2^18 keys, 70k-token causal attention, key rows past 2^31 elements in one sequence),
varlen with a loose max_seqlen or strided inputs, torch.compile with dynamic shapes, and several attention nodes in
one autograd graph. The report each test comes from is cited by URL in the comment above it (see also
tests/bug_report_sources.md); only the shapes and conditions of the reports are taken over, the code is this project's own.

Every result is checked by the rule of DESIGN.md §3 (``assert_close_by_rule`` against the float32 reference, the
error of the same reference run in the input dtype as the yardstick); outputs and gradients come from NaN-poisoned
memory where the helpers allow it. Skipped, with the reason, without an sm90 GPU and the built extension
(conftest.py), and per test when the build lacks a head_dim / dtype (``require_built`` / ``built_dtype``)."""

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import (
    assert_close_by_rule,
    attention_ref,
    attention_ref_grads,
    attention_varlen_ref,
)
from gpu_helpers import attention_inputs, bits, built_dtype, check_attention, check_attention_varlen
from gpu_helpers import cu_seqlens, poison_allocator, randn, require_built, run_attention
from test_bug_reports_gpu import DTYPE_IDS, DTYPES, GRAD_NAMES
from test_bug_reports_gpu import _leaves, _releasing_memory, _require_free_memory, _varlen_inputs, _varlen_run

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]


# ------------------------------------------------------------------------------------------------------- helpers
# (_leaves, _varlen_inputs, _varlen_run, _require_free_memory: tests/test_bug_reports_gpu.py)


def _nan_fill_(*tensors):
    with torch.no_grad():
        for t in tensors:
            t.fill_(float("nan"))


# -------------------------------------------------------------------------------------------------- CUDA graphs


# https://github.com/Dao-AILab/flash-attention/issues/165 (capture failed on a host call inside the op)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_cuda_graph_capture_and_replay(deterministic):
    """Forward and backward captured in one CUDA graph (after a warm-up on a side stream, as PyTorch's whole-network
    capture does), then replayed twice with fresh values copied into the static inputs: out, LSE, dQ, dK, dV of each
    replay by the rule (the graph's outputs are NaN-filled before each replay, so anything not rewritten shows), and
    the forward bit-identical to an eager call on the same values. GQA 4/2, causal, seqlen_q < seqlen_k."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    shape = (2, 203, 300, 4, 2, head_dim)
    opts = dict(causal=True, deterministic=deterministic)
    static = list(attention_inputs(*shape, dtype))
    leaves = [t.requires_grad_(True) for t in static[:3]]
    dout = static[3]

    def step():
        out, lse = attention(*leaves, return_lse=True, **opts)
        return out, lse, torch.autograd.grad(out, leaves, dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse, grads = step()
    for replay in range(2):
        fresh = attention_inputs(*shape, dtype)
        with torch.no_grad():
            for dst, src in zip(static, fresh):
                dst.copy_(src)
        _nan_fill_(out, lse, *grads)
        graph.replay()
        torch.cuda.synchronize()
        name = f"graph replay {replay}"
        check_attention(out.detach(), lse.detach(), tuple(g.detach() for g in grads), *fresh, name, causal=True)
        eager_out, eager_lse = attention(*fresh[:3], return_lse=True, **opts)
        assert torch.equal(bits(out), bits(eager_out)), f"{name}: out differs from the eager call"
        assert torch.equal(bits(lse), bits(eager_lse)), f"{name}: LSE differs from the eager call"
        if deterministic:  # the replayed backward is the eager one, bit for bit
            eager_leaves = [t.detach().requires_grad_(True) for t in fresh[:3]]
            eager_grads = torch.autograd.grad(attention(*eager_leaves, **opts), eager_leaves, fresh[3])
            for gname, g, e in zip(GRAD_NAMES, grads, eager_grads):
                assert torch.equal(bits(g), bits(e)), f"{name}: deterministic {gname} differs from the eager call"


# https://github.com/Dao-AILab/flash-attention/issues/1164 and https://github.com/vllm-project/flash-attention/pull/18
def test_cuda_graph_varlen_new_boundaries_on_replay():
    """vLLM's pattern: attention_varlen captured once with max_seqlen as an upper bound, then replayed with other
    sequence boundaries written into the same cu_seqlens tensors (and fresh q, k, v): the kernels must read the
    lengths from the device on each replay (FlashAttention's split kernel used the capture-time seqlen_k). The second
    set ends before the last rows of q and k: those query rows get output 0 and LSE -inf. Out and LSE by the rule."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    total_q, total_k, nheads, nheads_k = 400, 500, 4, 2
    max_q, max_k = 256, 320
    cu_q, cu_k = cu_seqlens([100, 150, 150]), cu_seqlens([120, 200, 180])
    static = [randn(total_q, nheads, head_dim, dtype=dtype), randn(total_k, nheads_k, head_dim, dtype=dtype),
              randn(total_k, nheads_k, head_dim, dtype=dtype)]
    attention_varlen(*static, cu_q, cu_k, max_q, max_k, causal=True)  # the host check of cu_seqlens, before capture

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention_varlen(*static, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = attention_varlen(*static, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True)

    for lq, lk in (([30, 256, 114], [300, 20, 180]), ([0, 200, 150], [0, 320, 100])):
        assert max(lq) <= max_q and max(lk) <= max_k and sum(lq) <= total_q and sum(lk) <= total_k
        cu_q.copy_(cu_seqlens(lq))
        cu_k.copy_(cu_seqlens(lk))
        for t in static:
            t.copy_(torch.randn_like(t))
        _nan_fill_(out, lse)
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = attention_varlen_ref(*static, cu_q, cu_k, causal=True)
        naive, naive_lse = attention_varlen_ref(*static, cu_q, cu_k, causal=True, upcast=False)
        assert_close_by_rule(out, ref, naive, f"replay {lq}/{lk} out")
        assert_close_by_rule(lse, ref_lse, naive_lse, f"replay {lq}/{lk} lse")
        tail = out[sum(lq):]
        assert torch.equal(tail, torch.zeros_like(tail)), "rows past the last sequence are not 0 after replay"


def test_cuda_graph_varlen_capture_with_unseen_cu_seqlens():
    """attention_varlen captured with cu_seqlens it has never seen (made under inference_mode, as a decoding server
    would) and whose capture-time last entry is below the rows of q and k; replays move the boundaries, the last entry
    both below and at its capture value and then up to every row. Inside a capture nothing reads cu_seqlens on the
    host (that copy would invalidate the capture), so every replay must follow the device values: out and LSE by the
    rule, rows outside the sequences 0 / -inf."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    total, nheads = 300, 2
    max_q = max_k = 200
    with torch.inference_mode():
        cu_q, cu_k = cu_seqlens([70, 130]), cu_seqlens([90, 110])  # both end at row 200 of 300
    q, k, v = (randn(total, nheads, head_dim, dtype=dtype) for _ in range(3))
    # PyTorch's recipe: warm up on a side stream first (here with other cu_seqlens tensors), then capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention_varlen(q, k, v, cu_seqlens([70, 130]), cu_seqlens([90, 110]), max_q, max_k, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True)
    for lq, lk in (([70, 130], [90, 110]), ([150, 10], [20, 180]), ([120, 180], [200, 100])):
        assert max(lq) <= max_q and max(lk) <= max_k and sum(lq) <= total and sum(lk) <= total
        with torch.inference_mode():
            cu_q.copy_(cu_seqlens(lq))
            cu_k.copy_(cu_seqlens(lk))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        _nan_fill_(out, lse)
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
        naive, naive_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=False)
        assert_close_by_rule(out, ref, naive, f"replay {lq}/{lk} out")
        assert_close_by_rule(lse, ref_lse, naive_lse, f"replay {lq}/{lk} lse")
        tail = out[sum(lq):]
        assert torch.equal(tail, torch.zeros_like(tail)), f"replay {lq}/{lk}: rows past the last sequence are not 0"


def test_cuda_graph_documents_new_ids_on_replay():
    """attention with document_ids captured after a warm-up call with the same ids tensor (which caches its document
    bounds), then replayed with other ids written into that tensor: inside a capture the bounds are computed in the
    graph from the ids, so each replay follows the ids it finds. Out and LSE by the rule."""
    head_dim = 128
    dtype = built_dtype(head_dim)

    def doc_ids(rows):
        return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]).to(
            device="cuda", dtype=torch.int32)

    q, k, v, _ = attention_inputs(2, 500, 500, 2, 2, head_dim, dtype)
    ids = doc_ids([[200, 300], [100, 400]])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention(q, k, v, causal=True, document_ids=ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = attention(q, k, v, causal=True, return_lse=True, document_ids=ids)
    for rows in ([[200, 300], [100, 400]], [[50, 150, 300], [499, 1, 0]], [[500], [250, 250]]):
        ids.copy_(doc_ids([[n for n in r if n] for r in rows]))
        _nan_fill_(out, lse)
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = attention_ref(q, k, v, causal=True, document_ids=ids)
        naive, naive_lse = attention_ref(q, k, v, causal=True, document_ids=ids, upcast=False)
        assert_close_by_rule(out, ref, naive, f"documents replay {rows} out")
        assert_close_by_rule(lse, ref_lse, naive_lse, f"documents replay {rows} lse")


# ----------------------------------------------------------------------------------- autocast and inference mode


# https://github.com/huggingface/diffusers/issues/14104 and https://github.com/Dao-AILab/flash-attention/issues/622
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_autocast(dtype):
    """Under torch.autocast: half-precision inputs run as they are (out in their dtype, forward and backward by the
    rule, also with the other half dtype as autocast's), while float32 inputs, which a kernel of this library cannot
    take, raise a TypeError naming the dtype (dense and varlen) instead of a CUDA error or a silent cast."""
    head_dim = 128
    require_built(head_dim, dtype)
    q, k, v, dout = attention_inputs(2, 203, 113, 4, 2, head_dim, dtype)
    for amp_dtype in DTYPES:
        with torch.autocast("cuda", dtype=amp_dtype):
            out, lse, grads = run_attention(q, k, v, dout, causal=True)
        assert out.dtype == dtype and lse.dtype == torch.float32
        check_attention(out, lse, grads, q, k, v, dout, f"autocast {amp_dtype}", causal=True)
    with torch.autocast("cuda", dtype=dtype):
        with pytest.raises(TypeError, match="float32"):
            attention(q.float(), k.float(), v.float(), causal=True)
        cu = cu_seqlens([203])
        with pytest.raises(TypeError, match="float32"):
            attention_varlen(q[0].float(), q[0].float(), q[0].float(), cu, cu, 203, 203)


# https://github.com/Dao-AILab/flash-attention/pull/1383 (inference-mode path broke the saved tensors)
def test_inference_mode_dense_and_varlen():
    """Inside torch.inference_mode, with inference tensors as inputs: attention and attention_varlen give the right
    out and LSE (by the rule) and no autograd graph. Inference tensors have no version counter, so a cu_seqlens
    tensor rewritten in place must be read again: the next call follows the new boundaries, and a max_seqlen below
    the new longest sequence raises. Leaves that require grad, called in inference mode, give an output without a
    graph."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    with torch.inference_mode():
        q, k, v, _ = attention_inputs(2, 257, 203, 4, 2, head_dim, dtype)
        poison_allocator(q.numel() * q.element_size(), 2 * 4 * 257 * 4)
        out, lse = attention(q, k, v, causal=True, return_lse=True)
        assert out.is_inference() and out.grad_fn is None
        ref, ref_lse = attention_ref(q, k, v, causal=True)
        naive, naive_lse = attention_ref(q, k, v, causal=True, upcast=False)
        assert_close_by_rule(out, ref, naive, "inference out")
        assert_close_by_rule(lse, ref_lse, naive_lse, "inference lse")

        qv, kv, vv, _ = _varlen_inputs([300], [300], 4, 2, head_dim, dtype)
        cu = cu_seqlens([100, 50, 150])
        for lengths in ([100, 50, 150], [20, 200, 80]):
            cu.copy_(cu_seqlens(lengths))
            out, lse = attention_varlen(qv, kv, vv, cu, cu, 200, 200, causal=True, return_lse=True)
            ref, ref_lse = attention_varlen_ref(qv, kv, vv, cu, cu, causal=True)
            naive, naive_lse = attention_varlen_ref(qv, kv, vv, cu, cu, causal=True, upcast=False)
            assert_close_by_rule(out, ref, naive, f"inference varlen {lengths} out")
            assert_close_by_rule(lse, ref_lse, naive_lse, f"inference varlen {lengths} lse")
        cu.copy_(cu_seqlens([10, 10, 280]))
        with pytest.raises(ValueError, match="holds a sequence of length 280"):
            attention_varlen(qv, kv, vv, cu, cu, 200, 200, causal=True)

    leaves = _leaves(*attention_inputs(1, 130, 130, 2, 2, head_dim, dtype)[:3])
    with torch.inference_mode():
        out = attention(*leaves, causal=True)
    assert out.grad_fn is None and not out.requires_grad
    ref, _ = attention_ref(*leaves, causal=True)
    naive, _ = attention_ref(*(t.detach() for t in leaves), causal=True, upcast=False)
    assert_close_by_rule(out, ref.detach(), naive, "inference mode on leaves out")


# ------------------------------------------------------------------------------------------- autograd machinery


# https://github.com/Dao-AILab/flash-attention/issues/699 and https://github.com/pytorch/pytorch/issues/116350
def test_create_graph_first_order_right_and_double_backward_raises():
    """A gradient penalty: torch.autograd.grad(..., create_graph=True) must still give the right dQ, dK, dV (by the
    rule), and differentiating them again must raise a RuntimeError that says double backward is not supported
    (README) rather than crash or silently drop the second-order terms."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    q, k, v, dout = attention_inputs(2, 150, 203, 4, 2, head_dim, dtype)
    leaves = _leaves(q, k, v)
    out, lse = attention(*leaves, causal=True, return_lse=True)
    grads = torch.autograd.grad(out, leaves, dout, create_graph=True)
    check_attention(out.detach(), lse.detach(), tuple(g.detach() for g in grads), q, k, v, dout, "create_graph",
                    causal=True)
    penalty = sum((g.float() ** 2).sum() for g in grads)
    with pytest.raises(RuntimeError, match="double backward"):
        penalty.backward()


# https://github.com/Dao-AILab/flash-attention/issues/341 (varlen + non-reentrant checkpointing raised)
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_activation_checkpointing(api, use_reentrant):
    """attention (GQA, causal, window, softcap) inside torch.utils.checkpoint, both implementations: the forward is
    recomputed during the backward and the gradients are those of the plain call, by the rule."""
    from torch.utils.checkpoint import checkpoint

    head_dim = 128
    dtype = built_dtype(head_dim)
    opts = dict(causal=True, window_size=(100, 0), softcap=20.0)
    if api == "dense":
        q, k, v, dout = attention_inputs(2, 203, 300, 4, 2, head_dim, dtype)

        def block(q, k, v):
            return attention(q, k, v, return_lse=True, **opts)
    else:
        lq, lk = [203, 0, 77], [300, 40, 77]
        q, k, v, dout = _varlen_inputs(lq, lk, 4, 2, head_dim, dtype)
        cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)

        def block(q, k, v):
            return attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), return_lse=True, **opts)

    leaves = _leaves(q, k, v)
    out, lse = checkpoint(block, *leaves, use_reentrant=use_reentrant)
    poison_allocator(q.numel() * q.element_size(), k.numel() * k.element_size())
    (out.float() * dout.float()).sum().backward()
    grads = tuple(t.grad for t in leaves)
    name = f"checkpoint {api} reentrant={use_reentrant}"
    if api == "dense":
        check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, name, **opts)
    else:
        check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, dout, cu_q, cu_k, name, **opts)


# https://github.com/pytorch/pytorch/issues/193671 (saved-tensor hooks materialising at pack time: wrong gradients)
@pytest.mark.parametrize("hooks", ["save_on_cpu", "clone"])
def test_saved_tensor_hooks(hooks):
    """Activation offloading (torch.autograd.graph.save_on_cpu) or a pack hook that clones: the tensors the op saves
    (q, k, v, out, LSE) go through the hooks and come back for the backward, with NaN written over freed GPU memory
    in between; the gradients (through out and LSE) are right by the rule."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    q, k, v, dout = attention_inputs(2, 203, 300, 4, 2, head_dim, dtype)
    dlse = torch.randn(2, 4, 203, device="cuda")
    leaves = _leaves(q, k, v)
    packed = []  # the tensors the pack hook saw

    def pack(t):
        packed.append(t.shape)
        return t.clone()

    if hooks == "save_on_cpu":
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
    else:
        ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with ctx:
        out, lse = attention(*leaves, causal=True, return_lse=True)
    if hooks == "clone":  # q, k, v, out and LSE went through the hook
        assert len(packed) >= 5, f"the pack hook saw {len(packed)} tensors: {packed}"
    poison_allocator(q.numel() * q.element_size(), k.numel() * k.element_size(), 2 * 4 * 203 * 4)
    grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
    check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, f"hooks {hooks}", dlse=dlse, causal=True)


# https://github.com/fla-org/flash-linear-attention/issues/73 (a saved tensor changed in place before the backward)
@pytest.mark.parametrize("what", ["out", "q"])
def test_inplace_change_of_a_saved_tensor(what):
    """out (scaled in place by 2 before the loss) or q (changed under no_grad after the forward) is modified between
    the forward and the backward. The backward recomputes P from the saved q, k, LSE and takes D = rowsum(dO ∘ O)
    from the saved out, so it must either refuse (autograd's "modified by an inplace operation" RuntimeError) or use
    the values of the forward; silently mixing old and new values gives wrong gradients."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    q, k, v, dout = attention_inputs(2, 150, 203, 4, 2, head_dim, dtype)
    leaves = _leaves(q.clone(), k, v)
    out = attention(*leaves, causal=True)
    dout_eff = dout
    if what == "out":
        out.mul_(2)  # loss = <2 out, dout>: the attention backward sees 2 * dout
        dout_eff = dout * 2
    else:
        with torch.no_grad():
            leaves[0].add_(1.0)
    try:
        grads = torch.autograd.grad(out, leaves, dout)
    except RuntimeError as e:
        assert "inplace operation" in str(e), f"unexpected RuntimeError: {e}"
        return
    ref = attention_ref_grads(q, k, v, dout_eff, causal=True)
    naive = attention_ref_grads(q, k, v, dout_eff, causal=True, upcast=False)
    for gname, g, r, n in zip(GRAD_NAMES, grads, ref, naive):
        assert_close_by_rule(g, r, n, f"{what} changed in place: {gname}")


NODE_OPTIONS = [dict(causal=True), dict(window_size=(32, 32)), dict(softcap=10.0)]


# https://github.com/Dao-AILab/flash-attention/issues/681 (one backward through several forward calls)
def test_several_calls_in_one_graph():
    """Three attention calls with different options on disjoint head ranges of the same q, k, v tensors (views of
    one base each), one loss, one backward: each head range of the bases' gradients is that call's dQ, dK, dV, by the
    rule."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    per, per_k = 2, 1
    n = len(NODE_OPTIONS)
    q, k, v, dout = attention_inputs(2, 257, 190, per * n, per_k * n, head_dim, dtype)
    bases = _leaves(q, k, v)
    loss = 0
    for i, opts in enumerate(NODE_OPTIONS):
        parts = [t[:, :, i * h:(i + 1) * h] for t, h in zip(bases, (per, per_k, per_k))]
        out = attention(*parts, **opts)
        loss = loss + (out.float() * dout[:, :, i * per:(i + 1) * per].float()).sum()
    poison_allocator(q.numel() * q.element_size(), k.numel() * k.element_size())
    loss.backward()
    for i, opts in enumerate(NODE_OPTIONS):
        sl = [slice(i * h, (i + 1) * h) for h in (per, per_k, per_k)]
        args = [t[:, :, s] for t, s in zip((q, k, v), sl)]
        d = dout[:, :, sl[0]]
        ref = attention_ref_grads(*args, d, **opts)
        naive = attention_ref_grads(*args, d, upcast=False, **opts)
        for gname, base, s, r, nv in zip(GRAD_NAMES, bases, sl, ref, naive):
            assert_close_by_rule(base.grad[:, :, s], r, nv, f"call {i} {opts} {gname}")


# ----------------------------------------------------------------------------------------------- zero sizes


# https://github.com/Dao-AILab/flash-attention/issues/1159 and https://github.com/pytorch/pytorch/pull/166318
@pytest.mark.parametrize("which", ["batch0", "heads0"])
def test_zero_batch_or_zero_heads(which):
    """batch 0 (a zero-batch step of a static graph, the report) or zero heads: forward and backward return tensors
    of the right shapes and dtypes without an error (docs/conventions.md: empty problems return zeros / -inf without
    a launch)."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    batch, nheads, nheads_k = (0, 4, 2) if which == "batch0" else (2, 0, 0)
    q, k, v, dout = attention_inputs(batch, 77, 100, nheads, nheads_k, head_dim, dtype)
    leaves = _leaves(q, k, v)
    out, lse = attention(*leaves, causal=True, return_lse=True)
    assert out.shape == (batch, 77, nheads, head_dim) and out.dtype == dtype
    assert lse.shape == (batch, nheads, 77) and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, leaves, dout)
    for gname, g, t in zip(GRAD_NAMES, grads, (q, k, v)):
        assert g.shape == t.shape and g.dtype == dtype, gname
    torch.cuda.synchronize()


# https://github.com/Dao-AILab/flash-attention/issues/1614 ("batch size must be positive" from the varlen path)
def test_varlen_zero_sequences():
    """attention_varlen with no sequences (cu_seqlens [0]): with no tokens at all, and with token rows that no
    sequence covers (a padded buffer): out 0, LSE -inf, zero gradients, the right shapes, no error."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    cu = torch.zeros(1, dtype=torch.int32, device="cuda")
    for rows in (0, 5):
        q, k, v, dout = _varlen_inputs([rows], [rows + 3], 4, 2, head_dim, dtype)
        leaves = _leaves(q, k, v)
        out, lse = attention_varlen(*leaves, cu, cu, 0, 0, causal=True, return_lse=True)
        assert out.shape == (rows, 4, head_dim) and lse.shape == (4, rows)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
        grads = torch.autograd.grad(out, leaves, dout)
        for gname, g, t in zip(GRAD_NAMES, grads, (q, k, v)):
            assert g.shape == t.shape and torch.equal(g, torch.zeros_like(g)), f"{rows} rows: {gname}"


# ----------------------------------------------------------------------------------------------- long sequences


DECODE_CASES = [
    (1, {}),
    (1, dict(causal=True)),
    (4, dict(causal=True)),  # a few draft tokens (speculative decoding): bottom-right causal
    (1, dict(window_size=(4095, 0))),  # Mistral-style sliding-window decoding: the last 4096 keys
    (3, dict(causal=True, window_size=(4095, 0))),
]


# https://github.com/karpathy/nanochat/pull/456 (decode ignoring the sliding window) and
# https://github.com/tile-ai/tilelang/issues/330 (attention failing past 65k keys)
@pytest.mark.parametrize("seqlen_q,opts", DECODE_CASES, ids=["full", "causal", "causal-4", "window", "window-3"])
def test_decode_against_a_long_kv_sequence(seqlen_q, opts):
    """One to four queries against 2^18 + 1 keys, 4 query heads on 1 KV head (MQA, as a decoding step with a long KV
    cache), forward and backward by the rule on every element; with a window only the last 4096 keys count."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    q, k, v, dout = attention_inputs(1, seqlen_q, 2**18 + 1, 4, 1, head_dim, dtype)
    out, lse, grads = run_attention(q, k, v, dout, **opts)
    check_attention(out, lse, grads, q, k, v, dout, f"decode {seqlen_q} {opts}", **opts)
    if "window_size" in opts:
        for gname, g in (("dk", grads[1]), ("dv", grads[2])):
            early = g[:, : 2**18 + 1 - 4096 - seqlen_q]
            assert torch.equal(early, torch.zeros_like(early)), f"{gname}: keys outside the window are not 0"


def _long_causal():
    head_dim = 64
    dtype = built_dtype(head_dim)
    seqlen_q, seqlen_k = 69_999, 70_123  # past 2^16 on both sides, off the tile grid, seqlen_q < seqlen_k
    q, k, v, dout = attention_inputs(1, seqlen_q, seqlen_k, 2, 1, head_dim, dtype)
    out, lse, grads = run_attention(q, k, v, dout, causal=True)
    for name, t in zip(("out",) + GRAD_NAMES, (out,) + tuple(grads)):
        assert torch.isfinite(t).all(), f"{name}: not finite (unwritten or wrongly addressed)"
    assert torch.isfinite(lse).all(), "every row sees keys (seqlen_q < seqlen_k)"
    shift = seqlen_k - seqlen_q
    m = 192
    for a in (0, 40_000, seqlen_q - m):
        b = a + m
        # rows a..b see keys 0..b-1+shift; the slice keeps the bottom-right alignment (row i sees j <= i + a + shift)
        args = (q[:, a:b], k[:, : b + shift], v[:, : b + shift])
        ref, ref_lse = attention_ref(*args, causal=True)
        naive, naive_lse = attention_ref(*args, causal=True, upcast=False)
        assert_close_by_rule(out[:, a:b], ref, naive, f"rows {a}:{b} out")
        assert_close_by_rule(lse[:, :, a:b], ref_lse, naive_lse, f"rows {a}:{b} lse")
        ref_g = attention_ref_grads(*args, dout[:, a:b], causal=True)
        naive_g = attention_ref_grads(*args, dout[:, a:b], causal=True, upcast=False)
        assert_close_by_rule(grads[0][:, a:b], ref_g[0], naive_g[0], f"rows {a}:{b} dq")
        if b == seqlen_q:  # the last m keys are seen by the last m rows only: their dK, dV are complete here
            for i in (1, 2):
                assert_close_by_rule(grads[i][:, -m:], ref_g[i][:, -m:], naive_g[i][:, -m:],
                                     f"last {m} keys {GRAD_NAMES[i]}")


# https://github.com/tile-ai/tilelang/issues/330 and https://github.com/Dao-AILab/flash-attention/issues/47
def test_long_causal_self_attention():
    """A 70k-token causal attention (69,999 queries x 70,123 keys, GQA 2/1): forward and backward from NaN-poisoned
    memory, every element finite; out, LSE and dQ by the rule on row slices at the start, the middle and the end
    (each slice against exactly the keys it sees), dK and dV on the last keys (seen only by the last rows)."""
    _releasing_memory(_long_causal)


def _key_rows_beyond_int32():
    head_dim = 128
    dtype = built_dtype(head_dim)
    nheads = 8
    seqlen_q, seqlen_k = 64, 2**21 + 1000  # k, v: 2^31 + 1,024,000 elements each, one sequence
    _require_free_memory(32 * 2**30)
    q = randn(1, seqlen_q, nheads, head_dim, dtype=dtype)
    k = randn(1, seqlen_k, nheads, head_dim, dtype=dtype)
    v = randn(1, seqlen_k, nheads, head_dim, dtype=dtype)
    dout = randn(1, seqlen_q, nheads, head_dim, dtype=dtype)
    assert k.numel() > 2**31

    # every key: the rows past 2^31 elements are read; checked head by head (the reference repeats nothing)
    poison_allocator(q.numel() * q.element_size(), nheads * seqlen_q * 4)
    out, lse = attention(q, k, v, return_lse=True)
    for h in range(nheads):
        args = (q[:, :, h:h + 1], k[:, :, h:h + 1], v[:, :, h:h + 1])
        ref, ref_lse = attention_ref(*args)
        naive, naive_lse = attention_ref(*args, upcast=False)
        assert_close_by_rule(out[:, :, h:h + 1], ref, naive, f"all keys head {h} out")
        assert_close_by_rule(lse[:, h:h + 1], ref_lse, naive_lse, f"all keys head {h} lse")
        del ref, naive
    del out, lse

    # a window at the end: only keys past 2^31 elements are seen; dK, dV written there, zeros everywhere else
    left = 300
    tail = seqlen_q + left  # the keys any query sees under the bottom-right window (left, 0)
    opts = dict(causal=True, window_size=(left, 0))
    leaves = _leaves(q, k, v)
    out, lse = attention(*leaves, return_lse=True, **opts)
    poison_allocator(k.numel() * k.element_size(), v.numel() * v.element_size())
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    args = (q, k[:, -tail:], v[:, -tail:])
    check_attention(out.detach(), lse.detach(), (dq, dk[:, -tail:], dv[:, -tail:]), *args, dout, "tail window", **opts)
    for name, g in (("dk", dk), ("dv", dv)):
        assert torch.count_nonzero(g[:, :-tail]).item() == 0, f"{name}: keys outside the window are not exactly 0"


# https://github.com/Dao-AILab/flash-attention/pull/1841 (int32 sizes at seqlen >= 4M) and
# https://github.com/Knowledgator/FlashDeBERTa/pull/11 (int32 row offsets within long packed sequences)
def test_key_rows_beyond_int32_in_one_sequence():
    """One sequence of 2^21 + 1000 keys x 8 heads x 128: key rows past 2^21 start beyond 2^31 elements of k and v
    (4 GiB each), within one batch element (tests/test_bug_reports_gpu.py crosses 2^31 only between batch elements).
    64 queries over all keys, forward by the rule head by head; then a bottom-right window of 300 so that only keys
    past 2^31 elements are seen, forward and backward: out, LSE, dQ and the window's dK, dV by the rule, every other
    dK, dV row exactly 0 (from NaN-poisoned memory). About 20 GiB."""
    _releasing_memory(_key_rows_beyond_int32)


# ---------------------------------------------------------------------------------------------- variable length


# https://github.com/Dao-AILab/flash-attention/issues/1664 (max_seqlen as an upper bound must not change the output)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_max_seqlen_above_the_longest(causal):
    """max_seqlen_q / max_seqlen_k far above the longest sequence (and above the total token counts), as callers
    pass an upper bound to avoid a host sync: forward and backward by the rule at two loose bounds, including an empty
    query sequence and one without keys."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    lq, lk = [300, 0, 129, 77, 5], [257, 33, 129, 500, 0]
    q, k, v, dout = _varlen_inputs(lq, lk, 4, 2, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    for max_q, max_k in ((4096, 8192), (sum(lq) + 1, max(lk))):
        out, lse, grads = _varlen_run(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal=causal)
        check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, f"max_seqlen {max_q}/{max_k}",
                               causal=causal)


# https://github.com/Dao-AILab/flash-attention/pull/2777 and https://github.com/Dao-AILab/flash-attention/issues/2541
@pytest.mark.parametrize("head_dim", [64, 256])
def test_varlen_qkv_split_from_one_projection(head_dim):
    """attention_varlen on q, k, v split along the heads from one packed (total, 8 + 2 + 2, head_dim) projection
    output (strided views: FlashAttention's varlen backward failed on non-contiguous inputs, FA4's dV was wrong at
    head_dim 256), with dO a transposed view: the packed tensor's gradient holds dQ, dK, dV by the rule; the packed
    input unchanged."""
    dtype = built_dtype(head_dim)
    lengths = [300, 1, 0, 513, 77]
    total, nheads, nheads_k = sum(lengths), 8, 2
    packed = randn(total, nheads + 2 * nheads_k, head_dim, dtype=dtype)
    before = packed.clone()
    packed.requires_grad_(True)
    q, k, v = packed.split([nheads, nheads_k, nheads_k], dim=1)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    dout = randn(nheads, total, head_dim, dtype=dtype).transpose(0, 1)
    assert not dout.is_contiguous()
    cu = cu_seqlens(lengths)
    poison_allocator(total * nheads * head_dim * packed.element_size(), total * nheads * 4)
    out, lse = attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, return_lse=True)
    poison_allocator(packed.numel() * packed.element_size())
    (dpacked,) = torch.autograd.grad(out, packed, dout)
    assert torch.equal(packed.detach(), before), "the packed input was modified"
    grads = dpacked.split([nheads, nheads_k, nheads_k], dim=1)
    check_attention_varlen(out.detach(), lse.detach(), grads, *(t.detach() for t in (q, k, v)), dout, cu, cu,
                           f"split qkv {head_dim}", causal=True)


# ------------------------------------------------------------------------------------------------ torch.compile


# https://github.com/pytorch/pytorch/issues/110322 (flash attention specialised seqlen under dynamic shapes)
def test_compile_dynamic_seqlens_one_graph():
    """torch.compile(dynamic=True, fullgraph=True) of a function calling attention (its checks once took math.isfinite
    of a symbolic float and broke the graph), run at three (seqlen_q, seqlen_k) pairs: after the first call compiles,
    the others run without recompiling (the sequence lengths are not specialised by the op's checks or fake kernels),
    forward and backward by the rule at each. No length equals another size, so duck sizing adds no guard."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import guard_failures

    head_dim = 128
    dtype = built_dtype(head_dim)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def f(q, k, v):
        return attention(q, k, v, causal=True, return_lse=True)

    compiled = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    frames = None
    for seqlen_q, seqlen_k in ((100, 203), (203, 300), (517, 129)):
        q, k, v, dout = attention_inputs(2, seqlen_q, seqlen_k, 4, 2, head_dim, dtype)
        leaves = _leaves(q, k, v)
        out, lse = compiled(*leaves)
        grads = torch.autograd.grad(out, leaves, dout)
        check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, f"dynamic {seqlen_q}x{seqlen_k}",
                        causal=True)
        if frames is None:
            frames = counter.frame_count
    assert counter.frame_count == frames, (
        f"recompiled for new sequence lengths ({frames} -> {counter.frame_count} frames): {dict(guard_failures)}"
    )
    torch._dynamo.reset()
