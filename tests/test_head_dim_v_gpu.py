"""v with its own head dim (head_dim_v != head_dim, issue 5 item 5): q/k of head_dim, v, out, dout and dv of head_dim_v,
e.g. DeepSeek-style (192, 128). The pair runs on the kernels of the larger one (192/128: forward 192, backward 256);
each tensor's columns past its own head dim load as zeros and are never stored. Forward and backward against the
float32 reference by the rule of DESIGN.md §3 with NaN-poisoned memory, exactness against explicit zero padding, NaN
canaries past v and dout, and compute-sanitizer memcheck. Skipped, with the reason, without an sm90 GPU and the built
extension (see conftest.py)."""

import math

import pytest
import torch

from flash_attn_hopper import attention
from gpu_helpers import GRAD_NAMES
from gpu_helpers import attention_inputs
from gpu_helpers import bits as _bits
from gpu_helpers import built_dtype as _built_dtype
from gpu_helpers import check_attention as _check
from gpu_helpers import check_deterministic as _check_deterministic
from gpu_helpers import check_varlen as _check_varlen
from gpu_helpers import in_canary_buffers as _in_canary_buffers
from gpu_helpers import require_built as _require_built
from gpu_helpers import run_attention as _run
from gpu_helpers import memcheck_script, run_memcheck

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

# (head_dim, head_dim_v): DeepSeek's, v narrower and wider, both below a kernel size, v at the 256 kernel's edge.
PAIRS = [(192, 128), (128, 64), (64, 128), (40, 72), (256, 128)]
PAIR_IDS = [f"{d}-{dv}" for d, dv in PAIRS]
SEQLENS = [(1, 1), (113, 257), (513, 700)]
DEVICE = "cuda"


def _inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v, dtype):
    return attention_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, head_dim_v=head_dim_v)


def _dtype(head_dim, head_dim_v):
    return _built_dtype(max(head_dim, head_dim_v))


# ------------------------------------------------------------------------------------------------- main grid


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim,head_dim_v", PAIRS, ids=PAIR_IDS)
def test_head_dim_v_matches_reference(head_dim, head_dim_v, causal, seqlen_q, seqlen_k):
    dtype = _dtype(head_dim, head_dim_v)
    q, k, v, dout = _inputs(2, seqlen_q, seqlen_k, 3, 3, head_dim, head_dim_v, dtype)
    before = [_bits(t) for t in (q, k, v, dout)]
    out, lse, grads = _run(q, k, v, dout, causal=causal)
    _check(out, lse, grads, q, k, v, dout, f"({head_dim}, {head_dim_v})", causal=causal)
    for t, b in zip((q, k, v, dout), before):
        assert torch.equal(_bits(t), b), "an input was modified"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 128), (64, 128)], ids=["192-128", "64-128"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_head_dim_v_dtypes(dtype, head_dim, head_dim_v, causal):
    _require_built(max(head_dim, head_dim_v), dtype)
    q, k, v, dout = _inputs(2, 257, 300, 4, 4, head_dim, head_dim_v, dtype)
    out, lse, grads = _run(q, k, v, dout, causal=causal)
    _check(out, lse, grads, q, k, v, dout, f"{dtype} ({head_dim}, {head_dim_v})", causal=causal)


@pytest.mark.parametrize(
    "head_dim,head_dim_v,nheads_k,opts",
    [
        (192, 128, 2, dict(causal=True)),
        (192, 128, 2, dict(window_size=(64, 17))),
        (192, 128, 1, dict(softcap=15.0, causal=True)),
        (128, 64, 2, dict(causal=True, window_size=(40, 0))),
        (64, 128, 2, dict(softcap=10.0)),
        (40, 72, 3, dict(window_size=(33, 33))),
        (256, 128, 2, dict(causal=True)),
    ],
    ids=["192-128-gqa-causal", "192-128-gqa-window", "192-128-mqa-softcap", "128-64-gqa-window", "64-128-gqa-softcap",
         "40-72-mha-window", "256-128-gqa-causal"],
)
def test_head_dim_v_gqa_window_softcap(head_dim, head_dim_v, nheads_k, opts):
    """GQA/MQA (dK and dV summed in fp32 buffers with rows of their own head dims), windows and softcap."""
    dtype = _dtype(head_dim, head_dim_v)
    q, k, v, dout = _inputs(2, 513, 700, 6, nheads_k, head_dim, head_dim_v, dtype)
    if "softcap" in opts:
        q, k = q * 2, k * 2
    out, lse, grads = _run(q, k, v, dout, **opts)
    _check(out, lse, grads, q, k, v, dout, f"({head_dim}, {head_dim_v}) {opts}", **opts)


@pytest.mark.parametrize("head_dim,head_dim_v,nheads_k", [(192, 128, 2), (64, 128, 6), (128, 64, 3)])
def test_head_dim_v_lse_loss(head_dim, head_dim_v, nheads_k):
    """A loss that uses the LSE too (dLSE folds into D, which the preprocess computes over head_dim_v columns)."""
    dtype = _dtype(head_dim, head_dim_v)
    q, k, v, dout = _inputs(2, 300, 257, 6, nheads_k, head_dim, head_dim_v, dtype)
    dlse = torch.randn(2, 6, 300, device=DEVICE)
    out, lse, grads = _run(q, k, v, dout, dlse=dlse, causal=True)
    _check(out, lse, grads, q, k, v, dout, f"lse loss ({head_dim}, {head_dim_v})", dlse=dlse, causal=True)


@pytest.mark.parametrize("head_dim,head_dim_v,nheads_k", [(192, 128, 2), (64, 128, 6), (40, 72, 1)])
def test_head_dim_v_deterministic(head_dim, head_dim_v, nheads_k):
    """Deterministic mode: bitwise-equal repeats and the right answer (GQA: the dV sums in head_dim_v rows)."""
    dtype = _dtype(head_dim, head_dim_v)
    q, k, v, dout = _inputs(2, 600, 700, 6, nheads_k, head_dim, head_dim_v, dtype)
    _check_deterministic(q, k, v, dout, f"deterministic ({head_dim}, {head_dim_v})")


# ------------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 128), (64, 128), (40, 72)], ids=["192-128", "64-128", "40-72"])
def test_same_as_explicit_zero_padding(head_dim, head_dim_v):
    """The result is bitwise that of the narrower tensors zero-padded by hand to the wider head dim (the same kernel
    runs both), with q's head_dim's softmax scale, and the padded run's extra columns are exactly 0."""
    width = max(head_dim, head_dim_v)
    dtype = _dtype(head_dim, head_dim_v)
    q, k, v, dout = _inputs(2, 300, 257, 4, 2, head_dim, head_dim_v, dtype)
    pads = [width - head_dim] * 2 + [width - head_dim_v] * 2
    padded = [torch.nn.functional.pad(t, (0, p)) for t, p in zip((q, k, v, dout), pads)]

    def run(q, k, v, dout):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out, lse = attention(*leaves, causal=True, return_lse=True, deterministic=True,
                             softmax_scale=1.0 / math.sqrt(head_dim))
        return out.detach(), lse, torch.autograd.grad(out, leaves, dout)

    out, lse, grads = run(q, k, v, dout)
    out_p, lse_p, grads_p = run(*padded)
    assert torch.equal(out, out_p[..., :head_dim_v]) and torch.equal(lse, lse_p)
    assert torch.equal(out_p[..., head_dim_v:], torch.zeros_like(out_p[..., head_dim_v:]))
    for gname, g, gp, d in zip(GRAD_NAMES, grads, grads_p, (head_dim, head_dim, head_dim_v)):
        assert torch.equal(g, gp[..., :d]), f"{gname} differs from the zero-padded run"
        assert torch.equal(gp[..., d:], torch.zeros_like(gp[..., d:])), f"padded {gname} columns not 0"


def test_default_scale_is_of_q_head_dim():
    head_dim, head_dim_v = 192, 128
    dtype = _dtype(head_dim, head_dim_v)
    q, k, v, _ = _inputs(2, 200, 150, 3, 3, head_dim, head_dim_v, dtype)
    assert torch.equal(attention(q, k, v), attention(q, k, v, softmax_scale=1.0 / math.sqrt(head_dim)))


@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 128), (64, 128)], ids=["192-128", "64-128"])
def test_opcheck_fake_kernels(head_dim, head_dim_v):
    """The fake kernels (torch.compile) give out head_dim_v and dv v's shape, as the CUDA kernels do."""
    dtype = _dtype(head_dim, head_dim_v)
    q, k, v, _ = _inputs(2, 77, 140, 4, 2, head_dim, head_dim_v, dtype)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    scale = head_dim**-0.5
    options = (True, -1, 0, 0.0, False)
    torch.library.opcheck(torch.ops.flash_attn_hopper.fwd.default, (q, k, v, scale, *options))
    out, lse = torch.ops.flash_attn_hopper.fwd(q.detach(), k.detach(), v.detach(), scale, *options)
    assert out.shape == (2, 77, 4, head_dim_v)
    torch.library.opcheck(
        torch.ops.flash_attn_hopper.bwd.default,
        (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, None, scale, *options),
    )


# ------------------------------------------------------------------------------------------------ variable length


@pytest.mark.parametrize(
    "head_dim,head_dim_v,nheads_k,opts",
    [(192, 128, 2, dict(causal=True)), (64, 128, 4, dict(window_size=(33, 5))), (128, 64, 1, dict())],
    ids=["192-128-gqa-causal", "64-128-window", "128-64-mqa"],
)
def test_head_dim_v_varlen(head_dim, head_dim_v, nheads_k, opts):
    _check_varlen(head_dim, head_dim_v, nheads_k, _dtype(head_dim, head_dim_v), f"{head_dim}/{head_dim_v}", **opts)


# ------------------------------------------------------------------------------- canaries and memcheck


@pytest.mark.parametrize("head_dim,head_dim_v,nheads_k", [(192, 128, 2), (64, 128, 1), (128, 64, 4)])
def test_no_access_past_the_tensors(head_dim, head_dim_v, nheads_k):
    """q, k, v and dout in NaN-filled buffers: reading v or dout (or O) as if they had the wider head dim would
    take NaN from past their ends or from the next row; no element of the buffers changes."""
    dtype = _dtype(head_dim, head_dim_v)
    tensors = _inputs(2, 257, 113, 4, nheads_k, head_dim, head_dim_v, dtype)
    (q, k, v, dout), check_canaries = _in_canary_buffers(*tensors)
    for deterministic in (False, True):
        out, lse, grads = _run(q, k, v, dout, causal=True, deterministic=deterministic)
        check_canaries(out, lse, grads)
    _check(out, lse, grads, *tensors, "canary", causal=True)


# both backward variants (256: P/dS in shared memory; 128: kSwapSdP), both dtypes, v wider and narrower, GQA/MQA
_SANITIZER_SCRIPT = memcheck_script(
    [(192, 128, 2, "bfloat16"), (64, 128, 4, "float16"), (128, 64, 1, "bfloat16")], lse_in_loss=True
)


def test_compute_sanitizer_memcheck():
    """Out-of-bounds global loads and stores with head_dim_v != head_dim: compute-sanitizer memcheck with the caching
    allocator off (every tensor its own allocation). Skipped without compute-sanitizer."""
    for width, dtype in ((256, torch.bfloat16), (128, torch.float16), (128, torch.bfloat16)):
        _require_built(width, dtype)
    run_memcheck(_SANITIZER_SCRIPT)
