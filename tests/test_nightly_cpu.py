"""CPU tests of the nightly benchmark's record logic (flash_attn_hopper/benchmark.py): compare with a baseline and
its one re-measurement, missing points, plots, summary and history, on synthetic records written here. The GPU
measurement is replaced by a fake runner (main's runner_factory seam), so the whole CLI flow runs without a GPU."""

import copy
import contextlib
import json
import math
import os
import subprocess
import sys

import pytest

from flash_attn_hopper import benchmark as nb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_attention.py")
OLD_RECORD = os.path.join(ROOT, "benchmarks", "results", "2026-11-29_h200_final.json")
try:
    import matplotlib  # noqa: F401

    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False
needs_mpl = pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed: the plot tests need it")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

HEAD_DIMS = (64, 128)
SEQLENS = (1024, 4096)
BASE_TFLOPS = {"ours": 500.0, "cudnn": 550.0, "fa2": 320.0}


def _flops(hd, causal, seqlen, direction):
    spec = {"feature": "dense", "head_dim": hd, "causal": causal, "seqlen": seqlen}
    f = nb.point_flops(spec, max(1, 16384 // seqlen), 2048 // hd)
    return int(nb.BWD_FLOPS_FACTOR * f) if direction == "bwd" else f


def _part(flops, tflops):
    part = nb._new_part(flops)
    for name, t in tflops.items():
        if t is None:
            part["errors"][name] = "RuntimeError: unsupported here"
            part["tflops"][name] = part["ms"][name] = None
            continue
        ms = flops / (t * 1e12) * 1e3
        part["ms"][name] = ms
        part["tflops"][name] = t
        part["stats"][name] = {"median": ms, "p20": 0.99 * ms, "p80": 1.01 * ms, "min": 0.98 * ms, "max": 1.05 * ms,
                               "n": 100}
    for p in nb.PEERS:
        if tflops.get("ours") and tflops.get(p):
            part["ratio"][f"ours/{p}"] = tflops["ours"] / tflops[p]
    part["check"] = {"maxdiff_vs_cudnn": 4e-3, "flag": False}
    return part


def _tflops_for(hd, causal, seqlen, direction, scale=1.0):
    """Deterministic, point-dependent numbers; `scale` multiplies ours only."""
    bump = 1.0 + 0.1 * (hd == 128) + 0.05 * (seqlen == 4096) - 0.2 * causal - 0.3 * (direction == "bwd")
    return {n: t * bump * (scale if n == "ours" else 1.0) for n, t in BASE_TFLOPS.items()}


def make_record(scale=1.0, gpu="NVIDIA H200", date="2026-12-01T02:00:00+00:00", commit="a" * 40, features=True):
    results = []
    for hd in HEAD_DIMS:
        for causal in (False, True):
            for s in SEQLENS:
                rec = {"feature": "dense", "head_dim": hd, "causal": causal, "seqlen": s, "batch": 16384 // s,
                       "nheads": 2048 // hd, "nheads_kv": 2048 // hd, "dtype": "bf16"}
                for d in nb.DIRECTIONS:
                    rec[d] = _part(_flops(hd, causal, s, d), _tflops_for(hd, causal, s, d, scale))
                results.append(rec)
    if features:
        for causal in (False, True):
            results.append({"feature": "gqa", "head_dim": 128, "causal": causal, "seqlen": 4096, "dtype": "bf16",
                            "skipped": "not in flash_attn_hopper yet (GQA)"})
    meta = {"schema": nb.SCHEMA, "date": date, "gpu": gpu, "driver": "580.1", "cuda": "13.0", "torch": "2.11.0",
            "cudnn": 91900, "git_commit": commit, "git_dirty": False,
            "sm_clock_before": {"sm_mhz": 1980, "max_sm_mhz": 1980}, "sm_clock_after": {"sm_mhz": 1965}}
    return {"meta": meta, "config": {"dtype": "bf16"}, "elapsed_s": 12.0, "results": results}


def _write(path, doc):
    path.write_text(json.dumps(doc))
    return str(path)


def _key(hd, causal, seqlen, d, feature="dense"):
    return (feature, "bf16", hd, causal, seqlen, d)


# ------------------------------------------------------------------------------------------------- compare logic


def test_run_compared_with_itself_passes():
    rec = make_record()
    cmp = nb.compare_records(rec, copy.deepcopy(rec), 0.05)
    assert not cmp["regressions"] and not cmp["missing_now"] and not cmp["missing_base"]
    assert len(cmp["rows"]) == len(HEAD_DIMS) * 2 * len(SEQLENS) * 2  # skipped feature points are not compared
    assert all(r["status"] == "ok" and abs(r["ratio"] - 1) < 1e-12 for r in cmp["rows"])
    text = nb.format_comparison(cmp, "base.json")
    assert text.splitlines()[-1].startswith("compare: PASS: 16 points")


def test_baseline_ten_percent_faster_fails_and_names_points():
    cur, base = make_record(), make_record(scale=1.1)
    calls = []

    def remeasure(keys):  # the re-measurement gives the same (slow) numbers
        calls.append(list(keys))
        return {k: _tflops_for(k[2], k[3], k[4], k[5])["ours"] for k in keys}

    cmp = nb.compare_records(cur, base, 0.05, remeasure)
    assert len(calls) == 1 and len(calls[0]) == 16  # every slower point re-measured in one call (the tries happen inside remeasure)
    assert len(cmp["regressions"]) == 16 and cmp["remeasured"]
    last = nb.format_comparison(cmp, "doctored.json").splitlines()[-1]
    assert last.startswith("compare: FAIL: ours (implementation=ours) is slower than doctored.json by more than 5%")
    assert "after re-measuring, best of 3 tries" in last
    for hd in HEAD_DIMS:
        for causal in ("no", "yes"):
            for s in SEQLENS:
                for d in nb.DIRECTIONS:
                    assert f"head_dim={hd} causal={causal} seqlen={s} {d} (" in last
    assert "+10.0% time" in last


def test_threshold_flag_decides():
    cur, base = make_record(), make_record(scale=1.1)
    assert not nb.compare_records(cur, base, 0.15)["regressions"]
    assert len(nb.compare_records(cur, base, 0.05)["regressions"]) == 16
    faster = nb.compare_records(make_record(scale=1.2), make_record(), 0.0)  # faster than the baseline: fine
    assert not faster["regressions"]


def test_remeasure_clears_noise_and_keeps_real_regressions():
    cur, base = make_record(), make_record()
    slow = [_key(128, False, 4096, "fwd"), _key(64, True, 1024, "bwd")]
    for key in slow:  # the current run measured these 10% slow
        rec = next(r for r in cur["results"] if nb.point_key(r) == key[:5])
        part = rec[key[5]]
        part["tflops"]["ours"] /= 1.1
    seen = []

    def remeasure(keys):
        seen.extend(keys)
        noise, real = slow
        return {noise: _tflops_for(128, False, 4096, "fwd")["ours"],  # back to normal: noise
                real: _tflops_for(64, True, 1024, "bwd")["ours"] / 1.1}  # still slow

    cmp = nb.compare_records(cur, base, 0.05, remeasure)
    assert sorted(seen) == sorted(slow)
    assert [r["key"] for r in cmp["noise"]] == [slow[0]]
    assert [r["key"] for r in cmp["regressions"]] == [slow[1]]
    text = nb.format_comparison(cmp)
    assert "ok on re-measure" in text and "SLOWER" in text
    last = text.splitlines()[-1]
    assert "head_dim=64 causal=yes seqlen=1024 bwd" in last and "head_dim=128 causal=no seqlen=4096" not in last


def test_remeasure_returning_nothing_keeps_the_regression():
    cmp = nb.compare_records(make_record(), make_record(scale=1.1), 0.05, lambda keys: {})
    assert len(cmp["regressions"]) == 16


def test_missing_points_are_reported_not_failed():
    cur, base = make_record(), make_record()
    cur["results"] = [r for r in cur["results"] if not (r.get("head_dim") == 64 and r["seqlen"] == 1024)]
    extra = copy.deepcopy(cur["results"][0])
    extra["seqlen"] = 16384
    cur["results"].append(extra)  # new point: no baseline
    broken = next(r for r in cur["results"] if nb.point_key(r) == _key(128, True, 4096, "fwd")[:5])
    broken["bwd"]["tflops"]["ours"] = None
    broken["bwd"]["errors"]["ours"] = "RuntimeError: kernel launch failed"
    cmp = nb.compare_records(cur, base, 0.05)
    assert not cmp["regressions"]
    missing_now = dict(cmp["missing_now"])
    assert set(missing_now) == {_key(64, c, 1024, d) for c in (False, True) for d in nb.DIRECTIONS} | {
        _key(128, True, 4096, "bwd")
    }
    assert missing_now[_key(64, False, 1024, "fwd")] == "not in the record"
    assert "kernel launch failed" in missing_now[_key(128, True, 4096, "bwd")]
    assert {k for k, _ in cmp["missing_base"]} == {_key(64, False, 16384, d) for d in nb.DIRECTIONS}
    text = nb.format_comparison(cmp)
    assert "missing in this run (5 points, reported, not failed)" in text
    assert "missing in the baseline (2 points, reported, not failed)" in text
    assert text.splitlines()[-1].startswith("compare: PASS")


def test_points_measured_at_another_shape_are_not_compared():
    """A baseline run with another --tokens / --hidden has the same point keys at another batch or head count: those
    points are listed, not compared (a 10 % slower baseline at twice the batch would otherwise pass or fail on the
    shape); records without the fields still compare."""
    cur, base = make_record(), make_record(scale=1.5)
    for r in base["results"]:
        if r.get("head_dim") == 128 and not r.get("skipped"):
            r["batch"] *= 2
    cmp = nb.compare_records(cur, base, 0.05)
    other = dict(cmp["other_shape"])
    assert set(other) == {_key(128, c, s, d) for c in (False, True) for s in SEQLENS for d in nb.DIRECTIONS}
    assert "batch 4 x nheads 16 / nheads_kv 16 here, batch 8" in other[_key(128, False, 4096, "fwd")]
    assert cmp["regressions"] and all(r["key"][2] != 128 for r in cmp["rows"])  # the other head dims compare
    assert f"measured at another shape ({len(other)} points, reported, not compared)" in nb.format_comparison(cmp)
    for doc in (cur, base):
        for r in doc["results"]:
            r.pop("batch", None)
    assert not nb.compare_records(cur, base, 0.05)["other_shape"]


def test_feature_measured_now_but_skipped_in_baseline_is_new():
    cur, base = make_record(), make_record()
    gqa = next(r for r in cur["results"] if r.get("feature") == "gqa" and not r["causal"])
    gqa.pop("skipped")
    for d in nb.DIRECTIONS:
        gqa[d] = _part(1e12, {"ours": 400.0, "cudnn": 420.0, "fa2": None})
    cmp = nb.compare_records(cur, base, 0.05)
    reasons = dict(cmp["missing_base"])
    assert reasons[_key(128, False, 4096, "fwd", "gqa")].startswith("skipped: not in flash_attn_hopper yet")


def test_gpu_mismatch_is_noted():
    cmp = nb.compare_records(make_record(gpu="NVIDIA H100 80GB HBM3"), make_record(), 0.05)
    assert any("H100" in n and "H200" in n for n in cmp["notes"])


def test_old_schema_record_compares_with_itself():
    """The committed record of benchmarks/bench_attention.py before the nightly (no feature, no stats)."""
    old = nb.load_record(OLD_RECORD)
    cmp = nb.compare_records(old, copy.deepcopy(old), 0.05)
    assert len(cmp["rows"]) == 36 and not cmp["regressions"]
    assert nb.format_table(old["results"]).splitlines()[0].startswith("| head_dim | causal | seqlen |")


def test_summarize_times():
    st = nb.summarize_times([5, 1, 4, 2, 3])
    assert st == {"median": 3.0, "p20": 1.8, "p80": 4.2, "min": 1.0, "max": 5.0, "n": 5} or (
        abs(st["p20"] - 1.8) < 1e-12 and abs(st["p80"] - 4.2) < 1e-12 and st["median"] == 3.0
    )
    assert nb.summarize_times([7.0])["p80"] == 7.0
    with pytest.raises(ValueError):
        nb.summarize_times([])


def test_grid_has_feature_points_and_window_flops():
    args = nb.parse_args(["--json", "x.json"])
    specs = nb.grid_specs(args)
    dense = [s for s in specs if s["feature"] == "dense"]
    assert len(dense) == 3 * 2 * 6
    for f in ("gqa", "varlen", "window", "softcap"):
        fs = [s for s in specs if s["feature"] == f]
        assert {s["head_dim"] for s in fs} == {128} and {s["seqlen"] for s in fs} == {1024, 4096, 16384}
        assert len(fs) == 6
    # Deterministic mode's cost is asked for at every head dim.
    fs = [s for s in specs if s["feature"] == "deterministic"]
    assert {s["head_dim"] for s in fs} == {64, 128, 256} and {s["seqlen"] for s in fs} == {1024, 4096, 16384}
    assert len(fs) == 3 * 2 * 3
    one = nb.grid_specs(nb.parse_args(["--head-dims", "256", "--features", "deterministic", "--json", "x"]))
    assert {s["head_dim"] for s in one} == {256}
    assert nb.parse_args(["--features", "dense", "--json", "x"]).features == ["dense"]
    assert nb.window_pairs(4, 1, 0) == 4 + 3 and nb.window_pairs(4, 10, 10) == 16
    causal = {"feature": "window", "head_dim": 64, "causal": True, "seqlen": 4}
    assert nb.point_flops(causal, 1, 1) == 4 * 64 * 10  # WINDOW >= seqlen: the whole causal triangle


def test_feature_support_reports_reasons():
    class NoFeatures:
        @staticmethod
        def attention(q, k, v, softmax_scale=None, causal=False, return_lse=False):
            pass

    class WithWindow:
        @staticmethod
        def attention(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0):
            pass

    assert nb.feature_support(NoFeatures, "dense") is None
    for f in ("window", "softcap", "varlen", "deterministic"):
        assert nb.feature_support(NoFeatures, f).startswith("not in flash_attn_hopper yet")
    assert nb.feature_support(WithWindow, "window") is None and nb.feature_support(WithWindow, "softcap") is None
    import flash_attn_hopper

    reason = nb.feature_support(flash_attn_hopper, "gqa")  # today's package raises NotImplementedError for GQA
    assert reason is None or reason.startswith("not in flash_attn_hopper yet")


def test_gpu_clocks_tolerates_missing_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert nb.gpu_clocks() is None and nb._driver_version() is None


def test_progress_without_bar(capsys):
    p = nb.Progress(2, enabled=False)
    p.write("[1/2] point")
    p.update("x")
    p.close()
    assert "[1/2] point" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ the CLI with a fake runner


class FakeRunner:
    """Stands in for GpuRunner: numbers from _tflops_for(scale), re-measure numbers from remeasure_scale (a number,
    or a list: one scale per re-measure try, in order)."""

    instances = []

    def __init__(self, args, scale=1.0, remeasure_scale=None):
        self.args, self.scale, self.remeasure_scale = args, scale, remeasure_scale
        self.calls = []
        FakeRunner.instances.append(self)

    def meta(self):
        return {"schema": nb.SCHEMA, "date": "2026-12-02T02:00:00+00:00", "gpu": "NVIDIA H200", "git_commit": "b" * 40}

    def clocks(self):
        return {"sm_mhz": 1980, "max_sm_mhz": 1980}

    attempt = 0

    @contextlib.contextmanager
    def spacer(self, attempt):
        self.attempt = attempt
        yield

    def support(self, feature):
        return None if feature == "dense" else f"not in flash_attn_hopper yet (fake: no {feature})"

    def run(self, spec, args):
        self.calls.append((dict(spec), list(args.directions), list(args.backends), args.no_check, args.no_adjacent))
        again = args.backends == ["ours"]
        scale = self.remeasure_scale if again and self.remeasure_scale is not None else self.scale
        if isinstance(scale, list):
            scale = scale[self.attempt]
        rec = dict(spec, batch=16384 // spec["seqlen"], nheads=2048 // spec["head_dim"], dtype=args.dtype)
        for d in args.directions:
            t = _tflops_for(spec["head_dim"], spec["causal"], spec["seqlen"], d, scale)
            rec[d] = _part(_flops(spec["head_dim"], spec["causal"], spec["seqlen"], d),
                           {n: t[n] for n in args.backends})
        return rec


GRID = ["--head-dims", "64,128", "--seqlens", "1024,4096", "--no-bar"]


def _main(argv, **fake):
    FakeRunner.instances.clear()
    rc = nb.main(argv, runner_factory=lambda args: FakeRunner(args, **fake))
    return rc, FakeRunner.instances[-1]


def test_cli_run_writes_record_with_meta_stats_and_skips(tmp_path):
    out = tmp_path / "run.json"
    rc, runner = _main(GRID + ["--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["sm_clock_before"]["sm_mhz"] == 1980 and doc["meta"]["sm_clock_after"]["sm_mhz"] == 1980
    dense = [r for r in doc["results"] if r["feature"] == "dense"]
    assert len(dense) == 8 and len(runner.calls) == 8  # skipped feature points are not run
    st = dense[0]["fwd"]["stats"]["ours"]
    assert {"median", "p20", "p80", "min", "max", "n"} <= set(st)
    skipped = [r for r in doc["results"] if r.get("skipped")]
    assert {r["feature"] for r in skipped} == {"gqa", "varlen", "window", "softcap", "deterministic"}
    assert all(r["skipped"].startswith("not in flash_attn_hopper yet") for r in skipped)
    assert {r["seqlen"] for r in skipped} == {1024, 4096}
    assert {r["head_dim"] for r in skipped if r["feature"] != "deterministic"} == {128}
    assert {r["head_dim"] for r in skipped if r["feature"] == "deterministic"} == {64, 128}  # the run's head dims


def test_cli_second_run_compared_with_first_passes(tmp_path, capsys):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    assert _main(GRID + ["--json", str(first)])[0] == 0
    rc, runner = _main(GRID + ["--json", str(second), "--compare", str(first)])
    assert rc == 0
    assert all(not c[2] == ["ours"] for c in runner.calls)  # nothing re-measured
    assert "compare: PASS: 16 points" in capsys.readouterr().out
    assert json.loads(second.read_text())["compare"]["passed"] is True


def test_cli_doctored_baseline_fails_after_remeasuring(tmp_path, capsys):
    base = _write(tmp_path / "base.json", make_record(scale=1.1))
    out = tmp_path / "run.json"
    rc, runner = _main(GRID + ["--json", str(out), "--compare", base])
    assert rc == 1
    again = [c for c in runner.calls if c[2] == ["ours"]]
    # REMEASURE_TRIES tries per point, fwd and bwd together, no correctness check, no references timed beside.
    assert len(again) == 8 * nb.REMEASURE_TRIES and all(c[1] == ["fwd", "bwd"] and c[3] and c[4] for c in again)
    assert not any(c[4] for c in runner.calls if c[2] != ["ours"])
    text = capsys.readouterr().out
    last = [line for line in text.splitlines() if line.startswith("compare:")][-1]
    assert last.startswith("compare: FAIL") and "head_dim=128 causal=yes seqlen=4096 bwd" in last
    doc = json.loads(out.read_text())
    assert doc["compare"]["passed"] is False and len(doc["compare"]["regressions"]) == 16
    rec = next(r for r in doc["results"] if r["feature"] == "dense")
    assert rec["fwd"]["remeasure"]["ours"]["tflops"] == pytest.approx(rec["fwd"]["tflops"]["ours"])
    assert len(rec["fwd"]["remeasure"]["ours"]["tries"]) == nb.REMEASURE_TRIES


def test_cli_noise_cleared_by_remeasure(tmp_path, capsys):
    base = _write(tmp_path / "base.json", make_record())
    rc, runner = _main(GRID + ["--json", str(tmp_path / "r.json"), "--compare", base], scale=0.9,
                       remeasure_scale=1.0)
    assert rc == 0
    assert len([c for c in runner.calls if c[2] == ["ours"]]) == 8 * nb.REMEASURE_TRIES
    assert "compare: PASS: 16 points of ours within 5% of base.json (16 only after re-measuring)" in (
        capsys.readouterr().out
    )


def test_cli_remeasure_takes_the_best_try(tmp_path, capsys):
    """A point slow at first and in the first re-measure tries but back at the baseline in the last is noise (the
    placement-dependent spread seen on the H200); slow in every try would be a regression (test above)."""
    base = _write(tmp_path / "base.json", make_record())
    slow_then_fast = [0.9] * (nb.REMEASURE_TRIES - 1) + [1.0]
    rc, _ = _main(GRID + ["--json", str(tmp_path / "r.json"), "--compare", base], scale=0.9,
                  remeasure_scale=slow_then_fast)
    assert rc == 0
    assert "compare: PASS" in capsys.readouterr().out
    doc = json.loads((tmp_path / "r.json").read_text())
    tries = doc["results"][0]["fwd"]["remeasure"]["ours"]["tries"]
    assert len(tries) == nb.REMEASURE_TRIES and max(tries) == doc["results"][0]["fwd"]["remeasure"]["ours"]["tflops"]


def test_help_and_input_mode_without_torch(tmp_path):
    """--help, and compare + summary of records (--input), through benchmarks/bench_attention.py: no torch import."""
    cur = _write(tmp_path / "cur.json", make_record())
    base = _write(tmp_path / "base.json", make_record(scale=1.1))
    summary = tmp_path / "s.md"
    code = (
        "import runpy, sys; sys.argv = [sys.argv[0]] + sys.argv[1:]\n"
        "try:\n    runpy.run_path(%r, run_name='__main__')\n"
        "except SystemExit as e:\n    rc = e.code\n"
        "print('TORCH', 'torch' in sys.modules); sys.exit(rc)\n" % SCRIPT
    )
    r = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--compare" in r.stdout and "TORCH False" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-c", code, "--input", cur, "--compare", base, "--summary", str(summary)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "TORCH False" in r.stdout and "not re-measured: --input" in r.stdout
    assert "compare: FAIL" in summary.read_text()
    r = subprocess.run([sys.executable, "-c", code, "--input", cur, "--compare", cur], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "compare: PASS" in r.stdout


def test_module_help_runs_without_gpu():
    r = subprocess.run([sys.executable, "-m", "flash_attn_hopper.benchmark", "--help"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "--threshold" in r.stdout, r.stderr


def test_summary_markdown(tmp_path):
    doc = make_record()
    cmp = nb.compare_records(doc, make_record(scale=1.1), 0.05)
    text = nb.format_summary(doc, cmp)
    assert "| head_dim | causal | seqlen | fwd ours | fwd cuDNN | fwd FA2 | fwd ours/cuDNN | bwd ours |" in text
    assert "| 128 | no | 4096 | 575 ±1.0% | 633 | 368 | 0.91 |" in text
    assert "- gqa skipped (2 points): not in flash_attn_hopper yet (GQA)" in text
    assert "before 1980 MHz, after 1965 MHz" in text
    assert text.rstrip().splitlines()[-1].startswith("compare: FAIL")
    path = tmp_path / "sub" / "summary.md"
    rc = nb.main(["--input", _write(tmp_path / "r.json", doc), "--summary", str(path)])
    assert rc == 0 and path.read_text().startswith("# Attention benchmark: NVIDIA H200")


def test_feature_ratios_against_dense():
    """Each feature point over the dense point of the same head_dim, mask and seqlen; a window point also over dense
    non-causal at the measured seqlen nearest its rows' average keys (within 5 %; n/a otherwise), same record."""
    w = nb.WINDOW
    assert nb.window_keys_per_row(16384, False) == pytest.approx(1984.9, abs=0.1)  # near 2W = 2048
    assert nb.window_keys_per_row(16384, True) == pytest.approx(993.0, abs=0.1)  # near W = 1024
    assert nb.window_keys_per_row(w, False) == w  # a window as wide as the sequence is dense
    ours = {(False, 2 * w): 600.0, (False, w): 580.0, (False, 16384): 640.0, (True, 16384): 620.0, (True, 2 * w): 500.0,
            (False, 4096): 630.0}
    results = []
    for (causal, s), t in ours.items():
        rec = {"feature": "dense", "head_dim": 128, "causal": causal, "seqlen": s, "dtype": "bf16"}
        for d in nb.DIRECTIONS:
            rec[d] = _part(1e12, {"ours": t if d == "fwd" else t / 2, "cudnn": 500.0, "fa2": 300.0})
        results.append(rec)
    for causal, s, t in ((False, 16384, 540.0), (True, 16384, 522.0), (False, 4096, 550.0)):
        rec = {"feature": "window", "head_dim": 128, "causal": causal, "seqlen": s, "dtype": "bf16"}
        rec["fwd"] = _part(1e12, {"ours": t, "cudnn": None, "fa2": None})
        results.append(rec)
    results.append({"feature": "softcap", "head_dim": 128, "causal": False, "seqlen": 16384, "dtype": "bf16",
                    "fwd": _part(1e12, {"ours": 576.0, "cudnn": None, "fa2": None})})
    results.append({"feature": "softcap", "head_dim": 128, "causal": False, "seqlen": 512, "dtype": "bf16",
                    "fwd": _part(1e12, {"ours": 400.0, "cudnn": None, "fa2": None})})  # no dense point at 512
    results.append({"feature": "window", "head_dim": 64, "causal": False, "seqlen": 4096, "dtype": "bf16",
                    "skipped": "not in this build"})
    got = {(x["key"][0], x["key"][3], x["key"][4], x["direction"]): x for x in nb.feature_ratios(results)}
    assert set(got) == {("window", False, 16384, "fwd"), ("window", True, 16384, "fwd"),
                        ("window", False, 4096, "fwd"), ("softcap", False, 16384, "fwd"),
                        ("softcap", False, 512, "fwd")}
    x = got[("window", False, 16384, "fwd")]
    assert x["vs_dense"] == pytest.approx(540 / 640)
    assert x["equal_work_seqlen"] == 2 * w and x["vs_equal_work"] == pytest.approx(540 / 600)
    x = got[("window", True, 16384, "fwd")]
    assert x["vs_dense"] == pytest.approx(522 / 620)
    assert x["equal_work_seqlen"] == w and x["vs_equal_work"] == pytest.approx(522 / 580)  # non-causal at W
    x = got[("window", False, 4096, "fwd")]  # 1793 keys per row: no dense seqlen within 5 %
    assert x["vs_dense"] == pytest.approx(550 / 630) and x["equal_work_seqlen"] is None and x["vs_equal_work"] is None
    assert got[("softcap", False, 16384, "fwd")]["vs_dense"] == pytest.approx(576 / 640)
    assert got[("softcap", False, 16384, "fwd")]["vs_equal_work"] is None
    assert got[("softcap", False, 512, "fwd")]["vs_dense"] is None
    text = nb.format_summary({"meta": {}, "results": results})
    assert "| window | 128 | yes | 16384 | 522 | 0.84 | 1024 | 0.90 |" in text
    assert "| window | 128 | no | 4096 | 550 | 0.87 | n/a | n/a |" in text
    assert "| softcap | 128 | no | 16384 | 576 | 0.90 | — | — |" in text
    assert "| softcap | 128 | no | 512 | 400 | n/a | — | — |" in text
    assert "window skipped (1 points): not in this build" in text


def test_feature_reference_specs():
    """The dense points timed beside a feature point: the same point for GQA, varlen, softcap and deterministic; for a
    window, dense non-causal with the rows' average keys and, when causal, dense causal with as many keys per row on
    average ((seqlen + 1) / 2), each seqlen rounded to the nearest multiple of the step."""
    for feature in ("gqa", "varlen", "softcap", "deterministic"):
        for causal in (False, True):
            spec = {"feature": feature, "head_dim": 128, "causal": causal, "seqlen": 4096}
            assert nb.feature_reference_specs(spec) == [("same", causal, 4096)]
    assert nb.feature_reference_specs({"feature": "dense", "head_dim": 128, "causal": False, "seqlen": 4096}) == []
    assert nb.ADJACENT_SEQLEN_STEP == 128
    win = {"feature": "window", "head_dim": 128, "seqlen": 16384}
    # (1024, 1024) at 16384: 1984.9 keys per row on average
    assert nb.feature_reference_specs(dict(win, causal=False)) == [("equal_work", False, 2048)]
    # (1024, 0): 993.0 keys per row, as many as dense non-causal at ~993 or dense causal at ~1985
    assert nb.feature_reference_specs(dict(win, causal=True)) == [("equal_work", False, 1024),
                                                                   ("equal_work_causal", True, 2048)]
    # at 4096: 1792.75 and 896.9 keys per row, off the benchmark's grid of seqlens
    assert nb.feature_reference_specs(dict(win, causal=False, seqlen=4096)) == [("equal_work", False, 1792)]
    assert nb.feature_reference_specs(dict(win, causal=True, seqlen=4096)) == [("equal_work", False, 896),
                                                                                ("equal_work_causal", True, 1792)]
    # a window as wide as the sequence: the dense point itself (causal: its non-causal half and itself)
    assert nb.feature_reference_specs(dict(win, causal=False, seqlen=1024)) == [("equal_work", False, 1024)]
    assert nb.feature_reference_specs(dict(win, causal=True, seqlen=1024)) == [("equal_work", False, 512),
                                                                                ("equal_work_causal", True, 1024)]
    assert nb.feature_reference_specs(dict(win, causal=True, seqlen=64), step=16) == [("equal_work", False, 32),
                                                                                       ("equal_work_causal", True, 64)]


def test_time_adjacent_warms_up_then_alternates_in_thue_morse_order():
    """A discarded reference timing, then reference, feature; feature, reference; feature, reference; reference,
    feature: the two sides' positions have equal sums and equal sums of squares over four rounds, so a steady drift
    and its curvature both cancel (two rounds cancel the steady part)."""
    def run(rounds, warmup):
        calls = []
        medians = {"feature": iter([2.0, 4.0, 6.0, 8.0]), "reference": iter([0.5, 1.0, 3.0, 5.0, 7.0])}
        if not warmup:
            next(medians["reference"])

        def timer(fn):
            name = fn()
            calls.append(name)
            return {"median": next(medians[name])}

        return calls, nb.time_adjacent(timer, lambda: "feature", lambda: "reference", rounds=rounds, warmup=warmup)

    calls, (t_feat, t_ref) = run(4, True)
    assert calls == ["reference"] + ["reference", "feature", "feature", "reference",
                                     "feature", "reference", "reference", "feature"]
    assert (t_feat, t_ref) == (5.0, 4.0)  # the warm-up's 0.5 is not in the mean
    timed = calls[1:]
    for side in ("reference", "feature"):
        slots = [i for i, name in enumerate(timed) if name == side]
        assert (sum(slots), sum(i * i for i in slots)) == (14, 70)
    calls, (t_feat, t_ref) = run(2, False)
    assert calls == ["reference", "feature", "feature", "reference"]
    assert (t_feat, t_ref) == (3.0, 2.0)


def test_adjacent_references_from_run_point_on_the_cpu(monkeypatch):
    """run_point's references timed beside a feature point, end to end on the CPU: a stand-in for flash_attn_hopper
    (SDPA in float32) and a timer that gives every call 1 ms, so that each ratio is the ratio of the two sides' FLOPs.
    Checks the reference shapes (GQA: full heads), the backward's FLOPs factor on both sides, a reference that fails
    (recorded, the other kinds still run) and --no-adjacent."""
    torch = pytest.importorskip("torch")
    import types

    import torch.nn.functional as F

    monkeypatch.setattr(nb, "DEVICE", "cpu")
    monkeypatch.setattr(nb, "ADJACENT_SEQLEN_STEP", 16)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    calls = []
    fail_seqlen = []

    def attention(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
        calls.append((tuple(q.shape), tuple(k.shape), causal, window_size, softcap, deterministic))
        if q.shape[1] in fail_seqlen:
            raise RuntimeError("no kernel here")
        qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=k.shape[2] != q.shape[2])
        return o.transpose(1, 2).to(q.dtype)

    fah = types.SimpleNamespace(attention=attention)

    def timer(fn):
        fn()
        return {"median": 1.0}

    base = ["--tokens", "128", "--hidden", "64", "--head-dims", "32", "--no-check", "--backends", "ours"]
    args = nb.parse_args(base)

    def run(feature, causal, seqlen, a=args):
        spec = {"feature": feature, "head_dim": 32, "causal": causal, "seqlen": seqlen}
        return nb.run_point(torch, F, fah, timer, a, spec, torch.bfloat16, lambda hd: None)

    rec = run("gqa", False, 64)  # 2 query heads, 1 KV head
    for d in ("fwd", "bwd"):
        (x,) = rec[d]["adjacent"]
        assert (x["kind"], x["causal"], x["seqlen"], x["batch"]) == ("same", False, 64, 2)
        assert x["ratio"] == pytest.approx(1.0)  # the same FLOPs: the backward's factor on both sides
    assert ((2, 64, 2, 32), (2, 64, 2, 32), False, (-1, -1), 0.0, False) in calls  # the reference: MHA
    assert ((2, 64, 2, 32), (2, 64, 1, 32), False, (-1, -1), 0.0, False) in calls  # the feature

    calls.clear()
    rec = run("window", True, 64)  # window (1024, 0) covers 64 keys: causal, 32.5 keys per row on average
    pairs = nb.window_pairs(64, nb.WINDOW, 0)
    for d in ("fwd", "bwd"):
        got = {x["kind"]: x for x in rec[d]["adjacent"]}
        assert set(got) == {"equal_work", "equal_work_causal"}
        assert (got["equal_work"]["seqlen"], got["equal_work"]["batch"]) == (32, 4)
        assert got["equal_work"]["ratio"] == pytest.approx(pairs * 2 / (4 * 32 * 32))
        assert (got["equal_work_causal"]["seqlen"], got["equal_work_causal"]["batch"]) == (64, 2)
        assert got["equal_work_causal"]["ratio"] == pytest.approx(pairs * 2 / (2 * 64 * 64 / 2))
    assert any(c[0] == (4, 32, 2, 32) and not c[2] for c in calls) and any(c[3] == (nb.WINDOW, 0) for c in calls)

    fail_seqlen.append(32)  # the non-causal equal-work reference fails; the causal one still runs
    rec = run("window", True, 64)
    for d in ("fwd", "bwd"):
        got = {x["kind"]: x for x in rec[d]["adjacent"]}
        assert got["equal_work"]["ratio"] is None and "no kernel here" in got["equal_work"]["error"]
        assert got["equal_work_causal"]["ratio"] == pytest.approx(pairs * 2 / (2 * 64 * 64 / 2))
    fail_seqlen.clear()

    calls.clear()
    rec = run("deterministic", True, 64)
    assert [x["ratio"] for d in ("fwd", "bwd") for x in rec[d]["adjacent"]] == [pytest.approx(1.0)] * 2
    assert {c[5] for c in calls} == {True, False}  # the feature with deterministic=True, the reference without

    rec = run("softcap", False, 64, nb.parse_args(base + ["--no-adjacent"]))
    assert "adjacent" not in rec["fwd"] and "adjacent" not in rec["bwd"]
    assert "adjacent" not in run("dense", False, 64)["fwd"]


@pytest.mark.parametrize("group, causal, window, softcap", [(1, False, (-1, -1), 0.0), (1, True, (-1, -1), 0.0),
                                                        (4, False, (5, 5), 0.0), (2, True, (7, 0), 2.0),
                                                        (1, False, (-1, -1), 1.5), (4, True, (-1, -1), 0.0)])
def test_benchmark_references_agree_with_testing(group, causal, window, softcap):
    """The benchmark's own references (a row slice of the forward, one K/V head's gradients from the equations, both
    kept small enough for seqlen 16384) against flash_attn_hopper.testing's attention_ref / attention_bwd_ref on the
    same float64 problem, with GQA's head mapping, windows, causal and softcap."""
    torch = pytest.importorskip("torch")
    from flash_attn_hopper import testing

    gen = torch.Generator().manual_seed(group * 100 + int(causal) * 10 + window[0])
    seqlen, nheads, head_dim = 37, 4, 16
    q = torch.randn(2, seqlen, nheads, head_dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, seqlen, nheads // group, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, seqlen, nheads, head_dim, generator=gen, dtype=torch.float64)
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    rows = torch.tensor([0, 3, 17, 36])
    got = nb.reference_slice(torch, q, k, v, causal, rows, window, softcap)
    want, _ = testing.attention_ref(q, k, v, **opts)
    heads = min(nb.REF_HEADS, nheads)
    assert got.shape == (4, heads, head_dim)
    torch.testing.assert_close(got, want[0, rows, :heads], rtol=1e-12, atol=1e-12)
    dq, dk, dv = testing.attention_bwd_ref(q, k, v, dout, **opts)
    for kv_head in range(nheads // group):
        g = nb.reference_grads_kv_head(torch, q, k, v, dout, causal, kv_head, window, softcap)
        torch.testing.assert_close(g[0], dq[0, :, kv_head * group:(kv_head + 1) * group], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g[1], dk[0, :, kv_head], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g[2], dv[0, :, kv_head], rtol=1e-12, atol=1e-12)
    naive = nb.reference_slice(torch, q.bfloat16(), k.bfloat16(), v.bfloat16(), causal, rows, window, softcap,
                               upcast=False)
    assert naive.dtype == torch.bfloat16  # the naive reference stays in the input dtype


def test_flag_is_design_rule():
    """_flag: DESIGN.md §3's bound exactly (2 x the naive error + floor passes, a hair more fails); a NaN or inf of
    ours flags, and so does a naive error that bounds nothing."""
    n, f = 3e-3, 1e-3
    assert nb._flag(2 * n + f, n, f) is False and nb._flag(0.0, n, f) is False
    assert nb._flag((2 * n + f) * (1 + 1e-9), n, f) is True
    for bad in (float("nan"), float("inf")):
        assert nb._flag(bad, n, f) is True and nb._flag(0.0, bad, f) is True


def _reference_fah(fault=None):
    """A stand-in for flash_attn_hopper on the CPU: testing.attention_ref in float32, returned in the input dtype (it
    meets DESIGN.md §3's bound), or with one fault: "causal" drops the causal mask, "window" / "softcap" drop the
    option, "gqa" maps query head h to K/V head h % nheads_k instead of h // (nheads / nheads_k), "nan_head0"
    puts one NaN into the output gradient of query head 0 (so into its dQ and the dK, dV of its K/V head)."""
    import types

    import torch

    from flash_attn_hopper import testing

    def attention(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
        if fault == "causal":
            causal = False
        if fault == "window":
            window_size = (-1, -1)
        if fault == "softcap":
            softcap = 0.0
        if fault == "gqa":
            heads = torch.arange(q.shape[2]) % k.shape[2]
            k, v = k[:, :, heads], v[:, :, heads]
        out, _ = testing.attention_ref(q, k, v, causal=causal, window_size=window_size, softcap=softcap)
        out = out.to(q.dtype)
        if fault == "nan_head0":
            out = NanGradHead0.apply(out)
        return out

    class NanGradHead0(torch.autograd.Function):
        """Identity forward; its backward puts one NaN into the gradient of query head 0 (row 0)."""

        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            g[0, 0, 0, 0] = float("nan")
            return g

    def attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=False):
        b = cu_q.numel() - 1
        out = attention(*(t.view(b, max_q, *t.shape[1:]) for t in (q, k, v)), causal=causal)
        return out.reshape(q.shape)

    return types.SimpleNamespace(attention=attention, attention_varlen=attention_varlen)


@pytest.mark.parametrize("feature, fault", [("dense", "causal"), ("varlen", "causal"), ("deterministic", "causal"),
                                            ("gqa", "gqa"), ("window", "window"), ("softcap", "softcap")])
def test_every_point_is_checked_against_its_own_reference(monkeypatch, feature, fault):
    """run_point's check on the CPU: every feature point (before session 74 only dense MHA points were) is compared
    with the float32 reference of its own problem and bounded by DESIGN.md §3's rule (2 x the naive reference's
    error + floor). A stand-in built on the reference passes in both directions; one that drops the feature's
    meaning is flagged in both."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    monkeypatch.setattr(nb, "DEVICE", "cpu")
    monkeypatch.setattr(nb, "WINDOW", 8)  # a window narrower than the 64 keys
    monkeypatch.setattr(nb, "SOFTCAP", 1.0)  # a softcap that changes scores of unit size
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    args = nb.parse_args(["--tokens", "128", "--hidden", "256", "--head-dims", "32", "--backends", "ours",
                          "--no-adjacent"])
    spec = {"feature": feature, "head_dim": 32, "causal": True, "seqlen": 64}

    def run(fah):
        return nb.run_point(torch, F, fah, lambda fn: (fn(), {"median": 1.0})[1], args, spec, torch.bfloat16,
                            lambda hd: None)

    good, bad = run(_reference_fah()), run(_reference_fah(fault))
    nan_first = run(_reference_fah("nan_head0"))  # one NaN in query head 0's dQ only: a later finite head keeps it
    assert nan_first["bwd"]["check"]["flag"] is True and math.isnan(nan_first["bwd"]["check"]["ref_err"]["ours"]["dq"])
    assert good["nheads_kv"] == (2 if feature == "gqa" else 8)
    for d in ("fwd", "bwd"):
        chk = good[d]["check"]
        naive = chk["naive_err"] if d == "bwd" else {"out": chk["naive_err"]}
        ours = chk["ref_err"]["ours"] if d == "bwd" else {"out": chk["ref_err"]["ours"]}
        assert all(0 < x < 0.1 for x in naive.values()), naive  # bf16 rounding, not zero, not a wrong answer
        assert chk["flag"] is False and all(ours[g] <= 2 * naive[g] for g in ours), (ours, naive)
        assert bad[d]["check"]["flag"] is True, (d, bad[d]["check"])
    assert good["bwd"]["check"]["ref_heads"] == (4 if feature == "gqa" else 2)  # GQA: the group of K/V head 0


def test_feature_ratios_show_the_references_timed_beside():
    results = []
    for causal, s, t in ((False, 16384, 640.0), (True, 16384, 620.0)):
        rec = {"feature": "dense", "head_dim": 128, "causal": causal, "seqlen": s, "dtype": "bf16"}
        rec["fwd"] = _part(1e12, {"ours": t, "cudnn": 500.0, "fa2": 300.0})
        results.append(rec)
    sc = {"feature": "softcap", "head_dim": 128, "causal": False, "seqlen": 16384, "dtype": "bf16",
          "fwd": _part(1e12, {"ours": 560.0, "cudnn": None, "fa2": None})}
    sc["fwd"]["adjacent"] = [{"kind": "same", "causal": False, "seqlen": 16384, "batch": 1, "rounds": 2,
                              "ours_tflops": 570.0, "reference_tflops": 600.0, "ratio": 0.95}]
    win = {"feature": "window", "head_dim": 128, "causal": True, "seqlen": 16384, "dtype": "bf16",
           "fwd": _part(1e12, {"ours": 490.0, "cudnn": None, "fa2": None})}
    win["fwd"]["adjacent"] = [
        {"kind": "equal_work", "causal": False, "seqlen": 1024, "batch": 16, "rounds": 2, "ours_tflops": 490.0,
         "reference_tflops": 576.0, "ratio": 490.0 / 576.0},
        {"kind": "equal_work_causal", "causal": True, "seqlen": 2048, "batch": 8, "rounds": 2,
         "error": "RuntimeError: out of memory", "ratio": None},
    ]
    results += [sc, win]
    got = {x["key"][0]: x for x in nb.feature_ratios(results)}
    assert got["softcap"]["adjacent"]["same"]["ratio"] == pytest.approx(0.95)
    assert set(got["window"]["adjacent"]) == {"equal_work"}  # the failed reference is left out
    text = nb.format_summary({"meta": {}, "results": results})
    assert "| softcap | 128 | no | 16384 | 560 | 0.88 | — | — | 0.95 (same 16384) |" in text
    assert "| window | 128 | yes | 16384 | 490 | 0.79 | n/a | n/a | 0.85 (equal work 1024) |" in text


# ------------------------------------------------------------------------------------------------------- plots


@needs_mpl
def test_plots_are_written(tmp_path):
    paths = nb.plot_record(make_record(), str(tmp_path / "plots"))
    assert sorted(os.path.basename(p) for p in paths) == ["tflops_bwd.png", "tflops_fwd.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == PNG_MAGIC


@needs_mpl
def test_history_plot_from_folder(tmp_path):
    hist = tmp_path / "history"
    hist.mkdir()
    for i, scale in enumerate((0.9, 1.0, 1.05)):
        _write(hist / f"run{i}.json", make_record(scale=scale, date=f"2026-12-0{i + 1}T02:00:00+00:00",
                                                  commit=str(i) * 40))
    (hist / "notes.json").write_text('{"not": "a record"}')  # ignored
    docs = nb.load_history(str(hist), extra=make_record(date="2026-12-09T02:00:00+00:00"))
    assert len(docs) == 4 and docs[-1]["meta"]["date"].startswith("2026-12-09")
    out = nb.plot_history(docs, str(tmp_path / "h.png"))
    with open(out, "rb") as f:
        assert f.read(8) == PNG_MAGIC


@needs_mpl
def test_cli_plots_summary_history(tmp_path):
    hist = tmp_path / "history"
    hist.mkdir()
    _write(hist / "old.json", make_record(date="2026-11-30T02:00:00+00:00"))
    plots, summary = tmp_path / "plots", tmp_path / "summary.md"
    rc, _ = _main(GRID + ["--json", str(tmp_path / "r.json"), "--plots", str(plots), "--summary", str(summary),
                          "--history", str(hist)])
    assert rc == 0
    assert sorted(os.listdir(plots)) == ["history.png", "tflops_bwd.png", "tflops_fwd.png"]
    assert summary.read_text().count("\n| ") == 9  # header + 8 points


def test_plots_without_matplotlib_fail_clearly(tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_mpl(name, *a, **k):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    rc = nb.main(["--input", _write(tmp_path / "r.json", make_record()), "--plots", str(tmp_path / "p")])
    assert rc == 2 and "plots need matplotlib" in capsys.readouterr().err

    def no_runner(args):
        raise AssertionError("a point would be measured before the plots' failure")

    # before any point: a grid run that cannot plot stops at once, not after the whole grid
    rc = nb.main(["--plots", str(tmp_path / "p"), "--json", str(tmp_path / "g.json")], runner_factory=no_runner)
    assert rc == 2 and "plots need matplotlib" in capsys.readouterr().err


def test_unreadable_compare_record_stops_before_any_point(tmp_path, capsys):
    def no_runner(args):
        raise AssertionError("a point would be measured before the baseline is read")

    rc = nb.main(["--compare", str(tmp_path / "missing.json"), "--json", str(tmp_path / "g.json")],
                 runner_factory=no_runner)
    assert rc == 2 and "cannot read --compare" in capsys.readouterr().err


def test_nothing_in_common_is_reported():
    other = make_record()
    for r in other["results"]:
        r["dtype"] = "fp16"
    cmp = nb.compare_records(make_record(), other, 0.05)
    assert not cmp["rows"] and not cmp["regressions"] and len(cmp["missing_now"]) == len(cmp["missing_base"]) == 16
    assert nb.format_comparison(cmp).splitlines()[-1].startswith("compare: PASS (nothing compared")


def test_varlen_point_packs_equal_lengths():
    """The varlen point runs attention_varlen on the dense point's tokens as equal-length sequences."""
    import torch

    calls = []

    class Fah:
        @staticmethod
        def attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=False):
            calls.append((q.shape, k.shape, cu_q.tolist(), cu_k is cu_q, max_q, max_k, causal))
            return q * 2

    assert nb.feature_support(Fah, "varlen") is None
    ours_kw, _, peer_reason = nb.feature_kwargs({"feature": "varlen", "causal": True})
    assert ours_kw == {"varlen": True} and "variable-length" in peer_reason
    q = torch.randn(3, 5, 4, 8)
    k = torch.randn(3, 5, 2, 8)
    out = nb._ours_call(Fah, q, k, k, True, ours_kw)
    assert out.shape == q.shape and torch.equal(out, q * 2)
    assert calls == [((15, 4, 8), (15, 2, 8), [0, 5, 10, 15], True, 5, 5, True)]


def test_time_all_settle_discards_one_timing_per_backend():
    """--settle: each backend is timed twice in a row and only the second timing is kept."""
    import types

    medians = iter([9.0, 1.0, 8.0, 2.0])  # ours: 9 discarded, 1 kept; cudnn: 8 discarded, 2 kept
    calls = []

    def timer(fn):
        calls.append(fn())
        return {"median": next(medians)}

    for settle, expect_calls in ((True, ["ours", "ours", "cudnn", "cudnn"]), (False, ["ours", "cudnn"])):
        calls.clear()
        medians = iter([9.0, 1.0, 8.0, 2.0] if settle else [1.0, 2.0])
        part = nb._new_part(1e12)
        args = types.SimpleNamespace(backends=["ours", "cudnn"], settle=settle)
        nb._time_all(None, timer, args, part, lambda name: (lambda: name), lambda name, fn: fn())
        assert calls == expect_calls
        assert part["ms"] == {"ours": 1.0, "cudnn": 2.0}


def test_time_all_rounds_rotation_and_lead_in(monkeypatch):
    """--rounds / rotation / lead-in: the first backend of the point's order is timed once and discarded, each round
    reverses the order of the one before, the order is rotated by the step drawn for the call (stubbed here: 0, then
    1), and the kept median is the median of the rounds' medians (one faster round does not decide the figure)."""
    import types

    calls = []
    readings = {"ours": iter([50.0, 1.0, 3.0]), "cudnn": iter([2.0, 4.0]), "fa2": iter([5.0, 7.0])}

    def timer(fn):
        name = fn()
        calls.append(name)
        return {"median": next(readings[name]), "p20": 0.5, "p80": 9.0, "min": 0.1, "max": 10.0, "n": 3}

    args = types.SimpleNamespace(backends=["ours", "cudnn", "fa2"], rounds=2, rotate=True, lead_in=True)
    monkeypatch.setattr(nb, "_ORDER_RANDOM", types.SimpleNamespace(randrange=lambda n: next(steps) % n))
    steps = iter([0, 1])  # this call's rotation: none; the next call's: one step
    part = nb._new_part(1e12)
    nb._time_all(None, timer, args, part, lambda name: (lambda: name), lambda name, fn: fn())
    assert calls == ["ours", "ours", "cudnn", "fa2", "fa2", "cudnn", "ours"]
    assert part["order"] == [["ours", "cudnn", "fa2"], ["fa2", "cudnn", "ours"]]
    assert part["ms"] == {"ours": 2.0, "cudnn": 3.0, "fa2": 6.0}  # the lead-in's 50 is discarded
    assert part["stats"]["ours"]["round_medians"] == [1.0, 3.0] and part["stats"]["ours"]["n"] == 6
    assert part["ratio"]["ours/cudnn"] == pytest.approx(1.5)

    calls.clear()  # the next call one step further: cudnn first (and timed in the lead-in)
    readings = {"ours": iter([1.0, 1.0]), "cudnn": iter([1.0, 1.0, 1.0]), "fa2": iter([1.0, 1.0])}
    part = nb._new_part(1e12)
    nb._time_all(None, timer, args, part, lambda name: (lambda: name), lambda name, fn: fn())
    assert part["order"] == [["cudnn", "fa2", "ours"], ["ours", "fa2", "cudnn"]]
    assert calls[0] == "cudnn" and len(calls) == 7


def test_time_all_error_in_a_later_round_is_recorded():
    """A backend that fails in the second round gets an error and no figure, not its first round's timing."""
    import types

    seen = {"cudnn": 0}

    def timer(fn):
        name = fn()
        if name == "cudnn":
            seen["cudnn"] += 1
            if seen["cudnn"] == 2:
                raise RuntimeError("boom")
        return {"median": 1.0}

    args = types.SimpleNamespace(backends=["ours", "cudnn"], rounds=2)
    part = nb._new_part(1e12)
    nb._time_all(None, timer, args, part, lambda name: (lambda: name), lambda name, fn: fn())
    assert "cudnn" in part["errors"] and part["tflops"]["cudnn"] is None and part["ms"]["ours"] == 1.0
    assert "ours/cudnn" not in part["ratio"]


def test_time_all_rotation_does_not_follow_the_grid():
    """The rotation is a seeded random step per call: over a grid's forward and backward calls, with two or three
    backends, every backend leads some forward points and some backward points (a step of one per call put ours
    first at every forward with two backends, and at every 1024-key forward with three)."""
    import types

    for backends in (["ours", "cudnn"], ["ours", "cudnn", "fa2"]):
        firsts = {"fwd": set(), "bwd": set()}
        args = types.SimpleNamespace(backends=backends, rounds=1, rotate=True, lead_in=False)
        for point in range(18):
            for d in ("fwd", "bwd"):
                part = nb._new_part(1e12)
                nb._time_all(None, lambda fn: {"median": 1.0}, args, part, lambda name: (lambda: name),
                             lambda name, fn: fn())
                firsts[d].add(part["order"][0][0])
        assert firsts["fwd"] == set(backends) and firsts["bwd"] == set(backends), (backends, firsts)
