"""Twenty-ninth round of the bug hunt (tests/bug_report_sources.md, "Twenty-ninth round"), GPU part.

Focus: pipeline-parallel training schedules (GPipe, 1F1B and out-of-order ones), where several micro-batches' forwards
are in flight before their backwards, the backwards run in another order than the forwards, and the per-step buffers
that describe the packing (cu_seqlens, document_ids) are refilled in place for every micro-batch. Earlier rounds ran
one forward and its backward (or several calls in one graph, class I; two passes through one graph, FH), and rewrote
cu_seqlens between calls (class 10) or refilled it without the version counter (BV), never while an earlier
micro-batch's backward was still to run.

FS: the buffers a caller keeps for the packing, one cu_seqlens_q / cu_seqlens_k pair (attention_varlen) or one
document_ids tensor (attention), refilled in place with each micro-batch's boundaries before its forward, while the
backwards of earlier micro-batches have not run yet (a 1F1B schedule, three micro-batches in flight). Each backward
must use the boundaries its forward used: the op's saved copy, not the buffer's current values (a backward that
re-reads the caller's buffer, a cache keyed by the tensor's identity, or a compiled graph that recomputes the bounds in
the backward from the buffer gives another micro-batch's boundaries, silently). Eager calls must give every gradient
(attention_varlen saves its own checked copy of cu_seqlens and attention the document bounds it computed, so the
refill is no reason to refuse), by the rule against the float32 reference of the micro-batch's own boundaries. Under
torch.compile(fullgraph=True) (aot_eager and inductor, whose partitioner may save a graph input and recompute cheap ops
from it in the backward) autograd's "modified by an inplace operation" error is a right answer too, but only for the
refilled buffer itself (the error names a tensor of its dtype and shape), only for micro-batches whose buffer was
refilled after their forward, and the same answer for all of them. NVIDIA/TransformerEngine#537 (a proposal to
compute cu_seqlens once and keep them in a global under virtual pipeline parallelism; its review asked whether later
micro-batches would then run with the first one's boundaries), pytorch/pytorch#185331 (pipeline stages reusing
receive buffers across steps, state attached to them persisting); motivation, not the mechanism tested:
pytorch/torchtitan#4098 (varlen metadata under pipeline parallelism, each micro-batch's cu_seqlens cut from the whole
batch's, which classes 29, 30 and CD cover).

FT: backwards in another order than their forwards, with forwards of other shapes, head dims, options (causal, window,
softcap, softmax_scale, documents, varlen, GQA / MQA, a loss on the LSE) and backward modes run in between: each
micro-batch's out, LSE, dQ, dK, dV must be those of the same micro-batch run alone (forward, then its backward at
once): out and LSE bit for bit in both modes, dQ, dK, dV bit for bit with deterministic=True and by the rule
otherwise. A backward that takes
anything from the last forward instead of its own node (options, the LSE or out of the last call, a workspace sized
or zeroed by the forward) fails; so does one whose returned gradients live in memory a later backward reuses: every
micro-batch's gradients are held, as a pipeline stage holds them until it sends them, and compared at the end with a
copy taken when they were returned. pytorch/pytorch#139404 (a pipeline stage kept only the most recent backward's
result: reordering the backwards could send wrong gradients), pytorch/pytorch#185331.

Inputs are plain Gaussian (no V offset, so |O| stays small; the rows that see only one or two keys sit inside long
sequences, not in whole sequences of two keys, so docs/conventions.md's limits of the rule at very short key ranges
and large |O| do not apply); every output from NaN-poisoned memory (gpu_helpers.poison_attention_memory).

Checked on the CPU (no GPU here): a dry run of this file's test functions with reference-based stand-ins of attention
and attention_varlen (float32 references rounded to the input dtype; backwards from the saved out and LSE, D from the
rounded out) passes every case, and stand-ins with the reported faults fail them (see bug_report_sources.md).

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py: "no CUDA GPU: GPU tests need an sm90
GPU (H100/H200)"), and per test when the build lacks a head_dim / dtype."""

import pytest
import torch

import flash_attn_hopper
import gpu_helpers
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_varlen_ref
from gpu_helpers import bits, check_attention, check_attention_varlen, require_built

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"  # (the CPU dry run sets "cpu" and stands in for the ops)
FP16, BF16 = torch.float16, torch.bfloat16
DTYPE_IDS = {FP16: "fp16", BF16: "bf16"}
INPLACE_ERROR = "modified by an inplace operation"  # autograd's version-counter error


def poison(q, v, cu_seqlens_q=None):
    """NaN into the caching allocator at the sizes the next forward or backward allocates."""
    gpu_helpers.poison_attention_memory(q, v, cu_seqlens_q)


def cu_tensor(lengths, device=None):
    """gpu_helpers.cu_seqlens on `device`, by default DEVICE (the CPU run of these bodies sets it to "cpu")."""
    return gpu_helpers.cu_seqlens(lengths, device or DEVICE)


def doc_ids_tensor(rows, device=None):
    """(batch, seqlen) int32 document ids from per-row run lengths; ids repeat 0, 1, 2, 0, ... (runs are documents)."""
    ids = [torch.cat([torch.full((n,), d % 3) for d, n in enumerate(r)]) for r in rows]
    return torch.stack(ids).to(device=device or DEVICE, dtype=torch.int32)


def gaussian(shape, g, dtype, device=None, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(device=device or DEVICE, dtype=dtype)


def check_forward_only(out, lse, q, k, v, name, cu_q=None, cu_k=None, **opts):
    """Out and LSE by the rule (a compiled backward having raised autograd's in-place error for the refilled buffer)."""
    assert out.shape[:-1] == q.shape[:-1] and out.dtype == q.dtype and lse.dtype == torch.float32, name
    if cu_q is None:
        ref, ref_lse = attention_ref(q, k, v, upcast=True, **opts)
        naive, naive_lse = attention_ref(q, k, v, upcast=False, **opts)
    else:
        ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=True, **opts)
        naive, naive_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, **opts)
    assert_close_by_rule(out, ref, naive, f"{name} out")
    assert_close_by_rule(lse, ref_lse, naive_lse, f"{name} lse")


def backward_or_buffer_error(outputs, leaves, grads_out, buffer, may_raise):
    """The gradients, or None when autograd refused the backward with its in-place error for `buffer` (the message
    names the modified tensor by its type and shape, "[torch.cuda.IntTensor [6]]"), allowed only where `may_raise`
    (a micro-batch whose buffer was refilled after its forward). Any other error raises."""
    try:
        return torch.autograd.grad(outputs, leaves, grads_out)
    except RuntimeError as e:
        named = f"{INPLACE_ERROR}: [{buffer.type()} [{', '.join(map(str, buffer.shape))}]]"
        if not may_raise or named not in str(e):
            raise
        return None


# 1F1B with three micro-batches in flight: F0 F1 F2 B0 F3 B1 B2 B3
SCHEDULE_1F1B = [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]


def refilled_after_forward(schedule, m):
    """Whether another micro-batch's forward (a refill of the buffers) runs between m's forward and m's backward."""
    f, b = schedule.index(("F", m)), schedule.index(("B", m))
    return any(op == "F" for op, _ in schedule[f + 1:b])


def check_schedule(schedule, count):
    """Each micro-batch's forward once, before its backward once."""
    for m in range(count):
        assert schedule.count(("F", m)) == 1 and schedule.count(("B", m)) == 1
        assert schedule.index(("F", m)) < schedule.index(("B", m))


# ------------------------------------------------ FS: packing buffers refilled while earlier backwards are pending

# Five sequences per micro-batch (the buffers' size), packed into 700 query and 900 key rows (rows past the last
# sequence in some), max_seqlen fixed upper bounds (a schedule sizes them once); empty, one-token and exactly-one-tile
# sequences; every micro-batch's boundaries different from the others'.
FS_ROWS_Q, FS_ROWS_K, FS_MAX_Q, FS_MAX_K = 700, 900, 400, 400
FS_LENGTHS = [
    ([300, 0, 129, 1, 200], [257, 33, 129, 0, 400]),
    ([1, 399, 64, 100, 7], [5, 300, 64, 100, 380]),
    ([128, 128, 128, 128, 128], [256, 1, 200, 130, 77]),
    ([0, 0, 350, 350, 0], [400, 0, 250, 250, 0]),
]
FS_VARLEN_CASES = {  # (options, LSE in the loss, deterministic, seed)
    "causal": (dict(causal=True), False, False, 706),
    "window-softcap-lse-deterministic": (dict(window_size=(100, 20), softcap=20.0), True, True, 732),
}


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", list(FS_VARLEN_CASES))
def test_cu_seqlens_buffers_refilled_between_micro_batches(case, dtype):
    """FS (NVIDIA/TransformerEngine#537, pytorch/pytorch#185331): one cu_seqlens_q / cu_seqlens_k pair refilled in
    place (copy_) with each of four micro-batches' boundaries before its forward, 1F1B with three in flight (head_dim
    128, GQA 4/2). Every micro-batch's out, LSE, dQ, dK, dV by the rule against the reference of its own boundaries
    (rows that see no key exactly 0); no error (attention_varlen saved its own copy). Catches a backward (or a cache)
    that reads the caller's buffer after the refill: another micro-batch's boundaries, silently wrong gradients."""
    head_dim, nheads, nheads_k = 128, 4, 2
    require_built(head_dim, dtype)
    opts, lse_in_loss, deterministic, seed = FS_VARLEN_CASES[case]
    check_schedule(SCHEDULE_1F1B, len(FS_LENGTHS))
    for lq, lk in FS_LENGTHS:
        assert len(lq) == len(lk) == 5 and sum(lq) <= FS_ROWS_Q and sum(lk) <= FS_ROWS_K
        assert max(lq) <= FS_MAX_Q and max(lk) <= FS_MAX_K
    cu_q = torch.zeros(6, dtype=torch.int32, device=DEVICE)  # the caller's buffers, kept for the whole step
    cu_k = torch.zeros(6, dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    scale = 2.0 if opts.get("softcap") else 1.0  # so that the cap bites
    inputs = [[gaussian((FS_ROWS_Q, nheads, head_dim), g, dtype, scale=scale),
               gaussian((FS_ROWS_K, nheads_k, head_dim), g, dtype),
               gaussian((FS_ROWS_K, nheads_k, head_dim), g, dtype),
               gaussian((FS_ROWS_Q, nheads, head_dim), g, dtype),
               torch.randn(nheads, FS_ROWS_Q, generator=g).to(DEVICE) if lse_in_loss else None]
              for _ in FS_LENGTHS]
    pending, results = {}, {}
    for op, m in SCHEDULE_1F1B:
        q, k, v, dout, dlse = inputs[m]
        if op == "F":
            lq, lk = FS_LENGTHS[m]
            cu_q.copy_(cu_tensor(lq))
            cu_k.copy_(cu_tensor(lk))
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            poison(q, v, cu_q)
            out, lse = flash_attn_hopper.attention_varlen(*leaves, cu_q, cu_k, FS_MAX_Q, FS_MAX_K, return_lse=True,
                                                          deterministic=deterministic, **opts)
            pending[m] = (leaves, out, lse)
        else:
            leaves, out, lse = pending.pop(m)
            poison(q, v, cu_tensor(FS_LENGTHS[m][0]))  # the sizes of m's own backward
            outputs, grads_out = ([out, lse], [dout, dlse]) if lse_in_loss else ([out], [dout])
            results[m] = (out.detach(), lse.detach(), torch.autograd.grad(outputs, leaves, grads_out))
    for m, (lq, lk) in enumerate(FS_LENGTHS):
        q, k, v, dout, dlse = inputs[m]
        out, lse, grads = results[m]
        own_q, own_k = cu_tensor(lq), cu_tensor(lk)  # fresh tensors holding this micro-batch's boundaries
        name = f"FS varlen {case} {DTYPE_IDS[dtype]} micro-batch {m}"
        check_attention_varlen(out, lse, grads, q, k, v, dout, own_q, own_k, name, dlse=dlse, **opts)


# Documents packed into a dense batch of 2 x 517: per micro-batch, the run lengths of each row.
FS_DOC_SEQLEN = 517
FS_DOC_RUNS = [
    ([300, 1, 216], [517]),
    ([128, 128, 261], [1, 515, 1]),
    ([517], [200, 117, 200]),
    ([50, 400, 67], [259, 258]),
]


@pytest.mark.parametrize("dtype,deterministic", [(FP16, False), (BF16, True)], ids=["fp16", "bf16-deterministic"])
def test_document_ids_buffer_refilled_between_micro_batches(dtype, deterministic):
    """FS for packed documents (attention's document_ids): one (2, 517) ids buffer refilled in place with each of four
    micro-batches' documents before its forward, 1F1B with three in flight, head_dim 64, GQA 6/2, causal. Every
    micro-batch by the rule against the reference of its own ids; no error (attention saved the bounds it computed).
    Catches bounds re-read from the buffer at backward time, or served from a cache keyed by the tensor's identity."""
    head_dim, nheads, nheads_k, batch = 64, 6, 2, 2
    require_built(head_dim, dtype)
    check_schedule(SCHEDULE_1F1B, len(FS_DOC_RUNS))
    assert all(sum(r) == FS_DOC_SEQLEN for rows in FS_DOC_RUNS for r in rows)
    ids_buffer = torch.zeros(batch, FS_DOC_SEQLEN, dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(517)
    shape_q, shape_k = (batch, FS_DOC_SEQLEN, nheads, head_dim), (batch, FS_DOC_SEQLEN, nheads_k, head_dim)
    inputs = [[gaussian(shape_q, g, dtype), gaussian(shape_k, g, dtype), gaussian(shape_k, g, dtype),
               gaussian(shape_q, g, dtype)] for _ in FS_DOC_RUNS]
    pending, results = {}, {}
    for op, m in SCHEDULE_1F1B:
        q, k, v, dout = inputs[m]
        if op == "F":
            ids_buffer.copy_(doc_ids_tensor(FS_DOC_RUNS[m]))
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            poison(q, v)
            out, lse = flash_attn_hopper.attention(*leaves, causal=True, return_lse=True, deterministic=deterministic,
                                                   document_ids=ids_buffer)
            pending[m] = (leaves, out, lse)
        else:
            leaves, out, lse = pending.pop(m)
            poison(q, v)
            results[m] = (out.detach(), lse.detach(), torch.autograd.grad([out], leaves, [dout]))
    for m, rows in enumerate(FS_DOC_RUNS):
        q, k, v, dout = inputs[m]
        out, lse, grads = results[m]
        opts = dict(causal=True, document_ids=doc_ids_tensor(rows))
        name = f"FS documents {DTYPE_IDS[dtype]} deterministic={deterministic} micro-batch {m}"
        check_attention(out, lse, grads, q, k, v, dout, name, **opts)


FS_COMPILED_HEAD_DIM = 64


def _fs_varlen_step(q, k, v, cu_q, cu_k):
    return flash_attn_hopper.attention_varlen(q, k, v, cu_q, cu_k, FS_MAX_Q, FS_MAX_K, causal=True,
                                              window_size=(150, 0), return_lse=True)


def _fs_documents_step(q, k, v, ids):
    return flash_attn_hopper.attention(q, k, v, causal=True, return_lse=True, document_ids=ids)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_packing_buffers_refilled_between_compiled_micro_batches(backend, request):
    """FS under torch.compile(fullgraph=True): attention_varlen (the cu_seqlens buffers) and attention with
    document_ids (an ids buffer), each its own compiled step with its own backward, MQA 4/1 at head_dim 64; four
    micro-batches, 1F1B, the buffers refilled in place before each forward. Under compile the bounds are computed in
    the graph from the buffers, and the partitioner may save a buffer and recompute from it in the backward, which
    must then raise autograd's in-place error naming that buffer rather than use another micro-batch's boundaries.
    Each micro-batch's out, LSE, dQ, dK, dV by the rule against its own boundaries' reference, or, for a step and only
    where the buffer was refilled after the forward (micro-batches 0-2), that error for all of them, with out and LSE
    by the rule. The path each step took is recorded in the test's user_properties."""
    head_dim, nheads, nheads_k, batch = FS_COMPILED_HEAD_DIM, 4, 1, 2
    dtype = BF16
    require_built(head_dim, dtype)
    check_schedule(SCHEDULE_1F1B, len(FS_LENGTHS))
    cu_q = torch.zeros(6, dtype=torch.int32, device=DEVICE)
    cu_k = torch.zeros(6, dtype=torch.int32, device=DEVICE)
    ids_buffer = torch.zeros(batch, FS_DOC_SEQLEN, dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(64)
    shape_dq, shape_dk = (batch, FS_DOC_SEQLEN, nheads, head_dim), (batch, FS_DOC_SEQLEN, nheads_k, head_dim)
    shape_q, shape_k = (FS_ROWS_Q, nheads, head_dim), (FS_ROWS_K, nheads_k, head_dim)
    inputs = [([gaussian(shape_q, g, dtype), gaussian(shape_k, g, dtype), gaussian(shape_k, g, dtype),
                gaussian(shape_q, g, dtype)],
               [gaussian(shape_dq, g, dtype), gaussian(shape_dk, g, dtype), gaussian(shape_dk, g, dtype),
                gaussian(shape_dq, g, dtype)]) for _ in FS_LENGTHS]
    torch._dynamo.reset()
    try:
        steps = [torch.compile(f, backend=backend, fullgraph=True) for f in (_fs_varlen_step, _fs_documents_step)]
        pending, results = {}, {}
        for op, m in SCHEDULE_1F1B:
            (q, k, v, dout), (qd, kd, vd, doutd) = inputs[m]
            if op == "F":
                cu_q.copy_(cu_tensor(FS_LENGTHS[m][0]))
                cu_k.copy_(cu_tensor(FS_LENGTHS[m][1]))
                ids_buffer.copy_(doc_ids_tensor(FS_DOC_RUNS[m]))
                leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
                leaves_d = [t.detach().requires_grad_(True) for t in (qd, kd, vd)]
                poison(q, v, cu_tensor(FS_LENGTHS[m][0]))
                pending[m] = (leaves, steps[0](*leaves, cu_q, cu_k), leaves_d, steps[1](*leaves_d, ids_buffer))
            else:
                leaves, (out, lse), leaves_d, (out_d, lse_d) = pending.pop(m)
                may_raise = refilled_after_forward(SCHEDULE_1F1B, m)
                poison(q, v, cu_tensor(FS_LENGTHS[m][0]))
                # (cu_k has cu_q's type and shape: an error naming either matches)
                grads = backward_or_buffer_error([out], leaves, [dout], cu_q, may_raise)
                poison(qd, vd)
                grads_d = backward_or_buffer_error([out_d], leaves_d, [doutd], ids_buffer, may_raise)
                results[m] = ((out.detach(), lse.detach(), grads), (out_d.detach(), lse_d.detach(), grads_d))
    finally:
        torch._dynamo.reset()
    for step_index, what in enumerate(("varlen", "documents")):
        paths = ["error" if results[m][step_index][2] is None else "gradients" for m in range(len(FS_LENGTHS))]
        request.node.user_properties.append((f"fs_{what}_backward_paths", ",".join(paths)))
        refilled = [p for m, p in enumerate(paths) if refilled_after_forward(SCHEDULE_1F1B, m)]
        if len(set(refilled)) != 1:
            raise AssertionError(f"FS compiled {backend} {what}: micro-batches refilled after their forwards took "
                                 f"different paths {paths}")
    for m, (lq, lk) in enumerate(FS_LENGTHS):
        (q, k, v, dout), (qd, kd, vd, doutd) = inputs[m]
        (out, lse, grads), (out_d, lse_d, grads_d) = results[m]
        own_q, own_k = cu_tensor(lq), cu_tensor(lk)
        name = f"FS compiled {backend} micro-batch {m}"
        varlen_opts = dict(causal=True, window_size=(150, 0))
        dense_opts = dict(causal=True, document_ids=doc_ids_tensor(FS_DOC_RUNS[m]))
        if grads is None:
            check_forward_only(out, lse, q, k, v, f"{name} varlen", own_q, own_k, **varlen_opts)
        else:
            check_attention_varlen(out, lse, grads, q, k, v, dout, own_q, own_k, f"{name} varlen", **varlen_opts)
        if grads_d is None:
            check_forward_only(out_d, lse_d, qd, kd, vd, f"{name} documents", **dense_opts)
        else:
            check_attention(out_d, lse_d, grads_d, qd, kd, vd, doutd, f"{name} documents", **dense_opts)


# ------------------------------------------------ FT: backwards out of their forwards' order, gradients held

# (kind, head_dim, head_dim_v, sizes, options, lse in the loss); sizes: dense (batch, seqlen_q, seqlen_k, nheads,
# nheads_k), varlen (lengths_q, lengths_k, nheads, nheads_k), documents (run lengths per row, nheads, nheads_k).
# Micro-batches 0 and 3 have the same shapes and options (other values): a gradient buffer reused per shape would
# give micro-batch 0's held gradients micro-batch 3's values.
FT_MICRO_BATCHES = [
    ("dense", 128, 128, (2, 203, 141, 4, 2), dict(causal=True), True),
    ("varlen", 64, 64, ((1, 300, 0, 77), (40, 129, 33, 200), 4, 1), dict(window_size=(64, 8)), False),
    ("dense", 256, 128, (1, 130, 257, 6, 2), dict(softcap=20.0, softmax_scale=0.125), False),
    ("dense", 128, 128, (2, 203, 141, 4, 2), dict(causal=True), True),
    ("documents", 64, 64, (([100, 1, 199], [300]), 4, 4), dict(causal=True), False),
]
FT_SCHEDULES = {
    # GPipe-like: every forward, then the backwards in reverse order
    "reverse": [("F", m) for m in range(5)] + [("B", m) for m in reversed(range(5))],
    # forwards and backwards mixed, the backwards in neither forward nor reverse order
    "out-of-order": [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("F", 3), ("B", 2), ("F", 4), ("B", 1), ("B", 4),
                     ("B", 3)],
}


def ft_inputs(index, dtype, device=None):
    """The micro-batch's tensors and call arguments: dict(qkv, dout, dlse, call opts, reference opts, cu_q, cu_k)."""
    kind, head_dim, head_dim_v, sizes, opts, lse_in_loss = FT_MICRO_BATCHES[index]
    device = device or DEVICE
    g = torch.Generator().manual_seed(1000 + index)
    scale = 3.0 if opts.get("softcap") else 1.0
    x = dict(kind=kind, opts=dict(opts), ref_opts=dict(opts), cu_q=None, cu_k=None)
    if kind == "varlen":
        lq, lk, nheads, nheads_k = sizes
        rows_q, rows_k = sum(lq), sum(lk)
        lead_q, lead_k = (rows_q,), (rows_k,)
        x.update(cu_q=cu_tensor(lq, device), cu_k=cu_tensor(lk, device), max_q=max(lq), max_k=max(lk))
        lse_shape = (nheads, rows_q)
    elif kind == "documents":
        rows, nheads, nheads_k = sizes
        seqlen = sum(rows[0])
        lead_q = lead_k = (len(rows), seqlen)
        ids = doc_ids_tensor(rows, device)
        x["opts"]["document_ids"] = x["ref_opts"]["document_ids"] = ids
        lse_shape = (len(rows), nheads, seqlen)
    else:
        batch, seqlen_q, seqlen_k, nheads, nheads_k = sizes
        lead_q, lead_k = (batch, seqlen_q), (batch, seqlen_k)
        lse_shape = (batch, nheads, seqlen_q)
    x["qkv"] = [gaussian((*lead_q, nheads, head_dim), g, dtype, device, scale),
                gaussian((*lead_k, nheads_k, head_dim), g, dtype, device),
                gaussian((*lead_k, nheads_k, head_dim_v), g, dtype, device)]
    x["dout"] = gaussian((*lead_q, nheads, head_dim_v), g, dtype, device)
    x["dlse"] = torch.randn(*lse_shape, generator=g).to(device) if lse_in_loss else None
    return x


def ft_forward(x, deterministic):
    q, k, v = x["qkv"]
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    poison(q, v, x["cu_q"])
    if x["kind"] == "varlen":
        out, lse = flash_attn_hopper.attention_varlen(*leaves, x["cu_q"], x["cu_k"], x["max_q"], x["max_k"],
                                                      return_lse=True, deterministic=deterministic, **x["opts"])
    else:
        out, lse = flash_attn_hopper.attention(*leaves, return_lse=True, deterministic=deterministic, **x["opts"])
    return leaves, out, lse


def ft_backward(x, leaves, out, lse):
    q, _, v = x["qkv"]
    poison(q, v, x["cu_q"])
    if x["dlse"] is None:
        return torch.autograd.grad([out], leaves, [x["dout"]])
    return torch.autograd.grad([out, lse], leaves, [x["dout"], x["dlse"]])


def ft_check(x, out, lse, grads, name):
    q, k, v = x["qkv"]
    if x["kind"] == "varlen":
        check_attention_varlen(out, lse, grads, q, k, v, x["dout"], x["cu_q"], x["cu_k"], name, dlse=x["dlse"],
                               **x["ref_opts"])
    else:
        check_attention(out, lse, grads, q, k, v, x["dout"], name, dlse=x["dlse"], **x["ref_opts"])


def assert_same_bits(a, b, name):
    gpu_helpers.assert_same_bits(a, b, name, " (not bit for bit the micro-batch's own result)")


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
@pytest.mark.parametrize("schedule", list(FT_SCHEDULES))
def test_backwards_out_of_forward_order(schedule, deterministic, dtype):
    """FT (pytorch/pytorch#139404, pytorch/pytorch#185331): five micro-batches of different kinds (dense GQA causal
    with a loss on the LSE, varlen MQA with a window, head_dim 256 / v 128 with softcap and a scale, documents), their
    backwards in reverse or out-of-order with other forwards between. Each micro-batch is also run alone (forward, then
    its backward at once; checked by the rule). Out and LSE bit for bit the alone run's in both modes; dQ, dK, dV bit
    for bit with deterministic=True, by the rule otherwise.
    Every micro-batch's gradients are held to the end and must still hold the bits they had when returned (a later
    backward reusing their memory fails). Catches a backward that takes options, LSE, out or workspaces from the last
    forward rather than its own node."""
    for _, head_dim, head_dim_v, *_ in FT_MICRO_BATCHES:
        require_built(max(head_dim, head_dim_v), dtype)
        require_built(min(head_dim, head_dim_v), dtype)
    order = FT_SCHEDULES[schedule]
    check_schedule(order, len(FT_MICRO_BATCHES))
    xs = [ft_inputs(m, dtype) for m in range(len(FT_MICRO_BATCHES))]
    alone = {}
    for m, x in enumerate(xs):  # each micro-batch alone: its forward, then its backward at once
        leaves, out, lse = ft_forward(x, deterministic)
        grads = ft_backward(x, leaves, out, lse)
        ft_check(x, out.detach(), lse.detach(), grads,
                 f"FT micro-batch {m} alone {DTYPE_IDS[dtype]} deterministic={deterministic}")
        alone[m] = (out.detach(), lse.detach(), grads)
    pending, held, copies = {}, {}, {}
    for op, m in order:
        x = xs[m]
        if op == "F":
            pending[m] = ft_forward(x, deterministic)
        else:
            leaves, out, lse = pending.pop(m)
            grads = ft_backward(x, leaves, out, lse)
            held[m] = (out.detach(), lse.detach(), grads)
            copies[m] = [bits(t) for t in grads]  # bits() copies
    for m, x in enumerate(xs):
        name = f"FT {schedule} {DTYPE_IDS[dtype]} deterministic={deterministic} micro-batch {m}"
        out, lse, grads = held[m]
        for gname, g, c in zip(("dq", "dk", "dv"), grads, copies[m]):
            if not torch.equal(bits(g), c):
                raise AssertionError(f"{name}: the held {gname} changed after later backwards ran")
        a_out, a_lse, a_grads = alone[m]
        assert_same_bits(out, a_out, f"{name} out")
        assert_same_bits(lse, a_lse, f"{name} lse")
        if deterministic:
            for gname, g, a in zip(("dq", "dk", "dv"), grads, a_grads):
                assert_same_bits(g, a, f"{name} {gname}")
        else:
            ft_check(x, out, lse, grads, name)
