"""The backward's head_dim 128 tile choice with each option forced in a fresh process (FAH_BWD_BLOCK_M=64 or 80), so
that both query-block heights the kernel has are checked against the reference with and without masks, not only the
one the launcher picks for each test's shape (csrc/flash/config.hpp bwd_block_m: 80 rows without a causal mask,
window or documents, 64 rows with one):

- the chosen and the forced heights are the ones that run (the kernel's name in a profile);
- the backward, varlen, feature, document, deterministic and GQA test files pass under each, all but their cases
  parametrized with another head_dim (FAH_TEST_HEAD_DIM=128, tests/conftest.py).

Skipped, with the reason, without an sm90 GPU and the built extension (see conftest.py)."""

import os
import subprocess
import sys

import pytest

import flash_attn_hopper
from gpu_helpers import built_dtype as _built_dtype

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = [
    "tests/test_bwd_gpu.py",
    "tests/test_varlen_gpu.py",
    "tests/test_features_gpu.py",
    "tests/test_documents_gpu.py",
    "tests/test_deterministic_gpu.py",
    "tests/test_bwd_gqa_group_gpu.py",
    "tests/test_head_dim_v_gpu.py",
]
# The children import the package this process tests (installed, or the built source tree) ahead of anything else.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_hopper.__file__)))
PRELUDE = f"import sys; sys.path.insert(0, {PACKAGE_ROOT!r})\n"

# One head_dim 128 backward (seqlen 1000: neither height divides it) and the backward kernel's name.
_KERNEL_NAME = """
import sys, torch, flash_attn_hopper
from torch.profiler import ProfilerActivity, profile
dtype = getattr(torch, sys.argv[1])
causal = sys.argv[2] == "causal"
q, k, v = (torch.randn(2, 1000, 4, 128, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
out = flash_attn_hopper.attention(q, k, v, causal=causal)
dout = torch.randn_like(out)
out.backward(dout)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    flash_attn_hopper.attention(q, k, v, causal=causal).backward(dout)
    torch.cuda.synchronize()
names = {e.key for e in prof.key_averages() if "flash_bwd_sm90_kernel" in e.key}
print("KERNELS", sorted(names))
"""


def _env(block_m):
    env = dict(os.environ, FAH_TEST_HEAD_DIM="128")
    env.pop("FAH_BWD_BLOCK_M", None)
    if block_m is not None:
        env["FAH_BWD_BLOCK_M"] = str(block_m)
    return env


@pytest.mark.parametrize(
    "block_m,causal,expected",
    [(None, "full", 80), (None, "causal", 64), (64, "full", 64), (80, "causal", 80)],
)
def test_chosen_and_forced_block_m_is_the_kernel_that_runs(block_m, causal, expected, tmp_path):
    dtype = _built_dtype(128)
    r = subprocess.run([sys.executable, "-c", PRELUDE + _KERNEL_NAME, str(dtype).split(".")[-1], causal],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_env(block_m))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    line = [l for l in r.stdout.splitlines() if l.startswith("KERNELS")][-1]
    # BwdSwapKernelTraits<Element, head_dim, kBlockM, kBlockN, kStages, kSeqlenQRounding>
    assert f", 128, {expected}, 128, 2, " in line, line
    other = 144 - expected
    assert f", 128, {other}, 128, 2, " not in line, line


@pytest.mark.parametrize("block_m", [64, 80])
def test_forced_block_m_passes_the_backward_tests(block_m):
    _built_dtype(128)
    args = ["-q", "-x", "-p", "no:cacheprovider", *FILES]
    code = PRELUDE + f"import pytest; sys.exit(pytest.main({args!r}))\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=480,
                       env=_env(block_m))
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    summary = r.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, tail
