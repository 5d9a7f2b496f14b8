"""Direct ``torch.ops.flash_attn_hopper.*`` calls on meta tensors (docs/training.md's FLOP counting, shape tracing),
and the loader's advice when the dynamic loader refuses the extension.

Found by a first-time-user trial of the README (session 47): meta and fake tensors never reach the C++ ops' checks,
so the fake kernels accepted float32 inputs, head_dim 60, nheads 2 over nheads_k 3, a negative softmax_scale, window
sides below -1, k and v of different seqlen_k or a wrong-shaped lse, and a q of the wrong rank failed inside the
shape unpacking ("not enough values to unpack"). The fake kernels now run the C++ checks that the output shapes rest
on, with the same messages and error type (RuntimeError). A build made on a machine with a newer glibc failed to load
with the advice to rebuild against this torch; the advice now names the C runtime.

No GPU: meta tensors; needs the compiled extension (the ops' schemas), and skips without it."""

import re

import pytest
import torch

from flash_attn_hopper import _ops

needs_ops = pytest.mark.skipif(
    not _ops.EXTENSION_LOADED, reason="the compiled extension is not built here (CI builds it; see README)"
)

ops = torch.ops.flash_attn_hopper if _ops.EXTENSION_LOADED else None


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def _dense(q_shape=(2, 33, 4, 64), k_shape=(2, 33, 4, 64), v_shape=None, dtype=torch.bfloat16):
    q, k = _meta(*q_shape, dtype=dtype), _meta(*k_shape, dtype=dtype)
    return q, k, _meta(*(v_shape or k_shape), dtype=dtype)


# (case id, q/k/v, softmax_scale, causal, window_left, window_right, softcap, the message's start)
_DENSE_BAD = [
    ("rank3_q", dict(q_shape=(33, 4, 64)), 0.1, False, -1, -1, 0.0, "q must have rank 4"),
    ("rank5_v", dict(v_shape=(2, 33, 4, 64, 1)), 0.1, False, -1, -1, 0.0, "v must have rank 4"),
    ("float32", dict(dtype=torch.float32), 0.1, False, -1, -1, 0.0, "q must be float16 or bfloat16"),
    ("head_dim_60", dict(q_shape=(2, 33, 4, 60), k_shape=(2, 33, 4, 60)), 0.1, False, -1, -1, 0.0,
     "head_dim must be a multiple of 8 in [8, 256], got 60"),
    ("head_dim_v_264", dict(v_shape=(2, 33, 4, 264)), 0.1, False, -1, -1, 0.0,
     "v's head_dim must be a multiple of 8 in [8, 256], got 264"),
    ("k_head_dim", dict(k_shape=(2, 33, 4, 128), v_shape=(2, 33, 4, 64)), 0.1, False, -1, -1, 0.0,
     "k must have head_dim 64, got 128"),
    ("nheads_2_over_3", dict(q_shape=(2, 33, 2, 64), k_shape=(2, 33, 3, 64)), 0.1, False, -1, -1, 0.0,
     "q's nheads must be a multiple of k's and v's nheads_k, got 2 and 3"),
    ("v_nheads_k", dict(v_shape=(2, 33, 2, 64)), 0.1, False, -1, -1, 0.0, "k and v must have the same nheads_k"),
    ("v_seqlen_k", dict(v_shape=(2, 40, 4, 64)), 0.1, False, -1, -1, 0.0, "k and v must have the same seqlen_k"),
    ("k_batch", dict(k_shape=(3, 33, 4, 64)), 0.1, False, -1, -1, 0.0, "k must match q in batch"),
    ("negative_scale", {}, -0.1, False, -1, -1, 0.0, "softmax_scale must be finite and > 0"),
    ("nan_scale", {}, float("nan"), False, -1, -1, 0.0, "softmax_scale must be finite and > 0"),
    ("window_left_-5", {}, 0.1, False, -5, -1, 0.0, "window_size entries must be >= -1"),
    ("causal_right_3", {}, 0.1, True, -1, 3, 0.0, "causal=True fixes the window's right side at 0"),
    ("negative_softcap", {}, 0.1, False, -1, -1, -1.0, "softcap must be finite and >= 0"),
    # float32 rounding, as the C++ ops (a first-time-user trial, session 55: the fakes passed these)
    ("scale_1e39", {}, 1e39, False, -1, -1, 0.0, "softmax_scale must be a positive normal float32 value"),
    ("scale_1e-50", {}, 1e-50, False, -1, -1, 0.0, "softmax_scale must be a positive normal float32 value"),
    ("scale_subnormal", {}, 2.0 ** -127, False, -1, -1, 0.0, "softmax_scale must be a positive normal float32 value"),
    ("scale_3e38_times_log2e", {}, 3e38, False, -1, -1, 0.0,
     "softmax_scale must be a positive normal float32 value, also times log2(e)"),
    ("softcap_1e300", {}, 0.1, False, -1, -1, 1e300, "softmax_scale / softcap must be a normal float32 value"),
    ("softcap_1e-45", {}, 1e-30, False, -1, -1, 1e-45, "softcap times log2(e) must be a positive normal float32"),
]


@needs_ops
@pytest.mark.parametrize("case", _DENSE_BAD, ids=[c[0] for c in _DENSE_BAD])
def test_fwd_on_meta_raises_the_ops_error(case):
    _, shapes, scale, causal, left, right, softcap, message = case
    q, k, v = _dense(**shapes)
    with pytest.raises(RuntimeError, match="^" + re.escape(message)):
        ops.fwd(q, k, v, scale, causal, left, right, softcap, False)


@needs_ops
@pytest.mark.parametrize("case", _DENSE_BAD, ids=[c[0] for c in _DENSE_BAD])
def test_bwd_on_meta_raises_the_ops_error(case):
    _, shapes, scale, causal, left, right, softcap, message = case
    q, k, v = _dense(**shapes)
    out = _meta(*q.shape[:-1], v.shape[-1], dtype=q.dtype) if q.dim() == 4 and v.dim() == 4 else q
    lse = _meta(2, 4, 33, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="^" + re.escape(message)):
        ops.bwd(out, q, k, v, out, lse, None, scale, causal, left, right, softcap, False)


@needs_ops
def test_valid_calls_on_meta_give_the_output_shapes():
    """The checks pass what the ops accept: GQA 6 over 2 with head_dim_v 128 beside 192, a causal window, a softcap."""
    q, k, v = _dense((2, 33, 6, 192), (2, 50, 2, 192), (2, 50, 2, 128))
    out, lse = ops.fwd(q, k, v, 0.1, True, 7, 0, 30.0, False)
    assert out.shape == (2, 33, 6, 128) and out.dtype == q.dtype and lse.shape == (2, 6, 33)
    assert lse.dtype == torch.float32
    grads = ops.bwd(out, q, k, v, out, lse, None, 0.1, True, 7, 0, 30.0, True)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    cu = torch.zeros(4, dtype=torch.int32, device="meta")
    q3, k3, v3 = _meta(40, 6, 64, dtype=torch.float16), _meta(70, 3, 64, dtype=torch.float16), \
        _meta(70, 3, 64, dtype=torch.float16)
    out3, lse3 = ops.fwd_varlen(q3, k3, v3, cu, cu, 20, 30, 0.125, False, 5, 5, 0.0, False)
    assert out3.shape == (40, 6, 64) and lse3.shape == (6, 40)
    grads3 = ops.bwd_varlen(out3, q3, k3, v3, out3, lse3, None, cu, cu, 20, 30, 0.125, False, 5, 5, 0.0, False)
    assert [g.shape for g in grads3] == [q3.shape, k3.shape, v3.shape]


_RANK3 = "must have rank 3 (total_tokens, nheads, head_dim) for variable-length attention"
_RANK3_MESSAGES = ("q, k, v " + _RANK3, "q, k, v, out, dout " + _RANK3)  # fwd_varlen's, bwd_varlen's


@needs_ops
@pytest.mark.parametrize("case", [
    ("rank4_q", (1, 40, 4, 64), (40, 4, 64), 0.1, -1, 0.0, _RANK3_MESSAGES),
    ("float32_rank4_q", (1, 40, 4, 64), (40, 4, 64), 0.1, -1, 0.0, _RANK3_MESSAGES),
    ("head_dim_40_k", (40, 4, 64), (40, 4, 40), 0.1, -1, 0.0, "k must have head_dim 64, got 40"),
    ("window_right_-2", (40, 4, 64), (40, 4, 64), 0.1, -2, 0.0, "window_size entries must be >= -1"),
    ("inf_softcap", (40, 4, 64), (40, 4, 64), 0.1, -1, float("inf"), "softcap must be finite and >= 0"),
    ("scale_1e39", (40, 4, 64), (40, 4, 64), 1e39, -1, 0.0, "softmax_scale must be a positive normal float32 value"),
    ("softcap_1e300", (40, 4, 64), (40, 4, 64), 0.1, -1, 1e300, "softmax_scale / softcap must be a normal float32"),
], ids=lambda c: c[0])
def test_varlen_ops_on_meta_raise_the_ops_error(case):
    """As the C++ varlen ops: ranks are checked first (a float32 rank-4 q gets the rank's message), then the rest."""
    name, q_shape, k_shape, scale, right, softcap, message = case
    fwd_message, bwd_message = message if isinstance(message, tuple) else (message, message)
    q = _meta(*q_shape, dtype=torch.float32 if name.startswith("float32") else torch.bfloat16)
    k, v = _meta(*k_shape), _meta(*k_shape)
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    with pytest.raises(RuntimeError, match="^" + re.escape(fwd_message)):
        ops.fwd_varlen(q, k, v, cu, cu, 20, 20, scale, False, -1, right, softcap, False)
    lse = _meta(4, 40, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="^" + re.escape(bwd_message)):
        ops.bwd_varlen(q, q, k, v, q, lse, None, cu, cu, 20, 20, scale, False, -1, right, softcap, False)


_CU = "must be a contiguous 1-D int32 tensor of length batch + 1 on q's device"


@needs_ops
@pytest.mark.parametrize("case", [
    ("float32_cu_q", dict(cu_q=torch.zeros(3, device="meta")), "cu_seqlens_q " + _CU),
    ("int64_cu_k", dict(cu_k=torch.zeros(3, dtype=torch.int64, device="meta")), "cu_seqlens_k " + _CU),
    ("2d_cu_q", dict(cu_q=torch.zeros(1, 3, dtype=torch.int32, device="meta")), "cu_seqlens_q " + _CU),
    ("empty_cu_k", dict(cu_k=torch.zeros(0, dtype=torch.int32, device="meta")), "cu_seqlens_k " + _CU),
    ("strided_cu_q", dict(cu_q=torch.zeros(6, dtype=torch.int32, device="meta")[::2]), "cu_seqlens_q " + _CU),
    ("cpu_cu_q", dict(cu_q=torch.zeros(3, dtype=torch.int32)), "cu_seqlens_q " + _CU),
    ("lengths_differ", dict(cu_k=torch.zeros(4, dtype=torch.int32, device="meta")),
     "cu_seqlens_q and cu_seqlens_k must have the same length"),
    ("negative_max", dict(max_q=-5), "max_seqlen_q and max_seqlen_k must be in [0, 2^31)"),
    ("max_past_int32", dict(max_k=2**31), "max_seqlen_q and max_seqlen_k must be in [0, 2^31)"),
], ids=lambda c: c[0] if isinstance(c, tuple) else None)
def test_varlen_ops_on_meta_check_cu_seqlens_and_maxima(case):
    """As the C++ varlen ops' check_varlen (a new-user trial found the fake kernels accepting float32 and 2-D
    cu_seqlens, lengths that differ and a negative max_seqlen)."""
    _, bad, message = case
    q, k, v = _meta(40, 4, 64), _meta(40, 4, 64), _meta(40, 4, 64)
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    cu_q, cu_k = bad.get("cu_q", cu), bad.get("cu_k", cu)
    max_q, max_k = bad.get("max_q", 20), bad.get("max_k", 20)
    with pytest.raises(RuntimeError, match="^" + re.escape(message)):
        ops.fwd_varlen(q, k, v, cu_q, cu_k, max_q, max_k, 0.1, False, -1, -1, 0.0, False)
    lse = _meta(4, 40, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="^" + re.escape(message)):
        ops.bwd_varlen(q, q, k, v, q, lse, None, cu_q, cu_k, max_q, max_k, 0.1, False, -1, -1, 0.0, False)


@needs_ops
def test_bwd_on_meta_checks_lse_and_out():
    q, k, v = _dense()
    lse = _meta(2, 4, 33, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"^lse must be the contiguous float32 \(batch, nheads, seqlen_q\)"):
        ops.bwd(q, q, k, v, q, _meta(2, 4, 33, dtype=torch.bfloat16), None, 0.1, False, -1, -1, 0.0, False)
    with pytest.raises(RuntimeError, match=r"^lse must be the contiguous float32 \(batch, nheads, seqlen_q\)"):
        ops.bwd(q, q, k, v, q, _meta(2, 4, dtype=torch.float32), None, 0.1, False, -1, -1, 0.0, False)
    with pytest.raises(RuntimeError, match=r"^out and dout must be \(batch, seqlen_q, nheads, head_dim_v\)"):
        ops.bwd(_meta(2, 30, 4, 64), q, k, v, q, lse, None, 0.1, False, -1, -1, 0.0, False)
    with pytest.raises(RuntimeError, match="^dout must have the dtype of q"):
        ops.bwd(_meta(2, 33, 4, 64, dtype=torch.float16), q, k, v, q, lse, None, 0.1, False, -1, -1, 0.0, False)


@pytest.mark.parametrize("reason, advice", [
    ("version `GLIBC_2.38' not found (required by /x/_C.abi3.so)", "newer C or C++ runtime"),
    ("/lib/libstdc++.so.6: version `GLIBCXX_3.4.32' not found", "newer C or C++ runtime"),
    ("symbol _ZSt4endl version GLIBCXX_3.4.29 not defined in file libstdc++.so.6", "newer C or C++ runtime"),
    ("version `CXXABI_1.3.15' not found", "newer C or C++ runtime"),
    ("/x/_C.abi3.so: undefined symbol: _ZN3c104cuda9SetDeviceEa", "built against another torch version"),
    ("libcudart.so.13: cannot open shared object file", "if it was built against another one"),
], ids=["glibc", "glibcxx", "glibcxx_not_defined", "cxxabi", "undefined_symbol", "other"])
def test_load_advice_names_the_cause(reason, advice):
    hint = _ops._load_hint(reason)
    assert advice in hint and "pip install --no-build-isolation ." in hint


@needs_ops
@pytest.mark.parametrize("name, words", [
    ("fwd", ["(batch, seqlen_q, nheads, head_dim)", "lse (batch, nheads, seqlen_q) float32", "RuntimeError"]),
    ("bwd", ["dlse", "(batch, nheads, seqlen_q)", "RuntimeError"]),
    ("fwd_varlen", ["(total_q, nheads, head_dim)", "cu_seqlens_q", "lse (nheads, total_q) float32"]),
    ("bwd_varlen", ["(nheads, total_q)", "zero gradients"]),
    ("build_config", ["head_dims="]),
    ("fwd_block_m", ["num_sms", "128 or 192"]),
    ("doc_bounds_partition", ["int32 (batch, seqlen, 2)", "RuntimeError"]),
])
def test_ops_have_docstrings(name, words):
    """help(torch.ops.flash_attn_hopper.<op>) tells shapes, dtypes and errors (the C++ schemas carry no text)."""
    for target in (getattr(ops, name), getattr(ops, name).default):
        doc = target.__doc__ or ""
        assert doc.startswith(name + "("), (name, doc[:80])
        for word in words:
            assert word in doc, (name, word)


def _cpu_op_args(op):
    q = torch.randn(2, 33, 4, 64, dtype=torch.bfloat16)
    lse = torch.zeros(2, 4, 33)
    opts = (0.125, False, -1, -1, 0.0, False)
    if op == "fwd":
        return (q, q, q, *opts)
    if op == "bwd":
        return (q, q, q, q, q, lse, None, *opts)
    packed = q[0]
    cu = torch.tensor([0, 33], dtype=torch.int32)
    if op == "fwd_varlen":
        return (packed, packed, packed, cu, cu, 33, 33, *opts)
    return (packed, packed, packed, packed, packed, lse[0], None, cu, cu, 33, 33, *opts)


@needs_ops
@pytest.mark.parametrize("op,first", [("fwd", "q"), ("bwd", "dout"), ("fwd_varlen", "q"), ("bwd_varlen", "dout")])
def test_ops_on_cpu_tensors_name_the_op_and_the_tensor(op, first):
    """A direct op call with CPU tensors (a new user's trial, session 72): a RuntimeError naming the op and its first
    CPU tensor, not the dispatcher's NotImplementedError listing backends; the Python functions refuse earlier
    (ValueError naming the tensor)."""
    with pytest.raises(RuntimeError, match=re.escape(f"flash_attn_hopper::{op}: {first} is a CPU tensor")):
        getattr(ops, op)(*_cpu_op_args(op))
