"""GQA backward with one CTA per (key block, K/V head) running the whole group of query heads (dK/dV kept in
registers across the group, stored once) against one CTA per query head summing dK/dV in fp32
(flash/config.hpp bwd_heads_per_cta; FAH_BWD_GQA_GROUP_CTA=1 / 0 forces either; the group CTAs under a causal mask
in the default sections of one wave and in the L2 sections, FAH_BWD_GQA_ORDER=l2): the GQA, MQA, varlen and
deterministic tests of the backward, varlen, deterministic, feature and head_dim_v files, and the head_dim_v files'
canary, memcheck and LSE-loss tests (GQA shapes whose dK/dV stores go straight to the caller's tensors in the group
mode), pass under each forced mode, run in a fresh process; and the forced modes are the ones asked for (the fp32
sums take two buffers of k's size more at peak). tests/test_bwd_gpu.py test_gqa_group_per_cta_large_grid checks the
launcher's own pick at a shape large enough for the group mode. Skipped, with the reason, without an sm90 GPU and
the built extension (see conftest.py)."""

import os
import subprocess
import sys

import pytest
import flash_attn_hopper
from gpu_helpers import CHILD_PRELUDE, built_dtype as _built_dtype

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["tests/test_bwd_gpu.py", "tests/test_varlen_gpu.py", "tests/test_deterministic_gpu.py",
         "tests/test_features_gpu.py", "tests/test_head_dim_v_gpu.py"]


@pytest.mark.parametrize("mode,order", [("1", "wave"), ("1", "l2"), ("0", "wave")],
                         ids=["group-per-cta", "group-per-cta-l2-sections", "head-per-cta"])
def test_gqa_test_files_pass_in_each_mode(mode, order):
    """order: FAH_BWD_GQA_ORDER, the group CTAs' launch order under a causal-like mask at head_dim <= 128 (wave, the
    default: sections of one wave of CTAs, at most of these small grids one section, key block n of every pair first;
    l2: the L2 sections, flash/bwd/launch_bwd_sm90.hpp)."""
    _built_dtype(128)
    selection = "gqa or mqa or varlen or deterministic or no_access_past or memcheck or lse_loss"
    args = ["-q", "-x", "-p", "no:cacheprovider", "-k", selection, *FILES]
    code = CHILD_PRELUDE + f"import pytest; sys.exit(pytest.main({args!r}))\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, FAH_BWD_GQA_GROUP_CTA=mode, FAH_BWD_GQA_ORDER=order))
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    summary = r.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, tail


def test_forced_modes_are_the_ones_asked_for(monkeypatch):
    """FAH_BWD_GQA_GROUP_CTA=0 keeps the fp32 sums (two zeroed buffers of k's size, 4 bytes an element, live during the
    backward) and =1 drops them: the backward's peak memory differs by at least that much, at a shape where each mode
    is legal (12 query heads on 4 K/V heads, 2 x 700 tokens, head_dim 128)."""
    import torch

    from gpu_helpers import randn

    dtype = _built_dtype(128)
    q = randn(2, 700, 12, 128, dtype=dtype)
    k, v = (randn(2, 700, 4, 128, dtype=dtype) for _ in range(2))
    dout = randn(2, 700, 12, 128, dtype=dtype)
    peaks = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("FAH_BWD_GQA_GROUP_CTA", mode)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = flash_attn_hopper.attention(*leaves, causal=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.autograd.grad(out, leaves, dout)
        torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated() - base
    sums_bytes = 2 * k.numel() * 4
    assert peaks["0"] - peaks["1"] >= sums_bytes, (peaks, sums_bytes)
