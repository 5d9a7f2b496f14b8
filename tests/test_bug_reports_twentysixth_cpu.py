"""Twenty-sixth round of the bug hunt (tests/bug_report_sources.md, "Twenty-sixth round"), CPU part: the constructions
of tests/test_bug_reports_twentysixth_gpu.py run through the CPU stand-ins of the ops (tests/cpu_stand_ins.py: the
extension's op schemas and C++ autograd node; float32 references for the kernels), at smaller sizes, and each check
is shown to fail for a stand-in with the fault its reports describe.

FI: query heads of a group identical: the stand-ins give dK, dV = G x the one-head call's and the same out, LSE, dQ; a
backward that rounds each head's dK / dV to the input dtype and sums them there (tinygrad#3331) fails that relation,
while DESIGN.md §3's rule (whose naive reference rounds each head too) often passes it: why the relation is there.
FJ: groups of 16 to 48 pass through the stand-ins, dense and varlen; a forward packing at most 8 heads per group (the
heads past the pack reusing the pack's, TensorRT-LLM#6573 / hpc-ops#58) and a backward mapping query head h to K/V head
h % nheads_k (interleaved instead of h // group) are caught by the rule.
FK: chunked prefill through the stand-ins matches the one-shot reference, dense and varlen; a forward and backward that
keep only the window's last keys (a cache of the window's size: a chunk longer than the window loses keys still inside
it, executorch#20346) are caught.
"""

import pytest
import torch

from flash_attn_hopper.testing import attention_ref_grads, max_abs_err
from cpu_stand_ins import STAND_INS, _grads, bwd_stand_in, fwd_stand_in, ops_on_cpu, stand_ins
from gpu_helpers import GRAD_NAMES, check_attention, check_attention_varlen
from test_bug_reports_twentysixth_gpu import (CHUNKS, FK_SEQUENCES, VARLEN_LK, VARLEN_LQ, WINDOW, activation_like,
                                              assert_within_one_rounding, check_against_one_shot,
                                              check_group_of_identical_heads,
                                              check_varlen_chunks_against_one_shot, chunked_prefill,
                                              fk_varlen_inputs, large_group_inputs, offsets, one_rounding, run,
                                              run_varlen, varlen_chunks, varlen_group_inputs)

# ------------------------------------------------------------------------------------------------------------ FI

FI_CASES = [(16, 2, 64, dict(causal=True)), (8, 1, 64, dict(window_size=(20, 5)))]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", FI_CASES, ids=["16-2-causal", "8-1-window"])
def test_identical_heads_relation_holds_for_the_stand_ins(monkeypatch, case, dtype):
    """FI's checks (the rule on both calls, the one-rounding relations) pass for kernels that sum in float32."""
    nheads, nheads_k, head_dim, opts = case
    q, k, v, dout = activation_like(2, 45, nheads, nheads_k, head_dim, dtype, device="cpu")
    with stand_ins(monkeypatch):
        check_group_of_identical_heads(q, k, v, dout, "stand-ins", **opts)


def _bwd_group_sum_in_input_dtype(dout, q, k, v, out, lse, dlse, scale, causal, left, right, softcap, deterministic,
                                  doc_bounds=None):
    """dQ as the stand-in; dK and dV per query head in float32, each rounded to the input dtype and added into a
    running sum in that dtype (a group sum without a float32 accumulator)."""
    dq = bwd_stand_in(dout, q, k, v, out, lse, dlse, scale, causal, left, right, softcap, deterministic)[0]
    group = q.shape[2] // k.shape[2]
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for h in range(q.shape[2]):
        kv = slice(h // group, h // group + 1)
        one = slice(h, h + 1)
        _, dk_h, dv_h = _grads(dout[:, :, one], q[:, :, one], k[:, :, kv], v[:, :, kv], out[:, :, one], lse[:, one],
                               None if dlse is None else dlse[:, one], scale, causal, (left, right), softcap, None)
        dk[:, :, kv] += dk_h.to(k.dtype)
        dv[:, :, kv] += dv_h.to(v.dtype)
    return dq, dk, dv


def _margins(got, want, ref, naive, dtype):
    """(relation, rule): the largest error of got against want over one_rounding, and of got against ref over the
    rule's tolerance (2 x the naive error + its floor); above 1 fails."""
    relation = ((got.double() - want).abs() / one_rounding(want, dtype)).max().item()
    floor = 1e-4 * max(1.0, ref.double().abs().max().item())
    rule = max_abs_err(got, ref) / (2 * max_abs_err(naive, ref) + floor)
    return relation, rule


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_identical_heads_relation_catches_a_group_sum_in_the_input_dtype(monkeypatch, dtype):
    """A backward summing the group's dK / dV in fp16 / bf16 fails FI's relation, and for dK and dV the relation sees
    it by a wider margin than the rule, whose naive reference rounds every head's dK too (the rule alone often passes
    it, and it cannot be relied on to fail it)."""
    q, k, v, dout = activation_like(2, 45, 16, 2, 64, dtype, device="cpu")
    with ops_on_cpu(monkeypatch, {**STAND_INS, "bwd": _bwd_group_sum_in_input_dtype}, "its op schemas"):
        grads = run(q, k, v, dout, causal=True)[2]
        grads1 = run(q[:, :, ::8], k, v, dout[:, :, ::8], causal=True)[2]
    for i in (1, 2):  # the relation check of check_group_of_identical_heads, alone (its rule checks come first there)
        with pytest.raises(AssertionError, match=r"\(group sum\): \d+ elements off by more than one rounding"):
            assert_within_one_rounding(f"{GRAD_NAMES[i]} (group sum)", grads[i], grads1[i].double() * 8)
    ref = attention_ref_grads(q, k, v, dout, causal=True)
    naive = attention_ref_grads(q, k, v, dout, causal=True, upcast=False)
    for i in (1, 2):
        relation, rule = _margins(grads[i], grads1[i].double() * 8, ref[i], naive[i], dtype)
        assert relation > 1 and relation > rule, (i, relation, rule)


def test_activation_like_inputs_are_what_they_claim():
    """activation_like: the heads of a group equal (identical=True) or not, the sink key draws most of batch element
    0's weight and none of batch element 1's, the massive channels dominate k."""
    q, k, v, dout = activation_like(2, 45, 8, 2, 64, torch.float32, device="cpu")
    assert torch.equal(q[:, :, 0], q[:, :, 3]) and torch.equal(dout[:, :, 4], dout[:, :, 7])
    assert not torch.equal(q[:, :, 3], q[:, :, 4])
    qn = activation_like(2, 45, 8, 2, 64, torch.float32, device="cpu", identical=False)[0]
    assert not torch.equal(qn[:, :, 0], qn[:, :, 1])
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(4, dim=2)) / 8.0
    p = torch.softmax(s, dim=-1)
    assert p[0, :, :, 0].mean() > 0.3 > p[1, :, :, 0].mean() * 10
    assert k[..., :4].abs().mean() > 5 * k[..., 4:].abs().mean()


# ------------------------------------------------------------------------------------------------------------ FJ

FJ_CASES = [(48, 1, 64, 64, dict(causal=True)), (32, 2, 64, 32, dict(window_size=(30, 0), softcap=50.0))]


@pytest.mark.parametrize("case", FJ_CASES, ids=["48-1-causal", "32-2-window-softcap"])
def test_large_groups_pass_the_stand_ins(monkeypatch, case):
    nheads, nheads_k, head_dim, head_dim_v, opts = case
    q, k, v, dout = large_group_inputs(2, 29, 37, nheads, nheads_k, head_dim, head_dim_v, torch.bfloat16, device="cpu")
    with stand_ins(monkeypatch):
        check_attention(*run(q, k, v, dout, **opts), q, k, v, dout, "stand-ins", **opts)


def test_large_groups_varlen_pass_the_stand_ins(monkeypatch):
    q, k, v, dout = varlen_group_inputs(32, 2, 64, torch.bfloat16, device="cpu")
    cu_q, cu_k = offsets(VARLEN_LQ, device="cpu"), offsets(VARLEN_LK, device="cpu")
    with stand_ins(monkeypatch):
        out, lse, grads = run_varlen(q, k, v, dout, cu_q, cu_k, max(VARLEN_LQ), max(VARLEN_LK), causal=True)
    check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, "stand-ins varlen", causal=True)


def _fwd_with_a_pack_of_eight(q, k, v, *args, **kwargs):
    """The stand-in, then each head past the 8th of its group given the result of the pack's head (index mod 8)."""
    out, lse = fwd_stand_in(q, k, v, *args, **kwargs)
    group = q.shape[2] // k.shape[2]
    src = torch.tensor([h - (h % group) + (h % group) % 8 for h in range(q.shape[2])])
    return out[:, :, src].contiguous(), lse[:, src].contiguous()


def _bwd_interleaved(dout, q, k, v, out, lse, dlse, *args, **kwargs):
    """The stand-in with query head h read against K/V head h % nheads_k (the interleaved map) instead of h // group:
    the heads reordered so that the stand-in's h // group lands on h % nheads_k, dQ put back in place."""
    nheads_k, group = k.shape[2], q.shape[2] // k.shape[2]
    order = torch.tensor([(h % group) * nheads_k + h // group for h in range(q.shape[2])])
    assert all(int(order[h]) % nheads_k == h // group for h in range(q.shape[2]))
    dq, dk, dv = bwd_stand_in(dout[:, :, order], q[:, :, order], k, v, out[:, :, order], lse[:, order],
                              None if dlse is None else dlse[:, order], *args, **kwargs)
    return dq[:, :, torch.argsort(order)].contiguous(), dk, dv


@pytest.mark.parametrize("fault", ["fwd-pack-of-8", "bwd-interleaved"])
def test_large_groups_catch_head_map_faults(monkeypatch, fault):
    impls = dict(STAND_INS)
    if fault == "fwd-pack-of-8":
        impls["fwd"] = _fwd_with_a_pack_of_eight
    else:
        impls["bwd"] = _bwd_interleaved
    nheads, nheads_k, head_dim, head_dim_v, opts = FJ_CASES[1]
    q, k, v, dout = large_group_inputs(2, 29, 37, nheads, nheads_k, head_dim, head_dim_v, torch.bfloat16, device="cpu")
    with ops_on_cpu(monkeypatch, impls, "its op schemas"):
        result = run(q, k, v, dout, **opts)
    with pytest.raises(AssertionError):
        check_attention(*result, q, k, v, dout, fault, **opts)


# ------------------------------------------------------------------------------------------------------------ FK

SMALL_CHUNKS = [0, 1, 15, 45, 60]  # chunks of 1, 14 (shorter than the window), 30 (longer) and 15 rows
SMALL_WINDOW = (25, 0)
SMALL_SEQUENCES = [(60, 15, 45), (30, 0, 30), (8, 7, 8)]


def test_chunk_plan_is_the_gpu_tests_scaled_down():
    """The CPU chunks keep the GPU test's shape: a one-row chunk, one shorter and one longer than the window."""
    for chunks, window in ((CHUNKS, WINDOW), (SMALL_CHUNKS, SMALL_WINDOW)):
        sizes = [e - s for s, e in zip(chunks, chunks[1:])]
        assert sizes[0] == 1 and sizes[1] < window[0] + 1 < max(sizes)
    assert [s for _, s, _ in FK_SEQUENCES] == [150, 0, 76] and SMALL_SEQUENCES[2][2] - SMALL_SEQUENCES[2][1] == 1


def _fk_dense(nheads, nheads_k, head_dim, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(3)
    shapes = ((2, 60, nheads, head_dim), (2, 60, nheads_k, head_dim), (2, 60, nheads_k, head_dim),
              (2, 60, nheads, head_dim))
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


FK_OPTS = [dict(window_size=SMALL_WINDOW), dict(causal=True, window_size=SMALL_WINDOW, softcap=50.0), dict(causal=True)]


@pytest.mark.parametrize("opts", FK_OPTS, ids=["window", "window-softcap", "causal"])
def test_chunked_prefill_passes_the_stand_ins(monkeypatch, opts):
    q, k, v, dout = _fk_dense(4, 2, 64)
    with stand_ins(monkeypatch):
        out, lse, grads = chunked_prefill(q, k, v, dout, SMALL_CHUNKS, **opts)
    check_against_one_shot(out, lse, grads, q, k, v, dout, "stand-ins chunks", **opts)


def test_chunked_prefill_varlen_passes_the_stand_ins(monkeypatch):
    import test_bug_reports_twentysixth_gpu as gpu

    monkeypatch.setattr(gpu, "FK_SEQUENCES", SMALL_SEQUENCES)
    q, k, v, dout = fk_varlen_inputs(64, 4, 2, torch.bfloat16, device="cpu")
    qs, ks, vs, dos, cu_q, cu_k = varlen_chunks(q, k, v, dout, SMALL_SEQUENCES)
    max_q, max_k = max(e - s for _, s, e in SMALL_SEQUENCES), max(e for _, _, e in SMALL_SEQUENCES)
    with stand_ins(monkeypatch):
        out, lse, grads = run_varlen(qs, ks, vs, dos, cu_q, cu_k, max_q, max_k, window_size=SMALL_WINDOW)
    check_varlen_chunks_against_one_shot(out, lse, q, k, v, SMALL_SEQUENCES, "stand-ins varlen",
                                         window_size=SMALL_WINDOW)
    check_attention_varlen(out, lse, grads, qs, ks, vs, dos, cu_q, cu_k, "stand-ins varlen",
                           window_size=SMALL_WINDOW)


def _keep(window_left, k):
    return max(0, k.shape[1] - (window_left + 1))


def _fwd_window_cache(q, k, v, scale, causal, left, right, *args, **kwargs):
    """A cache of the window's size: only the last left + 1 keys kept (rows of a longer chunk lose keys)."""
    s = _keep(left, k)
    return fwd_stand_in(q, k[:, s:], v[:, s:], scale, causal, left, right, *args, **kwargs)


def _bwd_window_cache(dout, q, k, v, out, lse, dlse, scale, causal, left, right, *args, **kwargs):
    s = _keep(left, k)
    dq, dk_kept, dv_kept = bwd_stand_in(dout, q, k[:, s:], v[:, s:], out, lse, dlse, scale, causal, left, right,
                                        *args, **kwargs)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dk[:, s:], dv[:, s:] = dk_kept, dv_kept
    return dq, dk, dv


def test_chunked_prefill_catches_a_cache_of_the_windows_size(monkeypatch):
    """executorch#20346's fault in the kernels' place: the chunk of 30 rows loses keys still inside its first rows'
    windows; the one-row chunk alone would not show it."""
    q, k, v, dout = _fk_dense(4, 2, 64)
    impls = {**STAND_INS, "fwd": _fwd_window_cache, "bwd": _bwd_window_cache}
    with ops_on_cpu(monkeypatch, impls, "its op schemas"):
        out, lse, grads = chunked_prefill(q, k, v, dout, SMALL_CHUNKS, window_size=SMALL_WINDOW)
        decode = chunked_prefill(q, k, v, dout, [0, 59, 60], window_size=SMALL_WINDOW)
    with pytest.raises(AssertionError, match="out"):
        check_against_one_shot(out, lse, grads, q, k, v, dout, "window cache", window_size=SMALL_WINDOW)
    with stand_ins(monkeypatch):
        right = chunked_prefill(q, k, v, dout, [0, 59, 60], window_size=SMALL_WINDOW)
    assert torch.equal(decode[0][:, 59:], right[0][:, 59:])  # the one-row chunk is the same either way
