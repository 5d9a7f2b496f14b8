"""Thirtieth round of the bug hunt (tests/bug_report_sources.md, "Thirtieth round"), GPU part.

Focus: the block grids of the kernels that no earlier round aimed at. Each pass decides, per tile, which key blocks to
visit and which of them to run without a mask (the "interior": every row of the tile sees every key of the block) from
the mask's bounds at the tile's first and last rows (csrc/flash/common/mask.hpp, Window::n_block_range /
interior_n_blocks in the forward, m_block_range / interior_m_blocks in the backward), each at its own granularity
(csrc/flash/config.hpp): the forward's 128-row tiles against 128-key blocks (head_dim 64 with documents, 96, 128),
112-key blocks (head_dim 136-192) or 64-key blocks (200-256); the backward's 128-row x 128-key (head_dim <= 64),
64 x 128 (72-128) or 64 x 64 (136-256) blocks. Class FR (twenty-eighth round) put causal, window and seqlen_k edges
at multiples of the 128-key block +-1 for head_dim 64, 96 and 128; the document masks and the 112-key blocks were left.

FU: packed documents (attention's document_ids) whose boundaries lie one before, on and one after multiples of every
block size the call's two passes use, chosen so that each grid has boundaries of its own (a multiple of 64 that is no
multiple of 128 reaches only the backward's 64-row blocks; one of 112 only head_dim 192's forward key blocks), with
long documents whose start and end sit on those grids around whole interior tiles. A pass that takes a block range or
an interior block at another granularity than its own, or rounds a document bound the wrong way, attends across a
boundary or drops a key at it, in one pass only. Head dims 96, 192 and the DeepSeek pair 192 / 128 had never run with
documents (tests/test_documents_gpu.py runs 64, 128, 256). Dao-AILab/flash-attention#2623 (SM90 block-sparse
attention at head_dim 64: the forward's 192-row tiles against the backward's 128-row blocks gave an exact forward and
gradients 150-700x off, silently), Dao-AILab/flash-attention#2429 (head_dim 192 / 128: forward tile_n 128, backward
96, so one pass's block mask did not fit the other), pytorch/pytorch#182593 (a comment there: moving FlexAttention's
full blocks into the partial list, a semantically equal mask, changed the output). Every run by the rule (out, LSE,
dQ, dK, dV, from NaN-poisoned memory); rows that see exactly one key (a document's first row under causal, a one-token
document's row) must return that key's V row bit for bit, which a single leaked or dropped key breaks at once.

FV: head_dim 136-192 (the DeepSeek 192 / 128 pair included) runs the one forward configuration whose key block is not
a power of two: 112 keys (csrc/flash/config.hpp FwdTileConfig<192>, no split mask loop, one CTA per tile). Edges at
multiples of 112 +-1: seqlen_k (the last block one key short, full, or of one key), the causal diagonal of the first
tile (a bottom-right offset of 224 +- 1), a 128-row tile whose diagonal crosses three 112-key blocks, a window's right
edge from a tile's first row and its left edge from a tile's last row with interior blocks above it; MHA / GQA / MQA,
head_dim_v 128 beside 192, head_dim 136 with bf16 softcap 30 (the fixed-maximum softmax). Dao-AILab/flash-attention
#2329 (a bug of the causal loop that only a configuration-specific key block exposed: tile_n 64 at head_dim > 64 put
two or more masked blocks on the diagonal and the running max and sum were reset at each), ROCm/aiter#2393 (an
attention kernel that failed once its block size was not a power of two). Out, LSE, dQ, dK, dV by the rule.

Inputs are plain Gaussian from fixed seeds (never zeros), batch 2, 4 query heads. No document has two or three tokens
(docs/conventions.md: the rule's limit at very short key ranges with few query rows).

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py: "no CUDA GPU: GPU tests need an sm90
GPU (H100/H200)"), and per test when the build lacks a head_dim / dtype. tests/test_bug_reports_thirtieth_cpu.py runs
the premises of every case, the tile table against csrc/flash/config.hpp, and some of these bodies through the library's
Python layer with tests/cpu_stand_ins.py."""


import pytest
import torch

import flash_attn_hopper
import gpu_helpers
from flash_attn_hopper.interface import kernel_head_dim
from gpu_helpers import check_attention, require_built

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"  # (the CPU run of these bodies sets "cpu" and stands in for the ops)
FP16, BF16 = torch.float16, torch.bfloat16
R_VARIANTS = (-1, 0, 1)  # each edge one before, on and one after a block multiple
BATCH, NHEADS = 2, 4

# (rows, keys) of a tile, by kernel head_dim (csrc/flash/config.hpp; test_bug_reports_thirtieth_cpu.py reads them back):
# the forward with documents (head_dim 64: FwdTileConfig64Narrow, which documents always take,
# csrc/flash/fwd/launch_fwd_sm90.hpp; 96-256: FwdTileConfig<96/128/192/256>) and the backward (BwdTileConfig).
FWD_TILES = {64: (128, 128), 96: (128, 128), 128: (128, 128), 192: (128, 112), 256: (128, 64)}
BWD_TILES = {64: (128, 128), 128: (64, 128), 256: (64, 64)}


def kernel_tiles(head_dim, head_dim_v):
    """(forward tile, backward tile) of the kernels that run this pair (the larger head_dim picks them)."""
    width = max(head_dim, head_dim_v)
    return FWD_TILES[kernel_head_dim(width)], BWD_TILES[kernel_head_dim(width, backward=True)]


def poison(q, v):
    """NaN into the caching allocator at the sizes the next forward or backward allocates."""
    gpu_helpers.poison_attention_memory(q, v)


def gaussian(shape, g, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def run_and_check(q, k, v, dout, name, dlse=None, deterministic=False, **opts):
    """Forward and backward (through out, and through the LSE when dlse is given) from NaN-poisoned memory; out, LSE,
    dQ, dK, dV by the rule against the float32 reference with the same options. Returns out."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    poison(q, v)
    out, lse = flash_attn_hopper.attention(*leaves, return_lse=True, deterministic=deterministic, **opts)
    poison(q, v)
    outputs, grads_out = ([out, lse], [dout, dlse]) if dlse is not None else ([out], [dout])
    grads = torch.autograd.grad(outputs, leaves, grads_out)
    check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, name, dlse=dlse, **opts)
    return out.detach()


# ------------------------------------------------ FU: document boundaries on the block grids of both passes

# Per forward kernel head_dim: the sequence length and the document boundaries of row 0 before the shift r (each is
# then at that multiple + r). Grids met: 64: 128 (both passes). 96 / 128: 128 (forward, backward keys) and 64 (the
# backward's query blocks: 64, 704 and 1216 are odd multiples). 192: 112 (forward keys: 112, 224, 672, 1120 lie on no
# multiple of 64), 64 (the backward: 704) and 128 (forward rows: 1024). 256: 64 (forward keys, backward: odd multiples)
# and 128 (forward rows: 1152). Long documents run from grid point to grid point around whole interior tiles:
# [256, 640) at 64; [128, 640) and [704, 1216) at 96 / 128; [224, 672) and [704, 1024) at 192; [320, 832) at 256.
FU_LAYOUTS = {
    64: (1250, (128, 256, 640, 768, 1024, 1152)),
    96: (1350, (64, 128, 640, 704, 1216, 1280)),
    128: (1350, (64, 128, 640, 704, 1216, 1280)),
    192: (1250, (112, 224, 672, 704, 1024, 1120)),
    256: (1200, (64, 192, 320, 832, 960, 1088, 1152)),
}
FU_CONFIGS = {  # name -> (head_dim, head_dim_v, dtype, attention-only options, LSE in the loss)
    "d64-fp16": (64, 64, FP16, {}, False),
    "d96-bf16-deterministic": (96, 96, BF16, {"deterministic": True}, False),
    "d128-fp16-lse": (128, 128, FP16, {}, True),
    "d192-bf16": (192, 192, BF16, {}, False),
    "d192v128-fp16-deterministic-lse": (192, 128, FP16, {"deterministic": True}, True),
    "d256-bf16": (256, 256, BF16, {}, False),
}
FU_NHEADS_K = 2


def fu_rows(head_dim, head_dim_v, r):
    """(seqlen, (row 0's boundaries, row 1's)): row 0 at the multiples + r, row 1 at the multiples - r with a one-token
    document at every other of them (so each run meets both signs, and rows that see one key without a causal mask)."""
    seqlen, multiples = FU_LAYOUTS[kernel_head_dim(max(head_dim, head_dim_v))]
    row0 = [m + r for m in multiples]
    row1 = sorted({m - r for m in multiples} | {m - r + 1 for m in multiples[::2]})
    return seqlen, (row0, row1)


def documents(bounds, seqlen):
    """[(start, end)] of one row's documents from its inner boundaries."""
    edges = [0, *bounds, seqlen]
    return list(zip(edges[:-1], edges[1:]))


def doc_ids(rows, seqlen, device=None):
    """(batch, seqlen) int32 document ids; ids repeat 0, 1, 2, 0, ... (runs of equal ids are the documents)."""
    ids = torch.empty(len(rows), seqlen, dtype=torch.int32)
    for b, bounds in enumerate(rows):
        for d, (s, e) in enumerate(documents(bounds, seqlen)):
            ids[b, s:e] = d % 3
    return ids.to(device or DEVICE)


def one_key_rows(rows, seqlen, causal):
    """(batch index, position) of the rows that see exactly one key: every one-token document's row and, under a
    causal mask, every document's first row."""
    return [(b, s) for b, bounds in enumerate(rows) for s, e in documents(bounds, seqlen) if causal or e - s == 1]


def _holds_whole_block(start, end, size):
    """Whether [start, end) holds a whole block of `size` positions of the grid that starts at 0."""
    first = -(-start // size) * size
    return first + size <= end


def fu_premises(head_dim, head_dim_v, r, seqlen, rows):
    """What each run is meant to exercise, asserted from the layout and the tile table: boundaries strictly inside the
    rows, documents of one token or of 16 and more; for every block size of the two passes a boundary at one of its
    multiples + r that lies on no other grid not dividing it; for each pass a document that starts or ends on the
    grid along which that pass's interior runs (the forward's key blocks, the backward's query blocks) and holds whole
    blocks of both its sizes (so that interior blocks exist and meet the edge)."""
    fwd, bwd = kernel_tiles(head_dim, head_dim_v)
    for bounds in rows:
        assert 0 < bounds[0] and bounds[-1] < seqlen and all(a < b for a, b in zip(bounds, bounds[1:])), bounds
        lengths = [e - s for s, e in documents(bounds, seqlen)]
        assert all(n == 1 or n >= 16 for n in lengths), lengths
    grids = sorted({*fwd, *bwd})
    for g in grids:
        own = [b for b in rows[0] if (b - r) % g == 0 and all((b - r) % h for h in grids if g % h)]
        assert own, f"head_dim {head_dim}/{head_dim_v} r {r}: no boundary on the {g} grid alone"
    for what, (block_m, block_n), edge in (("forward", fwd, fwd[1]), ("backward", bwd, bwd[0])):
        assert any(_holds_whole_block(s, e, block_m) and _holds_whole_block(s, e, block_n)
                   and ((s - r) % edge == 0 or (e - r) % edge == 0) for s, e in documents(rows[0], seqlen)), \
            f"head_dim {head_dim}/{head_dim_v} r {r}: no {what} interior against a document edge"
    assert one_key_rows(rows, seqlen, causal=False), "no one-token document"


def check_one_key_rows(out, v, rows, name):
    """Each row that sees one key returns that key's V row bit for bit (P is exactly 1 there; docs/performance.md,
    "O is normalised ..."; tests/test_fwd_boundary_gpu.py::test_one_key_rows_exact), in every query head of its
    group."""
    assert rows, f"{name}: the construction must have rows that see one key"
    b = torch.tensor([i for i, _ in rows], device=out.device)
    p = torch.tensor([j for _, j in rows], device=out.device)
    got = out[b, p]  # (rows, nheads, head_dim_v)
    expected = v[b, p].repeat_interleave(out.shape[2] // v.shape[2], dim=1)
    diff = (got.float() - expected.float()).abs()
    assert torch.equal(got, expected), (f"{name}: {int((diff > 0).any(-1).any(-1).sum())} of {len(rows)} one-key rows "
                                        f"are not their key's V row (max diff {diff.max().item():.3e})")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("config", list(FU_CONFIGS))
def test_document_boundaries_on_both_passes_block_grids(config, causal):
    """FU (Dao-AILab/flash-attention#2623, #2429, pytorch/pytorch#182593): documents packed in two rows of 1200-1350
    tokens whose boundaries lie at r = -1, 0, +1 from multiples of each block size of the forward and the backward
    that run this head_dim (fu_premises asserts which), GQA 4/2, causal or not; the deterministic backward on two
    configurations (its dQ turns follow block ranges that both sides must agree on, or a CTA waits forever) and a
    loss on the LSE on two. Out, LSE, dQ, dK, dV by the rule; one-key rows bit for bit their key's V row."""
    head_dim, head_dim_v, dtype, call_opts, lse_in_loss = FU_CONFIGS[config]
    require_built(max(head_dim, head_dim_v), dtype)
    for r in R_VARIANTS:
        seqlen, rows = fu_rows(head_dim, head_dim_v, r)
        fu_premises(head_dim, head_dim_v, r, seqlen, rows)
        name = f"FU {config} {'causal' if causal else 'full'} r={r:+d}"
        g = gpu_helpers.seeded_generator(name)
        q = gaussian((BATCH, seqlen, NHEADS, head_dim), g, dtype)
        k = gaussian((BATCH, seqlen, FU_NHEADS_K, head_dim), g, dtype)
        v = gaussian((BATCH, seqlen, FU_NHEADS_K, head_dim_v), g, dtype)
        dout = gaussian((BATCH, seqlen, NHEADS, head_dim_v), g, dtype)
        dlse = torch.randn(BATCH, NHEADS, seqlen, generator=g).to(DEVICE) if lse_in_loss else None
        out = run_and_check(q, k, v, dout, name, dlse=dlse, causal=causal, document_ids=doc_ids(rows, seqlen),
                            **call_opts)
        check_one_key_rows(out, v, one_key_rows(rows, seqlen, causal), name)


# ------------------------------------------------ FV: the 112-key blocks of head_dim 136-192's forward

FV_WIDTH = 192  # the forward kernel of head dims 136-192
FV_FAMILIES = ("seqlen_k_one_block", "seqlen_k_three_blocks", "causal_diagonal", "causal_three_blocks",
               "window_right", "window_left")
FV_CONFIGS = {  # name -> (head_dim, head_dim_v, dtype, nheads_k, options, scale of q and k)
    "d192-fp16-gqa": (192, 192, FP16, 2, {}, 1.0),
    "d192v128-bf16-mqa": (192, 128, BF16, 1, {}, 1.0),
    "d136-bf16-softcap30": (136, 136, BF16, 2, {"softcap": 30.0}, 3.0),  # fixed maximum; scores of deviation ~9
}


def fv_case(family, r):
    """(seqlen_q, seqlen_k, causal, window_size) of a family's variant r, for the 128-row tiles and 112-key blocks."""
    block_m, block_n = FWD_TILES[FV_WIDTH]
    if family == "seqlen_k_one_block":  # the only key block one key short, full, or a second block of one key
        return 200, block_n + r, False, (-1, -1)
    if family == "seqlen_k_three_blocks":
        return 130, 3 * block_n + r, False, (-1, -1)
    if family == "causal_diagonal":  # row 0 sees keys up to 2 * 112 + r (bottom-right offset)
        return 300, 300 + 2 * block_n + r, True, (-1, -1)
    if family == "causal_three_blocks":  # offset 100 + r: tile 0's diagonal (128 keys) crosses three key blocks
        return 250, 350 + r, True, (-1, -1)
    if family == "window_right":  # the first key row 0 does not see: 2 * 112 + r
        return 600, 600, False, (-1, 2 * block_n - 1 + r)
    if family == "window_left":  # the first key tile 3's last row sees: 3 * 112 + r; interior blocks above it
        return 700, 700, False, ((4 * block_m - 1) - 3 * block_n - r, -1)
    raise AssertionError(family)


def fv_premises(family, r, seqlen_q, seqlen_k, causal, window):
    """The edge each variant is meant to put at a multiple of 112 + r, computed from the tile sizes."""
    block_m, block_n = FWD_TILES[FV_WIDTH]
    assert block_n % 64 != 0 and block_m % block_n != 0, "not the non-power-of-two block this class is about"
    offset = seqlen_k - seqlen_q
    if family.startswith("seqlen_k"):
        edge = seqlen_k  # one past the last key
    elif family == "causal_diagonal":
        assert causal
        edge = offset  # row 0's last visible key
    elif family == "causal_three_blocks":
        assert causal and (offset + block_m - 1) // block_n - offset // block_n == 2, "diagonal not over 3 blocks"
        return
    elif family == "window_right":
        edge = 0 + offset + window[1] + 1  # the first key row 0 does not see
    elif family == "window_left":
        last_row = 4 * block_m - 1
        assert last_row < seqlen_q and window[1] == -1
        edge = last_row + offset - window[0]  # the first key the tile's last row sees
        assert -(-edge // block_n) < seqlen_k // block_n, "no interior block above the left edge"
    else:
        raise AssertionError(family)
    assert (edge - r) % block_n == 0 and (edge - r) % 64 != 0, (family, r, edge)


@pytest.mark.parametrize("family", FV_FAMILIES)
@pytest.mark.parametrize("config", list(FV_CONFIGS))
def test_non_power_of_two_key_blocks_at_their_edges(config, family):
    """FV (Dao-AILab/flash-attention#2329, ROCm/aiter#2393, Dao-AILab/flash-attention#2429): head_dim 136-192's
    forward (112-key blocks, 128-row tiles: asserted through fwd_block_m) with each family's edge at r = -1, 0, +1 from
    a multiple of 112; batch 2, 4 query heads on 2 or 1. Out, LSE, dQ, dK, dV by the rule (the backward runs on the
    head_dim 256 kernel)."""
    head_dim, head_dim_v, dtype, nheads_k, options, scale = FV_CONFIGS[config]
    require_built(max(head_dim, head_dim_v), dtype)
    assert kernel_head_dim(max(head_dim, head_dim_v)) == FV_WIDTH
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count if DEVICE == "cuda" else 132
    for r in R_VARIANTS:
        seqlen_q, seqlen_k, causal, window = fv_case(family, r)
        fv_premises(family, r, seqlen_q, seqlen_k, causal, window)
        rows = torch.ops.flash_attn_hopper.fwd_block_m(head_dim, head_dim_v, BATCH, NHEADS, seqlen_q, seqlen_k, causal,
                                                        window[0], 0 if causal else window[1], sms)
        assert rows == FWD_TILES[FV_WIDTH][0], f"the forward now runs {rows}-row tiles here"
        name = f"FV {config} {family} r={r:+d}"
        g = gpu_helpers.seeded_generator(name)
        q = gaussian((BATCH, seqlen_q, NHEADS, head_dim), g, dtype, scale)
        k = gaussian((BATCH, seqlen_k, nheads_k, head_dim), g, dtype, scale)
        v = gaussian((BATCH, seqlen_k, nheads_k, head_dim_v), g, dtype)
        dout = gaussian((BATCH, seqlen_q, NHEADS, head_dim_v), g, dtype)
        run_and_check(q, k, v, dout, name, causal=causal, window_size=window, **options)
