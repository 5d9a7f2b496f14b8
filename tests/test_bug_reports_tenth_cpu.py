"""The CPU part of the tenth round of bug-report tests (classes BS and BU of tests/bug_report_sources.md; the GPU part
is tests/test_bug_reports_tenth_gpu.py):

- BS: torch.use_deterministic_algorithms switched between calls of a torch.compile'd function and between a compiled
  forward and its backward (https://github.com/pytorch/pytorch/issues/113707: "torch.compile doesnt respect
  use_determistic_algorithms during the backward()"; https://github.com/pytorch/pytorch/pull/114780). The library
  reads the mode in the Python call and passes it to the ops as their ``deterministic`` argument; under torch.compile
  that read happens at trace time, so what reaches the ops is what a compiled graph bakes in. Each compiled call must
  hand the forward and backward ops the flags the eager call hands them, and give its results bit for bit.
- BU: the Python layer must build nothing quadratic: no (seqlen, seqlen) mask for packed documents or a window, nothing
  of batch x max_seqlen rows for attention_varlen (https://github.com/pytorch/pytorch/issues/134756: a FlexAttention
  mask materialised for a 96000-token sequence; https://github.com/karpathy/nanochat/issues/825: a sliding window built
  as a full (Tq, Tk) mask). Every tensor made outside the library's ops during a forward and backward is recorded.

No GPU is needed: the device checks are replaced by no-ops and the ops get the CPU kernels of tests/cpu_stand_ins.py
(the float32 references; the backwards from DESIGN.md §1), which record the ``deterministic`` argument they receive."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flash_attn_hopper import attention, attention_varlen
from cpu_stand_ins import CALLS, stand_ins


@pytest.fixture
def cpu_ops(monkeypatch):
    """The ops run on the CPU (tests/cpu_stand_ins.py), forward and backward through the extension's C++ autograd
    node; device checks pass; no call in the checked-call cache; no call recorded yet."""
    with stand_ins(monkeypatch):
        yield


def _seen():
    """(op name, deterministic) of every stand-in call since CALLS was emptied, in order."""
    return [(op, deterministic) for op, deterministic, _, _ in CALLS]


def _half(*shape):
    return torch.randn(*shape).half()


def _ids(batch_lengths):
    """document_ids (batch, seqlen) from each row's document lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in batch_lengths])


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


# ------------------------------------------------------------- BS: the deterministic mode switched around torch.compile


def _entry(name):
    """(function of (q, k, v) returning (out, lse), q, k, v, dout, dlse) for one entry point."""
    if name == "dense":
        q, k, v = _half(2, 150, 4, 64), _half(2, 170, 2, 64), _half(2, 170, 2, 64)

        def fn(q, k, v):
            return attention(q, k, v, causal=True, window_size=(63, 0), softcap=15.0, return_lse=True)
        dout, dlse = _half(2, 150, 4, 64), torch.randn(2, 4, 150)
    elif name == "documents":
        q, k, v = _half(2, 150, 4, 64), _half(2, 150, 2, 64), _half(2, 150, 2, 64)
        ids = _ids([[40, 1, 109], [150]])

        def fn(q, k, v):
            return attention(q, k, v, causal=True, document_ids=ids, return_lse=True)
        dout, dlse = _half(2, 150, 4, 64), torch.randn(2, 4, 150)
    else:
        lq, lk = [90, 0, 77], [60, 33, 100]
        q, k, v = _half(sum(lq) + 5, 4, 64), _half(sum(lk) + 3, 2, 64), _half(sum(lk) + 3, 2, 64)
        cu_q, cu_k = _cu(lq), _cu(lk)

        def fn(q, k, v):
            return attention_varlen(q, k, v, cu_q, cu_k, 90, 100, causal=True, return_lse=True)
        dout, dlse = _half(sum(lq) + 5, 4, 64), torch.randn(4, sum(lq) + 5)
    return fn, q, k, v, dout, dlse


def _run(fn, tensors, mode_fwd, mode_bwd):
    """(stand-in calls, out, lse, dq, dk, dv) of one forward under mode_fwd and its backward under mode_bwd."""
    q, k, v, dout, dlse = tensors
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    CALLS.clear()
    try:
        torch.use_deterministic_algorithms(mode_fwd)
        out, lse = fn(*leaves)
        torch.use_deterministic_algorithms(mode_bwd)
        grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
    finally:
        torch.use_deterministic_algorithms(False)
    return (_seen(), out.detach(), lse.detach(), *grads)


# mode for the forward, mode for the backward: off, on, on then off (the backward follows the forward), off again
_MODE_STEPS = [(False, False), (True, True), (True, False), (False, False), (True, True)]


@pytest.mark.parametrize("entry", ["dense", "documents", "varlen"])
def test_compiled_call_follows_the_deterministic_mode(cpu_ops, entry):
    """torch.compile (fullgraph, aot_eager: dynamo's guards and AOTAutograd's compiled backward) of an attention call
    (dense GQA with a causal window and softcap, packed documents, attention_varlen with rows past the sequences), called
    with the mode off, on, on for the forward and off for the backward, off, on: at each step the compiled call's forward
    and backward ops receive the deterministic flag the eager call's ops receive (the forward's mode: README,
    ``deterministic``), and out, LSE, dQ, dK, dV equal the eager call's bit for bit. A graph traced with the mode off
    that served a call made with it on would pass deterministic=False to both ops. Then the forward with the mode off
    and the backward with it on: eager runs the forward's choice; the compiled call must do the same or raise
    PyTorch's error naming torch.use_deterministic_algorithms (AOTAutograd refuses that order), never a third thing."""
    fn, *tensors = _entry(entry)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    fwd_op, bwd_op = ("fwd_varlen", "bwd_varlen") if entry == "varlen" else ("fwd", "bwd")
    for mode_fwd, mode_bwd in _MODE_STEPS:
        eager = _run(fn, tensors, mode_fwd, mode_bwd)
        assert eager[0] == [(fwd_op, mode_fwd), (bwd_op, mode_fwd)], f"construction: eager ops got {eager[0]}"
        got = _run(compiled, tensors, mode_fwd, mode_bwd)
        where = f"{entry}, mode {mode_fwd} for the forward and {mode_bwd} for the backward"
        assert got[0] == eager[0], f"{where}: the compiled call's ops got {got[0]}, the eager call's {eager[0]}"
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got[1:], eager[1:]):
            assert torch.equal(a, b), f"{where}: compiled {name} differs from eager"
    eager = _run(fn, tensors, False, True)
    assert eager[0] == [(fwd_op, False), (bwd_op, False)], f"construction: eager ops got {eager[0]}"
    try:
        got = _run(compiled, tensors, False, True)
    except RuntimeError as e:
        assert "use_deterministic_algorithms" in str(e), f"{entry}: the compiled backward raised {e!r}"
    else:
        assert got[0] == eager[0], f"{entry}: mode off for the forward, on for the backward: ops got {got[0]}"


# -------------------------------------------------------------------- BU: nothing quadratic in the Python layer


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operator outside the flash_attn_hopper ops returns (the stand-ins' own
    operations run inside the op, where this mode is not active)."""

    def __init__(self):
        super().__init__()
        self.numel, self.where = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", None) != "flash_attn_hopper":
            for t in tree_leaves(result):
                if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                    self.numel, self.where = t.numel(), f"{func} -> {tuple(t.shape)}"
        return result


@pytest.mark.parametrize("case", ["documents", "varlen"])
def test_python_layer_builds_nothing_quadratic(cpu_ops, case):
    """A forward and backward through the Python layer and the C++ autograd node, with every operator outside the
    library's ops recorded: no tensor may hold more elements than twice the largest of q, k, v and dO (out, the
    gradients, the padded output of attention_varlen, the document bounds are all that size or smaller).
    head_dim 16 and GQA 2/1 keep that bound small. "documents": 2 rows of 2048 tokens (documents of 700, 1 and 1347
    tokens; 2048), causal window (255, 0), softcap 10, deterministic: a (seqlen, seqlen) mask is 16 times the bound.
    "varlen": one sequence of 3000 tokens and 2000 of 1, 5 rows past the last sequence, causal window (127, 0): a
    (batch, max_seqlen) index is 18 times the bound. The results equal those of the same call without the recorder."""
    if case == "documents":
        seqlen = 2048
        q, k, v, dout = _half(2, seqlen, 2, 16), _half(2, seqlen, 1, 16), _half(2, seqlen, 1, 16), _half(2, seqlen, 2, 16)
        ids = _ids([[700, 1, 1347], [2048]])

        def call(q, k, v):
            return attention(q, k, v, causal=True, window_size=(255, 0), softcap=10.0, deterministic=True,
                             document_ids=ids, return_lse=True)
    else:
        lengths = [3000] + [1] * 2000
        total = sum(lengths) + 5
        q, k, v, dout = _half(total, 2, 16), _half(total, 1, 16), _half(total, 1, 16), _half(total, 2, 16)
        cu = _cu(lengths)

        def call(q, k, v):
            return attention_varlen(q, k, v, cu, cu, 3000, 3000, causal=True, window_size=(127, 0), return_lse=True)
    bound = 2 * max(t.numel() for t in (q, k, v, dout))
    if case == "documents":
        assert seqlen * seqlen >= 16 * bound, "construction: a (seqlen, seqlen) mask fits the bound"
    else:
        assert len(lengths) * max(lengths) >= 18 * bound, "construction: a (batch, max_seqlen) index fits the bound"
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    recorder = _LargestTensor()
    with recorder:
        out, lse = call(*leaves)
        grads = torch.autograd.grad(out, leaves, dout)
    assert [name for name, _ in _seen()] == (["fwd", "bwd"] if case == "documents" else ["fwd_varlen", "bwd_varlen"]), (
        f"construction: the ops did not run under the recorder: {_seen()}")
    assert recorder.numel <= bound, f"{case}: the Python layer made a tensor of {recorder.numel} elements " \
                                    f"({recorder.where}), more than {bound}"
    leaves2 = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out2, lse2 = call(*leaves2)
    grads2 = torch.autograd.grad(out2, leaves2, dout)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (out2, lse2, *grads2)):
        assert torch.equal(a, b), f"{case}: {name} under the recorder differs"
