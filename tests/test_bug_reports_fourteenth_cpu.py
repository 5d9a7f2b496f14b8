"""Fourteenth round of the bug hunt (tests/bug_report_sources.md, "Fourteenth round"): CPU tests.

DG: tensors made on the ambient default device. ``torch.set_default_device(...)`` and ``with torch.device(...)`` send
every tensor made without a ``device`` there (mistral-inference#215 and xformers#1064: masks made on cuda:0 for a model
on cuda:1; mlverse/torch#1473: a causal mask made on the default device; huggingface/transformers#47547: a
``torch.tensor`` made on the GPU inside a CUDA graph capture). The transformers integration recognises mask patterns
by evaluating the model's mask function on small index tensors that it means to keep on the host; they were made
without a device, so under a CUDA default device each recognition ran GPU kernels and synchronised the host
(``bool(torch.equal(...))``), and under a default device without kernels for those ops the recognition raised. Here
the default device is "meta" (a CPU-only stand-in for "cuda": a tensor made without a device lands there, and
``aten::equal`` has no meta kernel). Fixed: the index tensors name the CPU. The library's own paths (document bounds,
cu_seqlens offsets, the padding of attention_varlen, the integration's documents and unpadding) already named their
devices and dtypes; they are checked here too, bit for bit against the call under the plain defaults.

DH: tensors with PyTorch's lazy negative bit (``torch._neg_view``; ``x.conj().imag`` of a complex tensor is one): the
values are the negation of the memory. A kernel that reads the memory of such a tensor computes with the wrong sign
(pytorch/pytorch#56058 added the bit and a fallback that resolves it for operators; flagos-ai/Torch-FL#211: raw copy
paths that ignored it returned unnegated values). The ops must receive q, k, v, dO, cu_seqlens and the document
bounds resolved (the dispatcher's Negative fallback, reached because the Python layer and the C++ autograd node call
the ops through the dispatcher), with every result bitwise that of the same values without the bit.

The ops run through the CPU stand-ins of tests/cpu_stand_ins.py (the extension's op schemas, fake kernels and C++
autograd node; float32 references for the kernels).
"""


import pytest
import torch
from torch.overrides import TorchFunctionMode

from flash_attn_hopper import attention, attention_varlen, interface

from cpu_stand_ins import STAND_INS, ops_on_cpu
from gpu_helpers import ambient_defaults

from optional_deps import requires_transformers


class _FactoryDevices(TorchFunctionMode):
    """Records the device of every tensor a torch function returns while active."""

    def __init__(self):
        super().__init__()
        self.devices = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.devices.add(t.device.type)
        return out


# ------------------------------------------------------------------------------ DG: the integration's mask patterns

def _mask_cases():
    from transformers.masking_utils import (
        and_masks, bidirectional_mask_function, causal_mask_function, chunked_overlay, or_masks,
        sliding_window_bidirectional_mask_function, sliding_window_causal_mask_function)

    common = dict(batch_size=1, q_length=16, kv_length=16, allow_is_causal_skip=True, dtype=torch.float32)
    return {
        "causal": (dict(mask_function=causal_mask_function, **common), None),
        "sliding_causal": (dict(mask_function=sliding_window_causal_mask_function(5), local_size=5, **common), None),
        "sliding_bidirectional": (dict(mask_function=sliding_window_bidirectional_mask_function(4), local_size=4,
                                       **common), None),
        "overlay_everywhere": (dict(mask_function=or_masks(causal_mask_function, bidirectional_mask_function),
                                    **common), None),
        "wrong_window": (dict(mask_function=sliding_window_causal_mask_function(6), local_size=5, **common),
                         ValueError),
        "chunked": (dict(mask_function=and_masks(chunked_overlay(4, torch.zeros(1, dtype=torch.long)),
                                                 sliding_window_causal_mask_function(5)), local_size=5, **common),
                    ValueError),
    }


@requires_transformers
@pytest.mark.parametrize("how", ["set_default_device", "device_context"])
@pytest.mark.parametrize("case", ["causal", "sliding_causal", "sliding_bidirectional", "overlay_everywhere",
                                  "wrong_window", "chunked"])
def test_mask_patterns_recognised_on_the_host_whatever_the_default_device(case, how):
    """DG: flash_attn_hopper_mask answers as under the plain defaults (None: the kernel masks; or the ValueError of a
    pattern it does not compute), and every tensor its recognition makes stays on the CPU. Before the fix the
    recognition of a window raised NotImplementedError ("aten::equal ... Meta tensors") under a meta default device;
    under a CUDA one it ran on the GPU and synchronised the host at each model forward."""
    import flash_attn_hopper.integrations.transformers as fah_tf

    fah_tf.register()
    kwargs, error = _mask_cases()[case]
    if error is not None:
        with pytest.raises(error, match="mask pattern"):
            fah_tf.flash_attn_hopper_mask(**kwargs)
    else:
        assert fah_tf.flash_attn_hopper_mask(**kwargs) is None
    record = _FactoryDevices()
    ambient = ambient_defaults("meta") if how == "set_default_device" else torch.device("meta")
    with ambient, record:
        if error is not None:
            with pytest.raises(error, match="mask pattern"):
                fah_tf.flash_attn_hopper_mask(**kwargs)
        else:
            assert fah_tf.flash_attn_hopper_mask(**kwargs) is None
    assert "meta" not in record.devices, f"{case}: the mask recognition made tensors on the default device"
    if case not in ("causal",):
        assert record.devices == {"cpu"}, f"{case}: the recognition evaluated no index tensors ({record.devices})"


# ------------------------------------------------------------------------------ DG: the library's own tensors

def _under_plain_defaults(fn):
    """A stand-in run with the CPU default device and float32 default dtype: the stand-ins (test code) make tensors
    without naming them, the library must not."""
    def op(*args):
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            with torch.device("cpu"):
                return fn(*args)
        finally:
            torch.set_default_dtype(old)
    return op


@pytest.fixture
def cpu_ops(monkeypatch):
    impls = {name: _under_plain_defaults(fn) for name, fn in STAND_INS.items()}
    with ops_on_cpu(monkeypatch, impls, "its op schemas and autograd node"):
        yield monkeypatch


def _dense_inputs(batch=2, seqlen=70, heads=4, heads_k=2, head_dim=64):
    q = torch.randn(batch, seqlen, heads, head_dim, dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen, heads_k, head_dim, dtype=torch.bfloat16)
    v = torch.randn(batch, seqlen, heads_k, head_dim, dtype=torch.bfloat16)
    dout = torch.randn(batch, seqlen, heads, head_dim, dtype=torch.bfloat16)
    return q, k, v, dout


def _varlen_inputs(lengths=(30, 0, 70, 40), tail=5, heads=4, heads_k=2, head_dim=64):
    total = sum(lengths) + tail  # rows past the last sequence
    q = torch.randn(total, heads, head_dim, dtype=torch.bfloat16)
    k = torch.randn(total, heads_k, head_dim, dtype=torch.bfloat16)
    v = torch.randn(total, heads_k, head_dim, dtype=torch.bfloat16)
    dout = torch.randn(total, heads, head_dim, dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, dout, cu, max(lengths)


def _run(fn, tensors, dout):
    """(out, lse, dq, dk, dv) of fn on leaves made from tensors (q, k, v) and the loss out·dout + lse."""
    leaves = [t.detach().requires_grad_(True) for t in tensors]
    out, lse = fn(*leaves)
    grads = torch.autograd.grad((out.float() * dout.float()).sum() + lse.sum(), leaves)
    return (out.detach(), lse.detach(), *grads)


def _library_cases():
    """name -> (function of q, k, v giving (out, lse), (q, k, v), dout)."""
    q, k, v, dout = _dense_inputs()
    ids = torch.tensor([[0] * 30 + [1] * 25 + [2] * 15, [7] * 70])
    qv, kv, vv, doutv, cu, longest = _varlen_inputs()

    def documents(q, k, v):
        return attention(q, k, v, causal=True, return_lse=True, document_ids=ids.clone())

    def varlen(q, k, v):
        return attention_varlen(q, k, v, cu.clone(), cu.clone(), longest, longest, causal=True, return_lse=True)

    return {"documents": (documents, (q, k, v), dout), "varlen": (varlen, (qv, kv, vv), doutv),
            "varlen_trusted": (varlen, (qv, kv, vv), doutv)}


@pytest.mark.parametrize("ambient", ["meta_float64", "meta_float16"])
@pytest.mark.parametrize("case", ["documents", "varlen", "varlen_trusted"])
def test_library_tensors_follow_the_inputs_not_the_default_device(cpu_ops, case, ambient):
    """DG, the library's own tensors: attention with document_ids (the document bounds), attention_varlen with a
    host-checked cu_seqlens (the padding of rows past the last sequence) and with trusted ones (the clamped offsets of
    a capture or trace: ``_capturing`` answers True), forward and backward, under a meta default device and another
    default dtype, give bitwise the results of the plain defaults."""
    fn, tensors, dout = _library_cases()[case]
    if case == "varlen_trusted":
        cpu_ops.setattr(interface, "_capturing", lambda device: True)
    expected = _run(fn, tensors, dout)
    dtype = torch.float64 if ambient == "meta_float64" else torch.float16
    with ambient_defaults("meta", dtype):
        got = _run(fn, tensors, dout)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), expected, got):
        assert b.device.type == "cpu" and b.dtype == a.dtype, f"{case} {name}: {b.device} {b.dtype}"
        assert torch.equal(a, b), f"{case} {name} differs under the ambient defaults"


@requires_transformers
@pytest.mark.parametrize("case", ["position_ids", "padding_mask", "packed_kwargs"])
def test_integration_tensors_follow_the_inputs_not_the_default_device(cpu_ops, case):
    """DG through the transformers attention function: documents from position_ids, a padded batch (unpadding
    indices, cu_seqlens, the scatter back) and DataCollatorWithFlattening's cu_seq_lens keywords, under a meta
    default device: bitwise the results of the plain defaults, forward and backward."""
    import types

    import flash_attn_hopper.integrations.transformers as fah_tf

    fah_tf.register()
    module = types.SimpleNamespace(is_causal=True, layer_idx=0)
    batch = 1 if case == "packed_kwargs" else 2
    q = torch.randn(batch, 4, 24, 64, dtype=torch.bfloat16)
    k = torch.randn(batch, 2, 24, 64, dtype=torch.bfloat16)
    v = torch.randn(batch, 2, 24, 64, dtype=torch.bfloat16)
    dout = torch.randn(batch, 24, 4, 64, dtype=torch.bfloat16)
    mask, kwargs = None, {}
    if case == "position_ids":
        kwargs["position_ids"] = torch.tensor([list(range(10)) + list(range(14)), list(range(24))])
    elif case == "padding_mask":
        mask = torch.ones(batch, 24, dtype=torch.bool)
        mask[0, :5] = False  # left padding
        mask[1, 20:] = False  # right padding
    else:
        cu = torch.tensor([0, 9, 9, 24], dtype=torch.int32)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=15, max_length_k=15)

    def run():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out, _ = fah_tf.flash_attn_hopper_attention_forward(module, *leaves, mask, **kwargs)
        grads = torch.autograd.grad((out.float() * dout.float()).sum(), leaves)
        return (out.detach(), *grads)

    expected = run()
    cpu_ops.setattr(fah_tf, "_DOCUMENTS", interface._ValueNotes())  # nothing kept from the first run
    cpu_ops.setattr(fah_tf, "_UNPADDING", interface._ValueNotes())
    cpu_ops.setattr(interface, "_DOCUMENT_BOUNDS", interface._ValueNotes())
    cpu_ops.setattr(interface, "_CHECKED_CU_SEQLENS", interface._ValueNotes())
    with ambient_defaults("meta"):
        got = run()
    for name, a, b in zip(("out", "dq", "dk", "dv"), expected, got):
        assert b.device.type == "cpu", f"{case} {name} on {b.device}"
        assert torch.equal(a, b), f"{case} {name} differs under a meta default device"


# ------------------------------------------------------------------------------ DH: the negative bit

def _neg_view(t):
    """A tensor equal to t whose memory holds -t and whose negative bit is set."""
    view = torch._neg_view(-t)
    assert view.is_neg() and torch.equal(view, t)
    return view


@pytest.fixture
def resolved_ops(monkeypatch):
    """The stand-ins, each first asserting that no tensor argument reaches it with the negative bit set (a kernel
    reads the memory). Yields the calls as (op name, its arguments, tensors cloned)."""
    seen = []

    def checking(name, fn):
        def op(*args):
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and (a.is_neg() or a.is_conj()):
                    raise AssertionError(f"{name}: argument {i} reached the kernel with a lazy negative/conjugate bit")
            seen.append((name, [a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
            return fn(*args)
        return op

    with ops_on_cpu(monkeypatch, {name: checking(name, fn) for name, fn in STAND_INS.items()},
                    "its op schemas and autograd node"):
        yield seen


@pytest.mark.parametrize("case", ["dense", "documents", "varlen", "varlen_trusted", "dout_only"])
def test_negative_bit_views_reach_the_ops_resolved(resolved_ops, monkeypatch, case):
    """DH: q, k, v and dO (and cu_seqlens, document_ids) as negative-bit views of the same values: forward and
    backward reach the ops without the bit and with the plain tensors' bits (every argument of the forward op, and of
    the backward op all but the saved out and LSE, which are the run's own forward's), and out, LSE, dQ, dK, dV match
    the plain tensors'. (Outputs are compared to bf16's rounding, not bitwise: the stand-ins' float32 CPU matmuls
    are not reproducible across memory placements and threads, and about one run in twenty rounded an element of
    out the other way; a memory read without the bit would flip signs.)"""
    if case == "varlen_trusted":
        monkeypatch.setattr(interface, "_capturing", lambda device: True)
    if case.startswith("varlen"):
        q, k, v, dout, cu, longest = _varlen_inputs()

        def fn(q, k, v, cu):
            return attention_varlen(q, k, v, cu, cu, longest, longest, causal=True, window_size=(20, 0),
                                    return_lse=True)
        extra_plain, extra_neg = (cu.clone(),), (_neg_view(cu),)
    else:
        q, k, v, dout = _dense_inputs()
        ids = torch.tensor([[0] * 30 + [1] * 25 + [2] * 15, [7] * 70]) if case == "documents" else None

        def fn(q, k, v, ids=None):
            return attention(q, k, v, causal=True, softcap=30.0, return_lse=True, document_ids=ids)
        extra_plain = () if ids is None else (ids,)
        extra_neg = () if ids is None else (_neg_view(ids),)

    def run(tensors, dout, extra):
        leaves = [t.detach().requires_grad_(True) for t in tensors]
        out, lse = fn(*leaves, *extra)
        grads = torch.autograd.grad((out, lse), leaves, (dout, torch.ones_like(lse)))
        return (out.detach(), lse.detach(), *grads)

    expected = run((q, k, v), dout, extra_plain)
    plain_calls = len(resolved_ops)
    if case == "dout_only":
        got = run((q, k, v), _neg_view(dout), extra_plain)
    else:
        # (detach keeps the bit: the leaves made from the views are negative-bit views themselves)
        assert _neg_view(q).detach().is_neg()
        got = run((_neg_view(q), _neg_view(k), _neg_view(v)), _neg_view(dout), extra_neg)
    calls_plain, calls_neg = resolved_ops[:plain_calls], resolved_ops[plain_calls:]
    assert [c[0] for c in calls_plain] == [c[0] for c in calls_neg]
    assert any(name.startswith("bwd") for name, _ in calls_neg), "the backward op was not reached"
    for (name, plain_args), (_, neg_args) in zip(calls_plain, calls_neg):
        for i, (a, b) in enumerate(zip(plain_args, neg_args)):
            if name.startswith("bwd") and i in (4, 5):  # out and LSE: each run's own forward's
                continue
            same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            assert same, f"{case}: {name} argument {i} differs for negative-bit views of the same values"
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), expected, got):
        torch.testing.assert_close(b, a, msg=lambda m: f"{case}: {name} for negative-bit views: {m}")
