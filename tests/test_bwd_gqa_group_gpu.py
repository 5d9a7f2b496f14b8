"""GQA backward with one CTA per (key block, K/V head) running the whole group of query heads (dK/dV kept in
registers across the group, stored once) against one CTA per query head summing dK/dV in fp32
(flash/config.hpp bwd_heads_per_cta; FAH_BWD_GQA_GROUP_CTA=1 / 0 forces either): the GQA, varlen, deterministic,
feature and head_dim_v test files pass under each forced mode, run in a fresh process (tests/test_bwd_gpu.py
test_gqa_group_per_cta_large_grid checks the launcher's own pick at a shape large enough for the group mode).
Skipped, with the reason, without an sm90 GPU and the built extension (see conftest.py)."""

import os
import subprocess
import sys

import pytest
import flash_attn_hopper
from gpu_helpers import built_dtype as _built_dtype

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_hopper.__file__)))
PRELUDE = f"import sys; sys.path.insert(0, {PACKAGE_ROOT!r})\n"
FILES = ["tests/test_bwd_gpu.py", "tests/test_varlen_gpu.py", "tests/test_deterministic_gpu.py",
         "tests/test_features_gpu.py", "tests/test_head_dim_v_gpu.py"]


@pytest.mark.parametrize("mode", ["1", "0"], ids=["group-per-cta", "head-per-cta"])
def test_gqa_test_files_pass_in_each_mode(mode):
    _built_dtype(128)
    args = ["-q", "-x", "-p", "no:cacheprovider", "-k", "gqa or mqa or varlen or deterministic", *FILES]
    code = PRELUDE + f"import pytest; sys.exit(pytest.main({args!r}))\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, FAH_BWD_GQA_GROUP_CTA=mode))
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    summary = r.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, tail
