"""Twenty-third round of the bug hunt (tests/bug_report_sources.md, "Twenty-third round"), GPU part.

EZ: long contexts over values far from zero. The online softmax keeps O unnormalised (Σ_j P̃_j V_j, with P̃ = exp(S - m)
up to 1 per key) until the division by the row sum ℓ at the end, so with near-uniform attention over N keys the
accumulator reaches about N·|V| while the output stays about |V|: an accumulator (or a rescale, or a staging copy) in the
input dtype overflows fp16 past 65504 or loses bf16's 8 bits (ggml-org/llama.cpp#13975: the Metal FA kernels' O
accumulator overflowed F16 past 32k tokens of context, Gemma 3 wrote garbage; Xilinx/mlir-air#1606: a bf16 P·V
accumulator lost each ~1/N addend once the running sum was ~256 ulps large). The usual random inputs hide it: V of mean 0
cancels in the sum.
FA: query rows of one sequence past 2^31 elements of q, out, dO and dQ. The forward's output epilogue, the backward's
preprocess (D = rowsum(dO ∘ O)) and the dQ postprocess index query rows as row × row_stride; in 32 bits that wraps at
2^31 / (nheads · head_dim) rows (SHI-Labs/NATTEN#347: the compute-delta reduction's int32 offsets gave wrong dQ, dK from
2,097,153 queries at 16 heads × 64; meta-pytorch/MSLK#303: row_index * stride in int32 at N >= 2M). Class 17 crosses
2^31 only between batch elements, class N only along the keys.
FB: v's own head_dim at every width below the kernel of q's (8 ... 120 beside 128, 8 / 136 / 200 beside 256) and the
mirror (q, k narrow beside a wide v), dense and varlen: a column count, store granularity or predicate of O, dO, V or dV
taken from q's head_dim (Dao-AILab/flash-attention#2552: FA4's dV written with a reduce width derived from head_dim,
wrong for (128, 96), (128, 8), (128, 40), ...; ROCm/aotriton#162's review: the backward's block width rounded from k's
head dim only, out of bounds when v's is larger). test_head_dim_v_gpu.py runs v at 40, 64, 72, 128 only.
The CPU part (tests/test_bug_reports_twentythird_cpu.py) runs the EZ and FB constructions through the CPU stand-ins and
checks that EZ's fails for a kernel whose accumulator is in the input dtype.

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py: "no CUDA GPU: GPU tests need an sm90
GPU (H100/H200)"), and per test when the build lacks the head_dim / dtype."""

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import (assert_close_by_rule, attention_ref, attention_ref_grads, attention_varlen_ref,
                                       attention_varlen_ref_grads, repeat_kv)
from gpu_helpers import (DTYPES, attention_inputs, built_dtype, check_attention, check_varlen,
                         cu_seqlens, poison_allocator, randn, require_built, run_attention)
from test_bug_reports_gpu import _leaves, _releasing_memory, _require_free_memory

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DTYPE_IDS = ["fp16", "bf16"]
FP16_MAX = 65504.0


# ----------------------------------------------------------------------------------- EZ: long contexts, large values

# The values' common magnitude c per dtype: fp16's leaves the output (about c) 2000 times below the fp16 maximum while
# the unnormalised accumulator (about c·ℓ, ℓ ~ 0.8 N) passes it 16 times; bf16's is itself past fp16's range (a bf16
# path that stages anything in fp16 overflows at once), with the accumulator at ~3e10.
LONG_CONTEXT_VALUE = {torch.float16: 32.0, torch.bfloat16: 2.0**20}


def long_context_inputs(dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, device="cuda"):
    """q small (scores of standard deviation 0.05: near-uniform attention), k standard normal, v = c·(1 + 0.1·noise) with
    c = LONG_CONTEXT_VALUE[dtype] (every value of one sign, far from zero), dout standard normal."""
    c = LONG_CONTEXT_VALUE[dtype]
    q = (torch.randn(batch, seqlen_q, nheads, head_dim, device=device) * 0.05).to(dtype)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, device=device).to(dtype)
    v = (c * (1 + 0.1 * torch.randn(batch, seqlen_k, nheads_k, head_dim, device=device))).to(dtype)
    dout = torch.randn(batch, seqlen_q, nheads, head_dim, device=device).to(dtype)
    return q, k, v, dout


def assert_accumulator_far_past_fp16(q, k, v, name, causal=False):
    """The construction does what it says: every row's weight is spread (its largest P at most 2 / seqlen_k, i.e. the
    row sum ℓ relative to the row maximum, 1 / P_max, at least seqlen_k / 2), so that the unnormalised accumulator
    ℓ·|O| passes 8 times the fp16 maximum while |O| stays 16 times below the dtype's maximum. From the float32
    reference, on q's device."""
    qf, kf = q.float(), repeat_kv(k.float(), q.shape[2])
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device=q.device).unsqueeze(1)
        j = torch.arange(sk, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(j > i + sk - sq, float("-inf"))
    p_max = torch.softmax(scores, dim=-1).amax().item()
    ref, _ = attention_ref(q, k, v, causal=causal)
    out_max = ref.abs().amax().item()
    out_min = ref.abs().amin().item()
    if not p_max <= 2.0 / k.shape[1]:
        raise AssertionError(f"{name}: attention is not spread (largest P {p_max:.3e})")
    if not (out_max < torch.finfo(q.dtype).max / 16 and out_min / p_max >= 8 * FP16_MAX):
        raise AssertionError(f"{name}: |O| in [{out_min:.3e}, {out_max:.3e}] with P up to {p_max:.3e}: the accumulator "
                             "does not pass fp16's range with the output inside it")


def check_long_context(out, lse, grads, q, k, v, dout, name, cu_seqlens_q=None, cu_seqlens_k=None, causal=False):
    """out, dQ, dK, dV finite (dP = dO Vᵀ and D pass fp16's range in bf16: a stage kept in fp16 gives NaN there); out,
    LSE and dV by the rule against the float32 reference (varlen when cu_seqlens are given).
    dQ and dK are not compared at these inputs: D = rowsum(dO ∘ O) is formed from the stored out (DESIGN.md §1), whose
    rounding at |O| ~ c puts an error of the naive reference's own order into every dS of a row (the CPU stand-in, which
    forms D so: dQ at 1.1 times the naive error in fp16), so the rule would have no margin there by design."""
    for t, what in ((out, "out"), *zip(grads, ("dq", "dk", "dv"))):
        if not torch.isfinite(t).all():
            raise AssertionError(f"{name}: {what} is not finite")
    dv = grads[2]
    if cu_seqlens_q is None:
        refs = [attention_ref(q, k, v, upcast=u, causal=causal) for u in (True, False)]
        dvs = [attention_ref_grads(q, k, v, dout, upcast=u, causal=causal)[2] for u in (True, False)]
    else:
        refs = [attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, upcast=u, causal=causal) for u in (True, False)]
        dvs = [attention_varlen_ref_grads(q, k, v, dout, cu_seqlens_q, cu_seqlens_k, upcast=u, causal=causal)[2]
               for u in (True, False)]
    assert_close_by_rule(out, refs[0][0], refs[1][0], f"{name} out")
    assert_close_by_rule(lse, refs[0][1], refs[1][1], f"{name} lse")
    assert_close_by_rule(dv, dvs[0], dvs[1], f"{name} dv")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_long_context_over_values_far_from_zero(dtype, causal):
    """EZ (llama.cpp #13975, mlir-air #1606): 77 queries (4 heads on 2 K/V heads) against 40,003 keys with near-uniform
    attention over values of one sign far from zero (fp16: 32 ± 10 %; bf16: 2^20 ± 10 %, itself past fp16's range), so
    that Σ P̃ V before the division by ℓ passes 8 x 65504 while out stays near the values (asserted from the
    reference). Forward and backward on NaN-poisoned memory: out finite; out, LSE and dV by the rule
    (check_long_context says why not dQ, dK)."""
    head_dim = 128
    require_built(head_dim, dtype)
    q, k, v, dout = long_context_inputs(dtype, 1, 77, 40_003, 4, 2, head_dim)
    name = f"long context {dtype} causal={causal}"
    assert_accumulator_far_past_fp16(q, k, v, name, causal=causal)
    out, lse, grads = run_attention(q, k, v, dout, causal=causal)
    check_long_context(out, lse, grads, q, k, v, dout, name, causal=causal)


def test_long_context_over_values_far_from_zero_varlen():
    """EZ through attention_varlen (its own row offsets): fp16, causal, two sequences of 77 and 50 queries against
    40,003 and 30,001 keys of the same construction, GQA 4/2; forward and backward on NaN-poisoned memory, out, LSE and
    dV by the rule."""
    head_dim = 128
    dtype = torch.float16
    require_built(head_dim, dtype)
    lq, lk = [77, 50], [40_003, 30_001]
    parts = [long_context_inputs(dtype, 1, sq, sk, 4, 2, head_dim) for sq, sk in zip(lq, lk)]
    for i, (q, k, v, _) in enumerate(parts):
        assert_accumulator_far_past_fp16(q, k, v, f"sequence {i}", causal=True)
    q, k, v, dout = (torch.cat([p[j][0] for p in parts]) for j in range(4))
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    leaves = _leaves(q, k, v)
    e = q.element_size()
    poison_allocator(q.numel() * e, q.shape[0] * q.shape[1] * 4)
    out, lse = attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)
    poison_allocator(q.numel() * e, k.numel() * e, v.numel() * e)
    grads = torch.autograd.grad(out, leaves, dout)
    check_long_context(out.detach(), lse.detach(), grads, q, k, v, dout, "varlen long context", cu_q, cu_k,
                       causal=True)


# ------------------------------------------------------------------- FA: query rows past 2^31 elements of one sequence


def _query_rows_beyond_int32():
    head_dim, nheads = 128, 8
    dtype = built_dtype(head_dim)
    seqlen_k = 300
    seqlen_q = 2**21 + seqlen_k  # q, out, dO, dQ: rows from 2^21 on start past 2^31 elements (4 GiB each)
    _require_free_memory(30 * 2**30)  # peak ~25 GiB: q, dO, out, dQ 4 GiB each, the fp32 dQ accumulator 8
    q = randn(1, seqlen_q, nheads, head_dim, dtype=dtype)
    k = randn(1, seqlen_k, nheads, head_dim, dtype=dtype)
    v = randn(1, seqlen_k, nheads, head_dim, dtype=dtype)
    dout = randn(1, seqlen_q, nheads, head_dim, dtype=dtype)
    if not (q.numel() > 2**31 and (seqlen_q - seqlen_k) * nheads * head_dim >= 2**31):
        raise AssertionError("the construction: the last seqlen_k rows must start past 2^31 elements")
    e = q.element_size()

    # every row sees every key: rows are independent, so slices of them are checked against their own reference
    poison_allocator(q.numel() * e, nheads * seqlen_q * 4)
    out, lse = attention(q, k, v, return_lse=True)
    if not torch.isfinite(out).all():
        raise AssertionError("full rows: out is not finite")
    for start in (0, 2**20, seqlen_q - 256):
        rows = slice(start, start + 256)
        ref, ref_lse = attention_ref(q[:, rows], k, v)
        naive, naive_lse = attention_ref(q[:, rows], k, v, upcast=False)
        assert_close_by_rule(out[:, rows], ref, naive, f"full rows {start}+ out")
        assert_close_by_rule(lse[:, :, rows], ref_lse, naive_lse, f"full rows {start}+ lse")
    del out, lse

    # bottom-right causal: only the last seqlen_k rows (all past 2^31 elements) see keys; the backward's D, dQ and the
    # dK, dV they give come from those rows alone. Every other row: out 0, LSE -inf, dQ 0, from NaN-poisoned memory.
    leaves = _leaves(q, k, v)
    poison_allocator(q.numel() * e, nheads * seqlen_q * 4)
    out, lse = attention(*leaves, causal=True, return_lse=True)
    poison_allocator(q.numel() * e)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    out, lse = out.detach(), lse.detach()
    tail = slice(seqlen_q - seqlen_k, None)
    check_attention(out[:, tail], lse[:, :, tail], (dq[:, tail], dk, dv), q[:, tail], k, v, dout[:, tail],
                    "causal tail rows", causal=True)
    head = slice(0, seqlen_q - seqlen_k)
    for name, t in (("out", out[:, head]), ("dq", dq[:, head])):
        if torch.count_nonzero(t).item() != 0:
            raise AssertionError(f"{name}: rows that see no key are not exactly 0")
    if not torch.isneginf(lse[:, :, head]).all():
        raise AssertionError("lse: rows that see no key are not -inf")


def test_query_rows_beyond_int32_in_one_sequence():
    """FA (NATTEN #347, MSLK #303): one sequence of 2^21 + 300 queries x 8 heads x 128 against 300 keys: query rows past
    2^21 start beyond 2^31 elements of q, out, dO and dQ (4 GiB each) within one batch element. Every row over all keys:
    out finite, out and LSE of rows near the start, the middle and the end by the rule; then bottom-right causal, where only the last
    300 rows (past 2^31 elements) see keys: their out, LSE, dQ and the dK, dV they make by the rule, every other row out
    0, LSE -inf, dQ 0. About 25 GiB at the peak (the causal backward)."""
    _releasing_memory(_query_rows_beyond_int32)


# ------------------------------------------------------------- FB: v's head_dim at every width below q's kernel (mirror)

# (head_dim, head_dim_v): v narrow beside q, k of 128 / 256 at widths off every 16 / 32 / 64 column granularity (FA4's
# failing (128, 96), (128, 8), (128, 40), ...), and the mirror (q, k narrow beside a wide v).
V_WIDTH_PAIRS = [(128, 8), (128, 24), (128, 48), (128, 80), (128, 96), (128, 112), (128, 120), (256, 8), (256, 136),
                 (256, 200), (8, 128), (96, 128), (120, 128), (24, 256), (200, 256)]


@pytest.mark.parametrize("api", ["dense", "varlen"])
@pytest.mark.parametrize("head_dim,head_dim_v", V_WIDTH_PAIRS, ids=[f"{d}-{dv}" for d, dv in V_WIDTH_PAIRS])
def test_head_dim_v_at_every_width_of_the_kernel(head_dim, head_dim_v, api):
    """FB (flash-attention #2552, aotriton #162): head_dim_v != head_dim where the narrower one is off the column
    granularities a kernel may take from the other (multiples of 16, 32, 64), run on the kernels of the larger, so that
    out / dO / v / dV (or q / k / dQ / dK) use fewer columns than the kernel's width. Dense: GQA 6/2, causal, 203 x 141,
    memory NaN-poisoned before each pass; varlen: gpu_helpers.check_varlen (five sequences, empty ones on either side,
    GQA 4/2, causal). Out, LSE, dQ, dK, dV by the rule."""
    dtype = built_dtype(max(head_dim, head_dim_v))
    name = f"{head_dim}/{head_dim_v}"
    if api == "varlen":
        check_varlen(head_dim, head_dim_v, 2, dtype, name, causal=True)
        return
    q, k, v, dout = attention_inputs(2, 203, 141, 6, 2, head_dim, dtype, head_dim_v=head_dim_v)
    out, lse, grads = run_attention(q, k, v, dout, causal=True)
    check_attention(out, lse, grads, q, k, v, dout, name, causal=True)
