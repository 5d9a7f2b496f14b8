"""The kernels' tile-index math for masks (csrc/flash/common/block_range.hpp: kernel_window; mask.hpp:
Window::n_block_range, m_block_range, needs_mask, key_limits), ported line for line to Python and checked exhaustively
on CPU against the element-wise rule of DESIGN.md §2 (``flash_attn_hopper.testing.local_mask``):

- every visible (row, key) lies in a visited tile, from both sides (forward: key blocks of a query block; backward:
  query blocks of a key block), and every visited tile holds a visible element (cost follows the window);
- a tile in the interior run of ``interior_n_blocks`` / ``interior_m_blocks`` holds only visible elements (rows
  past seqlen_q excepted), and the runs are exact away from those rows;
- ``key_limits`` gives each row's visible keys within a tile exactly.

A port can drift from the C++; the GPU tests (tests/test_features_gpu.py) check the kernels themselves."""

import itertools

import pytest
import torch

from flash_attn_hopper.testing import local_mask


def ceil_div(a, b):
    return -(-a // b)


HEADROOM = 256  # kWindowHeadroom


def kernel_window(window_left, window_right, seqlen_q, seqlen_k):
    left = seqlen_k + HEADROOM if window_left < 0 or window_left > seqlen_k else window_left
    right = seqlen_q + HEADROOM if window_right < 0 or window_right > seqlen_q else window_right
    return left, right


class Window:
    def __init__(self, block_m, block_n, seqlen_q, seqlen_k, left, right):
        self.bm, self.bn, self.sq, self.sk, self.left, self.right = block_m, block_n, seqlen_q, seqlen_k, left, right

    def offset(self):
        return self.sk - self.sq

    def n_block_range(self, m_block):
        first_row = m_block * self.bm
        last_row = min(first_row + self.bm, self.sq) - 1
        lo = max(first_row + self.offset() - self.left, 0)
        hi = min(last_row + self.offset() + self.right + 1, self.sk)
        n_min = lo // self.bn  # C++ int division of a value >= 0
        return n_min, (n_min if hi <= lo else ceil_div(hi, self.bn))

    def m_block_range(self, n_block):
        first_key = n_block * self.bn
        last_key = min(first_key + self.bn, self.sk) - 1
        lo = max(first_key - self.offset() - self.right, 0)
        hi = min(last_key - self.offset() + self.left + 1, self.sq)
        m_min = lo // self.bm
        return m_min, (m_min if hi <= lo else ceil_div(hi, self.bm))

    def interior_n_blocks(self, m_block):
        first_row, last_row = m_block * self.bm, m_block * self.bm + self.bm - 1
        lo = ceil_div(max(last_row + self.offset() - self.left, 0), self.bn)
        hi = max(min(first_row + self.offset() + self.right + 1, self.sk), 0) // self.bn
        return lo, hi

    def interior_m_blocks(self, n_block):
        first_col, last_col = n_block * self.bn, n_block * self.bn + self.bn - 1
        lo = ceil_div(max(last_col - self.offset() - self.right, 0), self.bm)
        hi = 0 if last_col >= self.sk else max(first_col - self.offset() + self.left + 1, 0) // self.bm
        return lo, hi

    def key_limits(self, row, n_block):
        base = row + self.offset() - n_block * self.bn
        return base - self.left, min(base + self.right + 1, self.sk - n_block * self.bn)


def _check(block_m, block_n, seqlen_q, seqlen_k, window, causal):
    left, right = window
    if causal:
        right = 0
    visible = local_mask(seqlen_q, seqlen_k, (left, right))
    w = Window(block_m, block_n, seqlen_q, seqlen_k, *kernel_window(left, right, seqlen_q, seqlen_k))
    m_blocks, n_blocks = ceil_div(seqlen_q, block_m), ceil_div(seqlen_k, block_n)
    where = f"{block_m}x{block_n} seqlens {seqlen_q}x{seqlen_k} window {window} causal {causal}"

    def tile(m, n):
        return visible[m * block_m : (m + 1) * block_m, n * block_n : (n + 1) * block_n]

    full_rows = m_blocks * block_m  # the mask over whole tiles of rows, rows past seqlen_q included
    i = torch.arange(full_rows).unsqueeze(1)
    j = torch.arange(n_blocks * block_n).unsqueeze(0)
    diag = i + (seqlen_k - seqlen_q)
    # with the kernel's window (kernel_window): the same as the rule for real rows, and no masking of padding rows
    # where the rule is unbounded
    whole = (j < seqlen_k) & (j >= diag - w.left) & (j <= diag + w.right)

    def whole_tile(m, n):
        return whole[m * block_m : (m + 1) * block_m, n * block_n : (n + 1) * block_n]

    for m in range(m_blocks):
        n_min, n_max = w.n_block_range(m)
        lo, hi = w.interior_n_blocks(m)
        for n in range(n_blocks):
            inside = n_min <= n < n_max
            assert inside == bool(tile(m, n).any()), f"{where}: forward m_block {m} n_block {n} range ({n_min}, {n_max})"
            assert (lo <= n < hi) == bool(whole_tile(m, n).all()), f"{where}: forward interior ({lo}, {hi}) at {m}, {n}"
            if lo <= n < hi:
                t = tile(m, n)
                assert t.shape[1] == block_n and bool(t.all()), f"{where}: tile ({m}, {n}) is not interior"
            for r in range(m * block_m, min((m + 1) * block_m, seqlen_q)):
                key_lo, key_hi = w.key_limits(r, n)
                cols = torch.arange(min(block_n, seqlen_k - n * block_n))
                expect = visible[r, n * block_n : (n + 1) * block_n]
                assert torch.equal((cols >= key_lo) & (cols < key_hi), expect), f"{where}: key_limits row {r} n_block {n}"
    for n in range(n_blocks):
        m_min, m_max = w.m_block_range(n)
        lo, hi = w.interior_m_blocks(n)
        for m in range(m_blocks):
            assert (lo <= m < hi) == bool(whole_tile(m, n).all()), f"{where}: backward interior ({lo}, {hi}) at {m}, {n}"
            inside = m_min <= m < m_max
            assert inside == bool(tile(m, n).any()), f"{where}: backward n_block {n} m_block {m} range ({m_min}, {m_max})"


SEQLENS = [(1, 1), (1, 13), (13, 1), (7, 30), (30, 7), (16, 16), (33, 40), (40, 33)]
WINDOWS = [(-1, -1), (0, 0), (3, 1), (8, 0), (-1, 5), (6, -1), (20, 1000), (1000, 20), (2**31 - 1, 2**31 - 1)]


@pytest.mark.parametrize("block_m,block_n", [(4, 8), (8, 4), (8, 8), (16, 4)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tile_math_small(block_m, block_n, causal):
    for (seqlen_q, seqlen_k), window in itertools.product(SEQLENS, WINDOWS):
        _check(block_m, block_n, seqlen_q, seqlen_k, window, causal)


@pytest.mark.parametrize(
    "block_m,block_n,seqlen_q,seqlen_k,window",
    [
        (128, 128, 513, 700, (17, 3)),  # the GPU case, with the forward's tiles
        (192, 128, 513, 700, (17, 3)),  # head_dim 64 forward, 192-row tiles
        (192, 128, 1000, 1000, (-1, 0)),
        (192, 128, 300, 1000, (64, -1)),
        (64, 128, 513, 700, (128, 0)),  # the head_dim 128 backward's tiles
        (128, 80, 300, 100, (20, 1000)),  # head_dim 256 forward, window wider than the sequence
        (128, 128, 700, 513, (0, 0)),
        (64, 64, 1000, 1000, (-1, 5)),
    ],
)
def test_tile_math_kernel_tiles(block_m, block_n, seqlen_q, seqlen_k, window):
    _check(block_m, block_n, seqlen_q, seqlen_k, window, causal=False)


def test_kernel_window_clamps_unbounded_and_wide_sides():
    assert kernel_window(-1, -1, 10, 20) == (20 + HEADROOM, 10 + HEADROOM)
    assert kernel_window(25, 11, 10, 20) == (20 + HEADROOM, 10 + HEADROOM)
    assert kernel_window(20, 10, 10, 20) == (20, 10)
    assert kernel_window(3, 0, 10, 20) == (3, 0)


def bwd_workspace_row(cu_seqlens_q, nheads, rows_per_head, batch_idx, bidh, rounding=128):
    """Port of flash/common/seqlen.hpp bwd_workspace_row."""
    if cu_seqlens_q is not None:
        start = (cu_seqlens_q[batch_idx] + batch_idx * rounding) // rounding * rounding
        return bidh * rows_per_head + start
    return (batch_idx * nheads + bidh) * rows_per_head


@pytest.mark.parametrize(
    "lengths",
    [[0, 77, 0, 130, 5], [128] * 5, [1] * 40, [127, 129, 255, 257, 0, 0, 1], [300]],
)
def test_varlen_workspace_regions_disjoint_and_aligned(lengths):
    """Each sequence's backward workspace region (its rows rounded up to whole 128-row tiles, where the LSE/D bulk
    copies, the dQ chunks and the postprocess read) starts on a tile, stays inside the head's rows as the host sizes
    them (csrc/api/flash_api.cpp launch_bwd), and overlaps no other sequence's region; dQ chunks (32 x 128 floats)
    start on chunk boundaries for head_dim 64 and 128."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    batch, total_q, nheads = len(lengths), cu[-1], 3
    rows = ceil_div(total_q + batch * 128, 128) * 128
    for h in range(nheads):
        regions = []
        for b in range(batch):
            start = bwd_workspace_row(cu, nheads, rows, b, h)
            size = ceil_div(lengths[b], 128) * 128
            assert start % 128 == 0
            assert h * rows <= start and start + size <= (h + 1) * rows, (b, h, start, size, rows)
            for head_dim in (64, 128):
                assert start * head_dim % (32 * 128) == 0
            regions.append((start, start + size))
        regions.sort()
        for (a0, a1), (b0, b1) in zip(regions, regions[1:]):
            assert a1 <= b0, regions


def simulate_deterministic_dq(w, sms, decreasing=True, grid=None):
    """Lockstep model of the backward's deterministic dQ order (flash/bwd dq_turn and the kernel's launch order): CTAs
    launch in blockIdx order into `sms` slots (key block N-1-i for launch i when `decreasing`, else i); each walks its
    query blocks upwards and adds into tile m only when the tile's counter equals its turn (key blocks in decreasing
    order: n_max(m) - 1 - n; else increasing: n - n_min(m)). Returns the steps a CTA spent waiting in total, or None
    on a deadlock (no resident CTA can move and none can launch)."""
    n_blocks, m_blocks = ceil_div(w.sk, w.bn), ceil_div(w.sq, w.bm)
    if grid is not None:  # a grid of fewer key blocks than the sequence has (max_seqlen_k understated)
        n_blocks = grid
    order = list(range(n_blocks - 1, -1, -1)) if decreasing else list(range(n_blocks))
    counter = [0] * m_blocks
    todo = {n: list(range(*w.m_block_range(n))) for n in order}

    def turn(m, n):
        lo, hi = w.n_block_range(m)
        assert lo <= n < hi, (m, n, lo, hi)  # both sides agree on which tiles exist
        return min(hi, n_blocks) - 1 - n if decreasing else n - lo

    resident, launched, waits = [], 0, 0
    while launched < len(order) or resident:
        while len(resident) < sms and launched < len(order):
            resident.append(order[launched])
            launched += 1
        moved = False
        for n in list(resident):
            if not todo[n]:
                resident.remove(n)
                moved = True
                continue
            m = todo[n][0]
            if counter[m] == turn(m, n):
                counter[m] += 1
                todo[n].pop(0)
                moved = True
            else:
                waits += 1
        if not moved:
            return None
    for m in range(m_blocks):
        lo, hi = w.n_block_range(m)
        assert counter[m] == len(range(lo, min(hi, n_blocks)))
    return waits


@pytest.mark.parametrize("block_m,block_n", [(64, 128), (128, 128), (128, 64), (64, 64)])
@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,window,causal",
    [(1024, 1024, (-1, -1), True), (1000, 1300, (-1, -1), True), (1300, 1000, (-1, -1), True),
     (2048, 2048, (300, 0), False), (2048, 2048, (200, 200), False), (1024, 1024, (-1, -1), False)],
)
def test_deterministic_dq_order_is_deadlock_free_and_lets_causal_run_without_waits(block_m, block_n, seqlen_q,
                                                                                    seqlen_k, window, causal):
    """With key blocks launched last-first and adding in decreasing n_block order, a CTA only waits for CTAs launched
    before it, so even 1 or 2 SMs finish (no deadlock); with every CTA resident, causal and sliding-window masks make no
    CTA wait at all (the one nearest the diagonal goes first at every tile), where the increasing order made CTA n
    wait n steps."""
    left, right = window
    if causal:
        right = 0
    w = Window(block_m, block_n, seqlen_q, seqlen_k, *kernel_window(left, right, seqlen_q, seqlen_k))
    for sms in (1, 2, 5):
        assert simulate_deterministic_dq(w, sms) is not None, sms
    # A max_seqlen_k below the true length launches fewer key blocks: their sums are lost (as in the default mode) but
    # no CTA waits for a turn that never comes.
    assert simulate_deterministic_dq(w, 3, grid=max(1, ceil_div(seqlen_k, block_n) // 2)) is not None
    unlimited = ceil_div(seqlen_k, block_n)
    waits = simulate_deterministic_dq(w, unlimited)
    if causal or window[0] >= 0:
        assert waits == 0
        assert simulate_deterministic_dq(w, unlimited, decreasing=False) > 0  # what the old order cost

