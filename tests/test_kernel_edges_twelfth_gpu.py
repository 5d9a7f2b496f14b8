"""Twelfth round, kernel edge paths: GPU tests for inputs that reach edge paths of the forward kernel no earlier test
runs, found by a code review of csrc/flash (fwd, bwd, common) against bug reports filed on other Hopper attention
kernels (FlashAttention-3/4, cuDNN frontend, tilelang/helion CuTe kernels). tests/bug_report_sources.md, section
"Twelfth round (kernel edge paths)", lists the classes and their sources:

- DA: the persistent forward's tile loop (csrc/flash/fwd/kernel_fwd_sm90.hpp, flash_fwd_sm90_kernel) on a dense batch
  where each CTA takes several tiles and most of them have no key block (bottom-right causal, seqlen_q > seqlen_k),
  the rest one or two: the Q-buffer mbarriers' parity (barrier_q / barrier_q_empty, by tile count), the K/V pipeline
  state carried over empty tiles, the consumers' ping-pong turns (skipped on empty tiles, the round robin of three
  warpgroups on head_dim 64's 192-row tiles), and head_dim 64's QKᵀ issued ahead for a tile that has no key block
  (kCrossTile), in the sectioned tile order (causal) and the head-major one (causal window). Earlier tests reach empty
  tiles in a persistent CTA's loop only through varlen batches (tests/test_varlen_gpu.py) and dense empty tiles only
  with fewer tiles than SMs (one tile per CTA). In a subprocess with a time limit: a hang fails instead of stalling
  the session.
- DB: the forward's exact pass (csrc/flash/fwd/exact_rows_sm90.hpp, run when some row's scaled maximum passes 2^16)
  over rows that see no key, sequences with queries and no keys, sequences with keys and no queries, GQA and head_dim_v
  != head_dim, in a varlen and a dense batch: it recomputes every row whose LSE is not finite, so it must give those
  rows 0 and LSE -inf again, and its varlen indexing (sequence offsets, LSE (nheads, total_q)) must match the main
  kernel's. The fifth round's huge-logit tests (class AL) run only rows that all see keys, two equal sequences.

Every numeric result is checked by the rule of DESIGN.md §3 (float32 reference, the same reference in the input dtype
as the yardstick). Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per case
when the build lacks a head_dim / dtype (``built_dtype``; DA runs the cases the build compiles)."""

import math

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.interface import kernel_head_dim
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_varlen_ref
from gpu_helpers import built_dtype, cu_seqlens, poison_allocator, randn
from test_bug_reports_ninth_gpu import _run_script  # a subprocess with a time limit: a hang fails the test

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]


# ------------------------------------------------------ DA: persistent CTAs whose tiles mostly see no key block

# (head_dim, batch, nheads, nheads_k, seqlen_q, seqlen_k, forward tile rows). Rows i < seqlen_q - seqlen_k see no key
# (bottom-right causal): with 128-row tiles of 1000 x 200, query blocks 0-5 of each head have no key block, block 6 one
# and block 7 two; 320 tiles (1280 with 192-row tiles of 3000 x 500: 13 of 16 blocks empty, the rest one to four key
# blocks), more than twice the SMs, so that every persistent CTA runs several tiles, empty and not, in the tile
# counter's order. head_dim 64 at 128 rows: kCrossTile (a QKᵀ issued for every next tile, never read for an empty one),
# no ping-pong; at 192 rows: three consumer warpgroups taking turns in a round robin; head_dim 72: the 96-wide forward
# kernel; head_dim 128: two Q buffers and two warpgroups taking turns. Keys per tile stay below
# kFwdPersistentMaxKeyBlocks, so all of them launch persistent (FAH_FWD_PERSISTENT unset).
_PERSISTENT_CASES = [
    (64, 1, 40, 8, 1000, 200, 128),
    (64, 2, 40, 8, 3000, 500, 192),
    (72, 1, 40, 8, 1000, 200, 128),
    (128, 1, 40, 8, 1000, 200, 128),
]

_PERSISTENT_SCRIPT = r"""
import os, sys
import torch
from gpu_helpers import attention_inputs, check_attention, run_attention


def run_case(dtype, head_dim, batch, nheads, nheads_k, seqlen_q, seqlen_k, rows, sms):
    blind = seqlen_q - seqlen_k
    for opts in (dict(causal=True), dict(causal=True, window_size=(64, 0))):
        left, right = opts.get("window_size", (-1, -1))
        picked = torch.ops.flash_attn_hopper.fwd_block_m(head_dim, head_dim, batch, nheads, seqlen_q, seqlen_k, True,
                                                         left, right, sms)
        if os.environ.get("FAH_FWD_BLOCK_M") is None:
            assert picked == rows, f"this shape now runs {picked}-row tiles, not {rows}: pick another shape"
        tiles = -(-seqlen_q // picked) * nheads * batch
        assert tiles > 2 * sms, f"{tiles} tiles on {sms} SMs: each persistent CTA must take several"
        q, k, v, dout = attention_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
        name = f"head_dim {head_dim} {rows}-row tiles {seqlen_q}x{seqlen_k} {opts}"
        for _ in range(2):  # a second launch: a CTA that hung or raced on the first would also differ here
            out, lse, grads = run_attention(q, k, v, dout, **opts)
            check_attention(out, lse, grads, q, k, v, dout, name, **opts)
            assert torch.equal(out[:, :blind], torch.zeros_like(out[:, :blind])), f"{name}: blind rows of out not 0"
            assert torch.isneginf(lse[:, :, :blind]).all(), f"{name}: blind rows' LSE not -inf"
            assert torch.equal(grads[0][:, :blind], torch.zeros_like(grads[0][:, :blind])), f"{name}: blind dQ not 0"
            assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, blind:]).all(), name
        print("ok", name, flush=True)


sms = torch.cuda.get_device_properties(0).multi_processor_count
for arg in sys.argv[1:]:  # "dtype:head_dim,batch,nheads,nheads_k,seqlen_q,seqlen_k,rows"
    dtype_name, numbers = arg.split(":")
    run_case(getattr(torch, dtype_name), *(int(a) for a in numbers.split(",")), sms)
print("done")
"""


def test_persistent_ctas_over_tiles_without_key_blocks():
    """DA. helion PR 3621 (a persistent CuTe flash backward hung on a CTA's second tile: a barrier's parity advanced
    once less than its waits, only on tiles of one step), cudnn-frontend PR 575 (a persistent SDPA deadlocked on
    varlen tiles with no keys: an empty tile's arrivals raced ahead of a producer's parity) and candle issue 3603
    (FlashAttention-3's varlen tiles past a sequence skipped the mainloop and hung). Here the producer hands each tile,
    empty or not, through one Q buffer's pair of mbarriers whose parity follows the tile count, and the K/V pipeline
    and the ping-pong turns run on across tiles (csrc/flash/fwd/kernel_fwd_sm90.hpp). Dense causal seqlen_q > seqlen_k
    with more than twice as many tiles as SMs, GQA 40 on 8, in the sectioned tile order (causal) and the head-major
    one (causal window (64, 0)), each launched twice, for every case of _PERSISTENT_CASES this build compiles: out,
    LSE, dQ, dK, dV by the rule; the rows that see no key out 0, LSE -inf, dQ 0. One subprocess with a time limit for
    all of them (a hang fails instead of stalling the session; one interpreter start)."""
    cfg = flash_attn_hopper.build_config()
    args = []
    for case in _PERSISTENT_CASES:
        head_dim = case[0]
        built = all(kernel_head_dim(head_dim, backward=b) in cfg["head_dims"] for b in (False, True))
        dtypes = [d for d in (torch.float16, torch.bfloat16) if d in cfg["dtypes"]]
        if built and dtypes:
            args.append(str(dtypes[len(args) % len(dtypes)]).split(".")[-1] + ":" + ",".join(str(c) for c in case))
    if not args:
        pytest.skip("none of head_dim 64, 72, 128 in this build (FAH_HDIMS/FAH_DTYPES)")
    _run_script(_PERSISTENT_SCRIPT, *args, timeout=240)


# ------------------------------------------------- DB: the exact pass over rows and sequences without keys

_LOGIT_LOG2 = 26  # the full rows' scaled logit in the exp2 domain: past kExactRowsLimitLog2 = 2^16 (softmax.hpp)


def _huge_logit_inputs(rows_shape, keys_shape, head_dim, head_dim_v, dtype, gen):
    """q rows ±q0 (60 % of them scaled down to a scaled logit of ±2^4, the rest at ±2^_LOGIT_LOG2), every key k0, so
    that each row's scores are all equal and exact in float32 (multiples of 1/4 in [1/4, 1]): the softmax is uniform
    over the keys a row sees whatever the scale, and the naive reference at the default scale has the same answer.
    rows_shape / keys_shape: q's and k's shapes without head_dim. Returns q, k, v, softmax_scale."""
    q0 = (torch.randint(1, 5, (head_dim,), generator=gen).float() / 4).cuda()
    k0 = (torch.randint(1, 5, (head_dim,), generator=gen).float() / 4).cuda()
    sign = torch.randint(0, 2, (*rows_shape, 1), generator=gen).float() * 2 - 1
    small = torch.rand(*rows_shape, 1, generator=gen) < 0.6
    row_scale = (torch.where(small, 2.0 ** -(_LOGIT_LOG2 - 4), 1.0) * sign).cuda()
    q = (q0 * row_scale).to(dtype)
    k = k0.expand(*keys_shape, head_dim).to(dtype).contiguous()
    v = randn(*keys_shape, head_dim_v, dtype=dtype)
    score = (q0.to(dtype).float() * k0.to(dtype).float()).sum().abs().item()
    return q, k, v, 2.0**_LOGIT_LOG2 / (score * math.log2(math.e))


@pytest.mark.parametrize("api", ["varlen", "dense"])
@pytest.mark.parametrize("head_dim_v", [64, 128], ids=["v64", "v128"])
def test_exact_pass_over_rows_and_sequences_without_keys(head_dim_v, api):
    """DB. PyTorch issue 121558 and FlashMLA PR 68 (huge scaled logits: NaN or zero rows; class AL) combined with
    FlashAttention issues 1778 and 2562 and xformers PR 1042 (rows that see no key, empty query and key sequences:
    NaN or out-of-bounds writes). The full rows' scaled logits at 2^26 set the forward's exact-rows flag, so its exact
    pass (csrc/flash/fwd/exact_rows_sm90.hpp) recomputes every row whose LSE is non-finite or past 2^16 - 64 (2^15
    before session 66): here also the rows that see no key, whose output must stay exactly 0 and LSE -inf. varlen:
    sequences (queries, keys) (0, 9), (5, 0), (300, 100), (77, 700), (0, 50), (130, 130), causal, GQA 4 on 2 (the pass
    reads K/V head h // 2, LSE (nheads, total_q) at the sequence's row offset); dense: 2 x 300 queries against 100 keys,
    causal (rows 0-199 see no key). head_dim 64 with head_dim_v 64 or 128 (the pass's dot product over head_dim, its V
    rows over head_dim_v). out by the rule (float32 reference at this scale, the naive reference at the default scale,
    the same exact answer, as the yardstick), LSE within the rule's floor, rows that see no key out 0 and LSE -inf (the
    rule's infinities must match), from NaN-poisoned memory."""
    head_dim, nheads, nheads_k = 64, 4, 2
    dtype = built_dtype(max(head_dim, head_dim_v))
    gen = torch.Generator().manual_seed(12 + head_dim_v)
    opts = dict(causal=True)
    if api == "varlen":
        lq, lk = [0, 5, 300, 77, 0, 130], [9, 0, 100, 700, 50, 130]
        q, k, v, scale = _huge_logit_inputs((sum(lq), nheads), (sum(lk), nheads_k), head_dim, head_dim_v, dtype, gen)
        cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
        poison_allocator(q.numel() * q.element_size() // head_dim * head_dim_v, sum(lq) * nheads * 4)
        out, lse = attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), softmax_scale=scale, return_lse=True,
                                    **opts)
        ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, softmax_scale=scale, **opts)
        naive, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, **opts)
        blind_lse = torch.isneginf(ref_lse)  # (nheads, total_q)
        blind_out = blind_lse.transpose(0, 1)  # (total_q, nheads)
        expected_blind = 5 + 200  # rows of the (5, 0) sequence and the first 200 of (300, 100), per head
    else:
        batch, seqlen_q, seqlen_k = 2, 300, 100
        q, k, v, scale = _huge_logit_inputs((batch, seqlen_q, nheads), (batch, seqlen_k, nheads_k), head_dim,
                                            head_dim_v, dtype, gen)
        poison_allocator(batch * seqlen_q * nheads * head_dim_v * q.element_size(), batch * nheads * seqlen_q * 4)
        out, lse = attention(q, k, v, softmax_scale=scale, return_lse=True, **opts)
        ref, ref_lse = attention_ref(q, k, v, softmax_scale=scale, **opts)
        naive, _ = attention_ref(q, k, v, upcast=False, **opts)
        blind_lse = torch.isneginf(ref_lse)  # (batch, nheads, seqlen_q)
        blind_out = blind_lse.permute(0, 2, 1)  # (batch, seqlen_q, nheads)
        expected_blind = batch * (seqlen_q - seqlen_k)
    name = f"{api} head_dim_v {head_dim_v} logits ~2^{_LOGIT_LOG2}"
    assert int(blind_lse.sum()) == expected_blind * nheads, f"{name}: the construction's rows without keys"
    assert_close_by_rule(out, ref, naive, f"{name} out")
    assert_close_by_rule(lse, ref_lse, ref_lse, f"{name} lse")  # the exact LSE as its own yardstick: the floor only
    rows = out[blind_out]
    assert torch.equal(rows, torch.zeros_like(rows)), f"{name}: rows that see no key are not exactly 0"
    assert torch.isfinite(out[~blind_out]).all() and torch.isfinite(lse[~blind_lse]).all(), name
