"""Loads the compiled extension, which registers ``torch.ops.flash_attn_hopper.*`` through TORCH_LIBRARY.

The shared object has no Python module init (it is built with the limited API and holds no pybind code),
so it is loaded with ``torch.ops.load_library`` rather than imported.
"""

import functools
import glob
import os

import torch

_LIB_DIR = os.path.dirname(os.path.abspath(__file__))
_load_error = None


def _load():
    global _load_error
    candidates = sorted(glob.glob(os.path.join(_LIB_DIR, "_C*.so")))
    if not candidates:
        _load_error = (
            "the flash_attn_hopper CUDA extension is not built; install with "
            "`pip install --no-build-isolation .` on a machine with nvcc and the nvidia-cutlass wheel"
        )
        return False
    try:
        torch.ops.load_library(candidates[0])
    except OSError as e:  # pragma: no cover - depends on the local build
        _load_error = (
            f"the flash_attn_hopper CUDA extension could not be loaded from {candidates[0]} "
            f"(built against another torch? rebuild it): {e}"
        )
        return False
    return True


EXTENSION_LOADED = _load()


def _backward(saved, dout, dlse, *args):
    """dq, dk, dv through the backward op (args: softmax_scale, causal, window_left, window_right, softcap,
    deterministic). dout None (only lse used by the loss) means a zero output gradient; dlse None means the loss does
    not use lse."""
    q, k, v, out, lse = saved
    if dout is None:
        dout = torch.zeros_like(out)
    return torch.ops.flash_attn_hopper.bwd(dout, q, k, v, out, lse, dlse, *args)


class AttentionFunction(torch.autograd.Function):
    """The eager autograd path of ``flash_attn_hopper::fwd``: the same forward and backward ops as the
    torch.library registration below, through a plain autograd.Function, whose per-call host cost is a fraction of
    the registered op's Python autograd wrapper (that one stays for torch.compile and opcheck)."""

    @staticmethod
    def forward(ctx, q, k, v, *args):
        out, lse = torch.ops.flash_attn_hopper.fwd(q, k, v, *args)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = args
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        dq, dk, dv = _backward(ctx.saved_tensors, dout, dlse, *ctx.args)
        return (dq, dk, dv) + (None,) * len(ctx.args)


class AttentionVarlenFunction(torch.autograd.Function):
    """The eager autograd path of ``flash_attn_hopper::fwd_varlen`` (as AttentionFunction for the dense op)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args):
        out, lse = torch.ops.flash_attn_hopper.fwd_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.args = (max_seqlen_q, max_seqlen_k, *args)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        dq, dk, dv = _backward_varlen(ctx.saved_tensors, dout, dlse, *ctx.args)
        return (dq, dk, dv) + (None,) * (len(ctx.args) + 2)  # + cu_seqlens_q, cu_seqlens_k


def _backward_varlen(saved, dout, dlse, max_seqlen_q, max_seqlen_k, *args):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = saved
    if dout is None:
        dout = torch.zeros_like(out)
    return torch.ops.flash_attn_hopper.bwd_varlen(
        dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args
    )


def _register_python_kernels():
    """Fake (meta) kernels and the autograd formula of the C++ ops, so torch.compile traces them as graph nodes.

    The forward saves q, k, v, out and lse; its backward is the FlashAttention-3 backward op (paper §2.1). lse is
    differentiable: its gradient dLSE enters the backward op, where dS gains P ∘ dLSE.
    """

    @torch.library.register_fake("flash_attn_hopper::fwd")
    def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic):
        batch, seqlen_q, nheads, _ = q.shape
        return q.new_empty((batch, seqlen_q, nheads, v.shape[-1])), q.new_empty(
            (batch, nheads, seqlen_q), dtype=torch.float32
        )

    @torch.library.register_fake("flash_attn_hopper::bwd")
    def _bwd_fake(dout, q, k, v, out, lse, dlse, softmax_scale, causal, window_left, window_right, softcap,
                  deterministic):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def _fwd_setup_context(ctx, inputs, output):
        q, k, v, *args = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = tuple(args)
        ctx.set_materialize_grads(False)

    def _fwd_backward(ctx, dout, dlse):
        dq, dk, dv = _backward(ctx.saved_tensors, dout, dlse, *ctx.args)
        return (dq, dk, dv) + (None,) * len(ctx.args)

    torch.library.register_autograd("flash_attn_hopper::fwd", _fwd_backward, setup_context=_fwd_setup_context)

    @torch.library.register_fake("flash_attn_hopper::fwd_varlen")
    def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args):
        total_q, nheads, _ = q.shape
        return q.new_empty((total_q, nheads, v.shape[-1])), q.new_empty((nheads, total_q), dtype=torch.float32)

    @torch.library.register_fake("flash_attn_hopper::bwd_varlen")
    def _bwd_varlen_fake(dout, q, k, v, out, lse, dlse, *args):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def _fwd_varlen_setup_context(ctx, inputs, output):
        q, k, v, cu_seqlens_q, cu_seqlens_k, *args = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.args = tuple(args)
        ctx.set_materialize_grads(False)

    def _fwd_varlen_backward(ctx, dout, dlse):
        dq, dk, dv = _backward_varlen(ctx.saved_tensors, dout, dlse, *ctx.args)
        return (dq, dk, dv) + (None,) * (len(ctx.args) + 2)  # + cu_seqlens_q, cu_seqlens_k

    torch.library.register_autograd(
        "flash_attn_hopper::fwd_varlen", _fwd_varlen_backward, setup_context=_fwd_varlen_setup_context
    )


if EXTENSION_LOADED:
    _register_python_kernels()


def require_extension():
    """Raises RuntimeError with the reason when the compiled extension is unavailable."""
    if not EXTENSION_LOADED:
        raise RuntimeError(_load_error)


@functools.lru_cache(maxsize=None)
def _compiled():
    """(head_dims, dtypes) of this build as tuples, parsed once: the Python checks consult it on every call."""
    cfg = {}
    for part in torch.ops.flash_attn_hopper.build_config().split(";"):
        key, _, value = part.partition("=")
        cfg[key] = [v for v in value.split(",") if v]
    head_dims = tuple(int(v) for v in cfg.get("head_dims", []))
    dtypes = tuple({"fp16": torch.float16, "bf16": torch.bfloat16}[v] for v in cfg.get("dtypes", []))
    return head_dims, dtypes


def build_config():
    """The head dims and dtypes compiled into the extension: ``{"head_dims": [...], "dtypes": [...]}``."""
    require_extension()
    head_dims, dtypes = _compiled()
    return {"head_dims": list(head_dims), "dtypes": list(dtypes)}
