"""The kernels' tile-index math for masks (csrc/flash/common/block_range.hpp: kernel_window; mask.hpp:
Window::n_block_range, m_block_range, interior_n_blocks, interior_m_blocks, key_limits, row_limits,
apply<kOneSided>), ported line for line to Python and checked exhaustively
on CPU against the element-wise rule of DESIGN.md §2 (``flash_attn_hopper.testing.local_mask``):

- every visible (row, key) lies in a visited tile, from both sides (forward: key blocks of a query block; backward:
  query blocks of a key block), and every visited tile holds a visible element (cost follows the window);
- a tile in the interior run of ``interior_n_blocks`` / ``interior_m_blocks`` holds only visible elements (rows
  past seqlen_q excepted), and the runs are exact away from those rows;
- ``key_limits`` gives each row's visible keys within a tile exactly;
- the forward's one-compare mask (``Window::apply<kOneSided>``) masks, per thread of the WGMMA accumulator layout,
  exactly what the two-sided test masks.

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
    def __init__(self, block_m, block_n, seqlen_q, seqlen_k, left, right, doc_start=None, doc_end=None):
        self.bm, self.bn, self.sq, self.sk, self.left, self.right = block_m, block_n, seqlen_q, seqlen_k, left, right
        self.doc_start, self.doc_end = doc_start, doc_end

    def offset(self):
        return self.sk - self.sq

    def documents(self):
        return self.doc_start is not None

    def doc_lo(self, i):
        return self.doc_start[max(min(i, self.sq - 1), 0)]

    def doc_hi(self, i):
        return self.doc_end[max(min(i, self.sq - 1), 0)]

    def n_block_range(self, m_block):
        first_row = m_block * self.bm
        last_row = min(first_row + self.bm, self.sq) - 1
        lo = max(first_row + self.offset() - self.left, 0)
        hi = min(last_row + self.offset() + self.right + 1, self.sk)
        if self.documents():
            lo, hi = max(lo, self.doc_lo(first_row)), min(hi, self.doc_hi(last_row))
        n_min = lo // self.bn  # C++ int division of a value >= 0
        return n_min, (n_min if hi <= lo else ceil_div(hi, self.bn))

    def m_block_range(self, n_block):
        first_key = n_block * self.bn
        last_key = min(first_key + self.bn, self.sk) - 1
        lo = max(first_key - self.offset() - self.right, 0)
        hi = min(last_key - self.offset() + self.left + 1, self.sq)
        if self.documents():
            lo, hi = max(lo, self.doc_lo(first_key)), min(hi, self.doc_hi(last_key))
        m_min = lo // self.bm
        return m_min, (m_min if hi <= lo else ceil_div(hi, self.bm))

    def interior_n_blocks(self, m_block):
        first_row, last_row = m_block * self.bm, m_block * self.bm + self.bm - 1
        lo = ceil_div(max(last_row + self.offset() - self.left, 0), self.bn)
        hi = max(min(first_row + self.offset() + self.right + 1, self.sk), 0) // self.bn
        if self.documents():
            lo, hi = max(lo, ceil_div(self.doc_lo(last_row), self.bn)), min(hi, self.doc_hi(first_row) // self.bn)
        return lo, hi

    def interior_m_blocks(self, n_block):
        first_col, last_col = n_block * self.bn, n_block * self.bn + self.bn - 1
        lo = ceil_div(max(last_col - self.offset() - self.right, 0), self.bm)
        hi = 0 if last_col >= self.sk else max(first_col - self.offset() + self.left + 1, 0) // self.bm
        if self.documents():
            lo, hi = max(lo, ceil_div(self.doc_lo(last_col), self.bm)), min(hi, self.doc_hi(first_col) // self.bm)
        return lo, hi

    def key_limits(self, row, n_block):
        base = row + self.offset() - n_block * self.bn
        lo, hi = base - self.left, min(base + self.right + 1, self.sk - n_block * self.bn)
        if self.documents():
            lo, hi = max(lo, self.doc_lo(row) - n_block * self.bn), min(hi, self.doc_hi(row) - n_block * self.bn)
        return lo, hi

    def row_limits(self, key, m_block):
        base = key - self.offset() - m_block * self.bm
        lo, hi = base - self.right, (base + self.left + 1 if key < self.sk else 0)
        if self.documents():
            lo, hi = max(lo, self.doc_lo(key) - m_block * self.bm), min(hi, self.doc_hi(key) - m_block * self.bm)
        return lo, hi


def document_bounds(document_ids):
    """Per position of one row: (first position of its document, one past the last), by brute force."""
    n = len(document_ids)
    start, end = [], []
    for i in range(n):
        a = i
        while a > 0 and document_ids[a - 1] == document_ids[i]:
            a -= 1
        b = i + 1
        while b < n and document_ids[b] == document_ids[i]:
            b += 1
        start.append(a)
        end.append(b)
    return start, end


def _check(block_m, block_n, seqlen_q, seqlen_k, window, causal, document_ids=None):
    left, right = window
    if causal:
        right = 0
    visible = local_mask(seqlen_q, seqlen_k, (left, right))
    docs = (None, None)
    if document_ids is not None:
        assert seqlen_q == seqlen_k == len(document_ids)
        docs = document_bounds(document_ids)
        ids = torch.tensor(document_ids)
        # runs of equal consecutive ids: number the runs
        run = torch.cat([torch.zeros(1, dtype=torch.long), (ids[1:] != ids[:-1]).long()]).cumsum(0)
        visible = visible & (run.unsqueeze(1) == run.unsqueeze(0))
    w = Window(block_m, block_n, seqlen_q, seqlen_k, *kernel_window(left, right, seqlen_q, seqlen_k), *docs)
    m_blocks, n_blocks = ceil_div(seqlen_q, block_m), ceil_div(seqlen_k, block_n)
    where = f"{block_m}x{block_n} seqlens {seqlen_q}x{seqlen_k} window {window} causal {causal} docs {document_ids}"

    def tile(m, n):
        return visible[m * block_m : (m + 1) * block_m, n * block_n : (n + 1) * block_n]

    full_rows = m_blocks * block_m  # the mask over whole tiles of rows, rows past seqlen_q included
    i = torch.arange(full_rows).unsqueeze(1)
    j = torch.arange(n_blocks * block_n).unsqueeze(0)
    diag = i + (seqlen_k - seqlen_q)
    # with the kernel's window (kernel_window): the same as the rule for real rows, and no masking of padding rows
    # where the rule is unbounded
    whole = (j < seqlen_k) & (j >= diag - w.left) & (j <= diag + w.right)
    whole_bwd = whole.clone()
    if document_ids is not None:
        # The forward's rows past seqlen_q take the last row's document (the kernels clamp the row); the backward
        # bounds rows by each key's document, which holds no row past seqlen_q (those tiles are never interior there).
        row, col = i.clamp(max=seqlen_q - 1), j.clamp(max=seqlen_k - 1)
        whole &= (j >= torch.tensor(docs[0])[row]) & (j < torch.tensor(docs[1])[row])
        whole_bwd &= (i >= torch.tensor(docs[0])[col]) & (i < torch.tensor(docs[1])[col])

    def whole_tile(m, n, mask=whole):
        return mask[m * block_m : (m + 1) * block_m, n * block_n : (n + 1) * block_n]

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
            assert (lo <= m < hi) == bool(whole_tile(m, n, whole_bwd).all()), f"{where}: backward interior ({lo}, {hi}) at {m}, {n}"
            inside = m_min <= m < m_max
            assert inside == bool(tile(m, n).any()), f"{where}: backward n_block {n} m_block {m} range ({m_min}, {m_max})"
            for key in range(n * block_n, min((n + 1) * block_n, seqlen_k)):
                row_lo, row_hi = w.row_limits(key, m)
                rows = torch.arange(min(block_m, seqlen_q - m * block_m))
                expect = visible[m * block_m : (m + 1) * block_m, key]
                assert torch.equal((rows >= row_lo) & (rows < row_hi), expect), f"{where}: row_limits key {key} m {m}"


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
        (128, 64, 300, 100, (20, 1000)),  # head_dim 256 forward, window wider than the sequence
        (128, 112, 300, 100, (20, 1000)),  # head_dim 192 forward
        (128, 128, 700, 513, (0, 0)),
        (64, 64, 1000, 1000, (-1, 5)),
    ],
)
def test_tile_math_kernel_tiles(block_m, block_n, seqlen_q, seqlen_k, window):
    _check(block_m, block_n, seqlen_q, seqlen_k, window, causal=False)


def _documents(lengths):
    ids = []
    for d, n in enumerate(lengths):
        ids += [d % 3] * n  # ids repeat (0, 1, 2, 0, ...): only runs of equal adjacent ids form a document
    return ids


DOCUMENTS = [[1], [5], [1, 1, 1], [3, 4], [7, 1, 8], [16, 16], [2, 13, 1, 4], [1, 30, 2], [9, 9, 9, 6]]


@pytest.mark.parametrize("block_m,block_n", [(4, 8), (8, 4), (8, 8), (16, 4)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tile_math_documents(block_m, block_n, causal):
    """Packed documents (document_ids): both sides' block ranges are the tiles holding a visible element, interior
    runs exact, key_limits / row_limits exact, with and without windows."""
    for lengths, window in itertools.product(DOCUMENTS, [(-1, -1), (0, 0), (3, 1), (-1, 2), (5, -1)]):
        ids = _documents(lengths)
        _check(block_m, block_n, len(ids), len(ids), window, causal, ids)


@pytest.mark.parametrize("block_m,block_n", [(128, 128), (192, 128), (64, 128), (128, 64), (128, 112)])
def test_tile_math_documents_kernel_tiles(block_m, block_n):
    for lengths, window, causal in [([300, 1, 212, 500], (-1, -1), True), ([77, 600, 130, 5], (-1, -1), False),
                                    ([1000], (-1, -1), True), ([129, 128, 127, 640], (100, 0), True)]:
        ids = _documents(lengths)
        _check(block_m, block_n, len(ids), len(ids), window, causal, ids)


def test_document_bounds_of_the_python_layer():
    """flash_attn_hopper.interface.document_bounds (torch ops, CPU here) against the brute force above."""
    from flash_attn_hopper.interface import document_bounds as torch_bounds

    rows = [_documents(lengths) for lengths in ([3, 4, 3, 1, 1], [12], [1] * 12, [5, 7])]
    got = torch_bounds(torch.tensor(rows))
    assert got.dtype == torch.int32 and got.shape == (4, 12, 2) and got.is_contiguous()
    for b, ids in enumerate(rows):
        start, end = document_bounds(ids)
        assert got[b, :, 0].tolist() == start and got[b, :, 1].tolist() == end
    assert torch_bounds(torch.zeros((3, 0), dtype=torch.int64)).shape == (3, 0, 2)


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



@pytest.mark.parametrize("block_m,block_n", [(64, 128), (128, 128)])
@pytest.mark.parametrize("causal", [True, False])
def test_deterministic_dq_order_with_documents(block_m, block_n, causal):
    """Deterministic dQ with packed documents: both sides' ranges agree (turn() asserts it) and no order deadlocks."""
    ids = _documents([300, 1, 212, 500, 64, 3])
    start, end = document_bounds(ids)
    n = len(ids)
    w = Window(block_m, block_n, n, n, *kernel_window(-1, 0 if causal else -1, n, n), start, end)
    for sms in (1, 2, 5, ceil_div(n, block_n)):
        assert simulate_deterministic_dq(w, sms) is not None, sms


def wgmma_thread_coords(block_m, block_n):
    """(rows, cols) of each consumer thread's fp32 accumulator elements for an SM90 WGMMA tile of block_m rows (one
    warpgroup per 64 rows) and block_n columns: thread t of a warpgroup holds rows 16 * warp + lane / 4 + {0, 8} and
    columns 8 * k + 2 * (lane % 4) + {0, 1} (CuTe's CLayout_64xN, what acc_rowcol() views as (rows, cols))."""
    t = torch.arange(block_m // 64 * 128)
    wg, warp, lane = t // 128, t % 128 // 32, t % 32
    first_row = 64 * wg + 16 * warp + lane // 4
    rows = torch.stack([first_row, first_row + 8], 1)  # (threads, 2)
    k = torch.arange(block_n // 8)
    cols = (8 * k.view(1, -1, 1) + 2 * (lane % 4).view(-1, 1, 1) + torch.tensor([0, 1]).view(1, 1, 2)).flatten(1)
    return rows, cols  # (threads, 2), (threads, block_n / 4), columns in acc_rowcol's order


def apply_one_sided(w, rows, cols, m_block, n_block):
    """Port of Window::apply<kOneSided = true> (mask.hpp): the masked elements (threads, rows, cols) of one tile."""
    col0 = cols[:, :1]  # c(0, 0): each thread's first column
    lim = [[w.key_limits(m_block * w.bm + int(r), n_block) for r in thread_rows] for thread_rows in rows]
    lo = torch.tensor([[a for a, _ in t] for t in lim]) - col0
    hi = torch.tensor([[b for _, b in t] for t in lim]) - col0
    left = (lo > 0).any(1)
    dc = (cols - col0).unsqueeze(1)  # (threads, 1, cols)
    right_only = dc >= hi.unsqueeze(2)
    both = (dc < lo.unsqueeze(2)) | right_only
    return torch.where(left.view(-1, 1, 1), both, right_only)


def _case_window(block_m, block_n, seqlen_q, seqlen_k, window, lengths):
    """The kernels' Window for a parametrized case; `lengths` (packed documents) replaces both seqlens."""
    docs = (None, None)
    if lengths is not None:
        ids = _documents(lengths)
        seqlen_q = seqlen_k = len(ids)
        docs = document_bounds(ids)
    return Window(block_m, block_n, seqlen_q, seqlen_k, *kernel_window(*window, seqlen_q, seqlen_k), *docs)


@pytest.mark.parametrize(
    "block_m,block_n,seqlen_q,seqlen_k,window,lengths",
    [
        (128, 128, 1024, 1024, (-1, 0), None),  # causal diagonal: the one-compare path
        (128, 128, 513, 700, (17, 3), None),  # left limits inside a block: the two-compare path
        (128, 128, 700, 513, (0, 0), None),
        (128, 128, 300, 1000, (64, -1), None),
        (128, 128, 1000, 300, (-1, 0), None),  # seqlen_q > seqlen_k: rows with no keys
        (128, 128, 77, 130, (-1, -1), None),  # only seqlen_k's cut
        (128, 64, 300, 100, (20, 1000), None),  # head_dim 256's tiles
        (128, 112, 513, 700, (-1, 5), None),  # head_dim 192's tiles
        (128, 128, 0, 0, (-1, 0), [300, 1, 212, 500]),  # documents, causal
        (128, 128, 0, 0, (100, 0), [129, 128, 127, 640]),
    ],
)
def test_one_sided_mask_matches_the_two_sided_rule(block_m, block_n, seqlen_q, seqlen_k, window, lengths):
    """The forward's one-compare mask (Window::apply<kOneSided>, kernels with two consumer warpgroups) masks exactly
    what the two-sided per-element test masks, on every boundary tile the forward visits, for every thread's
    elements of the WGMMA accumulator (as modelled by wgmma_thread_coords; the GPU tests check the real layout): its
    limits are taken relative to the thread's first column, and the left test is dropped only where no row of the
    thread has a left limit past that column. Both paths must run where the case has a left limit."""
    w = _case_window(block_m, block_n, seqlen_q, seqlen_k, window, lengths)
    rows, cols = wgmma_thread_coords(block_m, block_n)
    assert torch.equal(cols[:, 0], cols.min(1).values)  # the model's premise, which the kernel's layout shares
    one_compare = two_compare = 0  # threads on each path, over the masked (boundary) tiles
    for m in range(ceil_div(w.sq, block_m)):
        n_min, n_max = w.n_block_range(m)
        interior_lo, interior_hi = w.interior_n_blocks(m)
        for n in range(n_min, n_max):
            if interior_lo <= n < interior_hi:
                continue  # the kernels run these without a mask
            got = apply_one_sided(w, rows, cols, m, n)
            lim = torch.tensor([[w.key_limits(m * block_m + int(r), n) for r in t] for t in rows])
            c = cols.unsqueeze(1)
            expect = (c < lim[:, :, :1]) | (c >= lim[:, :, 1:])
            assert torch.equal(got, expect), f"m_block {m} n_block {n}"
            one_sided = ((lim[:, :, 0] - cols[:, :1]) <= 0).all(1)
            one_compare += int(one_sided.sum())
            two_compare += int((~one_sided).sum())
    assert one_compare > 0
    if window[0] >= 0 or lengths is not None:
        assert two_compare > 0


def apply_transposed_one_sided(w, keys, cols, m_block, n_block):
    """Port of Window::apply_transposed<kOneSided = true> (mask.hpp): the masked elements (threads, keys, rows) of one
    Sᵀ tile, or None where the thread takes the two-sided path (some key's upper row limit inside the block)."""
    col0 = cols[:, :1]
    lim = torch.tensor([[w.row_limits(n_block * w.bn + int(k), m_block) for k in thread_keys] for thread_keys in keys])
    upper = (lim[:, :, 1] < w.bm).any(1)
    lo = lim[:, :, 0] - col0
    masked = (cols - col0).unsqueeze(1) < lo.unsqueeze(2)
    return masked, upper


@pytest.mark.parametrize(
    "block_m,block_n,seqlen_q,seqlen_k,window,lengths",
    [
        (64, 128, 1024, 1024, (-1, 0), None),  # head_dim 128's backward tiles, causal: the one-compare path
        (128, 128, 1024, 1024, (-1, 0), None),  # head_dim 64's
        (64, 128, 513, 700, (17, 3), None),  # upper limits inside blocks: the two-sided path
        (64, 128, 513, 700, (20, 3), None),  # a thread's upper limit exactly kBlockM - 1 (fails "hi < kBlockM - 1")
        (64, 128, 700, 513, (-1, 0), None),  # seqlen_q > seqlen_k
        (64, 128, 77, 130, (-1, -1), None),  # seqlen_k's cut
        (128, 128, 300, 1000, (64, -1), None),
        (64, 128, 0, 0, (-1, 0), [300, 1, 212, 500]),  # documents, causal
    ],
)
def test_one_sided_transposed_mask_matches_the_two_sided_rule(block_m, block_n, seqlen_q, seqlen_k, window, lengths):
    """The backward's one-compare mask on Sᵀ (Window::apply_transposed<kOneSided>): where a thread takes it (no key
    of the thread has its upper row limit inside the block), it masks exactly what the two-sided test masks, on every
    boundary tile the backward visits (threads as modelled by wgmma_thread_coords: keys are the accumulator's rows,
    query rows its columns)."""
    w = _case_window(block_m, block_n, seqlen_q, seqlen_k, window, lengths)
    keys, cols = wgmma_thread_coords(block_n, block_m)
    one_compare = 0
    for n in range(ceil_div(w.sk, block_n)):
        m_min, m_max = w.m_block_range(n)
        interior_lo, interior_hi = w.interior_m_blocks(n)
        for m in range(m_min, m_max):
            if interior_lo <= m < interior_hi:
                continue
            got, upper = apply_transposed_one_sided(w, keys, cols, m, n)
            lim = torch.tensor([[w.row_limits(n * block_n + int(k), m) for k in t] for t in keys])
            c = cols.unsqueeze(1)
            expect = (c < lim[:, :, :1]) | (c >= lim[:, :, 1:])
            one = ~upper
            assert torch.equal(got[one], expect[one]), f"n_block {n} m_block {m}"
            one_compare += int(one.sum())
    if window[1] >= 0:  # a causal or right limit: some keys' rows start inside a block
        assert one_compare > 0


@pytest.mark.parametrize("window,causal", [((-2, 0), False), ((0, -5), False), ((2, 3), True)])
def test_reference_mask_refuses_what_attention_refuses(window, causal):
    """The reference's mask must not compute a result under a rule the kernels do not have (a new-user trial found
    window (-5, 0) accepted and causal with right side 3 silently read as 0)."""
    with pytest.raises(ValueError, match="window"):
        local_mask(8, 8, window, causal)
