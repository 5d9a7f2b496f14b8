"""Forty-first round of the bug hunt (tests/bug_report_sources.md, "Forty-first round"), CPU part: the premises of
tests/test_bug_reports_fortyfirst_gpu.py and what of HD / HE / HF runs without a GPU or the extension.

- HD: every 8-bit and 4-bit float dtype of this torch as q, k or v (all three, an fp8 KV cache beside bf16 queries, v
  alone) is refused by name (TypeError) by attention and attention_varlen before the device checks and the extension,
  also inside torch.compile(fullgraph=True) (dynamo's "Observed exception" carries the message); the references refuse
  them too; the fake kernels' checks (interface of the ops for meta and fake tensors) give the C++ ops' RuntimeError,
  the message the GPU test expects of the real ops, for q, k, v and for the backward's out and dout.
- HE: flash-attention#334's one-key problem has an exact answer the float32 reference gives (out = v's row, dV = dO,
  dQ = dK = 0), and the naive references of every HE case are finite (the rule has a bound); head dims 8 / 16 / 24 pass
  the checks and run on the 64-wide kernels forward and backward; the (77 x 1) causal case has rows that see no key.
- HF: tensors imported through DLPack (capsule, protocol, and re-strided as a normalising producer gives them) share
  memory and values with the originals, pass the checks like them and key the checked-call cache like them; the
  normalised case really changes strides (else it tests nothing); cu_seqlens and document_ids imported through DLPack
  read and bound like the originals."""

import math
import re

import pytest
import torch

import test_bug_reports_fortyfirst_gpu as gpu_file
from flash_attn_hopper import _ops, interface
from flash_attn_hopper.interface import attention, attention_varlen, kernel_head_dim
from flash_attn_hopper.testing import (attention_ref, attention_ref_grads, attention_varlen_ref, document_mask,
                                       local_mask)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(gpu_file, "DEVICE", "cpu")
    torch.manual_seed(41)


# ------------------------------------------------------------------ HD

def test_hd_every_narrow_float_dtype_of_this_torch_is_tried():
    dtypes = gpu_file.narrow_float_dtypes()
    assert torch.float8_e4m3fn in dtypes and torch.float8_e5m2 in dtypes
    for dtype in dtypes:
        assert dtype.itemsize == 1 and dtype not in interface.SUPPORTED_DTYPES


@pytest.mark.parametrize("case", gpu_file.HD_CASES)
def test_hd_functions_refuse_narrow_floats_by_name_before_the_extension(on_cpu, case):
    name = gpu_file.hd_first_narrow(case)
    for dtype in gpu_file.narrow_float_dtypes():
        q, k, v = gpu_file.hd_inputs(case, dtype)
        assert {"q": q, "k": k, "v": v}[name].dtype == dtype
        refusal = re.escape(f"{name} has dtype {dtype}; supported dtypes are torch.float16 and torch.bfloat16")
        with pytest.raises(TypeError, match=refusal):
            attention(q, k, v, causal=True)
        with pytest.raises(TypeError, match=refusal):
            attention(q, k, v, return_lse=True, window_size=(20, 0))
        cu_q = torch.tensor([0, 77], dtype=torch.int32)
        cu_k = torch.tensor([0, 141], dtype=torch.int32)
        with pytest.raises(TypeError, match=refusal):
            attention_varlen(q[0], k[0], v[0], cu_q, cu_k, 77, 141)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_hd_refusal_survives_torch_compile_fullgraph(on_cpu, backend):
    compiled = torch.compile(lambda a, b, c: attention(a, b, c, causal=True), backend=backend, fullgraph=True)
    for case in gpu_file.HD_CASES:
        q, k, v = gpu_file.hd_inputs(case, torch.float8_e4m3fn)
        name = gpu_file.hd_first_narrow(case)
        try:
            with pytest.raises(Exception, match=re.escape(f"{name} has dtype torch.float8_e4m3fn")):
                compiled(q, k, v)
        finally:
            torch._dynamo.reset()


def test_hd_references_refuse_narrow_floats(on_cpu):
    for case in gpu_file.HD_CASES:
        q, k, v = gpu_file.hd_inputs(case, torch.float8_e5m2)
        name = gpu_file.hd_first_narrow(case)
        refusal = re.escape(f"{name} has dtype torch.float8_e5m2")
        with pytest.raises(TypeError, match=refusal):
            attention_ref(q, k, v)
        with pytest.raises(TypeError, match=refusal):
            attention_ref_grads(q, k, v, torch.ones(2, 77, 4, 128, dtype=torch.bfloat16))
        cu_q = torch.tensor([0, 77], dtype=torch.int32)
        cu_k = torch.tensor([0, 141], dtype=torch.int32)
        with pytest.raises(TypeError, match=refusal):
            attention_varlen_ref(q[0], k[0], v[0], cu_q, cu_k)


def test_hd_fake_kernel_checks_give_the_ops_refusal(on_cpu):
    """The messages test_narrow_float_formats_are_refused_by_the_ops_and_the_functions expects of the C++ ops, from
    the fake kernels' mirror of their checks (flash_attn_hopper/_ops.py _check_fake_inputs), on meta tensors."""
    scale = 1 / math.sqrt(128)
    for case, message in (("all", "q must be float16 or bfloat16"), ("kv-cache", "k must have the dtype of q"),
                          ("v-only", "v must have the dtype of q")):
        for dtype in gpu_file.narrow_float_dtypes():
            q, k, v = (t.to("meta") for t in gpu_file.hd_inputs(case, dtype))
            with pytest.raises(RuntimeError, match=re.escape(message)):
                _ops._check_fake_inputs(4, q, k, v, scale, True, -1, 0, 0.0)
            with pytest.raises(RuntimeError, match=re.escape(message)):
                _ops._check_fake_inputs(3, q[0], k[0], v[0], scale, True, -1, 0, 0.0)
    q = torch.empty(2, 77, 4, 128, dtype=torch.bfloat16, device="meta")
    k = v = torch.empty(2, 141, 2, 128, dtype=torch.bfloat16, device="meta")
    out = torch.empty(2, 77, 4, 128, dtype=torch.bfloat16, device="meta")
    _ops._check_fake_inputs(4, q, k, v, scale, True, -1, 0, 0.0, out=out, dout=out)  # the control: accepted
    for dtype in gpu_file.narrow_float_dtypes():
        narrow = gpu_file.narrow_tensor(out.shape, dtype, "cpu").to("meta")
        with pytest.raises(RuntimeError, match="dout must have the dtype of q"):
            _ops._check_fake_inputs(4, q, k, v, scale, True, -1, 0, 0.0, out=out, dout=narrow)
        with pytest.raises(RuntimeError, match="out must have the dtype of q"):
            _ops._check_fake_inputs(4, q, k, v, scale, True, -1, 0, 0.0, out=narrow, dout=out)


# ------------------------------------------------------------------ HE

def test_he_report_334_has_an_exact_answer_the_reference_gives(on_cpu):
    for dtype in gpu_file.DTYPES:
        q, k, v, dout = gpu_file.he_report_334(dtype)
        assert q.shape == (1, 1, 1, 16) and torch.equal(dout, torch.ones_like(q))
        assert q.float().abs().max() > 1.5, "spread 3 (the report's * 3)"
        out, lse = attention_ref(q, k, v, upcast=True)
        assert torch.equal(out, v.float()), "one key: out is v's row"
        expected_lse = (q.float() * k.float()).sum() / 4.0  # softmax_scale 16^-0.5 = 1/4
        assert torch.allclose(lse.flatten(), expected_lse.flatten(), rtol=1e-6, atol=1e-6)
        dq, dk, dv = attention_ref_grads(q, k, v, dout, upcast=True)
        assert torch.equal(dv, dout.float()), "one key: dV is dO"
        assert dq.abs().max() < 1e-5 and dk.abs().max() < 1e-5, "one key: dQ and dK vanish"
        naive = attention_ref_grads(q, k, v, dout, upcast=False)
        assert all(torch.isfinite(g).all() for g in naive)


@pytest.mark.parametrize("head_dim", [8, 16, 24])
def test_he_narrow_head_dims_pass_the_checks_on_the_64_wide_kernels(head_dim):
    assert kernel_head_dim(head_dim) == 64 and kernel_head_dim(head_dim, backward=True) == 64
    q = torch.empty(2, 77, 4, head_dim, dtype=torch.float16)
    k = torch.empty(2, 1, 2, head_dim, dtype=torch.float16)
    interface._check_tensor_args(q, k, k)  # no exception


@pytest.mark.parametrize("shape", gpu_file.HE_SHAPES, ids=[f"{a}x{b}" for a, b in gpu_file.HE_SHAPES])
@pytest.mark.parametrize("head_dim", [8, 16, 24])
def test_he_naive_references_are_finite_so_the_rule_bounds(on_cpu, head_dim, shape):
    seqlen_q, seqlen_k = shape
    for dtype in gpu_file.DTYPES:
        q, k, v, dout = gpu_file.he_inputs(head_dim, seqlen_q, seqlen_k, dtype)
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(2, dim=2))
        scores = scores / math.sqrt(head_dim)
        assert 5 < scores.std() < 15 or scores.numel() < 64, "scores of spread ~9 (inputs times 3)"
        out, lse = attention_ref(q, k, v, causal=True, upcast=False)
        assert torch.isfinite(out).all()
        for g in attention_ref_grads(q, k, v, dout, causal=True, upcast=False):
            assert torch.isfinite(g).all()
        rows_without_keys = ~local_mask(seqlen_q, seqlen_k, causal=True).any(dim=1)
        assert bool(rows_without_keys.any()) == (seqlen_q > seqlen_k)
        if rows_without_keys.any():
            assert torch.isneginf(lse[:, :, rows_without_keys]).all()


def test_he_report_1052_naive_reference_is_finite(on_cpu):
    """The report's problem at a quarter of its length (the CPU's time): scores of spread ~9 (std 3 inputs, scale
    128^-0.5), the fp16 naive reference and its gradients finite, so the rule bounds the GPU test."""
    q, k, v = ((torch.randn(1, 256, 1, 128) * 3).to(torch.float16) for _ in range(3))
    dout = torch.randn(1, 256, 1, 128).to(torch.float16)
    out, _ = attention_ref(q, k, v, softmax_scale=128 ** -0.5, causal=True, upcast=False)
    assert torch.isfinite(out).all()
    for g in attention_ref_grads(q, k, v, dout, softmax_scale=128 ** -0.5, causal=True, upcast=False):
        assert torch.isfinite(g).all()


# ------------------------------------------------------------------ HF

@pytest.mark.parametrize("how", gpu_file.HF_HOW)
def test_hf_imports_share_memory_pass_the_checks_and_key_the_cache_alike(on_cpu, how):
    q, k, v, dout = gpu_file.hf_decode_inputs(torch.bfloat16)
    imported = [gpu_file.through_dlpack(t, how) for t in (q, k, v, dout)]
    for a, b in zip(imported, (q, k, v, dout)):
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape and torch.equal(a, b)
    if how == "normalised":
        assert any(a.stride() != b.stride() for a, b in zip(imported, (q, k, v))), "the case must change strides"
        for a in imported:
            assert all(s == 1 for n, s in zip(a.shape, a.stride()) if n == 1)
    interface._check_tensor_args(*imported[:3])
    sig = interface._call_signature(*imported[:3], None, False, (-1, -1), 0, True)
    assert sig is not None and sig == interface._call_signature(q, k, v, None, False, (-1, -1), 0, True)
    ref = attention_ref(*imported[:3])
    base = attention_ref(q, k, v)
    assert torch.equal(ref[0], base[0]) and torch.equal(ref[1], base[1])


@pytest.mark.parametrize("how", gpu_file.HF_HOW)
def test_hf_cu_seqlens_and_document_ids_through_dlpack_read_alike(how):
    q = torch.empty(208, 4, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 131, 131, 208], dtype=torch.int32)
    imported = gpu_file.through_dlpack(cu, how)
    interface._check_cu_seqlens_meta("cu_seqlens_q", imported, q)  # int32, 1-D, contiguous, on q's device
    (first, last, longest), checked = interface._read_cu_seqlens("cu_seqlens_q", imported)
    assert (first, last, longest) == (0, 208, 130) and torch.equal(checked, cu)
    ids = torch.stack([torch.repeat_interleave(torch.arange(3), torch.tensor([1, 64, 138])),
                       torch.zeros(203, dtype=torch.int64)]).to(torch.int32)
    ids_imported = gpu_file.through_dlpack(ids, how)
    assert torch.equal(interface.document_bounds(ids_imported), interface.document_bounds(ids))
    assert torch.equal(document_mask(ids_imported), document_mask(ids))
