"""Thirty-seventh round of the bug hunt (tests/bug_report_sources.md, "Thirty-seventh round"), GPU part.

GQ: an allocation that fails inside a call, then the retry. Training loops and batch-size finders catch
torch.OutOfMemoryError, free memory and run the step again (pytorch/pytorch#33056: the OOM error made a type so that
code can recover from it "to pick a different algorithm"; pytorch/pytorch#18853: recovery from CUDA OOMs
inconsistent, autograd left holding memory). A library that allocates outside PyTorch's caching allocator raises a
generic CUDA error, or leaves a sticky one (NVIDIA/cuopt#483: after a library's failed allocation "a sticky cuda
error on any successive CUDA API call"); one whose backward changes its saved tensors (the LSE to log2, say) before
the allocation that fails gives wrong gradients when the same graph is differentiated again; one that keeps what it
allocated before the failure leaks it (mlverse/tabnet#28, kreshuklab/panseg#268: memory not freed after an OOM).
Earlier rounds never ran a call out of memory. Here the caching allocator is capped
(torch.cuda.set_per_process_memory_fraction) at what it holds plus nothing (the first allocation of the call fails)
or plus dQ, dK and dV (the backward's fp32 workspace, allocated after them in csrc/api/flash_api.cpp, fails), in the
forward or the backward, dense (GQA, causal, a loss on out and LSE), varlen (a window, rows that see no key) and packed
documents, deterministic or not. Checked: the error is torch.OutOfMemoryError; afterwards the device synchronises (no
sticky error) and no more than 1 MiB is left allocated; with the cap lifted the same graph's backward (or a fresh
call) is right by the rule, and in the deterministic mode bitwise a fresh call's.

GR: saved tensors restored in another layout or alignment than the forward's. Activation offloading goes through
torch.autograd.graph.saved_tensors_hooks: the op's saved q, k, v, out and LSE are copied to the host after the forward
and copied back for the backward, in the offloader's layout, not necessarily the forward's:
pytorch/pytorch#186396 (PyTorch's activation offloading reloaded every tensor contiguous, "losing the original
layout" of transposed activations), Dao-AILab/flash-attention#2777 (a backward that derived its buffers from the
layout of the saved inputs failed for strided ones). Class G offloaded contiguous tensors and got them back
contiguous. Here four restorations: contiguous (the forward took strided views: q sequence-first or a slice of a
padded buffer, k and v from one K/V projection), rows padded by 8 NaN columns, head-major storage (q as a transposed
(batch, nheads, seqlen, head_dim) buffer), and every tensor (LSE, cu_seqlens and document bounds too) at an element
offset of 1 in a NaN / INT_MAX-filled arena (2- or 4-byte aligned, not 16), over dense GQA causal with a loss on the
LSE (deterministic), varlen with a window and empty sequences, and documents at head_dim 96 with softcap. Checked:
the hooks saw the op's tensors and handed back other strides or addresses (the premise), and out, LSE, dQ, dK, dV by
the rule. The documents arena case failed on its first GPU run ("misaligned address": the kernels read each
position's bounds as one 8-byte load); the ops now copy such bounds, and the direct op calls below pass bounds 4
bytes off to the fwd and bwd ops (bitwise the results of aligned bounds).

GS: the allocator configurations PyTorch offers besides its default, each in a fresh process
(PYTORCH_ALLOC_CONF is read once, at CUDA initialisation): expandable_segments:True (which the OOM message itself
recommends; pages mapped and unmapped as segments grow and shrink) and backend:cudaMallocAsync (CUDA's stream-ordered
pool). Reports: pytorch/pytorch#187343 (an attention model crashed with an illegal address only with
expandable_segments), ROCm/legacy-rocm-build#6603 (a live allocation read back as zeros only with
expandable_segments), thu-ml/SageAttention#333 and pytorch/pytorch#158641 (an attention path failing under
cudaMallocAsync), pytorch/pytorch#104925 (record_stream semantics differ under cudaMallocAsync). Every earlier GPU
test ran the native allocator. The child checks that the configuration is in force, then runs a dense GQA
deterministic forward and backward with a loss on the LSE at a small and a large size, releases the cache (expandable
segments unmap), runs the small one again and on a side stream (bitwise the first run: the same call), and varlen /
documents problems at two sizes; everything by the rule.

Inputs are Gaussian from the per-test seed (tests/conftest.py). Skipped, with the reason, without an sm90 GPU and the
built extension (conftest.py), per test when the build lacks a head_dim / dtype, and (GQ) without the free memory
its references need. tests/test_bug_reports_thirtyseventh_cpu.py checks the premises."""

import contextlib
import gc
import os

import pytest
import torch

import flash_attn_hopper
import gpu_helpers
from gpu_helpers import (GRAD_NAMES, assert_same_bits, check_attention, check_attention_varlen, cu_seqlens, randn,
                         require_built, run_attention, run_attention_varlen)

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MiB = 2**20


class Problem:
    """q, k, v, dout, dlse and the options of one call; varlen: cu_q, cu_k, max_q, max_k too."""

    def __init__(self, q, k, v, dout, dlse, opts, varlen=None):
        self.q, self.k, self.v, self.dout, self.dlse, self.opts = q, k, v, dout, dlse, opts
        self.varlen = varlen  # (cu_q, cu_k, max_q, max_k) or None

    def call(self, leaves, **opts):
        """(out, lse) of the library on leaves (q, k, v)."""
        if self.varlen is None:
            return flash_attn_hopper.attention(*leaves, return_lse=True, **opts)
        return flash_attn_hopper.attention_varlen(*leaves, *self.varlen, return_lse=True, **opts)

    def run(self, **opts):
        """(out, lse, grads): forward and backward from NaN-poisoned memory (gpu_helpers)."""
        if self.varlen is None:
            return run_attention(self.q, self.k, self.v, self.dout, dlse=self.dlse, **opts)
        return run_attention_varlen(self.q, self.k, self.v, self.dout, *self.varlen, dlse=self.dlse, **opts)

    def check(self, out, lse, grads, name, **opts):
        """out, LSE, dQ, dK, dV by the rule against the float32 reference (with this problem's dLSE)."""
        if self.varlen is None:
            check_attention(out, lse, grads, self.q, self.k, self.v, self.dout, name, dlse=self.dlse, **opts)
        else:
            check_attention_varlen(out, lse, grads, self.q, self.k, self.v, self.dout, *self.varlen[:2], name,
                                   dlse=self.dlse, **opts)


def lse_like(q):
    """A random float32 dLSE of the LSE's shape: (batch, nheads, seqlen_q), varlen (nheads, total_q)."""
    shape = (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0])
    return randn(*shape, dtype=torch.float32)


def document_ids(lengths_per_row):
    """(batch, seqlen) int64 ids on DEVICE: row b holds documents of the given lengths, numbered from 0."""
    rows = [torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)) for lens in lengths_per_row]
    return torch.stack(rows).to(DEVICE)


def synchronize():
    torch.cuda.synchronize(DEVICE)


def allocated():
    """Bytes the caching allocator has handed out and not had back (after the device finished)."""
    synchronize()
    return torch.cuda.memory_allocated(DEVICE)


def require_free(nbytes, name):
    """Skip unless nbytes of device memory are free (the float32 references of the large cases need it)."""
    free, _ = torch.cuda.mem_get_info(DEVICE)
    if free < nbytes:
        pytest.skip(f"{name}: needs {nbytes / 2**30:.0f} GiB of free device memory, {free / 2**30:.1f} GiB free")


# ------------------------------------------------------------------ GQ: out of memory inside a call, then the retry

GQ_SLACK = 2 * MiB  # the "workspace" cap's room above dQ, dK, dV: one small-pool segment (2 MiB)
GQ_KEPT = 1 * MiB  # what a failed call may leave allocated: the Python layer's notes (document bounds, cu_seqlens)
GQ_FREE_BYTES = 24 * 2**30  # float32 references of 2 x 16 x 2048 x 4096 scores with their autograd graphs
GQ_CASES = {
    "dense-forward-fp16": ("dense", "fp16", "forward", False),
    "dense-forward-bf16": ("dense", "bf16", "forward", False),
    "dense-backward-first-fp16": ("dense", "fp16", "backward-first", False),
    "dense-backward-first-bf16-det": ("dense", "bf16", "backward-first", True),
    "dense-backward-workspace-fp16-det": ("dense", "fp16", "backward-workspace", True),
    "dense-backward-workspace-bf16": ("dense", "bf16", "backward-workspace", False),
    "varlen-forward-bf16": ("varlen", "bf16", "forward", False),
    "varlen-backward-first-fp16": ("varlen", "fp16", "backward-first", False),
    "varlen-backward-workspace-bf16-det": ("varlen", "bf16", "backward-workspace", True),
    "documents-forward-fp16": ("documents", "fp16", "forward", False),
    "documents-backward-workspace-bf16": ("documents", "bf16", "backward-workspace", False),
}
GQ_DENSE = (2, 2048, 4096, 16, 8)  # batch, seqlen_q, seqlen_k, nheads, nheads_k
GQ_DOCUMENTS = (2, 2048, 16, [(500, 1452, 96), (2048,)])  # batch, seqlen, nheads (= nheads_k), documents per row
GQ_VARLEN_Q, GQ_VARLEN_K, GQ_VARLEN_HEADS = (2000, 0, 2096), (1500, 600, 1996), 16
GQ_WINDOW = (700, 0)


def gq_problem(kind, dtype):
    """Head_dim 128; every one of q, k, v, dout is a multiple of 2 MiB and at least 10 MiB, so the caching allocator
    gives each its own segment of exactly its size (blocks from 10 MiB up are rounded to 2 MiB) and the caps below
    fall where the comments say."""
    if kind == "dense":  # GQA 16 / 8, bottom-right causal 2048 x 4096
        batch, seqlen_q, seqlen_k, nheads, nheads_k = GQ_DENSE
        q, dout = (randn(batch, seqlen_q, nheads, 128, dtype=dtype) for _ in range(2))
        k, v = (randn(batch, seqlen_k, nheads_k, 128, dtype=dtype) for _ in range(2))
        return Problem(q, k, v, dout, lse_like(q), dict(causal=True))
    if kind == "documents":  # 2 x 2048 self-attention, row 0 three documents, row 1 one
        batch, seqlen, nheads, docs = GQ_DOCUMENTS
        q, k, v, dout = (randn(batch, seqlen, nheads, 128, dtype=dtype) for _ in range(4))
        return Problem(q, k, v, dout, lse_like(q), dict(causal=True, document_ids=document_ids(docs)))
    assert kind == "varlen"  # window (700, 0): the first 500 rows of sequence 0 see no key
    total_q, total_k, nheads = sum(GQ_VARLEN_Q), sum(GQ_VARLEN_K), GQ_VARLEN_HEADS
    q, dout = (randn(total_q, nheads, 128, dtype=dtype) for _ in range(2))
    k, v = (randn(total_k, nheads, 128, dtype=dtype) for _ in range(2))
    varlen = (cu_seqlens(GQ_VARLEN_Q), cu_seqlens(GQ_VARLEN_K), max(GQ_VARLEN_Q), max(GQ_VARLEN_K))
    return Problem(q, k, v, dout, lse_like(q), dict(window_size=GQ_WINDOW), varlen)


def gq_segments_exact(p):
    """The premise of the caps: q, k, v, dout each a multiple of 2 MiB and at least 10 MiB."""
    return all(t.nbytes % (2 * MiB) == 0 and t.nbytes >= 10 * MiB for t in (p.q, p.k, p.v, p.dout))


def free_large_blocks():
    """Sizes of the free blocks above 1 MiB (what a large-pool request can take) inside segments the allocator
    keeps (empty_cache cannot release a segment that holds a live block: on the H100 ~1 GiB stayed free inside one
    after the first case's float32 references)."""
    index, stream = torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream  # the call's pool
    return [b["size"] for seg in torch.cuda.memory_snapshot()
            if seg["segment_type"] == "large" and seg.get("device", index) == index and seg["stream"] == stream
            for b in seg["blocks"] if b["state"] == "inactive" and b["size"] > MiB]


@contextlib.contextmanager
def memory_cap(extra_bytes):
    """The caching allocator capped at the memory it holds now (after emptying its cache) plus extra_bytes, by
    torch.cuda.set_per_process_memory_fraction, with every free large block inside a kept segment taken by ballast
    (an exact-size request takes an exact-size free block: best fit), so that the call's allocations need new
    memory; the whole device and the ballast back afterwards, also when the block fails."""
    synchronize()
    torch.cuda.empty_cache()
    ballast = [torch.empty(size, dtype=torch.uint8, device=DEVICE) for size in free_large_blocks()]
    left = free_large_blocks()
    if left:
        raise AssertionError(f"premise: free blocks {left} inside kept large segments after the ballast")
    total = torch.cuda.get_device_properties(DEVICE).total_memory
    cap = torch.cuda.memory_reserved(DEVICE) + extra_bytes
    index = torch.cuda.current_device()  # set_per_process_memory_fraction takes no index-less "cuda"
    torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0), index)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
        del ballast


def expect_out_of_memory(fn, name):
    """Runs fn, which must fail with torch.OutOfMemoryError (what the caching allocator raises at the cap); another
    error (a generic CUDA error, a RuntimeError of the library) fails the test by name. The exception and its
    traceback are dropped before returning, so what they held is freed."""
    try:
        fn()
    except torch.OutOfMemoryError:
        pass
    except RuntimeError as e:
        raise AssertionError(f"{name}: the failed allocation raised {type(e).__name__}, not torch.OutOfMemoryError "
                             f"(a caller cannot tell it from another error): {str(e)[:500]}") from None
    else:
        raise AssertionError(f"{name}: no out-of-memory error at the cap (the test's premise)")


def check_after_failure(before, name):
    """After the failed call: the device synchronises (no sticky CUDA error) and at most GQ_KEPT more bytes are
    allocated than before it (what the call allocated before the failure was given back)."""
    gc.collect()
    left = allocated() - before
    if left > GQ_KEPT:
        raise AssertionError(f"{name}: the failed call left {left} bytes allocated")


@pytest.mark.parametrize("case", list(GQ_CASES))
def test_out_of_memory_inside_a_call_then_the_retry(case):
    kind, dtype_name, phase, deterministic = GQ_CASES[case]
    dtype = DTYPES[dtype_name]
    require_built(128, dtype)
    require_free(GQ_FREE_BYTES, case)
    gc.collect()  # earlier tests' cached blocks out, so the inputs below get segments of exactly their sizes
    synchronize()
    torch.cuda.empty_cache()
    p = gq_problem(kind, dtype)
    assert gq_segments_exact(p), "premise: every input its own segment of exactly its size"
    opts = dict(p.opts, deterministic=deterministic)
    leaves = [t.detach().requires_grad_(True) for t in (p.q, p.k, p.v)]
    if phase == "forward":
        with memory_cap(0):
            before = allocated()
            expect_out_of_memory(lambda: p.call(leaves, **opts), case)
            check_after_failure(before, case)
        out, lse, grads = p.run(**opts)  # the retry: a fresh call with the memory back
        p.check(out, lse, grads, f"{case} retry", **opts)
        return
    out, lse = p.call(leaves, **opts)
    # "backward-first": nothing more, dQ (the backward's first allocation) fails; "backward-workspace": room for dQ,
    # dK and dV, then the fp32 dQ workspace (allocated after them, larger than the slack) fails
    extra = 0 if phase == "backward-first" else p.q.nbytes + p.k.nbytes + p.v.nbytes + GQ_SLACK
    with memory_cap(extra):
        before = allocated()
        expect_out_of_memory(lambda: torch.autograd.grad([out, lse], leaves, [p.dout, p.dlse], retain_graph=True),
                             case)
        check_after_failure(before, case)
    grads = torch.autograd.grad([out, lse], leaves, [p.dout, p.dlse])  # the same graph again, memory back
    p.check(out.detach(), lse.detach(), grads, f"{case} retry", **opts)
    if deterministic:  # the same call: the bits of a fresh call
        _, _, fresh = p.run(**opts)
        for gname, a, b in zip(GRAD_NAMES, grads, fresh):
            assert_same_bits(a, b, f"{case} {gname}", " (the retried backward differs from a fresh deterministic one)")


# ------------------------------------------------------------------ GR: saved tensors restored in another layout

GR_KINDS = ("host_contiguous", "padded_rows", "head_major", "offset_arena")
GR_WORKLOADS = {  # name: dtype, head_dim
    "dense": ("bf16", 128),
    "varlen": ("fp16", 64),
    "documents": ("bf16", 96),
}
GR_PAD = 8  # NaN columns after each row (padded_rows): the row stride stays a multiple of 16 bytes
GR_OFFSET = 1  # elements before each tensor in its arena (offset_arena): 2- or 4-byte aligned, never 16
GR_TAIL = 4096  # arena elements after each tensor


def gr_problem(workload, dtype, head_dim, strided):
    """The workload's problem; strided=True makes q, k, v strided views (q sequence-first or a slice of a padded
    buffer, k and v the halves of one K/V projection), as a model's projections give them."""
    if workload == "varlen":
        lq, lk = (1, 130, 0, 77), (40, 129, 33, 77)
        nheads, nheads_k = 4, 2
        if strided:
            q = randn(sum(lq), nheads, head_dim + 16, dtype=dtype)[..., :head_dim]
            kv = randn(sum(lk), 2, nheads_k, head_dim, dtype=dtype)
            k, v = kv[:, 0], kv[:, 1]
        else:
            q = randn(sum(lq), nheads, head_dim, dtype=dtype)
            k, v = (randn(sum(lk), nheads_k, head_dim, dtype=dtype) for _ in range(2))
        dout = randn(sum(lq), nheads, head_dim, dtype=dtype)
        varlen = (cu_seqlens(lq), cu_seqlens(lk), max(lq), max(lk))
        return Problem(q, k, v, dout, lse_like(q), dict(window_size=(50, 10)), varlen)
    if workload == "dense":
        batch, seqlen_q, seqlen_k, nheads, nheads_k = 2, 203, 341, 8, 2
        opts = dict(causal=True, deterministic=True)
    else:
        batch, seqlen_q, seqlen_k, nheads, nheads_k = 2, 300, 300, 4, 4
        opts = dict(causal=True, softcap=20.0, document_ids=document_ids([(100, 150, 50), (300,)]))
    if strided:
        q = randn(seqlen_q, batch, nheads, head_dim, dtype=dtype).transpose(0, 1)
        kv = randn(batch, seqlen_k, 2 * nheads_k, head_dim, dtype=dtype)
        k, v = kv[:, :, :nheads_k], kv[:, :, nheads_k:]
    else:
        q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
        k, v = (randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype) for _ in range(2))
    dout = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    return Problem(q, k, v, dout, lse_like(q), opts)


def gr_relayout(kind, host, device):
    """A device copy of the host tensor in the kind's layout. The 16-bit tensors (q, k, v, out) get the layout
    changes; the LSE and integer tensors stay contiguous but for offset_arena, which places every tensor at an
    element offset of GR_OFFSET in a buffer filled with NaN (floats) or INT_MAX (integers)."""
    half = host.dtype in (torch.float16, torch.bfloat16) and host.dim() >= 3
    shape = tuple(host.shape)
    if kind == "padded_rows" and half:
        buf = torch.full((*shape[:-1], shape[-1] + GR_PAD), float("nan"), dtype=host.dtype, device=device)
        t = buf[..., :shape[-1]]
    elif kind == "head_major" and half:  # (..., seqlen, nheads, d) stored as (..., nheads, seqlen, d)
        t = torch.empty((*shape[:-3], shape[-2], shape[-3], shape[-1]), dtype=host.dtype,
                        device=device).transpose(-3, -2)
    elif kind == "offset_arena":
        fill = float("nan") if host.dtype.is_floating_point else torch.iinfo(host.dtype).max
        arena = torch.full((GR_OFFSET + host.numel() + GR_TAIL,), fill, dtype=host.dtype, device=device)
        t = arena[GR_OFFSET:GR_OFFSET + host.numel()].view(shape)
    else:
        t = torch.empty(shape, dtype=host.dtype, device=device)
    t.copy_(host)
    return t


@contextlib.contextmanager
def gr_offloading(kind, record):
    """Saved-tensor hooks of an activation offloader: each saved tensor copied to a contiguous host tensor at the
    forward (its device memory free for reuse), copied back in the kind's layout for the backward. record gets
    (shape, strides, address) of each packed and each restored tensor."""

    def pack(t):
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        host.copy_(t)
        record["packed"].append((tuple(t.shape), t.stride(), t.data_ptr()))
        return t.device, host

    def unpack(packed):
        device, host = packed
        t = gr_relayout(kind, host, device)
        record["restored"].append((tuple(t.shape), t.stride(), t.data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def gr_check_premise(kind, record, name):
    """The hooks saw the op's saved tensors (q, k, v, out, LSE at least) and handed back other strides (layout kinds)
    or addresses that are not 16-byte aligned (offset_arena)."""
    packed, restored = record["packed"], record["restored"]
    if not (len(packed) >= 5 and len(restored) == len(packed)):
        raise AssertionError(f"{name}: premise: {len(packed)} tensors packed, {len(restored)} restored")
    if kind == "offset_arena":
        if not all(ptr % 16 != 0 for _, _, ptr in restored):
            raise AssertionError(f"{name}: premise: a restored tensor is 16-byte aligned")
    elif not any(a[1] != b[1] for a, b in zip(packed, restored) if a[0] == b[0]):
        raise AssertionError(f"{name}: premise: no restored tensor has other strides than the forward's")


@pytest.mark.parametrize("workload", list(GR_WORKLOADS))
@pytest.mark.parametrize("kind", GR_KINDS)
def test_saved_tensors_restored_in_another_layout(kind, workload):
    dtype_name, head_dim = GR_WORKLOADS[workload]
    dtype = DTYPES[dtype_name]
    require_built(head_dim, dtype)
    name = f"{kind} {workload}"
    p = gr_problem(workload, dtype, head_dim, strided=(kind == "host_contiguous"))
    leaves = [t.detach().requires_grad_(True) for t in (p.q, p.k, p.v)]  # detach keeps the views' strides
    record = {"packed": [], "restored": []}
    with gr_offloading(kind, record):
        out, lse = p.call(leaves, **p.opts)
    gpu_helpers.poison_attention_memory(p.q, p.v, p.varlen[0] if p.varlen else None)
    grads = torch.autograd.grad([out, lse], leaves, [p.dout, p.dlse])
    gr_check_premise(kind, record, name)
    p.check(out.detach(), lse.detach(), grads, name, **p.opts)


GR_DOC_SHAPE = (2, 300, 4, 96)  # batch, seqlen, nheads (= nheads_k), head_dim


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_document_bounds_at_a_4_byte_offset_in_direct_op_calls(dtype_name):
    """The ops' doc_bounds argument (csrc/api/flash_api.cpp check_documents; the kernels read each position's bounds
    as one 8-byte load) given contiguous int32 bounds 4 bytes off an 8-byte boundary, as a slice of a larger buffer or
    an offloader's arena gives them (offset_arena above faulted with "misaligned address" before check_documents
    copied such bounds): out, LSE and the deterministic dQ, dK, dV bitwise those of the same calls with aligned bounds,
    and the bounds left as they were."""
    dtype = DTYPES[dtype_name]
    require_built(GR_DOC_SHAPE[3], dtype)
    batch, seqlen, nheads, head_dim = GR_DOC_SHAPE
    q, k, v, dout = (randn(batch, seqlen, nheads, head_dim, dtype=dtype) for _ in range(4))
    dlse = lse_like(q)
    aligned = flash_attn_hopper.interface.document_bounds(document_ids([(100, 150, 50), (7, 293)]))
    arena = torch.full((aligned.numel() + 1,), torch.iinfo(torch.int32).max, dtype=torch.int32, device=DEVICE)
    shifted = arena[1:].view(aligned.shape)
    shifted.copy_(aligned)
    assert shifted.is_contiguous() and shifted.data_ptr() % 8 == 4, "premise: contiguous bounds 4 bytes off"
    kept = shifted.clone()
    scale = head_dim ** -0.5
    # (softmax_scale, causal, window_left, window_right, softcap, deterministic)
    args = (scale, True, -1, 0, 20.0, True)
    ops = torch.ops.flash_attn_hopper
    results = []
    for bounds in (aligned, shifted):
        out, lse = ops.fwd(q, k, v, *args, doc_bounds=bounds)
        grads = ops.bwd(dout, q, k, v, out, lse, dlse, *args, doc_bounds=bounds)
        results.append((out, lse, *grads))
    synchronize()
    for name, a, b in zip(("out", "LSE", *GRAD_NAMES), *results):
        assert_same_bits(b, a, f"{dtype_name} {name}", " (bounds 4 bytes off against aligned ones)")
    assert_same_bits(shifted, kept, f"{dtype_name} doc_bounds", " (the op changed the caller's bounds)")
    assert_same_bits(aligned, kept, f"{dtype_name} aligned doc_bounds", " (the op changed the caller's bounds)")
    check_attention(results[0][0], results[0][1], results[0][2:], q, k, v, dout, f"{dtype_name} aligned bounds",
                    dlse=dlse, causal=True, softcap=20.0, document_ids=document_ids([(100, 150, 50), (7, 293)]))


# ------------------------------------------------------------------ GS: the other allocator configurations

GS_CONFIGS = {"expandable_segments": "expandable_segments:True", "cudaMallocAsync": "backend:cudaMallocAsync"}
GS_GROUPS = ("dense_streams", "varlen_documents")
GS_TIMEOUT = 120  # seconds; a child takes a few (import, CUDA initialisation, small problems)
GS_SCRIPT = """
import sys, zlib
import torch
import test_bug_reports_thirtyseventh_gpu as t
config, group = sys.argv[1], sys.argv[2]
torch.manual_seed(zlib.crc32(f"{config} {group}".encode()))
t.gs_check_allocator(config)
t.gs_workload(group)
print("done")
"""


def gs_check_allocator(config):
    """The configuration is in force in this process: the cudaMallocAsync backend, or segments that are expandable
    (a 64 MiB allocation's segment in the allocator's snapshot)."""
    if config == "cudaMallocAsync":
        backend = torch.cuda.get_allocator_backend()
        if backend != "cudaMallocAsync":
            raise AssertionError(f"premise: the allocator backend is {backend!r}, not cudaMallocAsync")
        return
    x = torch.empty(64 * MiB, dtype=torch.uint8, device=DEVICE)
    segments = torch.cuda.memory._snapshot()["segments"]
    del x
    if not any(s.get("is_expandable", False) for s in segments):
        raise AssertionError("premise: no expandable segment in the allocator's snapshot")


def release():
    """Everything unreferenced freed and the allocator's cache emptied (expandable segments unmap their pages)."""
    gc.collect()
    synchronize()
    torch.cuda.empty_cache()


def on_side_stream(fn):
    """fn() run on a new stream that waits for the current one; the current stream then waits for it."""
    current = torch.cuda.current_stream(DEVICE)
    side = torch.cuda.Stream(DEVICE)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        result = fn()
    current.wait_stream(side)
    synchronize()
    return result


def gs_dense(batch, seqlen_q, seqlen_k, dtype):
    """A dense GQA 8 / 2 causal problem at head_dim 128 with a loss on out and LSE."""
    q = randn(batch, seqlen_q, 8, 128, dtype=dtype)
    k, v = (randn(batch, seqlen_k, 2, 128, dtype=dtype) for _ in range(2))
    dout = randn(batch, seqlen_q, 8, 128, dtype=dtype)
    return Problem(q, k, v, dout, lse_like(q), dict(causal=True, deterministic=True))


def gs_workload(group):
    """GS's checks in the current process (the child runs them under its allocator configuration)."""
    if group == "dense_streams":
        small = gs_dense(2, 203, 341, torch.bfloat16)
        first = small.run(**small.opts)
        small.check(*first, "small", **small.opts)
        large = gs_dense(3, 1029, 2000, torch.float16)  # new segments / pages
        large.check(*large.run(**large.opts), "large", **large.opts)
        del large
        release()
        again = small.run(**small.opts)
        side = on_side_stream(lambda: small.run(**small.opts))
        for how, results in (("again after the release", again), ("on a side stream", side)):
            out, lse, grads = results
            for what, a, b in zip(("out", "lse", *GRAD_NAMES), (out, lse, *grads), (first[0], first[1], *first[2])):
                assert_same_bits(a, b, f"small {what} {how}", " (the same deterministic call gave other bits)")
        return
    assert group == "varlen_documents"
    for round_, (lq, lk, hd) in enumerate((((1, 300, 0, 129), (5, 257, 33, 129), 64),
                                          ((700, 1, 1500), (1200, 0, 1600), 128))):
        dtype = (torch.float16, torch.bfloat16)[round_]
        q = randn(sum(lq), 4, hd, dtype=dtype)
        k, v = (randn(sum(lk), 2, hd, dtype=dtype) for _ in range(2))
        dout = randn(sum(lq), 4, hd, dtype=dtype)
        p = Problem(q, k, v, dout, lse_like(q), dict(window_size=(100, 20)),
                    (cu_seqlens(lq), cu_seqlens(lk), max(lq), max(lk)))
        p.check(*p.run(**p.opts), f"varlen round {round_}", **p.opts)
        seqlen = (300, 2048)[round_]
        docs = [(100, 150, 50), (seqlen,)] if round_ == 0 else [(1000, 1000, 48), (17, seqlen - 17)]
        q, dout = randn(2, seqlen, 4, hd, dtype=dtype), randn(2, seqlen, 4, hd, dtype=dtype)
        k, v = (randn(2, seqlen, 2, hd, dtype=dtype) for _ in range(2))
        p = Problem(q, k, v, dout, lse_like(q), dict(causal=True, softcap=30.0, document_ids=document_ids(docs)))
        p.check(*p.run(**p.opts), f"documents round {round_}", **p.opts)
        del p, q, k, v, dout
        release()


@pytest.mark.parametrize("group", GS_GROUPS)
@pytest.mark.parametrize("config", list(GS_CONFIGS))
def test_other_allocator_configurations(config, group):
    for head_dim in (64, 128):
        for dtype in DTYPES.values():
            require_built(head_dim, dtype)
    env = {key: val for key, val in os.environ.items()
           if key not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING")}
    env["PYTORCH_ALLOC_CONF"] = GS_CONFIGS[config]
    gpu_helpers.run_child(GS_SCRIPT, config, group, name=f"{config} {group}", timeout=GS_TIMEOUT, env=env)
