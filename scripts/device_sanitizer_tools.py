"""compute-sanitizer's racecheck, synccheck and initcheck over small attention calls (the GPU tests run memcheck only;
tests/bug_report_sources.md, eleventh round, class CC). Not a test yet: racecheck's view of TMA, WGMMA and mbarrier
traffic has to be read by hand first (hazards it reports on asynchronous-proxy accesses may be its own limits), then
the clean tools become GPU tests.

    python3 scripts/device_sanitizer_tools.py [tool ...]     (default: racecheck synccheck initcheck; writes $OUT)

Each tool runs tests/gpu_helpers.memcheck_script's workload (causal forward and backward of a (2, 131) x (2, 77)
batch in both deterministic modes at head_dim 64/128/256, GQA 4/2, then a two-sequence varlen batch), with the
caching allocator off; prints each tool's ERROR SUMMARY and its first reports."""

import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from gpu_helpers import memcheck_script  # noqa: E402

TOOLS = {
    "racecheck": ["--tool", "racecheck", "--racecheck-report", "all"],
    "synccheck": ["--tool", "synccheck"],
    "initcheck": ["--tool", "initcheck"],  # (--track-unused-memory takes no value here: "no" was read as the program)
}


def main(tools):
    exe = shutil.which("compute-sanitizer") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin",
                                                            "compute-sanitizer")
    if not os.path.exists(exe):
        sys.exit("compute-sanitizer not found")
    script = memcheck_script([(64, 64, 2, "bfloat16"), (128, 128, 2, "bfloat16"), (256, 256, 2, "float16")],
                             lse_in_loss=True)
    out_dir = os.environ.get("OUT", "/tmp")
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    for tool in tools:
        start = time.time()
        try:
            r = subprocess.run([exe, *TOOLS[tool], sys.executable, "-c", script], capture_output=True, text=True,
                               timeout=float(os.environ.get("TOOL_TIMEOUT", "170")), env=env)
            text, rc = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            text, rc = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"), "timeout"
        with open(os.path.join(out_dir, f"sanitizer_{tool}.log"), "w") as f:
            f.write(text)
        summary = re.findall(r"(?:ERROR|RACECHECK) SUMMARY:.*", text)
        print(f"{tool}: rc {rc}, {time.time() - start:.0f} s, done={'done' in text}, {summary[-2:]}")
        for line in [l for l in text.splitlines() if l.startswith("=========")][:12]:
            print("   ", line[:200])


if __name__ == "__main__":
    main(sys.argv[1:] or list(TOOLS))
