"""Thirteenth round of the bug hunt (tests/bug_report_sources.md, "Thirteenth round"): CPU tests.

DE: sizes without a value at trace time under torch.compile. A size is unbacked when it comes from data inside the
compiled code (rows picked by a boolean mask, ``nonzero``, with ``capture_dynamic_output_shape_ops``) or is marked with
``torch._dynamo.mark_unbacked`` (used to keep sizes 0 and 1 from specialising a graph). The Python checks of
``attention`` compared such sizes with the library's limits in Python (batch and nheads at most 65535, fewer than
2^30 - 256 rows, the forward's tile count, "are there keys") and the trace stopped with PyTorch's "Could not guard on
data-dependent expression", naming nothing of the library (pytorch/pytorch#147672: attention over a data-dependent
number of queries under export / compile; pytorch/pytorch#183833: FlexAttention's unbacked extents). What the trace
cannot decide is now a runtime assertion of the graph, as for a max_seqlen computed from data (tests/
test_bug_reports_ninth_cpu.py): the graph runs, and a call past a limit is refused when it runs, before any op.

The ops run through the CPU stand-ins of tests/cpu_stand_ins.py (the extension's op schemas, fake kernels and C++
autograd node; float32 references for the kernels); compiled results are compared bit for bit with the eager call.
"""

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen

from cpu_stand_ins import CALLS, stand_ins

mark_unbacked = torch._dynamo.decorators.mark_unbacked
HEADS, HEADS_K, HEAD_DIM, WIDTH = 4, 2, 64, 32


@pytest.fixture
def cpu_ops(monkeypatch):
    with stand_ins(monkeypatch):
        yield
    torch._dynamo.reset()


def _weights():
    torch.manual_seed(0)
    return (torch.randn((HEADS + 2 * HEADS_K) * HEAD_DIM, WIDTH) / WIDTH ** 0.5).to(torch.bfloat16)


def _split(t, weight):
    """q, k, v (..., rows, heads, head_dim) views of one projection of t (..., rows, WIDTH)."""
    qkv = (t @ weight.t()).unflatten(-1, (HEADS + 2 * HEADS_K, HEAD_DIM))
    return qkv.split([HEADS, HEADS_K, HEADS_K], dim=-2)


def _dense(x, weight):
    return attention(*_split(x, weight), causal=True)


def _dense_on_kept_rows(x, keep, weight):
    """Self-attention over the rows of x that keep selects: their number is data (an unbacked size when compiled)."""
    return attention(*_split(x[keep].unsqueeze(0), weight), causal=True)


def _varlen(x, cu, weight):
    return attention_varlen(*_split(x, weight), cu, cu, 40, 40, causal=True)


def _eager_and_compiled(fn, inputs, prepare=None):
    """(loss, gradient of inputs[0]) of fn eagerly and compiled (aot_eager, fullgraph), with the ops' calls of each."""
    results = []
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for f in (fn, compiled):
        x = inputs[0].detach().clone().requires_grad_(True)
        args = (x, *inputs[1:])
        if f is compiled and prepare is not None:
            prepare(x)
        CALLS.clear()
        out = f(*args)
        loss = out.float().square().sum()
        loss.backward()
        results.append((out.detach(), x.grad, [c[0] for c in CALLS]))
    return results, compiled


@pytest.mark.parametrize("case", ["rows_picked_by_a_mask", "unbacked_batch", "unbacked_seqlen", "unbacked_tokens"])
def test_compiled_attention_with_sizes_unknown_at_trace_time(cpu_ops, case):
    """torch.compile(fullgraph=True) of attention over a size without a value at trace time: it compiles, and the
    output, its gradient and the ops called are the eager call's, bit for bit. Before the fix each case
    stopped the trace in the library's Python checks ("Could not guard on data-dependent expression")."""
    weight = _weights()
    torch.manual_seed(1)
    if case == "rows_picked_by_a_mask":
        keep = torch.rand(70) < 0.6
        keep[:3] = True
        fn, inputs, prepare = _dense_on_kept_rows, (torch.randn(70, WIDTH).to(torch.bfloat16), keep, weight), None
    elif case == "unbacked_tokens":
        cu = torch.tensor([0, 13, 40, 71], dtype=torch.int32)
        fn, inputs = _varlen, (torch.randn(71, WIDTH).to(torch.bfloat16), cu, weight)
        prepare = lambda x: mark_unbacked(x, 0)  # noqa: E731
    else:
        dim = 0 if case == "unbacked_batch" else 1
        fn, inputs = _dense, (torch.randn(3, 37, WIDTH).to(torch.bfloat16), weight)
        prepare = lambda x: mark_unbacked(x, dim)  # noqa: E731
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        (out_e, grad_e, calls_e), (out_c, grad_c, calls_c) = _eager_and_compiled(fn, inputs, prepare)[0]
    assert calls_c == calls_e and calls_e[-1] in ("bwd", "bwd_varlen")
    assert torch.equal(out_c, out_e) and torch.equal(grad_c, grad_e)


def test_compiled_graph_refuses_a_data_dependent_batch_past_the_limit(cpu_ops):
    """Batch elements picked by a mask inside the compiled code (70000 candidates: the trace cannot tell whether more
    than 65535 are kept): the graph compiled with 3 kept checks the CUDA grid limit when it runs. 65536 kept is refused
    with a RuntimeError before any op runs; 65535 (the limit itself) and 5 kept run the same graph (no
    recompilation), as eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    weight = _weights()
    counter = CompileCounterWithBackend("aot_eager")

    def f(x, keep):
        return attention(*_split(x[keep], weight), causal=True)

    compiled = torch.compile(f, backend=counter, fullgraph=True)
    x = torch.randn(70000, 2, WIDTH).to(torch.bfloat16)
    with torch.no_grad(), torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        for kept in (3, 65536, 65535, 5):
            keep = torch.zeros(70000, dtype=torch.bool)
            keep[torch.randperm(70000)[:kept]] = True
            CALLS.clear()
            if kept > 65535:
                with pytest.raises(RuntimeError, match=r"<= 65535|past the library's limits"):  # 2.11: the expression
                    compiled(x, keep)
                assert CALLS == [], "an op ran past the batch limit"
            else:
                assert torch.equal(compiled(x, keep), f(x, keep))
    assert counter.frame_count == 1
