"""The forward's half-block skip (csrc/flash/fwd/kernel_fwd_sm90.hpp, fwd_skips_half): a consumer warpgroup whose 64
rows see no key in the upper half of its tile's first key block computes that block's QKᵀ and P V on the lower half
only (head_dim 256, whose key blocks are 64 wide: keys 32-63 of the block). Warpgroup 0 does so on every causal
diagonal; both warpgroups do when the last visible key of the tile lies in the lower half of its block.

- The skip changes no bit of O or LSE: the upper half's P is exactly 0, so its products add nothing. Each case runs in
  two fresh processes, FAH_FWD_SKIP_BLOCKS=0 (no skip) and the default, on the same inputs.
- The skipped half is not read: a V row of +inf in it (a key the warpgroup's rows do not see) leaves those rows
  finite and equal to the reference, where the full P V multiplies it by P = 0 (NaN); so this test also fails if the
  skip never runs.

Accuracy against the reference with the skip on is what the forward test files check (tests/test_fwd_boundary_gpu.py
puts mask edges on and off the 64-row grid and the key blocks' halves). Skipped, with the reason, without an sm90 GPU
and the built extension (see conftest.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref
from gpu_helpers import DTYPES, require_built

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

HEAD_DIM = 256  # the one kernel width with the skip (FwdKernelTraits::kHalfSkip)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_hopper.__file__)))
PRELUDE = f"import sys; sys.path.insert(0, {PACKAGE_ROOT!r})\n"

# (seqlen_q, seqlen_k, causal, window, softcap, nheads, nheads_k, varlen lengths q / k or None)
CASES = [
    (1000, 1000, True, (-1, -1), 0.0, 3, 3, None),  # warpgroup 0 skips on every diagonal
    (1000, 1020, True, (-1, -1), 0.0, 3, 3, None),  # offset 20: both warpgroups skip
    (513, 700, False, (-1, -1), 0.0, 3, 3, None),  # 700 = 10 x 64 + 60: the last key block is nearly full: none skips
    (513, 680, False, (-1, -1), 0.0, 3, 3, None),  # 680 = 10 x 64 + 40: both skip the last block's upper half
    (513, 700, False, (17, 3), 0.0, 3, 3, None),
    (513, 700, False, (0, 0), 0.0, 3, 3, None),
    (1000, 1000, True, (-1, -1), 30.0, 3, 3, None),  # bf16: the fixed-maximum softcap; fp16: the online one
    (1000, 1000, True, (-1, -1), 0.0, 6, 2, None),  # GQA
    (777, 777, True, (300, 0), 0.0, 2, 2, None),
    (None, None, True, (-1, -1), 0.0, 3, 3, ([0, 77, 0, 130, 5, 300], [10, 77, 0, 60, 200, 300])),
]
CASE_IDS = ["causal", "causal-offset20", "keys700", "keys680", "window17_3", "window0_0", "causal-cap30", "gqa", "window300_0",
            "varlen"]

_CHILD = r"""
import json, sys, torch, flash_attn_hopper
head_dim, dtype_name, cases, out_path = json.loads(sys.argv[1])
dtype = getattr(torch, dtype_name)
results = []
for i, (sq, sk, causal, window, softcap, nheads, nheads_k, lengths) in enumerate(cases):
    g = torch.Generator(device="cuda").manual_seed(1000 + i)
    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)
    if lengths is None:
        q, k, v = rnd(2, sq, nheads, head_dim), rnd(2, sk, nheads_k, head_dim), rnd(2, sk, nheads_k, head_dim)
        out, lse = flash_attn_hopper.attention(q, k, v, causal=causal, window_size=tuple(window), softcap=softcap,
                                               return_lse=True)
    else:
        lq, lk = lengths
        cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), device="cuda", dtype=torch.int32)
        q, k, v = rnd(sum(lq), nheads, head_dim), rnd(sum(lk), nheads_k, head_dim), rnd(sum(lk), nheads_k, head_dim)
        out, lse = flash_attn_hopper.attention_varlen(q, k, v, cu(lq), cu(lk), max(lq), max(lk), causal=causal,
                                                      window_size=tuple(window), softcap=softcap, return_lse=True)
    results.append((out.cpu(), lse.cpu()))
torch.save(results, out_path)
"""


def _run_child(head_dim, dtype, out_path, skip):
    env = dict(os.environ)
    env.pop("FAH_FWD_SKIP_BLOCKS", None)
    if not skip:
        env["FAH_FWD_SKIP_BLOCKS"] = "0"
    arg = json.dumps([head_dim, str(dtype).split(".")[-1], CASES, str(out_path)])
    r = subprocess.run([sys.executable, "-c", PRELUDE + _CHILD, arg], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return torch.load(out_path)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_skip_changes_no_bit(dtype, tmp_path):
    require_built(HEAD_DIM, dtype)
    with_skip = _run_child(HEAD_DIM, dtype, tmp_path / "skip.pt", skip=True)
    without = _run_child(HEAD_DIM, dtype, tmp_path / "noskip.pt", skip=False)
    for name, (out, lse), (out0, lse0) in zip(CASE_IDS, with_skip, without):
        assert torch.isfinite(out).all(), name
        assert torch.equal(out, out0), f"{name}: O differs with the skip"
        assert torch.equal(lse, lse0), f"{name}: LSE differs with the skip"


def _check_inf_key(head_dim, dtype):
    """test_skipped_half_is_not_read's check, in its child process."""
    torch.manual_seed(7)
    q, k, v = (torch.randn(1, 256, 1, head_dim, device="cuda", dtype=dtype) for _ in range(3))
    v[0, 230, 0, :] = float("inf")
    out, lse = flash_attn_hopper.attention(q, k, v, causal=True, return_lse=True)
    rows = slice(128, 192)  # warpgroup 0 of the second tile; key 230 is masked for all of them
    v_ref = v.clone()
    v_ref[0, 230, 0, :] = 0  # the masked key's value, as the rows that do not see it must take it: not at all
    ref, ref_lse = attention_ref(q, k, v_ref, causal=True, upcast=True)
    naive, naive_lse = attention_ref(q, k, v_ref, causal=True, upcast=False)
    assert torch.isfinite(out[:, rows]).all()
    assert_close_by_rule(out[:, rows], ref[:, rows], naive[:, rows], name="O, rows 128-191")
    assert_close_by_rule(lse[..., rows], ref_lse[..., rows], naive_lse[..., rows], name="LSE, rows 128-191")


_INF_CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[3])
import test_fwd_skip_gpu as t
t._check_inf_key(int(sys.argv[1]), getattr(torch, sys.argv[2]))
print("CHECKED")
"""


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_skipped_half_is_not_read(dtype):
    """Causal, 256 x 256, one head: the second query tile (rows 128-255) starts at the key block of keys 192-255; its
    warpgroup 0 (rows 128-191) sees keys up to 191 and skips the block's upper half, keys 224-255. V of key 230 is
    +inf; rows 128-191 must be finite and match the reference, which leaves that key out. In a fresh process, with
    the skip's switch (FAH_FWD_SKIP_BLOCKS) unset."""
    require_built(HEAD_DIM, dtype)
    env = dict(os.environ)
    env.pop("FAH_FWD_SKIP_BLOCKS", None)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", PRELUDE + _INF_CHILD, str(HEAD_DIM), str(dtype).split(".")[-1],
                        tests_dir], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "CHECKED" in r.stdout, (r.stdout + r.stderr)[-3000:]
