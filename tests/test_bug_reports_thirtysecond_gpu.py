"""Thirty-second round of the bug hunt (tests/bug_report_sources.md, "Thirty-second round"), GPU part.

FY: a user's own torch.autograd.Function next to, or around, the library under torch.compile(fullgraph=True). Dynamo
traces such a Function's forward and backward into the graph (speculating both), and AOTAutograd then differentiates
the library's op inside that graph; pytorch/pytorch#159299 (FlexAttention followed by an o_proj written as a
torch.autograd.Function: under torch.compile every input gradient of the attention came back as zeros, eager was
right). The second and third cases are the pattern of ring / context-parallel attention and of FlashAttention 4's
torch.compile plan: a user Function whose forward calls the library's forward op and whose backward calls its backward
op directly (Dao-AILab/flash-attention#2154, meta-pytorch/attention-gym#73), here through the public
torch.ops.flash_attn_hopper.* ops, dense and varlen. Each case: the compiled step's out, LSE and gradients must be
the eager step's bits (deterministic backward, so that the bits are defined), the eager step must be right by the rule,
and the direct-op Functions must give the bits of attention / attention_varlen themselves. Backend "aot_eager" (dynamo
and AOTAutograd, where the reports' faults live; inductor's code generation is not this class and costs compile time).

FZ: the forward's bits must not depend on the autograd mode of the call: leaves that require grad under grad mode (a
training step), torch.no_grad(), detached inputs, torch.inference_mode() with inference tensors (a rollout or an
evaluation), deterministic=True, torch.use_deterministic_algorithms(True), return_lse=False. RL training recomputes
the log-probabilities of rollouts made in inference mode and needs them to be the same numbers ("0-diff" train /
rollout log-probs): unslothai/unsloth#1167 (model.train() and model.eval() gave different log-probs, "negative KL"),
verl-project/verl-omni#637 and NovaSky-AI/SkyRL#2201 (bitwise train / rollout consistency), marin-community/
marin#1879 (trainer and inference log-probs apart with one attention kernel), intel/intel-extension-for-pytorch#597
(outputs under no_grad differing from those with gradients enabled). Dense (GQA causal with packed documents) and
attention_varlen (a window, an empty and a one-token sequence, rows past the last sequence). Only the forward: the
backward's bits may follow deterministic=False's atomics by design.

GA: prefill / decode / chunked-prefill invariance of the forward. Row i of a causal (or sliding-window) prefill must be
the same bits as the decode call of that row alone against keys[:i+1] (dense, seqlen_q = 1), as the same rows computed
in chunks (chunked prefill: queries [0, 149) and [149, 300) against the keys up to each chunk's end, bottom-right), and
as all of these packed into one attention_varlen serving batch. A row's result is a function of its own query row and
the keys it sees; the tiles a call cuts (which rows share a tile, which key blocks the tile's mask crosses and so
which copy of the main loop runs, csrc/flash/fwd/kernel_fwd_sm90.hpp kSplitMaskLoop) must not change it.
sgl-project/sglang#25790 (FlashAttention 3 on an H100: a one-row decode and an L-row causal prefill over the same
KV gave different log-probs once kv_len >= 97 with an fp8 cache; "a bf16 control ... is bitwise identical"),
sgl-project/sglang#10645 (deterministic inference with chunked prefill needed the attention's split sizes fixed),
vllm-project/vllm#3204 (review: the same request's logits changed with continuous batching). Class AP checked batch
mates with the sequence's own shape unchanged; FK checked chunked prefill by the rule only. Head dims 96, 128,
192 (112-key blocks, with v 128) and 256 (64-key blocks), whose forward has one tile height (asserted through
fwd_block_m); rows at every block edge (0, 1, 63, 64, 111, 112, 127, 128, 191, 192, 223, 224, 255, 256, 299 of
300).
test_prefill_rows_equal_decode_and_chunks_fixed_max_softcap runs the same with bf16 and softcap 20, the fixed-maximum
softcap (softcap <= 30 in bf16), whose rounding correction (OnlineSoftmax::add_rounding) was applied, until session 65,
on every row of a tile whose mask crosses the key block: row 127 (and 255) of a prefill got its diagonal block's
correction and its decode twin, whose last block is whole, did not, and chunk [149, 300) put rows 256-276 in a tile
whose block 1 is crossed (the helper's prediction from the code; tests/bug_report_sources.md). The correction is now
added only for the rows whose own mask cuts the block (csrc/flash/common/softmax.hpp, 0061d2a).
test_exact_pass_rows_equal_their_decode_calls: the same property for rows whose scores are large enough for the
forward's exact pass (csrc/flash/fwd/exact_rows_sm90.hpp), which recomputed rows between 2^15 and 2^16 (log2 units)
only when another row of the call passed 2^16 (session 65's review; per row since session 66, 73e371d).
test_head_dim_64_tile_heights_give_the_same_bits: head_dim 64's two tile heights, each forced in a child process.
test_scores_past_the_log2_range_follow_the_reference: bf16 scores that overflow once scaled to log2 units (NaN in
every call since 98ccfd5, which passed on an H100 in session 67; right by the rule since session 67's exact pass in
natural units, which passed there too). test_gradients_past_the_log2_range_are_nan_never_zero: the backward of such a
row, NaN where it was silently 0 (session 67; passed on an H100 in session 68).
What ran (session 66, an H100; benchmarks/results/2026-12-07_session66/): on 0061d2a's kernels the first 11 passed and
the exact-pass cases failed (row 'band +' alone: 125 / 102 elements of out differ); on 73e371d's kernels all 13
passed; the fixed-maximum case also failed, as predicted, on the kernels before 0061d2a; the tile-height case passed
on the two builds that sum a row in the same order on both heights (it was written after the 0061d2a / 73e371d runs;
a reviewer read from the code that it fails on them).

Inputs are Gaussian from fixed seeds (never zeros). Skipped, with the reason, without an sm90 GPU and the built
extension (conftest.py), and per test when the build lacks a head_dim / dtype.
tests/test_bug_reports_thirtysecond_cpu.py checks GA's premises (the key blocks each call's tiles visit and mask,
through tests/test_mask_math_cpu.py's port of mask.hpp; the serving batch's packing), FY's chain rule, and runs FY's
and FZ's bodies through the library's Python layer with tests/cpu_stand_ins.py's kernels where the extension is
built."""

import math
import os
import subprocess
import sys

import pytest
import torch

import flash_attn_hopper
import gpu_helpers
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_varlen_ref
from gpu_helpers import assert_same_bits, check_attention, check_attention_varlen, require_built

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"  # (the CPU run of FY's and FZ's bodies sets "cpu" and stands in for the ops)
FP16, BF16 = torch.float16, torch.bfloat16
BATCH, NHEADS, NHEADS_K = 2, 4, 2


def poison(q, v):
    """NaN into the caching allocator at the sizes the next forward or backward allocates."""
    gpu_helpers.poison_attention_memory(q, v)


def gaussian(shape, g, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def generator(name):
    return gpu_helpers.seeded_generator(name)


def cu_seqlens(lengths):
    return gpu_helpers.cu_seqlens(lengths, DEVICE)


# ------------------------------------------------ FY: a user's torch.autograd.Function under torch.compile

FY_BACKEND = "aot_eager"
FY_CASES = ("user_function_downstream", "direct_ops", "direct_varlen_ops")
FY_LENGTHS = (130, 1, 77)  # the varlen case's sequences (self-attention)


class _TimesTwo(torch.autograd.Function):
    """A user's Function (pytorch/pytorch#159299's o_proj stood in by an exact map): x * 2 forward, g * 2 backward."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def _scale(head_dim):
    return 1.0 / math.sqrt(head_dim)  # attention's default (interface._check_scale)


class _DirectAttention(torch.autograd.Function):
    """Ring-attention style: the library's forward and backward ops called directly, causal, deterministic."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = torch.ops.flash_attn_hopper.fwd.default(q, k, v, _scale(q.shape[-1]), True, -1, 0, 0.0, True, None)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.flash_attn_hopper.bwd.default(dout, q, k, v, out, lse, dlse, _scale(q.shape[-1]), True,
                                                             -1, 0, 0.0, True, None)
        return dq, dk, dv


class _DirectVarlenAttention(torch.autograd.Function):
    """The same through the varlen ops (cu_seqlens shared by q and k, maxima as Python ints)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len):
        out, lse = torch.ops.flash_attn_hopper.fwd_varlen.default(q, k, v, cu, cu, max_len, max_len,
                                                                  _scale(q.shape[-1]), True, -1, 0, 0.0, True)
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.max_len = max_len
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = torch.ops.flash_attn_hopper.bwd_varlen.default(dout, q, k, v, out, lse, dlse, cu, cu, ctx.max_len,
                                                                    ctx.max_len, _scale(q.shape[-1]), True, -1, 0,
                                                                    0.0, True)
        return dq, dk, dv, None, None


def _fy_step(case, cu=None):
    """(step(q, k, v) -> (out, lse), the library's own call for the same problem, or None)."""
    if case == "user_function_downstream":
        def step(q, k, v):
            out, lse = flash_attn_hopper.attention(_TimesTwo.apply(q), k, v, causal=True, return_lse=True,
                                                   deterministic=True)
            return _TimesTwo.apply(out), lse
        return step, None
    if case == "direct_ops":
        def own(q, k, v):
            return flash_attn_hopper.attention(q, k, v, causal=True, return_lse=True, deterministic=True)
        return _DirectAttention.apply, own
    max_len = max(FY_LENGTHS)

    def step(q, k, v):
        return _DirectVarlenAttention.apply(q, k, v, cu, max_len)

    def own(q, k, v):
        return flash_attn_hopper.attention_varlen(q, k, v, cu, cu, max_len, max_len, causal=True, return_lse=True,
                                                  deterministic=True)
    return step, own


def _fy_run(step, q, k, v, dout, dlse):
    """(out, lse, (dq, dk, dv)) of step on fresh leaves, from NaN-poisoned memory; the loss uses out and the LSE."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    poison(q, v)
    out, lse = step(*leaves)
    poison(q, v)
    grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    return out.detach(), lse.detach(), grads


@pytest.mark.parametrize("case", FY_CASES)
def test_user_autograd_function_under_torch_compile(case):
    """pytorch/pytorch#159299, Dao-AILab/flash-attention#2154, meta-pytorch/attention-gym#73: a user's
    torch.autograd.Function after the attention (and before it, on q), or wrapping the library's ops directly, compiled
    with fullgraph=True: out, LSE, dQ, dK, dV the eager step's bits (zeros, or a gradient that skipped the user's
    backward, differ), the eager step right by the rule, the direct-op Functions the bits of the library's own call."""
    head_dim, dtype = 128, BF16
    require_built(head_dim, dtype)
    g = generator(f"fy-{case}")
    if case == "direct_varlen_ops":
        total = sum(FY_LENGTHS)
        q = gaussian((total, NHEADS, head_dim), g, dtype)
        k, v = (gaussian((total, NHEADS_K, head_dim), g, dtype) for _ in range(2))
        dout = gaussian((total, NHEADS, head_dim), g, dtype)
        dlse = gaussian((NHEADS, total), g, torch.float32)
        cu = cu_seqlens(list(FY_LENGTHS))
    else:
        q = gaussian((BATCH, 203, NHEADS, head_dim), g, dtype)
        k, v = (gaussian((BATCH, 203, NHEADS_K, head_dim), g, dtype) for _ in range(2))
        dout = gaussian((BATCH, 203, NHEADS, head_dim), g, dtype)
        dlse = gaussian((BATCH, NHEADS, 203), g, torch.float32)
        cu = None
    step, own = _fy_step(case, cu)
    eager = _fy_run(step, q, k, v, dout, dlse)
    torch._dynamo.reset()
    try:
        compiled = _fy_run(torch.compile(step, backend=FY_BACKEND, fullgraph=True), q, k, v, dout, dlse)
    finally:
        torch._dynamo.reset()
    names = ("out", "lse", "dq", "dk", "dv")
    for name, a, b in zip(names, (*eager[:2], *eager[2]), (*compiled[:2], *compiled[2])):
        assert_same_bits(b, a, f"{case}: compiled {name}", " (the compiled step must run the eager step's ops)")
    if own is not None:
        ours = _fy_run(own, q, k, v, dout, dlse)
        for name, a, b in zip(names, (*ours[:2], *ours[2]), (*eager[:2], *eager[2])):
            assert_same_bits(b, a, f"{case}: the user Function's {name}", " (the same ops on the same arguments)")
    out, lse, grads = eager
    if case == "user_function_downstream":
        # y = 2 A(2q): A = y / 2 with input 2q and output gradient 2 dout; dL/dq = 2 dA/d(2q) (all exact in bf16)
        check_attention(out / 2, lse, (grads[0] / 2, grads[1], grads[2]), q * 2, k, v, dout * 2, case, dlse=dlse,
                        causal=True)
    elif case == "direct_ops":
        check_attention(out, lse, grads, q, k, v, dout, case, dlse=dlse, causal=True)
    else:
        check_attention_varlen(out, lse, grads, q, k, v, dout, cu, cu, case, dlse=dlse, causal=True)


# ------------------------------------------------ FZ: the forward's bits whatever the autograd mode

FZ_MODES = ("no_grad", "detached", "inference_mode", "deterministic", "torch_deterministic_mode", "out_only")
FZ_VARLEN = ((130, 1, 0, 77), (200, 64, 33, 77), 5, 3)  # lengths q, lengths k, rows past the last sequence in q, in k


def _fz_inputs(api, g):
    """(q, k, v, extra, options, head_dim, dtype): dense GQA causal with two documents per row (extra: document_ids), or
    varlen with a window (extra: (cu_q, cu_k, max_q, max_k))."""
    if api == "dense":
        head_dim, dtype, seqlen = 128, FP16, 257
        q = gaussian((BATCH, seqlen, NHEADS, head_dim), g, dtype)
        k, v = (gaussian((BATCH, seqlen, NHEADS_K, head_dim), g, dtype) for _ in range(2))
        ids = torch.zeros(BATCH, seqlen, dtype=torch.int32)
        ids[0, 100:], ids[1, 190:] = 1, 1
        ids[1, :37] = 2  # a third document at the start of row 1
        return q, k, v, ids.to(DEVICE), dict(causal=True), head_dim, dtype
    head_dim, dtype = 64, BF16
    lengths_q, lengths_k, tail_q, tail_k = FZ_VARLEN
    q = gaussian((sum(lengths_q) + tail_q, NHEADS, head_dim), g, dtype)
    k, v = (gaussian((sum(lengths_k) + tail_k, NHEADS_K, head_dim), g, dtype) for _ in range(2))
    extra = (cu_seqlens(list(lengths_q)), cu_seqlens(list(lengths_k)), max(lengths_q), max(lengths_k))
    return q, k, v, extra, dict(window_size=(50, 10)), head_dim, dtype


def _fz_call(api, q, k, v, extra, opts, return_lse=True, **kw):
    if api == "dense":
        return flash_attn_hopper.attention(q, k, v, return_lse=return_lse, document_ids=extra, **opts, **kw)
    return flash_attn_hopper.attention_varlen(q, k, v, *extra, return_lse=return_lse, **opts, **kw)


def _fz_mode(api, mode, q, k, v, extra, opts):
    """(out, lse or None) of the call in `mode`; inference_mode's results are cloned out of inference mode."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    if mode == "no_grad":
        with torch.no_grad():
            return _fz_call(api, *leaves, extra, opts)
    if mode == "detached":
        return _fz_call(api, q.detach(), k.detach(), v.detach(), extra, opts)
    if mode == "inference_mode":
        with torch.inference_mode():
            inputs = [t.clone() for t in (q, k, v)]
            extra_i = extra.clone() if api == "dense" else (extra[0].clone(), extra[1].clone(), *extra[2:])
            out, lse = _fz_call(api, *inputs, extra_i, opts)
            if not out.is_inference():
                raise AssertionError(f"{api}: the inference-mode call did not run on inference tensors")
        return out.clone(), lse.clone()  # (a clone outside inference mode is a normal tensor)
    if mode == "deterministic":
        return _fz_call(api, *leaves, extra, opts, deterministic=True)
    if mode == "torch_deterministic_mode":
        enabled = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            return _fz_call(api, *leaves, extra, opts)
        finally:
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    if mode == "out_only":
        return _fz_call(api, *leaves, extra, opts, return_lse=False), None
    raise ValueError(mode)


@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_forward_bits_do_not_depend_on_the_autograd_mode(api):
    """unslothai/unsloth#1167, verl-project/verl-omni#637, NovaSky-AI/SkyRL#2201, marin-community/marin#1879,
    intel/intel-extension-for-pytorch#597: the training call (leaves that require grad, grad mode on) right by the rule;
    its out and LSE the bits of the same call under no_grad, on detached inputs, under inference_mode on inference
    tensors, with deterministic=True, under torch.use_deterministic_algorithms(True), and (out) with
    return_lse=False."""
    g = generator(f"fz-{api}")
    q, k, v, extra, opts, head_dim, dtype = _fz_inputs(api, g)
    require_built(head_dim, dtype)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    poison(q, v)
    with torch.enable_grad():
        out, lse = _fz_call(api, *leaves, extra, opts)
    if out.grad_fn is None:
        raise AssertionError(f"{api}: the training call recorded no graph")
    out, lse = out.detach(), lse.detach()
    if api == "dense":
        ref, ref_lse = attention_ref(q, k, v, document_ids=extra, upcast=True, **opts)
        naive, naive_lse = attention_ref(q, k, v, document_ids=extra, upcast=False, **opts)
    else:
        ref, ref_lse = attention_varlen_ref(q, k, v, *extra[:2], upcast=True, **opts)
        naive, naive_lse = attention_varlen_ref(q, k, v, *extra[:2], upcast=False, **opts)
    assert_close_by_rule(out, ref, naive, f"{api} training out")
    assert_close_by_rule(lse, ref_lse, naive_lse, f"{api} training lse")
    for mode in FZ_MODES:
        poison(q, v)
        other_out, other_lse = _fz_mode(api, mode, q, k, v, extra, opts)
        why = " (the forward's bits must not follow the autograd mode: train / rollout log-probs)"
        assert_same_bits(other_out.detach(), out, f"{api} {mode} out", why)
        if other_lse is not None:
            assert_same_bits(other_lse.detach(), lse, f"{api} {mode} lse", why)


# ------------------------------------------------ GA: prefill rows = decode calls = chunked prefill (bitwise)

GA_SEQLEN = 300
GA_ROWS = (0, 1, 63, 64, 111, 112, 127, 128, 191, 192, 223, 224, 255, 256, 299)  # every edge of 64-/112-/128-key blocks
GA_CHUNKS = ((0, 149), (149, 300))
GA_CONFIGS = {  # name -> (head_dim, head_dim_v, dtype, options)
    "d128-fp16-causal": (128, 128, FP16, dict(causal=True)),
    "d96-bf16-window": (96, 96, BF16, dict(window_size=(150, 0))),
    "d128-bf16-window-softcap50": (128, 128, BF16, dict(window_size=(200, 0), softcap=50.0)),  # the online softcap
    "d192v128-fp16-causal": (192, 128, FP16, dict(causal=True)),
    "d256-bf16-causal": (256, 256, BF16, dict(causal=True)),
}
GA_FIXED_MAX = (128, 128, BF16, dict(causal=True, softcap=20.0))  # bf16 and softcap <= 30: the fixed maximum


def ga_segments():
    """The serving batch's sequences, (batch element, first query row, end row): every decode twin of GA_ROWS, then the
    chunks, per batch element; each sees keys [0, end)."""
    return [(b, s, e) for b in range(BATCH) for s, e in [(i, i + 1) for i in GA_ROWS] + list(GA_CHUNKS)]


def ga_serving_batch(q, k, v):
    """(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of ga_segments() packed for attention_varlen,
    in the order of ga_segments() (each sequence's keys copied from the dense rows: a serving engine's KV cache)."""
    segments = ga_segments()
    qv = torch.cat([q[b, s:e] for b, s, e in segments])
    kv = torch.cat([k[b, :e] for b, _, e in segments])
    vv = torch.cat([v[b, :e] for b, _, e in segments])
    lengths_q, lengths_k = [e - s for _, s, e in segments], [e for _, _, e in segments]
    return (qv, kv, vv, gpu_helpers.cu_seqlens(lengths_q, q.device), gpu_helpers.cu_seqlens(lengths_k, q.device),
            max(lengths_q), max(lengths_k))


def _window_args(opts):
    left, right = opts.get("window_size", (-1, -1))
    return (left, 0) if opts.get("causal", False) else (left, right)


def _tile_height(head_dim, head_dim_v, batch, seqlen_q, seqlen_k, opts):
    left, right = _window_args(opts)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    return torch.ops.flash_attn_hopper.fwd_block_m(head_dim, head_dim_v, batch, NHEADS, seqlen_q, seqlen_k,
                                                   opts.get("causal", False), left, right, sms)


def _prefill_rows_equal_decode_and_chunks(name, head_dim, head_dim_v, dtype, opts):
    require_built(max(head_dim, head_dim_v), dtype)
    g = generator(f"ga-{name}")
    q = gaussian((BATCH, GA_SEQLEN, NHEADS, head_dim), g, dtype)
    k = gaussian((BATCH, GA_SEQLEN, NHEADS_K, head_dim), g, dtype)
    v = gaussian((BATCH, GA_SEQLEN, NHEADS_K, head_dim_v), g, dtype)
    poison(q, v)
    out, lse = flash_attn_hopper.attention(q, k, v, return_lse=True, **opts)
    ref, ref_lse = attention_ref(q, k, v, upcast=True, **opts)
    naive, naive_lse = attention_ref(q, k, v, upcast=False, **opts)
    assert_close_by_rule(out, ref, naive, f"{name}: prefill out")
    assert_close_by_rule(lse, ref_lse, naive_lse, f"{name}: prefill lse")

    qv, kv, vv, cu_q, cu_k, max_q, max_k = ga_serving_batch(q, k, v)
    heights = {"prefill": _tile_height(head_dim, head_dim_v, BATCH, GA_SEQLEN, GA_SEQLEN, opts),
               "serving batch": _tile_height(head_dim, head_dim_v, cu_q.numel() - 1, max_q, max_k, opts)}
    heights.update({f"decode {i}": _tile_height(head_dim, head_dim_v, BATCH, 1, i + 1, opts) for i in GA_ROWS})
    heights.update({f"chunk {s}-{e}": _tile_height(head_dim, head_dim_v, BATCH, e - s, e, opts) for s, e in GA_CHUNKS})
    if len(set(heights.values())) != 1:
        raise AssertionError(f"{name}: the calls run different tile heights {heights}: this class needs one")
    why = " (a row's bits must not depend on how the call cuts the queries into tiles)"
    for i in GA_ROWS:  # decode: the row alone against the keys up to it
        o, o_lse = flash_attn_hopper.attention(q[:, i:i + 1], k[:, :i + 1], v[:, :i + 1], return_lse=True, **opts)
        assert_same_bits(o, out[:, i:i + 1], f"{name}: decode of row {i}: out", why)
        assert_same_bits(o_lse, lse[:, :, i:i + 1], f"{name}: decode of row {i}: lse", why)
    for s, e in GA_CHUNKS:  # chunked prefill
        o, o_lse = flash_attn_hopper.attention(q[:, s:e], k[:, :e], v[:, :e], return_lse=True, **opts)
        assert_same_bits(o, out[:, s:e], f"{name}: chunk [{s}, {e}): out", why)
        assert_same_bits(o_lse, lse[:, :, s:e], f"{name}: chunk [{s}, {e}): lse", why)
    o, o_lse = flash_attn_hopper.attention_varlen(qv, kv, vv, cu_q, cu_k, max_q, max_k, return_lse=True, **opts)
    starts = cu_q.tolist()
    for j, (b, s, e) in enumerate(ga_segments()):
        rows = slice(starts[j], starts[j + 1])
        assert_same_bits(o[rows], out[b, s:e], f"{name}: serving batch, element {b} rows [{s}, {e}): out", why)
        assert_same_bits(o_lse[:, rows], lse[b, :, s:e], f"{name}: serving batch, element {b} rows [{s}, {e}): lse",
                         why)


@pytest.mark.parametrize("config", list(GA_CONFIGS))
def test_prefill_rows_equal_decode_and_chunks(config):
    """sgl-project/sglang#25790, sgl-project/sglang#10645, vllm-project/vllm#3204: every row of GA_ROWS of a causal or
    sliding-window prefill (300 x 300, batch 2, GQA 4/2; the prefill by the rule) the same out and LSE bits as its
    decode call, as the chunks [0, 149) and [149, 300), and as all of them in one attention_varlen serving batch."""
    head_dim, head_dim_v, dtype, opts = GA_CONFIGS[config]
    _prefill_rows_equal_decode_and_chunks(config, head_dim, head_dim_v, dtype, opts)


def test_prefill_rows_equal_decode_and_chunks_fixed_max_softcap():
    """The same with bf16 and softcap 20, the fixed-maximum softcap (tests/bug_report_sources.md, "Thirty-second
    round"). OnlineSoftmax::add_rounding corrected the row sums on the key blocks the tile's mask crosses, so row 127's
    diagonal block was corrected in the prefill (rows 0-126 of its tile are masked there) and not in its decode call (a
    whole last block), and rows 256-276 got block 1's correction in chunk [149, 300) and not in the one-shot prefill:
    within DESIGN.md section 3's rule, but not class AP's property (a row's bits depend only on its sequence). Now a
    row is corrected only where its own mask cuts the block."""
    head_dim, head_dim_v, dtype, opts = GA_FIXED_MAX
    _prefill_rows_equal_decode_and_chunks("d128-bf16-causal-softcap20", head_dim, head_dim_v, dtype, opts)


# GA in the forward's exact pass (session 65's review). Scores are 4 * q[0] (every key's first element is 4) plus a
# spread of a few units from the other elements, so the top keys share a row's weight. kExactRowsLimitLog2 is 2^16.
GA_EXACT_KEYS = 300
GA_EXACT_ROWS = {  # name -> q[0]: scaled maximum M = 4 * q[0] * log2(e) roughly
    "ordinary": None,  # Gaussian q, M of a few units
    "band +": 6931.0,  # M ~ +40 000: between 2^15 and 2^16, the main kernel's result
    "band -": -6931.0,  # M ~ -40 000
    "limit +": 11703.0,  # M ~ +67 500: past 2^16, the exact pass's result
    "limit -": -11703.0,  # M ~ -67 500
}


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_exact_pass_rows_equal_their_decode_calls(dtype):
    """Rows whose scaled maximum is past 2^16 (and rows just below whose |LSE| * log2(e) reaches 2^16 - 64) are
    recomputed by the forward's exact pass (csrc/flash/fwd/exact_rows_sm90.hpp) and the others are not, whatever else
    the call holds. Until session 66 the pass, once a row past 2^16 had set its flag, also recomputed every row with
    |LSE| * log2(e) >= 2^15: rows between 2^15 and 2^16 got the main kernel's bits in their decode call and the pass's
    bits in a call beside a larger row (docs/conventions.md named it as an exception to GA's property; found by session
    65's review of the docs). Each row alone (seqlen_q 1) must give the bits it has in the call of all the rows (batch
    1, head_dim 128, 300 keys, softmax_scale 1), and that call must be right by the rule."""
    require_built(128, dtype)
    g = generator("ga-exact-pass")
    k = gaussian((1, GA_EXACT_KEYS, 1, 128), g, dtype)
    k[..., 0] = 4.0
    v = gaussian((1, GA_EXACT_KEYS, 1, 128), g, dtype)
    rows = []
    for name, first in GA_EXACT_ROWS.items():
        row = gaussian((128,), g, torch.float32, 0.3 if first is not None else 1.0)
        if first is not None:
            row[0] = first
        rows.append(row.to(dtype))
    q = torch.stack(rows).view(1, len(rows), 1, 128)
    scaled_max = (q[0, :, 0].double() @ k[0, :, 0].double().T).amax(dim=1) * math.log2(math.e)
    for name, m in zip(GA_EXACT_ROWS, scaled_max.tolist()):  # the premises
        band = abs(m) >= 2 ** 16 if name.startswith("limit") else (2 ** 15 <= abs(m) < 64000 or name == "ordinary")
        assert band, f"row {name!r}: scaled maximum {m:.0f} is outside the band the case needs"
    poison(q, v)
    out, lse = flash_attn_hopper.attention(q, k, v, softmax_scale=1.0, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, upcast=True, softmax_scale=1.0)
    naive, naive_lse = attention_ref(q, k, v, upcast=False, softmax_scale=1.0)
    assert_close_by_rule(out, ref, naive, "exact pass rows: out")
    assert_close_by_rule(lse, ref_lse, naive_lse, "exact pass rows: lse")
    why = " (whether the exact pass recomputes a row must depend on that row alone)"
    for i, name in enumerate(GA_EXACT_ROWS):
        o, o_lse = flash_attn_hopper.attention(q[:, i:i + 1], k, v, softmax_scale=1.0, return_lse=True)
        assert_same_bits(o, out[:, i:i + 1], f"row {name!r} alone: out", why)
        assert_same_bits(o_lse, lse[:, :, i:i + 1], f"row {name!r} alone: lse", why)


GA_OVERFLOW_KEY = 1.6e19  # the keys' first element, + on even keys and - on odd: with q[0] = +-1.5e19 scores of
#                           +-2.4e38, finite in float32, whose values in log2 units (x 1.4427, softmax_scale 1) are not
GA_OVERFLOW_ROWS = {"ordinary": 0.0, "overflow +": 1.5e19, "overflow -": -1.5e19, "limit +": 2.9e-15}


def _overflow_case():
    """q (the rows of GA_OVERFLOW_ROWS), k and v (bf16, head_dim 128, GA_EXACT_KEYS keys), the premises asserted."""
    g = generator("ga-overflow")
    k = gaussian((1, GA_EXACT_KEYS, 1, 128), g, BF16)
    k[..., 0] = GA_OVERFLOW_KEY
    k[:, 1::2, :, 0] = -GA_OVERFLOW_KEY
    v = gaussian((1, GA_EXACT_KEYS, 1, 128), g, BF16)
    rows = []
    for first in GA_OVERFLOW_ROWS.values():
        row = gaussian((128,), g, torch.float32, 0.3)
        row[0] = first
        rows.append(row.to(BF16))
    q = torch.stack(rows).view(1, len(rows), 1, 128)
    scores = (q[0, :, 0].float() @ k[0, :, 0].float().T).amax(dim=1).tolist()
    for name, s in zip(GA_OVERFLOW_ROWS, scores):  # the premises
        scaled = abs(s) * math.log2(math.e)
        ok = (abs(s) < 3.4e38 and scaled > 3.4029e38) if name.startswith("overflow") else scaled < 1e6
        assert ok, f"row {name!r}: score {s:.4g} is outside what the case needs"
    return q, k, v


def test_scores_past_the_log2_range_follow_the_reference():
    """bf16 scores past ~2.4e38 / softmax_scale are finite in float32 but not in the log2 units the kernels use. Such
    a row came out 0 with LSE -inf (a row that sees no key: silently wrong) when alone, NaN beside a row the exact pass
    recomputes (session 66's review); session 66 made it NaN in every call. Since session 67 the forward flags it and
    the exact pass (csrc/flash/fwd/exact_rows_sm90.hpp) works in natural units, as the float32 reference does, so the
    row is right by the rule: half its keys score +2.4e38 and get P = 1, the other half -2.4e38 and get P = 0 (their
    difference from the maximum is -inf in float32, in the reference too). Each row alone must give the bits of the
    call of all four (head_dim 128, 300 keys, softmax_scale 1; 'limit +': M ~ 66 900, recomputed by the pass). With
    softmax_scale 2 the scaled scores themselves overflow float32 (+inf on half the keys): the reference's out is NaN
    (its LSE +inf), and ours must be NaN, out and LSE (never the 0 / LSE -inf of a row that sees no key)."""
    require_built(128, BF16)
    q, k, v = _overflow_case()
    poison(q, v)
    out, lse = flash_attn_hopper.attention(q, k, v, softmax_scale=1.0, return_lse=True)
    overflow = [i for i, name in enumerate(GA_OVERFLOW_ROWS) if name.startswith("overflow")]
    others = [i for i in range(len(GA_OVERFLOW_ROWS)) if i not in overflow]
    for group, idx in (("overflow", overflow), ("ordinary and limit", others)):  # (apart: an LSE's floor is relative)
        ref, ref_lse = attention_ref(q[:, idx], k, v, upcast=True, softmax_scale=1.0)
        naive, naive_lse = attention_ref(q[:, idx], k, v, upcast=False, softmax_scale=1.0)
        assert torch.isfinite(ref).all() and torch.isfinite(ref_lse).all(), "premise: the reference is finite"
        assert_close_by_rule(out[:, idx], ref, naive, f"{group} rows: out")
        assert_close_by_rule(lse[:, :, idx], ref_lse, naive_lse, f"{group} rows: lse")
    why = " (a row's result must not depend on the other rows of the call)"
    for i, name in enumerate(GA_OVERFLOW_ROWS):
        o, o_lse = flash_attn_hopper.attention(q[:, i:i + 1], k, v, softmax_scale=1.0, return_lse=True)
        assert_same_bits(o, out[:, i:i + 1], f"row {name!r} alone: out", why)
        assert_same_bits(o_lse, lse[:, :, i:i + 1], f"row {name!r} alone: lse", why)
    qo = q[:, overflow]
    ref2, ref2_lse = attention_ref(qo, k, v, upcast=True, softmax_scale=2.0)
    assert torch.isnan(ref2).all(), "premise: with softmax_scale 2 the float32 reference's rows are NaN"
    o2, o2_lse = flash_attn_hopper.attention(qo, k, v, softmax_scale=2.0, return_lse=True)
    assert torch.isnan(o2).all() and torch.isnan(o2_lse).all(), (
        f"softmax_scale 2: out {o2[0, :, 0, :4].tolist()}, lse {o2_lse.flatten().tolist()}: expected NaN as the "
        "reference, never the 0 / -inf of a row that sees no key")


def test_gradients_past_the_log2_range_are_nan_never_zero():
    """The backward of test_scores_past_the_log2_range_follow_the_reference's 'overflow +' row (bf16, head_dim 128,
    softmax_scale 1). Its forward is right (LSE ~2.4e38), but the backward takes P = exp2(s * scale * log2 e - LSE *
    log2 e), where both products overflow: LSE * log2 e = +inf is the mark of a row with no key, so until session 67
    the row's dQ came out 0 and it added nothing to dK, dV, silently (session 67's review). The backward's
    preprocess now writes NaN there (csrc/flash/bwd/prepost_bwd_sm90.hpp): a known deviation (the float32 reference's
    gradients are finite), never a silent zero. Written in session 67, passed on an H100 in session 68."""
    require_built(128, BF16)
    q, k, v = _overflow_case()
    i = list(GA_OVERFLOW_ROWS).index("overflow +")
    q = q[:, i:i + 1].clone()
    dout = gaussian((1, 1, 1, 128), generator("ga-overflow-dout"), BF16)
    qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
    ref, _ = attention_ref(qr, kr, vr, upcast=True, softmax_scale=1.0)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), dout.float())
    assert all(torch.isfinite(t).all() for t in ref_grads), "premise: the reference's gradients are finite"
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = flash_attn_hopper.attention(q, k, v, softmax_scale=1.0, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), "premise: the forward is finite"
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for name, grad in zip(("dq", "dk", "dv"), grads):
        assert torch.isnan(grad).all(), (
            f"{name}: {int(torch.isnan(grad).sum())} of {grad.numel()} elements NaN, "
            f"{int((grad == 0).sum())} zero: expected all NaN (a known deviation), never a silent 0")


# GA across head_dim 64's two tile heights (csrc/flash/fwd/tile_choice.hpp picks 192 or 128 rows per problem, so a
# prefill and its decode calls may run different ones). Each height is forced in a child process (FAH_FWD_BLOCK_M is
# read once per process) that writes the forward's out and LSE of every case; the parent compares the bits.
GA_TILES_CASES = {  # name -> (dtype, seqlen_q, seqlen_k, options)
    "bf16-causal": ("bfloat16", 300, 300, {"causal": True}),
    "fp16-full": ("float16", 257, 700, {}),
    "bf16-window": ("bfloat16", 300, 300, {"window_size": (50, 10)}),
    "bf16-causal-softcap20": ("bfloat16", 300, 300, {"causal": True, "softcap": 20.0}),
    "fp16-softcap50": ("float16", 300, 300, {"softcap": 50.0}),
}
_GA_TILES_CHILD = """
import sys, zlib, torch, flash_attn_hopper
block_m, path, cases = int(sys.argv[1]), sys.argv[2], eval(sys.argv[3])
result = {}
for name, (dtype, seqlen_q, seqlen_k, opts) in cases.items():
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    dtype = getattr(torch, dtype)
    q, k, v = (torch.randn(2, n, h, 64, generator=g).to("cuda", dtype) for n, h in
               ((seqlen_q, 4), (seqlen_k, 2), (seqlen_k, 2)))
    left, right = opts.get("window_size", (-1, 0 if opts.get("causal") else -1))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ran = torch.ops.flash_attn_hopper.fwd_block_m(64, 64, 2, 4, seqlen_q, seqlen_k, opts.get("causal", False), left,
                                                  right, sms)
    assert ran == block_m, (name, ran, block_m)
    out, lse = flash_attn_hopper.attention(q, k, v, return_lse=True, **opts)
    result[name] = (out.cpu(), lse.cpu())
torch.save(result, path)
"""


def test_head_dim_64_tile_heights_give_the_same_bits(tmp_path):
    """Head_dim 64's 192-row tiles (three consumer warpgroups taking turns, interior key blocks in a loop of their own)
    and 128-row tiles (two warpgroups, no turns, the next tile's first QKᵀ issued early) must give every row the same
    out and LSE bits (causal, full, window, both softcap paths; fp16 and bf16; batch 2, GQA 4/2), so that a prefill and
    its decode calls agree whichever height each picks. The 128-row run is also checked by the rule. Until session 66
    the 192-row tiles summed a thread's part of a row in four chains and the 128-row tiles in one
    (FwdKernelTraits::kSoftmaxSumChains), so l, the LSE and out differed in the last bits (session 65's review). What
    ran (session 66, an H100): passed with either chain count on both heights (four: packs SC, which cost the 128-row
    tiles 3-7 %; one: W1, level, kept)."""
    require_built(64, BF16)
    require_built(64, FP16)
    runs = {}
    for block_m in (128, 192):
        path = tmp_path / f"tiles{block_m}.pt"
        env = dict(os.environ, FAH_FWD_BLOCK_M=str(block_m))
        r = subprocess.run([sys.executable, "-c", gpu_helpers.CHILD_PRELUDE + _GA_TILES_CHILD, str(block_m), str(path),
                            repr(GA_TILES_CASES)], cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        runs[block_m] = torch.load(path)
    why = " (a row's bits must not depend on the tile height the launcher picks)"
    for name, (dtype, seqlen_q, seqlen_k, opts) in GA_TILES_CASES.items():
        (o128, l128), (o192, l192) = runs[128][name], runs[192][name]
        assert_same_bits(o192, o128, f"{name}: out, 192 against 128 rows", why)
        assert_same_bits(l192, l128, f"{name}: lse, 192 against 128 rows", why)
    g = gpu_helpers.seeded_generator("bf16-causal")  # the child's inputs of the first case, for the rule
    q, k, v = (torch.randn(2, n, h, 64, generator=g).to(DEVICE, BF16) for n, h in ((300, 4), (300, 2), (300, 2)))
    ref, ref_lse = attention_ref(q, k, v, upcast=True, causal=True)
    naive, naive_lse = attention_ref(q, k, v, upcast=False, causal=True)
    assert_close_by_rule(runs[128]["bf16-causal"][0].to(DEVICE), ref, naive, "bf16-causal 128 rows: out")
    assert_close_by_rule(runs[128]["bf16-causal"][1].to(DEVICE), ref_lse, naive_lse, "bf16-causal 128 rows: lse")
