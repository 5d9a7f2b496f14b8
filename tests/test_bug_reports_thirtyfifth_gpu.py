"""Thirty-fifth round of the bug hunt (tests/bug_report_sources.md, "Thirty-fifth round"), GPU part.

GK: launch state keyed by an address. A kernel library that keeps anything per input or output address (a TMA
descriptor, a launch configuration, a checked-call record) serves it to the next tensor at that address, whatever
its shape, strides or values: flashinfer-ai/flashinfer#5127 (a cached descriptor still valid for a second live set of
tensors: the call silently wrote the other set; an address reused by the allocator), flashinfer-ai/flashinfer#5083
(its review: a cache hit does not prove the descriptor still describes the memory at that address),
pytorch/pytorch#188823 (TMA descriptors cached per launcher keyed by data_ptr). Here every round's q, k, v and dO are
views at offset 0 of the same NaN-filled buffers (so the same data pointers, asserted), with other batch sizes,
lengths, head counts, head dims and strides from round to round, and new values; two live sets of equal shapes are
called in turn. Checked: out, LSE, dQ, dK, dV by the rule; out and LSE bitwise those of the same call on fresh
contiguous copies; with deterministic=True the gradients too; the two live sets each give their own first bits.

GL: gradients reach only what the loss depends on. A backward that applies the mask only in the forward (or to some
blocks), or that lets the rows without an output gradient contribute, gives gradient to keys a row never saw:
pytorch/pytorch#27461 (nn.MultiheadAttention with add_zero_attn: the mask ignored in the backward, the gradient of
output row i reached inputs at later positions), lucidrains/x-transformers#168 (the maintainer: masked positions must
get no gradient; "the kernel should take care of masking both for forwards and backwards"). Losses on a few output
rows (the last row, one middle row, a completion span, one query head) and on the LSE of other rows, under causal,
bottom-right causal with seqlen_q < seqlen_k, a window, documents, softcap, GQA / MQA, and varlen: dQ rows without
an output or LSE gradient exactly 0, dK of keys no such row sees exactly 0, dV of keys no row with an output gradient
sees exactly 0 (per K/V head, over its query group), and everything by the rule, from NaN-poisoned memory.

GM: the same bytes under the other 16-bit dtype. A cache keyed by address, shape and strides but not dtype, or a
dtype collapsed to a label, runs fp16 code on bf16 bits: vllm-project/vllm#54338 (a KV cache holding bf16 bits read
back as fp16: fluent nonsense, no error, no non-finite value), rajveer43/VeloxQuant-MLX#400 (a kernel cache key that
collapsed bfloat16 into float32's label at the same shape; a risk, its fix found no wrong output),
pytorch/pytorch#128883 (a dtype view of a buffer computed as the old dtype: no error, wrong values). Each case fills
the same buffers through fp16, then bf16, then fp16 views of one shape (same data pointers, shapes and strides:
asserted), new values each round, forward and backward by the rule, out and LSE bitwise the call on fresh copies.

Inputs are Gaussian from the per-test seed (tests/conftest.py). Skipped, with the reason, without an sm90 GPU and
the built extension (conftest.py), and per test when the build lacks a head_dim / dtype.
tests/test_bug_reports_thirtyfifth_cpu.py checks the premises: the views' shared addresses, the rounds' differing
shapes and strides, the GL supports (nontrivial, and the float64 reference's gradients exactly 0 outside them while a
backward without the mask leaks there), and the Python layer's checked-call key for dtype views."""

import pytest
import torch

import flash_attn_hopper
import gpu_helpers
from flash_attn_hopper.testing import document_mask, local_mask
from gpu_helpers import (GRAD_NAMES, assert_same_bits, check_attention, check_attention_varlen, cu_seqlens, randn,
                         require_built, run_attention, run_attention_varlen)

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
WHY_BITS = " (the call at reused addresses differs from the same call on fresh copies)"


# ------------------------------------------------------------------------------------------------ shared pieces


def _buffer(numel, dtype):
    """A NaN-filled flat buffer of numel elements (the memory every round's views take)."""
    return torch.full((numel,), float("nan"), dtype=dtype, device=DEVICE)


def _view(buf, shape, spread=1):
    """A view at offset 0 of buf with this shape; spread 2 makes the heads' stride twice the head_dim (the other
    half of each head's row untouched), as in an interleaved K/V cache."""
    numel = 1
    for n in shape:
        numel *= n
    if spread == 1:
        t = buf[:numel].view(shape)
    else:
        t = buf[:numel * spread].view(*shape[:-1], spread, shape[-1])[..., 0, :]
    if t.data_ptr() != buf.data_ptr():
        raise AssertionError("premise: the view does not start at the buffer's address")
    return t


def _fill(*views):
    for t in views:
        t.copy_(torch.randn(t.shape, dtype=t.dtype, device=DEVICE))


def _check_against_fresh_copies(out, lse, grads, q, k, v, dout, name, **opts):
    """By the rule, then out / LSE (and with deterministic=True dQ, dK, dV) bitwise the same call on contiguous copies
    at fresh addresses."""
    check_attention(out, lse, grads, q, k, v, dout, name, **opts)
    copies = [t.detach().clone().contiguous() for t in (q, k, v)]
    out_c, lse_c, grads_c = run_attention(*copies, dout.clone(), **opts)
    assert_same_bits(out, out_c, f"{name} out", WHY_BITS)
    assert_same_bits(lse, lse_c, f"{name} lse", WHY_BITS)
    if opts.get("deterministic"):
        for gname, a, b in zip(GRAD_NAMES, grads, grads_c):
            assert_same_bits(a, b, f"{name} {gname}", WHY_BITS)


# ------------------------------------------------------------- GK: new shapes, strides and values at old addresses

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, kv spread, opts)
GK_SEQUENCES = {
    "shrink-grow": [
        (2, 300, 517, 4, 2, 128, 1, dict(causal=True)),
        (3, 77, 130, 4, 2, 128, 1, dict(causal=True, deterministic=True)),  # fewer rows than the old extent
        (1, 517, 300, 8, 2, 128, 1, {}),  # more query rows, other batch and heads
        (2, 300, 517, 4, 2, 128, 1, dict(causal=True)),  # round 0's shapes again, new values
    ],
    "heads-and-dims": [
        (2, 257, 257, 6, 2, 128, 1, dict(window_size=(64, 16))),
        (2, 257, 257, 6, 2, 64, 1, dict(window_size=(64, 16))),  # the same bytes at another head_dim (kernel)
        (2, 257, 257, 12, 4, 64, 1, dict(window_size=(64, 16), deterministic=True)),
        (4, 257, 257, 6, 6, 128, 1, dict(causal=True)),
    ],
    "strides": [
        (2, 300, 400, 4, 2, 128, 1, dict(causal=True)),
        (2, 300, 400, 4, 2, 128, 2, dict(causal=True, deterministic=True)),  # same pointers and shapes, k/v strided
        (2, 300, 400, 4, 2, 128, 1, dict(causal=True, softcap=20.0)),
    ],
}


def _gk_capacity(rounds):
    cap = {"q": 0, "kv": 0}
    for b, sq, sk, h, hk, d, spread, _ in rounds:
        cap["q"] = max(cap["q"], b * sq * h * d)
        cap["kv"] = max(cap["kv"], b * sk * hk * d * spread)
    return cap


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sequence", list(GK_SEQUENCES))
def test_new_shapes_at_the_addresses_of_earlier_calls(sequence, dtype):
    """Round after round the same buffers hold q, k, v, dO of other shapes, strides and values (the same data
    pointers, asserted): each round by the rule, and bitwise the call on fresh contiguous copies."""
    dtype = DTYPES[dtype]
    rounds = GK_SEQUENCES[sequence]
    for r in rounds:
        require_built(r[5], dtype)
    cap = _gk_capacity(rounds)
    bufs = {"q": _buffer(cap["q"], dtype), "k": _buffer(cap["kv"], dtype), "v": _buffer(cap["kv"], dtype),
            "dout": _buffer(cap["q"], dtype)}
    for i, (b, sq, sk, h, hk, d, spread, opts) in enumerate(rounds):
        q, dout = _view(bufs["q"], (b, sq, h, d)), _view(bufs["dout"], (b, sq, h, d))
        k, v = _view(bufs["k"], (b, sk, hk, d), spread), _view(bufs["v"], (b, sk, hk, d), spread)
        _fill(q, k, v, dout)
        out, lse, grads = run_attention(q, k, v, dout, **opts)
        _check_against_fresh_copies(out, lse, grads, q, k, v, dout, f"{sequence} round {i}", **opts)


# (lengths_q, lengths_k, nheads, nheads_k, head_dim, opts): packed rows of other totals at the same addresses
GK_VARLEN_ROUNDS = [
    ([300, 1, 0, 129], [517, 64, 5, 129], 4, 2, 128, dict(causal=True)),
    ([77, 13], [130, 13], 4, 2, 128, dict(causal=True)),
    ([5, 200, 64, 1, 33, 0], [5, 260, 64, 300, 1, 9], 8, 2, 128, dict(window_size=(40, 8))),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_varlen_rounds_at_the_addresses_of_earlier_calls(dtype):
    """attention_varlen with packed q, k, v, dO and cu_seqlens at the same addresses each round (other totals,
    sequences and heads, new values): by the rule per sequence, out and LSE bitwise the call on fresh copies."""
    dtype = DTYPES[dtype]
    require_built(128, dtype)
    cap_q = max(sum(lq) * h * d for lq, _, h, _, d, _ in GK_VARLEN_ROUNDS)
    cap_k = max(sum(lk) * hk * d for _, lk, _, hk, d, _ in GK_VARLEN_ROUNDS)
    bufs = [_buffer(n, dtype) for n in (cap_q, cap_k, cap_k, cap_q)]
    cu_bufs = [torch.zeros(8, dtype=torch.int32, device=DEVICE) for _ in range(2)]
    for i, (lq, lk, h, hk, d, opts) in enumerate(GK_VARLEN_ROUNDS):
        q, k = _view(bufs[0], (sum(lq), h, d)), _view(bufs[1], (sum(lk), hk, d))
        v, dout = _view(bufs[2], (sum(lk), hk, d)), _view(bufs[3], (sum(lq), h, d))
        _fill(q, k, v, dout)
        cu_q, cu_k = cu_bufs[0][:len(lq) + 1], cu_bufs[1][:len(lk) + 1]
        cu_q.copy_(cu_seqlens(lq))
        cu_k.copy_(cu_seqlens(lk))
        out, lse, grads = run_attention_varlen(q, k, v, dout, cu_q, cu_k, max(lq), max(lk), **opts)
        name = f"varlen round {i}"
        check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, name, **opts)
        copies = [t.clone() for t in (q, k, v)] + [cu_q.clone(), cu_k.clone()]
        out_c, lse_c = flash_attn_hopper.attention_varlen(*copies, max(lq), max(lk), return_lse=True, **opts)
        assert_same_bits(out, out_c, f"{name} out", WHY_BITS)
        assert_same_bits(lse, lse_c, f"{name} lse", WHY_BITS)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_two_live_sets_called_in_turn(dtype):
    """Two sets of q, k, v, dO of the same shapes, both alive, called A, B, A, B (forward and deterministic
    backward): every call gives its set's first bits (a descriptor or record kept for one set never serves the
    other), and the first calls are right by the rule."""
    dtype = DTYPES[dtype]
    require_built(128, dtype)
    opts = dict(causal=True, deterministic=True)
    sets = [gpu_helpers.attention_inputs(2, 333, 517, 6, 2, 128, dtype) for _ in range(2)]
    first = {}
    for step, which in enumerate((0, 1, 0, 1, 1, 0)):
        q, k, v, dout = sets[which]
        result = run_attention(q, k, v, dout, **opts)
        if which not in first:
            first[which] = result
            check_attention(*result, q, k, v, dout, f"set {which}", causal=True)
            continue
        why = f" (set {which}'s call at step {step} differs from its first: state of the other set served?)"
        for name, a, b in zip(("out", "lse", *GRAD_NAMES), (result[0], result[1], *result[2]),
                              (first[which][0], first[which][1], *first[which][2])):
            assert_same_bits(a, b, f"set {which} step {step} {name}", why)
    for a, b in zip(first[0][2], first[1][2]):
        if torch.equal(a, b):
            raise AssertionError("premise: the two sets gave the same gradients")


# ------------------------------------------------------------ GL: gradients reach only what the loss depends on

# (id, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, opts); "documents" takes document_ids below
GL_MASKS = [
    ("causal-d128", 2, 300, 300, 4, 2, 128, "fp16", dict(causal=True)),
    ("causal-q<k-d64", 2, 200, 500, 4, 1, 64, "bf16", dict(causal=True)),
    ("window-d96", 2, 400, 400, 6, 2, 96, "fp16", dict(window_size=(50, 20))),
    ("documents-d128", 2, 600, 600, 4, 2, 128, "bf16", dict(causal=True, documents=True)),
    ("softcap-causal-d256", 2, 257, 257, 4, 2, 256, "bf16", dict(causal=True, softcap=20.0)),
    ("window-left-d192v128", 2, 300, 450, 4, 2, 192, "fp16", dict(window_size=(64, -1))),
]
GL_PATTERNS = ["last-row", "middle-row", "span", "lse-rows"]
GL_HEAD_CASES = ["causal-d128", "window-d96", "softcap-causal-d256"]


def _gl_inputs(case):
    name, b, sq, sk, h, hk, d, dtype, opts = case
    dtype = DTYPES[dtype]
    d_v = 128 if d == 192 else d
    require_built(max(d, d_v), dtype)
    q, k, v, dout = gpu_helpers.attention_inputs(b, sq, sk, h, hk, d, dtype, head_dim_v=d_v)
    opts = dict(opts)
    if opts.pop("documents", False):
        lengths = [[1, 130, 200, 127, 142], [300, 1, 1, 298]]  # row 0 ends with a short document, row 1 a long one
        ids = torch.cat([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)).unsqueeze(0)
                         for ls in lengths]).to(torch.int32).to(DEVICE)
        opts["document_ids"] = ids
    return q, k, v, dout, opts


def gl_rows(pattern, seqlen_q, nheads):
    """(rows with an output gradient, rows with an LSE gradient), each (seqlen_q, nheads) bool, for a pattern."""
    do_rows = torch.zeros(seqlen_q, nheads, dtype=torch.bool)
    lse_rows = torch.zeros(seqlen_q, nheads, dtype=torch.bool)
    if pattern == "last-row":
        do_rows[-1] = True
    elif pattern == "middle-row":
        do_rows[seqlen_q // 3] = True
    elif pattern == "span":  # a completion after a prompt: the loss on rows [0.6 s, 0.8 s)
        do_rows[int(0.6 * seqlen_q):int(0.8 * seqlen_q)] = True
    elif pattern == "lse-rows":  # out of the last rows and the LSE (a z-loss) of rows near the middle
        do_rows[-5:] = True
        lse_rows[seqlen_q // 2 - 3:seqlen_q // 2 + 3] = True
    elif pattern == "one-head":  # every row of query head 1 only (a probe of one head)
        do_rows[:, 1] = True
    else:
        raise ValueError(pattern)
    return do_rows, lse_rows


def gl_visible(batch, seqlen_q, seqlen_k, opts, device=None):
    """(batch, seqlen_q, seqlen_k) bool: which keys each row sees under the options (window / causal, documents)."""
    visible = local_mask(seqlen_q, seqlen_k, opts.get("window_size", (-1, -1)), opts.get("causal", False),
                         device=device).expand(batch, seqlen_q, seqlen_k)
    if opts.get("document_ids") is not None:
        visible = visible & document_mask(opts["document_ids"].to(device))
    return visible


def gl_supports(visible, do_rows, lse_rows, nheads_k):
    """Where each gradient may be nonzero: dq (batch, seqlen_q, nheads) rows with an output or LSE gradient; dk, dv
    (batch, seqlen_k, nheads_k) keys seen by such a row of a query head of their group (dv: output gradients only)."""
    batch, _, seqlen_k = visible.shape
    nheads = do_rows.shape[-1]
    group = nheads // nheads_k
    v_f = visible.double()

    def keys(rows):
        hits = torch.einsum("bqk,bqh->bkh", v_f, rows.double()) > 0
        return hits.view(batch, seqlen_k, nheads_k, group).any(-1)

    return do_rows | lse_rows, keys(do_rows | lse_rows), keys(do_rows)


def check_support(grads, supports, name):
    """dQ, dK, dV exactly 0 outside their supports (AssertionError naming the gradient and where)."""
    for gname, g, sup in zip(GRAD_NAMES, grads, supports):
        outside = g[~sup]
        if not torch.equal(outside, torch.zeros_like(outside)):
            where = (~sup & (g != 0).any(-1)).nonzero()[:5].tolist()
            raise AssertionError(f"{name}: {gname} is not 0 where the loss does not reach, e.g. at {where} "
                                 f"({int((outside != 0).sum())} nonzero elements)")


def _gl_run(q, k, v, dout, opts, pattern, name):
    b, sq, h, _ = q.shape
    do_rows, lse_rows = (t.to(DEVICE).expand(b, sq, h) for t in gl_rows(pattern, sq, h))
    dout = dout * do_rows.unsqueeze(-1).to(dout.dtype)
    dlse = torch.randn(b, h, sq, device=DEVICE) * lse_rows.transpose(1, 2).float() if lse_rows.any() else None
    out, lse, grads = run_attention(q, k, v, dout, dlse=dlse, **opts)
    check_attention(out, lse, grads, q, k, v, dout, name, dlse=dlse, **opts)
    visible = gl_visible(b, sq, k.shape[1], opts, device=DEVICE)
    supports = gl_supports(visible, do_rows, lse_rows, k.shape[2])
    if supports[0].all():
        raise AssertionError(f"premise: {name}: the loss reaches every row")
    check_support(grads, supports, name)


@pytest.mark.parametrize("pattern", GL_PATTERNS)
@pytest.mark.parametrize("case", GL_MASKS, ids=[c[0] for c in GL_MASKS])
def test_gradients_reach_only_what_the_loss_depends_on(case, pattern):
    """A loss on some output rows (and the LSE of others): dQ of the other rows, dK of keys no such row sees, dV of
    keys no row with an output gradient sees, exactly 0 (per K/V head over its group); all by the rule."""
    q, k, v, dout, opts = _gl_inputs(case)
    _gl_run(q, k, v, dout, opts, pattern, f"{case[0]} {pattern}")


@pytest.mark.parametrize("case", [c for c in GL_MASKS if c[0] in GL_HEAD_CASES], ids=GL_HEAD_CASES)
def test_gradients_of_one_query_head_reach_only_its_kv_head(case):
    """A loss on query head 1 alone: the other query heads' dQ and the other K/V heads' dK, dV exactly 0."""
    q, k, v, dout, opts = _gl_inputs(case)
    _gl_run(q, k, v, dout, opts, "one-head", f"{case[0]} one-head")


GL_VARLEN_LQ, GL_VARLEN_LK = [130, 1, 257, 0, 64, 200], [300, 5, 257, 9, 1, 200]
GL_VARLEN = [  # (id, opts, rows with dO, rows with dLSE) as lists of packed row indices
    ("causal-last-row-of-one", dict(causal=True), [130 + 1 + 257 - 1], []),
    ("window-span", dict(window_size=(32, 8)), list(range(131 + 100, 131 + 140)), []),
    ("causal-lse", dict(causal=True), [0, 1, 2], list(range(131 + 257 + 64, 131 + 257 + 64 + 20))),
]


@pytest.mark.parametrize("case", GL_VARLEN, ids=[c[0] for c in GL_VARLEN])
def test_varlen_gradients_reach_only_what_the_loss_depends_on(case):
    """attention_varlen, GQA 4/2: a loss on rows of one or two sequences; the other sequences' dQ, dK, dV and the
    unseen keys' exactly 0, all by the rule."""
    name, opts, do_idx, lse_idx = case
    dtype = DTYPES["bf16"]
    require_built(128, dtype)
    lq, lk, h, hk, d = GL_VARLEN_LQ, GL_VARLEN_LK, 4, 2, 128
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    q, k, v, dout = randn(sum(lq), h, d, dtype=dtype), randn(sum(lk), hk, d, dtype=dtype), \
        randn(sum(lk), hk, d, dtype=dtype), randn(sum(lq), h, d, dtype=dtype)
    do_rows = torch.zeros(sum(lq), h, dtype=torch.bool, device=DEVICE)
    lse_rows = torch.zeros_like(do_rows)
    do_rows[do_idx] = True
    lse_rows[lse_idx] = True
    dout = dout * do_rows.unsqueeze(-1).to(dtype)
    dlse = torch.randn(h, sum(lq), device=DEVICE) * lse_rows.t().float() if lse_idx else None
    out, lse, grads = run_attention_varlen(q, k, v, dout, cu_q, cu_k, max(lq), max(lk), dlse=dlse, **opts)
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, name, dlse=dlse, **opts)
    visible = torch.block_diag(*[local_mask(a, b, opts.get("window_size", (-1, -1)), opts.get("causal", False))
                                 .double() for a, b in zip(lq, lk)]).bool().to(DEVICE).unsqueeze(0)
    supports = gl_supports(visible, do_rows.unsqueeze(0), lse_rows.unsqueeze(0), hk)
    check_support(grads, [s[0] for s in supports], name)


# ---------------------------------------------------------------- GM: the same bytes under the other 16-bit dtype

# (id, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v, opts)
GM_CASES = [
    ("d64-causal", 2, 300, 300, 4, 2, 64, 64, dict(causal=True)),
    ("d128-window-gqa", 2, 333, 517, 8, 2, 128, 128, dict(window_size=(100, 0), deterministic=True)),
    ("d256-softcap", 1, 257, 300, 4, 4, 256, 256, dict(softcap=15.0)),
    ("d192v128-causal", 2, 129, 300, 4, 1, 192, 128, dict(causal=True)),
]


@pytest.mark.parametrize("case", GM_CASES, ids=[c[0] for c in GM_CASES])
def test_same_bytes_under_the_other_dtype(case):
    """fp16, then bf16, then fp16 views of the same buffers (same pointers, shapes and strides; new values each
    round): each round by the rule and bitwise the call on fresh copies."""
    name, b, sq, sk, h, hk, d, d_v, opts = case
    for dtype in DTYPES.values():
        require_built(max(d, d_v), dtype)
    shapes = [(b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d_v), (b, sq, h, d_v)]
    raw = [torch.full((n[0] * n[1] * n[2] * n[3],), -1, dtype=torch.int16, device=DEVICE) for n in shapes]
    layout = None
    for i, dtype in enumerate((torch.float16, torch.bfloat16, torch.float16)):
        q, k, v, dout = (_view(r.view(dtype), s) for r, s in zip(raw, shapes))
        now = [(t.data_ptr(), tuple(t.shape), t.stride()) for t in (q, k, v, dout)]
        if layout is not None and now != layout:
            raise AssertionError("premise: the dtype views differ in address, shape or strides")
        layout = now
        _fill(q, k, v, dout)
        out, lse, grads = run_attention(q, k, v, dout, **opts)
        _check_against_fresh_copies(out, lse, grads, q, k, v, dout, f"{name} round {i} {dtype}", **opts)


def test_varlen_same_bytes_under_the_other_dtype():
    """attention_varlen over the same buffers and cu_seqlens as fp16, then bf16, then fp16 (GQA 6/2, causal)."""
    for dtype in DTYPES.values():
        require_built(128, dtype)
    lq, lk, h, hk, d = [1, 300, 0, 129, 77], [64, 400, 5, 129, 1], 6, 2, 128
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    shapes = [(sum(lq), h, d), (sum(lk), hk, d), (sum(lk), hk, d), (sum(lq), h, d)]
    raw = [torch.full((s[0] * s[1] * s[2],), -1, dtype=torch.int16, device=DEVICE) for s in shapes]
    for i, dtype in enumerate((torch.float16, torch.bfloat16, torch.float16)):
        q, k, v, dout = (_view(r.view(dtype), s) for r, s in zip(raw, shapes))
        _fill(q, k, v, dout)
        out, lse, grads = run_attention_varlen(q, k, v, dout, cu_q, cu_k, max(lq), max(lk), causal=True)
        name = f"varlen round {i} {dtype}"
        check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, name, causal=True)
        out_c, lse_c = flash_attn_hopper.attention_varlen(q.clone(), k.clone(), v.clone(), cu_q, cu_k, max(lq),
                                                          max(lk), causal=True, return_lse=True)
        assert_same_bits(out, out_c, f"{name} out", WHY_BITS)
        assert_same_bits(lse, lse_c, f"{name} lse", WHY_BITS)
