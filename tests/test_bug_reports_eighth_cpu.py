"""The CPU part of the eighth round of bug-report tests (class BJ of tests/bug_report_sources.md; the GPU test is
tests/test_bug_reports_eighth_gpu.py::test_jit_trace_replays_with_new_lengths_and_documents): torch.jit.trace records
the ops a function runs and turns every Python value it computed on the way into a constant of the trace. Reports:
https://github.com/Dao-AILab/flash-attention/issues/701 (max_seqlen converted to a Python scalar: "an incorrect trace in
torch.jit.trace"), https://github.com/facebookresearch/xformers/issues/406 (torch.jit.trace broke on an attention
op's "unsupported output type: int"), https://github.com/pytorch/pytorch/issues/115262 (SDPA effectively untraceable
with is_causal decided from a shape).

What this library did under torch.jit.trace before the fix (all three found here, on the CPU):

- the first call of the process inside a trace raised ``RuntimeError: unsupported output type: str, from operator:
  flash_attn_hopper::build_config`` (the build query, an op returning a str, was recorded; later calls hit its cache);
- attention_varlen cut q, k, v at the trace-time ``cu_seqlens[-1]`` (a host read) and padded the rest back: the trace
  kept both as constants, so a replay whose sequences reach further handed the kernels fewer rows than cu_seqlens
  name (on a GPU: reads and writes past the tensors);
- attention with document_ids served the bounds cached by an earlier call on the same tensor: the trace kept them
  as a constant, and replays with other ids silently used the old documents (as did the transformers integration's
  document ids from position_ids).

No GPU is needed: the device checks are replaced by no-ops and the ops get CPU kernels for the test (the float32
references of flash_attn_hopper.testing, rounded to the input dtype), so what is checked is what the Python layer hands
the op under the trace. Each replay must equal the stand-in run directly on the replay's inputs, bit for bit."""

import importlib.util
import re

import pytest
import torch

from flash_attn_hopper import _ops, attention, attention_varlen, interface
from cpu_stand_ins import fwd_stand_in, fwd_varlen_stand_in, stand_ins

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore:.*torch.jit.trace.*deprecated")
requires_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install transformers): integration not tested",
)


@pytest.fixture
def cpu_ops(monkeypatch):
    """The ops run on the CPU (tests/cpu_stand_ins.py); device checks pass; no call is in the checked-call cache; the
    build query has run (its cache is full, as after any earlier call: test_first_call_of_the_process_inside_a_jit_trace
    empties it)."""
    with stand_ins(monkeypatch, "its op schemas"):
        yield


def _ops_in(traced):
    return re.findall(r"flash_attn_hopper::\w+", str(traced.inlined_graph))


def _dense(batch, seqlen, nheads, nheads_k, head_dim=64):
    return (torch.randn(batch, seqlen, nheads, head_dim).half(), torch.randn(batch, seqlen, nheads_k, head_dim).half(),
            torch.randn(batch, seqlen, nheads_k, head_dim).half())


def test_first_call_of_the_process_inside_a_jit_trace(cpu_ops):
    """Nothing of the library ran before (the build query's cache is empty): tracing a causal call must record the
    attention op (not the build query) and replay on new values as the op computes them."""
    _ops._compiled.cache_clear()
    q, k, v = _dense(2, 77, 4, 2)
    traced = torch.jit.trace(lambda q, k, v: attention(q, k, v, causal=True), (q, k, v), check_trace=False)
    assert _ops_in(traced) == ["flash_attn_hopper::fwd"], _ops_in(traced)
    q2, k2, v2 = _dense(2, 77, 4, 2)
    want = fwd_stand_in(q2, k2, v2, 64**-0.5, True, -1, 0, 0.0, False)[0]
    assert torch.equal(traced(q2, k2, v2), want)


# trace-time boundaries end at row 200 of 300; the replays' end further, earlier, or start past row 0
REPLAYS = {"longer": [0, 150, 300], "shorter": [0, 40, 120], "offset": [30, 90, 260]}


def test_compiled_varlen_with_a_fixed_max_seqlen_compiles_once(cpu_ops):
    """torch.compile(dynamic=True, fullgraph=True) of attention_varlen with a fixed upper bound as max_seqlen (a
    model's context length): new sequence lengths, sequence counts and token totals reuse the one graph, and every call
    returns the eager call's out and LSE."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def f(q, k, v, cu):
        return attention_varlen(q, k, v, cu, cu, 64, 64, causal=True, return_lse=True)

    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    for lengths in ([5, 7], [9, 3], [4, 4, 11], [20, 1], [6, 30, 2], [1, 2, 3, 50]):
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        q, k, v = (torch.randn(sum(lengths), 2, 64).half() for _ in range(3))
        got, want = compiled(q, k, v, cu), f(q, k, v, cu)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"lengths {lengths}: compiled != eager"
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for one max_seqlen"


@pytest.mark.parametrize("replay", list(REPLAYS))
def test_jit_trace_of_varlen_follows_new_cu_seqlens(cpu_ops, replay):
    """Trace attention_varlen with cu_seqlens ending at row 200 of 300 (a preallocated buffer), replay with other
    boundaries (max_seqlen: 300, an upper bound, as the trace keeps it): out and LSE must be the op's on the replay's
    whole q, k, v and boundaries (before the fix the trace handed the op the first 200 rows whatever cu_seqlens said)."""
    q, k, v = torch.randn(300, 4, 64).half(), torch.randn(300, 2, 64).half(), torch.randn(300, 2, 64).half()
    cu_trace = torch.tensor([0, 100, 200], dtype=torch.int32)

    def f(q, k, v, cu):
        return attention_varlen(q, k, v, cu, cu, 300, 300, causal=True, return_lse=True)

    traced = torch.jit.trace(f, (q, k, v, cu_trace), check_trace=False)
    cu = torch.tensor(REPLAYS[replay], dtype=torch.int32)
    out, lse = traced(q, k, v, cu)
    want_out, want_lse = fwd_varlen_stand_in(q, k, v, cu, cu, 300, 300, 64**-0.5, True, -1, 0, 0.0, False)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse), f"{replay}: the trace kept trace-time lengths"


def test_jit_trace_of_documents_does_not_keep_cached_bounds(cpu_ops):
    """A warm-up call caches the document bounds of ids_a; a trace on the same ids must still derive the bounds from
    the ids it is given, so a replay with other ids uses their documents."""
    q, k, v = _dense(1, 300, 4, 2)
    ids_a = torch.repeat_interleave(torch.tensor([[0, 1]]), torch.tensor([120, 180]), dim=1)
    ids_b = torch.repeat_interleave(torch.tensor([[0, 1, 2]]), torch.tensor([40, 200, 60]), dim=1)
    attention(q, k, v, causal=True, document_ids=ids_a)  # warm-up: the bounds of ids_a are cached
    cached = interface._DOCUMENT_BOUNDS.get(ids_a, ids_a.device)
    assert cached is not interface._ValueNotes.MISSING, "construction: nothing cached"
    traced = torch.jit.trace(lambda q, k, v, ids: attention(q, k, v, causal=True, document_ids=ids), (q, k, v, ids_a),
                             check_trace=False)
    got = traced(q, k, v, ids_b)
    want = fwd_stand_in(q, k, v, 64**-0.5, True, -1, 0, 0.0, False, interface.document_bounds(ids_b))[0]
    assert torch.equal(got, want), "the trace replayed the warm-up's documents"


@requires_transformers
def test_transformers_document_ids_under_jit_trace(cpu_ops):
    """The transformers integration's document ids from position_ids, cached per tensor like the bounds: a trace after
    a warm-up on the same position_ids must compute them from the position_ids it is given."""
    from flash_attn_hopper.integrations import transformers as fah_transformers

    old, fah_transformers._DOCUMENTS = fah_transformers._DOCUMENTS, interface._ValueNotes()
    try:
        query = key = torch.randn(2, 4, 50, 64).half()  # transformers' (batch, nheads, seqlen, head_dim)
        pos_a = torch.cat([torch.arange(20), torch.arange(30)]).unsqueeze(0)
        pos_b = torch.cat([torch.arange(35), torch.arange(5), torch.arange(10)]).unsqueeze(0)
        fah_transformers._documents(pos_a, query, key)  # warm-up: cached
        traced = torch.jit.trace(lambda pos, query, key: fah_transformers._documents(pos, query, key),
                                 (pos_a, query, key), check_trace=False)
        got = traced(pos_b, query, key)
        fah_transformers._DOCUMENTS = interface._ValueNotes()
        want = fah_transformers._documents(pos_b, query, key)
        assert torch.equal(got, want), "the trace replayed the warm-up's document ids"
    finally:
        fah_transformers._DOCUMENTS = old


@requires_transformers
def test_transformers_padding_mask_refused_under_jit_trace(cpu_ops):
    """A padding mask's lengths are read on the host: under torch.jit.trace that must raise naming the trace (as inside
    a CUDA graph capture), not record the trace-time lengths as constants."""
    from flash_attn_hopper.integrations import transformers as fah_transformers

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="torch.jit.trace"):
        torch.jit.trace(lambda m: fah_transformers._unpadding(m, 5)[0], (mask,), check_trace=False)


@pytest.mark.parametrize("case", ["head_dim", "window_size", "cu_seqlens_q"])
def test_bad_arguments_still_refused_by_name_under_jit_trace(cpu_ops, case):
    """Taking the graph path under the trace skips only the host reads and caches, not the argument checks."""
    q, k, v = _dense(1, 40, 2, 2, head_dim=64)
    cu = torch.tensor([0, 40], dtype=torch.int32)
    if case == "head_dim":
        f, args = (lambda q, k, v: attention(q, k, v)), (q[..., :12], k[..., :12], v)
    elif case == "window_size":
        f, args = (lambda q, k, v: attention(q, k, v, window_size=(-2, 0))), (q, k, v)
    else:
        f, args = (lambda q, k, v: attention_varlen(q, k, v, cu.long(), cu, 40, 40)), (q[0], k[0], v[0])
    with pytest.raises(ValueError, match=case):
        torch.jit.trace(f, args, check_trace=False)


@pytest.mark.parametrize("bad", ["decreasing", "past_rows", "max_seqlen"])
def test_jit_trace_of_varlen_checks_the_traced_values(cpu_ops, bad):
    """torch.jit.trace runs the traced call eagerly, so its cu_seqlens are checked as in an eager call (a decreasing
    offset, an end past q's rows, a sequence longer than max_seqlen_q: ValueError naming it), though what is launched
    does not depend on them (test_jit_trace_of_varlen_follows_new_cu_seqlens)."""
    q, k, v = torch.randn(300, 4, 64).half(), torch.randn(300, 2, 64).half(), torch.randn(300, 2, 64).half()
    cu, max_q, match = {"decreasing": ([0, 150, 100], 300, "cu_seqlens_q must be non-decreasing"),
                        "past_rows": ([0, 150, 301], 300, "cu_seqlens_q ends at row 301"),
                        "max_seqlen": ([0, 150, 300], 100, "max_seqlen_q is 100")}[bad]
    cu_q = torch.tensor(cu, dtype=torch.int32)
    cu_k = torch.tensor([0, 150, 300], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        torch.jit.trace(lambda q, k, v, cu_q: attention_varlen(q, k, v, cu_q, cu_k, max_q, 300), (q, k, v, cu_q),
                        check_trace=False)


@requires_transformers
@pytest.mark.parametrize("mask_kind", ["all_ones", "padded"])
def test_transformers_mask_function_refuses_an_attention_mask_under_jit_trace(mask_kind):
    """transformers drops an all-ones attention_mask by a host read, which a trace would keep as "no padding" for
    every replay: the mask function must refuse any attention_mask under a trace, naming it."""
    from flash_attn_hopper.integrations import transformers as fah_transformers

    mask = torch.ones(2, 5, dtype=torch.int64)
    if mask_kind == "padded":
        mask[0, :2] = 0

    def f(m):
        out = fah_transformers.flash_attn_hopper_mask(2, 5, 5, attention_mask=m)
        return m if out is None else out

    with pytest.raises(RuntimeError, match="torch.jit.trace"):
        torch.jit.trace(f, (mask,), check_trace=False)
