"""Twenty-fourth round of the bug hunt (tests/bug_report_sources.md, "Twenty-fourth round"), GPU part.

FC: q, k, v as self-overlapping views: Longformer-style chunks of one sequence made with ``unfold`` / ``as_strided``
(huggingface/transformers#5219's ``_chunk``: chunks of 2w rows every w rows, so neighbouring batch elements share w
rows and the batch stride is below seqlen x row stride), and heads that overlap within a row (head stride half the
head_dim). The kernels only read them; their gradients come back per view and autograd's ``unfold`` / ``as_strided``
backward must SUM the overlapping contributions into the base (PaddlePaddle/Paddle#79718: the backward of overlapping
views wrote instead of adding and kept one contribution per element; pytorch/pytorch#183996: inductor's decomposition
of unfold_backward was wrong for overlapping windows). A kernel or launcher that wrote a gradient through the input's
own strides, or took a batch offset from seqlen x row stride, fails here.
FD: zero (and one) rows reaching the ops from a compiled graph whose sizes have no value at trace time (rows or batch
elements picked by a boolean mask, capture_dynamic_output_shape_ops): the op itself gets the empty tensors, where a
library's eager guard in a composite would be traced away (pytorch/pytorch#195812: CK flash attention aborted with
"batch size must be positive" on the empty batch a compiled graph handed it when no request was routed to a branch;
FlashAttention #1159).
The thirteenth round (class DE) compiled such graphs but ran them on 201 and 90 rows only.
FE: absorbed-MLA layout, one latent buffer read as K (head_dim 192) and as V (its first 128 columns): v's row stride is
k's width, not head_dim_v, and v overlaps k in memory (ikawrakow/ik_llama.cpp#2031: the flash-attention vec kernel
stepped V by Dv rows while K stepped Dk, so V drifted off K's rows after the first key block: garbage once the context
passed one block; deepseek-ai/FlashMLA#46: vcache = kcache). dK and dV both flow into the one buffer.

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py: "no CUDA GPU: GPU tests need an sm90
GPU (H100/H200)"), and per test when the build lacks the head_dim / dtype."""

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref
from gpu_helpers import (DTYPES, built_dtype, check_attention, check_attention_varlen, cu_seqlens, poison_allocator,
                         randn, require_built)

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DTYPE_IDS = ["fp16", "bf16"]


def assert_fold(base_grad, parts, name):
    """A check of PyTorch's view backward (unfold / as_strided / slice), not of this library, whose gradients are
    checked per view by the rule: base_grad is the sum, element by element, of the view gradients folded back onto the
    base, as autograd must form it for the views to be usable as these inputs at all. parts is a list of
    (view_grad, index) where base[index] is the view's memory; the sum is formed in float64 and one rounding to the
    base's dtype is allowed (autograd adds at most two contributions per element here). A contribution dropped or
    written over (Paddle #79718) is off by a whole gradient."""
    acc = torch.zeros(base_grad.shape, dtype=torch.float64, device=base_grad.device)
    for g, index in parts:
        acc[index] += g.double()
    eps = torch.finfo(base_grad.dtype).eps
    tiny = torch.finfo(base_grad.dtype).smallest_normal
    err = (base_grad.double() - acc).abs()
    bound = eps * acc.abs() + tiny
    if not torch.isfinite(base_grad).all():
        raise AssertionError(f"{name}: the base gradient is not finite")
    if not (err <= bound).all():
        raise AssertionError(f"{name}: the base gradient is not the sum of the views' gradients (max error "
                             f"{err.max().item():.3e}, {int((err > bound).sum())} elements off)")


# ------------------------------------------------------------------------------- FC: self-overlapping input views


def _chunked(base, w):
    """(C, 2w, heads, d) chunks of base (1, (C + 1) w, heads, d), one every w rows (Tensor.unfold, as Longformer's
    sliding chunks): chunk c is base rows [c w, c w + 2 w), so chunk c + 1 starts inside chunk c."""
    return base.unfold(1, 2 * w, w)[0].permute(0, 3, 1, 2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_overlapping_chunks_as_batch_elements(dtype, causal):
    """FC (transformers #5219's chunks, Paddle #79718, PyTorch #183996): q, k, v are 9 chunks of 2 x 96 rows taken
    every 96 rows of one 960-row sequence (GQA 4/2, head_dim 64): batch element c + 1 starts 96 rows into element c,
    batch stride 96 rows, below seqlen x row stride. Forward on NaN-poisoned memory; out, LSE and the per-chunk dQ, dK,
    dV by the rule; the gradients of the three bases equal the sums of the overlapping chunks' gradients."""
    head_dim, w, chunks, nheads, nheads_k = 64, 96, 9, 4, 2
    require_built(head_dim, dtype)
    rows = (chunks + 1) * w
    bases = [randn(1, rows, h, head_dim, dtype=dtype).requires_grad_(True) for h in (nheads, nheads_k, nheads_k)]
    views = [_chunked(b, w) for b in bases]
    q, k, v = views
    if not (q.shape == (chunks, 2 * w, nheads, head_dim) and q.stride(0) < q.shape[1] * q.stride(1)
            and q.stride(-1) == 1):
        raise AssertionError(f"construction: chunks {q.shape} with strides {q.stride()} must overlap")
    dout = randn(chunks, 2 * w, nheads, head_dim, dtype=dtype)
    e = q.element_size()
    poison_allocator(q.numel() * e, chunks * nheads * 2 * w * 4)
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    poison_allocator(q.numel() * e, k.numel() * e, v.numel() * e)
    grads = torch.autograd.grad(out, [*views, *bases], dout)
    name = f"overlapping chunks {dtype} causal={causal}"
    check_attention(out.detach(), lse.detach(), grads[:3], *(t.detach() for t in views), dout, name, causal=causal)
    for base_grad, view_grad, what in zip(grads[3:], grads[:3], "qkv"):
        parts = [(view_grad[c], (0, slice(c * w, c * w + 2 * w))) for c in range(chunks)]
        assert_fold(base_grad, parts, f"{name} d{what} of the base")


def _overlapping_heads(base, nheads, head_dim):
    """(batch, seqlen, nheads, head_dim) view of base (batch, seqlen, (nheads + 1) head_dim / 2) whose head h starts at
    column h head_dim / 2: neighbouring heads share half their columns (an unfold over the features)."""
    b, s, width = base.shape
    return base.as_strided((b, s, nheads, head_dim), (s * width, width, head_dim // 2, 1), base.storage_offset())


def test_overlapping_heads_within_a_row():
    """FC: q (2, 203, 4, 128) and k, v (2, 141, 2, 128) whose heads overlap by half their columns (head stride 64
    elements, 128 bytes: TMA reads the view in place), causal, GQA 4/2; forward and backward by the rule per view, and
    each base's gradient the sum of its overlapping heads' gradients."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    half = head_dim // 2
    bases = [randn(2, s, (h + 1) * half, dtype=dtype).requires_grad_(True) for s, h in ((203, 4), (141, 2), (141, 2))]
    views = [_overlapping_heads(b, h, head_dim) for b, h in zip(bases, (4, 2, 2))]
    dout = randn(2, 203, 4, head_dim, dtype=dtype)
    out, lse = attention(*views, causal=True, return_lse=True)
    grads = torch.autograd.grad(out, [*views, *bases], dout)
    check_attention(out.detach(), lse.detach(), grads[:3], *(t.detach() for t in views), dout, "overlapping heads",
                    causal=True)
    for base_grad, view_grad, what in zip(grads[3:], grads[:3], "qkv"):
        parts = [(view_grad[:, :, h], (slice(None), slice(None), slice(h * half, h * half + head_dim)))
                 for h in range(view_grad.shape[2])]
        assert_fold(base_grad, parts, f"overlapping heads d{what} of the base")


# ----------------------------------------------------------------------- FD: zero / one rows from a compiled graph


# deterministic=True: the default backward's dQ (and GQA dK / dV) sums are atomic, in no fixed order, so two runs may
# differ in the last bits; the bitwise comparison with eager needs the fixed order (as class DE's).
def _picked_rows(q, k, v, keep):
    return attention(q[:, keep], k[:, keep], v[:, keep], causal=True, return_lse=True, deterministic=True)


def _picked_batch(q, k, v, keep):
    return attention(q[keep], k[keep], v[keep], return_lse=True, deterministic=True)


def _run(fn, q, k, v, dout, keep):
    """(out, lse, dq, dk, dv) of fn on leaves; the loss reads out and lse, so both gradients reach the op."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, lse = fn(*leaves, keep)
    grads = torch.autograd.grad((out.float() * dout).sum() + lse.sum(), leaves, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
    return (out.detach(), lse.detach(), *grads)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("what", ["rows", "batch"])
def test_compiled_graph_handed_zero_or_one_rows(what, backend):
    """FD (PyTorch #195812, FlashAttention #1159): torch.compile(fullgraph=True) of attention over the rows (causal,
    GQA 4/2) or the batch elements picked by a boolean mask (an unbacked size), run with 77 / 3 picked, then none, then
    one, then 150 / 5 again: one graph, bit for bit the eager call (deterministic=True), right by the rule; with none
    picked the op gets empty tensors and returns empty out and LSE, and q, k, v get gradients of exactly 0."""
    from torch._dynamo.testing import CompileCounterWithBackend

    head_dim = 64
    dtype = built_dtype(head_dim)
    batch, seqlen, counts = (2, 333, (77, 0, 1, 150)) if what == "rows" else (7, 129, (3, 0, 1, 5))
    q = randn(batch, seqlen, 4, head_dim, dtype=dtype)
    k = randn(batch, seqlen, 2, head_dim, dtype=dtype)
    v = randn(batch, seqlen, 2, head_dim, dtype=dtype)
    fn = _picked_rows if what == "rows" else _picked_batch
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    torch.manual_seed(24)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            for kept in counts:
                n = batch if what == "batch" else seqlen
                keep = torch.zeros(n, dtype=torch.bool, device="cuda")
                keep[torch.randperm(n, device="cuda")[:kept]] = True
                out_shape = (batch, kept, 4, head_dim) if what == "rows" else (kept, seqlen, 4, head_dim)
                dout = randn(*out_shape, dtype=torch.float32)
                comp = _run(compiled, q, k, v, dout, keep)  # first: a fault must show in the compiled graph
                eager = _run(fn, q, k, v, dout, keep)
                name = f"{what} {backend} {kept} picked"
                for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), eager, comp):
                    if not (a.shape == b.shape and torch.equal(a, b)):
                        raise AssertionError(f"{name}: compiled {label} differs from eager")
                out, lse, dq, dk, dv = comp
                lse_shape = (out_shape[0], 4, out_shape[1])
                if not (out.shape == out_shape and lse.shape == lse_shape and out.dtype == dtype):
                    raise AssertionError(f"{name}: out {tuple(out.shape)} / lse {tuple(lse.shape)}")
                if kept == 0:
                    for label, g in (("dq", dq), ("dk", dk), ("dv", dv)):
                        if torch.count_nonzero(g).item() != 0:
                            raise AssertionError(f"{name}: {label} is not exactly 0")
                    continue
                picked = [t[:, keep] if what == "rows" else t[keep] for t in (q, k, v)]
                opts = dict(causal=True) if what == "rows" else {}
                ref, ref_lse = attention_ref(*picked, upcast=True, **opts)
                naive, naive_lse = attention_ref(*picked, upcast=False, **opts)
                assert_close_by_rule(out, ref, naive, f"{name}: out")
                assert_close_by_rule(lse, ref_lse, naive_lse, f"{name}: lse")
        if counter.frame_count != 1:
            raise AssertionError(f"{what} {backend}: {counter.frame_count} graphs for one function (a recompile per "
                                 "row count: the sizes were specialised)")
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------ FE: absorbed-MLA buffer read as K and as V


def _mla_inputs(dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, d_qk=192, d_v=128):
    """q (batch, seqlen_q, nheads, d_qk) and one latent buffer (batch, seqlen_k, nheads_k, d_qk) that requires grad; k
    is the whole buffer (a view) and v its first d_v columns (row stride d_qk x nheads_k, not d_v x nheads_k)."""
    q = randn(batch, seqlen_q, nheads, d_qk, dtype=dtype).requires_grad_(True)
    buf = randn(batch, seqlen_k, nheads_k, d_qk, dtype=dtype).requires_grad_(True)
    k, v = buf[..., :], buf[..., :d_v]
    if not (v.data_ptr() == k.data_ptr() and v.stride(1) == nheads_k * d_qk and not v.is_contiguous()):
        raise AssertionError("construction: v must be a column prefix of k's memory")
    return q, buf, k, v


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal", [(1, 4099, False), (203, 541, True), (541, 203, True)],
                         ids=["decode-4099", "prefill-203x541", "prefill-541x203"])
def test_mla_buffer_read_as_k_and_v(seqlen_q, seqlen_k, causal):
    """FE (ik_llama.cpp #2031, FlashMLA #46): absorbed MLA's single latent buffer as K (head_dim 192) and V (its first
    128 columns), MQA (16 query heads on one K/V head, as absorbed MLA runs) and batch 2: a decode row against 4099 keys
    (many key blocks: a V pointer stepped by head_dim_v drifts after the first), and causal prefill both ways. Out, LSE,
    dQ and the per-role dK, dV by the rule; the buffer's gradient is dK plus dV on its first 128 columns."""
    dtype = built_dtype(192)
    q, buf, k, v = _mla_inputs(dtype, 2, seqlen_q, seqlen_k, 16, 1)
    dout = randn(2, seqlen_q, 16, 128, dtype=dtype)
    e = q.element_size()
    poison_allocator(2 * seqlen_q * 16 * 128 * e, 2 * 16 * seqlen_q * 4)
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    poison_allocator(q.numel() * e, buf.numel() * e)
    dq, dk, dv, dbuf = torch.autograd.grad(out, [q, k, v, buf], dout)
    name = f"mla {seqlen_q}x{seqlen_k}"
    check_attention(out.detach(), lse.detach(), (dq, dk, dv), q.detach(), k.detach(), v.detach(), dout, name,
                    causal=causal)
    assert_fold(dbuf, [(dk, (Ellipsis, slice(None))), (dv, (Ellipsis, slice(0, 128)))], f"{name} buffer gradient")


def test_mla_buffer_read_as_k_and_v_varlen():
    """FE through attention_varlen: packed latent buffer (total_k, 1, 192) read as K and (its first 128 columns) as V,
    16 query heads, causal, sequences of (1, 300, 0, 77) queries against (1030, 257, 40, 77) keys; out, LSE, dQ, dK,
    dV by the rule (rows that see no key: 0) and the buffer's gradient dK + dV."""
    dtype = built_dtype(192)
    lq, lk = [1, 300, 0, 77], [1030, 257, 40, 77]
    q = randn(sum(lq), 16, 192, dtype=dtype).requires_grad_(True)
    buf = randn(sum(lk), 1, 192, dtype=dtype).requires_grad_(True)
    k, v = buf[..., :], buf[..., :128]
    dout = randn(sum(lq), 16, 128, dtype=dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)
    dq, dk, dv, dbuf = torch.autograd.grad(out, [q, k, v, buf], dout)
    check_attention_varlen(out.detach(), lse.detach(), (dq, dk, dv), q.detach(), k.detach(), v.detach(), dout, cu_q,
                           cu_k, "mla varlen", causal=True)
    assert_fold(dbuf, [(dk, (Ellipsis, slice(None))), (dv, (Ellipsis, slice(0, 128)))], "mla varlen buffer gradient")
