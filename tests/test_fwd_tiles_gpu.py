"""The forward's head_dim 64 tile choice with each option forced in a fresh process (FAH_FWD_BLOCK_M=128 or 192:
two or three consumer warpgroups), so that every tile shape the launcher can pick is checked against the reference,
not only the one it picks for each test's shape (csrc/flash/fwd/tile_choice.hpp; the choice itself is tested on CPU
in tests/test_tile_choice_cpu.py):

- the forced height is the one that runs (the kernel's name in a profile) even where the launcher would pick the
  other;
- the forward, varlen, feature and boundary test files (tests/test_fwd_gpu.py, tests/test_varlen_gpu.py,
  tests/test_features_gpu.py, tests/test_fwd_boundary_gpu.py) pass under it, all but their cases parametrized with
  another head_dim (FAH_TEST_HEAD_DIM=64, tests/conftest.py): the tests with a fixed head_dim stay, whichever it is.

Also those test files at head_dim 64, 128 and 256 with the consumers' ping-pong turned off (FAH_FWD_PINGPONG=0), the
way head_dim 64's 128-row tiles always run (csrc/flash/config.hpp FwdTileConfig64Narrow::kPingpong).

Skipped, with the reason, without an sm90 GPU and the built extension (see conftest.py)."""

import os
import subprocess
import sys

import pytest

from gpu_helpers import CHILD_PRELUDE, built_dtype as _built_dtype

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = [
    "tests/test_fwd_gpu.py",
    "tests/test_varlen_gpu.py",
    "tests/test_features_gpu.py",
    "tests/test_fwd_boundary_gpu.py",
]

# Runs one head_dim 64 forward where the launcher would pick the other height (causal 512 -> 128 rows, non-causal
# 4096 -> 192 rows) and prints the forward kernel's name.
_KERNEL_NAME = """
import sys, torch, flash_attn_hopper
from torch.profiler import ProfilerActivity, profile
dtype = getattr(torch, sys.argv[1])
causal = sys.argv[2] == "causal"
seqlen = 512 if causal else 4096
q, k, v = (torch.randn(8, seqlen, 16, 64, device="cuda", dtype=dtype) for _ in range(3))
flash_attn_hopper.attention(q, k, v, causal=causal)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    flash_attn_hopper.attention(q, k, v, causal=causal)
    torch.cuda.synchronize()
names = {e.key for e in prof.key_averages() if "flash_fwd_sm90_kernel" in e.key}
print("KERNELS", sorted(names))
"""


def _env(block_m):
    return dict(os.environ, FAH_FWD_BLOCK_M=str(block_m), FAH_TEST_HEAD_DIM="64")


@pytest.mark.parametrize("block_m,causal", [(192, "causal"), (128, "full")])
def test_forced_block_m_is_the_kernel_that_runs(block_m, causal, tmp_path):
    dtype = _built_dtype(64)
    r = subprocess.run([sys.executable, "-c", CHILD_PRELUDE + _KERNEL_NAME, str(dtype).split(".")[-1], causal],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_env(block_m))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    line = [l for l in r.stdout.splitlines() if l.startswith("KERNELS")][-1]
    assert f", 64, {block_m}, 128, " in line, line
    assert f", 64, {320 - block_m}, 128, " not in line, line


def _forward_files_pass(env):
    """Runs FILES in a child process with `env`; they must all pass."""
    args = ["-q", "-x", "-p", "no:cacheprovider", *FILES]
    code = CHILD_PRELUDE + f"import pytest; sys.exit(pytest.main({args!r}))\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    summary = r.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, tail


@pytest.mark.parametrize("block_m", [128, 192])
def test_forced_block_m_passes_the_forward_tests(block_m):
    _built_dtype(64)
    _forward_files_pass(_env(block_m))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_forward_without_pingpong_passes_the_forward_tests(head_dim):
    """FAH_FWD_PINGPONG=0 (csrc/api/flash_api.cpp) lets the consumer warpgroups issue their GEMMs without taking
    turns; head_dim 64's 128-row tiles run that way by configuration (FwdTileConfig64Narrow::kPingpong), the others only
    under the switch. The forward test files pass with it at each kernel width."""
    _built_dtype(head_dim)
    env = dict(os.environ, FAH_FWD_PINGPONG="0", FAH_TEST_HEAD_DIM=str(head_dim))
    env.pop("FAH_FWD_BLOCK_M", None)  # the launcher's own tiles
    _forward_files_pass(env)
