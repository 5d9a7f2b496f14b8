"""Loads the compiled extension, which registers ``torch.ops.flash_attn_hopper.*`` through TORCH_LIBRARY.

The shared object has no Python module init (it is built with the limited API and holds no pybind code),
so it is loaded with ``torch.ops.load_library`` rather than imported.
"""

import functools
import glob
import math
import mmap
import os
import struct
import warnings

import torch

_NAMESPACE = "flash_attn_hopper"
_LIB_DIR = os.path.dirname(os.path.abspath(__file__))
_load_error = None
LIBRARY_PATH = None  # the loaded extension's file


def _namespace_defined():
    """Whether some library already defined ops of the namespace in this process. Registry lookups only (they load
    nothing); a schema counts, a kernel registered without one does not."""
    names = {"fwd"}  # every build defines fwd; the listing adds ops another version of the library may define
    names.update(n.split("::", 1)[1].split(".")[0] for n in getattr(torch._C, "_dispatch_get_all_op_names", list)()
                 if n.startswith(_NAMESPACE + "::"))
    namespace = getattr(torch.ops, _NAMESPACE)
    return any(hasattr(namespace, name) for name in names)


def _mentions_namespace(path):
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(_NAMESPACE.encode()) >= 0
    except (OSError, ValueError):
        return False


def _files_defining_namespace(file_name):
    """The loaded files that define the namespace: those torch.ops.load_library loaded and, for a copy loaded another
    way (ctypes), mapped files named `file_name` (Linux); each holding the namespace's name."""
    paths = set(torch.ops.loaded_libraries)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and os.path.basename(fields[5].rstrip("\n")) == file_name:
                    paths.add(fields[5].rstrip("\n"))
    except OSError:
        pass
    return sorted(p for p in paths if _mentions_namespace(p))


def _same_file(a, b):
    # the path too: a file rebuilt in place since it was loaded is a new inode at the same path
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _load_hint(reason):
    """What to do about the dynamic loader's reason for refusing the extension."""
    if any(f"{lib}_" in reason for lib in ("GLIBC", "GLIBCXX", "CXXABI")):
        # "version `GLIBC_2.38' not found", "symbol ... version GLIBCXX_3.4.29 not defined in file libstdc++.so.6":
        # the build machine's C or C++ runtime is newer than this one's
        return ("a version of GLIBC, GLIBCXX or CXXABI not found means it was built on a system with a newer C or C++ "
                "runtime than this one (a build runs only where glibc and libstdc++ are at least as new as where it "
                "was built): build it on this machine (`pip install --no-build-isolation .`)")
    if "undefined symbol" in reason:
        return ("an undefined symbol means it was built against another torch version than this one: rebuild it with "
                "this torch (`pip install --no-build-isolation .`)")
    return "rebuild it with this torch (`pip install --no-build-isolation .`) if it was built against another one"


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
    if _namespace_defined():
        # A second copy's TORCH_LIBRARY would abort the interpreter (a C++ error no try/except catches), so load
        # nothing: a reload of this module, or this file reached through a link, reuses the ops already there.
        loaded = _files_defining_namespace(os.path.basename(candidates[0]))
        if any(_same_file(candidates[0], path) for path in loaded):
            LIBRARY_PATH = candidates[0]
            return True
        other = " and ".join(loaded) or "a file not loaded through torch.ops.load_library"
        _load_error = (
            f"the flash_attn_hopper CUDA extension {candidates[0]} was not loaded: another copy of it, {other}, "
            "already defined the torch.ops.flash_attn_hopper ops in this process, and loading a second one would "
            "abort the interpreter (PyTorch allows one TORCH_LIBRARY per namespace). Use one copy per process: "
            "uninstall or remove the other (a vendored copy, or a source tree with a build on sys.path beside an "
            "installed wheel), or import the copy that loaded first"
        )
        return False
    try:
        torch.ops.load_library(candidates[0])
    except OSError as e:
        # torch's OSError hides the loader's own message (an undefined symbol, a missing libcudart) in its cause
        cause = e.__cause__ or e.__context__
        reason = f"{e}: {cause}" if cause is not None and str(cause) not in str(e) else str(e)
        _load_error = (
            f"the flash_attn_hopper CUDA extension could not be loaded from {candidates[0]} ({reason}). This process "
            f"runs torch {torch.__version__} (CUDA {torch.version.cuda}); {_load_hint(reason)}."
        )
        return False
    LIBRARY_PATH = candidates[0]
    return True


EXTENSION_LOADED = _load()


def _register_python_kernels():
    """Fake (meta) kernels of the C++ ops, so torch.compile traces them as graph nodes. Their autograd formulas are
    registered in C++ (csrc/api/flash_api.cpp, the Autograd kernels of fwd and fwd_varlen): the forward saves q, k, v,
    out, lse (and fwd's doc_bounds); its backward is the FlashAttention-3 backward op (paper §2.1); lse is differentiable (its gradient
    dLSE enters the backward op, where dS gains P ∘ dLSE).

    allow_override: a reload of this module (importlib.reload, Jupyter's autoreload) or a second module over the same
    file registers them again, replacing the earlier ones (torch 2.11 raises without it; 2.14 defaults to it)."""
    register_fake = functools.partial(torch.library.register_fake, allow_override=True)

    @register_fake("flash_attn_hopper::fwd")
    def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic, doc_bounds=None):
        _check_fake_inputs(4, q, k, v, softmax_scale, causal, window_left, window_right, softcap)
        batch, seqlen_q, nheads, _ = q.shape
        return q.new_empty((batch, seqlen_q, nheads, v.shape[-1])), q.new_empty(
            (batch, nheads, seqlen_q), dtype=torch.float32
        )

    @register_fake("flash_attn_hopper::bwd")
    def _bwd_fake(dout, q, k, v, out, lse, dlse, softmax_scale, causal, window_left, window_right, softcap,
                  deterministic, doc_bounds=None):
        _check_fake_inputs(4, q, k, v, softmax_scale, causal, window_left, window_right, softcap, out, dout, lse, dlse)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    @register_fake("flash_attn_hopper::fwd_varlen")
    def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args):
        _check_fake_inputs(3, q, k, v, *args[:5])
        _check_fake_varlen(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        total_q, nheads, _ = q.shape
        return q.new_empty((total_q, nheads, v.shape[-1])), q.new_empty((nheads, total_q), dtype=torch.float32)

    @register_fake("flash_attn_hopper::bwd_varlen")
    def _bwd_varlen_fake(dout, q, k, v, out, lse, dlse, *args):
        _check_fake_inputs(3, q, k, v, *args[4:9], out, dout, lse, dlse)
        _check_fake_varlen(q, *args[:4])
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _check_fake_varlen(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The varlen ops' own checks (csrc/api/flash_api.cpp: check_varlen), with their messages, for the fake kernels
    (a direct op call on meta tensors accepted float32 or 2-D cu_seqlens and a negative max_seqlen). Values without a
    known size (symbolic under torch.compile) are left to the real op."""
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        ok = t.dtype == torch.int32 and t.device == q.device and t.dim() == 1
        if ok and isinstance(t.numel(), int) and isinstance(t.stride(0), int):
            ok = t.numel() >= 1 and (t.numel() == 1 or t.stride(0) == 1)
        if not ok:
            raise RuntimeError(f"{name} must be a contiguous 1-D int32 tensor of length batch + 1 on q's device")
    lengths = (cu_seqlens_q.numel(), cu_seqlens_k.numel())
    if all(isinstance(n, int) for n in lengths) and lengths[0] != lengths[1]:
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must have the same length")
    if isinstance(lengths[0], int) and lengths[0] - 1 > 65535:
        raise RuntimeError("at most 65535 sequences")
    maxima = (max_seqlen_q, max_seqlen_k)
    if all(isinstance(m, int) for m in maxima) and not all(0 <= m < 2**31 for m in maxima):
        raise RuntimeError("max_seqlen_q and max_seqlen_k must be in [0, 2^31)")


_LOG2E = 1.4426950408889634  # M_LOG2E


def _float32(x):
    """x rounded to float32 (inf past its range), as the C++ ops' float(x)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _normal32(x):
    return math.isfinite(x) and abs(x) >= 2.0 ** -126


def _check_float32_scales(softmax_scale, softcap):
    """The C++ ops' float32 checks of the scales (csrc/api/flash_api.cpp), for the fake kernels: a direct op call under
    torch.compile, make_fx or on meta tensors with a scale that is finite but no normal float32 passed the trace, to
    fail only when the real op ran. (``attention`` refuses these earlier, with a ValueError.)"""
    scale32 = _float32(softmax_scale)
    if not (_normal32(scale32) and scale32 > 0 and _normal32(_float32(scale32 * _LOG2E))):
        raise RuntimeError("softmax_scale must be a positive normal float32 value, also times log2(e), got "
                           f"{softmax_scale}")
    if softcap != 0 and not _normal32(_float32(softmax_scale / softcap)):
        raise RuntimeError("softmax_scale / softcap must be a normal float32 value")
    exp_scale = softcap if softcap > 0 else softmax_scale
    exp_scale_log2 = _float32(_float32(exp_scale) * _LOG2E)
    if not (_normal32(exp_scale_log2) and exp_scale_log2 > 0):
        raise RuntimeError(f"{'softcap' if softcap > 0 else 'softmax_scale'} times log2(e) must be a positive normal "
                           f"float32 value, got {exp_scale}")


def _check_fake_inputs(rank, q, k, v, softmax_scale, causal, window_left, window_right, softcap, out=None, dout=None,
                       lse=None, dlse=None):
    """The C++ ops' checks (csrc/api/flash_api.cpp: check_attention_inputs, check_qkv, check_score_options) that the
    output shapes and dtypes rest on, with their messages and error type (RuntimeError), for the fake kernels: meta and
    fake tensors never reach the C++ checks, so direct op calls on them (FLOP counting, shape tracing) accepted float32
    inputs or head_dim 60, and a q of the wrong rank failed inside the shape unpacking. Sizes and scalars without a
    value (symbolic under torch.compile) are left to the real op; the Python functions check everything before that.
    The backward's lse and dlse as the C++ ops check them (sizes, layout, dtype, device)."""
    from .interface import SUPPORTED_DTYPES, kernel_head_dim  # the library's one statement of these rules

    def known(*sizes):
        return all(isinstance(x, int) for x in sizes)

    named = [("q", q), ("k", k), ("v", v)] + [(n, t) for n, t in (("out", out), ("dout", dout)) if t is not None]
    if rank == 3 and any(t.dim() != 3 for _, t in named):  # the varlen ops check ranks first
        raise RuntimeError(f"{', '.join(n for n, _ in named)} must have rank 3 (total_tokens, nheads, head_dim) for "
                           "variable-length attention")
    if q.dtype not in SUPPORTED_DTYPES:
        raise RuntimeError("q must be float16 or bfloat16")
    for name, t in named:
        if t.dtype != q.dtype:
            raise RuntimeError(f"{name} must have the dtype of q")
        if t.dim() != rank:
            raise RuntimeError(f"{name} must have rank 4 (batch, seqlen, nheads, head_dim)")
        if rank == 4 and known(t.shape[0], q.shape[0]) and t.shape[0] != q.shape[0]:
            raise RuntimeError(f"{name} must match q in batch")
        if name == "k" and known(k.shape[-1], q.shape[-1]) and k.shape[-1] != q.shape[-1]:
            raise RuntimeError(f"k must have head_dim {q.shape[-1]}, got {k.shape[-1]}")

    nheads, head_dim, nheads_k, head_dim_v = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    if known(v.shape[-2], nheads_k) and v.shape[-2] != nheads_k:
        raise RuntimeError("k and v must have the same nheads_k")
    if known(nheads, nheads_k) and (nheads != 0 if nheads_k == 0 else nheads % nheads_k != 0):
        raise RuntimeError(f"q's nheads must be a multiple of k's and v's nheads_k, got {nheads} and {nheads_k}")
    if known(k.shape[-3], v.shape[-3]) and k.shape[-3] != v.shape[-3]:
        raise RuntimeError("k and v must have the same seqlen_k")
    for name, d in (("head_dim", head_dim), ("v's head_dim", head_dim_v)):
        if known(d) and kernel_head_dim(d) is None:
            raise RuntimeError(f"{name} must be a multiple of 8 in [8, 256], got {d}")
    if isinstance(softmax_scale, (int, float)) and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise RuntimeError("softmax_scale must be finite and > 0")
    if known(window_left, window_right):
        if window_left < -1 or window_right < -1:
            raise RuntimeError(f"window_size entries must be >= -1 (-1: unbounded), got ({window_left}, "
                               f"{window_right})")
        if causal is True and window_right > 0:
            raise RuntimeError(f"causal=True fixes the window's right side at 0, got window_size ({window_left}, "
                               f"{window_right})")
    if isinstance(softcap, (int, float)) and not (math.isfinite(softcap) and softcap >= 0):
        raise RuntimeError(f"softcap must be finite and >= 0, got {softcap}")
    if isinstance(softmax_scale, (int, float)) and isinstance(softcap, (int, float)):
        _check_float32_scales(float(softmax_scale), float(softcap))
    if out is not None and known(*out.shape, *dout.shape) and tuple(out.shape) != tuple(dout.shape):
        shape = "(batch, seqlen_q, nheads, head_dim_v)" if rank == 4 else "(total_q, nheads, head_dim_v)"
        raise RuntimeError(f"out and dout must be {shape}: q's shape with v's head_dim")
    if lse is not None:
        # The sizes and layout too, as the C++ ops (a direct backward call, e.g. ring attention's, handed an LSE of
        # another seqlen or a transposed one passed the fake kernel, to fail only when the real op ran).
        expected = (q.shape[0], q.shape[2], q.shape[1]) if rank == 4 else (q.shape[1], q.shape[0])
        wrong = lse.dtype != torch.float32 or lse.dim() != rank - 1
        if not wrong and known(*lse.shape, *expected) and tuple(lse.shape) != tuple(expected):
            wrong = True
        if not wrong and known(*lse.shape, *lse.stride()) and not lse.is_contiguous():
            wrong = True
        if wrong:
            shape = "(batch, nheads, seqlen_q)" if rank == 4 else "(nheads, total_q)"
            raise RuntimeError(f"lse must be the contiguous float32 {shape} tensor of the forward")
    if dlse is not None:
        same_shape = dlse.dim() == lse.dim() and (not known(*dlse.shape, *lse.shape)
                                                  or tuple(dlse.shape) == tuple(lse.shape))
        if dlse.device != q.device or dlse.dtype != torch.float32 or not same_shape:
            raise RuntimeError("dlse must be a float32 tensor of lse's shape on q's device")


# help() texts of the ops, whose C++ schemas carry none (a first-time user found `__doc__` None). The Python functions
# (interface.attention, attention_varlen) are the API; these are what they call.
_COMMON = """
    softmax_scale (float): multiplies Q Kᵀ; finite, > 0, a normal float32 value (also times log2(e)).
    causal (bool): the window's right side is 0 (bottom-right aligned).
    window_left, window_right (int): -1 unbounded, else >= 0 (DESIGN.md §2).
    softcap (float): 0 off, else c > 0: the scaled scores x become c * tanh(x / c) before the softmax.
    deterministic (bool): the backward adds dQ (and GQA dK/dV sums) in a fixed order.
    Raises RuntimeError (not the Python functions' ValueError / TypeError) for inputs the kernels cannot take: a
    dtype other than fp16 / bf16, mismatched ranks, shapes, dtypes or devices, a head_dim that is not a multiple of 8
    in [8, 256] or not built, nheads not a multiple of nheads_k, bad scale / window / softcap values; on meta and fake
    tensors the same checks run where the values are known. CUDA tensors only: CPU tensors raise a RuntimeError
    naming the op and the tensor.
    Math: FlashAttention-3 paper (Shah et al., 2024), §3.1-3.2 (forward, Algorithms 1-2), Appendix B.1
    (backward, Algorithm 3) and §2.1 (gradients)."""
_OP_DOCS = {
    "fwd": """fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic, doc_bounds=None)
    -> (out, lse)

    Dense attention forward. q: (batch, seqlen_q, nheads, head_dim); k: (batch, seqlen_k, nheads_k, head_dim);
    v: (batch, seqlen_k, nheads_k, head_dim_v); fp16 or bf16, on one sm90 GPU (copied where TMA cannot read the
    strides). doc_bounds: None, or a contiguous int32 (batch, seqlen, 2) tensor holding, per position, the first
    position of its document and one past the last (self-attention; interface.document_bounds makes it). Its
    values are trusted: other values give unspecified results, never a read out of bounds or a hang (the
    deterministic backward reads the runs of equal pairs: doc_bounds_partition).
    Returns out (batch, seqlen_q, nheads, head_dim_v) in q's dtype and lse (batch, nheads, seqlen_q) float32, the
    natural-log log-sum-exp of each row of scaled scores (-inf and a zero out row for a row that sees no key)."""
    + _COMMON,
    "bwd": """bwd(dout, q, k, v, out, lse, dlse, softmax_scale, causal, window_left, window_right, softcap,
    deterministic, doc_bounds=None) -> (dq, dk, dv)

    Dense attention backward. dout, out: (batch, seqlen_q, nheads, head_dim_v) in q's dtype; q, k, v as for fwd;
    lse: fwd's float32 (batch, nheads, seqlen_q); dlse: None or the float32 gradient of lse (same shape: dS gains
    P ∘ dLSE). The other arguments must be fwd's (deterministic=True reads doc_bounds as doc_bounds_partition of
    them). Returns dq, dk, dv shaped and typed as q, k, v (GQA: dk, dv summed over each group's query heads)."""
    + _COMMON,
    "fwd_varlen": """fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
    window_left, window_right, softcap, deterministic) -> (out, lse)

    Variable-length forward over packed tokens. q: (total_q, nheads, head_dim); k: (total_k, nheads_k, head_dim);
    v: (total_k, nheads_k, head_dim_v); cu_seqlens_q / cu_seqlens_k: int32 (batch + 1,) row offsets on q's device;
    max_seqlen_q / max_seqlen_k: upper bounds of the lengths. The values of cu_seqlens are trusted (clamped to the
    tensors' rows in the kernels, not checked: attention_varlen checks them). Returns out (total_q, nheads,
    head_dim_v) and lse (nheads, total_q) float32; rows outside every sequence get out 0 and lse -inf."""
    + _COMMON,
    "bwd_varlen": """bwd_varlen(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    softmax_scale, causal, window_left, window_right, softcap, deterministic) -> (dq, dk, dv)

    Variable-length backward: the arguments of fwd_varlen plus dout, out (total_q, nheads, head_dim_v), lse
    (nheads, total_q) and dlse (None or lse's shape, float32). Returns dq, dk, dv shaped and typed as q, k, v; rows
    outside every sequence get zero gradients."""
    + _COMMON,
    "build_config": """build_config() -> str

    The head dims and dtypes this build compiled, as "head_dims=64,...;dtypes=fp16,bf16,"
    (flash_attn_hopper.build_config() parses it).""",
    "fwd_block_m": """fwd_block_m(head_dim, head_dim_v, batch, nheads, seqlen_q, seqlen_k, causal, window_left,
    window_right, num_sms) -> int

    The forward's tile height (query rows per CTA tile: 128 or 192 at head_dim 64, else 128) that the launcher picks
    for this problem on a GPU with num_sms SMs (FAH_FWD_BLOCK_M forces it). Arguments as fwd's; raises RuntimeError
    for values the forward would refuse.""",
    "doc_bounds_partition": """doc_bounds_partition(doc_bounds) -> Tensor

    doc_bounds (int32 (batch, seqlen, 2), any device, any layout) read as the runs of equal consecutive
    [doc_start, doc_end] pairs of each row: a new contiguous int32 tensor holding each position's run. The identity
    on bounds made from document ids (interface.document_bounds); the deterministic backward (bwd) reads its bounds
    this way, so that bounds which are no partition cannot make it wait for a turn that never comes. Raises
    RuntimeError for another dtype or shape.""",
}


def _document_ops():
    namespace = getattr(torch.ops, _NAMESPACE)
    for name, doc in _OP_DOCS.items():
        if hasattr(namespace, name):
            packet = getattr(namespace, name)
            packet.__doc__ = doc
            packet.default.__doc__ = doc


if EXTENSION_LOADED:
    _register_python_kernels()
    _document_ops()


# ------------------------------------------------------------------------------------------ FLOP counting
# torch.utils.flop_counter.FlopCounterMode counts an op only through a formula in its registry, and counted these ops
# as 0 FLOPs without one (MFU tooling built on it left attention out). The formulas count as PyTorch's own for
# scaled_dot_product_attention do: 2 FLOPs per multiply-add of the matmuls over the whole (seqlen_q x seqlen_k) score
# matrix of every query head (masks, windows and documents not subtracted; the backward's five matmuls, the recomputed
# Q Kᵀ included); varlen per sequence (sum of seqlen_q x seqlen_k over the sequences: read from cu_seqlens on the host
# while counting, or max_seqlen_q x max_seqlen_k per sequence for tensors without values, as PyTorch does for its
# varlen flash ops).

def _dense_flops(q, k, v, backward):
    batch, seqlen_q, nheads, head_dim = q.shape
    per_score = 3 * head_dim + 2 * v.shape[-1] if backward else head_dim + v.shape[-1]
    return 2 * batch * nheads * seqlen_q * k.shape[1] * per_score


def _sequence_lengths(cu, max_len):
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    if isinstance(cu, (FakeTensor, FunctionalTensor)) or cu.device.type == "meta" or type(cu) is not torch.Tensor:
        return [max_len] * (cu.shape[0] - 1)
    return cu.diff().tolist()


def _varlen_flops(q, k, v, cu_q, cu_k, max_q, max_k, backward):
    nheads, head_dim = q.shape[1], q.shape[2]
    per_score = 3 * head_dim + 2 * v.shape[-1] if backward else head_dim + v.shape[-1]
    scores = sum(a * b for a, b in zip(_sequence_lengths(cu_q, max_q), _sequence_lengths(cu_k, max_k)))
    return 2 * nheads * scores * per_score


def _fwd_flops(q, k, v, *args, out_val=None, **kwargs):
    return _dense_flops(q, k, v, backward=False)


def _bwd_flops(dout, q, k, v, *args, out_val=None, **kwargs):
    return _dense_flops(q, k, v, backward=True)


def _fwd_varlen_flops(q, k, v, cu_q, cu_k, max_q, max_k, *args, out_val=None, **kwargs):
    return _varlen_flops(q, k, v, cu_q, cu_k, max_q, max_k, backward=False)


def _bwd_varlen_flops(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, *args, out_val=None, **kwargs):
    return _varlen_flops(q, k, v, cu_q, cu_k, max_q, max_k, backward=True)


_FLOP_FORMULAS = {"fwd": _fwd_flops, "bwd": _bwd_flops, "fwd_varlen": _fwd_varlen_flops,
                  "bwd_varlen": _bwd_varlen_flops}


def _register_flop_formulas(flop_counter):
    """Adds the formulas to torch.utils.flop_counter's registry (replacing this module's earlier ones on a reload)."""
    namespace = getattr(torch.ops, _NAMESPACE)
    for name, formula in _FLOP_FORMULAS.items():
        packet = getattr(namespace, name)
        flop_counter.flop_registry.pop(packet, None)
        flop_counter.register_flop_formula(packet, get_raw=True)(formula)


class _RegisterWhenImported:
    """A sys.meta_path entry that registers the formulas once torch.utils.flop_counter is imported (importing it here
    would bring in triton on every import of the library: ~50 ms); FlopCounterMode copies the registry when made, and
    its module must be imported before that."""

    NAME = "torch.utils.flop_counter"

    def find_spec(self, name, path=None, target=None):
        if name != self.NAME:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, self_name = spec.loader, self.NAME

        class _Loader:
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                try:
                    _register_flop_formulas(module)
                except Exception as e:  # never let the counting break the import of PyTorch's module
                    warnings.warn(f"flash_attn_hopper: its FLOP formulas were not registered with {self_name}: {e}")

            def __getattr__(self, attr):  # get_source, get_filename, is_package, ...: the path loader's own
                return getattr(loader, attr)

        spec.loader = _Loader()
        return spec


def _install_flop_formulas():
    import sys

    module = sys.modules.get(_RegisterWhenImported.NAME)
    if module is not None and hasattr(module, "register_flop_formula"):
        _register_flop_formulas(module)
        return
    if not any(type(f).__name__ == _RegisterWhenImported.__name__ for f in sys.meta_path):  # once per process
        sys.meta_path.insert(0, _RegisterWhenImported())


if EXTENSION_LOADED:
    _install_flop_formulas()


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
    """The head dims and dtypes compiled into the extension (the build's FAH_HDIMS / FAH_DTYPES).

    Returns ``{"head_dims": [...], "dtypes": [...]}``: the kernel head dims as ints (a full build: ``[64, 96, 128,
    192, 256]``) and the dtypes as ``torch.dtype`` (``torch.float16``, ``torch.bfloat16``). Raises RuntimeError, with
    the loader's reason, when the compiled extension is unavailable (the README's install check relies on it)."""
    require_extension()
    head_dims, dtypes = _compiled()
    return {"head_dims": list(head_dims), "dtypes": list(dtypes)}
