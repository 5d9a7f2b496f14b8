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


def _register_python_kernels():
    """Fake (meta) kernels and the autograd formula of the C++ ops, so torch.compile traces them as graph nodes.

    The forward saves q, k, v, out and lse; its backward is the FlashAttention-3 backward op (paper §2.1).
    lse is an output but not differentiable (marked so): a loss that uses it gets no gradient through it.
    """

    @torch.library.register_fake("flash_attn_hopper::fwd")
    def _fwd_fake(q, k, v, softmax_scale, causal):
        batch, seqlen_q, nheads, _ = q.shape
        return q.new_empty((batch, seqlen_q, nheads, v.shape[-1])), q.new_empty(
            (batch, nheads, seqlen_q), dtype=torch.float32
        )

    @torch.library.register_fake("flash_attn_hopper::bwd")
    def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def _fwd_setup_context(ctx, inputs, output):
        q, k, v, softmax_scale, causal = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.mark_non_differentiable(lse)

    def _fwd_backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.flash_attn_hopper.bwd(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal)
        return dq, dk, dv, None, None

    torch.library.register_autograd("flash_attn_hopper::fwd", _fwd_backward, setup_context=_fwd_setup_context)


if EXTENSION_LOADED:
    _register_python_kernels()


def require_extension():
    """Raises RuntimeError with the reason when the compiled extension is unavailable."""
    if not EXTENSION_LOADED:
        raise RuntimeError(_load_error)


@functools.lru_cache(maxsize=None)
def _build_config_text():
    return torch.ops.flash_attn_hopper.build_config()


def build_config():
    """The head dims and dtypes compiled into the extension: ``{"head_dims": [...], "dtypes": [...]}``."""
    require_extension()
    text = _build_config_text()
    cfg = {}
    for part in text.split(";"):
        key, _, value = part.partition("=")
        cfg[key] = [v for v in value.split(",") if v]
    return {
        "head_dims": [int(v) for v in cfg.get("head_dims", [])],
        "dtypes": [{"fp16": torch.float16, "bf16": torch.bfloat16}[v] for v in cfg.get("dtypes", [])],
    }
