"""Thirty-second round of the bug hunt (tests/bug_report_sources.md, "Thirty-second round"), CPU part.

- GA's premises, without the extension: the rows and chunks of tests/test_bug_reports_thirtysecond_gpu.py reach what
  the class is about. Through tests/test_mask_math_cpu.py's port of csrc/flash/common/mask.hpp (Window), at each
  configuration's tile (128 rows; 128, 112 or 64 keys): every key block a row sees is visited by the prefill's tile,
  the decode call's and the chunk's; for some rows a block the row sees whole is crossed by the mask of one call's
  tile and interior in another's (so the two copies of the forward's main loop, kSplitMaskLoop, and the fixed-maximum
  softcap's correction on crossed blocks, meet the same row); and, for the fixed-maximum case, the rows whose block
  is crossed by one call's tile mask and not another's, which the correction by the tile's mask (until session 65)
  treated differently and the correction by the row's own mask does not. The serving batch packs exactly the dense rows.
- FY's chain rule (float64, the library's references): the GPU check of the user Function downstream of the attention
  (y = 2 A(2q)) through the references of A.
- FY's and FZ's GPU bodies through the library's own Python layer, op schemas and autograd nodes with
  tests/cpu_stand_ins.py's kernels (float32 references; backwards from the saved out and LSE), torch.compile with
  "aot_eager": that the user Functions trace with fullgraph=True around the ops' fake kernels, that the compiled
  step and the direct-op Functions give the eager / library bits, and that every autograd mode hands the ops the same
  arguments. These skip, with the reason, where the extension is not built (its op schemas and autograd node are
  needed). GA's bodies are not run on the stand-ins: a float32 reference computed per call shape has no reason to be
  bitwise invariant, the kernels' per-row arithmetic is the GPU file's business.
- GA in the exact pass (session 66): the margins between csrc/flash/common/softmax.hpp's thresholds (the pass's pick by
  LSE, the kernel's flag by the kept maximum) that make a row's recomputation depend on that row alone, and that each
  threshold is the one used where it belongs."""

import os
import re

import pytest
import torch

import cpu_stand_ins
import test_bug_reports_thirtysecond_gpu as gpu_file
from flash_attn_hopper.interface import kernel_head_dim
from flash_attn_hopper.testing import attention_ref, attention_ref_grads
from test_mask_math_cpu import Window, kernel_window

BLOCK_M = 128  # the forward's tile height at kernel head_dim 96-256 (csrc/flash/config.hpp)
BLOCK_N = {96: 128, 128: 128, 192: 112, 256: 64}  # its key block, by kernel head_dim (config.hpp FwdTileConfig)


# ------------------------------------------------ GA: premises, through the port of mask.hpp

def _window(seqlen_q, seqlen_k, opts, block_n):
    left, right = opts.get("window_size", (-1, -1))
    if opts.get("causal", False):
        right = 0
    left, right = kernel_window(left, right, seqlen_q, seqlen_k)
    return Window(BLOCK_M, block_n, seqlen_q, seqlen_k, left, right)


def _blocks(w, row):
    """{key block: crossed by the tile's mask} of the blocks the tile of `row` (a row of w's call) visits, and the
    blocks in which `row` itself sees a key."""
    m_block = row // BLOCK_M
    n_min, n_max = w.n_block_range(m_block)
    lo, hi = w.interior_n_blocks(m_block)
    visited = {n: n < lo or n >= hi for n in range(n_min, n_max)}
    seen = set()
    for n in range(n_min, n_max):
        k_lo, k_hi = w.key_limits(row, n)
        if max(k_lo, 0) < min(k_hi, w.bn):
            seen.add(n)
    return visited, seen


def _calls(row, opts, block_n):
    """{call: (visited, seen)} for global query row `row` in the prefill, its decode call, and the chunk holding it."""
    calls = {"prefill": _blocks(_window(gpu_file.GA_SEQLEN, gpu_file.GA_SEQLEN, opts, block_n), row)}
    if row in gpu_file.GA_ROWS:
        calls["decode"] = _blocks(_window(1, row + 1, opts, block_n), 0)
    s, e = next((s, e) for s, e in gpu_file.GA_CHUNKS if s <= row < e)
    calls[f"chunk {s}-{e}"] = _blocks(_window(e - s, e, opts, block_n), row - s)
    return calls


@pytest.mark.parametrize("config", list(gpu_file.GA_CONFIGS) + ["fixed_max"])
def test_ga_calls_visit_what_each_row_sees_and_mask_it_differently(config):
    """Every key block a row sees is visited by each call's tile, and the calls agree on which blocks the row sees (the
    same keys: bottom-right alignment); for some rows a block the row sees is crossed by one call's tile mask and
    interior in another's (what the bitwise comparison must survive). The configurations' kernels run 128-row tiles."""
    head_dim, head_dim_v, _, opts = gpu_file.GA_FIXED_MAX if config == "fixed_max" else gpu_file.GA_CONFIGS[config]
    width = kernel_head_dim(max(head_dim, head_dim_v))
    block_n = BLOCK_N[width]
    differing = []
    for row in range(gpu_file.GA_SEQLEN):
        calls = _calls(row, opts, block_n)
        seen = {name: s for name, (_, s) in calls.items()}
        assert len({frozenset(s) for s in seen.values()}) == 1, (config, row, seen)
        for name, (visited, s) in calls.items():
            assert s <= set(visited), (config, row, name, visited, s)
        for n in seen["prefill"]:
            if len({calls[name][0][n] for name in calls}) > 1:
                differing.append((row, n))
    assert differing, f"{config}: no row whose block is crossed in one call's tile and interior in another's"
    decode_rows = {row for row, _ in differing if row in gpu_file.GA_ROWS}
    assert decode_rows, f"{config}: none of GA_ROWS has a decode call that masks a block differently"


def test_ga_rows_lie_on_every_block_edge():
    """GA_ROWS hold, for every edge of the configurations' key blocks (64, 112, 128 keys) inside the sequence, the row
    ending the block before it (its decode call's last block is whole) and the row starting the block after it."""
    for block_n in sorted(set(BLOCK_N.values())):
        for edge in range(block_n, gpu_file.GA_SEQLEN, block_n):
            assert edge - 1 in gpu_file.GA_ROWS and edge in gpu_file.GA_ROWS, (block_n, edge)


def test_ga_fixed_max_rows_whose_tile_mask_differs():
    """What test_prefill_rows_equal_decode_and_chunks_fixed_max_softcap guards, by the port: rows that see a block
    whole in tiles that the mask crosses in one call and not in another. Row 127 sees block 0 whole; the prefill's
    tile 0 crosses it (rows 0-126 are masked there), its decode call's tile does not. Row 255 the same for block 1.
    Rows 256-276 see block 1 whole: interior in the prefill's tile 2, crossed in chunk [149, 300)'s tile 0 (its first
    rows, 149-255, end inside block 1). With the fixed maximum, OnlineSoftmax::add_rounding ran on every row of a
    crossed block until session 65, which gave these rows different bits per call; it now adds only for rows whose own
    mask cuts the block (none of these)."""
    head_dim, head_dim_v, _, opts = gpu_file.GA_FIXED_MAX
    block_n = BLOCK_N[kernel_head_dim(max(head_dim, head_dim_v))]
    for row, block in ((127, 0), (255, 1)):
        calls = _calls(row, opts, block_n)
        assert block in calls["prefill"][1] and calls["prefill"][0][block], row
        assert not calls["decode"][0][block], row
    for row in range(256, 277):
        calls = _calls(row, opts, block_n)
        assert not calls["prefill"][0][1] and calls["chunk 149-300"][0][1], row
    assert 127 in gpu_file.GA_ROWS and 255 in gpu_file.GA_ROWS and (149, 300) in gpu_file.GA_CHUNKS
    # The rule now: no call corrects these blocks for these rows, their own mask covering the whole block in each.
    for row, block in [(127, 0), (255, 1)] + [(r, 1) for r in range(256, 277)]:
        for s, e in [(0, gpu_file.GA_SEQLEN), (row, row + 1)] + list(gpu_file.GA_CHUNKS):
            if s <= row < e:
                lo, hi = _window(e - s, e, opts, block_n).key_limits(row - s, block)
                assert lo <= 0 and hi >= block_n, (row, block, s, e, lo, hi)


def test_ga_serving_batch_packs_the_dense_rows():
    """ga_serving_batch: sequence j of the packed batch holds segment j's query rows and the keys / values up to its
    end, exactly, and its cu_seqlens and maxima describe that."""
    g = torch.Generator().manual_seed(32)
    q = torch.randn(gpu_file.BATCH, gpu_file.GA_SEQLEN, 4, 8, generator=g)
    k, v = (torch.randn(gpu_file.BATCH, gpu_file.GA_SEQLEN, 2, 8, generator=g) for _ in range(2))
    qv, kv, vv, cu_q, cu_k, max_q, max_k = gpu_file.ga_serving_batch(q, k, v)
    segments = gpu_file.ga_segments()
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.numel() == cu_k.numel() == len(segments) + 1
    cq, ck = cu_q.tolist(), cu_k.tolist()
    assert cq[-1] == qv.shape[0] and ck[-1] == kv.shape[0] == vv.shape[0]
    assert max_q == max(e - s for _, s, e in segments) and max_k == gpu_file.GA_SEQLEN
    for j, (b, s, e) in enumerate(segments):
        assert torch.equal(qv[cq[j]:cq[j + 1]], q[b, s:e]), (j, b, s, e)
        assert torch.equal(kv[ck[j]:ck[j + 1]], k[b, :e]) and torch.equal(vv[ck[j]:ck[j + 1]], v[b, :e]), (j, b, e)
    assert {(s, e) for _, s, e in segments} >= set(gpu_file.GA_CHUNKS)


# ------------------------------------------------ FY: the chain rule of the downstream case

def test_fy_downstream_check_is_the_chain_rule():
    """The GPU check of y = 2 A(2q) (the user Function on q and on out): A = y / 2 at input 2q, dA/d(2q) = dq / 2,
    with output gradient 2 dout; in float64 through the references, against autograd through the user Function."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 37, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 41, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 37, 4, 16, generator=g, dtype=torch.float64)
    dlse = torch.randn(2, 4, 37, generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = attention_ref(gpu_file._TimesTwo.apply(leaves[0]), leaves[1], leaves[2], causal=True)
    y = gpu_file._TimesTwo.apply(out)
    grads = torch.autograd.grad((y, lse), leaves, (dout, dlse))
    ref_out, ref_lse = attention_ref(q * 2, k, v, causal=True)
    ref = attention_ref_grads(q * 2, k, v, dout * 2, causal=True, dlse=dlse)
    torch.testing.assert_close(y.detach() / 2, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse.detach(), ref_lse, rtol=0, atol=0)
    for got, want in zip((grads[0] / 2, grads[1], grads[2]), ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------ FY and FZ bodies through the stand-ins

@pytest.fixture
def cpu_ops(monkeypatch):
    with cpu_stand_ins.gpu_bodies_on_cpu(monkeypatch, gpu_file, "round 32's test bodies"):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("case", gpu_file.FY_CASES)
def test_fy_bodies(cpu_ops, case):
    gpu_file.test_user_autograd_function_under_torch_compile(case)


@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_fz_bodies(cpu_ops, api):
    cpu_stand_ins.CALLS.clear()
    gpu_file.test_forward_bits_do_not_depend_on_the_autograd_mode(api)
    # every mode but deterministic=True / the global mode handed the forward op deterministic=False
    flags = [deterministic for op, deterministic, *_ in cpu_stand_ins.CALLS if op.startswith("fwd")]
    assert flags == [False, False, False, False, True, True, False], flags


# ------------------------------------------------ GA in the exact pass: the thresholds' margins

def _softmax_constants():
    """The float constants of csrc/flash/common/softmax.hpp (name -> value), their expressions evaluated in order."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc/flash/common/softmax.hpp")
    values = {}
    for name, expr in re.findall(r"constexpr float (k\w+) = ([^;]+);", open(path).read()):
        values[name] = eval(re.sub(r"(\d\.?)f\b", r"\1", expr), {}, dict(values))  # (64.f -> 64.)
    return values


def test_exact_pass_thresholds_keep_their_margins():
    """The exact pass picks rows by |LSE| * log2(e) >= kExactRowsSelectLog2 and runs only when a row's kept maximum
    reached kExactRowsFlagLog2 (csrc/flash/common/softmax.hpp). A row's LSE lies in [m, m + log2(keys)] for its true
    maximum m (keys < 2^31: 31) and the kept maximum in [m - kRescaleThresholdLog2, m]; so every row the pass picks
    sets the flag itself when Select - Flag > 31 + kRescaleThresholdLog2, and every row past kExactRowsLimitLog2 is
    picked when Limit - Select > 31 (a negative m: |LSE| >= |m| - 31). Each with a unit to spare for roundings."""
    c = _softmax_constants()
    limit, select, flag = c["kExactRowsLimitLog2"], c["kExactRowsSelectLog2"], c["kExactRowsFlagLog2"]
    assert limit == 2.0 ** 16, limit
    assert select - flag >= 31 + c["kRescaleThresholdLog2"] + 1, (select, flag)
    assert limit - select >= 31 + 1, (limit, select)
    assert flag > 2.0 ** 15, "the flag would fire for rows the main kernel computes well enough"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    softmax = open(os.path.join(root, "csrc/flash/common/softmax.hpp")).read()
    exact_rows = open(os.path.join(root, "csrc/flash/fwd/exact_rows_sm90.hpp")).read()
    needs = softmax[softmax.index("bool needs_exact_rows()"):]
    needs = needs[:needs.index("\n  }\n")]
    assert ">= kExactRowsFlagLog2" in needs and "kExactRowsSelectLog2" not in needs, needs
    assert "* float(M_LOG2E) < kExactRowsSelectLog2)" in exact_rows and "kExactRowsFlagLog2" not in exact_rows
