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
LIBRARY_PATH = None  # the loaded extension's file


def _load():
    global _load_error, LIBRARY_PATH
    candidates = sorted(glob.glob(os.path.join(_LIB_DIR, "_C*.so")))
    if not candidates:
        _load_error = (
            f"the flash_attn_hopper CUDA extension is not built (no _C*.so in {_LIB_DIR}); install with "
            "`pip install --no-build-isolation .` on a machine with nvcc and the nvidia-cutlass wheel. If it is "
            "installed, this import found the source tree first (run from another directory, or build in place with "
            "`python setup.py build_ext --inplace`)"
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
    LIBRARY_PATH = candidates[0]
    return True


EXTENSION_LOADED = _load()


def _register_python_kernels():
    """Fake (meta) kernels of the C++ ops, so torch.compile traces them as graph nodes. Their autograd formulas are
    registered in C++ (csrc/api/flash_api.cpp, the Autograd kernels of fwd and fwd_varlen): the forward saves q, k, v,
    out, lse (and fwd's doc_bounds); its backward is the FlashAttention-3 backward op (paper §2.1); lse is differentiable (its gradient
    dLSE enters the backward op, where dS gains P ∘ dLSE)."""

    @torch.library.register_fake("flash_attn_hopper::fwd")
    def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic, doc_bounds=None):
        batch, seqlen_q, nheads, _ = q.shape
        return q.new_empty((batch, seqlen_q, nheads, v.shape[-1])), q.new_empty(
            (batch, nheads, seqlen_q), dtype=torch.float32
        )

    @torch.library.register_fake("flash_attn_hopper::bwd")
    def _bwd_fake(dout, q, k, v, out, lse, dlse, softmax_scale, causal, window_left, window_right, softcap,
                  deterministic, doc_bounds=None):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    @torch.library.register_fake("flash_attn_hopper::fwd_varlen")
    def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args):
        total_q, nheads, _ = q.shape
        return q.new_empty((total_q, nheads, v.shape[-1])), q.new_empty((nheads, total_q), dtype=torch.float32)

    @torch.library.register_fake("flash_attn_hopper::bwd_varlen")
    def _bwd_varlen_fake(dout, q, k, v, out, lse, dlse, *args):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


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
