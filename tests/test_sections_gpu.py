"""The sectioned tile orders of causal-like launches (flash/common/tile_order.hpp l2_section_pairs; the forward's
decode_tile and the backward's CTA renumbering) with budgets small enough that sections hold a few (head, batch)
pairs and the last one is partial, as the default 24 MiB only gives at larger shapes: forward and backward against the
float32 reference by the rule of DESIGN.md §3, outputs and workspaces from NaN-poisoned memory, in a fresh process (the
knobs are read once per process). A skipped tile or CTA shows up as NaN or a wrong block; a forward tile done twice
does not (its stores are idempotent), a backward CTA done twice does (dQ is a sum). The section sizes come from a
Python port of l2_section_pairs and the launchers' bytes per pair; if those change, the test's premise check below
fails. Skipped, with the reason, without an sm90 GPU and the built extension."""

import os
import subprocess
import sys

import pytest

import flash_attn_hopper
from gpu_helpers import built_dtype as _built_dtype

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_hopper.__file__)))

# Run in the child: each case is (batch, nheads, nheads_k, seqlen_q, seqlen_k, head_dim, window); causal-like masks
# only (causal, or a window (-1, r)). Prints "ok <case>" per case, then "done".
CHILD = r"""
import sys, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from flash_attn_hopper import attention
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_ref_grads
from gpu_helpers import poison_allocator
torch.manual_seed(0)
dtype = {dtype}
for batch, nheads, nheads_k, sq, sk, hd, window in {cases!r}:
    q = torch.randn(batch, sq, nheads, hd, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, sk, nheads_k, hd, device="cuda", dtype=dtype) for _ in range(2))
    dout = torch.randn(batch, sq, nheads, hd, device="cuda", dtype=dtype)
    opts = dict(window_size=window) if window is not None else dict(causal=True)
    name = f"{{batch}}x{{nheads}}/{{nheads_k}} {{sq}}x{{sk}} hd{{hd}} {{opts}}"
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    rows = batch * nheads * -(-sq // 128) * 128  # the backward's workspaces: rows rounded to 128
    poison_allocator(q.numel() * 2, batch * nheads * sq * 4, rows * hd * 4, rows * 4, k.numel() * 2)
    out, lse = attention(*leaves, return_lse=True, **opts)
    ref, ref_lse = attention_ref(q, k, v, upcast=True, **opts)
    naive, naive_lse = attention_ref(q, k, v, upcast=False, **opts)
    assert_close_by_rule(out, ref, naive, name + " out")
    assert_close_by_rule(lse, ref_lse, naive_lse, name + " lse")
    poison_allocator(q.numel() * 2, rows * hd * 4, rows * 4, k.numel() * 2, k.numel() * 4)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_g = attention_ref_grads(q, k, v, dout, upcast=True, **opts)
    naive_g = attention_ref_grads(q, k, v, dout, upcast=False, **opts)
    for gname, g, r, n in zip(("dq", "dk", "dv"), grads, ref_g, naive_g):
        assert_close_by_rule(g, r, n, name + " " + gname)
    print("ok", name, flush=True)
print("done")
"""


def _section_pairs(pairs, bytes_per_pair, budget_mib):
    """Port of l2_section_pairs (flash/common/tile_order.hpp)."""
    if budget_mib <= 0 or pairs <= 1:
        return 0
    fit = max(1, min(int(min(budget_mib * (1 << 20) / max(bytes_per_pair, 1.0), 1024.0)), pairs, 1024))
    s = fit
    while s > fit // 2 and pairs % s != 0:
        s -= 1
    return s if pairs % s == 0 else fit


def _partial_budget(pairs, bytes_per_pair):
    """The smallest whole MiB budget whose sections leave a partial last one."""
    for mib in range(1, 64):
        size = _section_pairs(pairs, bytes_per_pair, mib)
        if size > 0 and pairs % size != 0:
            return mib
    raise AssertionError("no budget gives a partial last section")


def _fwd_bytes(case):
    """launch_fwd_sm90.hpp: K and V rows of a pair, shared by a GQA group's query heads (2-byte elements)."""
    batch, nheads, nheads_k, sq, sk, hd, window = case
    return sk * (hd + hd) * 2 / (nheads // nheads_k)


def _bwd_bytes(case):
    """launch_bwd_sm90.hpp: Q and dO rows (2-byte elements) and the fp32 dQ rows of a pair (one head per CTA at
    these small grids)."""
    batch, nheads, nheads_k, sq, sk, hd, window = case
    return sq * ((hd + hd) * 2 + hd * 4.0)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_partial_last_sections(head_dim):
    """Budgets chosen so that the first case (7 pairs of seqlen 1000) has a partial last section in the forward and the
    backward, sections from any number of query blocks; the other cases (5 pairs, a GQA group of 3 with seqlen_k >
    seqlen_q, 7 pairs under a window (-1, 40)) were picked to have one too under those budgets, which is checked."""
    dtype = _built_dtype(head_dim)
    cases = [(1, 7, 7, 1000, 1000, head_dim, None), (5, 1, 1, 822, 822, head_dim, None),
             (1, 9, 3, 456, 1406, head_dim, None), (7, 1, 1, 777, 777, head_dim, (-1, 40))]
    fwd_mib = _partial_budget(7, _fwd_bytes(cases[0]))
    bwd_mib = _partial_budget(7, _bwd_bytes(cases[0]))
    for case in cases:
        pairs = case[0] * case[1]
        for mib, nbytes in ((fwd_mib, _fwd_bytes(case)), (bwd_mib, _bwd_bytes(case))):
            size = _section_pairs(pairs, nbytes, mib)
            assert 1 < size < pairs and pairs % size != 0, f"premise: {case} at {mib} MiB gives sections of {size}"
    code = CHILD.format(root=PACKAGE_ROOT, tests=os.path.join(ROOT, "tests"), dtype=f"torch.{str(dtype).split('.')[-1]}",
                        cases=cases)
    env = dict(os.environ, FAH_FWD_SECTION_MIB=str(fwd_mib), FAH_BWD_SECTION_MIB=str(bwd_mib),
               FAH_FWD_SECTION_MIN_M_BLOCKS="0")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0 and r.stdout.strip().endswith("done"), tail
    assert r.stdout.count("ok ") == len(cases), tail


def _wave_section_pairs(pairs, ctas_per_pair, wave_ctas):
    """Port of wave_section_pairs (flash/common/tile_order.hpp), with even_section_pairs' lowering."""
    if pairs <= 1 or ctas_per_pair <= 0 or wave_ctas <= 0:
        return 0
    fit = max(1, min(wave_ctas // ctas_per_pair, pairs, 1024))
    s = fit
    while s > fit // 2 and pairs % s != 0:
        s -= 1
    return s if pairs % s == 0 else fit


@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_group_wave_sections_partial(head_dim):
    """The GQA group CTAs' sections of one wave (launch_bwd_sm90.hpp bwd_gqa_order, the default at head_dim <= 128
    under causal-like masks), forced to the group CTA (FAH_BWD_GQA_GROUP_CTA=1): seqlen_k chosen from this GPU's SM
    count so that a section holds 4 or 5 of the 7 pairs (key blocks of 128 keys: sm_count // 4 of them per pair) and
    the last section is partial; causal, square and with fewer queries than keys, and a window (-1, 3)."""
    import torch

    dtype = _built_dtype(head_dim)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = sms // 4
    sk = blocks * 128 - 57
    cases = [(7, 2, 1, sk, sk, head_dim, None), (1, 21, 7, sk - 333, sk, head_dim, None),
             (7, 4, 1, sk, sk, head_dim, (-1, 3))]
    for case in cases:
        size = _wave_section_pairs(case[0] * case[2], -(-case[4] // 128), sms)
        assert 1 < size < 7 and 7 % size != 0, f"premise: {case} on {sms} SMs gives sections of {size}"
    code = CHILD.format(root=PACKAGE_ROOT, tests=os.path.join(ROOT, "tests"), dtype=f"torch.{str(dtype).split('.')[-1]}",
                        cases=cases)
    env = dict(os.environ, FAH_BWD_GQA_GROUP_CTA="1")
    env.pop("FAH_BWD_GQA_ORDER", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0 and r.stdout.strip().endswith("done"), tail
    assert r.stdout.count("ok ") == len(cases), tail
