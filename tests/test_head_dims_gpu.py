"""Head dims between the compiled kernel sizes (issue 5 item 5) on an sm90 GPU: every multiple of 8 up to 256 runs on
the smallest kernel that holds it (forward 64/96/128/192/256, backward 64/128/256), its extra columns loaded as zeros
(TMA zero-fill) and never stored. Forward and backward against the float32 reference by the rule of DESIGN.md §3,
with NaN-poisoned memory before each call; exactness against explicit zero padding; inputs that are slices of wider
buffers and tensors followed by NaN canaries (a read past a tensor or its head_dim gives NaN; a write changes the
canary). Skipped, with the reason, without an sm90 GPU and the built extension (see conftest.py)."""

import math

import pytest
import torch

from flash_attn_hopper import attention
from flash_attn_hopper.interface import kernel_head_dim
from gpu_helpers import GRAD_NAMES
from gpu_helpers import attention_inputs as _inputs
from gpu_helpers import bits as _bits
from gpu_helpers import built_dtype as _built_dtype
from gpu_helpers import check_attention as _check
from gpu_helpers import check_deterministic as _check_deterministic
from gpu_helpers import check_varlen as _check_varlen
from gpu_helpers import in_canary_buffers as _in_canary_buffers
from gpu_helpers import randn as _randn
from gpu_helpers import require_built as _require_built
from gpu_helpers import run_attention as _run
from gpu_helpers import memcheck_script, run_memcheck

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
# Below, between and at the kernel sizes' edges. Forward: 8..64 run on 64, 72..96 on 96, 104..128 on 128, 136..192 on
# 192, 200..256 on 256; backward: 8..64 on 64, 72..128 on 128, 136..256 on 256.
HEAD_DIMS = [8, 40, 72, 96, 104, 136, 192, 200, 248]
SEQLENS = [(1, 1), (113, 257), (257, 113), (513, 700)]
DEVICE = "cuda"


# ------------------------------------------------------------------------------------------------- main grid


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_head_dim_matches_reference(dtype, head_dim, causal, seqlen_q, seqlen_k):
    _require_built(head_dim, dtype)
    q, k, v, dout = _inputs(2, seqlen_q, seqlen_k, 3, 3, head_dim, dtype)
    before = [_bits(t) for t in (q, k, v, dout)]
    out, lse, grads = _run(q, k, v, dout, causal=causal)
    _check(out, lse, grads, q, k, v, dout, f"head_dim {head_dim}", causal=causal)
    for t, b in zip((q, k, v, dout), before):
        assert torch.equal(_bits(t), b), "an input was modified"


@pytest.mark.parametrize("head_dim", [8, 40, 96, 136, 248])
def test_head_dim_long_sequence(head_dim):
    """2100 x 2100 (many K/V tiles per row block and many Q tiles per backward CTA)."""
    dtype = _built_dtype(head_dim)
    q, k, v, dout = _inputs(1, 2100, 2100, 2, 2, head_dim, dtype)
    out, lse, grads = _run(q, k, v, dout, causal=True)
    _check(out, lse, grads, q, k, v, dout, f"long {head_dim}", causal=True)


@pytest.mark.parametrize(
    "head_dim,nheads_k,opts",
    [
        (40, 2, dict(causal=True)),
        (72, 1, dict(window_size=(17, 3))),
        (104, 3, dict(causal=True, window_size=(40, 0))),
        (136, 2, dict(window_size=(64, 64))),
        (200, 1, dict(causal=True)),
        (96, 2, dict(softcap=15.0)),
        (248, 3, dict(softcap=10.0, window_size=(100, 0))),
        (8, 1, dict()),
    ],
    ids=["40-gqa-causal", "72-mqa-window", "104-gqa-causal-window", "136-gqa-window", "200-mqa-causal",
         "96-gqa-softcap", "248-gqa-softcap-window", "8-mqa"],
)
def test_head_dim_gqa_window_softcap(head_dim, nheads_k, opts):
    """GQA/MQA (dK/dV summed in fp32 buffers of the caller's head_dim), windows and softcap."""
    dtype = _built_dtype(head_dim)
    q, k, v, dout = _inputs(2, 513, 700, 6, nheads_k, head_dim, dtype)
    if "softcap" in opts:
        q, k = q * 2, k * 2
    out, lse, grads = _run(q, k, v, dout, **opts)
    _check(out, lse, grads, q, k, v, dout, f"head_dim {head_dim} {opts}", **opts)


@pytest.mark.parametrize("head_dim,nheads_k", [(40, 4), (72, 2), (136, 1), (200, 4)])
def test_head_dim_deterministic(head_dim, nheads_k):
    """Deterministic mode (dQ, and with GQA dK/dV, summed in a fixed order): bitwise-equal repeats, right answer."""
    dtype = _built_dtype(head_dim)
    q, k, v, dout = _inputs(2, 600, 700, 4, nheads_k, head_dim, dtype)
    _check_deterministic(q, k, v, dout, f"deterministic {head_dim}")


# ------------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("head_dim", [8, 40, 72, 136, 200])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_same_as_explicit_zero_padding(head_dim, causal):
    """The result is that of the true head_dim: bitwise the same as the kernel size run on inputs zero-padded by hand
    (with the true head_dim's softmax scale), and that run's padded output and gradient columns are exactly 0."""
    kernel = kernel_head_dim(head_dim)
    dtype = _built_dtype(head_dim)
    q, k, v, dout = _inputs(2, 300, 257, 4, 2, head_dim, dtype)
    pad = [torch.nn.functional.pad(t, (0, kernel - head_dim)) for t in (q, k, v, dout)]
    scale = 1.0 / math.sqrt(head_dim)

    def run(q, k, v, dout, **kw):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out, lse = attention(*leaves, causal=causal, return_lse=True, deterministic=True, **kw)
        return out.detach(), lse, torch.autograd.grad(out, leaves, dout)

    out, lse, grads = run(q, k, v, dout)
    out_p, lse_p, grads_p = run(*pad, softmax_scale=scale)
    assert torch.equal(out, out_p[..., :head_dim]) and torch.equal(lse, lse_p)
    assert torch.equal(out_p[..., head_dim:], torch.zeros_like(out_p[..., head_dim:]))
    for gname, g, gp in zip(GRAD_NAMES, grads, grads_p):
        assert torch.equal(g, gp[..., :head_dim]), f"{gname} differs from the zero-padded run"
        assert torch.equal(gp[..., head_dim:], torch.zeros_like(gp[..., head_dim:])), f"padded {gname} columns not 0"


def test_default_scale_is_of_the_true_head_dim():
    head_dim = 40
    dtype = _built_dtype(head_dim)
    q, k, v, _ = _inputs(2, 200, 150, 3, 3, head_dim, dtype)
    assert torch.equal(attention(q, k, v), attention(q, k, v, softmax_scale=1.0 / math.sqrt(head_dim)))


# ------------------------------------------------------------------------------------------------ variable length


@pytest.mark.parametrize(
    "head_dim,nheads_k,opts",
    [(8, 4, dict(causal=True)), (104, 2, dict()), (192, 1, dict(window_size=(33, 5))), (248, 2, dict(causal=True))],
    ids=["8-causal", "104-gqa", "192-mqa-window", "248-gqa-causal"],
)
def test_head_dim_varlen(head_dim, nheads_k, opts):
    _check_varlen(head_dim, head_dim, nheads_k, _built_dtype(head_dim), f"head_dim {head_dim}", **opts)


# ------------------------------------------------------------------------------- slices and canaries (memory safety)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_slices_of_wider_buffers_read_only_their_columns(dtype, causal):
    """head_dim 40 sliced out of 64-wide last dimensions whose other columns are NaN (q at columns 0:40, k at 8:48,
    v and dout at 24:64): read in place (16-byte strides), a read of a padded column would bring NaN in. Results
    are right and finite, bitwise those of contiguous copies, and no byte of the buffers changes."""
    head_dim, width = 40, 64
    _require_built(head_dim, dtype)
    batch, seqlen_q, seqlen_k, nheads, nheads_k = 2, 257, 300, 4, 2
    contiguous = _inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    views, buffers = [], []
    for t, start in zip(contiguous, (0, 8, 24, 24)):
        buf = torch.full((*t.shape[:-1], width), float("nan"), dtype=dtype, device=DEVICE)
        view = buf[..., start : start + head_dim]
        view.copy_(t)
        views.append(view)
        buffers.append(buf)
    before = [_bits(b) for b in buffers]
    q, k, v, dout = views
    assert q.stride(-2) == width and not q.is_contiguous()

    def run(q, k, v, dout):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out, lse = attention(*leaves, causal=causal, return_lse=True, deterministic=True)
        return out.detach(), lse, torch.autograd.grad(out, leaves, dout)

    out, lse, grads = run(q, k, v, dout)
    torch.cuda.synchronize()
    for b, saved in zip(buffers, before):
        assert torch.equal(_bits(b), saved), "a buffer around the inputs changed"
    for t in (out, lse, *grads):
        assert torch.isfinite(t).all(), "NaN from a padded column"
    out_c, lse_c, grads_c = run(*contiguous)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    for gname, g, gc in zip(GRAD_NAMES, grads, grads_c):
        assert torch.equal(g, gc), f"{gname} of the sliced inputs differs from the contiguous ones"
    _check(out, lse, grads, *contiguous, "sliced", causal=causal)


@pytest.mark.parametrize("head_dim", [8, 40, 96, 200])
def test_packed_qkv(head_dim):
    """q, k, v as slices of one packed (batch, seqlen, 3, nheads, head_dim) tensor: a read past head_dim would take
    the next head's or the next tensor's values (a wrong answer, not NaN)."""
    dtype = _built_dtype(head_dim)
    batch, seqlen, nheads = 2, 333, 3
    qkv = _randn(batch, seqlen, 3, nheads, head_dim, dtype=dtype)
    q, k, v = qkv.unbind(2)
    dout = _randn(batch, seqlen, nheads, head_dim, dtype=dtype)
    before = _bits(qkv)
    out, lse, grads = _run(q, k, v, dout, causal=True)
    assert torch.equal(_bits(qkv), before)
    _check(out, lse, grads, q, k, v, dout, f"packed {head_dim}", causal=True)


@pytest.mark.parametrize(
    "head_dim,seqlen_q,seqlen_k,nheads_k",
    [(8, 1, 1, 2), (40, 113, 257, 2), (72, 257, 113, 1), (136, 513, 700, 2), (248, 1, 300, 2), (200, 300, 1, 4)],
)
def test_no_access_past_the_tensors(head_dim, seqlen_q, seqlen_k, nheads_k):
    """q, k, v and dout each at the end of (and, for some, after the start of) a buffer whose other elements are NaN:
    a read past a tensor's end (the last row's padded columns, a partial tile's rows) gives NaN in the results, which
    must be finite and right; no element of the buffers changes."""
    dtype = _built_dtype(head_dim)
    batch, nheads = 2, 4
    tensors = _inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    (q, k, v, dout), check_canaries = _in_canary_buffers(*tensors)
    for causal in (False, True):
        out, lse, grads = _run(q, k, v, dout, causal=causal)
        check_canaries(out, lse, grads)
        _check(out, lse, grads, *tensors, f"canary causal={causal}", causal=causal)
        # the GQA/MQA dK/dV buffers and the workspaces hold the caller's / padded widths: also run deterministic
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out_d = attention(*leaves, causal=causal, deterministic=True)
        grads_d = torch.autograd.grad(out_d, leaves, dout)
        for g in grads_d:
            assert torch.isfinite(g).all()


_SANITIZER_SCRIPT = memcheck_script(
    [(d, d, nheads_k, dtype) for d, nheads_k in ((8, 1), (40, 2), (72, 4), (136, 2), (248, 1))
     for dtype in ("float16", "bfloat16")],
    lse_in_loss=False,
)


def test_compute_sanitizer_memcheck():
    """Out-of-bounds global loads and stores by the kernels themselves (not only those that reach a NaN canary):
    compute-sanitizer memcheck with the caching allocator off, so every tensor is its own allocation and an access
    past it is reported. Slow (a minute or more); skipped without compute-sanitizer."""
    for head_dim in (8, 40, 72, 136, 248):
        _require_built(head_dim, torch.float16)
        _require_built(head_dim, torch.bfloat16)
    run_memcheck(_SANITIZER_SCRIPT)
