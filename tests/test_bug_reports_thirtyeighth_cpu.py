"""Thirty-eighth round of the bug hunt (tests/bug_report_sources.md, "Thirty-eighth round"), CPU part: the premises of
tests/test_bug_reports_thirtyeighth_gpu.py, without a GPU or the extension.

- GT / GV: the child script compiles and names the module's child functions; every workload builds (shapes, dtypes,
  the knobs it sets are csrc's); the exact-pass workload's scaled scores are past the exact pass's bound; the
  bitwise comparison refuses a one-ulp change.
- GU: the poisoned element sits where the masks say (the row sees the keys listed, bottom-right causal / window);
  the float32 reference of the poisoned gradients is non-finite on every reached row (so the requirement is the
  math's, not the kernels'), and the clean reference finite; a backward that sanitises (nan_to_num, or a clamp to
  fp16's range) fails the check; the overflow construction puts the sink's dV past 2 x 65504 and nothing within
  rounding of the range."""

import pytest
import torch

import test_bug_reports_thirtyeighth_gpu as gpu_file
from flash_attn_hopper.testing import attention_ref_grads, attention_varlen_ref_grads


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(gpu_file, "DEVICE", "cpu")
    torch.manual_seed(38)


def test_child_script_and_functions():
    compile(gpu_file.CHILD_SCRIPT, "child", "exec")
    assert "green_support()" in gpu_file.CHILD_SCRIPT and "SKIP: " in gpu_file.CHILD_SCRIPT
    for args in gpu_file.GT_CASES.values():
        assert args[0] in ("set_context", "stream") and args[1] in ("primary-first", "green-first")
        assert all(int(s) % 8 == 0 for s in args[2].split("+")), "SM counts in steps of 8 (Hopper's granularity)"
    assert callable(gpu_file.gt_child) and callable(gpu_file.gv_child)
    assert set(gpu_file.GV_BUILT) == set(gpu_file.GV_GROUPS)


def test_gt_workloads_build(on_cpu):
    workloads = gpu_file._fix_documents_dlse(gpu_file.gt_workloads())
    assert [w.name for w in workloads] == ["dense-gqa-causal", "window-softcap-64", "varlen-96", "documents",
                                           "exact-pass"]
    for w in workloads:
        if w.backward:
            assert w.opts.get("deterministic") is True, "bitwise comparisons need the deterministic backward"
            assert w.dlse is not None and w.dout.shape[:-1] == w.q.shape[:-1]
    exact = workloads[-1]
    scores = torch.einsum("bqhd,bkhd->bhqk", exact.q.float(), exact.k.float()) * exact.q.shape[-1] ** -0.5
    assert scores.max(-1).values.min() >= gpu_file.EXACT_PASS_LSE, "every row's maximum past the exact pass's bound"
    assert exact.q.abs().max() < 65504, "inputs inside fp16's range"


def test_exact_pass_check_takes_the_top_key_and_refuses_one_ulp(on_cpu):
    """The exact-pass workload's check (P one-hot by construction): the top key's V row and score pass, bit for bit;
    one ulp off in one element of out, or an LSE off by 4, fails."""
    exact = gpu_file.gt_workloads()[-1]
    scores = torch.einsum("bqhd,bkhd->bhqk", exact.q.double(), exact.k.double()) * exact.q.shape[-1] ** -0.5
    best = scores.max(-1)
    v = exact.v.permute(0, 2, 1, 3)
    out = v.gather(2, best.indices[..., None].expand(-1, -1, -1, v.shape[-1])).permute(0, 2, 1, 3).contiguous()
    lse = best.values.float()
    exact.check((out, lse))
    off = out.clone()
    off.view(torch.int16)[0, 3, 1, 7] += 1
    with pytest.raises(AssertionError, match="elements differ"):
        exact.check((off, lse))
    with pytest.raises(AssertionError, match="LSE differs"):
        exact.check((out, lse + 4.0))


@pytest.mark.parametrize("group", gpu_file.GV_GROUPS)
def test_gv_workloads_build(on_cpu, group):
    for w in gpu_file.gv_workloads(group):
        assert w.opts.get("deterministic") is True
        assert set(w.env) <= {"FAH_BWD_GQA_GROUP_CTA", "FAH_BWD_DQ_LANES"}
    if group == "bwd-det-dense":
        w = gpu_file.gv_workloads(group)[0]
        assert (w.k.shape[1] // 128) * w.q.shape[2] * w.q.shape[0] == 256, "256 backward CTAs of 128 keys"


def test_bitwise_comparison_refuses_one_ulp():
    a = torch.randn(3, 4, dtype=torch.float16)
    b = a.clone()
    b.view(torch.int16)[1, 2] += 1
    gpu_file.compare_bits("x", (a,), (a.clone(),), "here")
    with pytest.raises(AssertionError, match="elements differ"):
        gpu_file.compare_bits("x", (a,), (b,), "here")


def _poisoned_reference(p):
    opts = {key: val for key, val in p.opts.items() if key != "deterministic"}
    if p.varlen is None:
        return attention_ref_grads(p.q, p.k, p.v, p.bad_dout, dlse=p.bad_dlse, **opts)
    return attention_varlen_ref_grads(p.q, p.k, p.v, p.bad_dout, *p.varlen[:2], dlse=p.bad_dlse, **opts)


@pytest.mark.parametrize("case", list(gpu_file.GU_CASES))
def test_gu_reach_is_the_math(on_cpu, case):
    workload, kind, dtype_name = gpu_file.GU_CASES[case]
    p = gpu_file.GuProblem(workload, kind, gpu_file.DTYPES[dtype_name])
    reach, skip = p.masks()
    assert len(reach["dk"]) == (289 if workload == "dense" else 81)
    poisoned = _poisoned_reference(p)
    for gname, g in zip(gpu_file.GRAD_NAMES, poisoned):
        for idx in reach[gname]:
            assert not torch.isfinite(g[idx]).all(), f"{gname} {idx}: the math leaves it finite"
        assert torch.isfinite(g[~skip[gname]]).all(), f"{gname}: the poison reaches an element that is compared"
    ref, naive = p.references()
    assert all(torch.isfinite(r).all() and torch.isfinite(n).all() for r, n in zip(ref, naive))
    # the float32 reference, poisoned and rounded, passes; a sanitising backward (nan_to_num) fails
    rounded = [g.to(p.dtype) for g in poisoned]
    gpu_file.check_reach_and_rest(case, rounded, reach, skip, ref, naive)
    with pytest.raises(AssertionError, match="would miss it"):
        gpu_file.check_reach_and_rest(case, [g.nan_to_num(posinf=65504.0, neginf=-65504.0) for g in rounded],
                                      reach, skip, ref, naive)


@pytest.mark.parametrize("case", list(gpu_file.GU_OVERFLOW_CASES))
def test_gu_overflow_construction(on_cpu, case):
    nheads, nheads_k, _, _ = gpu_file.GU_OVERFLOW_CASES[case]
    q, k, v, dout = gpu_file.gu_overflow_problem(nheads, nheads_k)
    assert torch.isfinite(dout).all() and dout.abs().max() <= gpu_file.GU_DOUT
    ref = attention_ref_grads(q, k, v, dout, upcast=True)
    total = 0
    for gname, r in zip(gpu_file.GRAD_NAMES, ref):
        over, ambiguous = gpu_file.gu_overflow_split(r)
        assert not ambiguous.any(), f"{gname}: values within rounding of fp16's range"
        total += int(over.sum())
        if gname == "dv":
            assert over[:, gpu_file.GU_SINK, :, 0].all(), "the sink's dV column 0 past 2 x 65504"
        else:
            assert not over.any(), f"{gname} overflows too"
    assert total == 2 * nheads_k
    # a saturating conversion (65504 instead of inf) is what the GPU test refuses
    assert torch.equal(ref[2][over].to(torch.float16).float().abs(), torch.full_like(ref[2][over], float("inf")))
