"""The CPU part of the seventh round of bug-report tests (class BE of tests/bug_report_sources.md; the GPU test is
tests/test_bug_reports_seventh_gpu.py::test_functorch_transforms_refused_or_right): under functorch transforms
(torch.vmap, also inside inference_mode, and torch.func.grad) the Python layer of attention and attention_varlen sees
functorch's wrapped tensors with per-example shapes. Its checks must still run on those shapes (a bad argument is still
refused by name, not waved through because the tensors are wrapped) and must not fail for a reason of their own (a
data pointer, a host read or a data-dependent branch on a wrapped tensor), so that what reaches the op is the
transform, which torch then batches or refuses with its own message (xformers issue 768, torch-xpu-ops issue 5194:
"either register a Vmap rule ... or raise a clear, actionable error").

No GPU is needed: as in tests/test_bug_reports_fifth_cpu.py, the device check is replaced by a no-op and the extension
check by a sentinel exception, so a call that passes every argument check shows up as _PassedEveryCheck; the cache of
checked calls starts empty in each test, so that the checks run."""

import re

import pytest
import torch

from flash_attn_hopper import _ops, attention, attention_varlen, interface

TRANSFORMS = ["vmap", "vmap_inference", "func_grad"]
ENSEMBLE = 3


class _PassedEveryCheck(Exception):
    pass


@pytest.fixture
def checks_only(monkeypatch):
    """Device checks pass; reaching the extension check raises _PassedEveryCheck; no call is in the checked cache."""
    monkeypatch.setattr(interface, "_check_devices", lambda named: None)
    monkeypatch.setattr(interface, "_CHECKED_CALLS", {})

    def reached():
        raise _PassedEveryCheck("every argument check passed: on a GPU the call would go on to the op")

    monkeypatch.setattr(_ops, "require_extension", reached)


def _names_one_of(message, names):
    return any(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", message) for n in names)


def _transformed(transform, f, *tensors):
    """f(*tensors) under the transform: vmap over a leading ensemble dimension (added here), or torch.func.grad of the
    output's sum with respect to the first tensor."""
    if transform == "func_grad":
        return torch.func.grad(lambda first, *rest: f(first, *rest).float().sum())(*tensors)
    batched = [t.unsqueeze(0).expand(ENSEMBLE, *t.shape).clone() for t in tensors]
    if transform == "vmap_inference":
        with torch.inference_mode():
            return torch.vmap(f)(*batched)
    return torch.vmap(f)(*batched)


def _inputs(api, head_dim=64, nheads_k=2):
    if api == "varlen":
        return (torch.randn(7, 4, head_dim).half(), torch.randn(9, nheads_k, head_dim).half(),
                torch.randn(9, nheads_k, head_dim).half())
    seqlen_k = 5 if api == "documents" else 6
    return (torch.randn(2, 5, 4, head_dim).half(), torch.randn(2, seqlen_k, nheads_k, head_dim).half(),
            torch.randn(2, seqlen_k, nheads_k, head_dim).half())


def _call(api, **opts):
    """The function of (q, k, v) that the transforms wrap; cu_seqlens and document_ids are shared, not batched."""
    if api == "varlen":
        cu_q = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
        cu_k = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
        return lambda q, k, v: attention_varlen(q, k, v, cu_q, cu_k, 4, 4, causal=True, **opts)
    ids = torch.tensor([[0, 0, 1, 1, 1], [2, 2, 2, 3, 3]]) if api == "documents" else None
    return lambda q, k, v: attention(q, k, v, causal=True, document_ids=ids, **opts)


# https://github.com/facebookresearch/xformers/issues/768 and https://github.com/intel/torch-xpu-ops/issues/5194
@pytest.mark.parametrize("api", ["dense", "documents", "varlen"])
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_checks_pass_under_transforms_and_reach_the_op(transform, api, checks_only):
    """Valid arguments (GQA 4/2, causal; packed documents; a varlen batch with an empty sequence) under vmap, vmap in
    inference_mode, and torch.func.grad: every argument check passes on the per-example shapes and the call reaches the
    op (the sentinel), with no error of the Python layer's own."""
    with pytest.raises(_PassedEveryCheck):
        _transformed(transform, _call(api), *_inputs(api))


BAD_ARGUMENTS = {
    "head_dim": (dict(head_dim=60), {}, ["q", "head_dim"]),
    "nheads_k": (dict(nheads_k=3), {}, ["k", "nheads_k"]),
    "window_size": ({}, dict(window_size=(-2, 0)), ["window_size"]),
    "softmax_scale": ({}, dict(softmax_scale=float("nan")), ["softmax_scale"]),
}


@pytest.mark.parametrize("bad", list(BAD_ARGUMENTS))
@pytest.mark.parametrize("api", ["dense", "varlen"])
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_bad_arguments_refused_by_name_under_transforms(transform, api, bad, checks_only):
    """The same calls with one bad argument (a head_dim that is not a multiple of 8, 3 K/V heads for 4 query heads, a
    window side below -1, a NaN softmax_scale) under each transform: refused by a TypeError / ValueError naming the
    argument, as without the transform, never passed on to the op because the tensors are functorch's wrappers."""
    shape_opts, call_opts, names = BAD_ARGUMENTS[bad]
    with pytest.raises((TypeError, ValueError)) as info:
        _transformed(transform, _call(api, **call_opts), *_inputs(api, **shape_opts))
    assert _names_one_of(str(info.value), names), f"{type(info.value).__name__} names none of {names}: {info.value}"
