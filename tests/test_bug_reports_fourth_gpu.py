"""A fourth round of GPU tests modelled on bug reports filed against other attention kernels (FlashInfer, FlashAttention
2/3 and its forks, xformers, PyTorch SDPA / cuDNN varlen and its fake kernels, Metal flash attention), for the kinds of
fault that tests/test_bug_reports_gpu.py, tests/test_bug_reports_more_gpu.py, tests/test_bug_reports_third_gpu.py and
the other GPU test files do not yet exercise: calls running at the same time on several CUDA streams and from several
host threads (state or workspace shared between calls), one tensor passed as several of q, k, v, fake (meta) kernels
whose output strides differ from the real ones for strided inputs, a second backward through a freed graph,
loss-scaled output gradients, variable-length inputs and dO that are not 16-byte aligned, cu_seqlens views inside a
larger buffer (a read one entry past them), softcaps far below and far above the scores (masked keys leaking through
a small cap), unscaled scores Q Kᵀ beyond fp16's range with a small softmax_scale, forward-mode AD (a dropped
tangent), CUDA graph trees under torch.compile with a Linear layer around the op, and hidden host synchronisations.
The report each test comes from is cited by URL in the comment above it (see also tests/bug_report_sources.md); only
the shapes and conditions of the reports are taken over, the code is this project's own.

Every numeric result is checked by the rule of DESIGN.md §3 (``assert_close_by_rule`` against the float32 reference,
the error of the same reference run in the input dtype as the yardstick); outputs and gradients come from
NaN-poisoned memory where the helpers allow it. Skipped, with the reason, without an sm90 GPU and the built extension
(conftest.py), and per test when the build lacks a head_dim / dtype (``require_built`` / ``built_dtype``)."""

import copy
import math
import threading
import time
import traceback

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_ref_grads, repeat_kv
from gpu_helpers import attention_inputs, bits, built_dtype, check_attention, check_attention_varlen
from gpu_helpers import cu_seqlens, in_canary_buffer, poison_allocator, randn, require_built, run_attention
from test_bug_reports_gpu import DTYPE_IDS, DTYPES, GRAD_NAMES
from test_bug_reports_gpu import _assert_blind_rows_zero, _leaves, _ref_grads_through, _varlen_inputs, _varlen_run

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"


# ------------------------------------------------------------------------------------------------------- helpers
# (_leaves, _varlen_inputs, _varlen_run, _ref_grads_through, _assert_blind_rows_zero: tests/test_bug_reports_gpu.py)


def _reference_opts(opts):
    """The options the references take: deterministic only changes the order of the kernels' sums."""
    return {key: value for key, value in opts.items() if key != "deterministic"}


def _run_dense(q, k, v, dout, **opts):
    """attention forward (out, LSE) and backward (dQ, dK, dV) on fresh leaves, nothing synchronised or poisoned."""
    leaves = _leaves(q, k, v)
    out, lse = attention(*leaves, return_lse=True, **opts)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), lse.detach(), grads


def _run_varlen(q, k, v, dout, cu_q, cu_k, max_q, max_k, **opts):
    leaves = _leaves(q, k, v)
    out, lse = attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, return_lse=True, **opts)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), lse.detach(), grads


def _poison_current_stream(*nbytes):
    """NaN-filled blocks of these sizes allocated and freed on the current stream, whose pool in the caching allocator
    hands them out next. Unlike gpu_helpers.poison_allocator no empty_cache: that would drop the blocks poisoned for
    other streams a moment before."""
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device=DEVICE) for n in nbytes if n > 0]
    del blocks


def _document_ids(rows):
    """An int32 (len(rows), sum(rows[0])) tensor on the CPU: row r holds documents of the lengths rows[r]."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]).to(torch.int32)


def _assert_bitwise(results, expected, name):
    """(out, lse, grads) against (out, lse, grads), bit for bit."""
    for what, a, b in zip(("out", "lse") + GRAD_NAMES, (results[0], results[1], *results[2]),
                          (expected[0], expected[1], *expected[2])):
        assert torch.equal(bits(a), bits(b)), f"{name}: {what} differs from the same call run alone"


# ---------------------------------------------------------------------------------------------------- concurrency


# https://github.com/flashinfer-ai/flashinfer/issues/3618 (a per-device cached buffer shared by the same call on two
# concurrent streams), https://github.com/flashinfer-ai/flashinfer/pull/4476 (two same-shape calls on different
# streams, interleaved without a sync, corrupted each other's staging buffers and TMA descriptors) and
# https://github.com/flashinfer-ai/flashinfer/pull/2710 (a cached workspace shared by concurrent calls: NaN tiles)
def test_calls_on_concurrent_streams():
    """FlashInfer issue 3618 and PRs 4476 / 2710: anything a call keeps between calls (a workspace, a tile counter,
    semaphores, descriptors) and hands to every call of the same shape is a race once calls run on several streams
    at once. Two dense calls of the same shapes and options (GQA 8/2, causal, the deterministic backward with its
    semaphores; 192 query tiles for the forward's scheduler) and one varlen call (window, atomic dQ) are enqueued on
    three streams, all three forwards first and then all three backwards, with nothing waited for in between, twice,
    from NaN-poisoned memory. The dense results must be bit for bit those of the same call run alone on the current
    stream (the forward and the deterministic backward are bitwise repeatable), each of which the rule checks; the
    varlen results by the rule."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    e = torch.finfo(dtype).bits // 8
    dense_opts = dict(causal=True, deterministic=True)
    var_opts = dict(causal=True, window_size=(100, 0))
    batch, seqlen_q, seqlen_k, nheads, nheads_k = 4, 700, 777, 8, 2
    dense = [attention_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype) for _ in range(2)]
    lq, lk = [300, 0, 513, 129], [257, 40, 600, 129]
    var = _varlen_inputs(lq, lk, nheads, nheads_k, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    inputs = [dense[0], dense[1], var]

    def forward(i, leaves):
        if i < 2:
            return attention(*leaves, return_lse=True, **dense_opts)
        return attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), return_lse=True, **var_opts)

    # Alone, on the current stream (this also runs the host check of the cu_seqlens, so that no call below reads them).
    alone = []
    for i, (q, k, v, dout) in enumerate(inputs):
        leaves = _leaves(q, k, v)
        out, lse = forward(i, leaves)
        alone.append((out.detach(), lse.detach(), torch.autograd.grad(out, leaves, dout)))
    check_attention(*alone[0], *dense[0], "alone dense 0", **_reference_opts(dense_opts))
    check_attention(*alone[1], *dense[1], "alone dense 1", **_reference_opts(dense_opts))
    check_attention_varlen(*alone[2], *var, cu_q, cu_k, "alone varlen", **var_opts)

    dense_bytes = (batch * seqlen_q * nheads * head_dim * e, batch * nheads * seqlen_q * 4,
                   batch * seqlen_k * nheads_k * head_dim * e)
    var_bytes = (sum(lq) * nheads * head_dim * e, nheads * sum(lq) * 4, sum(lk) * nheads_k * head_dim * e)
    streams = [torch.cuda.Stream() for _ in inputs]
    for round_ in range(2):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                _poison_current_stream(*(dense_bytes if i < 2 else var_bytes))
        pending = []
        for i, stream in enumerate(streams):  # three forwards back to back, nothing waited for
            with torch.cuda.stream(stream):
                leaves = _leaves(*inputs[i][:3])
                pending.append((leaves, *forward(i, leaves)))
        results = []
        for i, stream in enumerate(streams):  # then three backwards, while the forwards may still run
            with torch.cuda.stream(stream):
                leaves, out, lse = pending[i]
                results.append((out.detach(), lse.detach(), torch.autograd.grad(out, leaves, inputs[i][3])))
        torch.cuda.synchronize()
        for i in range(2):
            _assert_bitwise(results[i], alone[i], f"round {round_} stream {i}")
        check_attention_varlen(*results[2], *var, cu_q, cu_k, f"round {round_} varlen stream", **var_opts)


THREAD_OPTIONS = [dict(causal=True), dict(window_size=(40, 8)), dict(causal=True, softcap=20.0),
                  dict(causal=True, deterministic=True)]


def _thread_job(t, s, head_dim, dtype):
    """Thread t's step s: its own shapes (so the checked-call cache gains entries while other threads read it), a
    varlen batch and a batch of packed documents."""
    seqlen_q, seqlen_k = 97 + 31 * t + 7 * s, 130 + 17 * t + 5 * s
    lq, lk = [seqlen_q, 0, 40 + s], [seqlen_k, 9, 40 + s]
    length = 150 + 10 * t + s
    return dict(
        dense=attention_inputs(2, seqlen_q, seqlen_k, 4, 2, head_dim, dtype),
        lq=lq, lk=lk, var=_varlen_inputs(lq, lk, 4, 2, head_dim, dtype),
        docs=attention_inputs(2, length, length, 4, 2, head_dim, dtype),
        ids=_document_ids([[length // 3, length - length // 3], [length]]),
    )


# https://github.com/Dao-AILab/flash-attention/issues/637 ("can it be invoked through multi-thread x multi-stream?")
# and https://github.com/huggingface/transformers/pull/48297 (process-global state changed by one thread corrupted the
# attention of a decode loop running in another thread, silently)
def test_calls_from_several_threads():
    """FlashAttention issue 637 and transformers PR 48297: a server or a trainer with a background generation thread
    calls attention from several host threads, each on its own stream. The library keeps host state between calls (the
    cache of checked argument sets, the notes on cu_seqlens and document_ids tensors released by weak-reference
    callbacks, per-device flags in C++). Four threads, started together, each run three steps of their own shapes and
    option sets (causal, window, softcap, deterministic): a dense GQA forward and backward, attention_varlen with
    cu_seqlens tensors made in the thread (checked on the host there), and packed documents with a fresh document_ids
    tensor. Those tensors are kept for the checks, so each step also repeats the varlen and documents calls on
    temporary copies (clones dropped as the call returns): their notes' weak-reference callbacks then fire in one
    thread while the others read and write the notes, and the freed memory is handed to the next tensors. No thread
    may raise; afterwards every result is checked by the rule, and the calls on the copies must give the kept calls'
    out and LSE bit for bit (the forward is bitwise repeatable), and their gradients too with the deterministic
    backward."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    n_threads, steps = 4, 3
    jobs = [[_thread_job(t, s, head_dim, dtype) for s in range(steps)] for t in range(n_threads)]
    torch.cuda.synchronize()
    results = [[] for _ in range(n_threads)]
    errors = []  # (exception, report), in the order they happened
    barrier = threading.Barrier(n_threads, timeout=60)

    def work(t):
        try:
            stream = torch.cuda.Stream()
            barrier.wait()
            with torch.cuda.stream(stream):
                for s, job in enumerate(jobs[t]):
                    opts = THREAD_OPTIONS[(t + s) % len(THREAD_OPTIONS)]
                    dense = _run_dense(*job["dense"], **opts)
                    cu_q, cu_k = cu_seqlens(job["lq"]), cu_seqlens(job["lk"])
                    max_q, max_k = max(job["lq"]), max(job["lk"])
                    var = _run_varlen(*job["var"], cu_q, cu_k, max_q, max_k, **opts)
                    var_tmp = _run_varlen(*job["var"], cu_q.clone(), cu_k.clone(), max_q, max_k, **opts)
                    ids = job["ids"].to(DEVICE)
                    docs = _run_dense(*job["docs"], causal=True, document_ids=ids)
                    docs_tmp = _run_dense(*job["docs"], causal=True, document_ids=ids.clone())
                    results[t].append((opts, dense, cu_q, cu_k, var, var_tmp, ids, docs, docs_tmp))
            stream.synchronize()
        except BaseException as e:  # reported below, with the thread's traceback
            errors.append((e, f"thread {t}:\n{traceback.format_exc()}"))
            barrier.abort()

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(n_threads)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 240  # one limit for all: a hung thread must not keep pytest from exiting
    for th in threads:
        th.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(th.is_alive() for th in threads), "a thread did not finish (deadlock?)"
    # Threads that only saw the barrier broken by another thread's abort are not the cause.
    causes = [report for e, report in errors if not isinstance(e, threading.BrokenBarrierError)]
    assert not errors, causes[0] if causes else errors[0][1]
    torch.cuda.synchronize()
    for t in range(n_threads):
        assert len(results[t]) == steps, f"thread {t} ran {len(results[t])} of {steps} steps"
        for s, (opts, dense, cu_q, cu_k, var, var_tmp, ids, docs, docs_tmp) in enumerate(results[t]):
            job, name, ref_opts = jobs[t][s], f"thread {t} step {s} {opts}", _reference_opts(opts)
            check_attention(*dense, *job["dense"], f"{name} dense", **ref_opts)
            check_attention_varlen(*var, *job["var"], cu_q, cu_k, f"{name} varlen", **ref_opts)
            check_attention_varlen(*var_tmp, *job["var"], cu_q, cu_k, f"{name} varlen, copied cu_seqlens", **ref_opts)
            check_attention(*docs, *job["docs"], f"{name} documents", causal=True, document_ids=ids)
            check_attention(*docs_tmp, *job["docs"], f"{name} documents, copied ids", causal=True, document_ids=ids)
            for what, got, kept, bwd_bitwise in (("varlen", var_tmp, var, opts.get("deterministic", False)),
                                                 ("documents", docs_tmp, docs, False)):
                pairs = [("out", got[0], kept[0]), ("lse", got[1], kept[1])]
                if bwd_bitwise:
                    pairs += list(zip(GRAD_NAMES, got[2], kept[2]))
                for part, a, b in pairs:
                    assert torch.equal(bits(a), bits(b)), f"{name} {what}: {part} on the copies differs from the kept"


# --------------------------------------------------------------------------------------------- aliased arguments


# https://github.com/facebookresearch/xformers/pull/456 (the backward detected q, k, v sharing one storage and
# switched to a packed-gradient path)
@pytest.mark.parametrize("alias", ["q_k_v", "k_v"])
def test_one_tensor_passed_as_several_inputs(alias):
    """xformers PR 456 gave the backward a special path when q, k and v alias one storage (slices of a packed
    projection), taken on a storage test. Here the aliasing is total: one tensor passed as q, k and v (self-attention
    without projections), or one tensor as both k and v (GQA 6/2, 203 queries over 300 keys). The gradients of the
    shared leaf are the sums over its roles (autograd adds the op's dQ, dK, dV), checked by the rule against the
    references differentiated through the same aliasing; out and LSE by the rule; the input unchanged."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    opts = dict(causal=True)
    if alias == "q_k_v":
        bases = (randn(2, 257, 4, head_dim, dtype=dtype),)

        def build(x):
            return x, x, x
    else:
        bases = (randn(2, 203, 6, head_dim, dtype=dtype), randn(2, 300, 2, head_dim, dtype=dtype))

        def build(q, kv):
            return q, kv, kv
    before = [b.clone() for b in bases]
    q_shape = build(*bases)[0].shape
    dout = randn(*q_shape, dtype=dtype)
    leaves = _leaves(*bases)
    e = dout.element_size()
    poison_allocator(dout.numel() * e, q_shape[0] * q_shape[2] * q_shape[1] * 4)
    out, lse = attention(*build(*leaves), return_lse=True, **opts)
    # One block per gradient the backward allocates (dQ, dK, dV: three of x's size for q_k_v), before autograd sums
    # them onto the shared leaf.
    poison_allocator(*(t.numel() * e for t in build(*bases)))
    grads = torch.autograd.grad(out, leaves, dout)
    ref, ref_lse = attention_ref(*build(*bases), upcast=True, **opts)
    naive, naive_lse = attention_ref(*build(*bases), upcast=False, **opts)
    assert_close_by_rule(out.detach(), ref, naive, f"{alias} out")
    assert_close_by_rule(lse.detach(), ref_lse, naive_lse, f"{alias} lse")
    ref_g = _ref_grads_through(build, bases, dout, upcast=True, **opts)
    naive_g = _ref_grads_through(build, bases, dout, upcast=False, **opts)
    for i, (g, b, r, n) in enumerate(zip(grads, bases, ref_g, naive_g)):
        assert g.shape == b.shape and g.dtype == dtype, f"{alias} grad {i}"
        assert_close_by_rule(g, r, n, f"{alias} grad of input {i}")
    for b, saved in zip(bases, before):
        assert torch.equal(b, saved), f"{alias}: an input was modified"


# ------------------------------------------------------------------------------------ torch.compile's fake kernels


# https://github.com/pytorch/pytorch/pull/119500 (the meta kernel of flash attention's backward gave dV other strides
# than the real kernel when k and v had different layouts) and https://github.com/pytorch/pytorch/pull/178499 (the same
# mismatch for a transposed value tensor)
@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_fake_kernels_give_the_real_output_strides(api):
    """PyTorch PRs 119500 and 178499: a fake (meta) kernel that allocates its outputs like the inputs (empty_like of a
    transposed v) while the real kernel returns contiguous ones makes torch.compile plan views and copies for strides
    the tensors do not have. The ops' fake kernels against the real ones with q, k, v, dO of different layouts: dense q
    contiguous, k a column slice of a wider tensor, v and dO transposed from SDPA's layout; varlen q and k split
    along the heads of one projection, v and dO head-major. Every output's shape, dtype and strides must match, forward
    and backward; then torch.library.opcheck on both ops with those inputs (schema, autograd registration, fake
    tensors, AOT dispatch with static and dynamic shapes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    head_dim = 64
    dtype = built_dtype(head_dim)
    scale = head_dim**-0.5
    options = (True, -1, 0, 0.0, False)  # causal, window_left, window_right, softcap, deterministic
    ops = torch.ops.flash_attn_hopper
    if api == "dense":
        q = randn(2, 113, 4, head_dim, dtype=dtype)
        k = randn(2, 203, 2, head_dim + 8, dtype=dtype)[..., :head_dim]
        v = randn(2, 2, 203, head_dim, dtype=dtype).transpose(1, 2)  # empty_like(v) would keep this order
        dout = randn(2, 4, 113, head_dim, dtype=dtype).transpose(1, 2)
        fwd, bwd, rest = ops.fwd.default, ops.bwd.default, (scale, *options)
    else:
        lengths = [77, 0, 130]
        packed = randn(sum(lengths), 4 + 2, head_dim, dtype=dtype)
        q, k = packed.split([4, 2], dim=1)
        v = randn(2, sum(lengths), head_dim, dtype=dtype).transpose(0, 1)
        dout = randn(4, sum(lengths), head_dim, dtype=dtype).transpose(0, 1)
        cu = cu_seqlens(lengths)
        fwd, bwd = ops.fwd_varlen.default, ops.bwd_varlen.default
        rest = (cu, cu, max(lengths), max(lengths), scale, *options)
    assert not (k.is_contiguous() or v.is_contiguous() or dout.is_contiguous()), "construction: strided inputs"

    def bwd_args(out, lse):  # both schemas: the backward's tensors, then what the forward took after q, k, v
        return (dout, q, k, v, out, lse, torch.randn_like(lse)) + rest

    fwd_args = (q, k, v) + rest
    real_fwd = fwd(*fwd_args)
    real_bwd = bwd(*bwd_args(*real_fwd))
    mode = FakeTensorMode()

    def fake(args):
        return tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)

    fake_fwd_args = fake(fwd_args)
    with mode:
        fake_fwd = fwd(*fake_fwd_args)
    fake_bwd_args = fake(bwd_args(*real_fwd))
    with mode:
        fake_bwd = bwd(*fake_bwd_args)
    for name, real, fake_t in zip(("out", "lse") + GRAD_NAMES, (*real_fwd, *real_bwd), (*fake_fwd, *fake_bwd)):
        assert (tuple(fake_t.shape), fake_t.stride(), fake_t.dtype) == (tuple(real.shape), real.stride(), real.dtype), (
            f"{api} {name}: fake kernel gives shape {tuple(fake_t.shape)} strides {fake_t.stride()} {fake_t.dtype}, "
            f"the real one {tuple(real.shape)} {real.stride()} {real.dtype}"
        )

    grad_inputs = tuple(t.detach().requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(fwd, grad_inputs + rest)
    torch.library.opcheck(bwd, bwd_args(*real_fwd))


# ------------------------------------------------------------------------------------------- autograd machinery


# https://github.com/pytorch/pytorch/issues/1288 (a second backward through a freed graph segfaulted in conv2d instead
# of raising "Trying to backward through the graph a second time")
@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_second_backward_through_a_freed_graph_raises(api):
    """PyTorch issue 1288: the saved tensors of a graph are freed by its first backward (without retain_graph); a
    second backward must raise autograd's RuntimeError, not read freed memory or crash. Dense and varlen, GQA, causal:
    the first backward is right by the rule, the second (through out, and through LSE) raises, the device has no
    sticky error afterwards, and a new call on the same inputs is right by the rule."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    if api == "dense":
        q, k, v, dout = attention_inputs(2, 203, 300, 4, 2, head_dim, dtype)
    else:
        lq, lk = [203, 0, 77], [300, 40, 77]
        q, k, v, dout = _varlen_inputs(lq, lk, 4, 2, head_dim, dtype)
        cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)

    def forward(leaves):
        if api == "dense":
            return attention(*leaves, causal=True, return_lse=True)
        return attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)

    def check(out, lse, grads, name):
        if api == "dense":
            check_attention(out, lse, grads, q, k, v, dout, name, causal=True)
        else:
            check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, name, causal=True)

    leaves = _leaves(q, k, v)
    out, lse = forward(leaves)
    grads = torch.autograd.grad(out, leaves, dout)
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(out, leaves, dout)
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(lse, leaves, torch.ones_like(lse))
    torch.cuda.synchronize()  # a kernel that ran on freed buffers would leave a sticky error here
    check(out.detach(), lse.detach(), grads, f"{api} first backward")
    leaves = _leaves(q, k, v)
    out, lse = forward(leaves)
    check(out.detach(), lse.detach(), torch.autograd.grad(out, leaves, dout), f"{api} new call")


# ---------------------------------------------------------------------------------------------------- numerics


BF16_LOSS_SCALE = 2.0**16  # GradScaler's initial scale
FP16_DP_PEAK = 6e4  # the largest |dO Vᵀ| the fp16 case aims for: just below fp16's 65504


def _fp16_loss_scale(dout, v):
    """(s, peak): the power of two s for which max |s dO Vᵀ| over all (also masked) query-key pairs, computed in
    float32 with K/V heads repeated, lies in (FP16_DP_PEAK / 2, FP16_DP_PEAK]; peak is that scaled maximum."""
    dp = torch.einsum("bqhd,bkhd->bhqk", dout.float(), repeat_kv(v.float(), dout.shape[2]))
    raw = dp.abs().max().item()
    s = 2.0 ** math.floor(math.log2(FP16_DP_PEAK / raw))
    return s, s * raw


# https://github.com/Dao-AILab/flash-attention/issues/41 (NaN from the backward in mixed-precision training while the
# parameters stayed finite) and https://github.com/pytorch/pytorch/issues/125674 (NaN gradients from an SDPA backend)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_loss_scaled_output_gradients(dtype):
    """FlashAttention issue 41 and PyTorch issue 125674: NaN gradients out of an attention backward in mixed-precision
    training. A GradScaler multiplies the loss, so dO and dLSE arrive scaled by a power of two. fp16: the scale is
    chosen from the inputs so that max |dO Vᵀ| lands between 3e4 and 6e4. The naive fp16 reference keeps dP = dO Vᵀ
    as an fp16 tensor and must stay finite for the rule, so the scale cannot go higher. What this catches is a kernel
    that holds dP or dS in fp16 at a larger magnitude than the reference's dP (pre-multiplied by a constant such as
    log2(e) or the inverse softmax scale): any factor above 65504 / 3e4 ≈ 2.2 overflows, smaller ones when the peak
    lies near 6e4. A kernel that keeps dP in fp16 as it is, like the reference, is not caught. bf16: 2^16,
    GradScaler's initial scale; bf16 has fp32's range, so nothing comes near overflow there and the case is a
    scale-equivariance check (the gradients must scale with dO and dLSE as the reference's do). GQA 4/2, causal,
    203 x 300, a loss through out and LSE: every gradient finite and by the rule."""
    head_dim = 128
    require_built(head_dim, dtype)
    q, k, v, dout = attention_inputs(2, 203, 300, 4, 2, head_dim, dtype)
    if dtype == torch.float16:
        loss_scale, peak = _fp16_loss_scale(dout, v)
        assert 3e4 <= peak <= FP16_DP_PEAK < 65504, f"construction: max |dO Vᵀ| {peak:.3e} after the scale"
    else:
        loss_scale = BF16_LOSS_SCALE
    dout = dout * loss_scale  # exact: a power of two, and no value overflows
    assert torch.isfinite(dout).all(), "construction: the scaled dO must be finite"
    dlse = torch.randn(2, 4, 203, device=DEVICE) * loss_scale
    out, lse, grads = run_attention(q, k, v, dout, dlse=dlse, causal=True)
    for gname, g in zip(GRAD_NAMES, grads):
        assert torch.isfinite(g).all(), f"{gname} overflowed at loss scale {loss_scale}"
    check_attention(out, lse, grads, q, k, v, dout, f"loss scale {loss_scale}", dlse=dlse, causal=True)


# https://github.com/philipturner/metal-flash-attention/issues/8 (Q Kᵀ formed in half precision overflowed before the
# softmax scale was applied: NaN) and https://github.com/ultralytics/ultralytics/pull/24990 (the unscaled Q Kᵀ
# exceeded fp16's 65504 under AMP)
def test_unscaled_scores_beyond_fp16_range():
    """Metal flash attention issue 8 and ultralytics PR 24990: q and k of large magnitude (40 times standard normal,
    as in the SSD-1B activations of the report) with a softmax_scale small enough (1 / (1600 sqrt(head_dim))) that the
    scaled scores are of order 1, while the unscaled Q Kᵀ reaches about 9e4, past fp16's largest value 65504. A kernel
    that forms Q Kᵀ (or the running max) in fp16 before the scale turns it into inf and NaN; the GEMM's float32
    accumulator must hold it. fp16 only, GQA 4/2, causal, forward and backward by the rule. The naive reference is the
    same fp16 computation with the exact factor 2^-2 moved from the scale onto q (q / 4 is exact in fp16, and so is
    every product after it), which keeps its fp16 Q Kᵀ in range; run as written, it is not finite."""
    head_dim = 128
    dtype = torch.float16
    require_built(head_dim, dtype)
    q, k, v, dout = attention_inputs(2, 203, 300, 4, 2, head_dim, dtype)
    q = (q.float() * 40).to(dtype)
    k = (k.float() * 40).to(dtype)
    scale = 1.0 / (1600 * math.sqrt(head_dim))
    opts = dict(causal=True)
    raw = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(2, dim=2))
    assert raw.abs().max().item() > 65504, "construction: the unscaled scores must exceed fp16's range"
    plain_naive, plain_naive_lse = attention_ref(q, k, v, softmax_scale=scale, upcast=False, **opts)
    assert not (torch.isfinite(plain_naive).all() and torch.isfinite(plain_naive_lse).all()), (
        "construction: the fp16 reference as written must overflow")

    def moved(q, k, v):
        return q * 0.25, k, v

    out, lse, grads = run_attention(q, k, v, dout, softmax_scale=scale, **opts)
    ref, ref_lse = attention_ref(q, k, v, softmax_scale=scale, upcast=True, **opts)
    naive, naive_lse = attention_ref(*moved(q, k, v), softmax_scale=4 * scale, upcast=False, **opts)
    assert torch.isfinite(naive).all(), "the naive reference must be finite"
    assert_close_by_rule(out, ref, naive, "out")
    assert_close_by_rule(lse, ref_lse, naive_lse, "lse")
    ref_g = attention_ref_grads(q, k, v, dout, softmax_scale=scale, **opts)
    naive_g = _ref_grads_through(moved, (q, k, v), dout, upcast=False, softmax_scale=4 * scale, **opts)
    for gname, g, r, n in zip(GRAD_NAMES, grads, ref_g, naive_g):
        assert torch.isfinite(n).all(), f"{gname}: the naive reference is not finite"
        assert_close_by_rule(g, r, n, gname)


SOFTCAP_MASKS = [dict(causal=True), dict(window_size=(32, 8))]


# https://github.com/Dao-AILab/flash-attention/pull/1025 (softcap has to come before the mask: "if softcap value is
# small (e.g. 1.0), this can lead to information leakage from future tokens")
@pytest.mark.parametrize("cap", [0.1, 1000.0], ids=["cap0.1", "cap1000"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softcap_far_below_or_far_above_the_scores(dtype, cap):
    """FlashAttention PR 1025: a masked score that goes through the cap (or is masked with a finite value first)
    becomes -cap instead of -inf, which is harmless at a cap of 50 and a leak at a small one; the existing softcap
    tests use caps of 1 to 50 without such a mask or on scores where a leak weighs e^-30. Cap 0.1: every capped score
    lies in [-0.1, 0.1] (bf16 takes the fixed-maximum path there), so a leaked key weighs as much as a visible one;
    the values of the last 20 keys carry +20, which the rows that must not see them would show. Cap 1000: the scores,
    of order 1, are far below it, so tanh runs on arguments near 1e-3, where an approximation whose error were 2^-11
    in absolute rather than relative terms would move the scores by about half a unit (1000, not more: the naive fp16
    backward multiplies dS by the cap, and at 1e4 it overflows). Bottom-right causal and a window (32, 8), 300
    queries over 200 keys (the first rows see no key: output and dQ exactly 0), GQA 6/2, forward and backward by
    the rule."""
    head_dim = 128
    require_built(head_dim, dtype)
    for mask in SOFTCAP_MASKS:
        opts = dict(mask, softcap=cap)
        q, k, v, dout = attention_inputs(2, 300, 200, 6, 2, head_dim, dtype)
        if cap < 1:  # not at 1000, where dP would grow 20-fold and the naive fp16 dS times the cap overflow (a key
            v[:, -20:] += 20.0  # leaked there shows in the rows that see no key)
        out, lse, grads = run_attention(q, k, v, dout, **opts)
        name = f"softcap {cap} {mask}"
        check_attention(out, lse, grads, q, k, v, dout, name, **opts)
        empty = _assert_blind_rows_zero(out, lse, grads[0], name)
        assert empty.any() and not empty.all(), f"{name}: construction must leave some rows without keys"


# ------------------------------------------------------------------------------------------ variable length


# https://github.com/pytorch/pytorch/pull/194818 (cuDNN's varlen attention: q/k/v whose base or row stride was not
# 16-byte aligned gave silently wrong results or a misaligned-address fault, a padded grad_out crashed the backward)
@pytest.mark.parametrize("layout", ["base_offset", "odd_strides"])
def test_varlen_misaligned_inputs_and_dout(layout):
    """PyTorch PR 194818 (found by fuzzing the varlen API): attention_varlen with q, k, v and dO whose base address is
    2, 6, 10 and 14 bytes past a 16-byte boundary, or whose head and row strides (head_dim + 1 elements) are not
    multiples of 16 bytes (a padded buffer); test_fwd_gpu's unaligned views are dense only. Each tensor lies in a
    NaN-filled buffer (the extra column, or elements around it): a read outside the tensor shows as NaN, a write as a
    changed buffer. GQA 6/2, causal, sequences with no keys and no queries; forward and backward by the rule."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    lq, lk = [300, 0, 129, 1, 77], [257, 33, 129, 9, 0]
    q, k, v, dout = _varlen_inputs(lq, lk, 6, 2, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    placed = []
    for t, before in zip((q, k, v, dout), (1, 3, 5, 7)):
        if layout == "base_offset":
            buf, view = in_canary_buffer(t, before, after=64)
            assert view.data_ptr() % 16 != 0, "construction: a base address off the 16-byte grid"
        else:
            buf = torch.full((*t.shape[:-1], head_dim + 1), float("nan"), dtype=dtype, device=DEVICE)
            view = buf[..., :head_dim]
            view.copy_(t)
            assert (view.stride(1) * view.element_size()) % 16 != 0, "construction: a head stride off the 16-byte grid"
        placed.append((buf, view))
    saved = [bits(buf) for buf, _ in placed]
    out, lse, grads = _varlen_run(*(view for _, view in placed), cu_q, cu_k, max(lq), max(lk), causal=True)
    torch.cuda.synchronize()
    for (buf, _), before_bits in zip(placed, saved):
        assert torch.equal(bits(buf), before_bits), f"{layout}: a buffer around an input changed"
    assert torch.isfinite(out).all() and not torch.isnan(lse).any(), f"{layout}: NaN read from outside a tensor"
    for gname, g in zip(GRAD_NAMES, grads):
        assert torch.isfinite(g).all(), f"{layout}: {gname} read NaN from outside a tensor"
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, f"misaligned {layout}", causal=True)


def _cu_seqlens_in_poisoned_buffer(lengths, before, after):
    """(buffer, view): int32 cu_seqlens of `lengths` at element `before` of a buffer whose other entries are -2^30
    (ahead) and 2^30 (behind): offsets no kernel reading one entry too far can use without faulting or writing NaN."""
    values = cu_seqlens(lengths)
    buf = torch.empty(before + values.numel() + after, dtype=torch.int32, device=DEVICE)
    buf[:before] = -(2**30)
    buf[before + values.numel():] = 2**30
    view = buf[before:before + values.numel()]
    view.copy_(values)
    return buf, view


# https://github.com/vllm-project/flash-attention/pull/80 ("fix potential reading off the edge of the cu_seqlens_q
# buffer") and https://github.com/Dao-AILab/flash-attention/pull/2333 (wasted tiles of the varlen scheduler read
# cu_seqlens[num_batch + 1]: illegal address)
def test_cu_seqlens_views_inside_a_poisoned_buffer():
    """vLLM's flash-attention PR 80 and FlashAttention PR 2333: the varlen scheduler's spare tiles read one entry
    past cu_seqlens, which a caller's buffer (vLLM's query_start_loc, sliced per step) does not hold or holds other
    values at. Here cu_seqlens_q and cu_seqlens_k are views 3 and 1 entries into int32 buffers (12 and 4 bytes: off
    the 16-byte grid) whose other entries are -2^30 and 2^30, with rows past the last sequence in q and k. Forward and
    backward by the rule and the buffers unchanged; then new boundaries are written through the buffers (the views
    share their version counter, so the host check must read them again) and the deterministic backward runs on them,
    by the rule."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    lq, lk = [130, 0, 77, 200], [100, 40, 77, 256]
    q, k, v, dout = _varlen_inputs(lq + [13], lk + [5], 4, 2, head_dim, dtype)  # 13 and 5 rows past the sequences
    buf_q, cu_q = _cu_seqlens_in_poisoned_buffer(lq, before=3, after=5)
    buf_k, cu_k = _cu_seqlens_in_poisoned_buffer(lk, before=1, after=7)
    assert cu_q.data_ptr() % 16 != 0 and cu_k.data_ptr() % 16 != 0 and cu_q.is_contiguous() and cu_k.is_contiguous()
    saved = (buf_q.clone(), buf_k.clone())
    out, lse, grads = _varlen_run(q, k, v, dout, cu_q, cu_k, max(lq), max(lk), causal=True)
    torch.cuda.synchronize()
    assert torch.equal(buf_q, saved[0]) and torch.equal(buf_k, saved[1]), "a cu_seqlens buffer was written"
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, "poisoned buffer", causal=True)

    lq2, lk2 = [77, 200, 0, 130], [77, 256, 40, 100]  # the same totals: the rows past the sequences stay
    buf_q[3:3 + len(lq2) + 1] = cu_seqlens(lq2)
    buf_k[1:1 + len(lk2) + 1] = cu_seqlens(lk2)
    assert cu_q.tolist() == cu_seqlens(lq2).tolist() and cu_k.tolist() == cu_seqlens(lk2).tolist()
    saved = (buf_q.clone(), buf_k.clone())
    out, lse, grads = _varlen_run(q, k, v, dout, cu_q, cu_k, max(lq2), max(lk2), causal=True, deterministic=True)
    torch.cuda.synchronize()
    assert torch.equal(buf_q, saved[0]) and torch.equal(buf_k, saved[1]), "a cu_seqlens buffer was written"
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, "boundaries written through the buffer",
                           causal=True)


# ------------------------------------------------------------------------------------------- forward-mode AD


# https://github.com/Dao-AILab/flash-attention/issues/1672 (JVP for consistency models),
# https://github.com/facebookresearch/xformers/issues/552 (JVPs through xformers' flash attention) and
# https://github.com/pytorch/pytorch/issues/165530 (torch.func.jvp through flash attention)
@pytest.mark.parametrize("how", ["forward_ad", "torch_func_jvp"])
def test_forward_mode_ad_is_refused_or_right(how):
    """FlashAttention issue 1672, xformers issue 552, PyTorch issue 165530: consistency-model training (sCM) and
    Jacobian-vector products push tangents through attention. A kernel without a forward-mode formula must refuse
    with an error that says so; returning the primal with no tangent silently drops the derivative (torch.func.jvp
    then hands back zeros as the tangent). Dual tensors (torch.autograd.forward_ad) and torch.func.jvp, tangents on q,
    k and v, GQA 4/2, causal: either a RuntimeError / NotImplementedError naming jvp, forward-mode AD or functorch's
    transforms (after which a plain call still works, by the rule), or a tangent that is right by the rule against the
    float32 reference's JVP. Never the library's own launch error, which is not a refusal.

    The library's autograd Function is a C++ torch::autograd::Function, so as long as it is, both refusals are
    torch's: dual tensors reach its jvp stub ("jvp is not implemented for the c++ API of custom Function yet", read
    in torch 2.11's torch/csrc/autograd/custom_function.h), and torch.func.jvp refuses any C++ Function before it
    runs ("cannot use C++ torch::autograd::Function with functorch transforms", seen on the H200 with torch 2.11).
    The torch_func_jvp case thus checks torch's refusal, not the library's; both cases guard against a change of the
    autograd registration that would let a tangent drop."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    q, k, v, dout = attention_inputs(2, 130, 150, 4, 2, head_dim, dtype)
    tangents = tuple(randn(*t.shape, dtype=dtype) for t in (q, k, v))
    opts = dict(causal=True)

    def f(q, k, v):
        return attention(q, k, v, **opts)

    try:
        if how == "forward_ad":
            import torch.autograd.forward_ad as fwAD

            with fwAD.dual_level():
                out = f(*(fwAD.make_dual(t, d) for t, d in zip((q, k, v), tangents)))
                tangent = fwAD.unpack_dual(out).tangent
        else:
            _, tangent = torch.func.jvp(f, (q, k, v), tangents)
    except (RuntimeError, NotImplementedError) as e:
        message = str(e).lower()
        # A kernel that failed is no refusal ("flash_attn_hopper forward launch failed" also names the forward).
        assert "launch failed" not in message, f"{how}: the kernel failed instead of refusing: {e}"
        # The messages of the docstring; "forward" alone would also match the launch error.
        said_why = any(w in message for w in ("jvp", "forward-mode", "forward mode", "functorch transforms"))
        assert said_why, f"{how}: forward-mode AD refused without saying why: {e}"
        out, lse, grads = run_attention(q, k, v, dout, **opts)
        check_attention(out, lse, grads, q, k, v, dout, f"{how}: a plain call after the refusal", **opts)
        return
    assert tangent is not None, f"{how}: no tangent came out: the derivative was dropped"

    def ref_fn(upcast):
        return lambda q, k, v: attention_ref(q, k, v, upcast=upcast, **opts)[0]

    _, ref = torch.func.jvp(ref_fn(True), tuple(t.float() for t in (q, k, v)), tuple(t.float() for t in tangents))
    _, naive = torch.func.jvp(ref_fn(False), (q, k, v), tangents)
    assert_close_by_rule(tangent, ref, naive, f"{how} tangent")


# ------------------------------------------------------------------------------------------------ torch.compile


class _LinearAttentionBlock(torch.nn.Module):
    """A QKV projection, attention (causal, GQA 4/2) and an output projection."""

    def __init__(self, hidden, nheads, nheads_k, head_dim, dtype):
        super().__init__()
        self.shape = (nheads, nheads_k, head_dim)
        self.qkv = torch.nn.Linear(hidden, (nheads + 2 * nheads_k) * head_dim, device=DEVICE, dtype=dtype)
        self.proj = torch.nn.Linear(nheads * head_dim, hidden, device=DEVICE, dtype=dtype)

    def forward(self, x, attn):
        nheads, nheads_k, head_dim = self.shape
        batch, seqlen, _ = x.shape
        qkv = self.qkv(x).view(batch, seqlen, nheads + 2 * nheads_k, head_dim)
        q, k, v = qkv.split([nheads, nheads_k, nheads_k], dim=2)
        return self.proj(attn(q, k, v).reshape(batch, seqlen, nheads * head_dim))


def _block_step(block, x, attn, weight):
    """y, dx, dW_qkv of one forward and backward of block on a fresh copy of x (loss: y weighted along hidden)."""
    block.zero_grad(set_to_none=True)
    xx = x.detach().clone().requires_grad_(True)
    y = block(xx, attn)
    (y.float() * weight).sum().backward()
    return y.detach().clone(), xx.grad.clone(), block.qkv.weight.grad.clone()


# https://github.com/pytorch/pytorch/issues/157363 (a custom CUDA op after an nn.Linear changed its results under
# torch.compile(mode="reduce-overhead") for large inputs, silently) and
# https://github.com/thu-ml/SageAttention/issues/74 (a compiled attention op returning noisy outputs under CUDA graphs)
def test_compiled_cuda_graph_trees_with_a_linear_layer():
    """PyTorch issue 157363 and SageAttention issue 74: under torch.compile with CUDA graphs (cudagraph trees, as
    mode="reduce-overhead" uses them), a custom op's kernels are captured on a side stream into a private memory pool
    after a warm-up run and then replayed; an op that launches on another stream, keeps a pointer from the capture or
    allocates outside the pool gives wrong results on replay. A Linear - attention - Linear block (2 x 1024 tokens,
    GQA 4/2, causal) compiled with backend="cudagraphs" (the cudagraph trees, without Inductor's codegen), four steps
    of forward and backward on fresh inputs (warm-up, record, two replays), each step's output, dx and dW_qkv by the
    rule against the float32 block with the reference attention; no part of the graph may be left out of the capture."""
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    head_dim = 128
    dtype = built_dtype(head_dim)
    nheads, nheads_k, hidden = 4, 2, 256
    block = _LinearAttentionBlock(hidden, nheads, nheads_k, head_dim, dtype)
    xs = [torch.randn(2, 1024, hidden, device=DEVICE, dtype=dtype) for _ in range(4)]
    weight = torch.linspace(-1, 1, hidden, device=DEVICE)

    def kernel_attn(q, k, v):
        return attention(q, k, v, causal=True)

    def ref_attn(upcast):
        return lambda q, k, v: attention_ref(q, k, v, causal=True, upcast=upcast)[0].to(q.dtype)

    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = torch.compile(block, backend="cudagraphs", fullgraph=True)
        steps = []
        for x in xs:
            torch.compiler.cudagraph_mark_step_begin()
            steps.append(_block_step(compiled, x, kernel_attn, weight))  # clones: the next replay reuses the pool
        torch.cuda.synchronize()
        block.zero_grad(set_to_none=True)  # drop the .grad tensors that live in the graphs' memory pool
        del compiled
        assert counters["inductor"]["cudagraph_skips"] == 0, "cudagraphs skipped part of the graph"
    finally:
        torch._dynamo.reset()
        reset_cudagraph_trees()
    ref_block = copy.deepcopy(block).float()
    for i, (x, got) in enumerate(zip(xs, steps)):
        ref = _block_step(ref_block, x.float(), ref_attn(True), weight)
        naive = _block_step(block, x, ref_attn(False), weight)
        for part, a, r, n in zip(("y", "dx", "dW_qkv"), got, ref, naive):
            assert_close_by_rule(a.float(), r.float(), n.float(), f"step {i} {part}")


# ------------------------------------------------------------------------------------------- host synchronisation


# https://github.com/Dao-AILab/flash-attention/issues/1664 (seqlens.max().item() before every varlen call: a
# cudaStreamSynchronize in every step's timeline) and https://github.com/ecmwf/WeatherGenerator/issues/1531 (a max
# inside the attention forward synchronised the host and kept the module from being compiled)
def test_no_host_synchronisation():
    """FlashAttention issue 1664 and WeatherGenerator issue 1531: a hidden device-to-host read in an attention call
    stalls the CPU every layer and breaks CUDA graph capture. DESIGN.md §2: the kernels do no host synchronisation;
    attention_varlen reads a cu_seqlens tensor on the host once per tensor and version (README), so its tensors are
    checked once beforehand. Under torch.cuda.set_sync_debug_mode("error"), which raises on any synchronising PyTorch
    call: dense forward and backward through out and LSE (GQA, causal; window with softcap; the deterministic
    backward), packed documents with a fresh document_ids tensor (its bounds computed on the device), and varlen
    forward and backward. Nothing may raise; every result is checked by the rule afterwards."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    q, k, v, dout = attention_inputs(2, 203, 300, 4, 2, head_dim, dtype)
    dlse = torch.randn(2, 4, 203, device=DEVICE)
    qd, kd, vd, doutd = attention_inputs(2, 256, 256, 4, 2, head_dim, dtype)
    ids = _document_ids([[100, 156], [30, 200, 26]]).to(DEVICE)
    lq, lk = [203, 0, 77, 1], [300, 40, 77, 9]
    qv, kv, vv, doutv = _varlen_inputs(lq, lk, 4, 2, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    attention_varlen(qv, kv, vv, cu_q, cu_k, max(lq), max(lk), causal=True)  # their one host check
    cases = [dict(causal=True), dict(window_size=(64, 16), softcap=20.0), dict(causal=True, deterministic=True)]
    torch.cuda.synchronize()
    dense, docs, var = [], None, None
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for opts in cases:
            leaves = _leaves(q, k, v)
            out, lse = attention(*leaves, return_lse=True, **opts)
            dense.append((out.detach(), lse.detach(), torch.autograd.grad([out, lse], leaves, [dout, dlse])))
        docs = _run_dense(qd, kd, vd, doutd, causal=True, document_ids=ids)
        var = _run_varlen(qv, kv, vv, doutv, cu_q, cu_k, max(lq), max(lk), causal=True)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    for opts, result in zip(cases, dense):
        check_attention(*result, q, k, v, dout, f"no sync {opts}", dlse=dlse, **_reference_opts(opts))
    check_attention(*docs, qd, kd, vd, doutd, "no sync documents", causal=True, document_ids=ids)
    check_attention_varlen(*var, qv, kv, vv, doutv, cu_q, cu_k, "no sync varlen", causal=True)
