"""Helpers shared by the CPU test modules that run the library's ops through CPU stand-ins of their kernels (the
extension's op schemas and C++ autograd nodes, the stand-ins' arithmetic): the device, sm90 and build checks pass,
the checked-call and document caches start empty, and the build query has run. The stand-ins themselves are below."""

import contextlib
import sys
import warnings

import pytest
import torch

from flash_attn_hopper import _ops, interface
from flash_attn_hopper.testing import _scores, attention_ref, attention_varlen_ref, repeat_kv


@contextlib.contextmanager
def ops_on_cpu(monkeypatch, impls, needs):
    """Registers `impls` (op name -> CPU function) as the CPU kernels of the flash_attn_hopper ops for the duration;
    skips, naming `needs`, where the extension is not built."""
    if not _ops.EXTENSION_LOADED:
        pytest.skip(f"the extension is needed for {needs}: {_ops._load_error}")
    monkeypatch.setattr(interface, "_check_devices", lambda named: None)
    monkeypatch.setattr(interface, "_check_sm90", lambda name, device: None)
    # the stand-ins run every head_dim and dtype, whatever this build compiled (FAH_HDIMS / FAH_DTYPES)
    monkeypatch.setattr(interface, "_check_compiled", lambda *args: None)
    monkeypatch.setattr(interface, "_capturing", lambda device: False)  # (a CUDA query)
    monkeypatch.setattr(interface, "_CHECKED_CALLS", {})
    monkeypatch.setattr(interface, "_CHECKED_VARLEN_CALLS", {})
    monkeypatch.setattr(interface, "_DOCUMENT_BOUNDS", interface._ValueNotes())
    _ops._compiled()
    lib = torch.library.Library("flash_attn_hopper", "IMPL")
    try:
        with warnings.catch_warnings():  # over the extension's CPU kernel, which refuses CPU tensors
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            for name, fn in impls.items():
                lib.impl(name, fn, "CPU")
        yield
    finally:
        lib._destroy()
        _ops._compiled.cache_clear()


# ------------------------------------------------------------------------------------------ the stand-in kernels
# The forwards are the float32 references of flash_attn_hopper.testing rounded to the input dtype; the backwards are
# DESIGN.md §1 with P recomputed from the SAVED LSE and D from the SAVED out (as the kernels do), so a C++ autograd node
# handed the wrong saved tensors gives other gradients. Every call is recorded in CALLS as (op, deterministic,
# max_seqlen_q, max_seqlen_k) (None for the dense ops), for tests that read what a graph handed the ops.

CALLS = []


def fwd_stand_in(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic, doc_bounds=None):
    CALLS.append(("fwd", deterministic, None, None))
    ids = None if doc_bounds is None else doc_bounds[..., 0]  # each position's document start: valid document ids
    out, lse = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                             softcap=softcap, document_ids=ids)
    return out.to(q.dtype), lse


def _grads(dout, q, k, v, out, lse, dlse, scale, causal, window, softcap, ids):
    """dQ, dK, dV in float32: P = exp(S - LSE), D = rowsum(dO ∘ O) - dLSE, dS = P ∘ (dP - D) (times 1 - tanh² of the
    uncapped scaled score under a softcap)."""
    qf, kf, vf, of, dof = (t.float() for t in (q, k, v, out, dout))
    kr, vr = repeat_kv(kf, q.shape[2]), repeat_kv(vf, q.shape[2])
    s = _scores(qf, kr, scale, causal, window, softcap, ids)  # (b, h, q, k)
    empty = torch.isneginf(lse).unsqueeze(-1)
    p = torch.exp(s - lse.unsqueeze(-1).masked_fill(empty, 0.0)).masked_fill(empty, 0.0)
    d = (dof * of).sum(-1).transpose(1, 2)  # (b, h, q)
    if dlse is not None:
        d = d - dlse.float()
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", dof, vr) - d.unsqueeze(-1))
    if softcap > 0:
        ds = ds * (1 - torch.tanh(torch.einsum("bqhd,bkhd->bhqk", qf, kr) * scale / softcap) ** 2)
    dq = scale * torch.einsum("bhqk,bkhd->bqhd", ds, kr)
    dk = scale * torch.einsum("bhqk,bqhd->bkhd", ds, qf)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)
    group = q.shape[2] // k.shape[2]
    return dq, dk.reshape(*k.shape[:3], group, k.shape[3]).sum(3), dv.reshape(*v.shape[:3], group, v.shape[3]).sum(3)


def bwd_stand_in(dout, q, k, v, out, lse, dlse, softmax_scale, causal, window_left, window_right, softcap,
                 deterministic, doc_bounds=None):
    CALLS.append(("bwd", deterministic, None, None))
    ids = None if doc_bounds is None else doc_bounds[..., 0]
    g = _grads(dout, q, k, v, out, lse, dlse, softmax_scale, causal, (window_left, window_right), softcap, ids)
    return tuple(t.to(q.dtype) for t in g)


def _record_varlen(op, deterministic, cu_q, cu_k, max_q, max_k, rows_q, rows_k):
    """The kernels' contract: each maximum bounds its side's longest sequence (a smaller one leaves rows unwritten);
    the offsets lie in [0, rows] of the tensors they get and do not decrease (else the kernels index past them)."""
    CALLS.append((op, deterministic, max_q, max_k))
    for side, cu, bound, rows in (("q", cu_q, max_q, rows_q), ("k", cu_k, max_k, rows_k)):
        values = cu.tolist()
        if values[0] < 0 or values[-1] > rows or any(b < a for a, b in zip(values, values[1:])):
            raise RuntimeError(f"{op}: cu_seqlens_{side} {values} outside the {rows} rows of {side} (out of bounds)")
        longest = int(cu.diff().max()) if cu.numel() > 1 else 0
        if bound < longest:
            raise RuntimeError(f"{op}: max_seqlen_{side} {bound} below the longest sequence {longest}")


def fwd_varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_left, window_right, softcap,
                        deterministic):
    _record_varlen("fwd_varlen", deterministic, cu_q, cu_k, max_q, max_k, q.shape[0], k.shape[0])
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, softmax_scale=softmax_scale, causal=causal,
                                    window_size=(window_left, window_right), softcap=softcap)
    return out.to(q.dtype), lse


def bwd_varlen_stand_in(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_left,
                        window_right, softcap, deterministic):
    """The dense gradients per sequence (batch 1 views); rows and keys outside the sequences get 0."""
    _record_varlen("bwd_varlen", deterministic, cu_q, cu_k, max_q, max_k, q.shape[0], k.shape[0])
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        (q0, q1), (k0, k1) = (cq[b], cq[b + 1]), (ck[b], ck[b + 1])
        if q1 == q0 or k1 == k0:
            continue
        g = _grads(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                   lse[None, :, q0:q1], None if dlse is None else dlse[None, :, q0:q1], softmax_scale, causal,
                   (window_left, window_right), softcap, None)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = (t[0].to(q.dtype) for t in g)
    return dq, dk, dv


STAND_INS = {"fwd": fwd_stand_in, "bwd": bwd_stand_in, "fwd_varlen": fwd_varlen_stand_in,
             "bwd_varlen": bwd_varlen_stand_in}


@contextlib.contextmanager
def stand_ins(monkeypatch, needs="its op schemas and autograd node"):
    """ops_on_cpu with every op's stand-in above, CALLS emptied."""
    CALLS.clear()
    with ops_on_cpu(monkeypatch, STAND_INS, needs):
        yield


def _contiguous_outputs(fn):
    def run(*args, **kwargs):
        return tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in fn(*args, **kwargs))
    return run


@contextlib.contextmanager
def gpu_bodies_on_cpu(monkeypatch, gpu_file, needs):
    """stand_ins for running a GPU test file's bodies on the CPU: its DEVICE set to "cpu", its poison and
    require_built made no-ops (the CUDA caching allocator's; every head_dim here), the stand-ins' outputs contiguous
    (as the kernels' are)."""
    monkeypatch.setattr(gpu_file, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_file, "poison", lambda *args, **kwargs: None)
    monkeypatch.setattr(gpu_file, "require_built", lambda *args, **kwargs: None)
    monkeypatch.setattr(sys.modules[__name__], "STAND_INS", {n: _contiguous_outputs(f) for n, f in STAND_INS.items()})
    with stand_ins(monkeypatch, needs):
        yield


def dense_inputs(dtype=torch.bfloat16, seqlen=17, nheads_k=2):
    """Seeded CPU inputs for the stand-ins: q (2, seqlen, 4, 64), k and v (2, seqlen, nheads_k, 64)."""
    torch.manual_seed(0)
    q = torch.randn(2, seqlen, 4, 64, dtype=dtype)
    k = torch.randn(2, seqlen, nheads_k, 64, dtype=dtype)
    return q, k, torch.randn_like(k)


def varlen_inputs(total_q=30, total_k=34):
    """Seeded packed CPU inputs: q (total_q, 4, 64), k and v (total_k, 2, 64), bf16."""
    torch.manual_seed(1)
    q = torch.randn(total_q, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(total_k, 2, 64, dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)
