"""Packed documents in a row (``attention(..., document_ids=)``, issue 4's sync-free packed sequences) on an sm90 GPU,
forward and backward, against the float32 reference with the same document mask, by the rule of DESIGN.md §3
(flash_attn_hopper.testing: ``attention_ref`` / ``attention_ref_grads`` with document_ids). Outputs and gradients come
from NaN-poisoned memory, so an element the kernels never write shows up. Skipped, with the reason, without an sm90
GPU and the built extension."""

import pytest
import torch

from flash_attn_hopper import attention
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_ref_grads
from gpu_helpers import built_dtype as _built_dtype
from gpu_helpers import require_built as _require_built
from test_features_gpu import DTYPE_IDS, DTYPES, HEAD_DIMS
from test_features_gpu import _inputs, _run_and_check

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]


def _ids(*rows):
    """(batch, seqlen) int64 document_ids from per-row document lengths (equal totals). Ids repeat 0, 1, 0, 1, ...:
    only runs of equal adjacent ids are documents."""
    assert len({sum(r) for r in rows}) == 1
    out = [torch.cat([torch.full((n,), d % 2) for d, n in enumerate(r)]) for r in rows]
    return torch.stack(out).cuda()


MIXED = ([300, 1, 212, 500], [13, 700, 300])  # seqlen 1013: documents across tile edges, one of length 1


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_documents(dtype, head_dim, causal):
    _require_built(head_dim, dtype)
    q, k, v, dout = _inputs(2, 1013, 1013, 3, 3, head_dim, dtype)
    _run_and_check(q, k, v, dout, f"documents causal={causal}", causal=causal, document_ids=_ids(*MIXED))


LAYOUTS = {
    "one_document": ([777],),
    "length_one_documents": ([1] * 40 + [700] + [1] * 37,),
    "tile_aligned": ([128, 128, 64, 192, 256, 9],),
    "two_rows": ([5, 600, 172], [776, 1]),
    "many_short": ([7, 13, 1, 30, 2, 64, 100, 3, 300, 257],),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_document_layouts(layout, causal):
    head_dim = 128
    rows = LAYOUTS[layout]
    dtype = _built_dtype(head_dim)
    q, k, v, dout = _inputs(len(rows), sum(rows[0]), sum(rows[0]), 2, 2, head_dim, dtype)
    _run_and_check(q, k, v, dout, f"{layout} causal={causal}", causal=causal, document_ids=_ids(*rows))


@pytest.mark.parametrize("window", [(17, 3), (128, 0), (-1, 5), (64, -1), (0, 0)])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_documents_with_window(head_dim, window):
    dtype = _built_dtype(head_dim)
    q, k, v, dout = _inputs(2, 1013, 1013, 2, 2, head_dim, dtype)
    _run_and_check(q, k, v, dout, f"documents window {window}", window_size=window, document_ids=_ids(*MIXED))


@pytest.mark.parametrize("nheads_k", [2, 1], ids=["gqa", "mqa"])
def test_documents_gqa(nheads_k):
    dtype = _built_dtype(64)
    q, k, v, dout = _inputs(2, 1013, 1013, 6, nheads_k, 64, dtype)
    _run_and_check(q, k, v, dout, f"documents gqa {nheads_k}", causal=True, document_ids=_ids(*MIXED))


def test_documents_softcap_and_dlse():
    dtype = _built_dtype(128)
    q, k, v, dout = _inputs(2, 1013, 1013, 2, 2, 128, dtype, scale=2.0)
    dlse = torch.randn(2, 2, 1013, device="cuda")
    _run_and_check(q, k, v, dout, "documents softcap dlse", dlse=dlse, causal=True, softcap=15.0,
                   document_ids=_ids(*MIXED))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_documents_deterministic(head_dim):
    """Deterministic mode orders the dQ sums by the key blocks that visit a query block: with documents both sides
    must agree on those blocks, or a CTA would wait forever. Two runs: bitwise equal, and right."""
    dtype = _built_dtype(head_dim)
    q, k, v, dout = _inputs(2, 1013, 1013, 2, 2, head_dim, dtype)
    ids = _ids(*MIXED)
    grads = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = attention(*leaves, causal=True, deterministic=True, document_ids=ids)
        grads.append(torch.autograd.grad(out, leaves, dout))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    ref = attention_ref_grads(q, k, v, dout, upcast=True, causal=True, document_ids=ids)
    naive = attention_ref_grads(q, k, v, dout, upcast=False, causal=True, document_ids=ids)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads[0], ref, naive):
        assert_close_by_rule(g, r, n, f"documents deterministic {name}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_one_document_is_the_plain_kernel(head_dim, causal):
    """A row that is one document visits the same tiles with the same masks as no documents: bitwise equal results.
    Documents always run 128-row tiles, so the plain call must too: head_dim 64's 192-row tiles also sum the softmax's
    rows in another order (FwdKernelTraits::kSoftmaxChains)."""
    dtype = _built_dtype(head_dim)
    q, k, v, _ = _inputs(2, 1013, 1013, 3, 3, head_dim, dtype)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    plain_rows = torch.ops.flash_attn_hopper.fwd_block_m(head_dim, head_dim, 2, 3, 1013, 1013, causal, -1, -1, sms)
    assert plain_rows == 128, f"this shape's plain call now runs {plain_rows}-row tiles: pick a shape that runs 128"
    ids = torch.full((2, 1013), 7, device="cuda", dtype=torch.int32)
    out, lse = attention(q, k, v, causal=causal, return_lse=True, document_ids=ids)
    ref_out, ref_lse = attention(q, k, v, causal=causal, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_documents_are_not_the_plain_mask():
    """The documents change the result (the test inputs would pass without them otherwise)."""
    dtype = _built_dtype(128)
    q, k, v, _ = _inputs(1, 400, 400, 2, 2, 128, dtype)
    ids = _ids([200, 200])
    out = attention(q, k, v, causal=True, document_ids=ids)
    ref, _ = attention_ref(q, k, v, causal=True)
    assert (out.float() - ref).abs().max() > 0.05


def test_documents_under_torch_compile():
    """fullgraph compile: the bounds are made inside the graph (no host read, no graph break), results equal eager's."""
    dtype = _built_dtype(64)
    q, k, v, dout = _inputs(2, 1013, 1013, 2, 2, 64, dtype)
    ids = _ids(*MIXED)

    def step(q, k, v, ids):
        return attention(q, k, v, causal=True, document_ids=ids)

    compiled = torch.compile(step, fullgraph=True)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = compiled(*leaves, ids)
    grads = torch.autograd.grad(out, leaves, dout)
    eager_leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    eager = step(*eager_leaves, ids)
    eager_grads = torch.autograd.grad(eager, eager_leaves, dout)
    assert torch.equal(out, eager)
    # dK, dV: one CTA per key block sums them over the query blocks in registers, in one order (no GQA here), so they
    # match bitwise; dQ's adds run in a run-dependent order, so each dQ is checked by the rule instead
    for name, a, b in zip(("dk", "dv"), grads[1:], eager_grads[1:]):
        assert torch.equal(a, b), name
    ref_dq = attention_ref_grads(q, k, v, dout, causal=True, document_ids=ids)[0]
    naive_dq = attention_ref_grads(q, k, v, dout, causal=True, document_ids=ids, upcast=False)[0]
    assert_close_by_rule(grads[0], ref_dq, naive_dq, "compiled dq")
    assert_close_by_rule(eager_grads[0], ref_dq, naive_dq, "eager dq")
