"""The ops' doc_bounds as the deterministic backward reads them (csrc/api/flash_api.cpp doc_bounds_partition).

Found by a static audit after round 37's misaligned bounds (tests/bug_report_sources.md, "Thirty-seventh round"): the
deterministic backward's dQ turns count the key blocks that a query block's row-side hull of document bounds reaches,
while each key block visits the query blocks of its own key-side hull. For bounds made from document ids the two
agree; for other values given to a direct op call (say (start, length) pairs instead of (start, end)) a key block
counted in a turn never came, and the backward spun forever. The deterministic backward now reads the bounds as the
runs of equal consecutive pairs of each row (a partition, identical to bounds made from ids).

Checked here on CPU tensors (the op doc_bounds_partition: ATen ops on CPU and meta tensors, the reference for its CUDA
kernel, which tests/test_doc_bounds_partition_gpu.py compares with it): the
identity on interface.document_bounds of random ids; on arbitrary values, the runs of equal pairs by brute force; the
hulls of every query block and key block agreeing at the kernels' block sizes, which the raw bad bounds violate (the
premise); the input left as it was; meta tensors. tests/test_doc_bounds_partition_gpu.py runs the backward on them.
Needs the compiled extension (the op), and skips without it."""

import pytest
import torch

from flash_attn_hopper import _ops
from flash_attn_hopper.interface import document_bounds

needs_ops = pytest.mark.skipif(
    not _ops.EXTENSION_LOADED, reason="the compiled extension is not built here (CI builds it; see README)"
)
pytestmark = needs_ops

BLOCKS = ((64, 128), (128, 128), (80, 128), (128, 64))  # (query, key) block heights of the backward's tiles


def partition(bounds):
    return torch.ops.flash_attn_hopper.doc_bounds_partition(bounds)


def runs_of_equal_pairs(bounds):
    """Brute force: per row, the [start, end) of each run of equal consecutive (doc_start, doc_end) pairs."""
    batch, seqlen, _ = bounds.shape
    out = torch.empty_like(bounds)
    for b in range(batch):
        pairs = [tuple(p) for p in bounds[b].tolist()]
        start = 0
        for i in range(1, seqlen + 1):
            if i == seqlen or pairs[i] != pairs[i - 1]:
                out[b, start:i] = torch.tensor([start, i], dtype=torch.int32)
                start = i
    return out


def hulls_agree(bounds, block_m, block_n):
    """Whether, in every row, query block m's row-side hull [doc_start(first row), doc_end(last row)) reaches key block
    n exactly when key block n's key-side hull [doc_start(first key), doc_end(last key)) reaches query block m (the
    clamped reads of csrc/flash/common/mask.hpp), at query / key block heights block_m / block_n."""
    batch, seqlen, _ = bounds.shape

    def hull(b, j, block, other):
        first, last = j * block, min((j + 1) * block, seqlen) - 1
        lo = min(max(int(bounds[b, first, 0]), 0), seqlen)
        hi = min(max(int(bounds[b, last, 1]), 0), seqlen)
        return {i // other for i in range(lo, hi)}

    return all((n in hull(b, m, block_m, block_n)) == (m in hull(b, n, block_n, block_m))
               for b in range(batch) for m in range(-(-seqlen // block_m)) for n in range(-(-seqlen // block_n)))


def random_ids(generator, batch, seqlen, max_docs):
    """(batch, seqlen) int64 document ids: runs of random lengths, ids that repeat non-adjacently too."""
    ids = torch.empty(batch, seqlen, dtype=torch.int64)
    for b in range(batch):
        cuts = torch.randint(1, max(seqlen, 2), (int(torch.randint(0, max_docs, (1,), generator=generator)),),
                             generator=generator).unique().tolist() if seqlen > 1 else []
        doc = torch.zeros(seqlen, dtype=torch.int64)
        for c in cuts:
            doc[c:] += 1
        ids[b] = doc % 3  # ids 0, 1, 2 recur: runs, not id values, make documents
    return ids


@pytest.mark.parametrize("batch,seqlen,max_docs", [(1, 1, 1), (2, 0, 1), (3, 777, 9), (2, 512, 1), (1, 300, 300),
                                                   (4, 129, 40)])
def test_identity_on_bounds_made_from_document_ids(batch, seqlen, max_docs):
    generator = torch.Generator().manual_seed(seqlen * 31 + batch)
    bounds = document_bounds(random_ids(generator, batch, seqlen, max_docs))
    kept = bounds.clone()
    got = partition(bounds)
    assert got.dtype == torch.int32 and got.shape == bounds.shape and got.is_contiguous()
    assert torch.equal(got, bounds), "the partition changed bounds made from document ids"
    assert torch.equal(bounds, kept), "the op changed its input"


def bad_bounds(generator, batch, seqlen):
    """Arbitrary int32 pairs with runs (values in [-3, seqlen + 3]): (start, length) pairs, reversed pairs, pairs
    that do not hold their own position, all repeated over random runs."""
    out = torch.empty(batch, seqlen, 2, dtype=torch.int32)
    for b in range(batch):
        i = 0
        while i < seqlen:
            n = int(torch.randint(1, 90, (1,), generator=generator))
            out[b, i:i + n] = torch.randint(-3, seqlen + 4, (2,), generator=generator, dtype=torch.int32)
            i += n
    return out


def test_start_length_pairs_of_the_audit():
    """(0, 400) for rows 0-399 and (400, 112) for rows 400-511: the audit's input, which hung the deterministic
    backward (key block 3 reaches query blocks 0-1 only; query block 5 counts key blocks 0-3)."""
    bounds = torch.tensor([[0, 400]] * 400 + [[400, 112]] * 112, dtype=torch.int32)[None]
    assert not hulls_agree(bounds, 64, 128), "premise: the raw bounds' hulls disagree"
    got = partition(bounds)
    expected = torch.tensor([[0, 400]] * 400 + [[400, 512]] * 112, dtype=torch.int32)[None]
    assert torch.equal(got, expected)
    assert all(hulls_agree(got, *blocks) for blocks in BLOCKS)


@pytest.mark.parametrize("seed", range(6))
def test_arbitrary_values_become_the_runs_of_equal_pairs(seed):
    generator = torch.Generator().manual_seed(1000 + seed)
    bounds = bad_bounds(generator, 3, 300 + 71 * seed)
    kept = bounds.clone()
    got = partition(bounds)
    assert torch.equal(got, runs_of_equal_pairs(bounds))
    assert torch.equal(bounds, kept), "the op changed its input"
    positions = torch.arange(bounds.shape[1], dtype=torch.int32)
    assert bool(((got[..., 0] <= positions) & (positions < got[..., 1])).all()), "a position outside its document"


def test_hulls_agree_after_the_partition_and_not_before():
    generator = torch.Generator().manual_seed(7)
    bounds = bad_bounds(generator, 4, 640)
    assert not all(hulls_agree(bounds, *blocks) for blocks in BLOCKS), "premise: some raw hulls disagree"
    got = partition(bounds)
    for blocks in BLOCKS:
        assert hulls_agree(got, *blocks), f"hulls disagree at blocks {blocks} after the partition"


def test_non_contiguous_input_and_meta_tensors():
    generator = torch.Generator().manual_seed(3)
    bounds = bad_bounds(generator, 2, 200)
    strided = bounds.transpose(0, 1).contiguous().transpose(0, 1)  # same values, batch-minor storage
    assert not strided.is_contiguous()
    assert torch.equal(partition(strided), partition(bounds))
    meta = partition(torch.empty(2, 200, 2, dtype=torch.int32, device="meta"))
    assert meta.shape == (2, 200, 2) and meta.dtype == torch.int32 and meta.device.type == "meta"
    with pytest.raises(RuntimeError, match="doc_bounds must be an int32"):
        partition(bounds.to(torch.int64))
