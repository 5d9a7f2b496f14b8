"""A tenth round of GPU tests modelled on bug reports filed against other attention kernels and the PyTorch machinery
around them, for kinds of fault the earlier rounds (tests/test_bug_reports_gpu.py ... _ninth_gpu.py) do not exercise:

- BR: a row's running maximum that creeps upward by less than the conditional-rescale threshold (2^8 in P) at every key
  block, and far past float32's exponent range in total, in the order the forward visits the blocks (ROCm
  rocm-libraries PR 7194 and MSLK PR 242: "running-max drift causes exp2 overflow" on long sequences; tilelang PR
  1148: a running maximum taken from the current block only);
- BS: torch.use_deterministic_algorithms switched between calls of a torch.compile'd function, and between a compiled
  forward and its backward (PyTorch issue 113707, PR 114780; torchtitan PR 1808);
- BT: NaN in one batch element or one head must stay there: a partial tile loading the rows or columns that follow a
  tensor's (batch, head) slice in memory turns 0 x NaN into NaN in another lane (SageAttention PR 376, aiter PR 4245,
  PyTorch issue 101967);
- BU: peak memory of a forward and backward with packed documents and a window, and of attention_varlen with one long
  and hundreds of short sequences, stays linear in the tokens: no seqlen x seqlen mask and nothing of batch x
  max_seqlen (PyTorch issue 134756, nanochat issue 825).

The CPU part (BS with the ops replaced by CPU stand-ins, and BU's check that the Python layer builds no tensor of
seqlen x seqlen or batch x max_seqlen elements) is tests/test_bug_reports_tenth_cpu.py. Every numeric result is checked
by the rule of DESIGN.md §3 (float32 reference, the same reference in the input dtype as the yardstick). Skipped, with
the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build lacks a head_dim /
dtype (``require_built``, ``built_dtype``)."""

import math

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.interface import kernel_head_dim
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, local_mask
from gpu_helpers import BWD_SEQLEN_Q_ROUNDING, GRAD_NAMES, attention_inputs, bits, built_dtype, check_attention
from gpu_helpers import check_attention_varlen, cu_seqlens, poison_allocator, randn, require_built, run_attention

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]


def _leaves(*tensors):
    return [t.detach().requires_grad_(True) for t in tensors]


# ------------------------------------------------------------- BR: a running maximum creeping under the threshold

_RESCALE_THRESHOLD_LOG2 = 8.0  # csrc/flash/common/softmax.hpp kRescaleThresholdLog2
_RAMP_LOG2_PER_KEY = 5.0 / 128  # the scores rise 5 log2 units per 128 keys (the widest key block), 160 over 4100 keys
_CREEP_CASES = {
    "default_scale": {},
    "scale2_causal": {"softmax_scale": 2.0, "causal": True},
    "softcap200": {"softcap": 200.0},
}


def _log2_scores(q, k, head_dim, opts):
    """float64 scores in the forward's exp2 domain, (batch, nheads, seqlen_q, seqlen_k), -inf where masked."""
    scale = opts.get("softmax_scale", head_dim**-0.5)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    cap = opts.get("softcap", 0.0)
    if cap > 0:
        s = cap * torch.tanh(s / cap)
    if opts.get("causal", False):
        s = s.masked_fill(~local_mask(q.shape[1], k.shape[1], causal=True, device=q.device), float("-inf"))
    return s * math.log2(math.e)


# https://github.com/ROCm/rocm-libraries/pull/7194 and https://github.com/meta-pytorch/MSLK/pull/242 (conditional O
# rescaling, FlashAttention-4's threshold: P was left in the new maximum's frame when the rescale was skipped;
# "running-max drift causes exp2 overflow" on long sequences), https://github.com/tile-ai/tilelang/pull/1148 (the
# running maximum taken from the current block alone instead of the maximum of the old and the new)
@pytest.mark.parametrize("case", list(_CREEP_CASES))
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_running_maximum_creeping_under_the_rescale_threshold(dtype, head_dim, case):
    """The forward keeps a row's maximum until a key block raises it by more than 2^8 in P (kernel widths >= 96; 64
    rescales at every block). A bug that compares each block with the previous block's maximum instead of the one P is
    taken against, or that leaves P in the new maximum's frame after a skipped rescale, is invisible on random data,
    whose maxima settle after a few blocks. Here key j's first feature is a ramp and every query row's first feature is
    +4 (even rows) or -4 (odd rows), the other features small noise: odd rows' scores rise by 5 log2 units per 128 keys
    toward key 0 (the forward visits the last block first, so their maximum creeps up at every block, by 160 units in
    all: a P never rescaled would pass float32's 2^128), even rows' scores fall the same way (the maximum is in the
    first block visited; a running maximum replaced by each block's own maximum would rescale O by 2^160). 130 x 4100
    keys, full, causal at softmax_scale 2 (the threshold must be applied to scaled scores), softcap 200 (the online
    maximum of capped scores). The construction is asserted from the rounded inputs; out and LSE by the rule."""
    require_built(head_dim, dtype)
    opts = _CREEP_CASES[case]
    batch, seqlen_q, seqlen_k, nheads = 1, 130, 4100, 2
    scale = opts.get("softmax_scale", head_dim**-0.5)
    amp, noise = 4.0, 0.1  # noise: standard deviation of the scores' random part, natural units
    ramp = torch.arange(seqlen_k, device="cuda", dtype=torch.float64) * (
        math.log(2) * _RAMP_LOG2_PER_KEY / (scale * amp))
    sign = 1.0 - 2.0 * (torch.arange(seqlen_q, device="cuda") % 2).double()
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device="cuda", dtype=torch.float64)
    q *= noise / (scale * math.sqrt(head_dim - 1))
    k = torch.randn(batch, seqlen_k, nheads, head_dim, device="cuda", dtype=torch.float64)
    q[..., 0] = amp * sign[None, :, None]
    k[..., 0] = ramp[None, :, None]
    q, k = q.to(dtype), k.to(dtype)
    v = randn(batch, seqlen_k, nheads, head_dim, dtype=dtype)

    s2 = _log2_scores(q, k, head_dim, opts)
    # the running maximum after the forward has visited keys j.. (last block first): suffix maxima
    running = torch.flip(torch.cummax(torch.flip(s2, [-1]), dim=-1).values, [-1])
    steps = running[..., :-128] - running[..., 128:]
    steps = steps[torch.isfinite(steps)]
    assert steps.max().item() < _RESCALE_THRESHOLD_LOG2 - 1, "construction: 128 keys raise a row's maximum by 2^7"
    last = torch.full((seqlen_q,), seqlen_k - 1, device="cuda")
    if opts.get("causal", False):
        last = torch.arange(seqlen_q, device="cuda") + seqlen_k - seqlen_q
    first_block = running.gather(-1, (last - 127).expand(*running.shape[:2], -1).unsqueeze(-1)).squeeze(-1)
    creep = (running[..., 0] - first_block)[:, :, 1::2]
    assert creep.min().item() > 130, f"construction: odd rows' maxima creep by only {creep.min().item():.1f}"
    fall = (s2.amax(-1) - s2[..., :128].amax(-1))[:, :, 0::2]
    assert fall.min().item() > 130, f"construction: even rows' last-visited block is only {fall.min().item():.1f} down"

    poison_allocator(q.numel() * q.element_size(), batch * nheads * seqlen_q * 4)
    out, lse = attention(q, k, v, return_lse=True, **opts)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), f"{case}: non-finite out or LSE"
    ref, ref_lse = attention_ref(q, k, v, upcast=True, **opts)
    naive, naive_lse = attention_ref(q, k, v, upcast=False, **opts)
    assert_close_by_rule(out, ref, naive, f"{case} out")
    assert_close_by_rule(lse, ref_lse, naive_lse, f"{case} lse")


# --------------------------------------------------------- BS: the deterministic mode switched around torch.compile


# https://github.com/pytorch/pytorch/issues/113707 ("torch.compile doesnt respect use_determistic_algorithms during
# the backward()"), https://github.com/pytorch/pytorch/pull/114780 (a compiled backward run in another mode than its
# forward), https://github.com/pytorch/torchtitan/pull/1808 (compiled FlexAttention not deterministic although
# torch.use_deterministic_algorithms(True) was set)
def test_compiled_call_follows_the_deterministic_mode():
    """The library reads torch.are_deterministic_algorithms_enabled() in the Python call (the forward's choice holds
    for its backward). Under torch.compile that read happens once, at trace time: a graph traced with the mode off
    must not serve a call made with it on. One function (dense GQA 8/2 causal, 700 x 1500, and attention_varlen with a
    window over sequences of 300 x 900, 0 x 77, 513 x 600), compiled (fullgraph, aot_eager: dynamo's guards and
    AOTAutograd's compiled backward), called with the mode off, then on, then on for the forward and off for the
    backward: with the forward under the mode, the compiled call's out, LSE, dQ, dK, dV are bitwise those of the eager
    deterministic call (the fp32 sums of dQ and of the GQA dK/dV of 12 key blocks, added in whatever order they finish
    without the mode, would differ in their last bits); every compiled result by the rule."""
    dtype = built_dtype(128)
    q, k, v, dout = attention_inputs(2, 700, 1500, 8, 2, 128, dtype)
    lq, lk = [300, 0, 513], [900, 77, 600]
    vq, vdout = randn(sum(lq), 8, 128, dtype=dtype), randn(sum(lq), 8, 128, dtype=dtype)
    vk, vv = randn(sum(lk), 2, 128, dtype=dtype), randn(sum(lk), 2, 128, dtype=dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    varlen_opts = dict(window_size=(256, 64))

    def step(q, k, v, vq, vk, vv, cu_q, cu_k):
        out, lse = attention(q, k, v, causal=True, return_lse=True)
        vout, vlse = attention_varlen(vq, vk, vv, cu_q, cu_k, 513, 900, return_lse=True, **varlen_opts)
        return out, lse, vout, vlse

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)

    def run(fn, mode_fwd, mode_bwd):
        leaves = _leaves(q, k, v, vq, vk, vv)
        try:
            torch.use_deterministic_algorithms(mode_fwd)
            outs = fn(*leaves, cu_q, cu_k)
            torch.use_deterministic_algorithms(mode_bwd)
            grads = torch.autograd.grad([outs[0], outs[2]], leaves, [dout, vdout])
        finally:
            torch.use_deterministic_algorithms(False)
        torch.cuda.synchronize()
        return [t.detach() for t in outs], grads

    def check(outs, grads, name):
        check_attention(outs[0], outs[1], grads[:3], q, k, v, dout, f"{name} dense", causal=True)
        check_attention_varlen(outs[2], outs[3], grads[3:], vq, vk, vv, vdout, cu_q, cu_k, f"{name} varlen",
                               **varlen_opts)

    names = ("out", "lse", "varlen out", "varlen lse") + GRAD_NAMES + tuple(f"varlen {n}" for n in GRAD_NAMES)
    check(*run(compiled, False, False), "mode off")
    eager = [run(step, True, True) for _ in range(2)]
    for name, a, b in zip(names, eager[0][0] + list(eager[0][1]), eager[1][0] + list(eager[1][1])):
        assert torch.equal(bits(a), bits(b)), f"construction: the eager deterministic {name} is not repeatable"
    for mode_bwd in (True, False):
        outs, grads = run(compiled, True, mode_bwd)
        for name, a, b in zip(names, outs + list(grads), eager[0][0] + list(eager[0][1])):
            assert torch.equal(bits(a), bits(b)), (
                f"compiled call, mode on for the forward and {mode_bwd} for the backward: {name} is not the eager "
                "deterministic result (a graph traced with the mode off served the call?)")
    check(outs, grads, "mode on")


# ---------------------------------------------------------- BT: a non-finite batch element or head stays in its lane


# https://github.com/thu-ml/SageAttention/pull/376 (tail tiles left with stale shared memory: masked, yet 0 x NaN
# reached valid outputs), https://github.com/ROCm/aiter/pull/4245 (an out-of-range page folded to another slot whose
# NaN leaked through P = 0), https://github.com/pytorch/pytorch/issues/101967 (NaN in masked-out positions made SDPA's
# output NaN)
@pytest.mark.parametrize("layout", ["mha", "gqa"])
@pytest.mark.parametrize("head_dim", [40, 64, 72, 128, 136, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_non_finite_batch_element_or_head_stays_in_its_lane(dtype, head_dim, layout):
    """Each (batch element, head) is its own problem (DESIGN.md §1); a sample whose activations overflowed must not
    touch its batch mates. Contiguous (batch, seqlen, nheads, head_dim) tensors put the first rows of batch element b +
    1 right after the last rows of b, and head h + 1's columns right after h's, so a partial tile (203 queries, 141
    keys: no tile height divides them) that loads past its slice, or a head_dim between the kernel widths (40, 72, 136)
    padded with the next head's columns, brings another lane's values in; masked or multiplied by P = 0, NaN stays NaN.
    Batch element 1 is NaN in q, k, v and dO; "mha" (3 heads, causal): head 1 of q, k, v and dO is NaN too;
    "gqa" (4 query heads on 2 K/V heads, window (50, 10) with rows that see no key, softcap 20 (bf16: the fixed
    maximum), deterministic backward): K/V head 1 is NaN. Batch elements 0 and 2, on the heads untouched (and their K/V
    heads): out, LSE, dQ, dK, dV by the rule against the reference of those lanes alone; the NaN lanes are asserted to
    hold NaN (the poison was read)."""
    require_built(head_dim, dtype)
    batch, seqlen_q, seqlen_k = 3, 203, 141
    if layout == "mha":
        nheads, nheads_k, heads_q, heads_k = 3, 3, [0, 2], [0, 2]
        opts, run_opts = dict(causal=True), {}
    else:
        nheads, nheads_k, heads_q, heads_k = 4, 2, [0, 1], [0]
        opts, run_opts = dict(window_size=(50, 10), softcap=20.0), dict(deterministic=True)
    q, k, v, dout = attention_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    poisoned = [t.clone() for t in (q, k, v, dout)]
    for t in poisoned:
        t[1] = float("nan")
    if layout == "mha":
        for t in poisoned:
            t[:, :, 1] = float("nan")
    else:
        for t in poisoned[1:3]:
            t[:, :, 1] = float("nan")
    out, lse, grads = run_attention(*poisoned, **run_opts, **opts)
    lanes = [0, 2]

    def pick(t, heads):
        return t[lanes][:, :, heads]

    assert torch.isnan(out[1]).any() and torch.isnan(grads[1][1]).any(), "construction: batch element 1 is not NaN"
    nan_heads = [1] if layout == "mha" else [2, 3]
    assert torch.isnan(out[:, :, nan_heads]).any(), "construction: the poisoned head's output is not NaN"
    dq, dk, dv = grads
    check_attention(pick(out, heads_q), lse[lanes][:, heads_q], (pick(dq, heads_q), pick(dk, heads_k),
                    pick(dv, heads_k)), pick(q, heads_q), pick(k, heads_k), pick(v, heads_k), pick(dout, heads_q),
                    f"{layout} clean lanes", **opts)


# -------------------------------------------------------------------- BU: memory linear in the tokens, not squared


def _workspace_bytes(ws_outer, rows, kernel_dim, k, nheads_k, seqlen_k, batch):
    """An upper bound of what the backward allocates besides dQ, dK, dV (csrc/api/flash_api.cpp): the fp32 dQ
    accumulator (two lanes at most), its two row vectors (LSE in log2, D), the GQA fp32 dK/dV sums and the
    deterministic mode's semaphores."""
    accum = 2 * ws_outer * rows * kernel_dim * 4
    vectors = 2 * ws_outer * rows * 4
    sums = 2 * k.numel() * 4
    semaphores = (2 * ws_outer * rows // 64 + batch * nheads_k * -(-seqlen_k // 64)) * 4
    return accum + vectors + sums + semaphores


# https://github.com/pytorch/pytorch/issues/134756 (FlexAttention: creating the mask of a 96000-token sequence, OOM)
# and https://github.com/karpathy/nanochat/issues/825 (a sliding window built as a full (Tq, Tk) mask: memory flat in
# the window, quadratic in the sequence); docs/conventions.md: varlen "work and memory grow with the number of tokens,
# not with batch x max_seqlen"
@pytest.mark.parametrize("case", ["documents", "varlen"])
def test_peak_memory_linear_in_the_tokens(case):
    """test_bwd_gpu::test_bwd_peak_memory bounds dense non-causal MHA; here the features whose masks a library could
    build in memory. "documents": one row of 32768 tokens in 4 documents, causal, window (1023, 0), MQA 4/1, the
    deterministic backward. "varlen": one sequence of 4000 tokens, 600 of 7 and 30 of 300 (631 sequences, 17200
    tokens: batch x max_seqlen is 147 times the tokens), 13 rows past the last sequence, causal, window (511, 0), MQA.
    The peak allocated over forward and backward, above what existed before, must stay within twice an upper bound of
    what they need (out, LSE, dQ, dK, dV, twice for varlen's cut and padded rows; the backward's fp32 workspaces as
    csrc/api/flash_api.cpp sizes them, varlen's with 128 rows per sequence; the document bounds), which is asserted
    to be below one boolean seqlen x seqlen mask ("documents") and one padded (batch, max_seqlen) copy of q
    ("varlen"). The first documents / sequences (and the last sequence) by the rule, against references of each alone
    (documents and sequences attend only within themselves), and the rows past the last sequence 0."""
    head_dim, nheads, nheads_k = 128, 4, 1
    dtype = built_dtype(head_dim)
    kernel_dim = kernel_head_dim(head_dim, backward=True)
    opts = dict(causal=True, window_size=(1023, 0) if case == "documents" else (511, 0))
    if case == "documents":
        lengths = [3001, 2999, 20000, 6768]
        seqlen = sum(lengths)
        q, k, v, dout = attention_inputs(1, seqlen, seqlen, nheads, nheads_k, head_dim, dtype)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None].to("cuda")
        call = dict(document_ids=ids, deterministic=True, **opts)
        rows = -(-seqlen // BWD_SEQLEN_Q_ROUNDING) * BWD_SEQLEN_Q_ROUNDING
        e = q.element_size()
        outputs = 2 * q.numel() * e + 2 * k.numel() * e + nheads * seqlen * 4  # out, dQ, dK, dV, LSE
        documents = seqlen * 2 * 4 + 8 * seqlen * 8  # the bounds, and their intermediates (int64 at most)
        need = outputs + _workspace_bytes(nheads, rows, kernel_dim, k, nheads_k, seqlen, 1) + documents
        assert 2 * need < seqlen * seqlen, "construction: the allowance holds a boolean seqlen x seqlen mask"
    else:
        lengths = [4000] + [7] * 600 + [300] * 30
        tail = 13
        total = sum(lengths) + tail
        q, k, v, dout = (t[0] for t in attention_inputs(1, total, total, nheads, nheads_k, head_dim, dtype))
        cu = cu_seqlens(lengths)
        call = dict(**opts)
        batch, longest = len(lengths), max(lengths)
        rows = -(-(total + batch * BWD_SEQLEN_Q_ROUNDING) // BWD_SEQLEN_Q_ROUNDING) * BWD_SEQLEN_Q_ROUNDING
        e = q.element_size()
        outputs = 2 * (2 * q.numel() * e + 2 * k.numel() * e + nheads * total * 4)  # cut and padded / full size
        need = outputs + _workspace_bytes(nheads, rows, kernel_dim, k, nheads_k, longest, batch)
        padded_q = batch * longest * nheads * head_dim * e
        assert 2 * need < padded_q, "construction: the allowance holds a (batch, max_seqlen) copy of q"
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    leaves = _leaves(q, k, v)
    if case == "documents":
        out, lse = attention(*leaves, return_lse=True, **call)
    else:
        out, lse = attention_varlen(*leaves, cu, cu, longest, longest, return_lse=True, **call)
    grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    mib = 2**20
    assert peak <= 2 * need, f"{case}: peak {peak / mib:.0f} MiB over forward + backward > 2 x {need / mib:.0f} MiB"
    out, lse = out.detach(), lse.detach()
    dq, dk, dv = grads
    starts = torch.tensor([0] + lengths).cumsum(0).tolist()
    if case == "documents":
        for d in (0, 1):
            a, b = starts[d], starts[d + 1]
            check_attention(out[:, a:b], lse[:, :, a:b], (dq[:, a:b], dk[:, a:b], dv[:, a:b]), q[:, a:b], k[:, a:b],
                            v[:, a:b], dout[:, a:b], f"document {d}", **opts)
    else:
        for s in (0, 1, len(lengths) - 1):
            a, b = starts[s], starts[s + 1]
            check_attention(out[None, a:b], lse[None, :, a:b], (dq[None, a:b], dk[None, a:b], dv[None, a:b]),
                            q[None, a:b], k[None, a:b], v[None, a:b], dout[None, a:b], f"sequence {s}", **opts)
        for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            rows_past = t[starts[-1]:]
            assert torch.equal(rows_past, torch.zeros_like(rows_past)), f"varlen: {name} past the sequences is not 0"
        assert torch.isneginf(lse[:, starts[-1]:]).all(), "varlen: LSE past the sequences is not -inf"
