"""Twenty-seventh round of the bug hunt (tests/bug_report_sources.md, "Twenty-seventh round"), GPU part.

Focus: the head_dim 256 backward kernel's dQ hand-off (csrc/flash/bwd/kernel_bwd_sm90.hpp, bwd_consumer and
bwd_dq_writer). Per query tile the consumer warpgroups stage dQ in two passes, the first in smem_dq and the second in
the tile's own Q stage; the writer warp adds them into the fp32 accumulator (TMA reduce-add, in deterministic mode in
its key block's turn) and arrives on kBarrierDQEmpty; the consumers await that barrier (for every tile but the CTA's
first: `bidh > bidh0 || m_block > m_block_min`, and once more after the loop) before they hand the previous tile's Q
stage back to the producer. Commit cf14058 moved that wait to after the dV and dK GEMMs are issued. Every kernel whose
head_dim or head_dim_v is above 128 runs this path (200, 248, 128 with v 256 ...). A hand-off that releases a stage
too early, reads the wrong stage (the stage index runs on across the query heads of a GQA group CTA), or awaits the
writer once too often or too rarely gives wrong dQ in some tiles of some runs, or hangs.

FL: many query tiles per CTA (4096, 3001 and 2047 queries against one or two key blocks: 32 to 64 tiles in a row on
one Q-stage ring) and exactly one or two tiles per CTA (1, 64, 65, 127, 128 queries: only the after-loop wait, or
one in-loop wait). Dao-AILab/flash-attention#359 (a backward race seen only on some of 50 passes at 2048 queries
against 128 keys), deepseek-ai/DeepEP#657 (a TMA store still reading a shared-memory stage that the next load
overwrites), NVIDIA/cudnn-frontend#396 (a head_dim 576 backward whose buffer reuse was ordered only against the
release two generations back), triton-lang/triton#8554 (one buffer read by two wgmmas and pipelined one stage
short), Dao-AILab/flash-attention#1306 (the FA3 backward at head_dim 256 with 64 x 64 tiles wrong at 8192 tokens).
Three backward passes per forward, NaN-poisoned memory before each; with one key block (or deterministic=True)
every MHA gradient is a single sum and must repeat bit for bit in either mode, so a race that strikes one pass is seen
even when it stays within the rule.
FM: causal masks and windows with seqlen_q != seqlen_k, where m_block_min differs per key block (0 to 22), some key
blocks have no tile (their CTA skips the loop, the writer and the final wait) and some exactly one; head_dim 256, 200
and 248 (rounded up to the 256 kernel), 256 with v 128 and 128 with v 256; deterministic and not.
Dao-AILab/flash-attention#1766 (the FA3 deterministic flag dropped at launch; head_dim 256 and the early exit for
m_block_max <= m_block_min needed their own handling in deterministic mode), pytorch/FBGEMM#4982 (deterministic
backward with a left window: a key block with no work never took its turn), Dao-AILab/flash-attention#1870 (the dQ
semaphore not advanced under a local mask), vllm-project/vllm#26026 (a warp with no work arrived on a named barrier
without the matching wait: a hang under load), tile-ai/tilelang#2567 (a warp-specialized attention backward on Hopper
that hung at one unaligned sequence length).
FN: GQA with one CTA running a group's query heads one after another (FAH_BWD_GQA_GROUP_CTA=1) against one CTA per
query head (=0): one tile per head (every in-loop wait due to `bidh > bidh0`), odd tile counts per head (the stage
parity flips between heads), m_block_min > 0 under causal, MQA at head_dim 200, v narrower than q. dQ is computed per
head by the same code in both modes, so with one key block or deterministic=True it must be bit for bit the same in
both. deepseek-ai/FlashMLA#57 (a named barrier counting threads that never arrive), Dao-AILab/flash-attention#2035
(a backward's shared-memory epilogue overlapping dS: only dQ wrong), NVIDIA/TransformerEngine#3216 (FA4's head_dim
256 GQA 16 / 2 backward: dQ wrong, forward right).
FO: attention_varlen at head_dim 256 / 248 with empty, one-token and exactly-one-tile sequences, causal and a window,
6 query heads on 2 in both GQA modes, deterministic twice bit for bit and dQ equal across modes.
Dao-AILab/flash-attention#1893 (the deterministic backward's dK / dV semaphores not advanced for varlen),
Dao-AILab/flash-attention#2482 (a backward for head_dim in (128, 192] leaving tail rows of dq_accum stale).

What is new here: earlier rounds ran the head_dim 256 backward at 1000-1100 tokens a side (test_deterministic_gpu.py),
at groups of 8-64 with 157-203 queries (twenty-sixth round) and at 1023 x 1024 (test_bwd_gpu.py); the many-tiles race
shape (class 24, test_backward_repeats_many_query_blocks_per_key_block) and the deterministic key blocks that no query
sees (class BO) ran at head_dim 128 only, on the other consumer. None ran 32-64 tiles per head_dim 256 CTA, one tile
per head in a group CTA, a default-mode bitwise repeat at head_dim 256, or dQ compared bit for bit across the GQA modes.

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py: "no CUDA GPU: GPU tests need an sm90
GPU (H100/H200)"), and per test when the build lacks the head_dim / dtype."""

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref_grads, attention_varlen_ref_grads
from gpu_helpers import (GRAD_NAMES, bits, check_attention, check_attention_varlen, cu_seqlens,
                         poison_attention_memory, require_built)
from test_mask_math_cpu import Window, kernel_window

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

BLOCK_M = BLOCK_N = 64  # the head_dim 256 backward's tiles (csrc/flash/config.hpp BwdTileConfig<256>)
MODE_ENV = "FAH_BWD_GQA_GROUP_CTA"
MODES = {"group-per-cta": "1", "head-per-cta": "0"}
FP16, BF16 = torch.float16, torch.bfloat16
DTYPE_IDS = {FP16: "fp16", BF16: "bf16"}


def m_block_ranges(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1), **_):
    """[(m_block_min, m_block_max)] per key block: the query tiles its CTA runs, by test_mask_math_cpu's port of
    csrc/flash/common/mask.hpp (kernel_window, Window.m_block_range) at the head_dim 256 backward's tiles. Used to
    assert what each case exercises."""
    left, right = kernel_window(window_size[0], 0 if causal else window_size[1], seqlen_q, seqlen_k)
    window = Window(BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, left, right)
    return [window.m_block_range(n_block) for n_block in range(-(-seqlen_k // BLOCK_N))]


def tile_counts(seqlen_q, seqlen_k, **opts):
    return [hi - lo for lo, hi in m_block_ranges(seqlen_q, seqlen_k, **opts)]


def inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v, dtype, device="cuda", seed=0):
    """q, k, v, dout. Not uniform: every query row has its own scale in [0.5, 2), so rows (and tiles) range from flat
    to peaked softmax and their dQ differ in size; a tile's dQ landing in another's place changes the result."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, generator=g)
    q = q * (0.5 + 1.5 * torch.rand(batch, seqlen_q, nheads, 1, generator=g))
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, generator=g)
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim_v, generator=g)
    dout = torch.randn(batch, seqlen_q, nheads, head_dim_v, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]


def run(q, k, v, dout, passes, varlen=None, **opts):
    """(out, lse, [(dq, dk, dv) of each of `passes` backward passes through one forward]); varlen = (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k) runs attention_varlen. On a GPU the allocator is NaN-poisoned before the
    forward and before each pass (gpu_helpers.poison_attention_memory)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    poison = () if varlen is None else (varlen[0],)

    def poison_memory():
        if q.is_cuda:
            poison_attention_memory(q, v, *poison)

    poison_memory()
    if varlen is None:
        out, lse = attention(*leaves, return_lse=True, **opts)
    else:
        out, lse = attention_varlen(*leaves, *varlen, return_lse=True, **opts)
    grads = []
    for _ in range(passes):
        poison_memory()
        grads.append(tuple(g.detach() for g in torch.autograd.grad(out, leaves, dout, retain_graph=True)))
    return out.detach(), lse.detach(), grads


def repeatable(deterministic, one_key_block, dkv_in_registers):
    """The gradients that are one fixed sum per element, so that every pass must give the same bits: dQ with
    deterministic=True (ordered sums) or one key block (one addend into the zeroed accumulator); dK, dV with
    deterministic=True or when no fp32 sums over a GQA group's CTAs are involved (MHA, or one CTA per group)."""
    names = []
    if deterministic or one_key_block:
        names.append("dq")
    if deterministic or dkv_in_registers:
        names += ["dk", "dv"]
    return names


def _ref_opts(opts):
    return {key: value for key, value in opts.items() if key != "deterministic"}


def check_passes(result, q, k, v, dout, name, same_bits, cu=None, **opts):
    """result = run()'s (out, lse, passes). The first pass by the rule (out, LSE, dQ, dK, dV, shapes, dtypes; varlen:
    rows that see no key exactly 0); in the later passes the gradients named in `same_bits` bit for bit the first's,
    the others by the rule."""
    out, lse, passes = result
    opts = _ref_opts(opts)
    if cu is None:
        check_attention(out, lse, passes[0], q, k, v, dout, name, **opts)
    else:
        check_attention_varlen(out, lse, passes[0], q, k, v, dout, *cu, name, **opts)
    if len(passes) == 1:
        return
    ref = naive = None
    for i, grads in enumerate(passes[1:], start=1):
        for j, (gname, first, g) in enumerate(zip(GRAD_NAMES, passes[0], grads)):
            if gname in same_bits:
                if not torch.equal(bits(first), bits(g)):
                    changed = int((bits(first) != bits(g)).sum())
                    raise AssertionError(f"{name}: {gname} of pass {i} differs from pass 0 in {changed} elements "
                                         f"(a single fixed sum per element: a race?)")
                continue
            if ref is None:
                if cu is None:
                    ref = attention_ref_grads(q, k, v, dout, **opts)
                    naive = attention_ref_grads(q, k, v, dout, upcast=False, **opts)
                else:
                    ref = attention_varlen_ref_grads(q, k, v, dout, *cu, **opts)
                    naive = attention_varlen_ref_grads(q, k, v, dout, *cu, upcast=False, **opts)
            assert_close_by_rule(g, ref[j], naive[j], f"{name} pass {i} {gname}")


def set_mode(monkeypatch, mode):
    monkeypatch.setenv(MODE_ENV, MODES[mode])


def assert_same_dq(name, a, b):
    # Not a promise of the API (the GQA knob may change gradients' bits): it holds because neither dQ's per-tile code
    # nor its summation order depends on heads_per_cta (config.hpp bwd_dq_lanes, kernel_bwd_sm90.hpp dq_turn, the
    # workspace rows of bwd_workspace_row). A change that breaks that invariant must revisit these checks.
    if not torch.equal(bits(a), bits(b)):
        raise AssertionError(f"{name}: dQ differs between the GQA modes in {int((bits(a) != bits(b)).sum())} elements "
                             "(each head's dQ is the same per-tile code and the same ordered sum in both)")


# ------------------------------------------------------------------ FL: many, one or two query tiles per key block


# (batch, nheads, seqlen_q, seqlen_k, opts): 64, 32 and 47 tiles per CTA
MANY_TILES = [
    (2, 2, 4096, 64, {}),
    (1, 4, 2047, 113, {}),  # two key blocks, the second of 49 keys
    (2, 2, 3001, 40, dict(softcap=30.0)),  # one partial key block; the softcap consumer
]
MANY_IDS = ["4096x64", "2047x113", "3001x40-softcap"]


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", MANY_TILES, ids=MANY_IDS)
def test_many_query_tiles_per_key_block(case, dtype, deterministic):
    """FL (flash-attention#359, DeepEP#657, cudnn-frontend#396, triton#8554, flash-attention#1306): head_dim 256, MHA,
    each key block's CTA runs 32-64 query tiles through its two Q stages; three backward passes through one forward,
    the first by the rule, dK and dV of the others bit for bit the first's (one CTA writes them), dQ too with one key
    block or deterministic=True, else by the rule."""
    batch, nheads, seqlen_q, seqlen_k, opts = case
    require_built(256, dtype)
    counts = tile_counts(seqlen_q, seqlen_k, **opts)
    assert min(counts) >= 32, counts
    q, k, v, dout = inputs(batch, seqlen_q, seqlen_k, nheads, nheads, 256, 256, dtype, seed=seqlen_q)
    result = run(q, k, v, dout, 3, deterministic=deterministic, **opts)
    same = repeatable(deterministic, len(counts) == 1, dkv_in_registers=True)
    check_passes(result, q, k, v, dout, f"FL {seqlen_q}x{seqlen_k} {DTYPE_IDS[dtype]}", same, **opts)


# (batch, nheads, seqlen_q, seqlen_k, opts, dtype): every key block's CTA runs one or two query tiles
FEW_TILES = [
    (3, 2, 1, 700, {}, FP16),  # one tile of one row: only the after-loop wait
    (2, 2, 64, 700, dict(causal=True), BF16),  # one full tile
    (2, 2, 65, 700, {}, FP16),  # two tiles, the second of one row: one in-loop wait
    (2, 2, 128, 641, dict(causal=True), BF16),  # two tiles, the last key block (one key) one, m_block_min 1
    (4, 2, 127, 65, dict(softcap=20.0), BF16),  # two tiles against two key blocks, the second of one key
]
FEW_IDS = ["1x700", "64x700-causal", "65x700", "128x641-causal", "127x65-softcap"]


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("case", FEW_TILES, ids=FEW_IDS)
def test_one_or_two_query_tiles_per_key_block(case, deterministic):
    """FL, the short end: 11 key blocks (or 2) whose CTAs run exactly one or two query tiles, so the wait for the
    writer happens only after the loop or once inside it; three passes, by the rule and bit for bit as above."""
    batch, nheads, seqlen_q, seqlen_k, opts, dtype = case
    require_built(256, dtype)
    counts = tile_counts(seqlen_q, seqlen_k, **opts)
    assert set(counts) <= {1, 2}, counts
    q, k, v, dout = inputs(batch, seqlen_q, seqlen_k, nheads, nheads, 256, 256, dtype, seed=seqlen_q)
    result = run(q, k, v, dout, 3, deterministic=deterministic, **opts)
    same = repeatable(deterministic, len(counts) == 1, dkv_in_registers=True)
    check_passes(result, q, k, v, dout, f"FL {seqlen_q}x{seqlen_k} {DTYPE_IDS[dtype]}", same, **opts)


# ------------------------------------------------- FM: per-key-block query ranges under masks, seqlen_q != seqlen_k


# (seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v, opts, dtype)
MASKS = [
    (300, 1000, 3, 3, 256, 256, dict(causal=True), FP16),  # m_block_min 0-4: 5, 4, 3, 2, 1 tiles
    (1000, 300, 4, 2, 200, 200, dict(causal=True), BF16),  # rows 0-699 see no key; m_block_min 10-14
    (200, 1200, 3, 3, 248, 248, dict(window_size=(100, 0)), FP16),  # 14 key blocks without a tile, then 1, 2, 3, 3, 2
    (1500, 400, 4, 2, 256, 128, dict(window_size=(30, 50)), BF16),  # rows 0-1049 see no key; v narrower
    (700, 333, 3, 3, 128, 256, dict(window_size=(3, 2), softcap=15.0), FP16),  # q / k 128 on the 256 kernel
]
MASK_IDS = ["300x1000-causal", "1000x300-causal-d200-gqa", "200x1200-window-d248", "1500x400-window-d256v128-gqa",
            "700x333-window-softcap-d128v256"]


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("case", MASKS, ids=MASK_IDS)
def test_query_range_differs_per_key_block(case, deterministic):
    """FM (flash-attention#1766, FBGEMM#4982, flash-attention#1870, vllm#26026, tilelang#2567): batch 2, causal masks
    and windows aligned bottom-right with seqlen_q != seqlen_k, so that m_block_min differs between key blocks, and
    some key blocks run no tile or one; two passes: the first by the rule, the second bit for bit where the sums are
    fixed (deterministic; dK, dV of MHA), else by the rule."""
    seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v, opts, dtype = case
    require_built(max(head_dim, head_dim_v), dtype)
    ranges = m_block_ranges(seqlen_q, seqlen_k, **opts)
    assert len({lo for lo, hi in ranges}) > 1, ranges  # m_block_min differs between key blocks
    q, k, v, dout = inputs(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v, dtype, seed=seqlen_k)
    result = run(q, k, v, dout, 2, deterministic=deterministic, **opts)
    same = repeatable(deterministic, len(ranges) == 1, dkv_in_registers=nheads == nheads_k)
    check_passes(result, q, k, v, dout, f"FM {seqlen_q}x{seqlen_k} d{head_dim}/{head_dim_v}", same, **opts)


# ------------------------------------------------------------ FN: a GQA group's query heads run by one CTA in turn


# (nheads, nheads_k, seqlen_q, seqlen_k, head_dim, head_dim_v, opts, dtype)
GROUPS = [
    (6, 2, 1, 57, 256, 256, {}, BF16),  # one tile per head: every in-loop wait is a head change
    (8, 2, 200, 70, 256, 256, dict(causal=True), FP16),  # m_block_min 2 and 3 (rows 0-129 see no key); 2, 1 tiles
    (4, 1, 150, 64, 200, 200, {}, BF16),  # MQA, one key block, 3 tiles per head: the Q stage parity flips per head
    (6, 3, 257, 200, 256, 128, dict(window_size=(64, 64)), FP16),  # 3, 4, 4, 3 tiles per head; v narrower
]
GROUP_IDS = ["6-2-1x57", "8-2-200x70-causal", "4-1-150x64-d200", "6-3-257x200-window-d256v128"]


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("case", GROUPS, ids=GROUP_IDS)
def test_group_cta_runs_heads_in_turn(case, deterministic, monkeypatch):
    """FN (FlashMLA#57, flash-attention#2035, TransformerEngine#3216): batch 2, the same call with one CTA per group
    (FAH_BWD_GQA_GROUP_CTA=1: the heads run one after another through one Q-stage ring and one writer) and one CTA per
    query head (=0), two passes each: every run by the rule; dK, dV of the group CTA bit for bit across passes (kept
    in registers), dQ too with one key block or deterministic=True, and then also bit for bit across the modes."""
    nheads, nheads_k, seqlen_q, seqlen_k, head_dim, head_dim_v, opts, dtype = case
    require_built(max(head_dim, head_dim_v), dtype)
    counts = tile_counts(seqlen_q, seqlen_k, **opts)
    assert min(counts) >= 1, counts
    one_key_block = len(counts) == 1
    q, k, v, dout = inputs(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim_v, dtype, seed=nheads)
    dq = {}
    for mode in MODES:
        set_mode(monkeypatch, mode)
        result = run(q, k, v, dout, 2, deterministic=deterministic, **opts)
        same = repeatable(deterministic, one_key_block, dkv_in_registers=mode == "group-per-cta")
        check_passes(result, q, k, v, dout, f"FN {nheads}/{nheads_k} {seqlen_q}x{seqlen_k} {mode}", same, **opts)
        dq[mode] = result[2][0][0]
    if deterministic or one_key_block:
        assert_same_dq(f"FN {nheads}/{nheads_k} {seqlen_q}x{seqlen_k}", *dq.values())


# --------------------------------------------------- FO: varlen with empty, one-token and one-tile sequences


# (1 query, 64 keys): one tile; (0, 300): key blocks without a tile; (513, 65): causal, rows 0-447 see no key and the
# two key blocks run 2 and 1 tiles (m_block_min 7, 8); under the window rows 0-439 see no key, 3 and 2 tiles
# (m_block_min 6, 7); (64, 0): rows that see no key, no CTA; (1, 1); (130, 700): 3 tiles per key block but 2 for the
# last (causal), or none for the first 8 key blocks and 1, 2, 3 for the last (window).
VARLEN_LQ = [1, 0, 513, 64, 1, 130]
VARLEN_LK = [64, 300, 65, 0, 1, 700]
# (head_dim, opts, dtype)
VARLEN_CASES = [(256, dict(causal=True), BF16), (248, dict(window_size=(40, 8)), FP16)]


def varlen_inputs(nheads, nheads_k, head_dim, dtype, device="cuda", seed=0):
    q, k, v, dout = inputs(1, sum(VARLEN_LQ), sum(VARLEN_LK), nheads, nheads_k, head_dim, head_dim, dtype,
                           device=device, seed=seed)
    return [t[0] for t in (q, k, v, dout)]


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=["d256-causal", "d248-window"])
def test_varlen_empty_and_one_token_sequences(case, deterministic, monkeypatch):
    """FO (flash-attention#1893, flash-attention#2482; classes FM, FN through attention_varlen): six sequences, 6 query
    heads on 2, both GQA modes, two passes each: by the rule (rows that see no key exactly 0), dK, dV of the group CTA
    bit for bit across passes, with deterministic=True every gradient, and dQ across the modes."""
    head_dim, opts, dtype = case
    require_built(head_dim, dtype)
    counts = [n for lq, lk in zip(VARLEN_LQ, VARLEN_LK) for n in tile_counts(lq, lk, **opts)]
    assert 0 in counts and 1 in counts and max(counts) > 2, counts  # key blocks with no tile, one, several
    q, k, v, dout = varlen_inputs(6, 2, head_dim, dtype, seed=head_dim)
    cu = (cu_seqlens(VARLEN_LQ), cu_seqlens(VARLEN_LK))
    dq = {}
    for mode in MODES:
        set_mode(monkeypatch, mode)
        result = run(q, k, v, dout, 2, varlen=(*cu, max(VARLEN_LQ), max(VARLEN_LK)), deterministic=deterministic,
                     **opts)
        same = repeatable(deterministic, False, dkv_in_registers=mode == "group-per-cta")
        check_passes(result, q, k, v, dout, f"FO varlen d{head_dim} {mode}", same, cu=cu, **opts)
        dq[mode] = result[2][0][0]
    if deterministic:
        assert_same_dq(f"FO varlen d{head_dim}", *dq.values())
