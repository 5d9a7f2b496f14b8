"""The forward's tile height choice (csrc/flash/fwd/tile_choice.hpp), through the op that exposes it
(torch.ops.flash_attn_hopper.fwd_block_m, the function the launcher calls): no GPU needed, but the built extension is
(CI builds it). Checked against a Python port of the estimate over a grid of shapes and masks, on the cases that the
H200 measurements of session 5 decided (benchmarks/NOTES.md), and with FAH_FWD_BLOCK_M forcing each height. The GPU
side (the forced height is the kernel that runs, and passes the forward tests) is tests/test_fwd_tiles_gpu.py."""

import itertools
import os
import subprocess
import sys

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper import _ops

pytestmark = pytest.mark.skipif(
    not _ops.EXTENSION_LOADED, reason="the compiled extension is not built here (CI builds it; see README)"
)

H200_SMS = 132
HEADROOM = 256  # kWindowHeadroom
COST_FULL, COST_MASKED = 0.94, 0.95  # kFwd64WideCostFull / kFwd64WideCostMasked (csrc/flash/config.hpp)


def block_m(head_dim, seqlen_q, seqlen_k, causal=False, window=(-1, -1), batch=8, nheads=16, sms=H200_SMS,
            head_dim_v=None):
    return torch.ops.flash_attn_hopper.fwd_block_m(head_dim, head_dim if head_dim_v is None else head_dim_v, batch,
                                                   nheads, seqlen_q, seqlen_k, causal, window[0], window[1], sms)


def _key_block_range(bm, bn, sq, sk, left, right, m):
    offset = sk - sq
    first_row = m * bm
    last_row = min(first_row + bm, sq) - 1
    lo = max(first_row + offset - left, 0)
    hi = min(last_row + offset + right + 1, sk)
    n_min = lo // bn
    return n_min, (n_min if hi <= lo else -(-hi // bn))


def _pairs(bm, bn, sq, sk, left, right):
    blocks_m = -(-sq // bm)
    step = max(1, blocks_m // 256)
    ranges = (_key_block_range(bm, bn, sq, sk, left, right, m) for m in range(0, blocks_m, step))
    blocks = sum(hi - lo for lo, hi in ranges)
    return blocks * step * bm * bn


def _port(seqlen_q, seqlen_k, causal, window, batch, nheads, sms):
    """Python port of fwd_block_m_hdim64."""
    if seqlen_q <= 0 or seqlen_k <= 0:
        return 128
    wl, wr = window[0], (0 if causal else window[1])
    left = seqlen_k + HEADROOM if wl < 0 or wl > seqlen_k else wl
    right = seqlen_q + HEADROOM if wr < 0 or wr > seqlen_q else wr
    cost = COST_MASKED if (left < seqlen_k or right < seqlen_q) else COST_FULL

    def per_sm(bm):
        tiles = -(-seqlen_q // bm) * batch * nheads
        return _pairs(bm, 128, seqlen_q, seqlen_k, left, right) / min(tiles, sms)

    return 192 if cost * per_sm(192) <= per_sm(128) else 128


def test_matches_the_port_over_shapes_and_masks():
    seqlens = [0, 1, 77, 128, 192, 200, 513, 1024, 2048, 4096, 8192, 16384, 40000, 2**30 - 257]
    masks = [(False, (-1, -1)), (True, (-1, -1)), (False, (256, 256)), (True, (1024, 0)), (False, (-1, 5)),
             (False, (20, 1000000))]
    sizes = [(1, 1), (1, 4), (8, 16), (32, 32)]
    checked = set()
    for (sq, sk), (causal, window), (batch, nheads) in itertools.product(
            [(s, s) for s in seqlens] + [(300, 1000), (1000, 300), (1, 4096), (0, 100), (2**30 - 257, 7)], masks,
            sizes):
        got = block_m(64, sq, sk, causal, window, batch, nheads)
        assert got == _port(sq, sk, causal, window, batch, nheads, H200_SMS), (sq, sk, causal, window, batch, nheads)
        checked.add(got)
    assert checked == {128, 192}  # the grid reaches both heights


@pytest.mark.parametrize(
    "seqlen,causal,expected",
    [(512, True, 128), (1024, True, 128), (2048, True, 128), (4096, True, 128), (8192, True, 192),
     (16384, True, 192), (512, False, 128), (4096, False, 192), (8192, False, 192), (16384, False, 192)],
)
def test_h200_measured_cases(seqlen, causal, expected):
    """The paper grid's shapes (batch x seqlen = 16384 tokens, 32 heads of 64): the faster height in session 13's
    forced A/B (runs 3-4, both heights with the TMA-store epilogue), except the ties, not asserted: non-causal 1024
    (128 rows 407, 192 rows 413-415 TFLOP/s) and 2048 (436 vs 444-446)."""
    assert block_m(64, seqlen, seqlen, causal, batch=16384 // seqlen, nheads=32) == expected


def test_fewer_tiles_than_sms_take_the_narrow_tiles():
    # batch 1, 4 heads, 2048: 44 tiles of 192 rows or 64 of 128 on 132 SMs, one partial wave either way.
    assert block_m(64, 2048, 2048, batch=1, nheads=4) == 128
    assert block_m(64, 2048, 2048, batch=8, nheads=16) == 192


def test_a_last_block_mostly_past_seqlen_q_takes_the_narrow_tiles():
    assert block_m(64, 200, 200) == 128  # 384 rows of 192 against 256 of 128
    assert block_m(64, 1, 4096) == 128  # decoding: one row


def test_head_dims_and_other_kernels():
    for head_dim in (8, 40, 64):
        assert block_m(head_dim, 16384, 16384) == 192
    for head_dim, head_dim_v in ((128, 128), (72, 72), (64, 128), (256, 256), (192, 128)):
        assert block_m(head_dim, 16384, 16384, head_dim_v=head_dim_v) == 128


def test_bad_arguments_raise():
    with pytest.raises(RuntimeError, match="head_dim"):
        block_m(60, 128, 128)
    with pytest.raises(RuntimeError, match="num_sms"):
        block_m(64, 128, 128, sms=0)
    with pytest.raises(RuntimeError, match="batch and nheads"):
        block_m(64, 128, 128, batch=2**62, nheads=4)
    with pytest.raises(RuntimeError, match="seqlen_q and seqlen_k"):
        block_m(64, 2**30 - 256, 128)
    with pytest.raises(RuntimeError, match="window"):
        block_m(64, 128, 128, causal=True, window=(-1, 5))


@pytest.mark.parametrize("forced", ["128", "192", "100"])
def test_fah_fwd_block_m_forces_the_height(forced, tmp_path):
    # The child imports the package this process tested (installed, or the built source tree), from a neutral cwd.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_hopper.__file__)))
    code = (f"import sys; sys.path.insert(0, {package_root!r})\n"
            "import torch, flash_attn_hopper\n"
            "f = torch.ops.flash_attn_hopper.fwd_block_m\n"
            "print(f(64, 64, 8, 16, 512, 512, True, -1, -1, 132), f(64, 64, 8, 16, 8192, 8192, False, -1, -1, 132),"
            " f(128, 128, 8, 16, 512, 512, True, -1, -1, 132))\n")
    env = dict(os.environ, FAH_FWD_BLOCK_M=forced)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [int(x) for x in r.stdout.split()[-3:]]
    # An unrecognized value leaves the choice to the launcher (causal 512: 128 rows, non-causal 8192: 192 rows);
    # head_dim 128 has one height.
    assert got == {"128": [128, 128, 128], "192": [192, 192, 128], "100": [128, 192, 128]}[forced]


def decode_tile(tile, num_m_blocks, num_tiles, section_heads):
    """Port of FwdKernelTraits::decode_tile's order (kernel_fwd_sm90.hpp): (m_block, head_batch) of tile `tile`."""
    if section_heads > 0:
        per_section = section_heads * num_m_blocks
        section = tile // per_section
        first = section * section_heads
        heads = min(section_heads, num_tiles // num_m_blocks - first)
        within = tile - section * per_section
        step = within // heads
        return num_m_blocks - 1 - step, first + within - step * heads
    head_batch = tile // num_m_blocks
    return num_m_blocks - 1 - (tile - head_batch * num_m_blocks), head_batch


@pytest.mark.parametrize("num_m_blocks,head_batches", [(1, 1), (8, 128), (8, 5), (3, 7), (16, 64), (128, 16)])
@pytest.mark.parametrize("section_heads", [0, 1, 3, 16, 24, 1000])
def test_sectioned_tile_order_visits_every_tile_once_longest_first(num_m_blocks, head_batches, section_heads):
    """Every (m_block, head_batch) exactly once; within a section of head_batches the query blocks come last first (the
    causal tile with the most keys), and sections follow each other in head order (partial last section included)."""
    num_tiles = num_m_blocks * head_batches
    order = [decode_tile(t, num_m_blocks, num_tiles, section_heads) for t in range(num_tiles)]
    assert sorted(order) == sorted((m, h) for m in range(num_m_blocks) for h in range(head_batches))
    size = section_heads if section_heads > 0 else 1
    for t in range(1, num_tiles):
        (m0, h0), (m1, h1) = order[t - 1], order[t]
        if h1 // size == h0 // size:
            assert m1 <= m0, (t, order[t - 1], order[t])
        else:
            assert h1 // size == h0 // size + 1 and m1 == num_m_blocks - 1


def bwd_cta_coords(block_idx, grid_dim, section_pairs):
    """Port of the backward kernel's CTA renumbering (flash_bwd_sm90_kernel, Params::section_pairs): (n_block,
    head_group, batch) of the CTA at block_idx (x, y, z) of a grid (key blocks, head groups, batch), started in
    launch order (x fastest)."""
    (bx, by, bz), (gx, gy, gz) = block_idx, grid_dim
    if section_pairs > 0:
        pairs, per_section = gy * gz, section_pairs * gx
        cta = bx + gx * (by + gy * bz)
        section = cta // per_section
        first = section * section_pairs
        in_section = min(section_pairs, pairs - first)
        within = cta - section * per_section
        n_block = within // in_section
        pair = first + within - n_block * in_section
        return n_block, pair % gy, pair // gy
    return bx, by, bz


@pytest.mark.parametrize(
    "grid_dim", [(1, 1, 1), (16, 16, 8), (8, 5, 1), (3, 7, 2), (32, 4, 16), (128, 1, 16), (4, 3, 5)]
)
@pytest.mark.parametrize("section_pairs", [0, 1, 3, 8, 24, 1000])
def test_backward_sectioned_order_visits_every_cta_once_longest_first(grid_dim, section_pairs):
    """Every (key block, head group, batch) exactly once; in launch order, within a section of pairs (pair = head group
    + groups * batch) the key blocks come in increasing order (under a causal mask key block 0 sees the most query
    blocks), and sections follow each other (partial last section included); a section of one pair is the grid's
    own order."""
    gx, gy, gz = grid_dim
    launch = [(x, y, z) for z in range(gz) for y in range(gy) for x in range(gx)]  # x fastest
    order = [bwd_cta_coords(b, grid_dim, section_pairs) for b in launch]
    assert sorted(order) == sorted(launch)
    size = section_pairs if section_pairs > 0 else 1
    pair = [y + gy * z for _, y, z in order]
    for c in range(1, len(order)):
        (n0, p0), (n1, p1) = (order[c - 1][0], pair[c - 1]), (order[c][0], pair[c])
        if p1 // size == p0 // size:
            assert n1 >= n0, (c, order[c - 1], order[c])
        else:
            assert p1 // size == p0 // size + 1 and n1 == 0
    if section_pairs == 1:
        assert order == launch
