"""The autograd formulas of the ops (registered in C++, csrc/api/flash_api.cpp), run on meta tensors: no GPU needed,
but the built extension is (CI builds it). A dispatch mode records which ops the forward and the backward call and
with what, so the wiring of out, lse, dout and dlse is checked where no kernel can run."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flash_attn_hopper import _ops

pytestmark = pytest.mark.skipif(
    not _ops.EXTENSION_LOADED, reason="the compiled extension is not built here (CI builds it; see README)"
)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "flash_attn_hopper":
            self.calls.append((func.__name__.split(".")[0], args))
        return func(*args, **(kwargs or {}))


def _meta(*shape, requires_grad=True):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16, requires_grad=requires_grad)


def _dense_inputs():
    return _meta(2, 100, 4, 64), _meta(2, 130, 2, 64), _meta(2, 130, 2, 64)


ARGS = (0.125, True, 7, 0, 3.0, True)  # softmax_scale, causal, window_left, window_right, softcap, deterministic


@pytest.mark.parametrize("loss", ["out", "lse", "both"])
def test_dense_backward_passes_saved_tensors_and_output_grads(loss):
    q, k, v = _dense_inputs()
    rec = _Recorder()
    with rec:
        out, lse = torch.ops.flash_attn_hopper.fwd(q, k, v, *ARGS)
        assert out.requires_grad and lse.requires_grad
        assert "AttentionAutograd" in out.grad_fn.name()
        total = {"out": out.float().sum(), "lse": lse.sum(), "both": out.float().sum() + lse.sum()}[loss]
        dq, dk, dv = torch.autograd.grad(total, (q, k, v))
    names = [name for name, _ in rec.calls]
    assert names == ["fwd", "bwd"]
    fwd_args, bwd_args = rec.calls[0][1], rec.calls[1][1]
    assert fwd_args[3:] == ARGS
    dout, q_s, k_s, v_s, out_s, lse_s, dlse = bwd_args[:7]
    assert bwd_args[7:] == ARGS
    assert q_s is q or q_s.shape == q.shape
    assert out_s.shape == out.shape and lse_s.shape == lse.shape
    assert dout.shape == out.shape  # zeros when the loss uses only lse
    assert (dlse is None) == (loss == "out")
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_no_graph_without_requires_grad_or_under_no_grad():
    q, k, v = (_meta(1, 8, 2, 64, requires_grad=False) for _ in range(3))
    out, lse = torch.ops.flash_attn_hopper.fwd(q, k, v, *ARGS)
    assert out.grad_fn is None and not out.requires_grad
    q.requires_grad_(True)
    with torch.no_grad():
        out, lse = torch.ops.flash_attn_hopper.fwd(q, k, v, *ARGS)
    assert out.grad_fn is None


def test_varlen_backward_gets_cu_seqlens_and_maxima():
    q, k, v = _meta(50, 4, 64), _meta(70, 4, 64), _meta(70, 4, 64)
    cu_q = torch.empty(4, dtype=torch.int32, device="meta")
    cu_k = torch.empty(4, dtype=torch.int32, device="meta")
    rec = _Recorder()
    with rec:
        out, lse = torch.ops.flash_attn_hopper.fwd_varlen(q, k, v, cu_q, cu_k, 33, 41, *ARGS)
        assert "AttentionVarlenAutograd" in out.grad_fn.name()
        dq, dk, dv = torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))
    assert [name for name, _ in rec.calls] == ["fwd_varlen", "bwd_varlen"]
    bwd_args = rec.calls[1][1]
    assert bwd_args[7].shape == cu_q.shape and bwd_args[8].shape == cu_k.shape
    assert bwd_args[9:11] == (33, 41)
    assert bwd_args[11:] == ARGS
    assert bwd_args[6] is not None  # dlse
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_double_backward_raises_instead_of_dropping_terms(varlen):
    """dq, dk, dv from create_graph=True are not differentiable again: differentiating them raises (torch's fallback
    for an op without an autograd formula would only warn and drop the second-order terms through q, k, v)."""
    if varlen:
        q, k, v = _meta(50, 4, 64), _meta(70, 4, 64), _meta(70, 4, 64)
        cu = torch.empty(4, dtype=torch.int32, device="meta")
        out, _ = torch.ops.flash_attn_hopper.fwd_varlen(q, k, v, cu, cu, 33, 41, *ARGS)
    else:
        q, k, v = _dense_inputs()
        out, _ = torch.ops.flash_attn_hopper.fwd(q, k, v, *ARGS)
    dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k, v), create_graph=True)
    assert dq.requires_grad
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(dq.float().sum(), (q, k, v))
    # without create_graph the gradients carry no graph
    out, _ = torch.ops.flash_attn_hopper.fwd(*_dense_inputs(), *ARGS)
    dq = torch.autograd.grad(out.float().sum(), out.grad_fn.next_functions[0][0].variable)[0]
    assert not dq.requires_grad
