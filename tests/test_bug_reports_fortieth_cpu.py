"""Fortieth round of the bug hunt (tests/bug_report_sources.md, "Fortieth round"), CPU part: the premises of
tests/test_bug_reports_fortieth_gpu.py and what of HA / HB runs without a GPU or the extension.

- HA: the child script compiles; the workloads build with matching shapes; the bitwise comparison refuses a one-ulp
  change; cu_seqlens and document_ids on another device than q are refused by name (ValueError) in the checks that run
  before the extension is needed.
- HB: interface's option checks (softmax_scale, softcap, window, max_seqlen) traced by torch.compile (fullgraph;
  backends eager and aot_eager; automatic and dynamic=True) give, at every call of a changing schedule, the values of
  that call, not an earlier one's; consecutive schedule entries change the float32 reference's out; the premise check
  refuses a result list that kept an earlier entry's values.
- HC: FSDP2's free-and-restore keeps autograd's version check passing and the values, and moves the storage where a
  NaN blocker holds the freed block (as CUDA's caching allocator does; the CPU allocator may not); the float32
  reference, shaped like the op (saving q, k, v themselves), differentiated through the reshard gives the plain run's
  gradients bit for bit, and one whose inputs came back as the NaN blocker does not."""

import math

import pytest
import torch

import test_bug_reports_fortieth_gpu as gpu_file
from flash_attn_hopper import interface
from flash_attn_hopper.testing import attention_ref, attention_varlen_ref


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(gpu_file, "DEVICE", "cpu")
    torch.manual_seed(40)


# ------------------------------------------------------------------ HA

def test_ha_child_script_and_workloads_build():
    compile(gpu_file.HA_CHILD_SCRIPT, "child", "exec")
    assert "ha_child" in gpu_file.HA_CHILD_SCRIPT
    work = gpu_file.ha_workloads("cpu")
    assert [w.name for w in work] == ["dense-gqa", "window-softcap", "hd256", "varlen", "documents"]
    for w in work:
        assert w.opts.get("deterministic") is True, "bitwise comparisons need the deterministic backward"
        assert w.q.dtype == w.k.dtype == w.v.dtype == w.dtype and w.q.shape[-1] == w.head_dim
        (q, k, v, dout, dlse), opts, extra = w.to("cpu")
        assert dout.shape == (*q.shape[:-1], v.shape[-1]) and dlse.dtype == torch.float32
        if extra is None:
            assert dlse.shape == (q.shape[0], q.shape[2], q.shape[1])
        else:
            cu_q, cu_k, max_q, max_k = extra
            assert int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0] and cu_q.dtype == torch.int32
            assert max_q == max(w.varlen[0]) and max_k == max(w.varlen[1]) and dlse.shape == (q.shape[1], q.shape[0])
        if "document_ids" in opts:
            assert opts["document_ids"].shape == q.shape[:2]
    # the same values every time (both devices must get the same inputs)
    again = gpu_file.ha_workloads("cpu")
    assert all(torch.equal(a.q, b.q) and torch.equal(a.dout, b.dout) for a, b in zip(work, again))


def test_ha_comparison_refuses_one_ulp():
    a = tuple(torch.randn(3, 5).to(torch.bfloat16) for _ in range(5))
    gpu_file.ha_compare("same", a, tuple(t.clone() for t in a), "control")
    b = list(t.clone() for t in a)
    b[3] = b[3].clone()
    b[3][1, 2] = torch.nextafter(b[3][1, 2].float(), torch.tensor(math.inf)).to(torch.bfloat16)
    if torch.equal(b[3], a[3]):  # (the float32 step may round back: step the bf16 bits instead)
        b[3].view(torch.int16)[1, 2] += 1
    with pytest.raises(AssertionError, match="dk: 1 elements differ"):
        gpu_file.ha_compare("one ulp", a, tuple(b), "control")


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
def test_ha_cu_seqlens_on_another_device_refused_by_name(which):
    q = torch.randn(77, 2, 64).to(torch.bfloat16)
    cu = torch.tensor([0, 77], dtype=torch.int32)
    other = cu.to("meta")
    cu_q, cu_k = (other, cu) if which == "cu_seqlens_q" else (cu, other)
    with pytest.raises(ValueError, match=f"{which} is on meta but q is on cpu"):
        interface.attention_varlen(q, q, q, cu_q, cu_k, 77, 77)


def test_ha_document_ids_on_another_device_refused_by_name():
    q = torch.randn(1, 77, 2, 64).to(torch.bfloat16)
    ids = torch.zeros(1, 77, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="document_ids is on meta but q is on cpu"):
        interface.attention(q, q, q, document_ids=ids)


# ------------------------------------------------------------------ HB

def _checked_options(x, scale, cap, left, max_q):
    """The option checks of attention / attention_varlen, their results used in tensor arithmetic."""
    s = interface._check_scale(scale, x.shape[-1])
    c = interface._check_softcap(cap, s)
    lo, hi = interface._check_window((left, 0), False)
    m = interface._check_max_seqlen("max_seqlen_q", max_q)
    return x * s + c + lo * 1000 + hi * 10 + m * 1e-3


HB_MAX_Q = [130, 77, 130, 300, 130, 77, 77, 1, 2]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("dynamic", [None, True], ids=["auto", "dynamic"])
def test_hb_option_checks_under_compile_follow_each_call(backend, dynamic):
    torch._dynamo.reset()
    x = torch.randn(3, 64)
    compiled = torch.compile(_checked_options, backend=backend, dynamic=dynamic, fullgraph=True)
    try:
        with torch._dynamo.config.patch(recompile_limit=64):
            for i, ((scale, cap, left), max_q) in enumerate(zip(gpu_file.HB_SCHEDULE, HB_MAX_Q)):
                want = _checked_options(x, scale, cap, left, max_q)
                got = compiled(x, scale, cap, left, max_q)
                assert torch.equal(got, want), f"call {i} {(scale, cap, left, max_q)}: an earlier call's values?"
    finally:
        torch._dynamo.reset()


def test_hb_schedule_changes_the_reference_and_the_check_refuses_a_stale_list(on_cpu):
    for kind in ("dense", "varlen"):
        q, k, v, dout, dlse, extra = gpu_file.hb_problem(kind)
        outs = []
        for scale, cap, left in gpu_file.HB_SCHEDULE:
            opts = dict(softmax_scale=scale, softcap=cap, window_size=(left, 0))
            if extra is None:
                out, _ = attention_ref(q, k, v, **opts)
            else:
                out, _ = attention_varlen_ref(q, k, v, extra[0], extra[1], **opts)
            outs.append((out.to(q.dtype),))
        gpu_file.hb_check_changes(outs, gpu_file.HB_SCHEDULE, kind)
        stale = outs[:3] + [outs[2]] + outs[4:]  # call 3 served call 2's values
        with pytest.raises(AssertionError, match="entries 2 and 3"):
            gpu_file.hb_check_changes(stale, gpu_file.HB_SCHEDULE, kind)
    assert len(set(gpu_file.HB_SCHEDULE)) < len(gpu_file.HB_SCHEDULE), "the schedule comes back to earlier values"
    for values in gpu_file.HB_SCHEDULE:
        scale, cap, _ = values
        assert interface._check_scale(scale, 64) == scale and interface._check_softcap(cap, scale) == cap


# ------------------------------------------------------------------ HC

def _reference(q, k, v, extra):
    if extra is None:
        return attention_ref(q.float(), k.float(), v.float(), causal=True)
    return attention_varlen_ref(q.float(), k.float(), v.float(), extra[0], extra[1], causal=True)


class _ReferenceOp(torch.autograd.Function):
    """The float32 reference in the op's place, shaped like it: the forward saves q, k, v themselves (no copies) and
    the backward recomputes from them, so what it reads is what the saved tensors hold at backward time."""

    @staticmethod
    def forward(ctx, q, k, v, extra):
        ctx.save_for_backward(q, k, v)
        ctx.extra = extra
        out, lse = _reference(q, k, v, extra)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
            out, lse = _reference(*leaves, ctx.extra)
            grads = torch.autograd.grad([out, lse], leaves, [dout.float(), dlse])
        return (*(g.to(q.dtype) for g in grads), None)


def _reference_forward(leaves, extra):
    return _ReferenceOp.apply(*leaves, extra)


@pytest.mark.parametrize("case", ["flat-views", "parameters", "varlen"])
def test_hc_reshard_moves_storage_keeps_version_and_the_reference_agrees(on_cpu, monkeypatch, case):
    monkeypatch.setattr(gpu_file, "hc_forward", _reference_forward)
    torch.manual_seed(400)
    leaves, values, owners, _, _, _ = gpu_file.hc_inputs(case, device="cpu")
    assert all(t.requires_grad and t.is_leaf for t in leaves)
    if case == "flat-views":
        assert len(owners) == 1 and all(t.untyped_storage().data_ptr() == owners[0].data_ptr() for t in leaves)
        assert all(t.data_ptr() % 16 == 0 for t in leaves), "16-byte aligned views (read in place, not copied)"
    versions = [t._version for t in leaves]
    moved = [gpu_file.hc_reshard(o) for o in owners]
    for old, new, apart, blockers in moved:
        assert blockers and all(torch.isnan(b).all() for b in blockers)
        assert apart == (new >= old + o_bytes(owners) or new + o_bytes(owners) <= old)
    assert [t._version for t in leaves] == versions, "no version bump: autograd's check passes"
    assert all(torch.equal(t.detach(), v) for t, v in zip(leaves, values)), "the same values restored"
    del moved
    torch.manual_seed(401)
    plain = gpu_file.hc_run(case, reshard=False, device="cpu")
    torch.manual_seed(401)
    resharded = gpu_file.hc_run(case, reshard=True, device="cpu")
    for a, b in zip(plain[0], resharded[0]):
        assert torch.equal(a, b)
    assert len(resharded[5]) == len(owners)


def o_bytes(owners):
    return owners[0].untyped_storage().nbytes()


def test_hc_reshard_leaves_nan_in_the_freed_range_whatever_covers_it(on_cpu):
    """The values are set to NaN before the free: a backward reading the freed range gets NaN even where no blocker
    took the block (the allocator merged it with a free neighbour), unless another allocation wrote there."""
    flat = torch.randn(4096)
    seen = []
    real_resize = torch.UntypedStorage.resize_

    def spy(storage, n):
        if n == 0:
            seen.append(flat.detach().clone())
        return real_resize(storage, n)

    import unittest.mock

    with unittest.mock.patch.object(torch.UntypedStorage, "resize_", spy):
        gpu_file.hc_reshard(flat)
    assert seen and all(torch.isnan(t).all() for t in seen), "NaN in the storage at every free"
    assert not torch.isnan(flat).any(), "the values restored after"


def test_hc_check_refuses_inputs_read_from_the_freed_block(on_cpu, monkeypatch):
    """A backward that read the freed block gets the blocker's NaN: the bitwise comparison fails."""
    monkeypatch.setattr(gpu_file, "hc_forward", _reference_forward)

    def stale_reshard(flat, poison=True):
        old = flat.data_ptr()
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(flat):
            flat.fill_(float("nan"))  # what the freed block holds once the blocker took it
        return old, old + 1, True, []

    torch.manual_seed(402)
    plain = gpu_file.hc_run("flat-views", reshard=False, device="cpu")
    monkeypatch.setattr(gpu_file, "hc_reshard", stale_reshard)
    torch.manual_seed(402)
    stale = gpu_file.hc_run("flat-views", reshard=True, device="cpu")
    with pytest.raises(AssertionError, match="elements differ"):
        for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), plain[0], stale[0]):
            gpu_file.assert_same_bits(b, a, what)
