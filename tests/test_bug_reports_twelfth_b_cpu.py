"""Twelfth round, PyTorch machinery (tests/bug_report_sources.md, "Twelfth round (PyTorch machinery)"), on the CPU.

- DC: torch.utils.flop_counter.FlopCounterMode counted the library's ops as 0 FLOPs (no formula registered), so MFU
  tooling built on it left attention out. The ops now have formulas counted as PyTorch counts its own fused attention
  (tests/cpu_stand_ins.py runs the kernels; meta tensors in fresh interpreters for the import orders).
"""

import os
import subprocess
import sys

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper import attention, attention_varlen
from cpu_stand_ins import stand_ins

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_hopper.__file__)))


@pytest.fixture
def cpu_ops(monkeypatch):
    with stand_ins(monkeypatch):
        yield


def _randn(*shape):
    return torch.randn(*shape).to(torch.bfloat16).requires_grad_()


def _sdpa_counts(shapes):
    """(forward, backward) FLOPs of PyTorch's formulas for its fused attention ops, summed over (b, h, s_q, s_k, d,
    d_v) blocks (query heads: every query head reads a K/V head)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    fwd = bwd = 0
    for b, h, s_q, s_k, d, d_v in shapes:
        q, k, v, o = (b, h, s_q, d), (b, h, s_k, d), (b, h, s_k, d_v), (b, h, s_q, d_v)
        fwd += sdpa_flop_count(q, k, v)
        bwd += sdpa_backward_flop_count(o, q, k, v)
    return fwd, bwd


def _cases():
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([30, 50, 20])).expand(2, 100)
    cu_q = torch.tensor([0, 40, 40, 100], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 70, 130], dtype=torch.int32)
    return {
        # name: (call(q, k, v), q, k, v shapes, counted blocks)
        "dense_causal": (lambda q, k, v: attention(q, k, v, causal=True), (2, 100, 4, 64), (2, 120, 4, 64),
                         (2, 120, 4, 64), [(2, 4, 100, 120, 64, 64)]),
        "gqa_head_dim_v": (lambda q, k, v: attention(q, k, v, window_size=(20, 3)), (3, 50, 8, 64), (3, 70, 2, 64),
                           (3, 70, 2, 32), [(3, 8, 50, 70, 64, 32)]),
        "documents": (lambda q, k, v: attention(q, k, v, causal=True, document_ids=ids), (2, 100, 4, 64),
                      (2, 100, 4, 64), (2, 100, 4, 64), [(2, 4, 100, 100, 64, 64)]),
        "varlen": (lambda q, k, v: attention_varlen(q, k, v, cu_q, cu_k, 60, 60, causal=True), (110, 4, 64),
                   (130, 2, 64), (130, 2, 64), [(1, 4, 40, 10, 64, 64), (1, 4, 0, 60, 64, 64),
                                                (1, 4, 60, 60, 64, 64)]),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_flop_counter_counts_the_ops(cpu_ops, case):
    """pytorch/pytorch#195460 (FlopCounterMode silently counted 0 FLOPs for an attention op without a formula; fixed in
    PyTorch by registering it, #195801) and SHI-Labs/NATTEN#184 (a custom attention op invisible to FlopCounterMode
    until the library registered a formula). Forward and backward of each op counted as PyTorch counts its own fused
    attention over the same score blocks (masks not subtracted, as there; varlen per sequence)."""
    from torch.utils.flop_counter import FlopCounterMode

    call, q_shape, k_shape, v_shape, blocks = _cases()[case]
    q, k, v = _randn(*q_shape), _randn(*k_shape), _randn(*v_shape)
    fwd_op, bwd_op = ((torch.ops.flash_attn_hopper.fwd_varlen, torch.ops.flash_attn_hopper.bwd_varlen)
                      if case == "varlen" else (torch.ops.flash_attn_hopper.fwd, torch.ops.flash_attn_hopper.bwd))
    want_fwd, want_bwd = _sdpa_counts(blocks)
    with FlopCounterMode(display=False) as counter:
        out = call(q, k, v)
        counted_fwd = counter.get_total_flops()
        out.float().sum().backward()
    counts = counter.get_flop_counts()["Global"]
    assert counted_fwd == want_fwd and counts.get(fwd_op) == want_fwd, f"forward: {dict(counts)}, want {want_fwd}"
    assert counts.get(bwd_op) == want_bwd, f"backward: {dict(counts)}, want {want_bwd}"
    assert counter.get_total_flops() == want_fwd + want_bwd


def test_flop_counter_with_fake_tensors_counts_max_seqlen(cpu_ops):
    """FLOP estimates are often made on fake tensors (no values): varlen then counts max_seqlen_q x max_seqlen_k per
    sequence, as PyTorch's formulas do for its varlen flash ops, instead of reading cu_seqlens."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    with FakeTensorMode():
        q, k, v = torch.randn(110, 4, 64).bfloat16(), torch.randn(130, 2, 64).bfloat16(), torch.randn(130, 2, 64).bfloat16()
        cu_q = torch.tensor([0, 40, 40, 100], dtype=torch.int32)
        cu_k = torch.tensor([0, 10, 70, 130], dtype=torch.int32)
        with FlopCounterMode(display=False) as counter:
            attention_varlen(q, k, v, cu_q, cu_k, 60, 70)
    assert counter.get_total_flops() == _sdpa_counts([(3, 4, 60, 70, 64, 64)])[0]


_IMPORT_ORDER_SCRIPT = r"""
import sys
import torch
order = sys.argv[1]
if order == "counter_first":
    import torch.utils.flop_counter
import flash_attn_hopper
assert order == "counter_first" or "torch.utils.flop_counter" not in sys.modules, "the library imported the counter"
from torch.utils.flop_counter import FlopCounterMode
q = torch.empty(2, 100, 4, 64, device="meta", dtype=torch.bfloat16)
k = v = torch.empty(2, 120, 2, 64, device="meta", dtype=torch.bfloat16)
with FlopCounterMode(display=False) as counter:
    torch.ops.flash_attn_hopper.fwd(q, k, v, 0.125, True, -1, 0, 0.0, False, None)
print("flops", counter.get_total_flops())
"""


@pytest.mark.parametrize("order", ["library_first", "counter_first"])
def test_flop_formulas_registered_in_either_import_order(order):
    """The formulas reach FlopCounterMode whether torch.utils.flop_counter is imported before or after the library (a
    fresh interpreter; meta tensors run the ops' fake kernels), and importing the library does not import the counter
    (it brings in triton)."""
    if not flash_attn_hopper.EXTENSION_LOADED:
        pytest.skip("the extension is needed for the op schemas")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _IMPORT_ORDER_SCRIPT, order], capture_output=True, text=True,
                       timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert f"flops {2 * 2 * 4 * 100 * 120 * 128}" in r.stdout, r.stdout


_FAILING_REGISTRATION_SCRIPT = r"""
import warnings
import flash_attn_hopper
from flash_attn_hopper import _ops

def broken(module):
    raise RuntimeError("a registry of another shape")

_ops._register_flop_formulas = broken
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch.utils.flop_counter
assert hasattr(torch.utils.flop_counter, "FlopCounterMode")
assert any("FLOP formulas were not registered" in str(w.message) for w in caught), [str(w.message) for w in caught]
print("imported")
"""


def test_a_failing_registration_never_breaks_the_counter_import():
    """The import hook registers the formulas after PyTorch's module has run; a registration that fails (a future
    PyTorch with another registry) leaves torch.utils.flop_counter imported and warns, instead of failing its import."""
    if not flash_attn_hopper.EXTENSION_LOADED:
        pytest.skip("the extension is needed for the op schemas")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _FAILING_REGISTRATION_SCRIPT], capture_output=True, text=True,
                       timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0 and "imported" in r.stdout, f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


# DD: cu_seqlens as a tensor subclass whose values cannot be read on the host (a DTensor: ".tolist() is not supported
# for tensor subclasses"): refused before any launch, but with torch's message, which names no argument.


class _Unreadable(torch.Tensor):
    """A tensor subclass whose host read fails as a DTensor's does (a plain subclass: clone keeps the type)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            raise RuntimeError(".tolist() is not supported for tensor subclasses")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_unreadable_cu_seqlens_subclass_is_named(cpu_ops):
    """A DTensor-like cu_seqlens_k: TypeError naming cu_seqlens_k and its type, not the subclass's bare RuntimeError."""
    q, k, v = _randn(100, 4, 64), _randn(130, 2, 64), _randn(130, 2, 64)
    cu_q = torch.tensor([0, 40, 40, 100], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 70, 130], dtype=torch.int32).as_subclass(_Unreadable)
    with pytest.raises(TypeError, match=r"cu_seqlens_k must be a plain torch.Tensor .* got _Unreadable"):
        attention_varlen(q, k, v, cu_q, cu_k, 60, 70)
