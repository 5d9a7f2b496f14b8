"""Thirty-ninth round of the bug hunt (tests/bug_report_sources.md, "Thirty-ninth round"), CPU part: the premises of
tests/test_bug_reports_thirtyninth_gpu.py, without a GPU or the extension.

- GW: the child script compiles; every profiler configuration is known; the event check refuses a profile that does
  not name the ops or lacks q's shape, and takes one that does.
- GX: the large-score inputs are one-hot with scores exact in float32 and past the exact pass's bound; the float32
  reference passes the one-hot check and a simulation of the main kernel without the exact pass (P = 2^r at the row
  maximum, r the rounding of the scaled maximum) fails it on most rows; the replay logic passes a right stand-in and
  refuses a graph that keeps serving its first replay's results.
- GY / GZ: the workloads build; the scaled step's factors (2 on q, 0.5 on v) are undone exactly by the check, and a
  gradient without them fails; the torch.compile features the tests use exist in this torch."""

import types

import pytest
import torch

import test_bug_reports_thirtyninth_gpu as gpu_file
from flash_attn_hopper.testing import attention_ref, attention_ref_grads, attention_varlen_ref

LOG2E = 1.4426950408889634
EXACT_PASS_BOUND_LOG2 = 2.0**16  # docs/conventions.md: rows whose |M| (log2 units) reaches 2^16 are recomputed


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(gpu_file, "DEVICE", "cpu")
    torch.manual_seed(39)


def test_child_script_and_configs():
    compile(gpu_file.CHILD_SCRIPT, "child", "exec")
    assert "gw_child" in gpu_file.CHILD_SCRIPT
    for config in gpu_file.GW_CONFIGS:
        if config not in ("emit-nvtx", "scheduled"):
            kwargs = gpu_file.gw_profiler_kwargs(config)
            assert kwargs["activities"] and kwargs.get("record_shapes") is True
    with pytest.raises(ValueError):
        gpu_file.gw_profiler_kwargs("nothing")


def test_problems_build(on_cpu):
    ps = gpu_file.problems()
    assert [p.name for p in ps] == ["dense-gqa", "documents", "varlen"]
    for p in ps:
        assert p.opts.get("deterministic") is True, "bitwise comparisons need the deterministic backward"
        assert p.dout.shape == (*p.q.shape[:-1], p.v.shape[-1])
        assert p.dlse.dtype == torch.float32
        assert set(gpu_file.GW_OPS[p.name]) <= {"fwd", "bwd", "fwd_varlen", "bwd_varlen"}
    assert ps[0].dlse.shape == (2, 8, 203) and ps[2].dlse.shape == (4, sum((1, 300, 0, 77)))


def _event(name, shapes=(), device_type=torch.autograd.DeviceType.CPU):
    return types.SimpleNamespace(name=name, input_shapes=list(shapes), device_type=device_type)


def test_event_check(on_cpu):
    ps = gpu_file.problems()
    cuda = torch.autograd.DeviceType.CUDA
    events = [_event("flash_attn_hopper::fwd", [list(ps[0].q.shape)]), _event("flash_attn_hopper::bwd"),
              _event("flash_attn_hopper::fwd", [list(ps[1].q.shape)]),
              _event("flash_attn_hopper::fwd_varlen", [list(ps[2].q.shape)]), _event("flash_attn_hopper::bwd_varlen"),
              _event("void flash::kernel", device_type=cuda)]
    gpu_file.check_events(events, ps, True, True, "ok")
    with pytest.raises(AssertionError, match="no profiler event flash_attn_hopper::bwd_varlen"):
        gpu_file.check_events(events[:4] + events[5:], ps, True, True, "missing")
    with pytest.raises(AssertionError, match="recorded without q's shape"):
        gpu_file.check_events([_event("flash_attn_hopper::fwd", [[1, 2]])] + events[1:], ps, True, True, "shape")
    with pytest.raises(AssertionError, match="no GPU kernel event"):
        gpu_file.check_events(events[:-1], ps, True, True, "kernels")
    # a real CPU profile of other ops names none of them
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.mm(torch.randn(4, 4), torch.randn(4, 4))
    assert any(e.name == "aten::mm" and e.input_shapes[0] == [4, 4] for e in prof.events())
    with pytest.raises(AssertionError, match="no profiler event"):
        gpu_file.check_events(prof.events(), ps, True, False, "cpu profile")


def _dense_large(dtype, seed=0):
    d = gpu_file.GX_DENSE
    return gpu_file.large_dense(d["batch"], d["seqlen_q"], d["seqlen_k"], d["nheads"], d["head_dim"], dtype,
                                torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_inputs_are_one_hot_exact_and_past_the_bound(on_cpu, dtype):
    q, k, v = _dense_large(dtype)
    s64 = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())
    s32 = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float())
    assert torch.equal(s32.double(), s64), "scores exact in float32"
    top2 = s64.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1] >= 2.0**20).all()
    assert (top2[..., 0].abs() * LOG2E >= 2.0**29).all(), "every row far past the exact pass's bound"
    assert (top2[..., 0].abs() * LOG2E >= EXACT_PASS_BOUND_LOG2).all()
    out, lse = attention_ref(q, k, v, softmax_scale=1.0, upcast=True)
    gpu_file.check_one_hot(out.to(dtype), lse, q, k, v, "float32 reference")


def _main_kernel_only(q, k, v):
    """The forward without its exact pass, per docs/conventions.md: M = round_f32(max_s x c), c = round_f32(log2 e)
    (softmax_scale 1), P at the maximum = exp2(max_s x c - M) = 2^r (other keys ~0), O = round(P) V / P."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())
    top = s.max(-1)
    c = float(torch.tensor(LOG2E, dtype=torch.float32))
    prod = top.values * c  # exact in float64 (24-bit by 24-bit significands)
    r = prod - prod.float().double()
    p = torch.exp2(r.float())  # float32, may be inf or 0
    vv = v.permute(0, 2, 1, 3).float()
    vtop = vv.gather(2, top.indices[..., None].expand(-1, -1, -1, vv.shape[-1]))
    o = (p[..., None].to(q.dtype).float() * vtop) / p[..., None]
    lse = top.values.float()  # (as if the LSE were right: the check must catch out alone)
    return o.to(q.dtype).permute(0, 2, 1, 3), lse, o


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_without_the_exact_pass_most_rows_are_wrong(on_cpu, dtype):
    q, k, v = _dense_large(dtype)
    out, lse, _ = _main_kernel_only(q, k, v)
    expected, _ = attention_ref(q, k, v, softmax_scale=1.0, upcast=True)
    expected = expected.to(dtype)
    same_rows = (gpu_file.gpu_helpers.bits(out) == gpu_file.gpu_helpers.bits(expected)).all(-1)
    assert same_rows.float().mean() < 0.5, f"only {1 - same_rows.float().mean():.2f} of rows detectably wrong"
    with pytest.raises(AssertionError):
        gpu_file.check_one_hot(out, lse, q, k, v, "main kernel only")


def test_one_hot_check_refuses_one_ulp_and_nan(on_cpu):
    q, k, v = _dense_large(torch.float16)
    out, lse = attention_ref(q, k, v, softmax_scale=1.0, upcast=True)
    out = out.to(torch.float16).contiguous()
    off = out.clone()
    off.view(torch.int16)[1, 7, 1, 3] += 1
    with pytest.raises(AssertionError, match="elements differ"):
        gpu_file.check_one_hot(off, lse, q, k, v, "one ulp")
    with pytest.raises(AssertionError, match="LSE is not the top score"):
        gpu_file.check_one_hot(out, lse.clone().fill_(float("nan")), q, k, v, "NaN LSE")


def _stand_in(kind):
    """A float32-reference forward standing in for the library (softmax_scale 1), rounded to the inputs' dtype."""
    if kind == "varlen":
        cu = (gpu_file.cu_seqlens(gpu_file.GX_VARLEN_Q, "cpu"), gpu_file.cu_seqlens(gpu_file.GX_VARLEN_K, "cpu"))

        def fn(q, k, v):
            out, lse = attention_varlen_ref(q, k, v, *cu, softmax_scale=1.0, upcast=True)
            return out.to(q.dtype), lse
        return fn

    def fn(q, k, v):
        out, lse = attention_ref(q, k, v, softmax_scale=1.0, upcast=True)
        return out.to(q.dtype), lse
    return fn


@pytest.mark.parametrize("case", list(gpu_file.GX_CASES))
def test_gx_replays_logic(on_cpu, case):
    kind, dtype = gpu_file.GX_CASES[case]
    fn = _stand_in(kind)
    gpu_file.gx_replays(kind, dtype, fn, fn, torch.Generator().manual_seed(1))
    first = {}

    def stale(q, k, v):  # a graph that keeps its first replay's results
        if not first:
            first["r"] = fn(q, k, v)
        return first["r"]

    with pytest.raises(AssertionError):
        gpu_file.gx_replays(kind, dtype, stale, fn, torch.Generator().manual_seed(1))


def test_scaled_check_undoes_the_factors(on_cpu):
    p = gpu_file.problems()[0]
    opts = {key: val for key, val in p.opts.items() if key != "deterministic"}
    q2, v2 = p.q * 2, p.v * 0.5
    out, lse = attention_ref(q2, p.k, v2, upcast=True, **opts)
    dq2, dk, dv2 = attention_ref_grads(q2, p.k, v2, p.dout, upcast=True, dlse=p.dlse, **opts)
    dt = p.q.dtype
    results = (out.to(dt), lse, (dq2 * 2).to(dt), dk.to(dt), (dv2 * 0.5).to(dt))
    gpu_file.check_scaled(p, results)
    with pytest.raises(AssertionError):
        gpu_file.check_scaled(p, (results[0], results[1], dq2.to(dt), results[3], results[4]))


def test_compile_features_exist():
    import torch._functorch.config as functorch_config
    from torch._dynamo import list_backends

    assert hasattr(torch.compiler, "nested_compile_region")
    assert hasattr(functorch_config, "activation_memory_budget")
    with functorch_config.patch(activation_memory_budget=0.0):
        assert functorch_config.activation_memory_budget == 0.0
    backends = set(list_backends(exclude_tags=()))
    for backend in (*gpu_file.GY_BACKENDS, *gpu_file.GZ_BACKENDS):
        assert backend in backends, backend


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("problem", ["dense-gqa", "documents", "varlen"])
def test_nested_compile_region_through_stand_ins(on_cpu, monkeypatch, problem, dynamic):
    """GZ's chain through the CPU stand-ins of the kernels (aot_eager, fullgraph): its results equal eager's bit for
    bit. The varlen chain failed on the H100 in session 73 and here before the fix: the max_seqlen checks' torch._check
    left their message functions in the graph, which nested_compile_region's graph comparison refuses
    (InternalTorchDynamoError: get_attr with <class 'function'>). With dynamic=True every chain stopped at dynamo's
    "lift_tracked_freevar_to_input should not be called on root SubgraphTracer": the keyword default softcap=0.0 was
    read as a symbolic float (the default is now the int 0). Under torch 2.14.1 (CI) the dynamic varlen chain then
    stopped at dynamo's KeyError "-s52" reusing the region: the tile count's ceiling -(-rows // 128) (now without
    negation)."""
    from cpu_stand_ins import stand_ins

    with stand_ins(monkeypatch):
        p = next(x for x in gpu_file.problems() if x.name == problem)
        region_fn, eager_fn = gpu_file.chained_region(p)
        base, base_lse2 = gpu_file.run_chain(p, eager_fn)
        torch._dynamo.reset()
        compiled = torch.compile(region_fn, backend="aot_eager", fullgraph=True, dynamic=dynamic)
        results, lse2 = gpu_file.run_chain(p, compiled)
        for name, a, b in zip(("out2", "lse1", "dq", "dk", "dv", "lse2"), (*base, base_lse2), (*results, lse2)):
            assert torch.equal(a, b), name


def test_traced_check_keeps_no_function_for_a_decided_condition():
    """interface._traced_check: a decided condition is evaluated on the host (False: the ValueError with the message),
    never handed to torch._check."""
    import torch.fx.experimental.symbolic_shapes  # noqa: F401 (loaded by torch.compile, where the check runs)

    from flash_attn_hopper import interface

    interface._traced_check(True, lambda: "unused")
    with pytest.raises(ValueError, match="max_seqlen"):
        interface._traced_check(False, lambda: "max_seqlen_q must be in [0, 2^31)")
