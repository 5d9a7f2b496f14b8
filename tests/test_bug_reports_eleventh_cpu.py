"""The eleventh round of bug-report tests, CPU part (classes BV-BX of tests/bug_report_sources.md): inputs whose
handling is decided in the Python layer, run through the CPU stand-ins of tests/cpu_stand_ins.py (the float32
references as kernels; the stand-ins refuse cu_seqlens offsets outside the rows of the tensors they get, which the
kernels would read and write out of bounds).

- BV: a cu_seqlens buffer refilled by a writer that does not bump its version counter (torch.distributed's in-place
  collectives, a Triton or other custom kernel, a DLPack or numpy alias, ``.data``). attention_varlen reads the values
  once per tensor version and shapes the launch from them (q, k, v cut at the last sequence); the kernels must get
  the values that were read, never newer ones the launch was not shaped for.
- BW: scalars with no float32 value the kernels can take: an int or Fraction past float's range, a softcap whose
  product with log2(e) is subnormal; numpy arrays as bool flags. A ValueError or TypeError naming the argument before
  any op, as for NaN or a negative value."""

import fractions
import importlib.util

import numpy as np
import pytest
import torch

from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import attention_varlen_ref
from cpu_stand_ins import CALLS, stand_ins


@pytest.fixture
def cpu_ops(monkeypatch):
    with stand_ins(monkeypatch):
        yield


def _half(*shape):
    return torch.randn(*shape).half()


requires_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                           reason="transformers is not installed (CI installs it)")


# ------------------------------------------------------- BV: cu_seqlens written behind the version counter's back


def _write_behind_version_counter(cu, values):
    """Writes `values` into cu's memory as a collective or a custom kernel does: the version counter does not move."""
    version = cu._version
    cu.untyped_storage().copy_(torch.tensor(values, dtype=torch.int32).untyped_storage())
    assert cu.tolist() == values and cu._version == version


def test_cu_seqlens_refilled_without_a_version_bump_launches_the_values_read(cpu_ops):
    """The second call finds the first call's summary (same tensor, same version) while the memory now says [0, 8, 20].
    Before the fix the kernels got those offsets with q, k, v cut at row 12 (the summary's end): rows 12-19 indexed
    past the tensors (the stand-ins refuse it; on the GPU, LSE and dQ writes past their allocations). Now the launch
    uses the values it read, which is the documented limit of such writes: they are not seen."""
    torch.manual_seed(0)
    q, k, v = _half(20, 4, 64), _half(20, 2, 64), _half(20, 2, 64)
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    out_a, lse_a = attention_varlen(q, k, v, cu, cu, 12, 12, causal=True, return_lse=True)
    _write_behind_version_counter(cu, [0, 8, 20])
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out_b, lse_b = attention_varlen(qg, kg, vg, cu, cu, 12, 12, causal=True, return_lse=True)
    assert torch.equal(out_b, out_a) and torch.equal(lse_b, lse_a)
    (out_b.float().sum() + lse_b[torch.isfinite(lse_b)].sum()).backward()  # the backward gets the same values
    assert all(torch.isfinite(t.grad).all() for t in (qg, kg, vg))
    assert torch.equal(qg.grad[12:], torch.zeros_like(qg.grad[12:]))  # rows past the sequences it launched
    # the documented remedy (PyTorch's for writes it does not count), or a write through PyTorch: the new values are
    # read, checked and launched
    for bump in (torch.autograd.graph.increment_version, lambda t: t.copy_(torch.tensor([0, 8, 20], dtype=t.dtype))):
        bump(cu)
        out_c, lse_c = attention_varlen(q, k, v, cu, cu, 12, 12, causal=True, return_lse=True)
        ref_out, ref_lse = attention_varlen_ref(q, k, v, cu, cu, causal=True)
        torch.testing.assert_close(out_c.float(), ref_out, atol=2e-3, rtol=0)
        torch.testing.assert_close(lse_c, ref_lse)
    # and refused where they are not valid
    cu.copy_(torch.tensor([0, 4, 20], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^max_seqlen_q is 12 but cu_seqlens_q holds a sequence of length 16"):
        attention_varlen(q, k, v, cu, cu, 12, 12)


def test_cu_seqlens_checked_copy_reused_until_the_version_moves(cpu_ops):
    """The copy made when the values are read is reused while the tensor lives at that version; a write through
    PyTorch makes a new one (test_validation_cpu.py: an inference-mode tensor is read every call and launched as it
    is)."""
    from flash_attn_hopper import interface

    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    (summary, first) = interface._cu_seqlens_summary("cu", cu)
    assert summary == (0, 9, 5) and first is not cu and torch.equal(first, cu)
    assert interface._cu_seqlens_summary("cu", cu)[1] is first
    cu[1] = 4  # a version bump: read again, a new copy
    summary, second = interface._cu_seqlens_summary("cu", cu)
    assert summary == (0, 9, 5) and second is not first and second.tolist() == [0, 4, 9]


# --------------------------------------------------------------------- BW: scalars with no usable float32 value


def _qkv():
    return _half(1, 33, 2, 64), _half(1, 40, 2, 64), _half(1, 40, 2, 64)


@pytest.mark.parametrize("name, value", [
    ("softmax_scale", 10**400), ("softmax_scale", fractions.Fraction(10**400)), ("softcap", 10**400),
    ("softcap", fractions.Fraction(10**400, 3)), ("softcap", 1e-39), ("softcap", 8e-39),
], ids=["scale_int_10e400", "scale_fraction_10e400", "softcap_int_10e400", "softcap_fraction", "softcap_1e-39",
        "softcap_8e-39"])
def test_scalar_without_a_float32_value_named_before_the_op(cpu_ops, name, value):
    """An int past float's range made float() raise an OverflowError naming nothing; a softcap below 2^-126 / log2(e)
    passed the Python checks and reached the op, whose C++ check refused it with a RuntimeError (under torch.compile,
    when the graph runs)."""
    q, k, v = _qkv()
    cu = torch.tensor([0, 33], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"^{name}"):
        attention(q, k, v, **{name: value})
    with pytest.raises(ValueError, match=rf"^{name}"):
        attention_varlen(q[0], k[0, :33], v[0, :33], cu, cu, 33, 33, **{name: value})
    assert CALLS == []


def test_smallest_softcap_the_kernels_take_is_accepted(cpu_ops):
    """The bound is the op's own: softcap * log2(e) a normal float32 (with softmax_scale / softcap one too)."""
    q, k, v = _qkv()
    softcap = 1.2e-38 / 1.4426950408889634 * 1.0001
    out = attention(q, k, v, softmax_scale=1e-30, softcap=softcap)
    assert CALLS[-1][0] == "fwd" and torch.isfinite(out).all()


@pytest.mark.parametrize("flag", ["causal", "return_lse", "deterministic"])
@pytest.mark.parametrize("value", [np.array([True, False]), np.array([[True]]), np.array(True)],
                         ids=["two", "one_by_one", "zero_dim"])
def test_numpy_array_is_not_a_bool_flag(cpu_ops, flag, value):
    """numpy.bool_ scalars pass as bools; arrays do not: a one-element array was taken as its element, a longer one
    raised numpy's own ValueError naming nothing."""
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=rf"^{flag} must be a bool"):
        attention(q, k, v, **{flag: value})
    out = attention(q, k, v, **{flag: np.bool_(False)})
    assert out.shape == (1, 33, 2, 64)


# ------------------------------------------------- BX: tracers other than torch.compile and torch.jit.trace


def _varlen_case(seed=0):
    torch.manual_seed(seed)
    q, k, v = _half(40, 4, 64), _half(40, 2, 64), _half(40, 2, 64)
    cu1 = torch.tensor([0, 10, 25], dtype=torch.int32)  # rows 25-39 belong to no sequence
    cu2 = torch.tensor([0, 20, 40], dtype=torch.int32)
    return q, k, v, cu1, cu2


def _varlen(q, k, v, cu):
    return attention_varlen(q, k, v, cu, cu, 40, 40, causal=True, return_lse=True)


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_make_fx_graph_replays_new_cu_seqlens(cpu_ops, mode):
    """make_fx ran the eager path: a real-mode trace kept the host cut at the trace-time cu_seqlens_q[-1] (25) as a
    constant, so a replay with sequences up to row 40 handed the kernels offsets past the 25 rows they got (out of
    bounds on the GPU); fake and symbolic modes failed inside the host read with an error naming nothing. A traced
    call must read nothing on the host, like torch.compile: each replay equals the eager call on its own values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v, cu1, cu2 = _varlen_case()
    _varlen(q, k, v, cu1)  # an eager call first: its cached summary must not reach the trace
    graph = make_fx(_varlen, tracing_mode=mode)(q, k, v, cu1)
    for cu in (cu2, cu1):
        out, lse = graph(q, k, v, cu)
        want_out, want_lse = _varlen(q, k, v, cu.clone())
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_make_fx_graph_replays_new_document_ids(cpu_ops):
    """The same for attention's document bounds: a real-mode trace kept the bounds cached by an eager call on the same
    ids tensor, so a replay with other documents used the old ones (silently wrong)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(1)
    q = _half(1, 48, 2, 64)
    ids1 = torch.tensor([[0] * 20 + [1] * 28])
    ids2 = torch.tensor([[0] * 5 + [1] * 30 + [2] * 13])

    def call(q, ids):
        return attention(q, q, q, causal=True, document_ids=ids)

    call(q, ids1)
    graph = make_fx(call)(q, ids1)
    assert torch.equal(graph(q, ids2), call(q, ids2.clone()))


def test_aot_function_forward_and_backward_follow_new_cu_seqlens(cpu_ops):
    """functorch's aot_function traces with fake and functional tensors: the host read failed with
    DataDependentOutputException. Now forward and backward replay the values they are given."""
    from functorch.compile import aot_function, make_boxed_func

    q, k, v, cu1, cu2 = _varlen_case(2)
    compiled = aot_function(lambda q, k, v, cu: _varlen(q, k, v, cu)[0], fw_compiler=lambda g, _: make_boxed_func(g),
                            bw_compiler=lambda g, _: make_boxed_func(g))
    for cu in (cu1, cu2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        compiled(*leaves, cu).float().square().sum().backward()
        eager = [t.clone().requires_grad_() for t in (q, k, v)]
        _varlen(*eager, cu.clone())[0].float().square().sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, eager))


def test_functionalize_runs_attention_varlen(cpu_ops):
    """torch.func.functionalize hands functional tensors, whose storage the host read cannot touch ("tolist()
    shouldn't be called on a tensor with unallocated storage")."""
    q, k, v, cu1, _ = _varlen_case(3)
    out, lse = torch.func.functionalize(_varlen)(q, k, v, cu1)
    want_out, want_lse = _varlen(q, k, v, cu1)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


# ---------------------------------------------- CD: trusted cu_seqlens never index past the tensors


@pytest.mark.parametrize("values, bounded", [
    ([0, 10, 50], [0, 10, 40]),  # the last entry past q's 40 rows
    ([-5, 10, 40], [0, 10, 40]),  # a negative first entry (LSE writes before the tensor)
    ([0, 30, 20, 40], [0, 30, 30, 40]),  # decreasing: a negative length
], ids=["past_the_rows", "negative", "decreasing"])
@pytest.mark.parametrize("path", ["compile", "capture", "make_fx", "jit_trace"])
def test_trusted_cu_seqlens_stay_inside_the_tensors(cpu_ops, monkeypatch, values, bounded, path):
    """Under torch.compile, a CUDA graph capture or another tracer the values of cu_seqlens are not read on the host
    (documented: the caller's to get right), and the kernels took them as given: an offset past the rows or below 0
    made them read and write past q, out, LSE and dQ (https://github.com/JIA-Lab-research/LongLoRA/issues/199: a
    cu_seqlens built wrong for some lengths, then an illegal memory access; https://github.com/Dao-AILab/flash-attention/
    issues/1661: cu_seqlens that do not cover q). They now get each entry clamped to the rows and made
    non-decreasing, so bad values leave rows unwritten, never memory outside the tensors; valid values are unchanged
    (every other test). The stand-ins refuse offsets outside their tensors; forward and backward run."""
    from flash_attn_hopper import interface

    torch.manual_seed(4)
    q, k, v = (_half(40, 2, 64).requires_grad_() for _ in range(3))
    cu = torch.tensor(values, dtype=torch.int32)

    def call(q, k, v, cu):
        return attention_varlen(q, k, v, cu, cu, 40, 40, causal=True, return_lse=True)

    if path == "compile":
        run = torch.compile(call, backend="aot_eager", fullgraph=True)
    elif path == "capture":
        monkeypatch.setattr(interface, "_capturing", lambda device: True)
        run = call
    elif path == "make_fx":
        from torch.fx.experimental.proxy_tensor import make_fx

        run = make_fx(call)(q.detach(), k.detach(), v.detach(), torch.tensor([0, 20, 40], dtype=torch.int32))
        CALLS.clear()  # (the trace ran the op once)
    else:
        import warnings

        valid = torch.tensor([0, 20, 40], dtype=torch.int32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TracerWarnings of the shape checks
            run = torch.jit.trace(call, (q.detach(), k.detach(), v.detach(), valid), check_trace=False)
        CALLS.clear()
    out, lse = run(q, k, v, cu)
    assert [c[0] for c in CALLS] == ["fwd_varlen"]
    if path not in ("make_fx", "jit_trace"):  # (their graphs are not differentiable here)
        (out.float().sum() + lse[torch.isfinite(lse)].sum()).backward()
        assert [c[0] for c in CALLS] == ["fwd_varlen", "bwd_varlen"]
    monkeypatch.setattr(interface, "_capturing", lambda device: False)
    want_out, want_lse = attention_varlen(q.detach(), k.detach(), v.detach(), torch.tensor(bounded, dtype=torch.int32),
                                          torch.tensor(bounded, dtype=torch.int32), 40, 40, causal=True,
                                          return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@requires_transformers
@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
def test_transformers_padding_mask_refused_under_make_fx(tracing_mode):
    """The transformers integration reads a padding mask's lengths on the host (and keeps the unpadding per mask
    tensor): under make_fx a real-mode trace kept an earlier eager call's indices as constants (a replay with another
    mask silently used the old padding) and a fake-mode one failed in the host read naming nothing. Refused by name,
    as under torch.jit.trace (test_bug_reports_eighth_cpu.py)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from flash_attn_hopper.integrations import transformers as fah_transformers

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    fah_transformers._unpadding(mask, 5)  # an eager call first: its cached indices must not enter a graph
    with pytest.raises(RuntimeError, match="make_fx"):
        make_fx(lambda m: fah_transformers._unpadding(m, 5)[1], tracing_mode=tracing_mode)(mask)


# ------------------------------------------------- CE: values cached in inference_mode served to a training step


@pytest.mark.parametrize("entry", ["varlen", "documents"])
def test_cached_values_from_an_inference_mode_call_serve_a_training_step(cpu_ops, entry):
    """An evaluation under torch.inference_mode() (Lightning's sanity check runs one before the first training step)
    cached what it computed from a normal cu_seqlens or document_ids tensor as inference tensors; the next training
    call with the same tensor handed them to the op, whose autograd node cannot save them ("Inference tensors cannot
    be saved for backward"; https://github.com/state-spaces/s4/issues/169 from CUDA kernels under Lightning,
    https://github.com/snowflakedb/ArcticTraining/pull/265 when mixing train and eval). The cached copy and bounds
    are normal tensors now; the training step runs forward and backward and equals one with a fresh tensor."""
    torch.manual_seed(5)
    if entry == "varlen":
        q, k, v = _half(30, 2, 64), _half(30, 2, 64), _half(30, 2, 64)
        ids = torch.tensor([0, 12, 30], dtype=torch.int32)

        def call(q, k, v, ids):
            return attention_varlen(q, k, v, ids, ids, 18, 18, causal=True)
    else:
        q, k, v = _half(1, 30, 2, 64), _half(1, 30, 2, 64), _half(1, 30, 2, 64)
        ids = torch.tensor([[0] * 12 + [1] * 18])

        def call(q, k, v, ids):
            return attention(q, k, v, causal=True, document_ids=ids)

    with torch.inference_mode():
        call(q, k, v, ids)
    grads = []
    for tensor in (ids, ids.clone()):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        call(*leaves, tensor).float().square().sum().backward()
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
