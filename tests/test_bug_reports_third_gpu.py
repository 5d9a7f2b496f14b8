"""A third round of GPU tests modelled on bug reports filed against other attention kernels (FlashAttention 3/4 and
its CuTe forward, FlashInfer, PyTorch and its compiled autograd, TransformerEngine / Megatron layouts, a Rust flash
attention), for the kinds of fault that tests/test_bug_reports_gpu.py, tests/test_bug_reports_more_gpu.py and the
other GPU test files do not yet exercise: rows whose every logit is far below zero after a fully masked first key
block, logits below the finite "minus infinity" some kernels mask with, Megatron's sequence-first (sbhd) layout with
a batch stride below the row stride, device memory kept from one call to the next, gradients accumulated into
``.grad`` over micro-batches, PyTorch's strict deterministic mode (every fresh allocation NaN-filled), and
attention_varlen at the largest number of sequences it accepts. The report each test comes from is cited by URL in
the comment above it (see also tests/bug_report_sources.md); only the shapes and conditions of the reports are taken
over, the code is this project's own.

Every result is checked by the rule of DESIGN.md §3 (``assert_close_by_rule`` against the float32 reference, the
error of the same reference run in the input dtype as the yardstick); outputs and gradients come from NaN-poisoned
memory where the helpers allow it. Skipped, with the reason, without an sm90 GPU and the built extension
(conftest.py), and per test when the build lacks a head_dim / dtype (``require_built`` / ``built_dtype``)."""

import contextlib
import gc
import math

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import (
    assert_close_by_rule,
    attention_ref,
    attention_ref_grads,
    local_mask,
    repeat_kv,
)
from gpu_helpers import attention_inputs, bits, built_dtype, check_attention, check_attention_varlen
from gpu_helpers import cu_seqlens, poison_allocator, randn, require_built
from test_bug_reports_gpu import DTYPE_IDS, DTYPES, GRAD_NAMES
from test_bug_reports_gpu import _leaves, _varlen_inputs, _varlen_run

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

# softmax_scale = ln 2 makes the kernels' exponent scale (softmax_scale * log2(e), rounded to float32) exactly 1, so
# exp2 sees the raw scores themselves: the constructions below stay exact however large the scores are.
LN2 = math.log(2.0)


# ------------------------------------------------------------------------------------------------------- helpers
# (_leaves, _varlen_inputs, _varlen_run: tests/test_bug_reports_gpu.py)


def _poison_forward(q, v):
    """NaN into the caching allocator at the sizes of the forward's out (v's head dim) and LSE."""
    batch, seqlen_q, nheads, _ = q.shape
    poison_allocator(batch * seqlen_q * nheads * v.shape[-1] * q.element_size(), batch * nheads * seqlen_q * 4)


def _as_batch(t, start, n, length):
    """Rows start : start + n * length of a packed (total, heads, dim) tensor as a dense (n, length, heads, dim) view:
    n sequences of one length."""
    return t[start:start + n * length].view(n, length, *t.shape[1:])


@contextlib.contextmanager
def _strict_determinism():
    """torch.use_deterministic_algorithms(True) with fill_uninitialized_memory: ops without a deterministic
    implementation raise, and every fresh torch / ATen allocation (at::empty included) starts as NaN (integers as
    their maximum). The previous settings come back on exit. cuBLAS (the references' einsums) needs
    CUBLAS_WORKSPACE_CONFIG in this mode, so the references run outside."""
    old = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old[0], warn_only=old[1])
        torch.utils.deterministic.fill_uninitialized_memory = old[2]


# ------------------------------------------------------------------------------------------- the online softmax


# https://github.com/Dao-AILab/flash-attention/issues/2082 (CuTe sm90 forward: a fully masked first key block set
# the running max to 0, and rows whose real logits all lay far below 0 came out as zeros)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_negative_logits_after_a_fully_masked_first_block(dtype, head_dim):
    """FlashAttention issue 2082: the report's shape (88 queries, 448 keys, causal, 7 query heads per KV head) with
    every score about -200 (in units of the exponent base 2: softmax_scale ln 2). Bottom-right causal, rows 0-23 see
    keys up to 383 at most, so the last key block of 128 (keys 384-447, the block the kernels visit first at head_dim
    64 and 128) is fully masked for them while rows 24-87 of the same query tile see part of it. A kernel that takes
    the maximum of a fully masked block as 0 (to avoid -inf - -inf) keeps it when every later score is below 0: 2^-200
    underflows and those rows come out 0 or NaN. Each score is -200 plus a random part (a constant first half of q
    and k, random second halves), so softmax is that of the random part: out is checked by the rule against the
    reference without the offset (exactly the same softmax) and LSE against the float32 reference."""
    require_built(head_dim, dtype)
    batch, seqlen_q, seqlen_k, nheads, nheads_k = 2, 88, 448, 14, 2
    half, offset = head_dim // 2, -200.0
    q, k, v, _ = attention_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    q[..., :half] = 1.0
    k[..., :half] = offset / half  # exact in fp16/bf16 (-3.125, -6.25): every score gets exactly `offset`
    k[..., half:] *= 1.5 / math.sqrt(half)  # the random part: scores of standard deviation about 1.5
    q0 = q.clone()
    q0[..., :half] = 0.0  # the same problem without the offset
    # the construction does what it says: bottom-right causal leaves rows 0-23 without the last 64 keys, and every
    # score a row sees is far below 0
    visible = local_mask(seqlen_q, seqlen_k, causal=True, device=q.device)
    assert not visible[:24, 384:].any() and visible[24:, 384:].any(dim=1).all()
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), repeat_kv(k, nheads).float())
    assert scores.masked_fill(~visible, -math.inf).amax().item() < -150

    _poison_forward(q, v)
    out, lse = attention(q, k, v, softmax_scale=LN2, causal=True, return_lse=True)
    ref, ref_lse = attention_ref(q0, k, v, softmax_scale=LN2, causal=True)
    naive, naive_lse = attention_ref(q0, k, v, softmax_scale=LN2, causal=True, upcast=False)
    shifted, shifted_lse = attention_ref(q, k, v, softmax_scale=LN2, causal=True)
    torch.testing.assert_close(shifted, ref, rtol=1e-3, atol=1e-3)  # the offset cancels in the softmax
    torch.testing.assert_close(shifted_lse, ref_lse + offset * LN2, rtol=0, atol=1e-3)
    assert_close_by_rule(out, ref, naive, f"offset {offset} out")
    assert_close_by_rule(lse, shifted_lse, naive_lse + offset * LN2, f"offset {offset} lse")


SENTINEL_MASKS = [dict(), dict(causal=True), dict(window_size=(40, 0)), dict(window_size=(20, 20))]


# https://github.com/flashinfer-ai/flashinfer/issues/4267 (running max started at a finite -5e4: rows whose logits
# all lay below it came out as zeros) and https://github.com/ohdearquant/lattice/pull/373 (masked keys scored with a
# finite -1e4: below it, a masked key won the softmax)
@pytest.mark.parametrize("opts", SENTINEL_MASKS, ids=["full", "causal", "window40_0", "window20_20"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_logits_below_finite_mask_sentinels(dtype, opts):
    """FlashInfer issue 4267 (model activations drove every raw score of a row to about -2.45e5, below the finite
    -5e4 its kernels start the running maximum at: the row's output was silently 0) and lattice PR 373 (masked keys
    scored with a finite -1e4 took the whole softmax once the real scores were lower). Here every raw score is
    exactly -57344 (below both sentinels, still inside fp16's range), so each row attends uniformly to the keys it
    sees, and the values of the first and last 20 keys carry +20, which the rows that must not see them would show.
    GQA 6/2, 100 queries over 300 keys, bottom-right masks; out and LSE by the rule."""
    head_dim = 128
    require_built(head_dim, dtype)
    batch, seqlen_q, seqlen_k, nheads, nheads_k = 2, 100, 300, 6, 2
    half = head_dim // 2
    q, k, v, _ = attention_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    q[..., :half] = 1.0
    k[..., :half] = -896.0
    k[..., half:] = 0.0
    v[:, :20] += 20.0
    v[:, -20:] += 20.0
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), repeat_kv(k, nheads).float())
    assert (scores == -57344.0).all(), "the construction must give every score exactly -57344"
    visible = local_mask(seqlen_q, seqlen_k, opts.get("window_size", (-1, -1)), opts.get("causal", False),
                         device=q.device)
    assert visible.any(dim=1).all(), "every row must see a key"
    if visible.sum() < visible.numel():  # the masks leave the +20 keys out of some rows
        assert not (visible[:, :20].all() and visible[:, -20:].all())

    _poison_forward(q, v)
    out, lse = attention(q, k, v, softmax_scale=LN2, return_lse=True, **opts)
    ref, ref_lse = attention_ref(q, k, v, softmax_scale=LN2, **opts)
    naive, naive_lse = attention_ref(q, k, v, softmax_scale=LN2, upcast=False, **opts)
    assert_close_by_rule(out, ref, naive, f"{opts} out")
    assert_close_by_rule(lse, ref_lse, naive_lse, f"{opts} lse")
    # Every score is exact, so LSE is -57344 ln 2 + ln(keys seen) up to the float32 rounding of values near -4e4 (one
    # ulp is 0.004): a bound of 8 ulps, tighter than the rule's (the naive reference rounds the scores themselves).
    lse_err = (lse - ref_lse).abs().max().item()
    assert lse_err <= 8 * torch.finfo(torch.float32).eps * ref_lse.abs().max().item(), f"{opts}: LSE off by {lse_err}"


# ------------------------------------------------------------------------------------------------------ layouts


# https://github.com/flashinfer-ai/flashinfer/issues/3800 (a batch stride mistaken for the row stride: every batch
# element after the first read the wrong rows) and https://github.com/NVIDIA/TransformerEngine/pull/359 (Megatron's
# sequence-first tensors handed to FlashAttention as transposed views)
@pytest.mark.parametrize("nheads_k", [4, 1], ids=["mha", "mqa"])
def test_sequence_first_layout(nheads_k):
    """FlashInfer issue 3800 and TransformerEngine PR 359: Megatron keeps activations sequence-first, so its q, k, v
    are (seqlen, batch, heads, head_dim) tensors, here split along the heads from one projection output, passed as
    (batch, seqlen, ...) views whose batch stride is smaller than their row stride, which no other test has; dO
    arrives in the same layout (the loss reads out sequence-first). Batch 3, so every batch element after the first
    depends on the batch stride. The packed tensor's gradient holds dQ, dK, dV by the rule; the input unchanged."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    batch, seqlen, nheads = 3, 257, 4
    qkv = randn(seqlen, batch, nheads + 2 * nheads_k, head_dim, dtype=dtype)
    before = qkv.clone()
    qkv.requires_grad_(True)
    q, k, v = qkv.transpose(0, 1).split([nheads, nheads_k, nheads_k], dim=2)
    for t in (q, k, v):
        assert t.shape[0] == batch and t.stride(0) < t.stride(1), "construction: batch stride below the row stride"
    dout_sb = randn(seqlen, batch, nheads, head_dim, dtype=dtype)
    seen = {}

    def note_layout(g):  # the strides of the dO the attention backward receives
        seen["dout"] = g.stride()

    _poison_forward(q, v)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    out.register_hook(note_layout)
    poison_allocator(qkv.numel() * qkv.element_size(), batch * seqlen * nheads * head_dim * qkv.element_size())
    (dqkv,) = torch.autograd.grad(out.transpose(0, 1), qkv, dout_sb)
    assert seen["dout"][0] < seen["dout"][1], f"construction: dO reached attention with strides {seen['dout']}"
    assert torch.equal(qkv.detach(), before), "the packed input was modified"
    grads = dqkv.transpose(0, 1).split([nheads, nheads_k, nheads_k], dim=2)
    check_attention(out.detach(), lse.detach(), grads, *(t.detach() for t in (q, k, v)), dout_sb.transpose(0, 1),
                    f"sequence-first nheads_k={nheads_k}", causal=True)


# ---------------------------------------------------------------------------------------------- memory and .grad


# https://github.com/Dao-AILab/flash-attention/issues/658 (memory kept growing while serving) and
# https://github.com/pytorch/pytorch/issues/165407 (a training loop around flash_attn_varlen_func leaked memory)
def test_no_device_memory_kept_between_calls():
    """FlashAttention issue 658 and PyTorch issue 165407: device memory that grows from call to call. A step runs,
    at a new sequence length each time (a server's or a packed-batch trainer's pattern): a dense GQA forward and
    backward through out and LSE, a forward whose graph is dropped without a backward, one under no_grad, packed
    documents with a fresh document_ids tensor (whose bounds the library notes per tensor), and attention_varlen with
    fresh cu_seqlens tensors (whose host check it notes per tensor), forward and backward. After a warm-up step,
    six more steps at six other lengths must leave exactly the memory allocated before them: nothing the library
    notes or allocates may outlive the tensors it belongs to, and nothing may be kept per shape."""
    head_dim = 64
    dtype = built_dtype(head_dim)

    def step(seqlen):
        q, k, v, dout = attention_inputs(2, seqlen, seqlen + 13, 4, 2, head_dim, dtype)
        leaves = _leaves(q, k, v)
        out, lse = attention(*leaves, causal=True, return_lse=True)
        torch.autograd.backward([out, lse], [dout, torch.ones_like(lse)])
        attention(*leaves, window_size=(32, 0))  # a graph dropped without a backward
        with torch.no_grad():
            attention(*leaves, causal=True)

        third = seqlen // 3
        ids = torch.repeat_interleave(torch.arange(3), torch.tensor([third, third, seqlen - 2 * third]))
        ids = ids.expand(2, seqlen).contiguous().cuda()
        doc_leaves = _leaves(*attention_inputs(2, seqlen, seqlen, 4, 2, head_dim, dtype)[:3])
        attention(*doc_leaves, causal=True, document_ids=ids).sum().backward()

        lengths = [seqlen // 2, 0, seqlen - seqlen // 2]
        cu_q, cu_k = cu_seqlens(lengths), cu_seqlens(lengths)
        var_leaves = _leaves(*_varlen_inputs(lengths, lengths, 4, 2, head_dim, dtype)[:3])
        var_out = attention_varlen(*var_leaves, cu_q, cu_k, max(lengths), max(lengths), causal=True)
        var_out.backward(torch.randn_like(var_out))
        return all(t.grad is not None for t in leaves + doc_leaves + var_leaves)

    assert step(100), "a gradient is missing"  # warm-up: whatever a first call keeps for good is in the baseline
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for seqlen in (130, 257, 64, 300, 199, 131):
        assert step(seqlen), "a gradient is missing"
    gc.collect()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - baseline
    assert kept == 0, f"{kept} bytes of device memory outlived six steps at six sequence lengths"


# https://github.com/pytorch/pytorch/pull/119334 (AccumulateGrad steals a gradient's storage for .grad, so a buffer
# that is reused afterwards overwrites the accumulated gradient)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gradient_accumulation_over_micro_batches(deterministic):
    """PyTorch PR 119334: autograd keeps the gradient tensor a backward returns as the leaf's ``.grad`` (it steals
    the storage), so a kernel that hands out, or later writes to, memory it reuses from call to call corrupts the
    accumulated gradients. Three micro-batches (fresh dO each) are accumulated into q.grad, k.grad, v.grad with
    .backward() and no zero_grad, GQA 4/2, causal; after the first, another call's forward and backward of the same
    shapes on other tensors must leave .grad bit for bit as it was, and at the end each .grad must be the sum of the
    three steps' gradients, by the rule against the float32 reference summed and the naive one summed in the input
    dtype in the same order."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    shape = (2, 203, 257, 4, 2, head_dim)
    q, k, v, _ = attention_inputs(*shape, dtype)
    leaves = _leaves(q, k, v)
    opts = dict(causal=True, deterministic=deterministic)
    douts = [randn(2, 203, 4, head_dim, dtype=dtype) for _ in range(3)]
    for step, dout in enumerate(douts):
        attention(*leaves, **opts).backward(dout)
        if step == 0:
            first = [bits(t.grad) for t in leaves]
            others = _leaves(*attention_inputs(*shape, dtype)[:3])
            torch.autograd.grad(attention(*others, **opts), others, randn(2, 203, 4, head_dim, dtype=dtype))
            torch.cuda.synchronize()
            for gname, t, b in zip(GRAD_NAMES, leaves, first):
                assert torch.equal(bits(t.grad), b), f"{gname}: .grad changed when another call ran its backward"
    refs = [attention_ref_grads(q, k, v, d, causal=True) for d in douts]
    naives = [attention_ref_grads(q, k, v, d, causal=True, upcast=False) for d in douts]
    for i, (gname, leaf) in enumerate(zip(GRAD_NAMES, leaves)):
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == dtype, gname
        ref = refs[0][i] + refs[1][i] + refs[2][i]
        naive = (naives[0][i] + naives[1][i]) + naives[2][i]
        assert_close_by_rule(leaf.grad, ref, naive, f"accumulated {gname}")


# ------------------------------------------------------------------------------------------- strict determinism


STRICT_DENSE = [
    (128, 128, 2, dict(causal=True)),
    (192, 128, 1, dict(window_size=(64, 17), softcap=20.0)),  # DeepSeek's head dims, MQA
    (64, 64, 4, dict()),
]


# https://github.com/Dao-AILab/flash-attention/issues/2541 (the reporter ran FA4 under
# torch.use_deterministic_algorithms(True) "to force nans instead of garbage data", which exposed a corrupted dV) and
# https://github.com/pytorch/pytorch/pull/182551 (how SDPA's backends behave in PyTorch's deterministic mode)
@pytest.mark.parametrize("head_dim,head_dim_v,nheads_k,opts", STRICT_DENSE, ids=["128-gqa-causal", "192-128-mqa", "64"])
def test_strict_deterministic_mode(head_dim, head_dim_v, nheads_k, opts):
    """FlashAttention issue 2541 (found by running under torch.use_deterministic_algorithms(True), which fills every
    fresh allocation with NaN: memory a kernel reads before writing, or leaves unwritten, turns into NaN instead of
    plausible garbage) and PyTorch PR 182551 (SDPA's backends in that mode). Under it, with fill_uninitialized_memory,
    every output and workspace the library allocates (not only the sizes the poison helper guesses) starts as NaN,
    and any op without a deterministic implementation would raise. attention with deterministic=True, forward and
    backward through out and LSE, twice: no error, bitwise-equal results, and out, LSE, dQ, dK, dV by the rule
    (references computed outside the mode)."""
    dtype = built_dtype(max(head_dim, head_dim_v))
    q, k, v, dout = attention_inputs(2, 203, 300, 4, nheads_k, head_dim, dtype, head_dim_v)
    dlse = torch.randn(2, 4, 203, device="cuda")
    runs = []
    with _strict_determinism():
        for _ in range(2):
            leaves = _leaves(q, k, v)
            out, lse = attention(*leaves, return_lse=True, deterministic=True, **opts)
            grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
            runs.append((out.detach(), lse.detach(), *grads))
        torch.cuda.synchronize()
    for name, a, b in zip(("out", "lse") + GRAD_NAMES, *runs):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"
    out, lse, *grads = runs[0]
    check_attention(out, lse, tuple(grads), q, k, v, dout, f"strict ({head_dim}, {head_dim_v}) {opts}", dlse=dlse,
                    **opts)


def test_strict_deterministic_mode_varlen_and_documents():
    """The same strict mode (FlashAttention issue 2541, PyTorch PR 182551) for attention_varlen, with empty sequences
    on either side and seven rows past the last sequence (outputs and gradients the library must write itself), and
    for attention with packed documents (bounds computed on the device each call): deterministic=True, forward and
    backward twice, no error, bitwise-equal results, everything by the rule, rows outside the sequences 0 / -inf."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    lq, lk = [1, 300, 129, 0, 64], [5, 257, 129, 33, 0]
    q, k, v, dout = _varlen_inputs(lq + [7], lk + [7], 4, 2, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    rows = ([200, 300], [100, 399, 1])  # document lengths per row
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]).cuda()
    qd, kd, vd, doutd = attention_inputs(2, 500, 500, 4, 2, head_dim, dtype)
    varlen_runs, doc_runs = [], []
    with _strict_determinism():
        for _ in range(2):
            leaves = _leaves(q, k, v)
            out, lse = attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True,
                                        deterministic=True)
            varlen_runs.append((out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout)))
            leaves = _leaves(qd, kd, vd)
            out, lse = attention(*leaves, causal=True, return_lse=True, deterministic=True, document_ids=ids)
            doc_runs.append((out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, doutd)))
        torch.cuda.synchronize()
    for what, runs in (("varlen", varlen_runs), ("documents", doc_runs)):
        for name, a, b in zip(("out", "lse") + GRAD_NAMES, *runs):
            assert torch.equal(a, b), f"{what}: {name} differs between two deterministic runs"
    out, lse, *grads = varlen_runs[0]
    check_attention_varlen(out, lse, tuple(grads), q, k, v, dout, cu_q, cu_k, "strict varlen", causal=True)
    for gname, g, covered in (("dq", grads[0], sum(lq)), ("dk", grads[1], sum(lk)), ("dv", grads[2], sum(lk))):
        tail = g[covered:]
        assert torch.equal(tail, torch.zeros_like(tail)), f"strict varlen: {gname} rows past the last sequence"
    out, lse, *grads = doc_runs[0]
    check_attention(out, lse, tuple(grads), qd, kd, vd, doutd, "strict documents", causal=True, document_ids=ids)


# ----------------------------------------------------------------------------------------------- variable length


# (len_q, len_k, sequences): under bottom-right causal every row sees no key, one key, or at least 8
# (docs/conventions.md: rows that see two to four keys are where the backward's rounding of D = rowsum(dO * O) can
# exceed the rule)
VARLEN_LIMIT_GROUPS = [(2, 9, 30000), (1, 12, 20000), (3, 1, 15000), (0, 2, 535)]


# https://github.com/Dao-AILab/flash-attention/issues/1311 (flash_attn_varlen_func: illegal memory access once the
# launch grid's batch and head dimensions grew large)
def test_varlen_with_the_most_sequences():
    """FlashAttention issue 1311 was a varlen call (its grid 1 x 12288 x 16 blocks ran into an illegal access); the
    grid-limit tests elsewhere are dense. attention_varlen accepts at most 65535 sequences (a launch grid dimension):
    here exactly 65535, in four runs of equal shape (2 x 9, 1 x 12, 3 x 1 whose first two queries see no key under
    bottom-right causal, and 0 x 2: keys without queries), GQA 2/1, causal, forward and backward from NaN-poisoned
    memory. Each run of equal shape is a dense batch in disguise: out, LSE, dQ, dK, dV by the rule against the dense
    reference of that run, and the keys without queries get dK = dV = 0 exactly."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    nheads, nheads_k = 2, 1
    assert sum(n for _, _, n in VARLEN_LIMIT_GROUPS) == 65535
    lq = [a for a, _, n in VARLEN_LIMIT_GROUPS for _ in range(n)]
    lk = [b for _, b, n in VARLEN_LIMIT_GROUPS for _ in range(n)]
    q, k, v, dout = _varlen_inputs(lq, lk, nheads, nheads_k, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    out, lse, (dq, dk, dv) = _varlen_run(q, k, v, dout, cu_q, cu_k, max(lq), max(lk), causal=True)
    q0 = k0 = 0
    for len_q, len_k, n in VARLEN_LIMIT_GROUPS:
        q1, k1 = q0 + n * len_q, k0 + n * len_k
        name = f"{n} sequences of {len_q} x {len_k}"
        if len_q == 0:
            for gname, g in (("dk", dk), ("dv", dv)):
                assert torch.count_nonzero(g[k0:k1]).item() == 0, f"{name}: {gname} of keys without queries"
        else:
            qs = [_as_batch(t, q0, n, len_q) for t in (out, dq, q, dout)]
            ks = [_as_batch(t, k0, n, len_k) for t in (dk, dv, k, v)]
            group_lse = lse[:, q0:q1].view(nheads, n, len_q).permute(1, 0, 2)
            check_attention(qs[0], group_lse, (qs[1], ks[0], ks[1]), qs[2], ks[2], ks[3], qs[3], name, causal=True)
        q0, k0 = q1, k1
