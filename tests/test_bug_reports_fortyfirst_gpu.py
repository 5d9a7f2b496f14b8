"""Forty-first round of the bug hunt (tests/bug_report_sources.md, "Forty-first round"), GPU part.

HD: narrow float formats handed to the kernels. NVIDIA/cudnn-frontend#981: cuDNN's fp8 SDPA forward at head_dim 256
returned wrong output (0.1-0.3 % of the elements off by up to 1.9) instead of declining the configuration;
vllm-project/vllm#45563: a KV cache of one fp8 encoding (e4m3fnuz) read as another (e4m3fn) changed K and V before
the kernels consumed them. The library computes in fp16 / bf16 only (DESIGN.md section 2): any float8 (e4m3fn, e5m2,
their fnuz forms, e8m0fnu) or float4 tensor as q, k or v, and an fp8 KV cache beside bf16 queries, must be refused by
name before a launch: by the Python functions in eager and under torch.compile (aot_eager, fullgraph), and by the
ops themselves called directly in eager (their C++ checks; a compiled direct op call reaches the fake kernels' mirror of
those checks, run on the CPU by the CPU file); the next ordinary call must then be right (no sticky error).

HE: one-token problems and the narrowest head dims with inputs of spread 3. Dao-AILab/flash-attention#334: NaN in dQ
for q, k, v of shape (1, 1, 1, 16) drawn with standard deviation 3 and dO all ones; Dao-AILab/flash-attention#1052:
NaN gradients of FlashAttention-3 for 1024 causal queries, one head, head_dim 128, inputs times 3, through direct op
calls. Class 31 ran head dims 8, 40, 72, ...; 16 and 24 were never run explicitly (they share the 64-wide kernel, whose
padded columns must stay out of every product). Cases: the two reports' shapes as they were (the first has a single
key, so out is v's row, dQ and dK are 0 up to rounding and dV is dO), head dims 8 / 16 / 24 at (1 x 1), (1 x 77),
(77 x 1), (203 x 141) causal; the second report's shape through the ops called directly, bitwise the Python
function's (deterministic backward). Required: finite, by the rule against the float32 reference, NaN-poisoned memory.

HF: tensors that come through DLPack. pytorch/pytorch#99803: strides of a (1, 77) tensor came back as (1, 1) after
`from_dlpack(to_dlpack(a))`; pytorch/pytorch#83069: exporters may normalise (or not) the strides of size-1 dimensions.
Other producers (CuPy, JAX, TensorRT, Paddle) hand PyTorch tensors whose size-1 dimensions carry stride 1 or any
value, and share memory with the exporter. Cases: an MQA decode (batch 1, one query row, one K/V head) whose q, k, v
and dO are imported through a DLPack capsule and through the `__dlpack__` protocol (on torch 2.11 both give back the
original strides: these two cases pin the import path, not a stride change), and then re-strided as a normalising
producer gives them (every size-1 dimension stride 1: the case that changes strides); varlen with cu_seqlens imported
through DLPack; packed documents with document_ids imported through DLPack (1-D and (2, seqlen) tensors: no size-1
dimension, so their three forms run one call). Other stride values on size-1 dimensions are not run here. Required:
out, LSE, dQ, dK, dV bitwise the call on the original tensors (deterministic), and by the rule.

Inputs are Gaussian from the per-test seed (tests/conftest.py). Skipped, with the reason, without an sm90 GPU and the
built extension (conftest.py), and per test when the build lacks a head_dim / dtype.
tests/test_bug_reports_fortyfirst_cpu.py checks the premises and runs the refusals that need no GPU."""

import math
import re

import pytest
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

import flash_attn_hopper
from flash_attn_hopper import interface
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref
from gpu_helpers import (GRAD_NAMES, assert_same_bits, check_attention, check_attention_varlen, cu_seqlens,
                         poison_attention_memory, require_built, run_attention, run_attention_varlen)

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"
DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]


def randn(*shape, dtype, device=None):
    return torch.randn(*shape, dtype=dtype, device=DEVICE if device is None else device)


# ------------------------------------------------------------------ HD: narrow float formats refused

def narrow_float_dtypes():
    """Every 8-bit and 4-bit float dtype this torch has (the names differ between versions)."""
    names = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
             "float4_e2m1fn_x2"]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def narrow_tensor(shape, dtype, device=None):
    """A tensor of `dtype` holding some values: a cast where torch has one, else random bytes reinterpreted (float4
    x2 packs two values per byte and has no cast)."""
    device = DEVICE if device is None else device
    try:
        return (torch.randn(*shape, device=device) * 0.5).to(dtype)
    except (RuntimeError, TypeError):
        raw = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
        return raw.view(dtype)


HD_CASES = ["all", "kv-cache", "v-only"]


def hd_inputs(case, dtype, device=None):
    """(q, k, v) with the narrow dtype in every role ("all"), in k and v beside bf16 queries (an fp8 KV cache), or in v
    alone."""
    q = randn(2, 77, 4, 128, dtype=torch.bfloat16, device=device)
    k = randn(2, 141, 2, 128, dtype=torch.bfloat16, device=device)
    v = randn(2, 141, 2, 128, dtype=torch.bfloat16, device=device)
    if case == "all":
        return tuple(narrow_tensor(t.shape, dtype, device) for t in (q, k, v))
    if case == "kv-cache":
        return q, narrow_tensor(k.shape, dtype, device), narrow_tensor(v.shape, dtype, device)
    return q, k, narrow_tensor(v.shape, dtype, device)


def hd_first_narrow(case):
    return {"all": "q", "kv-cache": "k", "v-only": "v"}[case]


@pytest.mark.parametrize("case", HD_CASES)
def test_narrow_float_formats_are_refused_by_the_ops_and_the_functions(case):
    """The Python functions refuse by name (TypeError) in eager and under torch.compile; the ops called directly
    refuse with the C++ checks' RuntimeError (no launch, no CUDA error); an ordinary call afterwards is right."""
    require_built(128, torch.bfloat16)
    for dtype in narrow_float_dtypes():
        q, k, v = hd_inputs(case, dtype)
        name = hd_first_narrow(case)
        refusal = re.escape(f"{name} has dtype {dtype}")
        with pytest.raises(TypeError, match=refusal):
            flash_attn_hopper.attention(q, k, v, causal=True)
        qv, kv, vv = (t[0] for t in (q, k, v))
        cu_q, cu_k = cu_seqlens([77]), cu_seqlens([141])
        with pytest.raises(TypeError, match=refusal):
            flash_attn_hopper.attention_varlen(qv, kv, vv, cu_q, cu_k, 77, 141)
        compiled = torch.compile(lambda a, b, c: flash_attn_hopper.attention(a, b, c), backend="aot_eager",
                                 fullgraph=True)
        try:  # (dynamo wraps the TypeError in its "Observed exception", which carries the message)
            with pytest.raises(Exception, match=refusal):
                compiled(q, k, v)
        finally:
            torch._dynamo.reset()
        message = "q must be float16 or bfloat16" if case == "all" else f"{name} must have the dtype of q"
        with pytest.raises(RuntimeError, match=message):
            torch.ops.flash_attn_hopper.fwd.default(q, k, v, 1 / math.sqrt(128), True, -1, 0, 0.0, False, None)
        with pytest.raises(RuntimeError, match=message):  # (fwd_varlen runs fwd's dtype checks, in fwd's order)
            torch.ops.flash_attn_hopper.fwd_varlen.default(qv, kv, vv, cu_q, cu_k, 77, 141, 1 / math.sqrt(128), True,
                                                           -1, 0, 0.0, False)
        torch.cuda.synchronize()  # a launch that had started would surface its error here
    # the next ordinary call: right by the rule (nothing sticky, nothing half-written)
    q, k, v = (randn(2, n, h, 128, dtype=torch.bfloat16) for n, h in ((77, 4), (141, 2), (141, 2)))
    dout = randn(2, 77, 4, 128, dtype=torch.bfloat16)
    out, lse, grads = run_attention(q, k, v, dout, causal=True)
    check_attention(out, lse, grads, q, k, v, dout, f"after the refusals ({case})", causal=True)


def test_narrow_float_output_gradient_refused_by_the_backward_op():
    """The backward op called directly with an fp8 dO (or out) beside bf16 inputs: the C++ check's RuntimeError, not a
    backward that reads the fp8 bytes as bf16."""
    require_built(128, torch.bfloat16)
    q, k, v = (randn(2, n, h, 128, dtype=torch.bfloat16) for n, h in ((77, 4), (141, 2), (141, 2)))
    args = (1 / math.sqrt(128), True, -1, 0, 0.0, True)
    out, lse = torch.ops.flash_attn_hopper.fwd.default(q, k, v, *args, None)
    dout = randn(*out.shape, dtype=torch.bfloat16)
    for dtype in narrow_float_dtypes():
        for name, (o, do) in (("dout", (out, narrow_tensor(dout.shape, dtype))),
                              ("out", (narrow_tensor(out.shape, dtype), dout))):
            with pytest.raises(RuntimeError, match=f"{name} must have the dtype of q"):
                torch.ops.flash_attn_hopper.bwd.default(do, q, k, v, o, lse, None, *args, None)
    torch.cuda.synchronize()
    grads = torch.ops.flash_attn_hopper.bwd.default(dout, q, k, v, out, lse, None, *args, None)
    check_attention(out, lse, grads, q, k, v, dout, "backward op after the refusals", causal=True)


# ------------------------------------------------------------------ HE: one token, narrow head dims, spread 3

def he_report_334(dtype, device=None):
    """Dao-AILab/flash-attention#334's inputs: q, k, v (1, 1, 1, 16) with standard deviation 3, dO all ones."""
    q, k, v = (randn(1, 1, 1, 16, dtype=torch.float32, device=device) * 3 for _ in range(3))
    q, k, v = (t.to(dtype) for t in (q, k, v))
    return q, k, v, torch.ones_like(q)


HE_SHAPES = [(1, 1), (1, 77), (77, 1), (203, 141)]


def he_inputs(head_dim, seqlen_q, seqlen_k, dtype, device=None):
    """Two batch elements, 4 query heads on 2 K/V heads, q, k, v times 3, dO standard normal."""
    q = (randn(2, seqlen_q, 4, head_dim, dtype=torch.float32, device=device) * 3).to(dtype)
    k = (randn(2, seqlen_k, 2, head_dim, dtype=torch.float32, device=device) * 3).to(dtype)
    v = (randn(2, seqlen_k, 2, head_dim, dtype=torch.float32, device=device) * 3).to(dtype)
    return q, k, v, randn(2, seqlen_q, 4, head_dim, dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_report_334_one_token_head_dim_16(dtype):
    """One query, one key: out is v's row exactly (P = 1), LSE the scaled score, dV = dO exactly, dQ and dK 0 up to
    rounding (dP - D = dO . (v - out) = 0), all finite; by the rule."""
    require_built(16, dtype)
    q, k, v, dout = he_report_334(dtype)
    out, lse, grads = run_attention(q, k, v, dout)
    for what, t in (("out", out), ("lse", lse), *zip(GRAD_NAMES, grads)):
        assert torch.isfinite(t).all(), f"#334 {what} not finite"
    assert torch.equal(out, v), "one key: out must be v's row"
    assert torch.equal(grads[2], dout), "one key: dV must be dO"
    check_attention(out, lse, grads, q, k, v, dout, "#334")


@pytest.mark.parametrize("shape", HE_SHAPES, ids=[f"{a}x{b}" for a, b in HE_SHAPES])
@pytest.mark.parametrize("head_dim", [8, 16, 24])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_narrow_head_dims_with_inputs_of_spread_3(dtype, head_dim, shape):
    """head_dim 8 / 16 / 24 (the 64-wide kernels' padded columns), causal, GQA 4/2, q, k, v times 3 (scores of
    standard deviation ~9): finite, by the rule; rows that see no key (77 x 1 causal) give out 0."""
    require_built(head_dim, dtype)
    seqlen_q, seqlen_k = shape
    q, k, v, dout = he_inputs(head_dim, seqlen_q, seqlen_k, dtype)
    out, lse, grads = run_attention(q, k, v, dout, causal=True)
    for what, t in (("out", out), *zip(GRAD_NAMES, grads)):
        assert torch.isfinite(t).all(), f"{what} not finite"
    assert not torch.isnan(lse).any()
    check_attention(out, lse, grads, q, k, v, dout, f"hd{head_dim} {shape} x3", causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_report_1052_direct_op_calls(dtype):
    """Dao-AILab/flash-attention#1052's problem: (1, 1024, 1, 128) times 3, causal, softmax_scale 128^-0.5, through
    torch.ops.flash_attn_hopper.fwd / bwd called directly (the report's route) and through attention: finite, the
    two routes bitwise equal (deterministic backward), by the rule."""
    require_built(128, dtype)
    q, k, v = ((randn(1, 1024, 1, 128, dtype=torch.float32) * 3).to(dtype) for _ in range(3))
    dout = randn(1, 1024, 1, 128, dtype=dtype)
    scale = 128 ** -0.5
    args = interface._check_call(q, k, v, scale, True, (-1, -1), 0, True, False)
    poison_attention_memory(q, v)
    out, lse = torch.ops.flash_attn_hopper.fwd.default(q, k, v, *args, None)
    poison_attention_memory(q, v)
    grads = torch.ops.flash_attn_hopper.bwd.default(dout, q, k, v, out, lse, None, *args, None)
    for what, t in (("out", out), ("lse", lse), *zip(GRAD_NAMES, grads)):
        assert torch.isfinite(t).all(), f"#1052 op {what} not finite"
    out2, lse2, grads2 = run_attention(q, k, v, dout, softmax_scale=scale, causal=True, deterministic=True)
    for what, a, b in (("out", out, out2), ("lse", lse, lse2), *zip(GRAD_NAMES, grads, grads2)):
        assert_same_bits(a, b, f"#1052 {what}", " (the op called directly against attention)")
    check_attention(out, lse, grads, q, k, v, dout, "#1052", softmax_scale=scale, causal=True)


# ------------------------------------------------------------------ HF: tensors through DLPack

def through_dlpack(t, how):
    """t as another library hands it over: through a DLPack capsule, through the __dlpack__ protocol, or as a
    normalising producer gives it (every size-1 dimension with stride 1, same memory)."""
    if how == "capsule":
        return from_dlpack(to_dlpack(t))
    if how == "protocol":
        return torch.from_dlpack(t)
    if how == "normalised":
        imported = torch.from_dlpack(t)
        strides = [1 if n == 1 else s for n, s in zip(t.shape, t.stride())]
        return imported.as_strided(t.shape, strides, imported.storage_offset())
    raise ValueError(how)


HF_HOW = ["capsule", "protocol", "normalised"]


def hf_decode_inputs(dtype, device=None):
    """An MQA decode: batch 1, one query row, 8 query heads on one K/V head, 300 cached keys (size-1 batch, seqlen_q
    and nheads_k dimensions)."""
    q = randn(1, 1, 8, 128, dtype=dtype, device=device)
    k = randn(1, 300, 1, 128, dtype=dtype, device=device)
    v = randn(1, 300, 1, 128, dtype=dtype, device=device)
    return q, k, v, randn(1, 1, 8, 128, dtype=dtype, device=device)


@pytest.mark.parametrize("how", HF_HOW)
def test_dense_decode_inputs_through_dlpack(how):
    require_built(128, torch.bfloat16)
    q, k, v, dout = hf_decode_inputs(torch.bfloat16)
    base = run_attention(q, k, v, dout, deterministic=True)
    imported = [through_dlpack(t, how) for t in (q, k, v, dout)]
    for a, b in zip(imported, (q, k, v, dout)):
        assert a.data_ptr() == b.data_ptr() and torch.equal(a, b), "DLPack import must share the memory"
    got = run_attention(*imported, deterministic=True)
    for what, a, b in (("out", got[0], base[0]), ("lse", got[1], base[1]), *zip(GRAD_NAMES, got[2], base[2])):
        assert_same_bits(a, b, f"dlpack {how} {what}")
    check_attention(*got, q, k, v, dout, f"dlpack {how}")


@pytest.mark.parametrize("how", HF_HOW)
def test_varlen_cu_seqlens_and_documents_through_dlpack(how):
    require_built(128, torch.bfloat16)
    lq, lk = [1, 130, 0, 77], [40, 129, 33, 77]
    q = randn(sum(lq), 4, 128, dtype=torch.bfloat16)
    k = randn(sum(lk), 2, 128, dtype=torch.bfloat16)
    v = randn(sum(lk), 2, 128, dtype=torch.bfloat16)
    dout = randn(sum(lq), 4, 128, dtype=torch.bfloat16)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    base = run_attention_varlen(q, k, v, dout, cu_q, cu_k, max(lq), max(lk), causal=True, deterministic=True)
    got = run_attention_varlen(q, k, v, dout, through_dlpack(cu_q, how), through_dlpack(cu_k, how), max(lq), max(lk),
                               causal=True, deterministic=True)
    for what, a, b in (("out", got[0], base[0]), ("lse", got[1], base[1]), *zip(GRAD_NAMES, got[2], base[2])):
        assert_same_bits(a, b, f"dlpack cu_seqlens {how} {what}")
    check_attention_varlen(*got, q, k, v, dout, cu_q, cu_k, f"dlpack cu_seqlens {how}", causal=True)
    # packed documents: document_ids imported through DLPack
    lengths = [[1, 64, 138], [203]]
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]).to(DEVICE)
    ids = ids.to(torch.int32)
    qd, kd, vd = (randn(2, 203, h, 128, dtype=torch.bfloat16) for h in (4, 2, 2))
    dd = randn(2, 203, 4, 128, dtype=torch.bfloat16)
    base = run_attention(qd, kd, vd, dd, causal=True, deterministic=True, document_ids=ids)
    got = run_attention(qd, kd, vd, dd, causal=True, deterministic=True, document_ids=through_dlpack(ids, how))
    for what, a, b in (("out", got[0], base[0]), ("lse", got[1], base[1]), *zip(GRAD_NAMES, got[2], base[2])):
        assert_same_bits(a, b, f"dlpack document_ids {how} {what}")
    check_attention(*got, qd, kd, vd, dd, f"dlpack document_ids {how}", causal=True, document_ids=ids)


def test_outputs_exported_through_dlpack_keep_their_values():
    """out and LSE handed on through DLPack (to another library) share memory and values; a DLPack view of out used
    as the next call's query gives the same bits as out itself."""
    require_built(128, torch.bfloat16)
    q, k, v, dout = hf_decode_inputs(torch.bfloat16)
    out, lse = flash_attn_hopper.attention(q, k, v, return_lse=True)
    for t in (out, lse):
        e = from_dlpack(to_dlpack(t))
        assert e.data_ptr() == t.data_ptr() and torch.equal(e, t)
    again = flash_attn_hopper.attention(from_dlpack(to_dlpack(out)), k, v)
    assert_same_bits(again, flash_attn_hopper.attention(out, k, v), "out through dlpack as q")
    ref = attention_ref(out, k, v, upcast=True)[0]
    naive = attention_ref(out, k, v, upcast=False)[0]
    assert_close_by_rule(again, ref, naive, "out through dlpack as q")
