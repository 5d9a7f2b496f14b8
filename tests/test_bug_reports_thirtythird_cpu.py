"""Thirty-third round of the bug hunt (tests/bug_report_sources.md, "Thirty-third round"): a helper's attempt, on the
CPU machine, to break the Python API before any launch (session 67). The public functions' checks held; what it found
was around them:

- GB: the benchmark's records. load_record checked only that "results" was a list, so a corrupted or hand-edited
  baseline (a JSON file that parses) crashed the tables or the comparison with a traceback and exit status 1, the
  status of a regression: a nightly gate read a broken baseline as slower kernels. Now the fields the tables,
  comparison and plots read are checked by type and range (ValueError naming the field), the tables, summary and a
  self-comparison then run once on the record (any failure: the same ValueError), and main reports "cannot read" with
  exit status 2; every attention record under benchmarks/ still loads.
- GC: the benchmark's output paths. --json or --summary naming a folder (or a path under a file, or ending with a
  separator) failed after the grid's first point (--json, leaving PATH.tmp beside it) or after the whole grid
  (--summary), with a traceback, and so did --plots or --history naming a file; now refused when the arguments are
  parsed (exit status 2).
- GD: flash_attn_hopper.testing's helpers took what the references refuse: document_mask truncated float ids (0.2 and
  0.7 one document) and failed on a 1-D tensor with a bare IndexError; causal_mask / local_mask failed inside torch on
  a negative or float seqlen; the references took any truthy upcast (the string "no" upcast). Each now raises as
  ``attention`` does, naming the argument.
"""

import glob
import json
import os

import numpy as np
import pytest
import torch

from flash_attn_hopper import benchmark as nb
from flash_attn_hopper import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POINT = {"feature": "dense", "head_dim": 64, "causal": False, "seqlen": 1024}

# ------------------------------------------------ GB: malformed records are unreadable input, never a regression

PART = {"flops": 1e12, "tflops": {"ours": 500.0}}
MALFORMED = {
    "result-not-an-object": {"results": [1]},
    "result-without-fields": {"results": [{}]},
    "meta-a-string": {"meta": "str", "results": []},
    "head-dim-a-string": {"results": [dict(POINT, head_dim="64")]},
    "seqlen-0": {"results": [dict(POINT, seqlen=0)]},
    "causal-missing": {"results": [{"head_dim": 64, "seqlen": 1024}]},
    "feature-null": {"results": [dict(POINT, feature=None)]},
    "dtype-a-list": {"results": [dict(POINT, dtype=["bf16"], fwd=PART)]},
    "fwd-a-number": {"results": [dict(POINT, fwd=5)]},
    "fwd-null": {"results": [dict(POINT, fwd=None)]},
    "fwd-without-flops": {"results": [dict(POINT, fwd={"tflops": {"ours": 500.0}})]},
    "tflops-a-list": {"results": [dict(POINT, fwd={"flops": 1e12, "tflops": [1, 2]})]},
    "tflops-a-string": {"results": [dict(POINT, fwd=dict(PART, tflops={"ours": "x"}))]},
    "tflops-past-float": {"results": [dict(POINT, fwd=dict(PART, tflops={"ours": 10 ** 400}))]},
    "ratio-a-bool": {"results": [dict(POINT, fwd=dict(PART, ratio={"ours/cudnn": True}))]},
    "stats-without-p80": {"results": [dict(POINT, fwd=dict(PART, stats={"ours": {"median": 1.0, "p20": 1.0}}))]},
    "stats-p80-zero": {"results": [dict(POINT, fwd=dict(PART, stats={"ours": {"median": 1, "p20": 1, "p80": 0}}))]},
    "round-medians-a-number": {"results": [dict(POINT, fwd=dict(PART, stats={"ours": {
        "median": 1.0, "p20": 1.0, "p80": 1.0, "round_medians": 1.0}}))]},
    "round-medians-with-a-string": {"results": [dict(POINT, fwd=dict(PART, stats={"ours": {
        "median": 1.0, "p20": 1.0, "p80": 1.0, "round_medians": [1.0, "x"]}}))]},
    "maxdiff-a-string": {"results": [dict(POINT, fwd=dict(PART, check={"maxdiff_vs_cudnn": "big"}))]},
    "adjacent-an-object": {"results": [dict(POINT, fwd=dict(PART, adjacent={"kind": "same"}))]},
    "adjacent-without-kind": {"results": [dict(POINT, fwd=dict(PART, adjacent=[{"seqlen": 1024, "ratio": 1.0}]))]},
    "sm-clock-a-string": {"meta": {"sm_clock_before": "fast"}, "results": []},
    "git-commit-a-number": {"meta": {"git_commit": 5}, "results": []},
    "not-json": None,
    "nested-past-the-parser": "deep",
}


def _write(tmp_path, name, doc):
    path = tmp_path / f"{name}.json"
    if doc == "deep":
        path.write_text('{"results": ' + "[" * 100000 + "]" * 100000 + "}")
    else:
        path.write_text("{not json" if doc is None else json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_records_are_unreadable_input(tmp_path, capsys, case):
    """GB: --input and --compare of a record whose fields the tables cannot read: exit status 2 with "cannot read"
    and the field named, never a traceback or the regression status 1."""
    bad = _write(tmp_path, case, MALFORMED[case])
    good = _write(tmp_path, "good", {"meta": {}, "results": []})
    with pytest.raises(ValueError, match="not a benchmark record|not JSON that a benchmark record can be"):
        nb.load_record(bad)
    capsys.readouterr()
    assert nb.main(["--input", bad]) == 2
    assert "cannot read --input" in capsys.readouterr().err
    assert nb.main(["--input", good, "--compare", bad]) == 2
    assert "cannot read --compare" in capsys.readouterr().err


def test_every_attention_record_in_the_repository_still_loads():
    """GB's check must not refuse the records the benchmark wrote: every JSON file under benchmarks/ whose results are
    attention points (a head_dim in the first) loads, and there are some."""
    paths = []
    for path in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "**", "*.json"), recursive=True)):
        with open(path) as f:
            try:
                doc = json.load(f)
            except ValueError:
                continue
        results = doc.get("results") if isinstance(doc, dict) else None
        if isinstance(results, list) and results and isinstance(results[0], dict) and "head_dim" in results[0]:
            paths.append(path)
    assert len(paths) >= 20, f"only {len(paths)} attention records found under benchmarks/"
    for path in paths:
        nb.load_record(path)


# ------------------------------------------------ GC: output paths checked when the arguments are parsed

@pytest.mark.parametrize("flag,target", [("--json", "folder"), ("--summary", "folder"), ("--json", "under-file"),
                                         ("--summary", "under-file"), ("--json", "trailing-separator"),
                                         ("--summary", "through-a-file"), ("--plots", "file"), ("--history", "file"),
                                         ("--plots", "broken-link")])
def test_output_paths_that_cannot_be_written_are_refused_at_parse_time(tmp_path, capsys, flag, target):
    """GC: a folder where a file is written (or a file where a folder is, a broken link for a folder), refused by
    parse_args (exit status 2, the flag named) before any point is measured."""
    afile = tmp_path / "afile"
    afile.write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    path = {"folder": str(tmp_path), "under-file": str(afile / "x.out"), "file": str(afile),
            "trailing-separator": str(tmp_path / "new") + os.sep, "through-a-file": str(afile) + "/../x.md",
            "broken-link": str(tmp_path / "dangling")}[target]
    with pytest.raises(SystemExit) as e:
        nb.parse_args([flag, path])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_output_paths_in_new_folders_are_taken(tmp_path):
    """GC's check takes what the writers create: new nested folders for --json / --summary / --plots."""
    args = nb.parse_args(["--json", str(tmp_path / "a" / "b" / "r.json"), "--summary", str(tmp_path / "c" / "s.md"),
                          "--plots", str(tmp_path / "d" / "e")])
    assert args.json.endswith("r.json") and args.summary.endswith("s.md") and args.plots.endswith("e")


# ------------------------------------------------ GD: the reference helpers' arguments

def test_document_mask_refuses_what_attention_refuses():
    """GD: float ids (truncated: 0.2 and 0.7 one document), a non-tensor and a 1-D tensor raise, naming
    document_ids; integer ids give the runs."""
    with pytest.raises(TypeError, match="document_ids"):
        testing.document_mask(torch.tensor([[0.2, 0.7, 1.5]]))
    with pytest.raises(TypeError, match="document_ids"):
        testing.document_mask([[0, 0, 1]])
    with pytest.raises(ValueError, match="document_ids"):
        testing.document_mask(torch.tensor([0, 0, 1]))
    mask = testing.document_mask(torch.tensor([[0, 0, 1]], dtype=torch.int32))
    assert mask.tolist() == [[[True, True, False], [True, True, False], [False, False, True]]]


@pytest.mark.parametrize("fn", [testing.causal_mask, testing.local_mask])
def test_masks_refuse_seqlens_that_are_not_ints_from_0(fn):
    """GD: a negative, float or bool seqlen raises naming the argument (torch's own errors named none)."""
    with pytest.raises(ValueError, match="seqlen_q"):
        fn(-1, 3)
    with pytest.raises(TypeError, match="seqlen_q"):
        fn(2.5, 3)
    with pytest.raises(TypeError, match="seqlen_k"):
        fn(3, True)
    assert fn(np.int64(2), 3).shape == (2, 3) and fn(0, 3).shape == (0, 3)


@pytest.mark.parametrize("ref", ["attention_ref", "attention_ref_grads", "attention_bwd_ref", "attention_varlen_ref",
                                 "attention_varlen_ref_grads"])
def test_references_refuse_an_upcast_that_is_not_a_bool(ref):
    """GD: upcast="no" upcast (any truthy value did); a bool or numpy.bool_ is taken."""
    q = torch.randn(1, 3, 1, 8, generator=torch.Generator().manual_seed(33), dtype=torch.float64)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    args = {"attention_ref": (q, q, q), "attention_varlen_ref": (q[0], q[0], q[0], cu, cu),
            "attention_varlen_ref_grads": (q[0], q[0], q[0], q[0], cu, cu)}.get(ref, (q, q, q, q))
    fn = getattr(testing, ref)
    with pytest.raises(TypeError, match="upcast"):
        fn(*args, upcast="no")
    fn(*args, upcast=np.bool_(False))
