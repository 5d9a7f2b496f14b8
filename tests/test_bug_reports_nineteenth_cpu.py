"""Nineteenth round of the bug hunt (tests/bug_report_sources.md, "Nineteenth round"), CPU part.

EG: a float32 reference whose matrix products ran in TF32 (pytorch/pytorch#158979, triton-lang/triton#1671): the caller
set torch.set_float32_matmul_precision("high") (or the per-backend fp32_precision), so the public references of
flash_attn_hopper.testing were float32 in name only. FAULT: the references ran in the caller's precision. Fixed: they
run their products in full float32 (both matmul backends) and put the caller's settings back.
EH: a reference run inside the caller's autocast region (RL-Align/RL-Kernel#170, review: "the matmul can still run under
autocast or CUDA TF32 settings"): the "float32" reference then ran its products in bf16 / fp16. FAULT: the references
followed the caller's autocast. Fixed: autocast is off inside them, so they give the bits they give outside.
EI: a DTensor as q, k, v, document_ids or cu_seqlens (modelscope/DiffSynth-Studio#477: "flash_attn._flash_attn_forward.
default does not have a sharding strategy registered"). FAULT: the checks let it through and the op's DTensor dispatch
failed the same way, naming neither the argument nor a remedy. Fixed: a TypeError naming the argument, its placements
and what to pass (to_local / full_tensor), before any op runs.
EJ: the gradient references (attention_ref_grads, attention_varlen_ref_grads) under torch.inference_mode() (an
evaluation loop; Lightning-AI/pytorch-lightning#19910: enable_grad inside a test_step under inference mode records
nothing) or given inference tensors (a KV cache made in inference mode). FAULT: "element 0 of tensors does not
require grad" / "Setting requires_grad=True on inference tensor outside InferenceMode is not allowed". Fixed: they
leave inference mode and take copies of inference tensors; the gradients equal the normal-mode ones.
EK: the returned LSE updated in place (ring / context-parallel attention merges partial LSEs in place,
NVIDIA/TransformerEngine#716) before a backward that needs it. No fault: the op saves its LSE, so autograd's version
check refuses the backward by name ("modified by an inplace operation"); updating a clone works and gives the same
gradients; attention_varlen's padded LSE (rows past the last sequence) is a new tensor, free to update in place.

The ops run through the CPU stand-ins of tests/cpu_stand_ins.py.
"""

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen, testing

import cpu_stand_ins
from cpu_stand_ins import dense_inputs as _dense, stand_ins, varlen_inputs as _varlen


@pytest.fixture
def cpu_ops(monkeypatch):
    with stand_ins(monkeypatch):
        yield


_CU_Q = [0, 12, 30]
_CU_K = [0, 20, 34]


def _cu(values):
    return torch.tensor(values, dtype=torch.int32)


def _equal(a, b):
    """Same dtype and bits (NaN never expected here)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# The public references, each with the arguments of one call (q first: its device picks the autocast to turn off).
def _reference_calls():
    q, k, v = _dense()
    dout = torch.randn_like(q)
    dlse = torch.randn(2, 4, 17)
    qv, kv, vv = _varlen()
    doutv = torch.randn_like(qv)
    opts = dict(causal=True, window_size=(9, 0), softcap=3.0)
    return {
        "attention_ref": lambda: testing.attention_ref(q, k, v, upcast=True, **opts),
        "attention_ref_naive": lambda: testing.attention_ref(q, k, v, upcast=False, **opts),
        "attention_ref_grads": lambda: testing.attention_ref_grads(q, k, v, dout, dlse=dlse, **opts),
        "attention_bwd_ref": lambda: testing.attention_bwd_ref(q, k, v, dout, dlse=dlse, **opts),
        "attention_varlen_ref": lambda: testing.attention_varlen_ref(qv, kv, vv, _cu(_CU_Q), _cu(_CU_K), causal=True),
        "attention_varlen_ref_grads": lambda: testing.attention_varlen_ref_grads(
            qv, kv, vv, doutv, _cu(_CU_Q), _cu(_CU_K), causal=True),
    }


REFERENCES = list(_reference_calls())


# ------------------------------------------------------------------------------------------------------ EG

_BACKENDS = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)


def _matmul_state():
    """Both matmul backends' float32 precision, and the legacy setting ("mixed" where PyTorch refuses to read it)."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = "mixed"
    return [b.fp32_precision for b in _BACKENDS] + [legacy]


@pytest.fixture
def restore_matmul_precision():
    """Puts the legacy setting and both backends' back after the test (the legacy one first: it rewrites the
    backends')."""
    before = _matmul_state()
    yield
    torch.set_float32_matmul_precision(before[-1])
    for b, old in zip(_BACKENDS, before):
        b.fp32_precision = old
    assert _matmul_state() == before


def _lower_precision(how):
    if how == "legacy_high":
        torch.set_float32_matmul_precision("high")
    elif how == "legacy_medium":
        torch.set_float32_matmul_precision("medium")
    else:  # the per-backend API, as a training script using torch >= 2.9's new flags sets it
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.mkldnn.matmul.fp32_precision = "tf32"


@pytest.mark.parametrize("how", ["legacy_high", "legacy_medium", "per_backend_tf32"])
@pytest.mark.parametrize("name", REFERENCES)
def test_references_run_full_float32_products_under_a_lowered_matmul_precision(restore_matmul_precision, monkeypatch,
                                                                              how, name):
    """EG: with the caller's float32 matmul precision lowered, every product of the references (torch.einsum, and
    the autograd.grad call whose backward runs the products of the gradient references) runs with both matmul
    backends at "ieee"; afterwards the caller's settings are as it left them. (This CPU has no bf16 units, so oneDNN
    gives float32 bits either way: the settings seen by the products are what is checked here; the GPU test checks
    the bits under TF32.) The caller's settings, per backend and legacy, are unchanged afterwards."""
    calls = _reference_calls()
    _lower_precision(how)
    after = _matmul_state()
    assert "ieee" not in after[:2]
    seen = []
    real_einsum, real_grad = torch.einsum, torch.autograd.grad

    def record(fn):
        def wrapper(*args, **kwargs):
            seen.append(tuple(b.fp32_precision for b in _BACKENDS))
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(torch, "einsum", record(real_einsum))
    monkeypatch.setattr(torch.autograd, "grad", record(real_grad))
    calls[name]()
    monkeypatch.undo()
    assert seen and all(s == ("ieee", "ieee") for s in seen), seen
    assert _matmul_state() == after


# ------------------------------------------------------------------------------------------------------ EH

@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", REFERENCES)
def test_references_ignore_the_callers_autocast(name, autocast_dtype):
    """EH: each reference called inside torch.autocast("cpu") gives the dtypes and bits it gives outside (the float32
    reference stays float32, the naive one stays in the input dtype, the gradients follow)."""
    outside = _reference_calls()[name]()
    with torch.autocast("cpu", dtype=autocast_dtype):
        inside = _reference_calls()[name]()
    assert len(inside) == len(outside)
    for a, b in zip(inside, outside):
        assert _equal(a, b), (a.dtype, b.dtype)
    assert torch.is_autocast_enabled("cpu") is False  # (the region closed)


# ------------------------------------------------------------------------------------------------------ EI

@pytest.fixture
def one_rank_mesh():
    """A one-rank gloo process group and CPU device mesh for the test, destroyed after it."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _distributed(t, mesh, dim):
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(t, mesh, [Shard(dim)])


@pytest.mark.parametrize("which", ["q", "k", "v", "document_ids"])
def test_dtensor_inputs_are_refused_by_name(cpu_ops, one_rank_mesh, which):
    """EI: attention with q, k, v (sharded over the heads, as tensor parallelism shards them) or document_ids a
    DTensor raises a TypeError naming the argument and the remedy; no op ran. The same tensors' local parts run."""
    q, k, v = _dense()
    ids = torch.tensor([[0] * 5 + [1] * 12, [3] * 17])
    args = {"q": q, "k": k, "v": v, "document_ids": ids}
    args[which] = _distributed(args[which], one_rank_mesh, 2 if which != "document_ids" else 0)
    with pytest.raises(TypeError, match=rf"^{which} is a DTensor \(placements .*Shard.*\); .*{which}\.to_local\(\)"):
        attention(args["q"], args["k"], args["v"], causal=True, document_ids=args["document_ids"])
    assert cpu_stand_ins.CALLS == []
    local = {name: t.to_local() if name == which else t for name, t in args.items()}
    out = attention(local["q"], local["k"], local["v"], causal=True, document_ids=local["document_ids"])
    assert type(out) is torch.Tensor and cpu_stand_ins.CALLS == [("fwd", False, None, None)]


@pytest.mark.parametrize("which", ["q", "cu_seqlens_k"])
def test_dtensor_varlen_inputs_are_refused_by_name(cpu_ops, one_rank_mesh, which):
    """EI: attention_varlen with q or cu_seqlens_k a DTensor: the same refusal, before cu_seqlens are read."""
    q, k, v = _varlen()
    args = {"q": q, "cu_seqlens_k": _cu(_CU_K)}
    args[which] = _distributed(args[which], one_rank_mesh, 1 if which == "q" else 0)
    with pytest.raises(TypeError, match=rf"^{which} is a DTensor \(placements "):
        attention_varlen(args["q"], k, v, _cu(_CU_Q), args["cu_seqlens_k"], 18, 20, causal=True)
    assert cpu_stand_ins.CALLS == []


# ------------------------------------------------------------------------------------------------------ EJ

def _grad_references():
    q, k, v = _dense(nheads_k=4)
    dout, dlse = torch.randn_like(q), torch.randn(2, 4, 17)
    qv, kv, vv = _varlen()
    doutv = torch.randn_like(qv)
    return {
        "attention_ref_grads": ((q, k, v, dout), dict(causal=True, dlse=dlse)),
        "attention_varlen_ref_grads": ((qv, kv, vv, doutv, _cu(_CU_Q), _cu(_CU_K)), dict(causal=True)),
    }


@pytest.mark.parametrize("upcast", [True, False])
@pytest.mark.parametrize("name", ["attention_ref_grads", "attention_varlen_ref_grads"])
def test_gradient_references_under_inference_mode_and_with_inference_tensors(name, upcast):
    """EJ: the gradient references called under torch.inference_mode(), and called outside it on inference tensors
    (clones made under it, float32 ones too: their .to(float32) is no copy), give the normal-mode gradients bit for
    bit."""
    fn = getattr(testing, name)
    args, kwargs = _grad_references()[name]
    expected = fn(*args, upcast=upcast, **kwargs)
    with torch.inference_mode():
        inside = fn(*args, upcast=upcast, **kwargs)
        made_inside = [a.clone() for a in args]
        made_inside_fp32 = [a.float() if a.is_floating_point() else a.clone() for a in args]
    assert all(a.is_inference() for a in made_inside)
    outside = fn(*made_inside, upcast=upcast, **kwargs)
    for got in (inside, outside):
        assert all(_equal(a, b) for a, b in zip(got, expected))
    expected_fp32 = fn(*[a.float() if a.is_floating_point() else a for a in args], upcast=upcast, **kwargs)
    got_fp32 = fn(*made_inside_fp32, upcast=upcast, **kwargs)
    assert all(_equal(a, b) for a, b in zip(got_fp32, expected_fp32))


# ------------------------------------------------------------------------------------------------------ EK

def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _merge_in_place(lse):
    """What a ring merge does to the running LSE (TransformerEngine's correction updates it in place)."""
    return lse.sub_(0.75)


def test_dense_lse_updated_in_place_refuses_the_backward(cpu_ops):
    """EK: out and LSE of attention, the LSE then updated in place: the backward raises autograd's version error;
    the same update on a clone runs and gives the gradients of the out-of-place update."""
    q, k, v = _dense()
    dout = torch.randn_like(q)
    leaves = _leaves(q, k, v)
    out, lse = attention(*leaves, causal=True, return_lse=True)
    _merge_in_place(lse)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad([out, lse], leaves, [dout, torch.ones_like(lse)])
    grads = []
    for in_place in (True, False):
        leaves = _leaves(q, k, v)
        out, lse = attention(*leaves, causal=True, return_lse=True)
        merged = _merge_in_place(lse.clone()) if in_place else lse - 0.75
        grads.append(torch.autograd.grad([out, merged], leaves, [dout, torch.ones_like(merged)]))
    assert all(_equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("tail", [False, True], ids=["no_tail", "rows_past_the_last_sequence"])
def test_varlen_lse_updated_in_place(cpu_ops, tail):
    """EK: attention_varlen's LSE updated in place: refused by autograd when it is the op's own output; free (a new
    tensor, the padding's) when rows lie past the last sequence, with the gradients of the out-of-place update."""
    q, k, v = _varlen(total_q=33 if tail else 30)
    dout = torch.randn_like(q)
    cu_q, cu_k = _cu(_CU_Q), _cu(_CU_K)
    grads = []
    for in_place in (True, False):
        leaves = _leaves(q, k, v)
        out, lse = attention_varlen(*leaves, cu_q, cu_k, 18, 20, causal=True, return_lse=True)
        merged = _merge_in_place(lse) if in_place else lse - 0.75
        if in_place and not tail:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                torch.autograd.grad([out, merged], leaves, [dout, torch.ones_like(merged)])
            continue
        grads.append(torch.autograd.grad([out, merged], leaves, [dout, torch.ones_like(merged)]))
    if tail:
        assert all(_equal(a, b) for a, b in zip(*grads))
