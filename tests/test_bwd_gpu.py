"""Backward pass on an sm90 GPU: dQ, dK, dV against torch autograd of the float32 reference, by the rule of
DESIGN.md §3: max|grad - ref| <= 2 * max|naive - ref| + floor, where ``naive`` is autograd of the same reference run
in the input dtype (``flash_attn_hopper.testing.attention_ref_grads``).

Every backward goes through ``_backward`` (or poisons by hand), which first leaves NaN-filled blocks of the sizes of
dQ, dK, dV, the fp32 dQ accumulator and the per-row vectors in the CUDA caching allocator (``_poison_allocator``), so
an element the kernels never write shows up as NaN. dO is always random (never zeros or ones, except where a case
says so). The atomics that add into the dQ accumulator make dQ non-deterministic in its last bits, so repeated runs
are compared by the rule, not bit for bit. Skipped, with the reason, without an sm90 GPU and the built extension
(see conftest.py)."""

import pytest
import torch

from flash_attn_hopper import attention
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_ref_grads, causal_mask
from gpu_helpers import built_dtype as _built_dtype
from gpu_helpers import poison_allocator as _poison_allocator
from gpu_helpers import randn as _randn
from gpu_helpers import require_built as _require_built
from gpu_helpers import check_grads_where_required

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
HEAD_DIMS = [64, 128, 256]
SEQLENS = [(1, 1), (1, 239), (239, 1), (113, 203), (203, 113), (128, 128), (1023, 1024)]
# The dQ accumulator and the per-row vectors (LSE in log2, D) have seqlen_q rounded up to a multiple of this
# (csrc/flash/config.hpp, kBwdSeqlenQRounding).
BWD_SEQLEN_Q_ROUNDING = 128
GRAD_NAMES = ("dq", "dk", "dv")


def _bwd_nbytes(q, k, v):
    """Sizes of what the backward allocates: dQ, dK, dV, the fp32 dQ accumulator, LSE (log2) and dPsum."""
    batch, seqlen_q, nheads, head_dim = q.shape
    rows = batch * nheads * (-(-seqlen_q // BWD_SEQLEN_Q_ROUNDING) * BWD_SEQLEN_Q_ROUNDING)
    esize = q.element_size()
    return q.numel() * esize, k.numel() * esize, v.numel() * esize, rows * head_dim * 4, rows * 4, rows * 4


def _poison_bwd(q, k, v):
    _poison_allocator(*_bwd_nbytes(q, k, v))


def _qkv(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype, scale=None):
    """Random q, k, v (standard normal, times scale if given)."""
    q, k, v = (
        _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype),
        _randn(batch, seqlen_k, nheads, head_dim, dtype=dtype),
        _randn(batch, seqlen_k, nheads, head_dim, dtype=dtype),
    )
    if scale is not None:
        q, k, v = q * scale, k * scale, v * scale
    return q, k, v


def _backward(q, k, v, dout, **kwargs):
    """out = attention(q, k, v, **kwargs) on leaves that require grad, then (out, (dq, dk, dv)) by
    torch.autograd.grad, with the backward's memory poisoned with NaN beforehand. q, k, v are not modified."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = attention(*leaves, **kwargs)
    assert out.requires_grad and out.grad_fn is not None
    _poison_bwd(q, k, v)
    grads = torch.autograd.grad(out, leaves, dout)
    return out, grads


def _empty_rows(seqlen_q, seqlen_k, causal):
    """Boolean (seqlen_q,): query rows that see no key."""
    if not causal:
        return torch.zeros(seqlen_q, dtype=torch.bool, device="cuda")
    return ~causal_mask(seqlen_q, seqlen_k, device="cuda").any(dim=1)


def _check_grads(grads, q, k, v, dout, causal=False, softmax_scale=None, name=""):
    """Shapes/dtypes, then dQ, dK, dV by the rule against float32 autograd; dQ rows that see no key exactly 0.
    Returns the float32 reference gradients."""
    for gname, g, t in zip(GRAD_NAMES, grads, (q, k, v)):
        assert g.shape == t.shape and g.dtype == t.dtype and g.device == t.device, f"{name} {gname}"
    ref = attention_ref_grads(q, k, v, dout, softmax_scale=softmax_scale, causal=causal, upcast=True)
    naive = attention_ref_grads(q, k, v, dout, softmax_scale=softmax_scale, causal=causal, upcast=False)
    for gname, g, r, n in zip(GRAD_NAMES, grads, ref, naive):
        # The rule is only meaningful with a finite naive error.
        assert torch.isfinite(n).all(), f"{name} {gname}: the naive reference is not finite"
        assert_close_by_rule(g, r, n, f"{name} {gname}")
    empty = _empty_rows(q.shape[1], k.shape[1], causal)
    if empty.any():
        rows = grads[0][:, empty]
        assert torch.equal(rows, torch.zeros_like(rows)), f"{name}: dQ rows that see no key are not exactly 0"
    return ref


# ------------------------------------------------------------------------------------------------- main grid


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bwd_matches_reference(dtype, head_dim, causal, seqlen_q, seqlen_k):
    _require_built(head_dim, dtype)
    batch, nheads = 2, 3
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype)
    dout = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    _, grads = _backward(q, k, v, dout, causal=causal)
    _check_grads(grads, q, k, v, dout, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bwd_long_sequence(dtype, causal):
    """seqlen 4224 = 33 x 128 (many K/V tiles per head, many Q tiles per CTA), at head_dim 128 only."""
    head_dim = 128
    _require_built(head_dim, dtype)
    batch, nheads, seqlen = 1, 2, 4224
    q, k, v = _qkv(batch, seqlen, seqlen, nheads, head_dim, dtype)
    dout = _randn(batch, seqlen, nheads, head_dim, dtype=dtype)
    _, grads = _backward(q, k, v, dout, causal=causal)
    _check_grads(grads, q, k, v, dout, causal=causal, name="4224")


@pytest.mark.parametrize("softmax_scale", [0.3, 0.02])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_bwd_softmax_scale(head_dim, causal, softmax_scale):
    """A scale other than the default reaches P, dQ = α dS K and dK = α dSᵀ Q."""
    dtype = _built_dtype(head_dim)
    q, k, v = _qkv(2, 239, 203, 3, head_dim, dtype)
    dout = _randn(2, 239, 3, head_dim, dtype=dtype)
    _, grads = _backward(q, k, v, dout, causal=causal, softmax_scale=softmax_scale)
    _check_grads(grads, q, k, v, dout, causal=causal, softmax_scale=softmax_scale, name=f"scale {softmax_scale}")


# ----------------------------------------------------------------------------------------- special cases


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bwd_one_key_softmax_is_constant(dtype, head_dim):
    """seqlen 1 x 1, inputs scaled by 3, dO all ones: the softmax over one key is 1 whatever the score, so dQ = dK = 0
    and dV = dO. The kernel's dS = P (dP - D) takes two fp32 sums of the same products, so dQ and dK may differ from 0
    by rounding noise; the rule (floor 1e-4, the reference being exactly 0) bounds it."""
    _require_built(head_dim, dtype)
    batch, nheads = 2, 3
    q, k, v = _qkv(batch, 1, 1, nheads, head_dim, dtype, scale=3.0)
    dout = torch.ones(batch, 1, nheads, head_dim, dtype=dtype, device="cuda")
    _, (dq, dk, dv) = _backward(q, k, v, dout)
    ref = _check_grads((dq, dk, dv), q, k, v, dout, name="1x1")
    # the construction does what it says: the reference gradients are exactly 0, 0 and dO
    assert torch.equal(ref[0], torch.zeros_like(ref[0])) and torch.equal(ref[1], torch.zeros_like(ref[1]))
    assert torch.equal(ref[2], dout.float())
    naive_dv = attention_ref_grads(q, k, v, dout, upcast=False)[2]
    assert_close_by_rule(dv, dout.float(), naive_dv, "dv vs dO")


def test_bwd_causal_scaled_inputs():
    """Causal, seqlen 1024, head_dim 128, fp16, inputs scaled by 3: logits with a standard deviation near 9, so the
    softmax is peaked and P rounds to 0 over most of each row. Every gradient finite and within the rule."""
    head_dim, dtype = 128, torch.float16
    _require_built(head_dim, dtype)
    batch, nheads, seqlen = 2, 3, 1024
    q, k, v = _qkv(batch, seqlen, seqlen, nheads, head_dim, dtype, scale=3.0)
    dout = _randn(batch, seqlen, nheads, head_dim, dtype=dtype)
    _, grads = _backward(q, k, v, dout, causal=True)
    for name, g in zip(GRAD_NAMES, grads):
        assert torch.isfinite(g).all(), f"{name} is not finite"
    _check_grads(grads, q, k, v, dout, causal=True, name="scaled x3")


def _dout_with_layout(layout, batch, seqlen, nheads, head_dim, dtype):
    """A (batch, seqlen, nheads, head_dim) dO that is not laid out like out."""
    if layout == "transposed":  # made in SDPA's (batch, nheads, seqlen, head_dim) layout and transposed
        t = _randn(batch, nheads, seqlen, head_dim, dtype=dtype).transpose(1, 2)
        assert not t.is_contiguous() and t.stride(1) == head_dim
    elif layout == "sliced":  # the first half of a wider last dim: 16-byte strides, read in place
        t = _randn(batch, seqlen, nheads, 2 * head_dim, dtype=dtype)[..., :head_dim]
        assert not t.is_contiguous()
    elif layout == "odd_stride":  # row/head strides not multiples of 16 bytes: copied before the kernel
        t = _randn(batch, seqlen, nheads, head_dim + 1, dtype=dtype)[..., :head_dim]
        assert (t.stride(2) * t.element_size()) % 16 != 0
    elif layout == "broadcast":  # one random row expanded over batch and seqlen (stride 0), as from a sum
        t = _randn(1, 1, nheads, head_dim, dtype=dtype).expand(batch, seqlen, nheads, head_dim)
        assert t.stride(0) == 0 and t.stride(1) == 0
    else:
        raise AssertionError(layout)
    assert t.shape == (batch, seqlen, nheads, head_dim)
    return t


@pytest.mark.parametrize("layout", ["transposed", "sliced", "odd_stride", "broadcast"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_bwd_dout_layouts(head_dim, layout):
    """dO of any strides is read as the values it holds, not assumed to share out's layout."""
    dtype = _built_dtype(head_dim)
    batch, seqlen_q, seqlen_k, nheads = 2, 203, 113, 3
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype)
    dout = _dout_with_layout(layout, batch, seqlen_q, nheads, head_dim, dtype)
    before = dout.clone()
    _, grads = _backward(q, k, v, dout, causal=True)
    assert torch.equal(dout, before), "dO was modified"
    _check_grads(grads, q, k, v, dout.contiguous(), causal=True, name=f"dO {layout}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bwd_packed_qkv(dtype, causal):
    """q, k, v sliced out of one (batch, seqlen, 3, nheads, head_dim) leaf at head_dim 256: the gradient of the
    packed tensor holds dQ, dK, dV in its three slices."""
    head_dim = 256
    _require_built(head_dim, dtype)
    batch, seqlen, nheads = 2, 203, 3
    qkv = _randn(batch, seqlen, 3, nheads, head_dim, dtype=dtype)
    before = qkv.clone()
    qkv.requires_grad_(True)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    dout = _randn(batch, seqlen, nheads, head_dim, dtype=dtype)
    out = attention(q, k, v, causal=causal)
    _poison_bwd(q, k, v)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert dqkv.shape == qkv.shape and dqkv.dtype == dtype
    assert torch.equal(qkv.detach(), before)
    _check_grads(dqkv.unbind(2), *(t.detach() for t in (q, k, v)), dout, causal=causal, name="packed")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bwd_causal_more_queries_than_keys(dtype):
    """seqlen_q 2048 > seqlen_k 1024, bottom-right causal: query rows 0..1023 see no key, so their dQ rows are exactly
    0, they add nothing to dK and dV, and no gradient holds NaN."""
    head_dim = 128
    _require_built(head_dim, dtype)
    batch, nheads, seqlen_q, seqlen_k = 2, 3, 2048, 1024
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype)
    dout = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    out, (dq, dk, dv) = _backward(q, k, v, dout, causal=True)
    for name, g in zip(GRAD_NAMES, (dq, dk, dv)):
        assert not torch.isnan(g).any(), f"{name} holds NaN"
    blind = dq[:, :1024]
    assert torch.equal(blind, torch.zeros_like(blind)), "dQ rows that see no key must be exactly 0"
    assert torch.equal(out[:, :1024], torch.zeros_like(out[:, :1024]))
    _check_grads((dq, dk, dv), q, k, v, dout, causal=True, name="causal 2048x1024")
    # The blind rows add nothing: changing their dO (and nothing else) leaves dK and dV within the rule of the
    # original reference.
    dout2 = dout.clone()
    dout2[:, :1024] = _randn(batch, 1024, nheads, head_dim, dtype=dtype) * 100
    _, (_, dk2, dv2) = _backward(q, k, v, dout2, causal=True)
    ref = attention_ref_grads(q, k, v, dout, causal=True)
    naive = attention_ref_grads(q, k, v, dout, causal=True, upcast=False)
    assert_close_by_rule(dk2, ref[1], naive[1], "dk with the blind rows' dO changed")
    assert_close_by_rule(dv2, ref[2], naive[2], "dv with the blind rows' dO changed")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(0, 7), (7, 0), (0, 0)])
def test_bwd_empty_sequences(seqlen_q, seqlen_k, causal):
    head_dim = 128
    dtype = _built_dtype(head_dim)
    batch, nheads = 2, 3
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype)
    dout = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    _, grads = _backward(q, k, v, dout, causal=causal)
    for name, g, t in zip(GRAD_NAMES, grads, (q, k, v)):
        assert g.shape == t.shape and g.dtype == dtype and g.device == t.device, name
        assert torch.equal(g, torch.zeros_like(g)), name


# ---------------------------------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("which", ["q", "k", "v", "kv", "qkv"])
def test_bwd_only_inputs_that_require_grad(which):
    """Gradients reach exactly the inputs with requires_grad (the others keep .grad None), and the output with
    autograd equals the output without it."""
    head_dim = 128
    dtype = _built_dtype(head_dim)
    batch, seqlen_q, seqlen_k, nheads = 2, 203, 113, 3
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype)
    dout = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    leaves = {name: t.detach().requires_grad_(name in which) for name, t in zip("qkv", (q, k, v))}
    out = attention(leaves["q"], leaves["k"], leaves["v"], causal=True)
    assert out.requires_grad
    assert torch.equal(out.detach(), attention(q, k, v, causal=True))
    _poison_bwd(q, k, v)
    out.backward(dout)
    ref = attention_ref_grads(q, k, v, dout, causal=True)
    naive = attention_ref_grads(q, k, v, dout, causal=True, upcast=False)
    check_grads_where_required(leaves, which, ref, naive, dtype, f"only {which}")


def test_bwd_no_graph_without_requires_grad():
    head_dim = 128
    dtype = _built_dtype(head_dim)
    q, k, v = _qkv(2, 113, 203, 3, head_dim, dtype)
    out = attention(q, k, v)
    assert not out.requires_grad and out.grad_fn is None
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    with torch.no_grad():
        out_no_grad = attention(*leaves)
    assert not out_no_grad.requires_grad and out_no_grad.grad_fn is None
    out, lse = attention(*leaves, return_lse=True)
    # lse is differentiable (issue 5; tests/test_features_gpu.py checks its gradient)
    assert out.requires_grad and lse.requires_grad and lse.grad_fn is out.grad_fn


def test_bwd_twice_with_retain_graph():
    """Two backward passes through one graph (retain_graph=True) both give gradients within the rule. They need not
    be bit-identical: dQ is accumulated with atomics."""
    head_dim = 128
    dtype = _built_dtype(head_dim)
    batch, seqlen_q, seqlen_k, nheads = 2, 1023, 1024, 3
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype)
    dout = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = attention(*leaves, causal=True)
    _poison_bwd(q, k, v)
    first = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    _poison_bwd(q, k, v)
    second = torch.autograd.grad(out, leaves, dout)
    _check_grads(first, q, k, v, dout, causal=True, name="first")
    _check_grads(second, q, k, v, dout, causal=True, name="second")
    # dK and dV are not atomics: one CTA per key block accumulates them in registers over the query blocks in a
    # fixed order, so they repeat bit for bit.
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])


def test_bwd_non_default_stream():
    """On a side stream kept busy, the inputs and dO are written and then forward and backward run: a kernel launched
    on any other stream would run before the writes land and read the stale values."""
    head_dim = 128
    dtype = _built_dtype(head_dim)
    batch, seqlen, nheads = 2, 1024, 3
    q, k, v = _qkv(batch, seqlen, seqlen, nheads, head_dim, dtype)
    dout = _randn(batch, seqlen, nheads, head_dim, dtype=dtype)
    stale = [torch.randn_like(t) for t in (q, k, v, dout)]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    assert side != torch.cuda.current_stream()
    with torch.cuda.stream(side):
        # poison first: _poison_allocator synchronizes the device, which must not happen after the sleep
        _poison_bwd(q, k, v)
        torch.cuda._sleep(100_000_000)  # keeps `side` busy for tens of ms
        for dst, src in zip(stale, (q, k, v, dout)):
            dst.copy_(src)
        leaves = [t.requires_grad_(True) for t in stale[:3]]
        out = attention(*leaves, causal=True)
        grads = torch.autograd.grad(out, leaves, stale[3])
    torch.cuda.current_stream().wait_stream(side)
    for t in stale:  # made on the default stream, used on `side`
        t.record_stream(side)
    _check_grads(grads, q, k, v, dout, causal=True, name="side stream")


# ------------------------------------------------------------------------------------------------------ memory


def test_bwd_peak_memory(record_property):
    """batch 1, nheads 16, seqlen 16384, head_dim 128, bf16: the peak memory of forward + backward, above what was
    allocated before q, k, v and dO were made, stays within 2x what q, k, v, out, dO, dQ, dK, dV and the fp32 dQ
    accumulator need. A seqlen_q x seqlen_k buffer anywhere (8 GiB in bf16 here) would break it by far. The figure
    goes into the junit XML (record_property)."""
    head_dim, dtype = 128, torch.bfloat16
    _require_built(head_dim, dtype)
    batch, nheads, seqlen = 1, 16, 16384
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    q, k, v = (t.requires_grad_(True) for t in _qkv(batch, seqlen, seqlen, nheads, head_dim, dtype))
    dout = _randn(batch, seqlen, nheads, head_dim, dtype=dtype)
    one = q.numel() * q.element_size()  # 64 MiB
    dq_accum = batch * nheads * (-(-seqlen // BWD_SEQLEN_Q_ROUNDING) * BWD_SEQLEN_Q_ROUNDING) * head_dim * 4
    need = 8 * one + dq_accum  # q, k, v, out, dO, dQ, dK, dV + dQ accumulator
    # Poison here rather than between forward and backward, so the poisoned blocks do not count in the peak: out
    # and LSE take the first ones, dQ, dK, dV, the accumulator and the row vectors the rest.
    _poison_allocator(one, *_bwd_nbytes(q, k, v), batch * nheads * seqlen * 4)
    torch.cuda.reset_peak_memory_stats()
    out = attention(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    record_property("bwd_peak_memory_bytes", peak)
    record_property("bwd_needed_bytes", need)
    mib = 2**20
    assert peak <= 2 * need, (
        f"peak {peak / mib:.0f} MiB over forward + backward > 2 x {need / mib:.0f} MiB needed "
        f"(q, k, v, out, dO, dQ, dK, dV {8 * one / mib:.0f} MiB + dQ accumulator {dq_accum / mib:.0f} MiB)"
    )
    for name, g in zip(GRAD_NAMES, (dq, dk, dv)):
        assert torch.isfinite(g).all(), f"{name} is not finite"
    # dQ rows depend only on their own query row (non-causal): check the first and last 64 rows by the rule.
    q, k, v = (t.detach() for t in (q, k, v))
    rows = torch.cat([torch.arange(64), torch.arange(seqlen - 64, seqlen)]).cuda()
    ref = attention_ref_grads(q[:, rows], k, v, dout[:, rows])[0]
    naive = attention_ref_grads(q[:, rows], k, v, dout[:, rows], upcast=False)[0]
    assert_close_by_rule(dq[:, rows], ref, naive, "dq rows")


# ---------------------------------------------------------------------------------------------------- GQA / MQA


@pytest.mark.parametrize("nheads_k", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 239), (113, 203), (203, 113), (1023, 1024)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gqa_fwd_bwd_match_reference(dtype, head_dim, causal, seqlen_q, seqlen_k, nheads_k):
    """nheads 6 over nheads_k 2 (groups of 3) and 1 (MQA): out and LSE by the rule, then dQ, dK, dV, with dK and dV
    summed over the query heads of each group (the reference repeats K/V heads; autograd sums). Inputs unmodified."""
    _require_built(head_dim, dtype)
    batch, nheads = 2, 6
    q = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k, v = (_randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype) for _ in range(2))
    dout = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    before = [t.clone() for t in (q, k, v, dout)]
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, upcast=True)
    naive, naive_lse = attention_ref(q, k, v, causal=causal, upcast=False)
    assert out.shape == q.shape and lse.shape == (batch, nheads, seqlen_q)
    assert_close_by_rule(out, ref, naive, "gqa out")
    assert_close_by_rule(lse, ref_lse, naive_lse, "gqa lse")
    _, grads = _backward(q, k, v, dout, causal=causal)
    _check_grads(grads, q, k, v, dout, causal=causal, name=f"gqa nheads_k={nheads_k}")
    for t, b in zip((q, k, v, dout), before):
        assert torch.equal(t, b), "inputs must not be modified"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gqa_group_per_cta_large_grid(head_dim, causal, monkeypatch):
    """8 x 1100 tokens, 12 query heads on 4 K/V heads: 9 key blocks (head_dim 256: 18) x 4 x 8 CTAs fill a 132-SM GPU
    twice, so the launcher runs each group's three query heads in one CTA (flash/config.hpp bwd_heads_per_cta): dQ, dK,
    dV by the rule, and dK, dV bitwise those of that mode forced (FAH_BWD_GQA_GROUP_CTA=1; it sums no atomics, and
    the fp32 sums of the other mode round differently). tests/test_bwd_gqa_group_gpu.py forces each mode on the other
    GQA tests; this one unsets the variable to test the launcher's own pick."""
    if torch.cuda.get_device_properties(0).multi_processor_count > 144:
        pytest.skip("the shape fills a GPU of at most 144 SMs twice over; this one has more")
    monkeypatch.delenv("FAH_BWD_GQA_GROUP_CTA", raising=False)
    dtype = _built_dtype(head_dim)
    batch, seqlen, nheads, nheads_k = 8, 1100, 12, 4
    q = _randn(batch, seqlen, nheads, head_dim, dtype=dtype)
    k, v = (_randn(batch, seqlen, nheads_k, head_dim, dtype=dtype) for _ in range(2))
    dout = _randn(batch, seqlen, nheads, head_dim, dtype=dtype)
    _, grads = _backward(q, k, v, dout, causal=causal)
    _check_grads(grads, q, k, v, dout, causal=causal, name="gqa group per CTA")
    monkeypatch.setenv("FAH_BWD_GQA_GROUP_CTA", "1")
    _, forced = _backward(q, k, v, dout, causal=causal)
    for gname, g, f in zip(GRAD_NAMES[1:], grads[1:], forced[1:]):
        assert torch.equal(g, f), f"{gname}: the launcher did not run one CTA per K/V head group at this shape"


def _bwd_peak(q, k, v, dout, **kwargs):
    """Peak bytes allocated during the backward alone (beyond what the forward left allocated)."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = attention(*leaves, **kwargs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, grads


# Windows that hide no key (left >= seqlen_k - 1 and right >= seqlen_q - 1) count as no mask; None: from seqlen.
_RULE_MASKS = {"none": {}, "causal": {"causal": True}, "window_right_only": {"window_size": (-1, 40)},
               "window": {"window_size": (300, 40)}, "window_wider": {"window_size": (5000, 5000)},
               "window_hides_nothing": None, "window_one_short": None}


def _rule_mask_kwargs(mask, seqlen):
    if mask == "window_hides_nothing":
        return {"window_size": (seqlen - 1, seqlen - 1)}
    if mask == "window_one_short":
        return {"window_size": (seqlen - 2, seqlen - 1)}
    return _RULE_MASKS[mask]
_RULE_UNMASKED = ("none", "window_wider", "window_hides_nothing")


@pytest.mark.parametrize("waves", ["one", "near_two"])
@pytest.mark.parametrize("mask", list(_RULE_MASKS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gqa_group_rule_below_two_waves(head_dim, mask, waves, monkeypatch):
    """Below two waves of CTAs (12 query heads on 4 K/V heads, 1100 tokens: 9 key blocks, or 1344 tokens: 21 blocks at
    head_dim 256 (with 1100 no batch lands in [1.9, 2) x 132 SMs), x 4 x batch CTAs; "one": from 1 to 1.9 x the SMs,
    "near_two": from 1.9 to 2 x), the launcher's pick depends on the mask
    (flash/config.hpp bwd_heads_per_cta): one CTA per K/V head group without a mask (or a window that hides no key)
    at head_dim <= 128, and under a causal-like mask (causal, or a window with no left bound) at head_dim 64 from 1.9
    x the SMs; fp32 sums otherwise (a window with a left bound, head_dim 256). Read from the backward's peak memory
    against the group mode forced (_check_gqa_mode); the gradients follow the rule either way."""
    monkeypatch.delenv("FAH_BWD_GQA_GROUP_CTA", raising=False)
    dtype = _built_dtype(head_dim)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    seqlen, nheads, nheads_k = (1100 if head_dim <= 128 else 1344), 12, 4
    blocks = -(-seqlen // (128 if head_dim <= 128 else 64))
    low, high = (sms, 1.9 * sms) if waves == "one" else (1.9 * sms, 2 * sms)
    batch = -(-int(low) // (blocks * nheads_k))
    ctas = blocks * nheads_k * batch
    if not low <= ctas < high:
        pytest.skip(f"no batch puts {blocks} x {nheads_k} x batch CTAs in [{low:g}, {high:g}) on {sms} SMs")
    causal_like = mask in ("causal", "window_right_only")
    group = (mask in _RULE_UNMASKED and head_dim <= 128) or (causal_like and head_dim <= 64 and waves == "near_two")
    _check_gqa_mode(batch, seqlen, nheads, nheads_k, head_dim, dtype, _rule_mask_kwargs(mask, seqlen), group,
                    f"gqa rule {mask}, {ctas} CTAs on {sms} SMs", monkeypatch)


def _check_gqa_mode(batch, seqlen, nheads, nheads_k, head_dim, dtype, kwargs, group, where, monkeypatch):
    """The launcher's GQA backward mode read from the backward's peak memory against the group mode forced (the sums
    take two zeroed fp32 buffers of k's size that the group mode does not), and the gradients by the rule."""
    q = _randn(batch, seqlen, nheads, head_dim, dtype=dtype)
    k, v = (_randn(batch, seqlen, nheads_k, head_dim, dtype=dtype) for _ in range(2))
    dout = _randn(batch, seqlen, nheads, head_dim, dtype=dtype)
    peak, grads = _bwd_peak(q, k, v, dout, **kwargs)
    monkeypatch.setenv("FAH_BWD_GQA_GROUP_CTA", "1")
    group_peak, _ = _bwd_peak(q, k, v, dout, **kwargs)
    sums_bytes = 2 * k.numel() * 4
    # The two modes' peaks fall at different points of the backward, so their difference is near, not exactly, the
    # sums' size (0.92 of it under a causal mask): half of it separates the modes.
    if group:
        assert peak - group_peak < sums_bytes / 2, f"{where}: expected the group CTAs"
    else:
        assert peak - group_peak > sums_bytes / 2, f"{where}: expected the fp32 sums"
    ref = attention_ref_grads(q, k, v, dout, upcast=True, **kwargs)
    naive = attention_ref_grads(q, k, v, dout, upcast=False, **kwargs)
    for gname, g, r, n in zip(GRAD_NAMES, grads, ref, naive):
        assert torch.isfinite(n).all(), f"{where} {gname}: the naive reference is not finite"
        assert_close_by_rule(g, r, n, f"{where} {gname}")


@pytest.mark.parametrize("mask", ["none", "causal", "window_right_only", "window"])
@pytest.mark.parametrize("head_dim", [128, 192, 256])
def test_gqa_group_rule_groups_of_eight(head_dim, mask, monkeypatch):
    """Groups of 8 (16 query heads on 2 K/V heads) on at least two waves of CTAs (1344 tokens: 11 key blocks at
    head_dim 128, 21 at 192 and 256, x 2 x batch): at head_dim > 128 a causal-like mask (causal, or a window with no
    left bound) takes the fp32 sums at any grid, where the group CTAs ran at 0.68-0.81 of their speed
    (flash/config.hpp bwd_heads_per_cta, session 56); without a mask, under a window with a left bound, and at head_dim
    128 the group CTAs stay (two waves). Read as test_gqa_group_rule_below_two_waves does (_check_gqa_mode)."""
    monkeypatch.delenv("FAH_BWD_GQA_GROUP_CTA", raising=False)
    dtype = _built_dtype(head_dim)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    seqlen, nheads, nheads_k = 1344, 16, 2
    blocks = -(-seqlen // (128 if head_dim <= 128 else 64))
    batch = -(-2 * sms // (blocks * nheads_k))
    group = not (mask in ("causal", "window_right_only") and head_dim > 128)
    _check_gqa_mode(batch, seqlen, nheads, nheads_k, head_dim, dtype, _rule_mask_kwargs(mask, seqlen), group,
                    f"gqa groups of 8 {mask}, {blocks * nheads_k * batch} CTAs on {sms} SMs", monkeypatch)


@pytest.mark.parametrize("layout", ["packed_kv", "transposed"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gqa_strided_kv(head_dim, layout):
    """GQA (8 query heads over 2 K/V heads, groups of 4) with k and v as views: slices of one packed
    (batch, seqlen, 2, nheads_k, head_dim) tensor, or (batch, nheads_k, seqlen, head_dim) tensors transposed (the
    transformers layout). dK and dV come back with k's and v's shapes."""
    dtype = _built_dtype(head_dim)
    batch, seqlen_q, seqlen_k, nheads, nheads_k = 2, 150, 333, 8, 2
    q = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    if layout == "packed_kv":
        kv = _randn(batch, seqlen_k, 2, nheads_k, head_dim, dtype=dtype)
        k, v = kv[:, :, 0], kv[:, :, 1]
    else:
        k, v = (_randn(batch, nheads_k, seqlen_k, head_dim, dtype=dtype).transpose(1, 2) for _ in range(2))
    assert not k.is_contiguous()
    dout = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    for causal in (False, True):
        out, grads = _backward(q, k, v, dout, causal=causal)
        ref, _ = attention_ref(q, k, v, causal=causal, upcast=True)
        naive, _ = attention_ref(q, k, v, causal=causal, upcast=False)
        assert_close_by_rule(out, ref, naive, f"gqa {layout} out")
        _check_grads(grads, q, k, v, dout, causal=causal, name=f"gqa {layout} causal={causal}")
