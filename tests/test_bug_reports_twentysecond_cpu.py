"""Twenty-second round of the bug hunt (tests/bug_report_sources.md, "Twenty-second round"), CPU part: the parts of the
package other than flash_attn_hopper.testing (the benchmark CLI, packaging knobs, narrow builds seen from the API).

EU: the benchmark CLI took grid sizes it cannot run (cf. flashinfer-ai/flashinfer#3285's review: a benchmark's
`--sequence-lengths 0` divided by zero; axolotl-ai-cloud/axolotl#3776's review: dimensions not validated at argument
parsing): `--seqlens 0` divided by zero in run_point after the metadata and the points before it, a negative seqlen or
--hidden made negative shapes (an uncaught error mid-run), `--hidden 0` points of 0 heads whose ours/peer TFLOP/s ratio
divided 0 by 0, `--tokens 0`, `--rep 0` and a negative --warmup were silently taken, and head dims flash_attn_hopper has
no kernel for (60, 512) were recorded as "not in this build (FAH_HDIMS ...)". FAULT, fixed: parse_args refuses them by
flag (exit 2).
EV: the benchmark's JSON record held bare NaN (a check's maxdiff or reference error when an output is not finite: the
points the record exists to show), which JSON does not have (dotnet/BenchmarkDotNet#1242: "fails most JSON parsers";
redis/memtier_benchmark#271 and its fix #273: `-nan` in the JSON output). FAULT, fixed: written as "nan" / "inf" /
"-inf" strings, read back as floats.
EW: the regression gate given a threshold or a record it cannot compare (synaptent/aragora#8043: reject NaN and
infinite benchmark regression thresholds; pallets/click#3347: a NaN passed a range check, every comparison with it
False): `--threshold nan` (and inf) passed a 10% slowdown; a NaN TFLOP/s in a baseline passed its point, a 0 divided by
zero. FAULT, fixed: the threshold must be finite and >= 0 (CLI and compare_records), such points are reported as
missing on their side.
EX: build knobs (FAH_HDIMS / FAH_DTYPES) that select nothing (cf. flashinfer-ai/flashinfer#751: a FLASHINFER_HEAD_DIMS
value the sm90 kernels do not take broke the build; Dao-AILab/flash-attention#1165: a head dim removed by hand left an
undefined symbol at import): "FAH_HDIMS=," gave an empty list, a build without kernels, every call failing at run time.
FAULT, fixed in setup.py: exit naming the knob. Checked, no fault: a narrow build (FAH_HDIMS=64,128 FAH_DTYPES=bf16)
refuses a head_dim or dtype it lacks with a ValueError / TypeError naming the argument, the kernel and the build, before
any launch, through attention and attention_varlen; the benchmark records such points as skipped with that reason.
EY: the backward ops' fake kernels took an LSE of the wrong sizes or layout and any dlse, which the C++ ops refuse (a
site the fake kernels' checks of session 47 did not reach; pytorch/pytorch#155616: checks in C++ kernels do not apply
to fake tensors, only those of the fake / meta implementation do; zhuzilin/ring-flash-attention#47: ring attention
calls the backward op directly with an LSE whose shape changed between versions). A direct bwd / bwd_varlen call on meta
or fake tensors (shape tracing, FLOP counting, a torch.compile trace of such a call) passed, to fail only when the real
op ran. FAULT, fixed in _ops.py: the fake kernels raise the C++ ops' RuntimeError.
"""

import ast
import contextlib
import functools
import json
import math
import os
import re
import sys

import pytest
import torch

from flash_attn_hopper import _ops, attention, attention_varlen, interface
from flash_attn_hopper import benchmark as nb

import cpu_stand_ins

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REAL_CHECK_COMPILED = interface._check_compiled  # (the cpu_ops fixture replaces it; EX's narrow-build test needs it)

GRID = ["--head-dims", "64", "--seqlens", "1024", "--causal", "no", "--features", "dense", "--no-bar"]


class _Runner:
    """Stands in for benchmark.GpuRunner (main's runner_factory seam): every backend at `tflops` TFLOP/s (ours times
    `scale`), each direction's check holding `maxdiff` as the maxdiff and ours' float32-reference error."""

    def __init__(self, args, scale=1.0, tflops=500.0, maxdiff=1e-3):
        self.args, self.scale, self.tflops, self.maxdiff = args, scale, tflops, maxdiff

    def meta(self):
        return {"schema": nb.SCHEMA, "date": "2026-12-03T02:00:00+00:00", "gpu": "NVIDIA H200", "git_commit": "c" * 40}

    def clocks(self):
        return {"sm_mhz": 1980, "max_sm_mhz": 1980}

    def support(self, feature):
        return None if feature == "dense" else f"fake runner: no {feature}"

    @contextlib.contextmanager
    def spacer(self, attempt):
        yield

    def run(self, spec, args):
        batch, nheads = max(1, args.tokens // spec["seqlen"]), args.hidden // spec["head_dim"]
        rec = dict(spec, batch=batch, nheads=nheads, nheads_kv=nheads, dtype=args.dtype)
        for d in args.directions:
            flops = nb.point_flops(spec, batch, nheads) * (nb.BWD_FLOPS_FACTOR if d == "bwd" else 1)
            part = nb._new_part(int(flops))
            for name in args.backends:
                t = self.tflops * (self.scale if name == "ours" else 1.0)
                ms = part["flops"] / (t * 1e12) * 1e3
                part["ms"][name], part["tflops"][name] = ms, t
                part["stats"][name] = {"median": ms, "p20": ms, "p80": ms, "min": ms, "max": ms, "n": 10}
            part["check"] = {"maxdiff_vs_cudnn": self.maxdiff, "ref_err": {"ours": self.maxdiff, "cudnn": 1e-3},
                             "flag": not math.isfinite(self.maxdiff)}
            rec[d] = part
        return rec


def _main(argv, **runner):
    return nb.main(argv, runner_factory=lambda args: _Runner(args, **runner))


def _strict_json(text):
    """json.loads refusing NaN, Infinity and -Infinity (which RFC 8259 does not have, and JSON.parse refuses)."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


# ------------------------------------------------------------------------------------------------ EU: grid sizes

@pytest.mark.parametrize("argv, flag", [
    (["--seqlens", "0"], "--seqlens"),
    (["--seqlens", "512,-512"], "--seqlens"),
    (["--tokens", "0"], "--tokens"),
    (["--hidden", "0"], "--hidden"),
    (["--hidden", "-2048"], "--hidden"),
    (["--warmup", "-5"], "--warmup"),
    (["--rep", "0"], "--rep"),
    (["--head-dims", "60", "--hidden", "1920"], "--head-dims"),
    (["--head-dims", "512"], "--head-dims"),
    (["--head-dims", "64,264", "--hidden", "16896"], "--head-dims"),
    (["--rounds", "0"], "--rounds"),
    (["--preheat", "-1"], "--preheat"),
    (["--preheat", "nan"], "--preheat"),
], ids=["seqlen_0", "seqlen_negative", "tokens_0", "hidden_0", "hidden_negative", "warmup_negative", "rep_0",
        "head_dim_60", "head_dim_512", "head_dim_264", "rounds_0", "preheat_negative", "preheat_nan"])
def test_cli_refuses_grid_sizes_it_cannot_run(argv, flag, capsys):
    """EU: each is refused at parsing (exit status 2) naming its flag, before any measurement (a seqlen of 0 divided by
    zero in run_point mid-run; a negative seqlen or hidden made negative shapes, hidden 0 a 0 / 0 ratio; tokens 0, rep
    0 and a negative warmup were taken; flash_attn_hopper has no kernel for head_dim 60, 264 or 512)."""
    with pytest.raises(SystemExit) as e:
        nb.parse_args(argv + ["--json", "x.json"])
    assert e.value.code == 2
    # argparse's usage block names every flag: the error line itself must name this one.
    assert flag in capsys.readouterr().err.strip().splitlines()[-1]


def test_cli_takes_the_smallest_runnable_sizes_and_peer_only_head_dims():
    """EU's control: seqlen 1, one token, --warmup 0 --rep 1, head dims 8 and 256 are taken; a head_dim only the peers
    run is taken when ours is not timed."""
    args = nb.parse_args(["--seqlens", "1", "--tokens", "1", "--warmup", "0", "--rep", "1", "--head-dims", "8,256",
                          "--json", "x.json"])
    assert (args.seqlens, args.tokens, args.warmup, args.rep, args.head_dims) == ([1], 1, 0, 1, [8, 256])
    args = nb.parse_args(["--backends", "cudnn,fa2", "--head-dims", "60", "--hidden", "1920", "--json", "x.json"])
    assert args.head_dims == [60] and args.backends == ["cudnn", "fa2"]


def test_cli_head_dim_rule_is_the_librarys():
    """EU: the benchmark's own statement of the head_dim rule (it parses without importing torch) agrees with
    interface.kernel_head_dim at every head_dim from -8 to 520."""
    for hd in range(-8, 521):
        assert nb.ours_runs_head_dim(hd) == (hd > 0 and interface.kernel_head_dim(hd) is not None), hd


# ------------------------------------------------------------------------------------------------ EV: JSON record

def test_record_with_non_finite_checks_is_standard_json_and_reads_back(tmp_path, capsys):
    """EV: a run whose checks are NaN (ours not finite: the flagged point) writes a record that a strict JSON parser
    reads; --input reads the NaN back (the table shows it, flagged), and infinite values round-trip too."""
    out = tmp_path / "run.json"
    assert _main(GRID + ["--json", str(out)], maxdiff=math.nan) == 0
    doc = _strict_json(out.read_text())
    check = doc["results"][0]["fwd"]["check"]
    assert check["maxdiff_vs_cudnn"] == "nan" and check["ref_err"]["ours"] == "nan" and check["flag"] is True

    back = nb.load_record(str(out))
    check = back["results"][0]["fwd"]["check"]
    assert math.isnan(check["maxdiff_vs_cudnn"]) and math.isnan(check["ref_err"]["ours"])
    assert check["ref_err"]["cudnn"] == 1e-3  # finite values unchanged
    capsys.readouterr()
    assert nb.main(["--input", str(out)]) == 0
    assert "nan !" in capsys.readouterr().out

    doc = {"meta": {}, "results": [], "extra": [math.inf, -math.inf, 1.5, "text"]}
    nb.write_json(str(tmp_path / "inf.json"), doc)
    assert _strict_json((tmp_path / "inf.json").read_text())["extra"] == ["inf", "-inf", 1.5, "text"]
    assert nb.load_record(str(tmp_path / "inf.json"))["extra"] == [math.inf, -math.inf, 1.5, "text"]


def test_record_with_a_comparison_stays_standard_json(tmp_path):
    """EV: the record rewritten with --compare's summary is standard JSON too (and the run is still compared)."""
    base = tmp_path / "base.json"
    assert _main(GRID + ["--json", str(base)]) == 0
    out = tmp_path / "run.json"
    assert _main(GRID + ["--json", str(out), "--compare", str(base)], maxdiff=math.nan) == 0
    doc = _strict_json(out.read_text())
    assert "compare" in doc and doc["results"][0]["bwd"]["check"]["maxdiff_vs_cudnn"] == "nan"


# ------------------------------------------------------------------------------------------------ EW: the gate

@pytest.mark.parametrize("threshold", ["nan", "inf", "-0.01"])
def test_gate_refuses_a_threshold_that_bounds_nothing(threshold, tmp_path, capsys):
    """EW: against a baseline 10% faster, --threshold nan (every comparison False) and inf passed the run (exit 0);
    now refused at parsing (exit 2) naming --threshold, as a negative one already was. The control: 0.05 fails the
    run (exit 1)."""
    base = tmp_path / "base.json"
    assert _main(GRID + ["--json", str(base)], scale=1.1) == 0
    args = GRID + ["--json", str(tmp_path / "run.json"), "--compare", str(base)]
    with pytest.raises(SystemExit) as e:
        _main(args + ["--threshold", threshold])
    assert e.value.code == 2 and "--threshold" in capsys.readouterr().err.strip().splitlines()[-1]
    assert _main(args + ["--threshold", "0.05"]) == 1


@pytest.mark.parametrize("threshold", [math.nan, math.inf, -0.1, "0.05", True])
def test_compare_records_refuses_a_threshold_that_bounds_nothing(threshold):
    """EW: compare_records itself (the gate's function) refuses a threshold that is not a finite number >= 0."""
    rec = _Runner(nb.parse_args(GRID + ["--json", "x"])).run(
        {"feature": "dense", "head_dim": 64, "causal": False, "seqlen": 1024}, nb.parse_args(GRID + ["--json", "x"]))
    doc = {"meta": {}, "results": [rec]}
    with pytest.raises(ValueError, match="threshold"):
        nb.compare_records(doc, doc, threshold)


def _record(tflops_by_seqlen):
    """A record of dense points at head_dim 64, one per seqlen, ours at the given TFLOP/s (forward only)."""
    results = []
    for seqlen, t in tflops_by_seqlen.items():
        part = nb._new_part(10**12)
        part["tflops"] = {"ours": t, "cudnn": 400.0, "fa2": 300.0}
        results.append({"feature": "dense", "head_dim": 64, "causal": False, "seqlen": seqlen, "dtype": "bf16",
                        "fwd": part})
    return {"meta": {}, "results": results}


def test_gate_reports_points_it_cannot_compare():
    """EW: a baseline whose TFLOP/s is NaN (it passed, whatever the run measured) or 0 (ZeroDivisionError), and a run
    whose TFLOP/s is 0, are reported as missing on their side with the value; the other points are still compared (a
    10% slowdown at seqlen 512 stays a regression)."""
    base = _record({512: 550.0, 1024: math.nan, 2048: 0.0, 4096: 500.0})
    now = _record({512: 500.0, 1024: 200.0, 2048: 500.0, 4096: 0.0})
    cmp = nb.compare_records(now, base, 0.05)
    seqlen = lambda key: key[4]  # noqa: E731 (point_key: feature, dtype, head_dim, causal, seqlen, direction)
    assert [seqlen(r["key"]) for r in cmp["regressions"]] == [512]
    assert sorted(seqlen(k) for k, _ in cmp["missing_base"]) == [1024, 2048]
    assert [seqlen(k) for k, _ in cmp["missing_now"]] == [4096]
    assert all("not a positive finite number" in why for _, why in cmp["missing_base"] + cmp["missing_now"])
    text = nb.format_comparison(cmp)
    assert "FAIL" in text.splitlines()[-1]


def test_gate_remeasure_of_zero_keeps_the_regression():
    """EW: a re-measure that returns 0 TFLOP/s (a broken timing) keeps the point a regression instead of dividing by
    zero; a re-measure within the threshold clears it (the control)."""
    base, now = _record({512: 550.0}), _record({512: 500.0})
    cmp = nb.compare_records(now, base, 0.05, remeasure=lambda keys: {k: 0.0 for k in keys})
    assert len(cmp["regressions"]) == 1 and cmp["regressions"][0]["remeasured"] == 0.0
    cmp = nb.compare_records(now, base, 0.05, remeasure=lambda keys: {k: 549.0 for k in keys})
    assert not cmp["regressions"] and len(cmp["noise"]) == 1


# ------------------------------------------------------------------------------------------------ EX: build knobs

@functools.lru_cache(maxsize=None)
def _setup_list_knob():
    """setup.py's _list_knob, taken from its source without running setup() (which builds the extension)."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_list_knob")
    namespace = {"os": os, "sys": sys}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "setup.py", "exec"), namespace)
    return namespace["_list_knob"]


_HDIMS, _DTYPES = (64, 96, 128, 192, 256), ("fp16", "bf16")


@pytest.mark.parametrize("name, raw", [("FAH_HDIMS", ","), ("FAH_HDIMS", " , ,"), ("FAH_DTYPES", ","),
                                       ("FAH_DTYPES", " ,, ")])
def test_build_knob_that_selects_nothing_is_refused(name, raw, monkeypatch):
    """EX: a knob whose list is empty once split ("," from a script joining an empty list) selected no kernel at all;
    now the build stops naming the knob."""
    monkeypatch.setenv(name, raw)
    allowed, cast = (_HDIMS, int) if name == "FAH_HDIMS" else (_DTYPES, str)
    with pytest.raises(SystemExit) as e:
        _setup_list_knob()(name, allowed, cast)
    assert re.match(re.escape(name) + r"=.*selects nothing", str(e.value.code))


@pytest.mark.parametrize("name, raw, expected", [
    ("FAH_HDIMS", "", list(_HDIMS)), ("FAH_HDIMS", "  ", list(_HDIMS)), ("FAH_HDIMS", "128, 64,64", [64, 128]),
    ("FAH_DTYPES", "bf16", ["bf16"]), ("FAH_DTYPES", "bf16,fp16", ["fp16", "bf16"]),
    ("FAH_HDIMS", "72", None), ("FAH_HDIMS", "64 128", None), ("FAH_DTYPES", "fp32", None),
])
def test_build_knobs_take_lists_and_refuse_values_by_name(name, raw, expected, monkeypatch):
    """EX's control: unset or blank means all, lists are ordered and deduplicated, values outside the kernels (72, a
    space-separated list, fp32) stop the build naming the knob."""
    monkeypatch.setenv(name, raw)
    allowed, cast = (_HDIMS, int) if name == "FAH_HDIMS" else (_DTYPES, str)
    if expected is not None:
        assert _setup_list_knob()(name, allowed, cast) == expected
    else:
        with pytest.raises(SystemExit) as e:
            _setup_list_knob()(name, allowed, cast)
        assert str(e.value.code).startswith(name)


def _dense(head_dim, head_dim_v, dtype):
    """Seeded q (2, 9, 4, head_dim), k (2, 11, 2, head_dim), v (2, 11, 2, head_dim_v)."""
    torch.manual_seed(5)
    return (torch.randn(2, 9, 4, head_dim, dtype=dtype), torch.randn(2, 11, 2, head_dim, dtype=dtype),
            torch.randn(2, 11, 2, head_dim_v, dtype=dtype))


def _varlen(head_dim, head_dim_v, dtype):
    """Seeded packed q (9, 4, head_dim), k (11, 2, head_dim), v (11, 2, head_dim_v); lengths (5, 4) and (6, 5)."""
    torch.manual_seed(6)
    cu_q, cu_k = torch.tensor([0, 5, 9], dtype=torch.int32), torch.tensor([0, 6, 11], dtype=torch.int32)
    return (torch.randn(9, 4, head_dim, dtype=dtype), torch.randn(11, 2, head_dim, dtype=dtype),
            torch.randn(11, 2, head_dim_v, dtype=dtype), cu_q, cu_k, 5, 6)


def _narrow_build(monkeypatch):
    """The build query answering as a FAH_HDIMS=64,128 FAH_DTYPES=bf16 build, and attention's build check restored."""
    monkeypatch.setattr(_ops, "_compiled", functools.lru_cache(maxsize=None)(lambda: ((64, 128), (torch.bfloat16,))))
    monkeypatch.setattr(interface, "_check_compiled", _REAL_CHECK_COMPILED)


@pytest.mark.parametrize("case", [
    (96, 96, torch.bfloat16, ValueError, "q has head_dim 96 (run by the head_dim 96 forward kernels), which this build "
     "does not include (built with head_dims [64, 128]"),
    (72, 72, torch.bfloat16, ValueError, "q has head_dim 72 (run by the head_dim 96 forward kernels)"),
    (64, 192, torch.bfloat16, ValueError, "q has head_dim 64 and v head_dim 192 (run by the head_dim 192 forward kernels)"),
    (200, 200, torch.bfloat16, ValueError, "q has head_dim 200 (run by the head_dim 256 forward kernels)"),
    (64, 64, torch.float16, TypeError, "q has dtype torch.float16, which this build does not include (built with "
     "[torch.bfloat16]"),
], ids=["96", "72_on_96", "v_192", "200", "fp16"])
def test_narrow_build_refuses_what_it_lacks_before_any_launch(case, cpu_ops, monkeypatch):
    """EX, checked (no fault): a narrow build refuses a head_dim whose forward kernel it lacks (also a head_dim_v) and a
    dtype it lacks, by name and with what it holds, before any op runs; q, k, v untouched; dense and varlen."""
    head_dim, head_dim_v, dtype, error, message = case
    _narrow_build(monkeypatch)
    q, k, v = _dense(head_dim, head_dim_v, dtype)
    before = [t.clone() for t in (q, k, v)]
    cpu_stand_ins.CALLS.clear()
    with pytest.raises(error, match="^" + re.escape(message)):
        attention(q, k, v, causal=True)
    qv, kv, vv, cu_q, cu_k, max_q, max_k = _varlen(head_dim, head_dim_v, dtype)
    with pytest.raises(error, match="^" + re.escape(message)):
        attention_varlen(qv, kv, vv, cu_q, cu_k, max_q, max_k)
    assert cpu_stand_ins.CALLS == []
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), before))


@pytest.mark.parametrize("head_dim", [8, 40, 64, 104, 128])
def test_narrow_build_runs_the_head_dims_its_kernels_hold(head_dim, cpu_ops, monkeypatch):
    """EX's control: the same narrow build runs head dims that its 64 and 128 kernels hold (8, 40 on 64; 104 on 128),
    forward and backward, dense and varlen."""
    _narrow_build(monkeypatch)
    q, k, v = (t.requires_grad_() for t in _dense(head_dim, head_dim, torch.bfloat16))
    out = attention(q, k, v, causal=True)
    out.float().sum().backward()
    assert out.shape == (2, 9, 4, head_dim) and q.grad.shape == q.shape
    qv, kv, vv, cu_q, cu_k, max_q, max_k = _varlen(head_dim, head_dim, torch.bfloat16)
    assert attention_varlen(qv, kv, vv, cu_q, cu_k, max_q, max_k).shape == qv.shape


def test_benchmark_skips_points_a_narrow_build_lacks():
    """EX's control for the benchmark: GpuRunner.ours_reason names the build for head dims and dtypes it lacks (72 runs
    its forward on 96) and gives None for those it holds (40 on 64)."""
    runner = object.__new__(nb.GpuRunner)
    runner.fah = type("Fah", (), {"interface": interface})()
    runner.fah_reason, runner.built, runner.dtype = None, {"head_dims": [64, 128], "dtypes": [torch.bfloat16]}, \
        torch.bfloat16
    runner.args = nb.parse_args(["--json", "x"])
    assert runner.ours_reason(96) == "head_dim 96 not in this build (FAH_HDIMS: [64, 128])"
    assert runner.ours_reason(72) == "head_dim 72 not in this build (FAH_HDIMS: [64, 128])"
    assert runner.ours_reason(40) is None and runner.ours_reason(128) is None
    runner.dtype, runner.args = torch.float16, nb.parse_args(["--dtype", "fp16", "--json", "x"])
    assert runner.ours_reason(64) == "dtype fp16 not in this build"


# ------------------------------------------------------------------------------------------------ EY: fake kernels

def _meta(*shape, dtype=torch.bfloat16, device="meta"):
    return torch.empty(*shape, device=device, dtype=dtype)


_LSE = "lse must be the contiguous float32 "
_DLSE = "dlse must be a float32 tensor of lse's shape on q's device"


@pytest.mark.skipif(not _ops.EXTENSION_LOADED, reason="the ops' schemas need the compiled extension")
@pytest.mark.parametrize("case", [
    ("lse_seqlen_34", dict(lse=(2, 4, 34)), _LSE),
    ("lse_nheads_2", dict(lse=(2, 2, 33)), _LSE),
    ("lse_transposed", dict(lse_t=True), _LSE),
    ("dlse_float16", dict(dlse=(2, 4, 33), dlse_dtype=torch.float16), _DLSE),
    ("dlse_shape", dict(dlse=(2, 4, 7)), _DLSE),
    ("dlse_on_cpu", dict(dlse=(2, 4, 33), dlse_device="cpu"), _DLSE),
], ids=lambda c: c[0])
def test_dense_backward_fake_kernel_checks_lse_and_dlse(case):
    """EY: ops.bwd on meta tensors refuses what the C++ op refuses (its message): an LSE of another seqlen or nheads, a
    transposed LSE, a dlse of another dtype, shape or device."""
    _, bad, message = case
    q = _meta(2, 33, 4, 64)
    lse = _meta(*bad.get("lse", (2, 4, 33)), dtype=torch.float32)
    if bad.get("lse_t"):
        lse = _meta(2, 33, 4, dtype=torch.float32).transpose(1, 2)
    dlse = None
    if "dlse" in bad:
        dlse = _meta(*bad["dlse"], dtype=bad.get("dlse_dtype", torch.float32), device=bad.get("dlse_device", "meta"))
    with pytest.raises(RuntimeError, match="^" + re.escape(message)):
        torch.ops.flash_attn_hopper.bwd(q, q, q, q, q, lse, dlse, 0.125, False, -1, -1, 0.0, False)


@pytest.mark.skipif(not _ops.EXTENSION_LOADED, reason="the ops' schemas need the compiled extension")
@pytest.mark.parametrize("case", [
    ("lse_rows_41", dict(lse=(4, 41)), _LSE),
    ("lse_token_major", dict(lse=(40, 4)), _LSE),
    ("dlse_shape", dict(dlse=(4, 39)), _DLSE),
    ("dlse_float64", dict(dlse=(4, 40), dlse_dtype=torch.float64), _DLSE),
], ids=lambda c: c[0])
def test_varlen_backward_fake_kernel_checks_lse_and_dlse(case):
    """EY: ops.bwd_varlen on meta tensors, the same (the LSE is (nheads, total_q))."""
    _, bad, message = case
    q = _meta(40, 4, 64)
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    lse = _meta(*bad.get("lse", (4, 40)), dtype=torch.float32)
    dlse = _meta(*bad["dlse"], dtype=bad.get("dlse_dtype", torch.float32)) if "dlse" in bad else None
    with pytest.raises(RuntimeError, match="^" + re.escape(message)):
        torch.ops.flash_attn_hopper.bwd_varlen(q, q, q, q, q, lse, dlse, cu, cu, 20, 20, 0.125, False, -1, -1, 0.0,
                                               False)


@pytest.mark.skipif(not _ops.EXTENSION_LOADED, reason="the ops' schemas need the compiled extension")
def test_backward_fake_kernels_take_what_the_ops_take():
    """EY's control: an LSE of the forward's shape with no dlse, a dlse expanded from one value (stride 0: the gradient
    of lse.sum(), which the C++ op makes contiguous), a transposed dlse, GQA with head_dim_v 128; dense and varlen."""
    ops = torch.ops.flash_attn_hopper
    q, k, v = _meta(2, 33, 6, 192), _meta(2, 50, 2, 192), _meta(2, 50, 2, 128)
    out, lse = ops.fwd(q, k, v, 0.1, True, -1, 0, 0.0, False)
    for dlse in (None, _meta(1, 1, 1, dtype=torch.float32).expand(2, 6, 33),
                 _meta(2, 33, 6, dtype=torch.float32).transpose(1, 2)):
        grads = ops.bwd(out, q, k, v, out, lse, dlse, 0.1, True, -1, 0, 0.0, False)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    q3, k3 = _meta(40, 4, 64), _meta(30, 2, 64)
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    out3, lse3 = ops.fwd_varlen(q3, k3, k3, cu, cu, 20, 15, 0.125, False, -1, -1, 0.0, False)
    for dlse in (None, _meta(1, 1, dtype=torch.float32).expand(4, 40)):
        grads = ops.bwd_varlen(out3, q3, k3, k3, out3, lse3, dlse, cu, cu, 20, 15, 0.125, False, -1, -1, 0.0, False)
        assert [g.shape for g in grads] == [q3.shape, k3.shape, k3.shape]
