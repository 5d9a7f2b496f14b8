"""Forty-second round of the bug hunt (tests/bug_report_sources.md, "Forty-second round"), CPU part: the host paths
of tests/test_bug_reports_fortysecond_gpu.py's classes, run without a GPU or the extension. attention and
attention_varlen run on CPU tensors with the device, sm90, build and extension checks passed and their ops replaced by
a recorder (`recording_ops`), so what a call hands the kernels (the cu_seqlens copy checked, the document bounds) is
read directly; the notes start empty.

- HG: cu_seqlens kept by a call, then replaced in place by resize_, set_ or as_strided_: the next call hands the op
  the new values. torch.utils.swap_tensors of a kept cu_seqlens or document_ids (also through load_state_dict under
  torch.__future__.set_swap_module_params_on_conversion(True)) is refused with PyTorch's weak-reference error, as
  docs/conventions.md says, and the documented remedy (copy_) is followed; a tensor never passed swaps. Where the swap
  is let through as pytorch/pytorch#190739 proposes (plain weak references do not block), the next call must hand
  the op the swapped-in values.
- HH: two threads' references interleaved (A enters, B enters, A leaves, B computes, B leaves): B's scores computed
  under "highest", and the caller's "high" unchanged afterwards; run one after the other, the same threads pass (the
  harness can tell).
- HI: a write by another thread between a note's read of the values and its store: the next call (no write since)
  hands the op the values the tensor holds; a write before the call is followed (the control)."""

import types

import pytest
import torch

import test_bug_reports_fortysecond_gpu as gpu_file
from flash_attn_hopper import interface, testing
from flash_attn_hopper.interface import attention, attention_varlen
from flash_attn_hopper.testing import attention_ref


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(gpu_file, "DEVICE", "cpu")
    torch.manual_seed(42)


@pytest.fixture
def recording_ops(monkeypatch, on_cpu):
    """The host checks up to the ops pass on CPU tensors; the ops record their tensor arguments: ("fwd", doc_bounds)
    or ("fwd_varlen", cu_seqlens_q, cu_seqlens_k) as lists. Fresh checked-call caches and notes."""
    seen = []

    def fwd(q, k, v, *args):
        doc_bounds = args[-1]
        seen.append(("fwd", None if doc_bounds is None else doc_bounds.tolist()))
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def fwd_varlen(q, k, v, cu_q, cu_k, *args):
        seen.append(("fwd_varlen", cu_q.tolist(), cu_k.tolist()))
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(interface, "_check_devices", lambda named: None)
    monkeypatch.setattr(interface, "_check_sm90", lambda name, device: None)
    monkeypatch.setattr(interface, "_check_compiled", lambda *a: None)
    monkeypatch.setattr(interface._ops, "require_extension", lambda: None)
    monkeypatch.setattr(interface, "_capturing", lambda device: False)
    monkeypatch.setattr(interface, "_CHECKED_CALLS", {})
    monkeypatch.setattr(interface, "_CHECKED_VARLEN_CALLS", {})
    monkeypatch.setattr(interface, "_CHECKED_CU_SEQLENS", interface._ValueNotes())
    monkeypatch.setattr(interface, "_DOCUMENT_BOUNDS", interface._ValueNotes())
    for name, op in (("fwd", fwd), ("fwd_varlen", fwd_varlen)):
        monkeypatch.setattr(torch.ops.flash_attn_hopper, name, types.SimpleNamespace(default=op), raising=False)
    return seen


def _varlen(total=30):
    q = torch.randn(total, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(total, 2, 64, dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def _dense(seqlen=96):
    q = torch.randn(2, seqlen, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, seqlen, 2, 64, dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def _call(what, kept, seen):
    """One call with `kept` as the cu_seqlens (self-attention) or the document_ids; returns what the op got."""
    if what == "cu_seqlens":
        q, k, v = _varlen()
        attention_varlen(q, k, v, kept, kept, 30, 30, causal=True)
    else:
        q, k, v = _dense()
        attention(q, k, v, causal=True, document_ids=kept)
    return seen[-1]


def _expected(what, values):
    if what == "cu_seqlens":
        return ("fwd_varlen", values.tolist(), values.tolist())
    return ("fwd", interface.document_bounds(values).tolist())


def _kept_and_new(what):
    if what == "cu_seqlens":
        return (torch.tensor(gpu_file.HG_OLD, dtype=torch.int32),
                torch.tensor(gpu_file.HG_NEW["set"], dtype=torch.int32))
    return gpu_file.hg_documents()


# ------------------------------------------------------------------ HG

@pytest.mark.parametrize("how", gpu_file.HG_HOW)
def test_hg_metadata_ops_on_kept_cu_seqlens_reach_the_op(recording_ops, how):
    cu = gpu_file.hg_kept_cu_seqlens()
    assert cu.is_contiguous() and cu.tolist() == gpu_file.HG_OLD
    assert _call("cu_seqlens", cu, recording_ops) == _expected("cu_seqlens", torch.tensor(gpu_file.HG_OLD))
    version = cu._version
    gpu_file.hg_replace(cu, how)
    assert cu.tolist() == gpu_file.HG_NEW[how] and cu._version != version, "the premise: a new version"
    assert _call("cu_seqlens", cu, recording_ops) == _expected("cu_seqlens", cu.clone())


@pytest.mark.parametrize("what", ["cu_seqlens", "document_ids"])
def test_hg_swap_of_a_kept_tensor_refused_as_documented_then_copy_followed(recording_ops, what):
    kept, new = _kept_and_new(what)
    assert _expected(what, kept) != _expected(what, new), "the two values must give the op different arguments"
    never_passed, _ = _kept_and_new(what)
    gpu_file.swap_into(never_passed, new)  # the control: swap_tensors itself works here
    assert torch.equal(never_passed, new)
    old = kept.clone()
    assert _call(what, kept, recording_ops) == _expected(what, kept)
    with pytest.raises(RuntimeError, match="Cannot swap t1 because it has weakref associated with it"):
        gpu_file.swap_into(kept, new)
    assert torch.equal(kept, old), "a refused swap leaves the values"
    kept.copy_(new)  # the documented remedy
    assert _call(what, kept, recording_ops) == _expected(what, new)
    # load_state_dict under the swap future: Tensor.module_load's default copies the values in (copy_, a new
    # version) before the swap, which is then refused; the next call follows what the buffer holds
    module = torch.nn.Module()
    module.register_buffer("packing", kept)
    was = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)packing.*has weakref associated with it"):
            module.load_state_dict({"packing": old.clone()})
    finally:
        torch.__future__.set_swap_module_params_on_conversion(was)
    assert module.packing is kept
    assert _call(what, kept, recording_ops) == _expected(what, kept.clone())


@pytest.mark.parametrize("what", ["cu_seqlens", "document_ids"])
def test_hg_swapped_in_values_followed_where_any_weakref_lets_the_swap_through(recording_ops, what):
    """Latent fault (torch-version dependent), fixed in session 74: on a PyTorch whose swap_tensors lets plain weak
    references through (pytorch/pytorch#190739) the notes' weakref subclass still blocks the swap of a tensor with
    notes; where any weak reference is let through (#190604) the notes, stamped with the TensorImpl beside the
    version counter, follow the values swapped in (before: keyed by identity and version alone through a plain
    weakref.ref, they served the values swapped out)."""
    kept, new = _kept_and_new(what)
    assert _call(what, kept, recording_ops) == _expected(what, kept)
    version, identity = kept._version, id(kept)
    with gpu_file.swap_allowing_plain_weakrefs(), pytest.raises(RuntimeError, match="weakref"):
        gpu_file.swap_into(kept, new)
    assert _call(what, kept, recording_ops) == _expected(what, kept), "the refused swap left the kept values"
    with gpu_file.swap_allowing_any_weakrefs():
        gpu_file.swap_into(kept, new)
    assert torch.equal(kept, new) and id(kept) == identity
    assert kept._version == version, "the premise: the swapped-in content has the kept version (0)"
    assert _call(what, kept, recording_ops) == _expected(what, new), "the op got the values swapped out"


def test_hg_plain_weakrefs_allowed_only_inside_the_emulation():
    kept, new = _kept_and_new("cu_seqlens")
    import weakref

    ref = weakref.ref(kept)
    with pytest.raises(RuntimeError, match="weakref"):
        gpu_file.swap_into(kept, new)
    keyed = weakref.WeakValueDictionary({"k": kept})
    with gpu_file.swap_allowing_plain_weakrefs():
        with pytest.raises(RuntimeError, match="weakref"):  # a container's KeyedRef still blocks (#190739)
            gpu_file.swap_into(kept, new)
        del keyed
        gpu_file.swap_into(kept, new)
    assert torch.equal(kept, new) and ref() is kept
    with pytest.raises(RuntimeError, match="weakref"):
        gpu_file.swap_into(kept, new)


# ------------------------------------------------------------------ HH

def _hh_inputs():
    return [tuple(torch.randn(1, 33, 2, 16) for _ in range(3)) for _ in range(2)]


def test_hh_references_from_two_threads_keep_highest_and_the_callers_setting(on_cpu):
    """FAULT: testing._reference_mode saves and restores process-wide settings per entry; interleaved across two
    threads, thread B's reference computes under the caller's lowered precision once thread A has left, and B's exit
    puts A's "highest" back for good."""
    (a, b) = _hh_inputs()
    result_a, result_b, seen_b, after = gpu_file.hh_interleaved(attention_ref, a, b)
    alone = attention_ref(*b)
    assert torch.equal(result_b[0], alone[0]) and torch.equal(result_a[0], attention_ref(*a)[0])
    assert seen_b == "highest", f"thread B's reference computed its scores under {seen_b!r}"
    assert after == "high", f"the caller's 'high' came back as {after!r}"


def test_hh_a_reference_entering_after_another_thread_lowered_the_precision_runs_in_highest():
    """Thread A inside a reference, then the caller sets "high" (training turning TF32 on), then thread B's reference
    enters: B computes under "highest" (review of the first HH fix, which set it only for the first thread in)."""
    import threading

    (qa, ka, va), (qb, kb, vb) = _hh_inputs()
    original = testing._scores
    a_inside, release_a, seen = threading.Event(), threading.Event(), {}

    def scores(*args, **kwargs):
        name = threading.current_thread().name
        if name == "a":
            a_inside.set()
            release_a.wait(60)
        seen[name] = torch.get_float32_matmul_precision()
        return original(*args, **kwargs)

    legacy = torch.get_float32_matmul_precision()
    try:
        testing._scores = scores
        a = threading.Thread(target=lambda: attention_ref(qa, ka, va), name="a")
        a.start()
        assert a_inside.wait(60)
        torch.set_float32_matmul_precision("high")
        b = threading.Thread(target=lambda: attention_ref(qb, kb, vb), name="b")
        b.start()
        b.join(60)
        release_a.set()
        a.join(60)
    finally:
        testing._scores = original
        release_a.set()
        torch.set_float32_matmul_precision(legacy)
    assert seen == {"a": "highest", "b": "highest"}, seen


def test_hh_references_one_thread_after_the_other_keep_both(on_cpu):
    """The control: the same references on two threads run one after the other (no overlap)."""
    import threading

    legacy = torch.get_float32_matmul_precision()
    seen = []
    original = testing._scores

    def scores(*args, **kwargs):
        seen.append(torch.get_float32_matmul_precision())
        return original(*args, **kwargs)

    testing._scores = scores
    try:
        torch.set_float32_matmul_precision("high")
        for args in _hh_inputs():
            thread = threading.Thread(target=attention_ref, args=args, daemon=True)
            thread.start()
            thread.join(60)
        after = torch.get_float32_matmul_precision()
    finally:
        testing._scores = original
        torch.set_float32_matmul_precision(legacy)
    assert seen == ["highest", "highest"] and after == "high"


# ------------------------------------------------------------------ HI

@pytest.mark.parametrize("what", ["cu_seqlens", "document_ids"])
def test_hi_values_written_during_the_read_are_not_kept_for_later_calls(recording_ops, what):
    """FAULT: _ValueNotes.computed stores a result under the version read after computing it; a copy_ by another
    thread in between files the old values under the new version, served to every later call until the next write."""
    buffer, new = _kept_and_new(what)
    old = buffer.clone()
    reader = ("_read_cu_seqlens" if what == "cu_seqlens" else "document_bounds")
    with gpu_file.refilled_during_read(interface, reader, buffer, new):
        racing = _call(what, buffer, recording_ops)
    assert torch.equal(buffer, new), "the premise: the writer thread wrote during the call"
    # the racing call may use either values, for each argument (cu_seqlens_q and cu_seqlens_k are read in turn)
    choices = (_expected(what, old), _expected(what, new))
    assert len(racing) == len(choices[0]) and all(got in [c[i] for c in choices] for i, got in enumerate(racing)), \
        "the racing call used other values"
    assert _call(what, buffer, recording_ops) == _expected(what, new), "a later call got the old values"


@pytest.mark.parametrize("what", ["cu_seqlens", "document_ids"])
def test_hi_values_written_before_the_call_are_followed(recording_ops, what):
    buffer, new = _kept_and_new(what)
    assert _call(what, buffer, recording_ops) == _expected(what, buffer.clone())
    import threading

    writer = threading.Thread(target=lambda: buffer.copy_(new), daemon=True)
    writer.start()
    writer.join(60)
    assert _call(what, buffer, recording_ops) == _expected(what, new)


def test_hi_transformers_document_ids_written_during_their_making_are_made_again(monkeypatch):
    """HI through the transformers integration's kept document ids (`_documents`, from position_ids on the device):
    a write to position_ids by another thread while the ids are made leaves them stamped with the old version, so the
    next call makes them from the new positions (the review of round 42: the integration stamped after, as the notes
    did)."""
    pytest.importorskip("transformers")
    import threading

    from flash_attn_hopper.integrations import transformers as fah_tf

    monkeypatch.setattr(fah_tf, "_DOCUMENTS", interface._ValueNotes())
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    new = torch.tensor([[0, 1, 0, 1, 2, 3, 4, 5]])
    query = key = torch.zeros(1, 2, 8, 16)
    original, done = fah_tf._document_ids, []

    def making(*args, **kwargs):
        ids = original(*args, **kwargs)
        if not done:
            done.append(True)
            writer = threading.Thread(target=lambda: position_ids.copy_(new))
            writer.start()
            writer.join(60)
        return ids

    monkeypatch.setattr(fah_tf, "_document_ids", making)
    first = fah_tf._documents(position_ids, query, key)
    assert first.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]  # the racing call: the positions it read
    assert torch.equal(position_ids, new)
    assert fah_tf._documents(position_ids, query, key).tolist() == [[0, 0, 1, 1, 1, 1, 1, 1]]
