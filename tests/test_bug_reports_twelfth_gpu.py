"""Twelfth round of the bug hunt (tests/bug_report_sources.md, "Twelfth round"), GPU part: direct calls of the ops.

- CX (the adversarial review): ``torch.ops.flash_attn_hopper.*`` called directly with a softcap and a softmax_scale
  that the Python layer refuses but the op's checks let through (they checked only softmax_scale / softcap and
  softcap * log2(e)). The kernels also take softmax_scale itself as a float32 (the backward's dQ and dK scale), which
  then rounded to 0 (uniform attention, dQ = 0, silently), to a subnormal (flushed to 0 under fast math) or to inf.
  Every such call must raise an error naming softmax_scale before any launch.

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build lacks
the head_dim / dtype (``built_dtype``)."""

import pytest
import torch

from gpu_helpers import attention_inputs, built_dtype, cu_seqlens

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

# (softmax_scale, softcap): each passes softmax_scale / softcap and softcap * log2(e) as normal float32 values, but
# softmax_scale as a float32 is 0, subnormal or inf
_BAD_SCALES = [(1e-46, 1e-37), (1e-40, 1e-37), (1e39, 1e38)]


@pytest.mark.parametrize("scale,softcap", _BAD_SCALES, ids=["zero", "subnormal", "inf"])
@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_direct_op_refuses_a_softmax_scale_with_no_float32_value(api, scale, softcap):
    head_dim = 64
    dtype = built_dtype(head_dim)
    q, k, v, dout = attention_inputs(2, 70, 90, 2, 2, head_dim, dtype)
    opts = (False, -1, -1, softcap, False)
    if api == "dense":
        out, lse = torch.ops.flash_attn_hopper.fwd(q, k, v, 0.125, False, -1, -1, 30.0, False)
        with pytest.raises(RuntimeError, match="softmax_scale"):
            torch.ops.flash_attn_hopper.fwd(q, k, v, scale, *opts)
        with pytest.raises(RuntimeError, match="softmax_scale"):
            torch.ops.flash_attn_hopper.bwd(dout, q, k, v, out, lse, None, scale, *opts)
    else:
        q, k, v, dout = (t.flatten(0, 1) for t in (q, k, v, dout))
        cu_q, cu_k = cu_seqlens([70, 70]), cu_seqlens([90, 90])
        out, lse = torch.ops.flash_attn_hopper.fwd_varlen(q, k, v, cu_q, cu_k, 70, 90, 0.125, False, -1, -1, 30.0,
                                                          False)
        with pytest.raises(RuntimeError, match="softmax_scale"):
            torch.ops.flash_attn_hopper.fwd_varlen(q, k, v, cu_q, cu_k, 70, 90, scale, *opts)
        with pytest.raises(RuntimeError, match="softmax_scale"):
            torch.ops.flash_attn_hopper.bwd_varlen(dout, q, k, v, out, lse, None, cu_q, cu_k, 70, 90, scale, *opts)
