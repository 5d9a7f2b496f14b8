"""The softcap's tanh (flash/common/utils.hpp softcap_tanh: tanh.approx.f32) on an sm90 GPU, forward and backward:
scores all well below the cap, query and key rows of magnitudes 0.2 to 10 side by side (an attention sink's large
scores beside small ones), and the tanh's accuracy read directly off the LSE. Against the float32 reference by the
rule of DESIGN.md §3. Skipped, with the reason, without an sm90 GPU and the built extension."""

import math

import pytest
import torch

from flash_attn_hopper import attention
from gpu_helpers import randn as _randn
from gpu_helpers import require_built as _require_built
from test_features_gpu import _inputs, _run_and_check

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softcap_small_scores(dtype, head_dim, causal):
    """Unscaled inputs under softcap 30 (|softmax_scale * S| rarely above 5: tanh near its linear part, P under the
    fixed maximum near exp(-30)); 30 is the fixed maximum's largest cap for bf16, fp16 runs the online one."""
    _require_built(head_dim, dtype)
    q, k, v, dout = _inputs(2, 239, 377, 3, 3, head_dim, dtype)
    _run_and_check(q, k, v, dout, f"softcap 30 small scores causal={causal}", causal=causal, softcap=30.0)


@pytest.mark.parametrize("cap", [8.0, 30.0, 50.0])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softcap_rows_of_mixed_magnitude(dtype, head_dim, cap):
    """Query rows scaled from 0.2 to 10 in a repeating pattern (times sqrt(cap / 8), so up to 25 at cap 50), keys from
    0.2 to 10 in the reverse pattern, so one warp's scores run from the linear part of tanh to its saturation."""
    _require_built(head_dim, dtype)
    q, k, v, dout = _inputs(2, 333, 290, 2, 2, head_dim, dtype)
    row_scale = torch.tensor([0.2, 0.5, 1.0, 3.0, 10.0], device="cuda").repeat(80)
    q = (q.float() * row_scale[:333, None, None] * math.sqrt(cap / 8)).to(dtype)
    k = (k.float() * row_scale.flip(0)[:290, None, None]).to(dtype)
    _run_and_check(q, k, v, dout, f"softcap {cap} mixed", causal=True, softcap=cap)


@pytest.mark.parametrize("cap", [10.0, 30.0, 30.5])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softcap_tanh_accuracy_through_the_lse(dtype, head_dim, cap):
    """Every key equal to e_0 and query row i to a_i e_0: row i's scores all equal a_i, so its LSE is
    cap * tanh(a_i * softmax_scale / cap) + log(seqlen_k) in exact arithmetic. With x = a_i * softmax_scale / cap from
    -1.5 to 1.5 the LSE's error is the tanh's error times cap plus float32 rounding: at most 6e-4 relative in tanh
    (tanh.approx.f32's ~2^-11 = 4.9e-4), plus 5e-5 absolute."""
    _require_built(head_dim, dtype)
    seqlen_q, seqlen_k, nheads = 256, 200, 2
    scale = 1.0 / math.sqrt(head_dim)
    x_target = torch.linspace(-1.5, 1.5, seqlen_q, device="cuda", dtype=torch.float64)
    a = (x_target * cap / scale).to(dtype)  # representable scores; x below from the rounded ones
    q = torch.zeros(1, seqlen_q, nheads, head_dim, device="cuda", dtype=dtype)
    q[0, :, :, 0] = a[:, None]
    k = torch.zeros(1, seqlen_k, nheads, head_dim, device="cuda", dtype=dtype)
    k[0, :, :, 0] = 1.0
    v = _randn(1, seqlen_k, nheads, head_dim, dtype=dtype)
    _, lse = attention(q, k, v, return_lse=True, softcap=cap)
    x = a.double() * scale / cap
    t = torch.tanh(x)
    expected = cap * t + math.log(seqlen_k)
    bound = (cap * t.abs() * 6e-4 + 5e-5)[None, :].expand(nheads, -1)
    err = (lse[0].double() - expected[None, :]).abs()
    worst = int((err - bound).argmax()) % seqlen_q
    assert (err <= bound).all(), (
        f"LSE off by more than the tanh's error: row {worst} x {x[worst].item():.4f} error "
        f"{err[:, worst].max().item():.3e} bound {bound[0, worst].item():.3e}")
