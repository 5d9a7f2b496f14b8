"""CPU checks of benchmarks/bench_attention.py that need no GPU: ``--help`` runs without importing torch's CUDA
side, the arguments parse, and the table has a column group per direction."""

import os
import subprocess
import sys

import pytest

from repo_scripts import ROOT, load_script

RELATIVE = "benchmarks/bench_attention.py"
SCRIPT = str(ROOT / RELATIVE)


@pytest.fixture(scope="module")
def bench():
    return load_script(RELATIVE, "bench_attention")


def test_help_runs_without_gpu():
    r = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--direction" in r.stdout and "{fwd,bwd,both}" in r.stdout


def test_usage_line_names_the_command_as_run():
    """Run by path, the usage line names the script (a first-time-user trial saw the module form there)."""
    by_path = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    assert by_path.stdout.startswith("usage: python ") and "bench_attention.py" in by_path.stdout.splitlines()[0]
    root = os.path.dirname(os.path.dirname(os.path.abspath(SCRIPT)))
    as_module = subprocess.run([sys.executable, "-m", "flash_attn_hopper.benchmark", "--help"], capture_output=True,
                               text=True, timeout=60, cwd=root)
    assert as_module.returncode == 0, as_module.stderr
    assert as_module.stdout.startswith("usage: python -m flash_attn_hopper.benchmark ")


def test_importing_does_not_import_torch():
    code = f"import importlib.util, sys; s = importlib.util.spec_from_file_location('b', {SCRIPT!r}); "
    code += "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); m.parse_args([]); "
    code += "sys.exit(1 if 'torch' in sys.modules else 0)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, "parse_args must work without importing torch"


@pytest.mark.parametrize("direction,expected", [("both", ["fwd", "bwd"]), ("fwd", ["fwd"]), ("bwd", ["bwd"])])
def test_direction(bench, direction, expected):
    args = bench.parse_args(["--direction", direction, "--json", "x.json"])
    assert args.directions == expected
    assert bench.parse_args(["--json", "x.json"]).directions == ["fwd", "bwd"]  # default both


def _part(ours, cudnn, fa2, flag=False):
    tflops = {"ours": ours, "cudnn": cudnn, "fa2": fa2}
    ratio = {f"ours/{p}": ours / tflops[p] for p in ("cudnn", "fa2") if ours and tflops[p]}
    return {"tflops": tflops, "ratio": ratio, "check": {"maxdiff_vs_cudnn": 1.5e-2, "flag": flag}, "errors": {}}


def test_repeated_list_values_are_measured_once(bench):
    """--head-dims 64,64 or --seqlens 1024,1024 timed each point twice (thirty-third round, found but not changed)."""
    args = bench.parse_args(["--head-dims", "128,64,128", "--seqlens", "1024 1024,512", "--backends", "ours,OURS,fa2",
                             "--features", "dense,gqa,dense", "--json", "x.json"])
    assert args.head_dims == [128, 64] and args.seqlens == [1024, 512] and args.backends == ["ours", "fa2"]
    assert args.features == ["dense", "gqa"]


def test_table_has_a_column_group_per_direction(bench):
    rec = {"head_dim": 128, "causal": False, "seqlen": 16384}
    both = dict(rec, fwd=_part(500.0, 600.0, 340.0), bwd=_part(350.0, 532.0, None, flag=True))
    table = bench.format_table([both], ["fwd", "bwd"]).splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header[:3] == ["head_dim", "causal", "seqlen"] and len(header) == 15
    assert "bwd ours/cuDNN" in header and "fwd ours/cuDNN" in header
    row = [c.strip() for c in table[2].strip("|").split("|")]
    assert row[header.index("bwd ours")] == "350.0"
    assert row[header.index("bwd ours/cuDNN")] == f"{350 / 532:.2f}"
    assert row[header.index("bwd FA2")] == "n/a"
    assert row[header.index("bwd maxdiff")].endswith("!") and not row[header.index("fwd maxdiff")].endswith("!")
    only_bwd = bench.format_table([dict(rec, bwd=_part(350.0, 532.0, 307.0))], ["bwd"]).splitlines()
    assert len(only_bwd[0].strip("|").split("|")) == 9 and "fwd" not in only_bwd[0]
