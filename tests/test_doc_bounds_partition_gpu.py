"""The deterministic backward on document bounds that are no partition, and saved LSE / bounds / cu_seqlens that
come back from saved-tensor hooks in another layout (GPU part; tests/test_doc_bounds_partition_cpu.py has the CPU
part and the history).

A static audit after round 37 (tests/bug_report_sources.md, "Thirty-seventh round") found, by reading:
- the deterministic backward spun forever on doc_bounds whose query- and key-side hulls disagree (a direct op call
  given (start, length) pairs, say): its dQ turns waited for key blocks that never visit the tile. The op now reads
  the bounds as their partition (csrc/api/flash_api.cpp doc_bounds_partition). Here, in a child process with a time
  limit (a hang fails the test instead of stopping the run): the audit's bounds and random bad ones, dense and GQA,
  causal or not; the deterministic backward returns, bitwise the backward given the partition itself, and the op
  computes the same partition on the GPU as on the CPU;
- the partition's CUDA kernel (csrc/api/varlen_rows.cu, session 72; it replaced ~14 ATen ops per call): bitwise the
  CPU reference and the brute force, across its 1024-position chunks, runs that cross them, and inputs that are not
  contiguous or sit 4 bytes off an int2 boundary;
- the autograd backward handed the op its saved LSE, bounds and cu_seqlens as the hooks restored them, and the op
  refuses tensors that are not contiguous (a RuntimeError in the backward of a working forward). It now makes them
  contiguous. Here hooks restore them with other strides (the same values), and out, LSE, dQ, dK, dV are checked by
  the rule.
Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build
lacks a head_dim / dtype."""


import pytest
import torch

import gpu_helpers
from gpu_helpers import GRAD_NAMES, assert_same_bits, randn, require_built
from test_bug_reports_thirtyseventh_gpu import Problem, document_ids, lse_like
from test_doc_bounds_partition_cpu import bad_bounds, random_ids, runs_of_equal_pairs

from flash_attn_hopper.interface import document_bounds

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"
TIMEOUT = 120  # seconds; a child takes a few (import, CUDA initialisation, small problems)

# (id, batch, seqlen, nheads, nheads_k, head_dim, dtype, causal, bounds: "audit" or a seed of bad_bounds)
CASES = [
    ("audit-bf16", 1, 512, 1, 1, 128, "bf16", False, "audit"),
    ("audit-fp16-causal", 1, 512, 2, 1, 128, "fp16", True, "audit"),
    ("random-gqa-hdim64", 2, 700, 6, 2, 64, "fp16", True, 11),
    ("random-hdim128", 3, 641, 4, 4, 128, "bf16", False, 12),
    ("random-hdim256-causal", 2, 385, 2, 1, 256, "bf16", True, 13),
]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

CHILD = """
import test_doc_bounds_partition_gpu as t
t.child(sys.argv[1])
print("done")
"""


def audit_bounds():
    """(0, 400) for rows 0-399, (400, 112) for rows 400-511: (start, length) where (start, end) was meant."""
    return torch.tensor([[0, 400]] * 400 + [[400, 112]] * 112, dtype=torch.int32)[None]


def child(case_id):
    """The case in this process: forward, then the deterministic backward on the bad bounds and on their partition
    (bitwise the same), the non-deterministic backward on the bad bounds (it returns)."""
    _, batch, seqlen, nheads, nheads_k, head_dim, dtype_name, causal, which = next(c for c in CASES if c[0] == case_id)
    dtype = DTYPES[dtype_name]
    torch.manual_seed(seqlen * 7 + nheads)
    q, dout = (randn(batch, seqlen, nheads, head_dim, dtype=dtype) for _ in range(2))
    k, v = (randn(batch, seqlen, nheads_k, head_dim, dtype=dtype) for _ in range(2))
    host = audit_bounds() if which == "audit" else bad_bounds(torch.Generator().manual_seed(which), batch, seqlen)
    bounds = host.expand(batch, -1, -1).contiguous().to(DEVICE)
    ops = torch.ops.flash_attn_hopper
    parts = ops.doc_bounds_partition(bounds)
    assert_same_bits(parts.cpu(), ops.doc_bounds_partition(bounds.cpu()), f"{case_id} partition on the GPU")
    if torch.equal(parts, bounds):
        raise AssertionError(f"{case_id}: premise: the bounds are a partition already")
    # (softmax_scale, causal, window_left, window_right, softcap, deterministic)
    args = (head_dim ** -0.5, causal, -1, 0 if causal else -1, 0.0)
    out, lse = ops.fwd(q, k, v, *args, False, doc_bounds=bounds)
    dlse = lse_like(q)
    bad = ops.bwd(dout, q, k, v, out, lse, dlse, *args, True, doc_bounds=bounds)
    good = ops.bwd(dout, q, k, v, out, lse, dlse, *args, True, doc_bounds=parts)
    ops.bwd(dout, q, k, v, out, lse, dlse, *args, False, doc_bounds=bounds)
    torch.cuda.synchronize()
    for name, a, b in zip(GRAD_NAMES, bad, good):
        assert_same_bits(a, b, f"{case_id} {name}", " (the deterministic backward did not read the partition)")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_deterministic_backward_on_bounds_that_are_no_partition(case):
    require_built(case[5], DTYPES[case[6]])
    gpu_helpers.run_child(CHILD, case[0], name=case[0], timeout=TIMEOUT)


def other_strides(t):
    """t's values with other strides: the LSE and the bounds with their dimensions stored in reverse order, a 1-D
    tensor (cu_seqlens) every other element of a buffer; the 16-bit tensors as they are."""
    if t.dtype in (torch.float16, torch.bfloat16):
        return t
    if t.dim() == 1:
        buf = torch.empty(2 * t.numel(), dtype=t.dtype, device=t.device)
        r = buf[::2]
    else:
        dims = list(range(t.dim()))[::-1]
        r = torch.empty([t.shape[d] for d in dims], dtype=t.dtype, device=t.device).permute(dims)
    r.copy_(t)
    return r


@pytest.mark.parametrize("workload", ["dense-documents", "varlen"])
def test_saved_lse_bounds_and_cu_seqlens_restored_with_other_strides(workload):
    require_built(96, torch.bfloat16)
    restored = []

    def unpack(t):
        r = other_strides(t)
        restored.append(r)
        return r

    if workload == "varlen":
        lq, lk = (1, 130, 0, 77), (40, 129, 33, 77)
        q, dout = randn(sum(lq), 4, 96, dtype=torch.bfloat16), randn(sum(lq), 4, 96, dtype=torch.bfloat16)
        k, v = (randn(sum(lk), 2, 96, dtype=torch.bfloat16) for _ in range(2))
        varlen = (gpu_helpers.cu_seqlens(lq), gpu_helpers.cu_seqlens(lk), max(lq), max(lk))
        p = Problem(q, k, v, dout, lse_like(q), dict(window_size=(50, 10), deterministic=True), varlen)
    else:
        q, k, v, dout = (randn(2, 300, 4, 96, dtype=torch.bfloat16) for _ in range(4))
        p = Problem(q, k, v, dout, lse_like(q), dict(causal=True, softcap=20.0, deterministic=True,
                                                     document_ids=document_ids([(100, 150, 50), (300,)])))
    leaves = [t.detach().requires_grad_(True) for t in (p.q, p.k, p.v)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        out, lse = p.call(leaves, **p.opts)
    grads = torch.autograd.grad([out, lse], leaves, [p.dout, p.dlse])
    others = [r for r in restored if r.dtype in (torch.float32, torch.int32)]
    if not (others and all(not r.is_contiguous() for r in others)):
        raise AssertionError(f"{workload}: premise: the LSE / bounds / cu_seqlens came back contiguous")
    p.check(out.detach(), lse.detach(), grads, workload, **p.opts)


def partition_inputs():
    """(id, int32 (batch, seqlen, 2) CPU bounds): lengths at and around the kernel's 1024-position chunk, runs longer
    than a chunk, runs of one position, bad values, bounds made from ids."""
    g = torch.Generator().manual_seed(72)
    # a short run first, so that a lost carry of either scan gives a wrong value inside the long run
    one_long_run = torch.tensor([[0, 5]] * 5 + [[5, 3005]] * 3000 + [[3005, 3015]] * 10, dtype=torch.int32)[None]
    distinct = torch.randint(-5, 5000, (2, 2049, 2), generator=g, dtype=torch.int32)  # runs of one, mostly
    return [
        ("one-position", bad_bounds(g, 3, 1)),
        ("chunk", bad_bounds(g, 2, 1024)),
        ("chunk+1", bad_bounds(g, 2, 1025)),
        ("bad-5000", bad_bounds(g, 1, 5000)),
        ("run-across-chunks", one_long_run),
        ("distinct-2049", distinct),
        ("ids-4099", document_bounds(random_ids(g, 3, 4099, 12))),
        ("ids-one-document", document_bounds(torch.zeros(2, 2500, dtype=torch.int64))),
    ]


@pytest.mark.parametrize("layout", ["contiguous", "not-contiguous", "4-bytes-off"])
@pytest.mark.parametrize("case", partition_inputs(), ids=lambda c: c[0])
def test_partition_kernel_matches_the_cpu_reference(case, layout):
    name, host = case
    if layout == "contiguous":
        bounds = host.to(DEVICE)
    elif layout == "not-contiguous":
        bounds = torch.empty(host.shape[2], host.shape[1], host.shape[0], dtype=torch.int32,
                             device=DEVICE).permute(2, 1, 0)
        bounds.copy_(host)
        if bounds.is_contiguous():
            raise AssertionError("premise: the permuted bounds are contiguous")
    else:
        buf = torch.empty(host.numel() + 1, dtype=torch.int32, device=DEVICE)
        bounds = buf[1:].view(host.shape)
        bounds.copy_(host)
        if bounds.data_ptr() % 8 == 0:
            raise AssertionError("premise: the bounds sit on an int2 boundary")
    before = bounds.clone()
    got = torch.ops.flash_attn_hopper.doc_bounds_partition(bounds)
    torch.cuda.synchronize()
    assert got.is_contiguous() and got.dtype == torch.int32 and got.shape == host.shape
    assert_same_bits(got.cpu(), torch.ops.flash_attn_hopper.doc_bounds_partition(host), f"{name} {layout}")
    assert_same_bits(got.cpu(), runs_of_equal_pairs(host), f"{name} {layout} brute force")
    assert_same_bits(bounds, before, f"{name} {layout}: the input changed")


@pytest.mark.parametrize("shape", [(0, 5, 2), (2, 0, 2), (0, 0, 2)])
def test_partition_kernel_on_empty_bounds(shape):
    got = torch.ops.flash_attn_hopper.doc_bounds_partition(torch.zeros(shape, dtype=torch.int32, device=DEVICE))
    assert got.shape == shape and got.device.type == "cuda"


def own_partition(rows):
    """Which rows of int32 (batch, seqlen, 2) CPU bounds are their own partition (the kernel's copied rows)."""
    return [bool(torch.equal(runs_of_equal_pairs(rows[b:b + 1]), rows[b:b + 1])) for b in range(rows.shape[0])]


def test_partition_kernel_copies_only_rows_that_are_their_own_partition():
    """Session 73's fast path: rows made from ids are copied in parallel, and a row one value away from that is
    scanned. Each change below makes its row no partition (the premise is checked), at a run's first position, at
    the last position, inside a run at a 256-position copy block's edge, and at position 0; rows 0 and 5 stay."""
    g = torch.Generator().manual_seed(73)
    rows = document_bounds(random_ids(g, 6, 3000, 9))
    starts = [i for i in range(1, 3000) if rows[1, i, 0] == i]
    rows[1, starts[len(starts) // 2], 0] -= 1
    rows[2, 2999, 1] += 1
    if rows[3, 512, 0] == 512 or rows[3, 512, 1] == 513:
        raise AssertionError("premise: position 512 of row 3 is inside a run")
    rows[3, 512, 1] += 1
    rows[4, 0, 0] = 1
    assert own_partition(rows) == [True, False, False, False, False, True], "premise"
    got = torch.ops.flash_attn_hopper.doc_bounds_partition(rows.to(DEVICE)).cpu()
    assert_same_bits(got, runs_of_equal_pairs(rows), "mixed rows")


def test_partition_kernel_past_65535_rows():
    """The copy kernel's grid covers at most 65535 rows at once and loops over the rest: a bad row past that (65536)
    and one inside it (0) are scanned, the others copied."""
    g = torch.Generator().manual_seed(74)
    ids = torch.randint(0, 2, (65537, 3), generator=g)
    rows = document_bounds(ids)
    rows[0, 1, 1] = 7
    rows[65536, 2, 0] = 5
    assert own_partition(rows[[0, 1, 65535, 65536]]) == [False, True, True, False], "premise"
    got = torch.ops.flash_attn_hopper.doc_bounds_partition(rows.to(DEVICE)).cpu()
    assert_same_bits(got, torch.ops.flash_attn_hopper.doc_bounds_partition(rows), "65537 rows against the CPU op")
    for b in (0, 1, 65534, 65535, 65536):
        assert_same_bits(got[b:b + 1], runs_of_equal_pairs(rows[b:b + 1]), f"row {b} brute force")


def test_partition_kernel_pins_each_half_of_the_copy_check():
    """Whole runs changed so that only one half of the copy kernel's check fails (a review of session 73's fast
    path: a kernel with either half dropped passed the single-value faults above): a run's start alone, its end
    alone, a run starting at a 256-position copy block's edge, the last run's end, equal starts with different
    ends. Documents [0, 300) [300, 512) [512, 900) [900, 1000); rows 0 and 4 stay their own partition."""
    ids = torch.zeros(7, 1000, dtype=torch.int64)
    for cut in (300, 512, 900):
        ids[:, cut:] += 1
    rows = document_bounds(ids)
    rows[1, 300:512, 0] = 299
    rows[2, 300:512, 1] = 513
    rows[3, 512:900, 0] = 511
    rows[5, 900:, 1] = 1001
    rows[6, 300:400] = torch.tensor([300, 400], dtype=torch.int32)
    rows[6, 400:512, 0] = 300
    assert own_partition(rows) == [True, False, False, False, True, False, False], "premise"
    got = torch.ops.flash_attn_hopper.doc_bounds_partition(rows.to(DEVICE)).cpu()
    assert_same_bits(got, runs_of_equal_pairs(rows), "whole runs changed")
