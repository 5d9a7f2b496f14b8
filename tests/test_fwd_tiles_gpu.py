"""The forward's host-side tile choice with each option forced in a fresh process, over the head_dim 64 forward,
varlen and feature tests (tests/test_fwd_gpu.py, tests/test_varlen_gpu.py, tests/test_features_gpu.py), so that every
tile shape the host can pick is checked against the reference, not only the one it picks for each test's shape:
FAH_FWD_BLOCK_M=128 / 192 runs head_dim 64 on 128-row (two consumer warpgroups) or 192-row (three) tiles; left
alone, the host picks per mask and length (csrc/flash/fwd/launch_fwd_sm90.hpp, run_fwd_sm90_hdim64).

Skipped, with the reason, without an sm90 GPU and the built extension (see conftest.py)."""

import os
import subprocess
import sys

import pytest
import torch

from gpu_helpers import require_built as _require_built

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["tests/test_fwd_gpu.py", "tests/test_varlen_gpu.py", "tests/test_features_gpu.py"]


@pytest.mark.parametrize(
    "env", [{"FAH_FWD_BLOCK_M": "128"}, {"FAH_FWD_BLOCK_M": "192"}], ids=["block_m_128", "block_m_192"],
)
def test_forced_forward_choice_passes_the_head_dim_64_tests(env):
    _require_built(64, torch.bfloat16)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "64", *FILES],
        cwd=ROOT, capture_output=True, text=True, timeout=140,
        env=dict(os.environ, **env, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))),
    )
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    summary = r.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, tail
