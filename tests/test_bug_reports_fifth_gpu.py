"""A fifth round of GPU tests modelled on bug reports filed against other attention kernels (PyTorch SDPA's flash
backend, FlashMLA, FlashAttention 3 in vLLM, a Mojo FlashAttention-4 port, IREE, PyTorch autograd and export, ...),
for the kinds of fault that the earlier rounds (tests/test_bug_reports_gpu.py, test_bug_reports_more_gpu.py,
test_bug_reports_third_gpu.py, test_bug_reports_fourth_gpu.py) and the other GPU test files do not yet exercise:
scaled scores so large that exp2(fma(s, α·log2 e, -round(m·α·log2 e))) leaves the product's rounding error at a row's
maximum instead of 0 (P overflows or vanishes), the smallest softmax_scale accepted, autograd graphs that only the
cyclic garbage collector could free, results that depend on the other members of a batch, per-tensor notes handed to a
fresh tensor that took a freed one's id and memory, anomaly detection over rows that see no key, torch.export, fp16
values in the subnormal range, and LSE gradients with non-unit strides. The report each test comes from is cited by URL
in the comment above it (see also tests/bug_report_sources.md); only the shapes and conditions of the reports are taken
over, the code is this project's own.

Every numeric result is checked by the rule of DESIGN.md §3 (``assert_close_by_rule`` against the float32 reference,
the error of the same reference run in the input dtype as the yardstick); where the exact answer is known and the input
dtype cannot hold the scores (one-hot rows at a huge softmax_scale) the yardstick is the rounding of that exact answer
to the dtype instead, and this is said where it is done. Skipped, with the reason, without an sm90 GPU and the built
extension (conftest.py), and per test when the build lacks a head_dim / dtype (``require_built`` / ``built_dtype``)."""

import gc
import itertools
import math
import random

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_ref_grads, attention_varlen_ref
from attention_modules import Attention, AttentionVarlen
from gpu_helpers import attention_inputs, bits, built_dtype, check_attention, check_attention_varlen
from gpu_helpers import cu_seqlens, randn, require_built, run_attention
from test_bug_reports_gpu import DTYPE_IDS, DTYPES, GRAD_NAMES, _leaves, _varlen_inputs

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"


# ------------------------------------------------------------------------------------------------------- helpers
# (_leaves, _varlen_inputs: tests/test_bug_reports_gpu.py)

_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}


def _assert_within_one_ulp(out, exact, name):
    """|out - exact| <= one unit in the last place of out's dtype at |exact|, element by element; exact: float32 values
    that out's dtype holds exactly. The rule's yardstick for a result whose exact value is known: twice the rounding of
    that value to the dtype (half an ulp). NaN and infinities never pass."""
    assert not torch.isnan(out).any(), f"{name}: holds NaN ({int(torch.isnan(out).sum())} elements)"
    _, exponent = torch.frexp(exact.abs().clamp_min(torch.finfo(out.dtype).tiny))
    ulp = torch.ldexp(torch.ones_like(exact), exponent - 1 - _MANTISSA_BITS[out.dtype])
    bad = ~((out.float() - exact).abs() <= ulp)
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} of {bad.numel()} elements more than one ulp from the exact value, e.g. "
        f"{out.float()[bad][:4].tolist()} for {exact[bad][:4].tolist()}"
    )


def _num_sms():
    return torch.cuda.get_device_properties(DEVICE).multi_processor_count


def _tile_height(head_dim, batch, nheads, seqlen_q, seqlen_k, opts):
    """The forward's tile height for a call (the launcher's pick; varlen: batch = sequences, seqlens = the maxima)."""
    left, right = opts.get("window_size", (-1, -1))
    return torch.ops.flash_attn_hopper.fwd_block_m(head_dim, head_dim, batch, nheads, seqlen_q, seqlen_k,
                                                   opts.get("causal", False), left, right, _num_sms())


# ---------------------------------------------------------------------------------- scaled scores beyond 2^24


# https://github.com/pytorch/pytorch/issues/121558 (q = k = v = 133120.0 in bf16, shape (1, 1, 1, 64): NaN from the
# flash backend, right from the math and efficient ones) and https://github.com/deepseek-ai/FlashMLA/pull/68 (the same
# inputs gave all-zero outputs; the cause is the FFMA of the scaled score with the rounded scaled maximum)
# Fixed in session 38 (csrc/flash/common/softmax.hpp, kExactRowsLimitLog2, and flash/fwd/exact_rows_sm90.hpp); strict
# xfails in sessions 36-37, their failures predicted from the arithmetic and seen on the H200.
@pytest.mark.parametrize("seqlen", [1, 5])
def test_constant_inputs_of_magnitude_133120(seqlen):
    """PyTorch issue 121558 and FlashMLA PR 68: with every score S = 133120² · 64 = 1.134e12 and the default scale 1/8,
    the scaled score in the exp2 domain is m·α·log2(e) = 2.05e11 ≈ 2^37.6, whose float32 rounding is off by up to
    2^13. A kernel that forms P = exp2(fma(S, α·log2 e, -round(m·α·log2 e))) gets exp2(that rounding error) instead of
    exp2(0) = 1 at the row's maximum: inf or 0, so O = inf/inf = NaN, or a row sum of 0 read as "no key". The report's
    shape (one query, one key) and five of each (all scores equal): out and LSE finite and by the rule (every weight
    equal, every value 133120: the output is exactly 133120)."""
    head_dim = 64
    require_built(head_dim, torch.bfloat16)
    q = torch.full((1, seqlen, 1, head_dim), 133120.0, dtype=torch.bfloat16, device=DEVICE)
    k, v = q.clone(), q.clone()
    out, lse = attention(q, k, v, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), (
        f"not finite: out {out.flatten()[:2].tolist()}, lse {lse.flatten()[:2].tolist()}"
    )
    ref, ref_lse = attention_ref(q, k, v, upcast=True)
    naive, naive_lse = attention_ref(q, k, v, upcast=False)
    assert_close_by_rule(out, ref, naive, "out")
    assert_close_by_rule(lse, ref_lse, naive_lse, "lse")


def _one_hot_inputs(dtype, seqlen_q, seqlen_k, nheads, head_dim):
    """(1, seqlen_q, nheads, head_dim) q and (1, seqlen_k, ...) k of integers in [-2, 2], except their first column:
    q's is 1 and k's a fraction j / 256 that differs between the keys of a head. Every score is an integer plus a
    distinct multiple of 1/256, exact in float32 (and in the kernels' fp32 accumulators): each row has one largest score,
    at least 1/256 above the next. v random."""
    assert seqlen_k <= 256
    q = torch.randint(-2, 3, (1, seqlen_q, nheads, head_dim), device=DEVICE).to(dtype)
    k = torch.randint(-2, 3, (1, seqlen_k, nheads, head_dim), device=DEVICE).to(dtype)
    q[..., 0] = 1
    fractions = torch.stack([torch.randperm(256, device=DEVICE)[:seqlen_k] for _ in range(nheads)], dim=1)
    k[0, :, :, 0] = (fractions.float() / 256).to(dtype)  # j / 256, j < 256: exact in fp16 and bf16
    v = randn(1, seqlen_k, nheads, head_dim, dtype=dtype)
    return q, k, v


HUGE_SCALES = [2.0**17, 2.0**20, 2.0**23, 2.0**26]
# Before session 38 fp16 failed from 2^23 on (its P could not hold 2^r) and both dtypes at 2^26 (NaN).
_HUGE_SCALE_CASES = [
    pytest.param(dtype, scale, id=f"{dtype_id}-2^{int(math.log2(scale))}")
    for dtype, dtype_id in zip(DTYPES, DTYPE_IDS) for scale in HUGE_SCALES
]


# https://github.com/pytorch/pytorch/issues/121558, https://github.com/deepseek-ai/FlashMLA/pull/68 and
# https://github.com/gabrieldemarmiesse/torch-mojo-backend/pull/398 (FA4's P = exp2(fma(s, scale_log2, -rowmax)) with
# a rounded rowmax: the winning element's exponent is off 0 by up to half an ulp of the scaled logit, so on a saturated
# row the output is v · bf16(p) / p, and once that error passes the range of P, inf or 0)
@pytest.mark.parametrize("dtype,softmax_scale", _HUGE_SCALE_CASES)
def test_one_hot_rows_at_huge_softmax_scales(dtype, softmax_scale):
    """PyTorch issue 121558, FlashMLA PR 68 and torch-mojo-backend PR 398, with random rows instead of constants: a
    softmax_scale (inverse temperature) of 2^17 to 2^26 that interface._check_scale accepts, on scores of up to ~±50
    with a gap of at least 1/256 between a row's two largest. The float32 softmax is then exactly one-hot (the runner-up's
    weight is at most e^-512 = 0), so out is exactly the value row of each row's largest score and LSE exactly α times
    that score. The scaled logits in the exp2 domain reach ~2^23.5 (2^17) to ~2^32.5 (2^26), where half an ulp of their
    float32 rounding is 2^-1 to 2^8: an FMA that subtracts the rounded maximum from the exact product leaves P = 2^(that)
    at the maximum, which an fp16 P holds only as a subnormal or not at all from 2^23 on (outputs several ulps off, or
    NaN) and which overflows or empties the float32 row sum at 2^26 (NaN, or a row read as seeing no key). The naive
    reference in the input dtype cannot hold these scores (fp16 overflows, bf16 rounds them into ties), so out must be
    within one ulp of the exact value (twice its rounding to the dtype) and LSE within the rule's floor of the exact
    one. The backward is not asserted: recomputing P from a float32 LSE of magnitude up to ~10^10 (DESIGN.md §1) cannot
    give it to better than |LSE|·2^-24, so no implementation of that design is accurate there."""
    head_dim = 64
    require_built(head_dim, dtype)
    q, k, v = _one_hot_inputs(dtype, 77, 200, 2, head_dim)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float())  # exact: integers plus multiples of 1/256
    top2 = scores.topk(2, dim=-1).values
    assert ((top2[..., 0] - top2[..., 1]) * softmax_scale >= 512).all(), "construction: rows are not one-hot"
    winner = scores.argmax(dim=-1)  # (1, nheads, seqlen_q)
    index = winner.unsqueeze(-1).expand(-1, -1, -1, head_dim)
    exact = torch.gather(v.float().permute(0, 2, 1, 3), 2, index).permute(0, 2, 1, 3)  # (1, seqlen_q, nheads, d)
    ref, ref_lse = attention_ref(q, k, v, softmax_scale=softmax_scale, upcast=True)
    assert torch.equal(ref, exact), "construction: the float32 reference is not exactly one-hot"
    logit_log2 = math.log2((top2[..., 0].abs().max() * softmax_scale * math.log2(math.e)).item())
    name = f"scale 2^{int(math.log2(softmax_scale))} (scaled logits up to 2^{logit_log2:.1f})"

    out, lse = attention(q, k, v, softmax_scale=softmax_scale, return_lse=True)
    _assert_within_one_ulp(out, exact, f"{name} out")
    assert_close_by_rule(lse, ref_lse, ref_lse, f"{name} lse")  # the exact LSE as its own yardstick: the floor only


# The same reports, as a kind of fault rather than one input: every head_dim (the non-lazy kernels at 64/96 also took
# the O rescale as an FFMA against the rounded maximum, so a factor 2^r compounded once per key block), several key
# blocks, causal and not, and the varlen, window and GQA paths, which share the softmax and the exact pass.
@pytest.mark.parametrize("api", ["dense", "varlen", "window", "gqa", "softcap", "documents"])
@pytest.mark.parametrize("logit_log2", [15, 26, 33])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [40, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_equal_scores_at_huge_scaled_logits(dtype, head_dim, causal, logit_log2, api):
    """Every key the same row k0 and every query row ±q0 (random multiples of 1/4, so that the scores are exact), most
    of them scaled down by 2^-(logit_log2 - 4): each row's scores are all equal, with a softmax_scale that puts the
    scaled logit (exp2 domain) of the full rows at ±2^15, ±2^26 or ±2^33 (half an ulp of its float32 rounding: 2^-9,
    2^2, 2^9) and of the scaled-down rows at ±2^4 (fp16 at 2^33: 0, below its subnormals), mixed within a warp's rows.
    The softmax is uniform over the keys a row sees whatever the scale, so out is the mean of those values: the float32
    reference at this scale, with the naive reference at the default scale (the same exact answer) as the yardstick;
    LSE by the rule's floor. Two batch elements (varlen: two packed sequences, the second at row offsets 77 and 700),
    seqlen_k 700 spanning several key blocks at every head_dim; head_dim 40 runs on the 64-wide kernels, "gqa" puts
    both query heads on one K/V head, "softcap" adds a cap of 2^logit_log2 (the kernels' online-maximum softcap path),
    "documents" packs three documents into 300 positions, split differently in the two batch elements. Before the fix:
    NaN, inf or 0 rows, and weights off by 2^r between key blocks (head_dim 64/96). 2^15 stays on the kernels' fast
    path (below kExactRowsLimitLog2 = 2^16, csrc/flash/common/softmax.hpp); 2^26 and 2^33 rows are recomputed by the
    exact pass (csrc/flash/fwd/exact_rows_sm90.hpp), on which 2^33 depends."""
    require_built(head_dim, dtype)
    batch, nheads = 2, 2
    seqlen_q, seqlen_k = (300, 300) if api == "documents" else (77, 700)
    gen = torch.Generator(device="cpu").manual_seed(logit_log2 * 1000 + head_dim)
    # Positive multiples of 1/4 in [1/4, 1]: every product and partial sum of q0 · k0 is exact in float32, so the
    # kernels and the reference get the same scores. (With random normal rows the sum could cancel, and its rounding,
    # scaled up to 2^15 and more, moved the reference's LSE by ~1: an ill-conditioned input, not a kernel error.)
    q0 = (torch.randint(1, 5, (1, 1, 1, head_dim), generator=gen).float() / 4).to(DEVICE)
    k0 = (torch.randint(1, 5, (1, 1, 1, head_dim), generator=gen).float() / 4).to(DEVICE)
    sign = torch.randint(0, 2, (batch, seqlen_q, nheads, 1), generator=gen).float() * 2 - 1
    small = torch.rand(batch, seqlen_q, nheads, 1, generator=gen) < 0.6
    row_scale = torch.where(small, 2.0 ** -(logit_log2 - 4), 1.0) * sign
    q = (q0 * row_scale.to(DEVICE)).to(dtype)
    k = k0.expand(batch, seqlen_k, 1 if api == "gqa" else nheads, head_dim).to(dtype).contiguous()
    v = randn(batch, seqlen_k, k.shape[2], head_dim, dtype=dtype)
    score = (q0.to(dtype).float() * k0.to(dtype).float()).sum().abs().item()
    softmax_scale = 2.0**logit_log2 / (score * math.log2(math.e))
    window = (100, 0) if api == "window" else (-1, -1)
    opts = dict(causal=causal, window_size=window)
    if api == "softcap":
        opts["softcap"] = 2.0**logit_log2
    if api == "documents":
        opts["document_ids"] = torch.tensor([[0] * 100 + [1] * 150 + [2] * 50, [0] * 20 + [1] * 200 + [2] * 80],
                                            device=DEVICE)
    name = f"head_dim {head_dim} {api} causal {causal} logits ~2^{logit_log2}"
    if api == "varlen":
        cu = cu_seqlens([seqlen_q] * batch), cu_seqlens([seqlen_k] * batch)
        out, lse = attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), *cu, seqlen_q, seqlen_k,
                                    softmax_scale=softmax_scale, return_lse=True, **opts)
        out = out.unflatten(0, (batch, seqlen_q))
        lse = lse.unflatten(1, (batch, seqlen_q)).transpose(0, 1)  # (nheads, total_q) -> (batch, nheads, seqlen_q)
    else:
        out, lse = attention(q, k, v, softmax_scale=softmax_scale, return_lse=True, **opts)
    ref, ref_lse = attention_ref(q, k, v, softmax_scale=softmax_scale, upcast=True, **opts)
    naive, _ = attention_ref(q, k, v, upcast=False, **opts)
    assert_close_by_rule(out, ref, naive, f"{name} out")
    assert_close_by_rule(lse, ref_lse, ref_lse, f"{name} lse")


# The other end of the accepted range (interface._check_scale; the C++ check wants softmax_scale · log2(e) normal):
# the scores vanish and the softmax is uniform over the keys a row sees. Same reports as above (the scale enters the
# exponent's FMA).
def test_smallest_accepted_softmax_scale():
    """softmax_scale = 2^-126, the smallest float32 normal and the smallest value interface._check_scale accepts: every
    scaled score is ~1e-37, so each row is the mean of the values it sees and its LSE the log of their number (causal,
    seqlen_q 150 < seqlen_k 333: each row sees a different number). out, LSE, dQ, dK, dV by the rule (dQ = α dS K and dK
    are ~1e-38 and below, subnormal or zero in every format involved: they meet the rule through its floor)."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    scale = 2.0**-126
    q, k, v, dout = attention_inputs(2, 150, 333, 4, 2, head_dim, dtype)
    out, lse, grads = run_attention(q, k, v, dout, softmax_scale=scale, causal=True)
    check_attention(out, lse, grads, q, k, v, dout, "scale 2^-126", softmax_scale=scale, causal=True)


# --------------------------------------------------------------------------------------- memory and object lifetime


# https://github.com/pytorch/pytorch/issues/25340 (an autograd.Function that kept its output on ctx made a reference
# cycle: the graph and everything it saved stayed alive until the cyclic collector ran) and
# https://github.com/RobinBruegger/RevTorch/issues/1 (a leak only when an output was not used by the loss, so its
# backward never ran to break the cycle)
def test_graphs_freed_without_the_cycle_collector():
    """PyTorch issue 25340 and RevTorch issue 1: an autograd node that holds its own output (or a Python object that
    refers back to the graph) forms a reference cycle, and the saved q, k, v, out and LSE then live until the cyclic
    garbage collector runs: with gc disabled or rare (a common training setting), device memory grows with every step.
    test_bug_reports_third_gpu::test_no_device_memory_kept_between_calls calls gc.collect() before measuring, which
    hides exactly this. Here the collector is off: each step (dense GQA through out and LSE, packed documents, and
    attention_varlen with rows past the last sequence, whose padding is part of the graph, each with fresh cu_seqlens /
    document_ids tensors) runs once with a backward and once with its graph dropped unused, and after every step the
    allocated device memory must be back at its value before it, by reference counting alone."""
    head_dim = 64
    dtype = built_dtype(head_dim)

    def step(seqlen, backward):
        q, k, v, dout = attention_inputs(2, seqlen, seqlen + 9, 4, 2, head_dim, dtype)
        leaves = _leaves(q, k, v)
        out, lse = attention(*leaves, causal=True, return_lse=True)
        third = seqlen // 3
        ids = torch.repeat_interleave(torch.arange(3), torch.tensor([third, third, seqlen - 2 * third]))
        ids = ids.expand(2, seqlen).contiguous().to(DEVICE)
        doc_leaves = _leaves(*attention_inputs(2, seqlen, seqlen, 4, 2, head_dim, dtype)[:3])
        doc_out = attention(*doc_leaves, causal=True, document_ids=ids)
        lengths = [seqlen // 2, 0, seqlen - seqlen // 2]
        cu_q, cu_k = cu_seqlens(lengths), cu_seqlens(lengths)
        var_q, var_k, var_v, _ = _varlen_inputs(lengths + [7], lengths, 4, 2, head_dim, dtype)  # 7 rows past the end
        var_leaves = _leaves(var_q, var_k, var_v)
        var_out = attention_varlen(*var_leaves, cu_q, cu_k, max(lengths), max(lengths), causal=True)
        if backward:
            torch.autograd.backward([out, lse, doc_out, var_out],
                                    [dout, torch.ones_like(lse), torch.ones_like(doc_out), torch.ones_like(var_out)])
            assert all(t.grad is not None for t in leaves + doc_leaves + var_leaves), "a gradient is missing"

    step(100, True)  # warm-up: whatever a first call keeps for good is in the baseline
    step(100, False)
    gc.collect()
    torch.cuda.synchronize()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for seqlen in (130, 257, 199):
            for backward in (False, True):
                before = torch.cuda.memory_allocated()
                step(seqlen, backward)
                kept = torch.cuda.memory_allocated() - before
                assert kept == 0, (
                    f"seqlen {seqlen}, backward={backward}: {kept} bytes of device memory outlived the step with the "
                    "cyclic garbage collector off (a reference cycle holds a graph or its saved tensors)"
                )
    finally:
        if enabled:
            gc.enable()


# https://github.com/RBLN-SW/torch-rbln/pull/138 (SDPA's forward cached intermediate tensors keyed by the output's
# data_ptr(); entries outlived their tensors, and only a later tensor at the same address displaced them)
def test_fresh_tensors_at_a_freed_tensors_id_and_memory():
    """torch-rbln PR 138: a cache keyed by something a freed tensor hands on to the next one (its address, or its
    Python id) serves the old entry to a new tensor. attention_varlen notes each cu_seqlens tensor's first and last
    entries and longest sequence, and attention each document_ids tensor's bounds, per tensor object and version.
    Here each step makes its cu_seqlens (and, in a second loop, document_ids) tensor with torch.empty right after the
    previous step's was freed, so CPython hands the new tensor the freed object's id and the caching allocator the freed
    block, and fills it with copy_: the same id, the same data_ptr and the same version (1) as the freed one, but other
    values (other lengths, a different number of rows past the last sequence; other documents). Every step's out and
    LSE by the rule against the reference for its own values; the test asserts that ids were in fact reused."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    rng = random.Random(0)
    nheads, nheads_k, rows_q, rows_k = 4, 2, 600, 700
    q, k, v, _ = _varlen_inputs([rows_q], [rows_k], nheads, nheads_k, head_dim, dtype)
    steps, same_id, previous = 12, 0, None
    for step in range(steps):
        lengths_q = [rng.randrange(0, 190) for _ in range(3)]  # the rest of the 600 rows: past the last sequence
        lengths_k = [rng.randrange(1, 233) for _ in range(3)]
        offsets_q = list(itertools.accumulate([0] + lengths_q))
        offsets_k = list(itertools.accumulate([0] + lengths_k))
        cu_q = torch.empty(4, dtype=torch.int32, device=DEVICE)  # the first tensor made since the last one was freed
        same_id += id(cu_q) == previous
        cu_q.copy_(torch.tensor(offsets_q, dtype=torch.int32))
        cu_k = torch.empty(4, dtype=torch.int32, device=DEVICE)
        cu_k.copy_(torch.tensor(offsets_k, dtype=torch.int32))
        out, lse = attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                    return_lse=True)
        ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=True)
        naive, naive_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=False)
        assert_close_by_rule(out, ref, naive, f"varlen step {step} out")
        assert_close_by_rule(lse, ref_lse, naive_lse, f"varlen step {step} lse")
        previous = id(cu_q)
        del out, lse, ref, ref_lse, naive, naive_lse, cu_k
        del cu_q  # freed last: its object is the next one CPython hands out
    assert same_id >= steps // 2, f"cu_seqlens: only {same_id} of {steps - 1} steps reused the freed tensor's id"

    seqlen = 500
    doc_q, doc_k, doc_v, _ = attention_inputs(2, seqlen, seqlen, nheads, nheads_k, head_dim, dtype)
    same_id, previous = 0, None
    for step in range(steps):
        ids = torch.empty((2, seqlen), dtype=torch.int32, device=DEVICE)  # first tensor since the last was freed
        same_id += id(ids) == previous
        rows = []
        for _ in range(2):
            cuts = sorted(rng.sample(range(1, seqlen), rng.randrange(1, 6)))
            rows.append([b - a for a, b in zip([0] + cuts, cuts + [seqlen])])
        host_ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])
        ids.copy_(host_ids.to(torch.int32))
        out, lse = attention(doc_q, doc_k, doc_v, causal=True, document_ids=ids, return_lse=True)
        ref, ref_lse = attention_ref(doc_q, doc_k, doc_v, causal=True, document_ids=ids, upcast=True)
        naive, naive_lse = attention_ref(doc_q, doc_k, doc_v, causal=True, document_ids=ids, upcast=False)
        assert_close_by_rule(out, ref, naive, f"documents step {step} out")
        assert_close_by_rule(lse, ref_lse, naive_lse, f"documents step {step} lse")
        previous = id(ids)
        del out, lse, ref, ref_lse, naive, naive_lse, host_ids
        del ids
    assert same_id >= steps // 2, f"document_ids: only {same_id} of {steps - 1} steps reused the freed tensor's id"


# ------------------------------------------------------------------------------------------------ batch invariance


BATCH_INVARIANCE_OPTIONS = [dict(causal=True), dict(window_size=(96, 32), softcap=30.0)]


# https://github.com/vllm-project/vllm/issues/51902 (H100 FA3: a decode row's bf16 output changed when an unrelated
# prefill in the same varlen call grew from 9 to 10 tokens, which raised max_seqlen_q and changed the tile scheduler)
# and https://github.com/Dao-AILab/flash-attention/issues/1897 (is FA3's forward batch invariant?)
@pytest.mark.parametrize("opts", BATCH_INVARIANCE_OPTIONS, ids=["causal", "window-softcap"])
def test_forward_is_batch_invariant(opts):
    """vLLM issue 51902 and FlashAttention issue 1897: deterministic inference needs a sequence's attention output to
    be the same bits whatever else is in the batch. This forward has no split-KV and no reduction across rows or
    sequences, and at head_dim 128 one tile shape for every problem (asserted below through fwd_block_m, the launcher's
    own pick), so a row's result may depend on nothing but its sequence. One sequence (333 queries, 517 keys, GQA 4/2)
    runs alone; as element 2 of a batch of four and element 0 of a batch of three (other elements random); and in
    attention_varlen alone, between a one-token decode against 700 keys and a short sequence, and beside a 900-token
    prefill that raises max_seqlen_q (the vLLM case). Its out and LSE must be the same bits in every call; the call
    alone is checked by the rule."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    nheads, nheads_k, seqlen_q, seqlen_k = 4, 2, 333, 517
    q1, k1, v1, _ = attention_inputs(1, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    alone_out, alone_lse = attention(q1, k1, v1, return_lse=True, **opts)
    ref, ref_lse = attention_ref(q1, k1, v1, upcast=True, **opts)
    naive, naive_lse = attention_ref(q1, k1, v1, upcast=False, **opts)
    assert_close_by_rule(alone_out, ref, naive, "alone out")
    assert_close_by_rule(alone_lse, ref_lse, naive_lse, "alone lse")

    heights = {"alone": _tile_height(head_dim, 1, nheads, seqlen_q, seqlen_k, opts)}
    for batch, pos in ((4, 2), (3, 0)):
        q, k, v, _ = attention_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
        q[pos], k[pos], v[pos] = q1[0], k1[0], v1[0]
        out, lse = attention(q, k, v, return_lse=True, **opts)
        name = f"element {pos} of a batch of {batch}"
        heights[name] = _tile_height(head_dim, batch, nheads, seqlen_q, seqlen_k, opts)
        assert torch.equal(bits(out[pos]), bits(alone_out[0])), f"{name}: out differs from the sequence alone"
        assert torch.equal(bits(lse[pos]), bits(alone_lse[0])), f"{name}: LSE differs from the sequence alone"

    layouts = [([seqlen_q], [seqlen_k], 0), ([1, seqlen_q, 90], [700, seqlen_k, 5], 1),
               ([seqlen_q, 900], [seqlen_k, 64], 0)]
    for lengths_q, lengths_k, index in layouts:
        parts = [(q1[0], k1[0], v1[0]) if i == index else
                 (randn(lq, nheads, head_dim, dtype=dtype), randn(lk, nheads_k, head_dim, dtype=dtype),
                  randn(lk, nheads_k, head_dim, dtype=dtype))
                 for i, (lq, lk) in enumerate(zip(lengths_q, lengths_k))]
        q, k, v = (torch.cat([part[j] for part in parts]) for j in range(3))
        cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
        out, lse = attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), return_lse=True, **opts)
        start = sum(lengths_q[:index])
        rows = slice(start, start + seqlen_q)
        name = f"varlen lengths {lengths_q} x {lengths_k}"
        heights[name] = _tile_height(head_dim, len(lengths_q), nheads, max(lengths_q), max(lengths_k), opts)
        assert torch.equal(bits(out[rows]), bits(alone_out[0])), f"{name}: out differs from the sequence alone"
        assert torch.equal(bits(lse[:, rows]), bits(alone_lse[0])), f"{name}: LSE differs from the sequence alone"
    assert len(set(heights.values())) == 1, f"the calls ran different tile heights {heights}: pick shapes that share one"


# ------------------------------------------------------------------------------------------- autograd modes


# https://github.com/Dao-AILab/flash-attention/issues/41 (torch.autograd.set_detect_anomaly(True) reported
# "Function 'FlashAttnQKVPackedFuncBackward' returned nan values in its 0th output") and
# https://github.com/huggingface/transformers/issues/38690 (rows of padding: NaN from a fused backend, 0 from the math
# one, and the NaN spread through later layers)
def test_anomaly_detection_over_rows_that_see_no_key():
    """FlashAttention issue 41 and transformers issue 38690: under torch.autograd.detect_anomaly(check_nan=True) every
    backward node's outputs are checked for NaN, so a kernel that leaves NaN (or reads a workspace NaN) in the gradient
    rows of queries that see no key, or of rows past the last sequence, stops training with an error although the
    loss does not use them. DESIGN.md §2: such rows have dQ 0 and nothing is NaN. A dense causal call with more queries
    than keys (100 rows see no key, LSE -inf) and a varlen call with a sequence without keys, a sequence without queries
    and 13 rows past the last sequence (their padding is part of the graph), both with a loss through out and the finite
    LSE entries (nan_to_num, whose gradient is 0 at -inf), run forward and backward in anomaly mode: no error, and out,
    LSE, dQ, dK, dV by the rule."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    q, k, v, dout = attention_inputs(2, 300, 200, 4, 2, head_dim, dtype)
    dlse = torch.randn(2, 4, 300, device=DEVICE)
    lq, lk = [50, 40, 0, 77], [60, 0, 30, 1]
    var_q, var_k, var_v, var_dout = _varlen_inputs(lq + [13], lk, 4, 2, head_dim, dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    var_dlse = torch.randn(4, var_q.shape[0], device=DEVICE)
    with torch.autograd.detect_anomaly(check_nan=True):
        leaves = _leaves(q, k, v)
        out, lse = attention(*leaves, causal=True, return_lse=True)
        loss = (out.float() * dout.float()).sum() + (lse.nan_to_num(neginf=0.0) * dlse).sum()
        grads = torch.autograd.grad(loss, leaves)
        var_leaves = _leaves(var_q, var_k, var_v)
        var_out, var_lse = attention_varlen(*var_leaves, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)
        var_loss = (var_out.float() * var_dout.float()).sum() + (var_lse.nan_to_num(neginf=0.0) * var_dlse).sum()
        var_grads = torch.autograd.grad(var_loss, var_leaves)
    lse, var_lse = lse.detach(), var_lse.detach()
    assert torch.isneginf(lse).any() and torch.isneginf(var_lse).any(), "construction: no row sees no key"
    check_attention(out.detach(), lse, grads, q, k, v, dout, "anomaly dense",
                    dlse=dlse.masked_fill(torch.isneginf(lse), 0.0), causal=True)
    check_attention_varlen(var_out.detach(), var_lse, var_grads, var_q, var_k, var_v, var_dout, cu_q, cu_k,
                           "anomaly", dlse=var_dlse.masked_fill(torch.isneginf(var_lse), 0.0), causal=True)


# https://github.com/Dao-AILab/flash-attention/pull/2388 (the split-KV forward addressed the LSE accumulator with
# hard-coded strides instead of the ones passed) and https://github.com/flagos-ai/FlagAttention/pull/1 (the backward's
# preprocess assumed contiguous o / do / delta layouts)
@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_lse_gradient_with_a_transposed_layout(api):
    """FlashAttention PR 2388 and FlagAttention PR 1: kernels that assume a layout for the LSE or its companions
    instead of reading strides. Merging partial results (ring / context-parallel attention) uses the LSE transposed to
    the output's (batch, seqlen, nheads) or (total_q, nheads) layout, so the gradient arriving for the LSE (dLSE) is a
    transposed view, not the contiguous (batch, nheads, seqlen) / (nheads, total_q) tensor of the forward (the stride-0
    dLSE of lse.sum() is covered by test_features_gpu). A hook asserts that the backward receives a non-contiguous
    dLSE; out, LSE, dQ, dK, dV by the rule, with the loss through out and the transposed LSE."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    layouts = []
    if api == "dense":
        q, k, v, dout = attention_inputs(2, 300, 333, 4, 2, head_dim, dtype)
        weight = torch.randn(2, 300, 4, device=DEVICE)
        leaves = _leaves(q, k, v)
        out, lse = attention(*leaves, causal=True, return_lse=True)
        lse.register_hook(lambda g: layouts.append(g.is_contiguous()))
        loss = (out.float() * dout.float()).sum() + (lse.transpose(1, 2) * weight).sum()
        grads = torch.autograd.grad(loss, leaves)
        assert layouts == [False], f"construction: the LSE's gradient arrived contiguous={layouts}"
        check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, "transposed dLSE",
                        dlse=weight.transpose(1, 2).contiguous(), causal=True)
    else:
        lq, lk = [100, 1, 201, 57], [130, 40, 201, 3]
        q, k, v, dout = _varlen_inputs(lq, lk, 4, 2, head_dim, dtype)
        cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
        weight = torch.randn(sum(lq), 4, device=DEVICE)
        leaves = _leaves(q, k, v)
        out, lse = attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)
        lse.register_hook(lambda g: layouts.append(g.is_contiguous()))
        loss = (out.float() * dout.float()).sum() + (lse.t() * weight).sum()
        grads = torch.autograd.grad(loss, leaves)
        assert layouts == [False], f"construction: the LSE's gradient arrived contiguous={layouts}"
        check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, dout, cu_q, cu_k, "transposed dLSE",
                               dlse=weight.t().contiguous(), causal=True)


# ---------------------------------------------------------------------------------------------------- torch.export


# https://github.com/Dao-AILab/flash-attention/issues/1332 (flash_attn's varlen_fwd could not be scripted, traced or
# exported: "is currently not supported in Torchscript") and https://github.com/unslothai/unsloth/issues/7124 (an
# attention path that torch.export could not go through)
@pytest.mark.parametrize("case", ["dense", "dense_strict", "documents", "varlen"])
def test_torch_export(case):
    """FlashAttention issue 1332 and unsloth issue 7124: serving stacks export models (torch.export, then AOTInductor
    or another runtime), which needs the op to trace as one node through fake tensors (its fake kernel) with no host
    read of tensor values, in strict (Dynamo) and non-strict (Python) tracing, and the exported program to give the
    eager results. Dense (causal, softcap) with dynamic seqlen_q and seqlen_k, exported non-strict and strict and run
    at the export shapes and at others; packed documents; attention_varlen (window) run again with other cu_seqlens
    values of the same shape (the exported graph must read them on the device, not keep the export-time ones). Each
    exported program holds the op, and its out and LSE are the bits of the eager call on the same inputs."""
    from torch.export import Dim, export

    head_dim = 64
    dtype = built_dtype(head_dim)
    strict = case == "dense_strict"
    if case.startswith("dense"):
        module, op = Attention(causal=True, softcap=20.0, return_lse=True), torch.ops.flash_attn_hopper.fwd.default
        seqlen_q, seqlen_k = Dim("seqlen_q", min=2, max=4096), Dim("seqlen_k", min=2, max=4096)
        dynamic_shapes = ({1: seqlen_q}, {1: seqlen_k}, {1: seqlen_k})
        runs = [attention_inputs(2, sq, sk, 4, 2, head_dim, dtype)[:3] for sq, sk in ((300, 400), (77, 1025))]
    elif case == "documents":
        module, op, dynamic_shapes = Attention(causal=True, return_lse=True), torch.ops.flash_attn_hopper.fwd.default, None
        ids = torch.repeat_interleave(torch.arange(4), torch.tensor([100, 1, 250, 149])).expand(2, 500)
        runs = [(*attention_inputs(2, 500, 500, 4, 2, head_dim, dtype)[:3], ids.contiguous().to(DEVICE))]
    else:
        lengths = [([100, 0, 301, 57], [130, 40, 301, 3]), ([300, 58, 50, 50], [1, 300, 171, 2])]
        module, op, dynamic_shapes = AttentionVarlen(301, 301, window_size=(64, 0), return_lse=True), torch.ops.flash_attn_hopper.fwd_varlen.default, None
        q, k, v, _ = _varlen_inputs(*lengths[0], 4, 2, head_dim, dtype)
        runs = [(q, k, v, cu_seqlens(lq), cu_seqlens(lk)) for lq, lk in lengths]
        assert all(sum(lq) == q.shape[0] and sum(lk) == k.shape[0] for lq, lk in lengths)

    program = export(module, runs[0], dynamic_shapes=dynamic_shapes, strict=strict)
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert targets.count(op) == 1, f"the exported graph does not hold {op} once: {targets}"
    exported = program.module()
    for i, args in enumerate(runs):
        got_out, got_lse = exported(*args)
        out, lse = module(*args)
        shapes = [tuple(t.shape) for t in args]
        assert torch.equal(bits(got_out), bits(out)), f"{case} run {i} {shapes}: out differs from eager"
        assert torch.equal(bits(got_lse), bits(lse)), f"{case} run {i} {shapes}: LSE differs from eager"


# ---------------------------------------------------------------------------------------------- subnormal fp16


# https://github.com/iree-org/iree/pull/22041 (attention kernels configured to flush denormals),
# https://github.com/tenstorrent/tt-metal/pull/50082 (hardware keeps fp16 subnormals but flushes bf16/fp32 ones; the
# reference had to follow) and https://github.com/invergent-ai/surogate/issues/162 (a float-to-fp16 conversion flushed
# every fp16 subnormal to zero)
def test_fp16_values_in_the_subnormal_range():
    """IREE PR 22041, tt-metal PR 50082 and surogate issue 162: fp16 has subnormals below 2^-14 (down to 2^-24) that
    are ordinary float32 values, so an fp16 attention has no reason to lose them, but a kernel built to flush denormals
    (or an fp16 conversion that does) returns zeros. v and dO of magnitude ~2^-17 (every element subnormal in fp16):
    out (~2^-20) and dV in the subnormal range, q and k ordinary. out, LSE, dQ, dK, dV by the rule with a floor of one
    fp16 subnormal step (2^-24) instead of the default 1e-4, which would swallow the whole output; and, in case the
    GPU's own fp16 matmul in the naive reference flushed them too, out and dV also within two subnormal steps of the
    float32 reference."""
    head_dim = 64
    dtype = torch.float16
    require_built(head_dim, dtype)
    step = 2.0**-24
    q, k, _, _ = attention_inputs(2, 200, 257, 4, 2, head_dim, dtype)
    v = (randn(2, 257, 2, head_dim, dtype=torch.float32) * 2.0**-17).to(dtype)
    dout = (randn(2, 200, 4, head_dim, dtype=torch.float32) * 2.0**-17).to(dtype)
    assert (v.abs() < 2.0**-14).all() and (dout.abs() < 2.0**-14).all(), "construction: not all subnormal"
    out, lse, grads = run_attention(q, k, v, dout, causal=True)
    ref, ref_lse = attention_ref(q, k, v, causal=True, upcast=True)
    naive, naive_lse = attention_ref(q, k, v, causal=True, upcast=False)
    assert (ref.abs() >= 2.0**-22).float().mean() > 0.5, "construction: the output is not mostly above 2^-22"
    assert_close_by_rule(out, ref, naive, "subnormal out", floor=step)
    assert_close_by_rule(lse, ref_lse, naive_lse, "subnormal lse")
    ref_g = attention_ref_grads(q, k, v, dout, causal=True, upcast=True)
    naive_g = attention_ref_grads(q, k, v, dout, causal=True, upcast=False)
    for gname, g, r, n in zip(GRAD_NAMES, grads, ref_g, naive_g):
        assert_close_by_rule(g, r, n, f"subnormal {gname}", floor=step)
    for what, got, r in (("out", out, ref), ("dv", grads[2], ref_g[2])):
        err = (got.float() - r).abs().max().item()
        assert err <= 2 * step, f"{what}: {err / step:.2f} subnormal steps from the float32 reference (flushed?)"
