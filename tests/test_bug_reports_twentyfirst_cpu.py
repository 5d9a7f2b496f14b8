"""Twenty-first round of the bug hunt (tests/bug_report_sources.md, "Twenty-first round"), CPU part.

EQ: the public references (flash_attn_hopper.testing) took scalar options that attention refuses and computed a
reference under a rule the kernels do not have: a softmax_scale of 0 (a uniform softmax, as in
SKaiNET-developers/SKaiNET#880, where a scale of 0 silently flattened every attention pattern), negative or NaN; a
negative or NaN softcap (ignored: `softcap > 0` is False), an infinite one (NaN everywhere), True as 1.0 (cf.
EricLBuehler/mistral.rs#1930: softcap values 0, negative, NaN, infinite not rejected at the boundary); a causal of any
truthy or falsy value. FAULT, fixed: they raise attention's own TypeError / ValueError.
ER: assert_close_by_rule given a floor that bounds nothing (numpy/numpy#28205 and its fix numpy/numpy#28221: isclose
with an infinite or NaN tolerance; xarray-contrib/xarray-spatial#2194: NaN / infinite atol accepted): an infinite floor
(e.g. computed from a reference LSE holding -inf, as `ref.abs().max() / 1024` is in tests/test_transformers_gpu.py for
logits) passed every output. FAULT, fixed: TypeError / ValueError naming floor.
ES: the references given q, k, v of different dtypes (nari-labs/dia#158: an fp32 query beside half keys and values,
refused by SDPA's fused kernels) or float document_ids: the float32 references upcast all of them into a reference of a
call attention refuses, the gradient references cast k and v to q's dtype (bf16 into fp16), other paths failed inside
einsum naming no argument, float ids were truncated. FAULT, fixed: TypeError naming the dtypes, as attention.
ET: results returned as views of padded buffers (Dao-AILab/flash-attention#1347: the head-dim padding moved to Python,
whose interface returns `out_padded[..., :head_size_og]`; vllm-project/vllm-gaudi#505: `.view` of such a sliced
attention output failed). No fault in the Python layer: out, LSE and the gradients are contiguous tensors owning exactly
their own storage (here: what the Python layer pads, attention_varlen with rows outside the sequences; the GPU file
checks the kernels' outputs).

ET's case runs the ops through the CPU stand-ins of tests/cpu_stand_ins.py.
"""

import math

import numpy as np
import pytest
import torch

from flash_attn_hopper import attention, attention_varlen, testing

from cpu_stand_ins import dense_inputs as _dense, varlen_inputs as _varlen


def _cu(values):
    return torch.tensor(values, dtype=torch.int32)


def _small(dtype=torch.bfloat16):
    """q (2, 9, 4, 16), k and v (2, 11, 2, 16), dout like out, dlse like the LSE: small enough for every reference."""
    torch.manual_seed(3)
    q = torch.randn(2, 9, 4, 16, dtype=dtype)
    k = torch.randn(2, 11, 2, 16, dtype=dtype)
    v = torch.randn(2, 11, 2, 16, dtype=dtype)
    return q, k, v, torch.randn_like(q), torch.randn(2, 4, 9)


def _small_varlen(dtype=torch.bfloat16):
    """Packed q (12, 4, 16), k, v (15, 2, 16), lengths (5, 0, 4) / (6, 3, 6), one query row past the last sequence."""
    torch.manual_seed(4)
    q = torch.randn(12, 4, 16, dtype=dtype)
    k = torch.randn(15, 2, 16, dtype=dtype)
    v = torch.randn(15, 2, 16, dtype=dtype)
    return q, k, v, _cu([0, 5, 5, 9]), _cu([0, 6, 9, 15]), torch.randn_like(q), torch.randn(4, 12)


def _dense_references(q, k, v, dout, dlse, **opts):
    """Each dense reference, as a call of the options (forward naive and float32, both gradient references)."""
    return {
        "attention_ref": lambda: testing.attention_ref(q, k, v, **opts),
        "attention_ref_naive": lambda: testing.attention_ref(q, k, v, upcast=False, **opts),
        "attention_ref_grads": lambda: testing.attention_ref_grads(q, k, v, dout, dlse=dlse, **opts),
        "attention_bwd_ref": lambda: testing.attention_bwd_ref(q, k, v, dout, dlse=dlse, **opts),
    }


def _varlen_references(q, k, v, cu_q, cu_k, dout, dlse, **opts):
    """Each varlen reference; and one with no sequence at all (cu_seqlens [0]), which reaches no per-sequence call."""
    return {
        "attention_varlen_ref": lambda: testing.attention_varlen_ref(q, k, v, cu_q, cu_k, **opts),
        "attention_varlen_ref_grads": lambda: testing.attention_varlen_ref_grads(q, k, v, dout, cu_q, cu_k,
                                                                                 dlse=dlse, **opts),
        "attention_varlen_ref_no_sequences": lambda: testing.attention_varlen_ref(q, k, v, _cu([0]), _cu([0]),
                                                                                  **opts),
    }


# ------------------------------------------------------------------------------------------------------ EQ

_BAD_OPTIONS = {
    "scale_zero": dict(softmax_scale=0.0),
    "scale_negative": dict(softmax_scale=-0.25),
    "scale_nan": dict(softmax_scale=math.nan),
    "scale_bool": dict(softmax_scale=True),
    "scale_tensor": dict(softmax_scale=torch.tensor(0.25, requires_grad=True)),
    "softcap_negative": dict(softcap=-5.0),
    "softcap_nan": dict(softcap=math.nan),
    "softcap_inf": dict(softcap=math.inf),
    "softcap_bool": dict(softcap=True),
    "causal_none": dict(causal=None),
    "causal_int": dict(causal=1),
    # (found in the session's final read: the dense references checked window_size only when it differed from
    # (-1, -1), and these compare equal to it)
    "window_float": dict(window_size=(-1.0, -1.0)),
    "window_array": dict(window_size=np.array([-1, -1])),
    "window_tensor": dict(window_size=torch.tensor([-1, -1])),
}


def _attention_refusal(opts):
    """attention's own exception for these options (its scalar checks run before the device check, so CPU tensors
    reach them): (type, message)."""
    q, k, v, _, _ = _small()
    with pytest.raises((TypeError, ValueError)) as refused:
        attention(q, k, v, **opts)
    return type(refused.value), str(refused.value)


@pytest.mark.parametrize("option", list(_BAD_OPTIONS))
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_references_refuse_the_scalar_options_attention_refuses(layout, option):
    """EQ: every reference raises attention's exception, type and message, for a scale of 0 / below 0 / NaN / bool /
    tensor, a softcap below 0 / NaN / infinite / bool, a causal that is not a bool, a window_size of floats, an array
    or a tensor equal to (-1, -1). Before the fix each ran (the
    infinite softcap and the NaN scale gave NaN everywhere; the others a finite reference of another rule)."""
    opts = _BAD_OPTIONS[option]
    kind, message = _attention_refusal(opts)
    if layout == "dense":
        calls = _dense_references(*_small(), **opts)
    else:
        calls = _varlen_references(*_small_varlen(), **opts)
    for name, call in calls.items():
        with pytest.raises(kind) as refused:
            call()
        assert str(refused.value) == message, name


def test_local_mask_refuses_a_causal_that_is_not_a_bool():
    """EQ: local_mask (public, the references' mask) with causal "no" built a causal mask (a truthy string); it now
    raises attention's TypeError. Its control: np.bool_ is taken as attention takes it."""
    with pytest.raises(TypeError, match="^causal must be a bool, got builtins.str$"):
        testing.local_mask(5, 7, causal="no")
    assert torch.equal(testing.local_mask(5, 7, causal=np.bool_(True)), testing.local_mask(5, 7, causal=True))


def test_references_take_the_values_attention_takes():
    """EQ, the control: the values attention accepts still run, with the same numbers as their plain float forms (an
    int scale as its float, a numpy scale and softcap as Python floats, the default scale as 1 / sqrt(head_dim))."""
    q, k, v, dout, dlse = _small()
    cases = [(dict(softmax_scale=1), dict(softmax_scale=1.0)),
             (dict(softmax_scale=np.float32(0.5), softcap=np.float64(3.0)), dict(softmax_scale=0.5, softcap=3.0)),
             (dict(), dict(softmax_scale=1 / math.sqrt(16))),
             (dict(causal=np.bool_(True), softcap=2), dict(causal=True, softcap=2.0))]
    for given, plain in cases:
        for name, call in _dense_references(q, k, v, dout, dlse, **given).items():
            expected = _dense_references(q, k, v, dout, dlse, **plain)[name]()
            assert all(torch.equal(a, b) for a, b in zip(call(), expected)), (name, given)


# ------------------------------------------------------------------------------------------------------ ER

def _wrong_output():
    """(ref, naive, wrong): a causal reference run and an output whose batch element 1 has its rows reversed."""
    q, k, v = _dense()
    ref, _ = testing.attention_ref(q, k, v, causal=True)
    naive, _ = testing.attention_ref(q, k, v, causal=True, upcast=False)
    wrong = ref.clone()
    wrong[1] = wrong[1].flip(0)
    return ref, naive, wrong.to(q.dtype)


@pytest.mark.parametrize("floor, kind", [(math.inf, ValueError), (math.nan, ValueError), (-1e-3, ValueError),
                                         (np.float64(np.inf), ValueError), (True, TypeError),
                                         (torch.tensor(math.inf), TypeError), ("1e-4", TypeError)],
                         ids=["inf", "nan", "negative", "numpy_inf", "bool", "tensor", "str"])
def test_rule_refuses_a_floor_that_bounds_nothing(floor, kind):
    """ER: assert_close_by_rule with a floor that is infinite, NaN, negative or not a real number raises naming floor,
    before comparing. Before the fix an infinite floor (also a numpy or 0-d tensor one) let an output with a batch
    element's rows reversed pass, and the others failed it only through the comparison's AssertionError."""
    ref, naive, wrong = _wrong_output()
    with pytest.raises(AssertionError, match="max abs error"):  # the control: the default floor catches it
        testing.assert_close_by_rule(wrong, ref, naive, "out")
    with pytest.raises(kind, match=r"^out: floor must be"):
        testing.assert_close_by_rule(wrong, ref, naive, "out", floor=floor)


def test_rule_refuses_a_floor_computed_from_an_infinite_lse():
    """ER, the way an infinite floor arises: a floor of max|ref| / 1024 (as tests/test_transformers_gpu.py computes one
    for logits) taken over a causal LSE with rows that see no key (-inf) is infinite. Before the fix an LSE off by 1 in
    every finite row passed with it; now a ValueError names floor. Finite floors, int ones included, still work."""
    q, k, v = _dense()
    q = torch.cat([q, q[:, :5]], dim=1)  # 22 queries, 17 keys: bottom-right causal leaves 5 rows without keys
    _, lse = testing.attention_ref(q, k, v, causal=True)
    _, naive_lse = testing.attention_ref(q, k, v, causal=True, upcast=False)
    assert torch.isneginf(lse).any() and torch.isfinite(lse).any()
    wrong = torch.where(torch.isfinite(lse), lse + 1, lse)
    floor = lse.double().abs().max().item() / 1024
    assert floor == math.inf
    with pytest.raises(ValueError, match=r"^lse: floor must be finite and >= 0"):
        testing.assert_close_by_rule(wrong, lse, naive_lse, "lse", floor=floor)
    finite_floor = lse.double().abs().masked_fill(torch.isinf(lse), 0).max().item() / 1024
    with pytest.raises(AssertionError, match="max abs error"):
        testing.assert_close_by_rule(wrong, lse, naive_lse, "lse", floor=finite_floor)
    for good in (finite_floor, 0, 0.0, np.float32(1e-4)):
        err, base = testing.assert_close_by_rule(naive_lse, lse, naive_lse, "lse", floor=good)
        assert err == base


# ------------------------------------------------------------------------------------------------------ ES

_MIXED = {"fp16_q_bf16_kv": (torch.float16, torch.bfloat16, torch.bfloat16),
          "fp32_q_bf16_kv": (torch.float32, torch.bfloat16, torch.bfloat16),
          "bf16_qk_fp32_v": (torch.bfloat16, torch.bfloat16, torch.float32),
          "fp64_q_fp32_kv": (torch.float64, torch.float32, torch.float32)}


@pytest.mark.parametrize("dtypes", list(_MIXED))
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_references_refuse_mixed_dtypes(layout, dtypes):
    """ES: q, k, v of different dtypes (an fp32 query from a norm beside bf16 keys; half keys beside a float32 value):
    every reference raises a TypeError naming the three dtypes, as attention does for its fp16 / bf16 mixtures. Before
    the fix the float32 references of fp16 / bf16 mixtures ran (on a call attention refuses), the gradient references
    ran with k and v cast to q's dtype, and the rest failed inside einsum with "expected m1 and m2 to have the same
    dtype" / "expected scalar type Float but found Double" (RuntimeError, naming nothing)."""
    dq, dk, dv = _MIXED[dtypes]
    if layout == "dense":
        q, k, v, dout, dlse = _small()
        calls = _dense_references(q.to(dq), k.to(dk), v.to(dv), dout.to(dq), dlse)
    else:
        q, k, v, cu_q, cu_k, dout, dlse = _small_varlen()
        calls = _varlen_references(q.to(dq), k.to(dk), v.to(dv), cu_q, cu_k, dout.to(dq), dlse)
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"^q, k and v must share one dtype, got q "
                                            rf"{dq}, k {dk}, v {dv}$"):
            call()
    if all(dtype in (torch.float16, torch.bfloat16) for dtype in (dq, dk, dv)):
        with pytest.raises(TypeError, match="must share one dtype"):  # attention's own refusal of the mixture
            attention(q.to(dq), k.to(dk), v.to(dv)) if layout == "dense" else attention_varlen(
                q.to(dq), k.to(dk), v.to(dv), cu_q, cu_k, 6, 6)


def test_references_refuse_float_document_ids():
    """ES: document_ids of a floating dtype raise attention's TypeError. Before the fix the references truncated them
    (ids 0.25 and 0.75 of two intended documents became one document 0). Each integer dtype attention takes gives the
    same reference bits (the control)."""
    q, k, v, dout, dlse = _small()
    k, v = k[:, :9], v[:, :9]
    float_ids = torch.tensor([[0.25] * 4 + [0.75] * 5, [0.5] * 9])
    with pytest.raises(TypeError) as refused_by_attention:
        attention(q, k, v, document_ids=float_ids)
    for name, call in _dense_references(q, k, v, dout, dlse, document_ids=float_ids).items():
        if name == "attention_bwd_ref":
            continue  # (takes no document_ids)
        with pytest.raises(TypeError) as refused:
            call()
        assert str(refused.value) == str(refused_by_attention.value), name
    ids = torch.tensor([[0] * 4 + [1] * 5, [2] * 9])
    expected = testing.attention_ref(q, k, v, document_ids=ids.to(torch.int32))
    for dtype in (torch.int8, torch.int16, torch.int64, torch.uint8):
        got = testing.attention_ref(q, k, v, document_ids=ids.to(dtype))
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), dtype


def test_references_name_arguments_that_are_not_tensors():
    """ES: a cu_seqlens, document_ids, dout or q given as a list raised AttributeError ("'list' object has no attribute
    'dim'" / "'shape'"), naming no argument; each now raises a TypeError naming it."""
    q, k, v, cu_q, cu_k, dout, _ = _small_varlen()
    with pytest.raises(TypeError, match="^cu_seqlens_q must be a torch.Tensor, got list$"):
        testing.attention_varlen_ref(q, k, v, [0, 5, 5, 9], cu_k)
    with pytest.raises(TypeError, match="^dout must be a torch.Tensor, got list$"):
        testing.attention_varlen_ref_grads(q, k, v, dout.tolist(), cu_q, cu_k)
    qd, kd, vd, _, _ = _small()
    with pytest.raises(TypeError, match="^document_ids must be a torch.Tensor, got list$"):
        testing.attention_ref(qd, kd[:, :9], vd[:, :9], document_ids=[[0] * 9, [1] * 9])
    with pytest.raises(TypeError, match="^q must be a torch.Tensor, got list$"):
        testing.attention_bwd_ref(qd.tolist(), kd, vd, qd)


# ------------------------------------------------------------------------------------------------------ ET

def _owns_exactly_its_storage(t):
    """Contiguous, at offset 0 of a storage of exactly its own bytes, and flattenable by .view (what a slice of a
    padded buffer is not)."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            and t.view(t.shape[0], -1).shape == (t.shape[0], t.numel() // max(t.shape[0], 1)))


def test_varlen_results_padded_by_the_python_layer_own_exactly_their_storage(cpu_ops):
    """ET: where q has rows before the first and past the last sequence, the Python layer cuts q, k, v at
    cu_seqlens[-1] and pads out and the LSE back (and autograd's slice backward pads dq, dk, dv): all five contiguous,
    each owning exactly its storage (a slice of a padded buffer would not), with the shapes of the inputs. (Outputs
    the ops return as they are come from the kernels: tests/test_bug_reports_twentyfirst_gpu.py; here they would be
    the stand-ins'.)"""
    q, k, v = _varlen()
    cu_q, cu_k = _cu([2, 7, 7, 25]), _cu([0, 9, 20, 30])  # q has 30 rows, k and v 34
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    out, lse = attention_varlen(*leaves, cu_q, cu_k, 18, 11, causal=True, return_lse=True)
    assert out.shape == (30, 4, 64) and lse.shape == (4, 30)
    grads = torch.autograd.grad((out, lse), leaves, (torch.randn_like(out), torch.randn_like(lse)))
    assert [g.shape for g in grads] == [t.shape for t in leaves]
    for name, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        assert _owns_exactly_its_storage(t), name
