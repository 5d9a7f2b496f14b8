"""Forty-second round of the bug hunt (tests/bug_report_sources.md, "Forty-second round"), GPU part.

HG: a tensor the library keeps a note for (cu_seqlens: the values checked and their copy; document_ids: the bounds)
whose content is replaced without an ordinary write. resize_, set_ and as_strided_ change what the tensor object
holds in place (they move its version counter, so a note keyed by identity and version must be dropped);
torch.utils.swap_tensors gives the object another tensor's whole content, version counter included (a fresh tensor's
is 0, as the kept one's may be). On torch 2.11 swap_tensors refuses any tensor with a Python weak reference, which
the library's notes hold: docs/conventions.md documents that refusal and the remedy (copy into the buffer).
pytorch/pytorch#186796 (a live compiled module's weak references blocked swap_tensors for diffusers' offloading) led
to pytorch/pytorch#190604 (allow swap_tensors with any weak reference) and pytorch/pytorch#190739 (allow plain
weakref.ref, which it calls observational, and keep refusing the weakref subclasses of identity-keyed containers,
which a swap "silently corrupts"). The library's notes are an identity-keyed container built on plain weakref.ref:
where PyTorch lets such a swap through, the next call must use the swapped-in values, not the note's. That case is
run with swap_tensors' weak-reference check narrowed as #190739 proposes (`swap_allowing_plain_weakrefs`).

HH: the references' numeric mode (flash_attn_hopper.testing._reference_mode: torch.set_float32_matmul_precision
("highest") for the reference, the caller's settings put back after it) entered from two threads at once, as a
multithreaded test runner or an evaluation thread beside training does. pytorch/pytorch#190285: PyTorch's own
tf32_off, a per-entry save and restore of the same process-wide state, leaked modified flags when rank threads
entered it concurrently (a thread snapshots the state another thread already changed and restores it last); the fix
was first-in / last-out with a lock. Here: thread A enters, thread B enters (saving A's "highest" as the caller's),
A leaves (putting "high" back while B still computes), B computes, B leaves (putting "highest" back for good).
Required: B's float32 reference in full float32 (within 1e-5 of the one computed alone) and the caller's setting
unchanged.

HI: a note whose version is read after its values. `_ValueNotes.computed` reads the values (cu_seqlens: a clone and
its host copy; document_ids: the bounds), then stores them under the version the tensor has at the store. A write by
another thread in between (a loader refilling the packing buffer with `copy_`, which moves the version) files the
old values under the new version, and every later call until the next write is served them: the boundaries of one
batch for the next, silently. NVIDIA/TensorRT-LLM#13696 (attention metadata reused after another wrapper had
overwritten the shared object), MinghuasLab/flash-attention-npu#178 (scheduler metadata overwritten by consecutive
forwards before the kernel read it), vllm-project/vllm-ascend#16480 (cached host metadata diverging from the device's
query_start_loc under asynchronous scheduling: a hang). The racing call itself may use either values (the caller
raced); the next call, with no write since, must use the values the tensor holds.

Inputs are Gaussian from the per-test seed (tests/conftest.py). Skipped, with the reason, without an sm90 GPU and the
built extension (conftest.py), and per test when the build lacks a head_dim / dtype.
tests/test_bug_reports_fortysecond_cpu.py runs the host paths of the three classes with a recording op."""

import contextlib
import threading
import types
import weakref

import pytest
import torch

from flash_attn_hopper import interface, testing
from flash_attn_hopper.testing import attention_ref
from gpu_helpers import check_attention, check_attention_varlen, require_built, run_attention, run_attention_varlen

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"


def randn(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


# ------------------------------------------------------------------ shared by the CPU file

HG_HOW = ["resize", "set", "as_strided"]
HG_OLD = [0, 10, 30]  # two sequences of 10 and 20 rows, 30 rows in all
HG_NEW = {"resize": [0, 10], "set": [0, 4, 30], "as_strided": [0, 4, 30]}  # after the replacement


def hg_kept_cu_seqlens():
    """A contiguous int32 cu_seqlens holding HG_OLD, a view into a buffer that also holds [0, 4, 30] after it (for
    as_strided_)."""
    buffer = torch.tensor(HG_OLD + HG_NEW["as_strided"], dtype=torch.int32, device=DEVICE)
    return buffer[:3]


def hg_replace(cu, how):
    """Replaces what `cu` holds in place, without a write to its elements: resize_ (shrunk to its first sequence),
    set_ (another storage), as_strided_ (another offset into its buffer). Returns cu."""
    if how == "resize":
        return cu.resize_(2)
    if how == "set":
        return cu.set_(torch.tensor(HG_NEW["set"], dtype=torch.int32, device=cu.device))
    return cu.as_strided_((3,), (1,), 3)


def hg_documents(seqlen=96, batch=2):
    """Two document_ids tensors of one shape and dtype: old (two documents per row) and new (three per row)."""
    old = torch.repeat_interleave(torch.arange(2), torch.tensor([40, seqlen - 40])).to(torch.int32)
    new = torch.repeat_interleave(torch.arange(3), torch.tensor([7, 50, seqlen - 57])).to(torch.int32)
    return old.expand(batch, seqlen).contiguous().to(DEVICE), new.expand(batch, seqlen).contiguous().to(DEVICE)


@contextlib.contextmanager
def swap_allowing_plain_weakrefs():
    """torch.utils.swap_tensors as pytorch/pytorch#190739 proposes it: plain weakref.ref objects (observers) no longer
    block a swap; weakref subclasses (WeakIdRef, KeyedRef: identity-keyed containers) still do. torch 2.11's check is
    `weakref.getweakrefs(t)` in torch/utils/__init__.py; it is narrowed for the block only."""
    import torch.utils as torch_utils

    saved = torch_utils.weakref
    torch_utils.weakref = types.SimpleNamespace(
        getweakrefs=lambda t: [w for w in weakref.getweakrefs(t) if type(w) is not weakref.ref])
    try:
        yield
    finally:
        torch_utils.weakref = saved


@contextlib.contextmanager
def swap_allowing_any_weakrefs():
    """torch.utils.swap_tensors as pytorch/pytorch#190604 proposes it: no weak reference blocks a swap (torch 2.11's
    check, `weakref.getweakrefs(t)` in torch/utils/__init__.py, sees none for the block only)."""
    import torch.utils as torch_utils

    saved = torch_utils.weakref
    torch_utils.weakref = types.SimpleNamespace(getweakrefs=lambda t: [])
    try:
        yield
    finally:
        torch_utils.weakref = saved


def swap_into(kept, values):
    """kept takes a fresh tensor's content (values: same shape and dtype) by torch.utils.swap_tensors; the version it
    then reads is that fresh tensor's (0), as a never-written kept tensor's was. Returns kept."""
    fresh = values.clone()
    torch.utils.swap_tensors(kept, fresh)
    return kept


def hh_interleaved(reference, args_a, args_b, caller_precision="high"):
    """Runs reference(*args_a) on thread A and reference(*args_b) on thread B in the order of HH (A enters, B enters,
    A leaves, B computes its scores, B leaves), with torch.set_float32_matmul_precision(caller_precision) set by the
    caller. Returns (result_a, result_b, the legacy precision B's scores were computed under, the legacy precision
    after both). The order is forced with events in a wrapper of flash_attn_hopper.testing._scores (called once per
    reference, inside its numeric mode); the caller's settings are put back afterwards whatever happens."""
    original = testing._scores
    a_inside, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()
    seen, results, errors = {}, {}, []

    def scores(*args, **kwargs):
        if threading.current_thread().name == "hh-a":
            a_inside.set()
            if not b_inside.wait(60):
                raise RuntimeError("thread B never entered its reference")
        else:
            b_inside.set()
            if not a_done.wait(60):
                raise RuntimeError("thread A never left its reference")
            seen["b"] = torch.get_float32_matmul_precision()
        return original(*args, **kwargs)

    def run(name, args):
        try:
            results[name] = reference(*args)
        except BaseException as e:  # (re-raised on the calling thread)
            errors.append(e)
            a_inside.set()
            b_inside.set()
        finally:
            if name == "a":
                a_done.set()

    legacy = torch.get_float32_matmul_precision()
    backends = [torch.backends.cuda.matmul, torch.backends.mkldnn.matmul]
    saved = [b.fp32_precision for b in backends]
    testing._scores = scores
    try:
        torch.set_float32_matmul_precision(caller_precision)
        thread_a = threading.Thread(target=run, args=("a", args_a), name="hh-a", daemon=True)
        thread_a.start()
        a_inside.wait(60)
        thread_b = threading.Thread(target=run, args=("b", args_b), name="hh-b", daemon=True)
        thread_b.start()
        thread_a.join(120)
        thread_b.join(120)
        after = torch.get_float32_matmul_precision()
    finally:
        testing._scores = original
        torch.set_float32_matmul_precision(legacy)
        for b, old in zip(backends, saved):
            b.fp32_precision = old
    if errors:
        raise errors[0]
    return results["a"], results["b"], seen.get("b"), after


@contextlib.contextmanager
def refilled_during_read(module, name, tensor, values):
    """While active, module.name (a function that reads `tensor`'s values for a note: interface._read_cu_seqlens or
    interface.document_bounds) is wrapped: after its first read, another thread writes `values` into `tensor` with
    copy_ (moving its version) and finishes before the read returns to the note, the interleaving of a loader thread
    refilling the buffer. Later reads are left alone."""
    original = getattr(module, name)
    done = []

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        if not done:
            done.append(True)
            writer = threading.Thread(target=lambda: tensor.copy_(values), name="hi-writer", daemon=True)
            writer.start()
            writer.join(60)
            if writer.is_alive():
                raise RuntimeError("the writer thread did not finish")
        return result

    setattr(module, name, wrapped)
    try:
        yield
    finally:
        setattr(module, name, original)


# ------------------------------------------------------------------ HG on the GPU

def _varlen_inputs(dtype, total=30):
    q = randn(total, 4, 64, dtype=dtype)
    k = randn(total, 2, 64, dtype=dtype)
    return q, k, randn(total, 2, 64, dtype=dtype), randn(total, 4, 64, dtype=dtype)


@pytest.mark.parametrize("how", HG_HOW)
def test_hg_kept_cu_seqlens_replaced_by_metadata_ops(how):
    require_built(64, torch.bfloat16)
    q, k, v, dout = _varlen_inputs(torch.bfloat16)
    cu = hg_kept_cu_seqlens()
    out, lse, grads = run_attention_varlen(q, k, v, dout, cu, cu, 30, 30, causal=True)
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu.clone(), cu.clone(), f"{how} before", causal=True)
    version = cu._version
    hg_replace(cu, how)
    assert cu.tolist() == HG_NEW[how] and cu._version != version
    out, lse, grads = run_attention_varlen(q, k, v, dout, cu, cu, 30, 30, causal=True)
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu.clone(), cu.clone(), f"{how} after", causal=True)


def hg_kept_problem(what):
    """((q, k, v, dout), kept, new) after one call with `kept` (cu_seqlens or document_ids, bf16 head_dim 64, GQA 4/2,
    causal), so that the library keeps notes for it; new: the values it is then given."""
    require_built(64, torch.bfloat16)
    dtype = torch.bfloat16
    if what == "cu_seqlens":
        q, k, v, dout = _varlen_inputs(dtype)
        kept = torch.tensor(HG_OLD, dtype=torch.int32, device=DEVICE)
        new = torch.tensor(HG_NEW["set"], dtype=torch.int32, device=DEVICE)
        run_attention_varlen(q, k, v, dout, kept, kept, 30, 30, causal=True)
    else:
        kept, new = hg_documents()
        q, k, v, dout = (randn(2, 96, 4, 64, dtype=dtype), randn(2, 96, 2, 64, dtype=dtype),
                         randn(2, 96, 2, 64, dtype=dtype), randn(2, 96, 4, 64, dtype=dtype))
        run_attention(q, k, v, dout, causal=True, document_ids=kept)
    return (q, k, v, dout), kept, new


def hg_check_follows(what, inputs, kept, new, name):
    """A call with `kept` by the rule against the boundaries / documents of `new`."""
    q, k, v, dout = inputs
    if what == "cu_seqlens":
        out, lse, grads = run_attention_varlen(q, k, v, dout, kept, kept, 30, 30, causal=True)
        check_attention_varlen(out, lse, grads, q, k, v, dout, new, new, name, causal=True)
    else:
        out, lse, grads = run_attention(q, k, v, dout, causal=True, document_ids=kept)
        check_attention(out, lse, grads, q, k, v, dout, name, causal=True, document_ids=new)


@pytest.mark.parametrize("what", ["cu_seqlens", "document_ids"])
def test_hg_swap_of_a_kept_tensor_refused_as_documented_then_copy_followed(what):
    """docs/conventions.md: swap_tensors refuses a tensor the library keeps a weak reference to; copy_ is the
    remedy, and the next call follows it."""
    inputs, kept, new = hg_kept_problem(what)
    with pytest.raises(RuntimeError, match="weakref"):
        torch.utils.swap_tensors(kept, new.clone())
    kept.copy_(new)
    hg_check_follows(what, inputs, kept, new, "after copy_")


@pytest.mark.parametrize("what", ["cu_seqlens", "document_ids"])
def test_hg_swapped_in_values_followed_where_any_weakref_lets_the_swap_through(what):
    inputs, kept, new = hg_kept_problem(what)
    with swap_allowing_plain_weakrefs(), pytest.raises(RuntimeError, match="weakref"):
        swap_into(kept, new)  # #190739: the notes' weakref subclass still blocks, as torch 2.11's check does
    with swap_allowing_any_weakrefs():  # #190604
        swap_into(kept, new)
    assert torch.equal(kept, new)
    hg_check_follows(what, inputs, kept, new, "after the swap")


# ------------------------------------------------------------------ HH on the GPU

def test_hh_float32_references_from_two_threads_stay_full_float32():
    q, k, v = (randn(1, 256, 2, 128, dtype=torch.float32) for _ in range(3))
    q2, k2, v2 = (randn(1, 256, 2, 128, dtype=torch.float32) for _ in range(3))
    alone = attention_ref(q2, k2, v2, causal=True)
    legacy = torch.get_float32_matmul_precision()
    saved = torch.backends.cuda.matmul.fp32_precision
    try:
        products = []
        for precision in ("high", "highest"):
            torch.set_float32_matmul_precision(precision)
            products.append(torch.einsum("bqhd,bkhd->bhqk", q2, k2))
    finally:
        torch.set_float32_matmul_precision(legacy)
        torch.backends.cuda.matmul.fp32_precision = saved
    if torch.equal(*products):
        pytest.skip("TF32 changes no product on this GPU: a lowered precision could not be seen")
    _, got_b, seen_b, after = hh_interleaved(lambda *a: attention_ref(*a, causal=True), (q, k, v), (q2, k2, v2))
    assert seen_b == "highest", f"thread B's reference computed its scores under {seen_b!r}"
    # Not bitwise: cuBLAS on another thread's handle and stream need not pick the same algorithm. float32 products
    # agree to a few ulps; TF32's 10-bit mantissa moves out by ~1e-3.
    err = (got_b[0] - alone[0]).abs().max().item()
    assert err <= 1e-5, f"thread B's float32 out differs from the reference alone by {err:.1e} (its products in TF32?)"
    assert after == "high", f"the caller's 'high' came back as {after!r}"


# ------------------------------------------------------------------ HI on the GPU

def test_hi_cu_seqlens_refilled_by_another_thread_during_the_read():
    require_built(64, torch.bfloat16)
    q, k, v, dout = _varlen_inputs(torch.bfloat16)
    buffer = torch.tensor(HG_OLD, dtype=torch.int32, device=DEVICE)
    new = torch.tensor(HG_NEW["set"], dtype=torch.int32, device=DEVICE)
    with refilled_during_read(interface, "_read_cu_seqlens", buffer, new):
        run_attention_varlen(q, k, v, dout, buffer, buffer, 30, 30, causal=True)  # the racing call: either values
    assert torch.equal(buffer, new)
    out, lse, grads = run_attention_varlen(q, k, v, dout, buffer, buffer, 30, 30, causal=True)
    check_attention_varlen(out, lse, grads, q, k, v, dout, new, new, "the call after the refill", causal=True)


def test_hi_document_ids_refilled_by_another_thread_during_the_read():
    require_built(64, torch.bfloat16)
    dtype = torch.bfloat16
    buffer, new = hg_documents()
    q, k, v, dout = (randn(2, 96, 4, 64, dtype=dtype), randn(2, 96, 2, 64, dtype=dtype),
                     randn(2, 96, 2, 64, dtype=dtype), randn(2, 96, 4, 64, dtype=dtype))
    with refilled_during_read(interface, "document_bounds", buffer, new):
        run_attention(q, k, v, dout, causal=True, document_ids=buffer)
    assert torch.equal(buffer, new)
    out, lse, grads = run_attention(q, k, v, dout, causal=True, document_ids=buffer)
    check_attention(out, lse, grads, q, k, v, dout, "the call after the refill", causal=True, document_ids=new)
