"""scripts/kernel_report.py on ptxas logs (CPU): serialized-wgmma notes fail the report with --fail-on-serialized (as
scripts/gpu_check.sh runs it) and are only flagged without it."""

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "kernel_report.py")
KERNEL = "_ZN5flash21flash_fwd_sm90_kernelINS_15FwdKernelTraitsIN7cutlass10bfloat16_tELi64EEEvNT_6ParamsE"


def _log(serialized):
    lines = [
        f"ptxas info    : Compiling entry function '{KERNEL}' for 'sm_90a'",
        f"ptxas info    : Function properties for {KERNEL}",
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Used 168 registers, used 16 barriers",
    ]
    if serialized:
        lines.append(
            "ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "non wgmma instructions defining input registers of a wgmma between start and end of the pipeline stage "
            f"in the function '{KERNEL}'"
        )
    return "\n".join(lines) + "\n"


def _run(tmp_path, text, *flags):
    log = tmp_path / "build.log"
    log.write_text(text)
    return subprocess.run([sys.executable, SCRIPT, "--ptxas-log", str(log), *flags], capture_output=True, text=True)


@pytest.mark.parametrize("serialized", [False, True])
def test_fail_on_serialized(tmp_path, serialized):
    strict = _run(tmp_path, _log(serialized), "--fail-on-serialized")
    assert strict.returncode == (1 if serialized else 0), strict.stdout + strict.stderr
    assert ("serialized" in strict.stdout) == serialized
    lenient = _run(tmp_path, _log(serialized))
    assert lenient.returncode == 0, lenient.stdout + lenient.stderr
