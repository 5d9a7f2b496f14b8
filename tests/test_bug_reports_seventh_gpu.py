"""A seventh round of GPU tests modelled on bug reports filed against other attention kernels and the PyTorch machinery
around them (FlashAttention's varlen launch grid and its SM100 long-context tile scheduler, SageAttention's and CuTe
kernels' 32-bit offsets into fused-QKV views, xformers and SDPA under torch.vmap, batched gradients through attention
in PyTorch and JAX, FlashAttention 4's wasted varlen tiles), for the kinds of fault that the earlier rounds
(tests/test_bug_reports_gpu.py, test_bug_reports_more_gpu.py, test_bug_reports_third_gpu.py,
test_bug_reports_fourth_gpu.py, test_bug_reports_fifth_gpu.py, test_bug_reports_sixth_gpu.py) and the other GPU test
files do not yet exercise:

- a varlen forward whose launch grid (sequences x heads x query blocks of the longest sequence) holds more than
  2^31 - 1 tiles while every documented limit holds (65535 sequences, 128 heads, one long sequence among short ones);
- functorch transforms over the library's ops (torch.vmap, also under inference_mode and over attention_varlen;
  torch.func.grad): a refusal that says why, or the right result;
- batched output gradients (torch.autograd.grad(is_grads_batched=True), a vectorized Jacobian), which run the C++
  backward node under PyTorch's legacy batching;
- K and V as views of one packed K/V buffer whose element offsets pass 2^31 while each view holds fewer than 2^31
  elements (a guard on numel() would not see it);
- causal attention over more than 2^31 bytes of K/V per head, with enough query blocks for the forward's L2-sized
  tile sections;
- the wasted tiles of varlen launches sized by their longest sequence (and by an upper-bound max_seqlen), forward and
  backward, under compute-sanitizer memcheck.

The report each test comes from is cited by URL in the comment above it (see also tests/bug_report_sources.md); only the
shapes and conditions of the reports are taken over, the code is this project's own.

Every numeric result is checked by the rule of DESIGN.md §3 (``assert_close_by_rule`` against the float32 reference,
the error of the same reference run in the input dtype as the yardstick); the tile-count, packed-view and 2^31-byte
tests draw their outputs from NaN-poisoned memory (poison_allocator), the transform and batched-gradient tests do not.
A refusal is accepted only as a TypeError / ValueError / NotImplementedError (or, for the transforms, torch's own
RuntimeError) that says what is refused, never as the library's launch error. Skipped, with
the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build lacks a head_dim /
dtype (``built_dtype``)."""

import math
import re
import warnings

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.interface import kernel_head_dim
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_ref_grads
from flash_attn_hopper.testing import attention_varlen_ref, attention_varlen_ref_grads
from gpu_helpers import attention_inputs, built_dtype, check_attention, cu_seqlens, poison_allocator, randn
from gpu_helpers import run_attention, run_memcheck
from test_bug_reports_gpu import GRAD_NAMES, _leaves, _releasing_memory, _require_free_memory

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"
INT32_MAX = 2**31 - 1
WIDEST_TILE_ROWS = 192  # the tallest forward tile of any head_dim (head_dim 64's wide tiles; flash/config.hpp)


# ------------------------------------------------------------------------------------------------------- helpers
# (_leaves, _releasing_memory, _require_free_memory: tests/test_bug_reports_gpu.py)


def _names_one_of(message, names):
    """Whether message names one of `names` as a word."""
    return any(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", message) for n in names)


def _last_element_offset(t):
    """The element offset, from the start of t's storage, of t's last element."""
    return t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _built_head_dim(candidates):
    """The first of candidates whose forward and backward kernels this build holds, else skip."""
    head_dims = flash_attn_hopper.build_config()["head_dims"]
    for d in candidates:
        if all(kernel_head_dim(d, backward=b) in head_dims for b in (False, True)):
            return d
    pytest.skip(f"none of head_dim {list(candidates)} in this build (FAH_HDIMS)")


# ------------------------------------------------------------------------------------- varlen launch beyond int32

# One long sequence among 65534 one-token sequences (65535: the most attention_varlen accepts). The forward's grid is
# every (sequence, head, query block of the longest sequence), mostly empty blocks: 257 query blocks of 192 rows (385
# of 128, head_dim 128's height) x 128 heads x 65535 sequences > 2^31 - 1.
VARLEN_TILES_NHEADS, VARLEN_TILES_NHEADS_K = 128, 8
VARLEN_TILES_SHORT = 65_534  # sequences of 1 query x 2 keys
VARLEN_TILES_LONG = (49_153, 80)  # the last sequence: queries, keys


def _varlen_tiles_beyond_int32():
    head_dim = 128
    dtype = built_dtype(head_dim)
    nheads, nheads_k, n = VARLEN_TILES_NHEADS, VARLEN_TILES_NHEADS_K, VARLEN_TILES_SHORT
    long_q, long_k = VARLEN_TILES_LONG
    lq, lk = [1] * n + [long_q], [2] * n + [long_k]
    assert len(lq) == 65535
    tiles = math.ceil(long_q / WIDEST_TILE_ROWS) * nheads * len(lq)
    assert tiles > INT32_MAX, "construction: the launch's tile count fits int32"
    # the long sequence's tiles come last (tiles are numbered sequence-major): all of them past index 2^31
    assert n * nheads * math.ceil(long_q / WIDEST_TILE_ROWS) > INT32_MAX, "construction: long-sequence tiles < 2^31"
    _require_free_memory(40 * 2**30)
    q = randn(sum(lq), nheads, head_dim, dtype=dtype)
    k = randn(sum(lk), nheads_k, head_dim, dtype=dtype)
    v = randn(sum(lk), nheads_k, head_dim, dtype=dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    poison_allocator(q.numel() * q.element_size(), nheads * q.shape[0] * 4)
    name = f"{len(lq)} sequences x {nheads} heads, the longest {long_q} queries (>= {tiles} tiles)"
    try:
        with torch.no_grad():
            out, lse = attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), return_lse=True)
        torch.cuda.synchronize()
    except (TypeError, ValueError, NotImplementedError) as e:
        # refused before any launch: acceptable when the message says what is out of range (DESIGN.md §2)
        assert _names_one_of(str(e), ("nheads", "cu_seqlens_q", "max_seqlen_q", "sequences")), (
            f"{name}: refused without naming the argument: {type(e).__name__}: {e}")
        return
    except RuntimeError as e:
        pytest.fail(f"{name}: RuntimeError: {e}. Every documented limit holds (at most 65535 sequences and heads, "
                    "max_seqlen at least the longest sequence), so the call must run, or be refused before any launch "
                    "by a TypeError / ValueError / NotImplementedError naming the argument (DESIGN.md §2)")

    # the one-token sequences: a dense batch of n sequences of 1 query x 2 keys, checked in parts
    out_short = out[:n].view(n, 1, nheads, head_dim)
    lse_short = lse[:, :n].t().unsqueeze(-1)  # (n, nheads, 1), the dense LSE layout
    part = 16_384
    for a in range(0, n, part):
        b = min(a + part, n)
        args = (q[a:b].unsqueeze(1), k[2 * a:2 * b].view(b - a, 2, nheads_k, head_dim),
                v[2 * a:2 * b].view(b - a, 2, nheads_k, head_dim))
        ref, ref_lse = attention_ref(*args)
        naive, naive_lse = attention_ref(*args, upcast=False)
        assert_close_by_rule(out_short[a:b], ref, naive, f"{name}: one-token sequences {a}:{b} out")
        assert_close_by_rule(lse_short[a:b], ref_lse, naive_lse, f"{name}: one-token sequences {a}:{b} lse")
        del ref, naive
    # the long sequence, by query rows (no mask: its rows are independent)
    ql, kl, vl = q[n:].unsqueeze(0), k[2 * n:].unsqueeze(0), v[2 * n:].unsqueeze(0)
    part = -(-long_q // 4)
    for a in range(0, long_q, part):
        b = min(a + part, long_q)
        ref, ref_lse = attention_ref(ql[:, a:b], kl, vl)
        naive, naive_lse = attention_ref(ql[:, a:b], kl, vl, upcast=False)
        assert_close_by_rule(out[n + a:n + b].unsqueeze(0), ref, naive, f"{name}: long sequence rows {a}:{b} out")
        assert_close_by_rule(lse[:, n + a:n + b].unsqueeze(0), ref_lse, naive_lse,
                             f"{name}: long sequence rows {a}:{b} lse")
        del ref, naive


# https://github.com/Dao-AILab/flash-attention/issues/1786 (a varlen batch of many short sequences: RuntimeError at
# 1.28M tokens with GPU memory to spare, the launch sized by the sequence count), https://github.com/fla-org/flash-
# linear-attention/issues/903 (a varlen launch sized from the packed length instead of the documents: "Triton Error
# [CUDA]: invalid argument" past a grid limit) and https://github.com/lightseekorg/tokenspeed/pull/330 (a head count
# that made the launch configuration invalid: "launch failed: invalid argument")
def test_varlen_launch_with_more_tiles_than_int32():
    """FlashAttention issue 1786, flash-linear-attention issue 903, tokenspeed PR 330: a launch configuration derived
    from the batch's shape that passes a hardware or index limit shows up as an opaque "invalid argument" (or worse, a
    wrapped index) although every argument is within what the API documents. attention_varlen's forward launches one
    tile per (sequence, head, query block of the longest sequence): here 65535 sequences (the most accepted), 128
    heads (GQA 16) and head_dim 128, 65534 sequences of 1 query x 2 keys and a last one of 49,153 queries x 80 keys,
    so the tile count is above 2^31 - 1 (for any tile height up to 192 rows) while only ~8.4M tiles hold rows; the
    long sequence's tiles all lie past index 2^31. Forward only, under no_grad (a serving step; the backward's
    per-sequence workspace would not fit). The call must either run (out and LSE by the rule: the short sequences as a
    dense batch, the long one by row parts) or be refused before any launch by a TypeError / ValueError /
    NotImplementedError naming the argument; a RuntimeError from the launch fails. Found by reading the code:
    csrc/flash/fwd/launch_fwd_sm90.hpp returns cudaErrorInvalidValue for more than INT32_MAX tiles, which
    csrc/api/flash_api.cpp raised as "flash_attn_hopper forward launch failed: invalid argument", the Python layer
    checking each size but not their product; since session 40 the Python layer refuses such calls by name
    (interface._check_fwd_tiles; CPU tests in tests/test_validation_cpu.py): the refusal needs ~4 GiB for the
    inputs, a run would need ~25 GiB (the free-memory guard asks for that with room to spare)."""
    _releasing_memory(_varlen_tiles_beyond_int32)


# ------------------------------------------------------------------------------------------ functorch transforms

_TRANSFORM_CASES = ["vmap", "vmap_inference", "vmap_shared_kv_inference", "vmap_varlen_inference", "func_grad"]
_TRANSFORM_WORDS = ("vmap", "functorch", "batching rule", "batched")
ENSEMBLE = 3


def _refused_or_result(call, name):
    """call()'s result, or None when it raised a RuntimeError / NotImplementedError / ValueError / TypeError that says
    it refuses the transform; any other failure (the library's launch error included) fails the test."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # functorch's "performance drop" note when it falls back to a loop
            return call()
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
        message = str(e).lower()
        assert "launch failed" not in message, f"{name}: the kernel failed instead of refusing: {e}"
        assert any(w in message for w in _TRANSFORM_WORDS), (
            f"{name}: refused without saying that the transform is the reason: {type(e).__name__}: {e}")
        return None


def _in_inference_mode(call):
    def wrapped():
        with torch.inference_mode():
            return call()
    return wrapped


# https://github.com/facebookresearch/xformers/issues/768 ("Batching rule not implemented for
# xformers::efficient_attention_forward_cutlass"), https://github.com/pytorch/pytorch/issues/151558 (SDPA under vmap
# over an ensemble of attention modules: masks refused, arguments not batched), https://github.com/meta-pytorch/
# attention-gym/issues/25 (vmap over attention kernels) and https://github.com/intel/torch-xpu-ops/issues/5194 (an op
# under vmap must "either register a Vmap rule ... or raise a clear, actionable error")
@pytest.mark.parametrize("case", _TRANSFORM_CASES)
def test_functorch_transforms_refused_or_right(case):
    """xformers issue 768, PyTorch issue 151558, attention-gym issue 25, torch-xpu-ops issue 5194: ensembles
    (torch.func.stack_module_state + torch.vmap) and per-example gradients run attention under functorch transforms.
    The library's ops have no batching rule and C++ autograd functions; functorch may then loop over the batched
    dimension (its fallback), refuse, or, with a wrong rule, hand the kernel the batched dimension as something else.
    Cases, GQA 4/2, causal, head_dim 64, an ensemble of 3: "vmap" (q, k, v batched, grad mode on), the same under
    inference_mode (no autograd kernel: functorch's loop reaches the kernels), k and v shared by the ensemble
    (in_dims (0, None, None)), attention_varlen under vmap (cu_seqlens shared, an empty sequence), and
    torch.func.grad of a loss through attention. Each must either refuse with an error that names vmap / functorch /
    batching (then a plain call still works, by the rule) or give out and LSE (or dQ) of each ensemble member right by
    the rule against the float32 reference of that member."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    opts = dict(causal=True)
    if case == "func_grad":
        q, k, v, dout = attention_inputs(2, 203, 300, 4, 2, head_dim, dtype)

        def loss(q_):
            return (attention(q_, k, v, **opts).float() * dout.float()).sum()

        dq = _refused_or_result(lambda: torch.func.grad(loss)(q), case)
        if dq is None:
            out, lse, grads = run_attention(q, k, v, dout, **opts)
            check_attention(out, lse, grads, q, k, v, dout, f"{case}: a plain call after the refusal", **opts)
            return
        assert dq.shape == q.shape and dq.dtype == dtype, f"{case}: dq shape / dtype"
        ref = attention_ref_grads(q, k, v, dout, **opts)[0]
        naive = attention_ref_grads(q, k, v, dout, upcast=False, **opts)[0]
        assert_close_by_rule(dq, ref, naive, f"{case}: dq")
        return

    if case == "vmap_varlen_inference":
        lq, lk = [77, 0, 130], [100, 20, 130]
        cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
        qs = randn(ENSEMBLE, sum(lq), 4, head_dim, dtype=dtype)
        ks = randn(ENSEMBLE, sum(lk), 2, head_dim, dtype=dtype)
        vs = randn(ENSEMBLE, sum(lk), 2, head_dim, dtype=dtype)

        def f(q, k, v):
            return attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), return_lse=True, **opts)

        def reference(i, upcast):
            return attention_varlen_ref(qs[i], ks[i], vs[i], cu_q, cu_k, upcast=upcast, **opts)

        call = _in_inference_mode(lambda: torch.vmap(f)(qs, ks, vs))
    else:
        qs = randn(ENSEMBLE, 2, 203, 4, head_dim, dtype=dtype)
        ks = randn(ENSEMBLE, 2, 300, 2, head_dim, dtype=dtype)
        vs = randn(ENSEMBLE, 2, 300, 2, head_dim, dtype=dtype)
        shared = case == "vmap_shared_kv_inference"

        def f(q, k, v):
            return attention(q, k, v, return_lse=True, **opts)

        def reference(i, upcast):
            j = 0 if shared else i
            return attention_ref(qs[i], ks[j], vs[j], upcast=upcast, **opts)

        if shared:
            call = _in_inference_mode(lambda: torch.vmap(f, in_dims=(0, None, None))(qs, ks[0], vs[0]))
        elif case == "vmap_inference":
            call = _in_inference_mode(lambda: torch.vmap(f)(qs, ks, vs))
        else:
            def call():
                return torch.vmap(f)(qs, ks, vs)

    result = _refused_or_result(call, case)
    if result is None:
        out, lse = f(qs[0], ks[0], vs[0])
        ref, ref_lse = reference(0, True)
        naive, naive_lse = reference(0, False)
        assert_close_by_rule(out, ref, naive, f"{case}: a plain call after the refusal: out")
        assert_close_by_rule(lse, ref_lse, naive_lse, f"{case}: a plain call after the refusal: lse")
        return
    out, lse = result
    for i in range(ENSEMBLE):
        ref, ref_lse = reference(i, True)
        naive, naive_lse = reference(i, False)
        assert out.shape == (ENSEMBLE, *ref.shape) and out.dtype == dtype, f"{case}: out shape / dtype"
        assert lse.shape == (ENSEMBLE, *ref_lse.shape) and lse.dtype == torch.float32, f"{case}: lse shape / dtype"
        assert_close_by_rule(out[i], ref, naive, f"{case}: ensemble member {i} out")
        assert_close_by_rule(lse[i], ref_lse, naive_lse, f"{case}: ensemble member {i} lse")


# ----------------------------------------------------------------------------------------- batched gradients


# https://github.com/pytorch/pytorch/issues/102457 (batched gradients of a vector output through SDPA's efficient
# attention: no batching rule for the attention op) and https://github.com/jax-ml/jax/issues/38495
# (jax.jacobian through cuDNN attention: the backward's batching rule reshaped the batched output gradient wrongly)
@pytest.mark.parametrize("case", ["dense", "varlen", "jacobian"])
def test_batched_output_gradients_through_the_backward(case):
    """PyTorch issue 102457 and JAX issue 38495: Jacobians and Hessian-vector products push a batch of output
    gradients through the backward in one call, torch.autograd.grad(..., is_grads_batched=True) and
    torch.autograd.functional.jacobian(vectorize=True), which run the backward node under PyTorch's legacy batching:
    the C++ autograd node of this library gets batched dO, and its backward op either has a batching rule, falls back
    to a loop over the batch, or refuses; a rule that folds the batch wrongly (JAX's) gives wrong gradients. "dense":
    GQA 4/2, causal, deterministic, three output gradients at once; "varlen": attention_varlen with an empty sequence;
    "jacobian": the full Jacobian of out with respect to q of a tiny causal problem (head_dim 8). Each either refuses
    with an error naming vmap / batching (then a plain call still works, by the rule) or gives every gradient of the
    batch right by the rule against the float32 reference."""
    if case == "jacobian":
        head_dim = 8
        dtype = built_dtype(head_dim)
        q, k, v, dout = attention_inputs(1, 5, 7, 2, 1, head_dim, dtype)

        def f(q_):
            return attention(q_, k, v, causal=True)

        jac = _refused_or_result(lambda: torch.autograd.functional.jacobian(f, q, vectorize=True), case)
        if jac is None:
            out, lse, grads = run_attention(q, k, v, dout, causal=True)
            check_attention(out, lse, grads, q, k, v, dout, f"{case}: a plain call after the refusal", causal=True)
            return
        jacobian = torch.autograd.functional.jacobian
        ref = jacobian(lambda x: attention_ref(x, k.float(), v.float(), causal=True)[0], q.float())
        naive = jacobian(lambda x: attention_ref(x, k, v, causal=True, upcast=False)[0], q)
        assert jac.shape == (*q.shape, *q.shape), f"{case}: Jacobian shape {tuple(jac.shape)}"
        assert_close_by_rule(jac, ref, naive, f"{case}: d out / d q")
        return

    head_dim = 64
    dtype = built_dtype(head_dim)
    batch = 3
    if case == "dense":
        q, k, v, _ = attention_inputs(2, 203, 300, 4, 2, head_dim, dtype)
        opts = dict(causal=True, deterministic=True)
        leaves = _leaves(q, k, v)
        out = attention(*leaves, **opts)

        def reference(dout, upcast):
            return attention_ref_grads(q, k, v, dout, upcast=upcast, causal=True)
    else:
        lq, lk = [77, 0, 130], [100, 20, 130]
        cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
        q = randn(sum(lq), 4, head_dim, dtype=dtype)
        k = randn(sum(lk), 2, head_dim, dtype=dtype)
        v = randn(sum(lk), 2, head_dim, dtype=dtype)
        leaves = _leaves(q, k, v)
        out = attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), causal=True)

        def reference(dout, upcast):
            return attention_varlen_ref_grads(q, k, v, dout, cu_q, cu_k, upcast=upcast, causal=True)

    douts = randn(batch, *out.shape, dtype=dtype)
    grads = _refused_or_result(
        lambda: torch.autograd.grad(out, leaves, douts, retain_graph=True, is_grads_batched=True), case)
    if grads is None:
        plain = torch.autograd.grad(out, leaves, douts[0])
        for gname, g, r, n in zip(GRAD_NAMES, plain, reference(douts[0], True), reference(douts[0], False)):
            assert_close_by_rule(g, r, n, f"{case}: a plain backward after the refusal: {gname}")
        return
    for i in range(batch):
        ref, naive = reference(douts[i], True), reference(douts[i], False)
        for gname, g, t, r, n in zip(GRAD_NAMES, grads, (q, k, v), ref, naive):
            assert g.shape == (batch, *t.shape) and g.dtype == dtype, f"{case}: {gname} shape / dtype"
            assert_close_by_rule(g[i], r, n, f"{case}: output gradient {i}: {gname}")


# ---------------------------------------------------------------------------- packed K/V views beyond int32


def _packed_kv_beyond_int32():
    head_dim, nheads = 128, 8
    dtype = built_dtype(head_dim)
    seqlen_q, seqlen_k, left = 16, 2**20 + 1000, 299
    _require_free_memory(32 * 2**30)
    kv = randn(1, seqlen_k, 2, nheads, head_dim, dtype=dtype)  # one K/V projection output: K and V in each row
    k, v = kv.unbind(2)
    assert kv.numel() > 2**31 and k.numel() < 2**31 and v.numel() < 2**31, "construction: sizes"
    assert min(_last_element_offset(t) for t in (k, v)) > 2**31, "construction: the views' offsets fit int32"
    # TMA-legal views (16-byte base and strides), so the kernels read them in place rather than from a copy
    assert all(t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])
               for t in (k, v)), "construction: views the kernels would copy"
    q = randn(1, seqlen_q, nheads, head_dim, dtype=dtype)
    dout = randn(1, seqlen_q, nheads, head_dim, dtype=dtype)
    dlse = torch.randn(1, nheads, seqlen_q, device=DEVICE)

    # every key: the rows past 2^31 elements of the buffer are read
    poison_allocator(q.numel() * q.element_size(), nheads * seqlen_q * 4)
    out, lse = attention(q, k, v, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v)
    naive, naive_lse = attention_ref(q, k, v, upcast=False)
    assert_close_by_rule(out, ref, naive, "all keys out")
    assert_close_by_rule(lse, ref_lse, naive_lse, "all keys lse")
    del out, lse, ref, naive

    # a bottom-right window: only keys past 2^31 elements of the buffer are seen; gradients into the packed buffer
    tail = seqlen_q + left  # the keys any query sees under the window (left, 0)
    assert (seqlen_k - tail) * k.stride(1) > 2**31, "construction: the window's keys start before 2^31 elements"
    opts = dict(causal=True, window_size=(left, 0))
    q_leaf, kv_leaf = q.detach().requires_grad_(True), kv.detach().requires_grad_(True)
    out, lse = attention(q_leaf, *kv_leaf.unbind(2), return_lse=True, **opts)
    poison_allocator(k.numel() * k.element_size(), v.numel() * v.element_size())  # dK, dV: fresh like k, v
    dq, dkv = torch.autograd.grad([out, lse], [q_leaf, kv_leaf], [dout, dlse])
    assert dkv.shape == kv.shape and dkv.dtype == dtype, "dkv shape / dtype"
    dk, dv = dkv.unbind(2)
    check_attention(out.detach(), lse.detach(), (dq, dk[:, -tail:], dv[:, -tail:]), q, k[:, -tail:], v[:, -tail:],
                    dout, "window past 2^31 elements", dlse=dlse, **opts)
    assert torch.count_nonzero(dkv[:, :-tail]).item() == 0, "keys outside the window: dK, dV not exactly 0"


# https://github.com/thu-ml/SageAttention/issues/386 and https://github.com/thu-ml/SageAttention/pull/390 (row index x
# stride in int32 for q/k views of a fused QKV projection: silent corruption, then an illegal address, at ~100k rows
# while each view holds far fewer than 2^31 elements), https://github.com/meta-pytorch/MSLK/pull/303 (CuTe tensor
# indexing in int32 by default: row x stride past INT32_MAX, cudaErrorIllegalAddress) and
# https://github.com/Comfy-Org/comfy-kitchen/issues/178 (a kernel refusing int32-overflowing strides of ordinary
# long-video workloads)
def test_packed_kv_views_with_offsets_beyond_int32():
    """SageAttention issue 386 / PR 390, MSLK PR 303, comfy-kitchen issue 178: K and V are often views of one projection
    output, so their row stride is that of the packed row and their element offsets pass 2^31 long before their own
    element count does; a kernel that picks 32-bit indexing by numel(), or multiplies a row index by a stride in 32
    bits, reads wrapped addresses. Here K and V are the two halves of each row of a (1, 2^20 + 1000, 2, 8, 128) buffer
    (2^31 + 2M elements, 4 GiB; each view 2^30 + 1M elements, TMA-legal, so read in place): 16 queries over every key,
    out and LSE by the rule; then a bottom-right window of 299 (causal), which sees only keys past 2^31 elements, with
    the loss through out and LSE and the gradient taken with respect to the packed buffer: dQ and the window's dK, dV
    by the rule, every other row of the buffer's gradient exactly 0 (from NaN-poisoned memory). About 20 GiB."""
    _releasing_memory(_packed_kv_beyond_int32)


# ------------------------------------------------------------------------- long causal context: tile sections


def _causal_keys_beyond_2_31_bytes():
    head_dim, nheads = 128, 2
    dtype = built_dtype(head_dim)
    seqlen_q, seqlen_k = 1537, 2**22 + 777
    esize = torch.tensor([], dtype=dtype).element_size()
    assert seqlen_k * 2 * head_dim * esize > 2**31, "construction: one head's K and V fit 2^31 bytes"
    assert math.ceil(seqlen_q / WIDEST_TILE_ROWS) >= 8, "construction: fewer query blocks than the sections need"
    _require_free_memory(48 * 2**30)
    q = randn(1, seqlen_q, nheads, head_dim, dtype=dtype)
    k = randn(1, seqlen_k, nheads, head_dim, dtype=dtype)
    v = randn(1, seqlen_k, nheads, head_dim, dtype=dtype)
    poison_allocator(q.numel() * esize, nheads * seqlen_q * 4)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    # the references row block by row block (each against exactly the keys it sees: the slice keeps the bottom-right
    # alignment), assembled, then one rule check over every element
    ref, naive = torch.empty(out.shape, device=DEVICE), torch.empty_like(out)
    ref_lse, naive_lse = torch.empty_like(lse), torch.empty_like(lse)
    shift = seqlen_k - seqlen_q
    for a in range(0, seqlen_q, 128):
        b = min(a + 128, seqlen_q)
        args = (q[:, a:b], k[:, :b + shift], v[:, :b + shift])
        r, r_lse = attention_ref(*args, causal=True)
        ref[:, a:b], ref_lse[:, :, a:b] = r, r_lse
        del r
        r, r_lse = attention_ref(*args, causal=True, upcast=False)
        naive[:, a:b], naive_lse[:, :, a:b] = r, r_lse
        del r
    assert_close_by_rule(out, ref, naive, "out")
    assert_close_by_rule(lse, ref_lse, naive_lse, "lse")


# https://github.com/Dao-AILab/flash-attention/pull/2662 ("Fix int32 overflow in SM100 LPT tile scheduler for long
# context": the scheduler sized its L2 swizzle from seqlen_k * (headdim + headdim_v) * element_size in int32, which
# went negative past seqlen_k ~4M at head_dim 128, decoded out-of-bounds batch indices and read illegal addresses in a
# causal forward at seqlen_k = 2^22)
def test_causal_keys_beyond_2_31_bytes_per_head():
    """FlashAttention PR 2662: a tile scheduler that orders causal tiles in L2-sized groups sizes them from the bytes of
    K and V one head streams, seqlen_k * (head_dim + head_dim_v) * element size, past 2^31 at seqlen_k = 2^22 and
    head_dim 128; computed in 32 bits the size turns negative and the tile decoding goes wrong. This library's forward
    orders causal launches in sections sized the same way (launch_fwd_sm90.hpp, l2_section_pairs) from 8 query blocks
    per head on. The report's causal shape with seqlen_k = 2^22 + 777 (2^31 + 0.4M bytes of K and V per head), 1537
    queries (13 query blocks), 2 heads: out and LSE by the rule over every element (each reference block against
    exactly the keys it sees). About 30 GiB for the references."""
    _releasing_memory(_causal_keys_beyond_2_31_bytes)


# ------------------------------------------------------------------------------- wasted varlen tiles, memcheck

# The varlen launches are sized by the longest sequence (and by max_seqlen when it is an upper bound): short
# sequences get query and key blocks past their ends, which must read and write nothing.
_WASTED_TILES_SCRIPT = r"""
import itertools

import torch

from flash_attn_hopper import attention_varlen

torch.manual_seed(SEED)
dtype = getattr(torch, DTYPE)
short_q, short_k = [1, 3, 0, 5, 2, 1, 0, 4], [2, 0, 7, 5, 1, 9, 3, 4]
lq = short_q * 3 + [700] + short_q * 2  # 41 sequences, the long one in the middle
lk = short_k * 3 + [900] + short_k * 2


def offsets(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


cu_q, cu_k = offsets(lq), offsets(lk)
for opts in (dict(causal=True), dict(window_size=(64, 16), deterministic=True)):
    for max_q, max_k in ((max(lq), max(lk)), (1024, 2048)):  # the true maxima, and upper bounds
        q = torch.randn(sum(lq), 4, HEAD_DIM, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(sum(lk), 2, HEAD_DIM, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(sum(lk), 2, HEAD_DIM, device="cuda", dtype=dtype, requires_grad=True)
        out, lse = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **opts)
        loss = (out.float() * torch.randn(out.shape, device="cuda")).sum()
        loss = loss + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).sum()
        loss.backward()
        assert torch.isfinite(out).all(), (opts, max_q, max_k)
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v)), (opts, max_q, max_k)
torch.cuda.synchronize()
print("done")
"""


# https://github.com/Dao-AILab/flash-attention/issues/2860 (FA4 varlen: an over-provisioned grid whose surplus tiles
# decoded to garbage coordinates and issued their K/V loads before checking validity: "Invalid __global__ read",
# illegal memory access at >= 4 segments, depending on the memory layout) and
# https://github.com/Dao-AILab/flash-attention/pull/2333 (wasted varlen tiles read cu_seqlens[num_batch + 1] out of
# bounds: cudaErrorIllegalAddress)
def test_varlen_wasted_tiles_under_compute_sanitizer(seed):
    """FlashAttention issue 2860 and PR 2333: a varlen launch sized by its longest sequence gives every short sequence
    query and key blocks past its end (and more of them when max_seqlen is an upper bound); a tile that loads before it
    checks, or decodes a sequence index past the batch, reads out of bounds, which NaN canaries miss when the value is
    not used and which crashes only for some memory layouts. attention_varlen forward and backward (GQA 4/2, the loss
    through out and LSE) over 41 sequences (one of 700 queries x 900 keys among sequences of 0-5 queries and 0-9
    keys), causal and a (64, 16) window with the deterministic backward, each with the true maxima and with upper
    bounds 1024 / 2048, under compute-sanitizer memcheck with the caching allocator off (every tensor its own
    allocation): 0 errors and finite results. Skipped without compute-sanitizer. About 20-40 s (the sanitizer)."""
    head_dim = _built_head_dim((64, 128))
    dtype = built_dtype(head_dim)
    script = _WASTED_TILES_SCRIPT.replace("SEED", str(seed)).replace("HEAD_DIM", str(head_dim))
    script = script.replace("DTYPE", repr(str(dtype).split(".")[-1]))
    run_memcheck(script)

