"""Public entry points of flash_attn_hopper."""

import math
import numbers
import sys
import warnings
import weakref

import torch

from . import _ops

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Tile widths of the compiled kernels. Any head_dim that is a multiple of 8 up to 256 runs on the smallest of them that
# holds it (kernel_head_dim); the padded columns are zeros on load and never stored. v's head_dim may differ from q's
# and k's: the kernel is then the one of the larger. The backward has fewer widths (96 and 192 run on 128 and 256).
SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
BACKWARD_HEAD_DIMS = (64, 128, 256)
_HEAD_DIM_MULTIPLE = 8  # 16-byte rows (fp16/bf16), what TMA needs
_MAX_GRID_YZ = 65535  # batch and nheads index grid dimensions y and z
_FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32
_FLOAT32_MAX = 3.4028234663852886e38
_INT32_MAX = 2**31 - 1
_MAX_SEQLEN = 2**30 - 256  # rows per tensor: the kernels' mask sums (seqlen_q + seqlen_k + 2 tiles) fit int32
_FWD_TILE_ROWS = 128  # the forward's smallest tile height (flash/config.hpp): the most tiles a launch can have
# The persistent forward (one CTA per SM) hands out its next tile as atomicAdd(counter) + gridDim.x
# (flash/fwd/kernel_fwd_sm90.hpp), which reaches tiles - 1 + gridDim.x: before session 41 that int32 sum wrapped
# negative past INT32_MAX and, by the code, such a CTA hung (its consumers stopped at a negative tile, its producer
# went on). The kernel now compares before the sum; this limit keeps room for 1024 CTAs (an H100/H200 has 132 SMs)
# all the same: at most 2^31 - 1025 tiles, a limit no GPU run has had to test at the boundary.
_FWD_PERSISTENT_CTAS_MAX = 1024
_MAX_FWD_TILES = _INT32_MAX - _FWD_PERSISTENT_CTAS_MAX


def kernel_head_dim(head_dim, backward=False):
    """The compiled kernel size that runs ``head_dim`` in the forward (the smallest of SUPPORTED_HEAD_DIMS >=
    head_dim) or, with backward=True, in the backward (of BACKWARD_HEAD_DIMS); None when no kernel does (head_dim not
    a multiple of 8 in [8, 256])."""
    if head_dim <= 0 or head_dim % _HEAD_DIM_MULTIPLE != 0:
        return None
    return next((d for d in (BACKWARD_HEAD_DIMS if backward else SUPPORTED_HEAD_DIMS) if head_dim <= d), None)


def _check_strided(name, t):
    """Nested (jagged or strided) and sparse tensors are refused by name: the kernels read plain strided memory, and
    such tensors otherwise fail deep inside torch with messages that name nothing. A torch.masked.MaskedTensor is
    refused too: the kernels would not apply its mask, and its dispatch failed naming only the op (with a warning).
    So is a DTensor: the ops have no sharding rule."""
    masked = sys.modules.get("torch.masked.maskedtensor.core")  # (loaded by `import torch`; no import here)
    if masked is not None and isinstance(t, masked.MaskedTensor):
        raise TypeError(
            f"{name} is a torch.masked.MaskedTensor; its mask would not be applied: pass a plain tensor and express "
            "the mask with causal, window_size, document_ids or attention_varlen's cu_seqlens"
        )
    # A DTensor (tensor parallelism, distribute_module) reached the op's dispatch, which failed with "Operator
    # flash_attn_hopper.fwd.default does not have a sharding strategy registered", naming neither argument nor remedy.
    dtensor = sys.modules.get("torch.distributed.tensor._api")  # (loaded only where DTensors exist; no import here)
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        raise TypeError(
            f"{name} is a DTensor (placements {tuple(t.placements)}); the library's ops have no sharding rule: pass "
            f"plain tensors, {name}.to_local() where each rank's attention needs only its own shard (e.g. heads "
            f"sharded for tensor parallelism), else {name}.full_tensor()"
        )
    if t.is_nested:
        raise TypeError(
            f"{name} is a nested tensor; pass a plain (torch.strided) tensor, e.g. pack variable-length sequences for "
            "attention_varlen with cu_seqlens"
        )
    if t.layout != torch.strided:
        raise TypeError(
            f"{name} has layout {t.layout}; only dense torch.strided tensors are supported (call .to_dense())"
        )


def _check_shapes_agree(q, k, v, varlen=False):
    """How q, k and v of rank 4 must agree (batch; seqlen_k; nheads_k, which divides nheads; head_dim of q and k),
    ValueError naming the argument; also the rule of flash_attn_hopper.testing's references. varlen: rank-3 tensors
    seen as one batch element, whose keys are counted in rows (total_k), not seqlen_k."""
    batch, _, nheads, head_dim = q.shape
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != batch:
            raise ValueError(f"{name} has batch {t.shape[0]} but q has batch {batch}")
    if k.shape[1] != v.shape[1]:
        what = "number of rows (total_k)" if varlen else "seqlen_k"
        raise ValueError(f"k and v must have the same {what}, got k {k.shape[1]} and v {v.shape[1]}")
    nheads_k = k.shape[2]
    if v.shape[2] != nheads_k:
        raise ValueError(f"v has {v.shape[2]} heads but k has {nheads_k}; k and v must have the same nheads_k")
    if nheads_k == 0 and nheads != 0 or nheads_k != 0 and nheads % nheads_k != 0:
        raise ValueError(
            f"k has {nheads_k} heads but q has {nheads}; q's nheads must be a multiple of k's and v's nheads_k "
            "(equal for multi-head attention, smaller for grouped-query / multi-query attention)"
        )
    if k.shape[3] != head_dim:
        raise ValueError(f"k has head_dim {k.shape[3]} but q has head_dim {head_dim}")


def _check_same_dtype(q, k, v):
    """TypeError unless q, k and v share one dtype (also the rule of flash_attn_hopper.testing's references)."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")


def _check_tensor_args(q, k, v, varlen=False):
    """Shape/dtype/stride checks that need no GPU. Raises TypeError or ValueError naming the argument (varlen: see
    _check_shapes_agree)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        _check_strided(name, t)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            hint = (" (cast with .to(torch.bfloat16), or compute q, k, v under torch.autocast)"
                    if t.is_floating_point() else "")
            raise TypeError(f"{name} has dtype {t.dtype}; supported dtypes are torch.float16 and torch.bfloat16{hint}")
    _check_same_dtype(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have rank 4 (batch, seqlen, nheads, head_dim), got rank {t.dim()} with shape {tuple(t.shape)}"
            )
    _check_shapes_agree(q, k, v, varlen)
    batch, _, nheads, head_dim = q.shape
    for what, value in (("batch", batch), ("nheads", nheads)):
        if _over(value, _MAX_GRID_YZ):
            raise ValueError(f"q has {what} {value}; at most {_MAX_GRID_YZ} is supported (CUDA grid limit)")
    for name, t in (("q", q), ("k", k)):
        if _over(t.shape[1], _MAX_SEQLEN - 1):
            raise ValueError(f"{name} has {t.shape[1]} rows (seqlen or total tokens); at most {_MAX_SEQLEN - 1} are supported")
    # v's head_dim (that of out) may differ from q's and k's (e.g. 192 / 128 in DeepSeek-style models).
    for name, d in (("q", head_dim), ("v", v.shape[3])):
        if kernel_head_dim(d) is None:
            raise ValueError(
                f"{name} has head_dim {d}; supported head_dim values are the multiples of {_HEAD_DIM_MULTIPLE} from "
                f"{_HEAD_DIM_MULTIPLE} to {SUPPORTED_HEAD_DIMS[-1]}"
            )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have stride 1 in its last dimension (head_dim), got stride {t.stride(-1)}; "
                f"call {name}.contiguous() first"
            )


def _check_fwd_tiles(batch, nheads, seqlen_q, names, launches=True):
    """The forward numbers its tiles (query row blocks x heads x batch) with int32, and its persistent launch counts up
    to one tile per CTA past the last (_MAX_FWD_TILES): refuse a launch past that by name (the launcher fails with a
    bare "invalid argument" past 2^31 - 1 tiles; before session 41 the persistent kernel's tile numbers wrapped
    within 132 of it).
    Reached only by huge grids, e.g. seqlen_q 1 with batch x nheads near 2^31, or thousands of varlen sequences under
    a long max_seqlen_q or with tens of thousands of heads. seqlen_q: the rows the launcher covers per sequence;
    launches=False (no keys: the op fills the outputs without a launch) passes."""
    tiles = (seqlen_q + _FWD_TILE_ROWS - 1) // _FWD_TILE_ROWS * nheads * batch  # (>= 0; no negation, see below)
    if launches and tiles > _MAX_FWD_TILES:
        raise ValueError(
            f"{names[0]} ({batch}) x {names[1]} ({nheads}) x ceil({names[2]} ({seqlen_q}) / {_FWD_TILE_ROWS}) = "
            f"{tiles} forward tiles; at most 2^31 - 1025 are supported (int32 tile numbers with room for one per SM "
            "past the last): split the call"
        )


def _over(size, limit):
    """Whether a size is past a limit of the library (size > limit). Under torch.compile a size may be unbacked
    (data-dependent: rows picked by a mask inside the compiled code, or marked with
    torch._dynamo.decorators.mark_unbacked), so
    that the comparison has no answer at trace time (a Python `if` on it stopped the trace with "Could not guard on
    data-dependent expression", naming nothing of the library): it then becomes a runtime assertion of the graph
    (torch._check: a RuntimeError when the graph runs, before the op) and this returns False. Outside torch.compile,
    and for comparisons the trace can decide, it returns the comparison."""
    if torch.compiler.is_compiling() and not _guard_or_false(size > limit) and not _guard_or_false(size <= limit):
        torch._check(size <= limit, lambda: (  # (torch.compile takes the message only from a local function)
            "flash_attn_hopper: a size is past the library's limits (batch and nheads at most 65535, fewer than "
            "2^30 - 256 rows in q and k)"))
        return False
    return size > limit


def _traced_check(cond, message):
    """torch._check(cond, message) under torch.compile where cond depends on a value from data; a condition the trace
    can decide is decided here instead (False: ValueError(message())). Why: dynamo keeps torch._check's message
    function as an attribute of the graph even when the condition is a constant, and torch 2.11's
    torch.compiler.nested_compile_region cannot compare two graphs that hold one (InternalTorchDynamoError:
    "NotImplementedError: get_attr with <class 'function'>"; round 39, GZ). A condition on a value from data (.item()
    in the compiled code) inside such a region still meets that limit."""
    if _guard_or_false(cond):  # true, or known true by the hints (with a guard)
        return
    if not torch.fx.experimental.symbolic_shapes.guard_or_true(cond):
        raise ValueError(message())  # decided false
    torch._check(cond, message)  # a value from data: the graph's runtime assertion


def _guard_or_false(cond):
    """torch.fx.experimental.symbolic_shapes.guard_or_false, reached only under torch.compile (which has loaded that
    module; a plain import of the library does not, it brings in sympy): a condition on a value the trace does not
    have (a maximum computed from data) is False instead of an error."""
    return torch.fx.experimental.symbolic_shapes.guard_or_false(cond)


def _check_fwd_tiles_compiling(batch, nheads, seqlen_q, rows_k, max_seqlen_k, names):
    """_check_fwd_tiles under torch.compile, where a maximum may come from data (.item() in the compiled code, see
    _check_max_seqlen), or a size be unbacked (``attention``: rows picked by a mask, see _over), and a Python
    comparison on it would need its value at trace time. What the trace can decide raises the ValueError as in eager;
    the rest becomes a runtime assertion of the graph (with the tile count unknown too, a launch is assumed: a call
    past the limit with no keys is refused at run time).
    seqlen_q: the rows per sequence, or a tuple of bounds on them whose smallest the launcher covers (varlen:
    max_seqlen_q and q's rows). Each bound is compared alone, never their min: a guard on min(max_seqlen_q, q's rows)
    came back from torch 2.11's FX graph cache as `max_q < q.size()[0]`, a recompile for the first call whose maximum
    reached the rows (one sequence), which a cold compile did not make. The guard is now on max_seqlen_q's tile count
    alone, so a loose bound past about 2^31 x 128 / (sequences x nheads) recompiles once (a guard on the rows instead
    would recompile ordinary packed batches)."""
    if _guard_or_false(rows_k == 0) or _guard_or_false(max_seqlen_k == 0):
        return  # no launch
    bounds = seqlen_q if isinstance(seqlen_q, tuple) else (seqlen_q,)
    # the launch's count is the smallest; a ceiling without negation: torch 2.14's nested_compile_region reuse could
    # not bind the expression -s of a symbolic size (dynamo's KeyError "-s52"; the bounds are >= 0)
    tiles = [(b + _FWD_TILE_ROWS - 1) // _FWD_TILE_ROWS * nheads * batch for b in bounds]
    message = lambda: (  # noqa: E731 (torch.compile takes the message of torch._check only from a local function)
        "flash_attn_hopper: more than 2^31 - 1025 forward tiles (batch or sequences x nheads x query row blocks; "
        "int32 tile numbers): split the call")
    if all(_guard_or_false(t > _MAX_FWD_TILES) for t in tiles):
        if _guard_or_false(rows_k > 0) and _guard_or_false(max_seqlen_k > 0):
            _check_fwd_tiles(batch, nheads, min(bounds), names)  # raises
        _traced_check(min(rows_k, max_seqlen_k) <= 0, message)  # then only a call without keys passes
    elif not any(_guard_or_false(t <= _MAX_FWD_TILES) for t in tiles):
        _traced_check(min(tiles) <= _MAX_FWD_TILES, message)


def _check_devices(named_devices):
    """named_devices: [(name, torch.device)]. Raises ValueError unless all are the same CUDA device."""
    for name, dev in named_devices:
        if dev.type != "cuda":
            raise ValueError(
                f"{name} is on device '{dev}'; flash_attn_hopper needs tensors on a CUDA device (an sm90 GPU: "
                "H100, H200, H800, GH200)"
            )
    first_name, first = named_devices[0]
    for name, dev in named_devices[1:]:
        if dev != first:
            raise ValueError(f"{name} is on {dev} but {first_name} is on {first}; all tensors must be on one device")


_SM90_DEVICES = set()  # CUDA device indices already found to be sm90 (the check runs on every call)


def _check_sm90(name, device):
    if device.index in _SM90_DEVICES and device.index is not None:
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        raise ValueError(
            f"{name} is on {device}, a GPU of compute capability {major}.{minor} "
            f"({torch.cuda.get_device_name(device)}); flash_attn_hopper needs an sm90 GPU (H100/H200)"
        )
    if device.index is not None:
        _SM90_DEVICES.add(device.index)


def _check_scale(softmax_scale, head_dim):
    if softmax_scale is None:
        # int(): under torch.compile(dynamic=True) head_dim is symbolic; the kernels are per head_dim anyway, so the
        # graph specialises on it and the op gets a plain float scale.
        return 1.0 / math.sqrt(int(head_dim))
    softmax_scale = _traced_numpy("softmax_scale", softmax_scale, "float")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number (float or int) or None, got {type(softmax_scale).__name__}")
    softmax_scale = _as_float("softmax_scale", softmax_scale)
    # The kernel takes softmax_scale and softmax_scale * log2(e) as normal float32 values.
    if not (_FLOAT32_TINY <= softmax_scale <= _FLOAT32_MAX / math.log2(math.e)):
        # FlashAttention-2's flash_attn_func / flash_attn_varlen_func take dropout_p where this takes softmax_scale
        hint = ("; a 0.0 here is often a dropout_p passed by position, as FlashAttention-2's functions take it: "
                "there is no dropout, and the options after the tensors are best passed by keyword"
                if softmax_scale == 0.0 else "")
        raise ValueError(
            f"softmax_scale must be a positive float32-representable value in [{_FLOAT32_TINY:.3g}, "
            f"{_FLOAT32_MAX / math.log2(math.e):.3g}], got {softmax_scale}{hint}"
        )
    return softmax_scale


def _check_compiled(head_dim, dtype, head_dim_v=None):
    """head_dim: q's and k's; head_dim_v: v's (None: the same). The forward and backward kernels of the larger must
    be in the build."""
    head_dims, dtypes = _ops._compiled()
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    for backward in (False, True):
        kernel = kernel_head_dim(max(head_dim, head_dim_v), backward=backward)
        if kernel not in head_dims:
            which = "backward" if backward else "forward"
            ran_by = f" (run by the head_dim {kernel} {which} kernels)"
            with_v = "" if head_dim_v == head_dim else f" and v head_dim {head_dim_v}"
            raise ValueError(
                f"q has head_dim {head_dim}{with_v}{ran_by}, which this build does not include (built with head_dims "
                f"{list(head_dims)}; rebuild without FAH_HDIMS to get all)"
            )
    if dtype not in dtypes:
        raise TypeError(
            f"q has dtype {dtype}, which this build does not include (built with {list(dtypes)}; rebuild without "
            "FAH_DTYPES to get both)"
        )


def _as_float(name, value):
    """float(value) of a real number; a ValueError naming the argument where it has no float (an int or Fraction past
    float's range)."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a float32-representable value, got one past float's range") from None


def _traced_numpy(name, value, kind, symint=False):
    """value, unless it is a numpy scalar argument under torch.compile (kind: "float", "int" or "bool", what the op
    takes). Eager calls take numpy scalars (numbers.Real / numbers.Integral, numpy.bool_), but dynamo traces them as
    0-d numpy arrays backed by a tensor whose value the trace does not have (also constants of the compiled code and
    np.float64), which the checks refused as "got ndarray", naming neither numpy nor torch.compile: the same call
    failed only when compiled. Where the op takes a SymInt (symint=True: max_seqlen) an integer one is converted (its
    range becomes a runtime assertion of the graph, as for a maximum computed from data); the op's plain float / int /
    bool arguments cannot take a value from data, so those are refused saying why and what to pass. (Under
    torch.compile a 0-d numpy array cannot be told from a numpy scalar.)"""
    np = sys.modules.get("numpy")
    if np is None or not torch.compiler.is_compiling() or not isinstance(value, np.ndarray) or value.ndim != 0:
        return value
    if symint:
        dtype = torch.as_tensor(value).dtype  # (dynamo has no ndarray.dtype attribute; the tensor's dtype it has)
        if dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex:
            return int(value)
    raise TypeError(
        f"{name} is a numpy scalar (or 0-d numpy array), which torch.compile traces as a tensor whose value is not "
        f"known at trace time; pass a Python {kind} (convert it with {kind}(x) before the compiled code runs, e.g. when "
        "the module is built)"
    )


def _check_bool(name, value):
    value = _traced_numpy(name, value, "bool")
    if isinstance(value, bool):
        return value
    # numpy.bool_ (a scalar: shape ()), not an array, whose item() would take any one-element array as a bool
    if (type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and type(value).__name__ != "ndarray"
            and isinstance(value.item(), bool)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__module__}.{type(value).__qualname__}")


def _check_causal(causal):
    return _check_bool("causal", causal)


def _check_window(window_size, causal):
    """(left, right) ints >= -1 (-1: unbounded); causal fixes right at 0. Returns the pair the op takes."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints (-1: that side unbounded; (-1, -1): no "
                        f"window), got {window_size!r}")
    sides = []
    for name, w in zip(("left", "right"), window_size):
        w = _traced_numpy(f"window_size {name} side", w, "int")
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise TypeError(f"window_size {name} side must be an int (-1: unbounded), got {type(w).__name__}")
        w = int(w)
        if w < -1:
            raise ValueError(f"window_size {name} side must be >= -1 (-1: unbounded), got {w}")
        sides.append(min(w, _INT32_MAX))  # wider than any sequence: the same as unbounded
    left, right = sides
    if causal:
        if right > 0:
            raise ValueError(
                f"causal=True means a window right side of 0; got window_size {tuple(window_size)} "
                "(pass causal=False with the window you want)"
            )
        right = 0
    return left, right


def _check_softcap(softcap, softmax_scale):
    softcap = _traced_numpy("softcap", softcap, "float")
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (float or int), got {type(softcap).__name__} (0: off)")
    softcap = _as_float("softcap", softcap)
    # Comparisons, not math.isfinite: under torch.compile(dynamic=True) softcap may be a symbolic float (NaN fails
    # both tests).
    if not (0 <= softcap < math.inf):
        raise ValueError(f"softcap must be finite and >= 0 (0: off), got {softcap}")
    if softcap > 0:
        # The kernels take softcap * log2(e) and softmax_scale / softcap as normal float32 values.
        if not (_FLOAT32_TINY <= softcap * math.log2(math.e) <= _FLOAT32_MAX) or not (
            _FLOAT32_TINY <= softmax_scale / softcap <= _FLOAT32_MAX
        ):
            raise ValueError(
                f"softcap {softcap} with softmax_scale {softmax_scale}: softmax_scale / softcap and "
                "softcap * log2(e) must be normal float32 values"
            )
    return softcap


# softcap's default is the int 0, not 0.0, here and in attention_varlen: under torch.compile(dynamic=True) dynamo
# reads a float keyword default as a symbolic float, which a torch.compiler.nested_compile_region then cannot take in
# (dynamo's AssertionError "lift_tracked_freevar_to_input should not be called on root SubgraphTracer"); 0 and 1 stay
# constants.
def attention(
    q, k, v, softmax_scale=None, causal=False, return_lse=False, *, window_size=(-1, -1), softcap=0,
    deterministic=False, document_ids=None,
):
    """Exact scaled dot-product attention on Hopper GPUs (FlashAttention-3 forward and backward).

    Computes, per batch element and head, ``O = softmax(S + mask) V`` with ``S = softmax_scale * Q Kᵀ``
    (or ``softcap * tanh(softmax_scale * Q Kᵀ / softcap)`` when softcap > 0), with the online softmax of the
    FlashAttention-3 paper (Shah et al., 2024), §3.1-3.2 (Algorithm 1: warp-specialized TMA producer, WGMMA
    consumers, exp2-domain online softmax; Algorithm 2: the next QKᵀ issued before the current softmax, the
    intra-warpgroup overlap); the math is §2.1, eq. for S, P, O.

    Args:
        q: ``(batch, seqlen_q, nheads, head_dim)``, torch.float16 or torch.bfloat16, on an sm90 CUDA device.
        k: ``(batch, seqlen_k, nheads_k, head_dim)``, same dtype and device as q. nheads_k divides nheads:
            grouped-query / multi-query attention when smaller, query head h reading K/V head
            ``h // (nheads // nheads_k)``; dK and dV sum over the query heads of a group inside the kernel (fp32).
        v: ``(batch, seqlen_k, nheads_k, head_dim_v)``, same dtype and device as q; head_dim_v may differ from
            head_dim (e.g. 192 and 128 as in DeepSeek-V2/V3). head_dim and head_dim_v are any multiples of 8 from 8 to
            256 (they run on the smallest kernel that holds the larger, forward 64/96/128/192/256 and backward
            64/128/256: the extra columns are zeros that are never read from or written to the tensors, so the
            result is exactly that of the true sizes); seqlen_q, seqlen_k >= 0 and may differ. Only the last dimension
            must be contiguous (stride 1); other strides are read in place (q, k, v may be slices of one packed
            tensor) when they are multiples of 16 bytes and the base is 16-byte aligned, otherwise the tensor
            is copied first.
        softmax_scale: multiplier of Q Kᵀ before the softmax (unitless); default ``1 / sqrt(head_dim)`` (q's
            head_dim, not v's).
        causal: if True, query row i sees key j only when ``j <= i + seqlen_k - seqlen_q`` (causal mask
            aligned to the bottom-right corner; note SDPA's ``is_causal`` is aligned top-left). The same as
            ``window_size=(-1, 0)``.
        return_lse: if True, also return the log-sum-exp of each row of scores.
        window_size: keyword-only ``(left, right)``, ints >= -1 (in keys): query row i sees key j only when
            ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right`` (sliding window, bottom-right
            aligned); -1 leaves a side unbounded; a side wider than the sequences is the same as unbounded. With
            causal=True the right side is 0 (passing right > 0 then raises). Key tiles wholly outside the window are
            skipped, so the cost grows with the window, not with seqlen_k.
        softcap: keyword-only float (or int) >= 0, default 0; when > 0, scores become ``softcap * tanh(S / softcap)``
            before the softmax (Gemma 2 style logit soft-capping), with the matching backward (factor
            ``1 - tanh²``). 0: off. tanh is ``tanh.approx.f32`` (relative error ~2^-11) for both dtypes.
        deterministic: keyword-only bool; if True the backward adds the partial sums of dQ (and, with GQA, of dK
            and dV) in a fixed order, so repeated backward passes give bitwise-identical gradients (at some cost in
            speed); if False (default) they are added as they finish and the last bits may differ between runs.
            Under ``torch.use_deterministic_algorithms(True)`` the backward is deterministic whatever this says, as
            PyTorch's own operators pick their deterministic implementation in that mode; the mode is read when this
            forward runs, and its backward follows that choice.
        document_ids: keyword-only, None or an integer tensor ``(batch, seqlen)`` on q's device, for several
            sequences packed into each row (self-attention: seqlen_q == seqlen_k == seqlen). Each run of equal
            consecutive ids is one document, and query i sees key j only when both are in the same run (on top of
            causal and window_size, which stay relative to the row: within a document that is the same as running it
            alone). Read on the device only (no host synchronisation, also under torch.compile); key tiles outside a
            row block's documents are skipped. Equal ids that are not adjacent are different documents.

    Returns:
        ``out`` of shape ``(batch, seqlen_q, nheads, head_dim_v)`` in q's dtype, or ``(out, lse)`` with ``lse``
        float32 ``(batch, nheads, seqlen_q)``, natural log. A query row that sees no key (causal with
        seqlen_q > seqlen_k, or a window that misses every key) has an output row of exactly 0 and LSE ``-inf``.

    Raises:
        TypeError: q, k or v is not a tensor, has a dtype other than float16/bfloat16 (or one this build does not
            include), or the dtypes differ; softmax_scale or softcap is not a real number; causal, return_lse or
            deterministic is not a bool; window_size is not a pair of ints; document_ids is not an integer tensor;
            q, k, v or document_ids is a nested tensor, not torch.strided (sparse) or a
            torch.masked.MaskedTensor (its mask would not be applied) or a DTensor (the ops have no sharding rule:
            pass local or full tensors); under torch.compile (fullgraph) a numpy scalar
            as softmax_scale, softcap, a window side or a bool (dynamo traces it without a value: pass a Python
            number; eager takes numpy scalars).
        ValueError: rank is not 4; batch differs between q, k, v, or head_dim between q and k; k and v differ in
            nheads_k, or nheads is not a multiple of nheads_k; seqlen_k differs between k and v; batch or nheads
            above 65535; seqlen_q or seqlen_k of 2^30 - 256 or more (varlen: total rows); batch x nheads x
            ceil(seqlen_q / 128) (the forward's tiles) of 2^31 - 1024 or more while seqlen_k > 0; head_dim or
            head_dim_v is not a multiple of 8 in [8, 256] (or the forward or backward kernel size of the larger is not
            in this build);
            the last dimension's stride is not 1; a tensor is not on a CUDA device, the tensors are on different
            devices, or the GPU is not sm90;
            softmax_scale is not a positive normal float32 whose product with log2(e) is one too (an int past
            float's range included); a window_size side is below -1, or causal=True with a right side > 0; softcap is
            negative or not finite, or (softcap > 0) softcap * log2(e) or softmax_scale / softcap is not a normal
            float32;
            document_ids is not ``(batch, seqlen)`` on q's device, or seqlen_q != seqlen_k with document_ids.
        RuntimeError: the compiled extension is not available; (in the backward) differentiating dq, dk, dv again
            (double backward is not supported: ``create_graph=True`` works, a second backward through it raises).

    Gradients: when q, k or v requires grad, ``out`` (and ``lse``) backpropagate through the FlashAttention-3
    backward (paper Appendix B.1, Algorithm 3; the equations of §2.1: dV = Pᵀ dO, dP = dO Vᵀ, dS = dsoftmax(dP),
    dQ = α dS K, dK = α dSᵀ Q; the row-wise dsoftmax is computed as dS = P ∘ (dP − D) with D = rowsum(P ∘ dP) =
    rowsum(dO ∘ O)), recomputing P from the saved LSE; saved state is q, k, v, out and lse (and the document
    bounds). ``lse`` is differentiable: since d LSE_i / d S_ij = P_ij, a loss that uses it adds ``P ∘ dLSE`` to dS
    at no extra cost (what ring and context-parallel attention need to merge partial results).

    Inputs are never modified. The kernels run on the current CUDA stream of q's device.
    """
    return_lse = _check_bool("return_lse", return_lse)  # outside the checked-call cache, whose key does not hold it
    compiling = _graph_tracing(q)
    key = None if compiling else _call_signature(q, k, v, softmax_scale, causal, window_size, softcap, deterministic,
                                                 document_ids)
    args = _checked(_CHECKED_CALLS, key, lambda: _check_call(q, k, v, softmax_scale, causal, window_size, softcap,
                                                            deterministic, compiling, document_ids))
    doc_bounds = None if document_ids is None else _document_bounds(document_ids, compiling)
    # The registered op (its autograd formula is in C++, its fake kernel in _ops.py): one graph node under
    # torch.compile, and in eager mode no Python between the forward and the backward kernels.
    out, lse = torch.ops.flash_attn_hopper.fwd.default(q, k, v, *args, doc_bounds)
    return (out, lse) if return_lse else out


def _checked(cache, key, check):
    """The op's scalar arguments (deterministic last): check() runs every argument check and returns them; a call
    whose signature `key` (None: not cacheable) was checked before reuses its result from `cache` (the cache is
    emptied when full). torch.use_deterministic_algorithms(True) turns the deterministic backward on, applied after
    the cache since the global mode may change between calls."""
    args = cache.get(key) if key is not None else None
    if args is None:
        args = check()
        if key is not None:
            if len(cache) >= _CHECKED_CALLS_MAX:
                cache.clear()
            cache[key] = args
    if not args[-1] and torch.are_deterministic_algorithms_enabled():
        args = (*args[:-1], True)
    return args


# The dispatch modes of PyTorch's tracers: make_fx (PROXY; FAKE too in its fake and symbolic modes), AOTAutograd and
# torch.export's non-strict tracing (FAKE, FUNCTIONAL), a user's FakeTensorMode (no values to read).
_TRACING_MODE_KEYS = tuple(getattr(torch._C._TorchDispatchModeKey, name) for name in ("PROXY", "FAKE", "FUNCTIONAL"))


def _graph_tracing(q=None):
    """Whether this call is being recorded into a graph that later runs on other values, or runs on tensors without
    values: torch.compile / torch.export (dynamo), torch.jit.trace, make_fx, AOTAutograd (functorch's aot_function),
    torch.func.functionalize (q a functional tensor), a FakeTensorMode. Such a call takes no tensor value read on the
    host into what it launches and serves no per-tensor cached result (either would become a constant of the graph: a
    torch.jit.trace or make_fx of attention_varlen kept the trace-time cut at cu_seqlens_q[-1], and one of attention
    the document bounds cached by a call before it; fake and functional tensors have no host values), and it leaves
    the build and device queries to the op (the extension's build_config op returns a str, which torch.jit.trace
    cannot record)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    # (every dispatch mode puts the Python key in the thread's include set: one query when none is active)
    if torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.Python) and any(
            torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODE_KEYS):
        return True
    return isinstance(q, torch.Tensor) and torch._is_functional_tensor(q)


def _check_call(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, compiling, document_ids=None):
    """Every check of ``attention``'s arguments; returns the op's scalar arguments (softmax_scale, causal, window_left,
    window_right, softcap, deterministic)."""
    _check_tensor_args(q, k, v)
    if torch.compiler.is_compiling():  # (sizes may be unbacked: no Python comparison on them)
        _check_fwd_tiles_compiling(q.shape[0], q.shape[2], q.shape[1], k.shape[1], k.shape[1],
                                   ("batch", "nheads", "seqlen_q"))
    else:
        _check_fwd_tiles(q.shape[0], q.shape[2], q.shape[1], ("batch", "nheads", "seqlen_q"), launches=k.shape[1] > 0)
    softmax_scale = _check_scale(softmax_scale, q.shape[-1])
    causal = _check_causal(causal)
    window_left, window_right = _check_window(window_size, causal)
    softcap = _check_softcap(softcap, softmax_scale)
    deterministic = _check_bool("deterministic", deterministic)
    if document_ids is not None:
        _check_document_ids(document_ids, q, k)
    _check_devices([("q", q.device), ("k", k.device), ("v", v.device)])
    _ops.require_extension()
    if not compiling:
        # Host queries, left out of a torch.compile graph (the op repeats both checks at run time).
        _check_sm90("q", q.device)
        _check_compiled(q.shape[-1], q.dtype, v.shape[-1])
    return softmax_scale, causal, window_left, window_right, softcap, deterministic


# Calls whose arguments passed every check: signature -> the op's scalar arguments. A training loop repeats the same
# few signatures, and the checks cost more host time per call (tens of microseconds) than the dictionary lookup.
_CHECKED_CALLS = {}
_CHECKED_CALLS_MAX = 4096


def _call_signature(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, document_ids=None):
    """A key that fixes everything the checks read, or None (then the checks run). Only for plain tensors and
    arguments of exact builtin types, so that equal keys mean equal outcomes (1 == True, but an int causal must
    still raise TypeError; an int softcap, the default 0, is checked as float(softcap), so 0 and 0.0 are one key)."""
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor):
        return None
    if any(isinstance(t, torch.Tensor) and (t.is_nested or t.layout != torch.strided)
           for t in (q, k, v, document_ids)):
        return None  # refused by the checks, by name (no shapes or strides to key on)
    if q.dim() == 0 or k.dim() == 0 or v.dim() == 0:
        return None  # refused by the rank check, by name (stride(-1) below would raise an IndexError)
    if (type(causal) is not bool or type(deterministic) is not bool or type(softcap) not in (float, int)
            or not (softmax_scale is None or type(softmax_scale) is float)
            or type(window_size) is not tuple or len(window_size) != 2
            or type(window_size[0]) is not int or type(window_size[1]) is not int
            or not (document_ids is None or type(document_ids) is torch.Tensor)):
        return None
    documents = None if document_ids is None else (document_ids.shape, document_ids.dtype, document_ids.device)
    return (q.shape, k.shape, v.shape, q.stride(-1), k.stride(-1), v.stride(-1), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, softmax_scale, causal, window_size, softcap, deterministic, documents)


# ------------------------------------------------------------------------------------------ packed documents

_DOCUMENT_ID_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _check_document_ids(document_ids, q, k):
    """Type, dtype, device and shape of document_ids (no device read)."""
    if not isinstance(document_ids, torch.Tensor):
        raise TypeError(f"document_ids must be a torch.Tensor or None, got {type(document_ids).__name__}")
    _check_strided("document_ids", document_ids)
    _check_document_ids_dtype(document_ids)
    if document_ids.device != q.device:
        raise ValueError(f"document_ids is on {document_ids.device} but q is on {q.device}; it must be on q's device")
    _check_document_ids_shape(document_ids, q, k)


def _check_document_ids_dtype(document_ids):
    """TypeError unless document_ids has an integer dtype (also the rule of flash_attn_hopper.testing's references)."""
    if document_ids.dtype not in _DOCUMENT_ID_DTYPES:
        raise TypeError(f"document_ids must be int8, int16, int32, int64 or uint8, got {document_ids.dtype}")


def _check_document_ids_shape(document_ids, q, k):
    """document_ids' shape against q's and k's (also the rule of flash_attn_hopper.testing's references)."""
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"document_ids packs documents for self-attention: seqlen_q ({q.shape[1]}) must equal seqlen_k "
            f"({k.shape[1]})"
        )
    if tuple(document_ids.shape) != (q.shape[0], q.shape[1]):
        raise ValueError(
            f"document_ids must have shape (batch, seqlen) = {(q.shape[0], q.shape[1])}, got {tuple(document_ids.shape)}"
        )


# document_ids tensors -> their bounds, per CUDA stream (the layers of one step pass the same tensor: computed once per
# step and stream).
_DOCUMENT_BOUNDS = None  # a _ValueNotes, made below


def document_bounds(document_ids):
    """The kernels' form of ``document_ids`` (batch, seqlen): an int32 ``(batch, seqlen, 2)`` tensor of, per position,
    the first position of its document and one past the last (runs of equal consecutive ids). Device work only."""
    batch, seqlen = document_ids.shape
    device = document_ids.device
    if seqlen == 0:
        return torch.empty((batch, 0, 2), dtype=torch.int32, device=device)
    starts = torch.cat([torch.ones((batch, 1), dtype=torch.bool, device=device),
                        document_ids[:, 1:] != document_ids[:, :-1]], dim=1)
    pos = torch.arange(seqlen, dtype=torch.int32, device=device).expand(batch, seqlen)
    doc_start = torch.where(starts, pos, 0).cummax(dim=1).values
    next_start = torch.where(starts, pos, seqlen)[:, 1:]  # doc_end[i]: the first start after i, else seqlen
    doc_end = torch.cat([next_start.flip(1).cummin(dim=1).values.flip(1),
                         torch.full((batch, 1), seqlen, dtype=torch.int32, device=device)], dim=1)
    return torch.stack([doc_start, doc_end], dim=-1).to(torch.int32).contiguous()


def _capturing(device):
    """Whether the current stream of `device` (a CUDA device) is being captured into a CUDA graph."""
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()  # no device switch (host time per call)
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _document_bounds(document_ids, compiling):
    # Under torch.compile and torch.jit.trace (compiling: _graph_tracing()), and inside a CUDA graph capture (so that a
    # replay recomputes them from the ids it finds), the bounds are computed every call instead of coming from the
    # cache.
    if compiling or (document_ids.is_cuda and _capturing(document_ids.device)):
        return document_bounds(document_ids)
    return _DOCUMENT_BOUNDS.computed(document_ids, lambda: document_bounds(document_ids), document_ids.device)


# ---------------------------------------------------------------------------------------------- variable length

class _NoteRef(weakref.ref):
    """The notes' weak reference: a subclass, as identity-keyed containers' are, so that a torch.utils.swap_tensors
    that lets plain weakref.ref observers through (pytorch/pytorch#190739) still refuses a tensor with notes, as
    torch 2.11 refuses any (docs/conventions.md); round 42's HG."""

    __slots__ = ()


class _IdentityNotes:
    """A value per object (a tensor, a model config), kept while the object lives. Keyed by identity, not a
    WeakKeyDictionary: that compares keys with ==, which tensors answer elementwise and configs by value."""

    def __init__(self):
        self._entries = {}  # id(obj) -> (weak reference, value)

    def get(self, obj, default=None):
        entry = self._entries.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else default

    def put(self, obj, value):
        """Keeps value for obj; nothing is kept for an object that cannot be weakly referenced."""
        key = id(obj)
        try:
            ref = _NoteRef(obj, lambda _, key=key: self._entries.pop(key, None))
        except TypeError:
            return
        self._entries[key] = (ref, value)


class _ValueNotes(_IdentityNotes):
    """Results computed from a tensor's values (a device read), kept while the tensor lives and its version counter is
    unchanged: the layers of one model step pass the same tensors, so their values are read once. Writes that bypass
    the version counter (through ``.data``, numpy or DLPack memory, in-place torch.distributed collectives, kernels
    outside PyTorch's operators) are not seen until torch.autograd.graph.increment_version, so what is kept must never
    let a launch index past its tensors (cu_seqlens: the kernels get the values read). Inference-mode tensors have no
    version counter and are never kept.
    A result that is itself a device tensor is kept per device and stream (get and put with its ``device``): one made
    on another stream would be neither ordered before this stream's kernels nor kept alive by the caching allocator
    for them."""

    MISSING = object()

    def get(self, t, device=None, per_call=False):
        entry = super().get(t)  # (version, {_result_key(device): value})
        if entry is not None and entry[0] == self._version(t, per_call):
            return entry[1].get(_result_key(device), self.MISSING)
        return self.MISSING

    def put(self, t, value, device=None, per_call=False, version=MISSING):
        """per_call: t is a tensor object made for one call of the caller's (e.g. the view of a padding mask that a
        model's forward hands to its layers), whose values do not change while it lives; kept also when t is an
        inference tensor (which has no version counter); a t that has one is still checked by it. version: t's
        version as it was before value was computed (default: now)."""
        if t.is_inference() and not per_call:
            return
        if version is self.MISSING:
            version = self._version(t, per_call)
        entry = super().get(t)
        if entry is None or entry[0] != version:
            entry = (version, {})
            super().put(t, entry)
        entry[1][_result_key(device)] = value

    @classmethod
    def _version(cls, t, per_call):
        """t's version counter and its TensorImpl: torch.utils.swap_tensors keeps the Python object and swaps what it
        holds, and the swapped-in tensor's counter may read the same number (round 42's HG). The notes' _NoteRef makes
        torch 2.11 refuse the swap, and a torch with pytorch/pytorch#190739 too; where any weak reference is let
        through (#190604) the TensorImpl's address tells the swapped-in tensor apart, unless a tensor swapped in
        earlier and freed since left its address to it (two swaps with no call between)."""
        if t.is_inference():  # (no version counter)
            return None if per_call else cls.MISSING
        return t._version, t._cdata

    def computed(self, t, compute, device=None, per_call=False):
        """get, else compute() then put. compute runs outside inference_mode: a result kept from an evaluation under
        torch.inference_mode() may serve a training call with the same tensor, whose op saves it for backward
        (inference tensors cannot be saved)."""
        value = self.get(t, device, per_call)
        if value is self.MISSING:
            # The version before the read: a write from another thread during compute() then leaves the kept value
            # under the old version, so the next call reads again (stamped after, the values read before that write
            # served every later call: round 42's HI).
            version = self._version(t, per_call)
            with torch.inference_mode(False):
                value = compute()
            self.put(t, value, device, per_call, version)
        return value


def _result_key(device):
    """Where a kept result lives: None for host results, else its device and that device's current stream (the
    default stream's handle is 0 on every GPU, so the handle alone served ids made on cuda:0 to a layer on cuda:1 given
    the same position_ids: session 72's audit)."""
    if device is None:
        return None
    return str(torch.device(device)), _stream_key(device)


def _stream_key(device):
    """The handle of `device`'s current stream for results on a CUDA device; None for results on the host or the CPU."""
    if device is None or torch.device(device).type != "cuda":
        return None
    return torch.cuda.current_stream(device).cuda_stream


# cu_seqlens tensors whose values were checked -> (first entry, last entry, longest sequence).
_CHECKED_CU_SEQLENS = _ValueNotes()
_DOCUMENT_BOUNDS = _ValueNotes()


def _check_cu_seqlens_meta(name, cu, q):
    """Type, dtype, device and rank of one cu_seqlens tensor (no device read)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    _check_strided(name, cu)
    if cu.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.device != q.device:
        raise ValueError(f"{name} is on {cu.device} but q is on {q.device}; cu_seqlens must be on q's device")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D of length batch + 1 >= 1, got shape {tuple(cu.shape)}")
    if not cu.is_contiguous():
        raise ValueError(f"{name} must be contiguous (stride 1), got stride {cu.stride()}")


def _cu_seqlens_summary(name, cu):
    """((first, last, longest), checked) of a cu_seqlens tensor whose entries are checked to be >= 0 and
    non-decreasing; read from the device once per tensor version (see _ValueNotes). ``checked`` is the copy, made on
    the current stream, whose values were read, which the kernels get in place of ``cu`` (the launch is shaped by the
    summary, so a write to ``cu`` that bypasses its version counter, e.g. torch.distributed's in-place collectives or
    a Triton kernel, must not reach them: they would index past the tensors' rows)."""
    return _CHECKED_CU_SEQLENS.computed(cu, lambda: _read_cu_seqlens(name, cu), cu.device)


def _read_cu_seqlens(name, cu):
    # The copy first, then its values: a writer on another stream cannot change what is checked after the check.
    checked = cu.clone()
    try:
        values = checked.tolist()  # one small device-to-host copy
    except (RuntimeError, NotImplementedError) as e:
        if type(cu) is torch.Tensor:
            raise
        # a tensor subclass whose values cannot be read here (a DTensor: ".tolist() is not supported")
        raise TypeError(f"{name} must be a plain torch.Tensor whose values can be read on the host, got "
                        f"{type(cu).__name__} ({e})") from e
    if values[0] < 0:
        raise ValueError(f"{name} must start at an offset >= 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if any(n < 0 for n in lengths):
        i = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"{name} must be non-decreasing, but entry {i + 1} ({values[i + 1]}) < entry {i} ({values[i]})")
    return (values[0], values[-1], max(lengths, default=0)), checked


def _check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The checks of cu_seqlens' values (a host read): non-negative, non-decreasing, within q's / k's rows, no sequence
    longer than its max_seqlen. Returns (cu_seqlens_q[-1], cu_seqlens_k[-1], the checked cu_seqlens_q, the checked
    cu_seqlens_k): the values checked, which the launch must use (_cu_seqlens_summary)."""
    last, checked = [], []
    for name, cu, rows, max_name, max_len in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k),
    ):
        (_, end, longest), values = _cu_seqlens_summary(name, cu)
        if end > rows:
            raise ValueError(f"{name} ends at row {end}, past the {rows} rows of {name[-1]}")
        if longest > max_len:
            raise ValueError(f"{max_name} is {max_len} but {name} holds a sequence of length {longest}")
        last.append(end)
        checked.append(values)
    return (*last, *checked)


def _bounded_offsets(cu, rows):
    """cu_seqlens as the kernels may take them without a host check: each entry clamped to [0, rows], then the running
    maximum (valid values come back unchanged). Two device ops, which graphs and captures record (torch.jit.trace:
    more, as rows is a traced 0-d CPU tensor there, which clamp's Scalar bounds do not take and clamp_max's Tensor
    bound takes only on cu's device and dtype)."""
    if isinstance(rows, torch.Tensor):
        return torch.cummax(cu.clamp_min(0).clamp_max(rows.to(device=cu.device, dtype=cu.dtype)), dim=0).values
    return torch.cummax(cu.clamp(0, rows), dim=0).values


def _check_max_seqlen(name, value):
    value = _traced_numpy(name, value, "int", symint=True)
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        hint = " (pass int(t) or t.item())" if isinstance(value, torch.Tensor) else ""
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}{hint}")
    if torch.compiler.is_compiling():
        # the op takes SymInt, so a maximum that changes between calls stays symbolic (checked by range, not value);
        # one computed from data in the compiled code (.item() with capture_scalar_outputs) has no value at trace
        # time: its range becomes a runtime assertion of the graph (torch._check); a known value out of range still
        # raises a ValueError
        if _guard_or_false(value < 0) or _guard_or_false(value >= 2**31):
            raise ValueError(f"{name} must be in [0, 2^31)")  # (int(value) of a value from data cannot be traced)
        _traced_check(value >= 0, lambda: "max_seqlen_q and max_seqlen_k must be in [0, 2^31)")
        _traced_check(value < 2**31, lambda: "max_seqlen_q and max_seqlen_k must be in [0, 2^31)")
        return value
    value = int(value)
    if not 0 <= value < 2**31:
        raise ValueError(f"{name} must be in [0, 2^31), got {value}")
    return value


# attention_varlen's calls whose arguments passed every check but the values of cu_seqlens (checked per tensor
# version, _check_cu_seqlens_values): signature -> the op's scalar arguments. As for ``attention``, the
# checks cost more host time than the lookup (session 42: 110-127 us per call against 26-43 for ``attention`` on an
# H200 host), which at seqlen 1024 is most of the kernel's own time.
_CHECKED_VARLEN_CALLS = {}


def _varlen_signature(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                      window_size, softcap, deterministic):
    """A key that fixes everything _check_varlen_call reads, or None (then the checks run): _call_signature's, plus
    cu_seqlens' shape, stride, dtype and device and the max_seqlen ints."""
    if type(cu_seqlens_q) is not torch.Tensor or type(cu_seqlens_k) is not torch.Tensor:
        return None
    if type(max_seqlen_q) is not int or type(max_seqlen_k) is not int:
        return None
    if any(t.is_nested or t.layout != torch.strided for t in (cu_seqlens_q, cu_seqlens_k)):
        return None
    key = _call_signature(q, k, v, softmax_scale, causal, window_size, softcap, deterministic)
    if key is None:
        return None
    return key + tuple((t.shape, t.stride(), t.dtype, t.device) for t in (cu_seqlens_q, cu_seqlens_k)) + (
        max_seqlen_q, max_seqlen_k)


def _check_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                       window_size, softcap, deterministic, compiling):
    """Every check of ``attention_varlen``'s arguments but cu_seqlens' values; returns the op's scalar arguments
    (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, deterministic),
    deterministic as passed (the global mode is applied per call)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor):
            _check_strided(name, t)
        if isinstance(t, torch.Tensor) and t.dim() != 3:
            raise ValueError(
                f"{name} must have rank 3 (total_tokens, nheads, head_dim) for attention_varlen, got rank {t.dim()} "
                f"with shape {tuple(t.shape)}"
            )
    if all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        _check_tensor_args(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), varlen=True)
    else:
        _check_tensor_args(q, k, v)  # raises the TypeError naming the argument
    softmax_scale = _check_scale(softmax_scale, q.shape[-1])
    causal = _check_causal(causal)
    window_left, window_right = _check_window(window_size, causal)
    softcap = _check_softcap(softcap, softmax_scale)
    deterministic = _check_bool("deterministic", deterministic)
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    _check_cu_seqlens_meta("cu_seqlens_q", cu_seqlens_q, q)
    _check_cu_seqlens_meta("cu_seqlens_k", cu_seqlens_k, q)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got {cu_seqlens_q.numel()} and "
            f"{cu_seqlens_k.numel()}"
        )
    if cu_seqlens_q.numel() - 1 > _MAX_GRID_YZ:
        raise ValueError(f"at most {_MAX_GRID_YZ} sequences are supported, got {cu_seqlens_q.numel() - 1}")
    _check_devices([("q", q.device), ("k", k.device), ("v", v.device)])
    _ops.require_extension()
    if not compiling:
        _check_sm90("q", q.device)
        _check_compiled(q.shape[-1], q.dtype, v.shape[-1])
    return max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, deterministic


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0,
    return_lse=False,
    deterministic=False,
):
    """Attention over a batch of sequences of different lengths packed along the token dimension (no padding).

    Sequence b holds query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v, and attends only within itself; masks (causal, window) are
    aligned per sequence, bottom-right, exactly as ``attention`` does for one batch element. The same kernels as
    ``attention`` (FlashAttention-3 paper §3.1-3.2 forward, Appendix B.1 backward, §2.1 gradients) run with
    per-sequence row offsets, so memory and work grow with the number of tokens, not with batch × max_seqlen.

    Args:
        q: ``(total_q, nheads, head_dim)``, torch.float16 or torch.bfloat16, on an sm90 CUDA device.
        k: ``(total_k, nheads_k, head_dim)``, v: ``(total_k, nheads_k, head_dim_v)``, same dtype and device; nheads_k
            divides nheads (GQA/MQA). head_dim and head_dim_v are any multiples of 8 from 8 to 256, as for
            ``attention``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` on q's device, non-decreasing row offsets (usually starting
            at 0); zero-length sequences are allowed on either side. Rows past ``cu_seqlens_q[-1]`` (or ``[-1]`` of k)
            belong to no sequence.
        max_seqlen_q, max_seqlen_k: Python ints (SymInts under torch.compile, where a new value reuses the graph), at
            least the longest query / key sequence (larger is allowed; it sizes the launch grid).
        softmax_scale, causal, window_size, softcap, return_lse, deterministic: as ``attention``.

    Returns:
        ``out`` ``(total_q, nheads, head_dim_v)`` in q's dtype, or ``(out, lse)`` with ``lse`` float32
        ``(nheads, total_q)`` (natural log). A sequence with no keys gives output rows of 0 and LSE ``-inf``; rows past
        ``cu_seqlens_q[-1]`` get output 0 and LSE ``-inf``, and their gradients (and dK, dV of key rows past
        ``cu_seqlens_k[-1]``) are 0. ``out`` and ``lse`` are differentiable with respect to q, k, v.

    Raises:
        TypeError: as ``attention``; cu_seqlens not tensors (or nested, sparse, a MaskedTensor or a DTensor, or
            another tensor subclass whose values cannot be read on the host); max_seqlen not Python ints (numpy
            integers are taken, also under torch.compile).
        ValueError: as ``attention`` (with rank 3 instead of 4); cu_seqlens not int32, not on q's device, not 1-D,
            not contiguous, of different lengths, negative, decreasing, or ending past the tensor's rows; max_seqlen
            below the longest sequence, negative, or 2^31 or more; more than 65535 sequences; sequences x nheads x
            ceil(min(max_seqlen_q, cu_seqlens_q[-1]) / 128) (the forward's tiles; under torch.compile,
            torch.jit.trace, another tracer (make_fx, AOTAutograd, functionalize, fake tensors) or a CUDA graph
            capture q's rows instead of cu_seqlens_q[-1]) of 2^31 - 1024 or more while
            there are keys.
        RuntimeError: the compiled extension is not available; under torch.compile, when the graph runs, a max_seqlen
            computed from data in the compiled code that is out of range or makes too many forward tiles (a runtime
            assertion of the graph, where eager raises the ValueError above).

    The values of cu_seqlens are checked on the host (one small device-to-host copy per cu_seqlens tensor and version;
    the layers of a model step reuse the check, and the kernels get a copy of the values checked: a write the version
    counter does not count, e.g. an in-place collective or a Triton kernel, is not seen until
    ``torch.autograd.graph.increment_version(cu_seqlens)`` or a new tensor); under torch.compile (and make_fx,
    AOTAutograd, functionalize, fake tensors) and inside a CUDA graph capture (where a replay reads the boundaries it
    finds on the device) that check is skipped and the values are trusted; torch.jit.trace
    checks the values of the call it traces, and its replays trust theirs (no Python check runs in a replay, only
    the op's). max_seqlen_q/k are constants of a trace or a capture (trace or capture with upper bounds); under
    torch.compile they stay symbolic. Trusted values reach the kernels clamped to the tensors' rows and made
    non-decreasing (device ops), so bad ones leave rows unwritten but never make the kernels index past the tensors.
    Where the values are trusted, rows past the last sequence must hold finite
    values (a last partial tile loads them). In every mode the tokens of one sequence must be finite for its
    neighbours' results to be (the same reason).
    Inputs are never modified. The kernels run on the current CUDA stream of q's device.
    """
    return_lse = _check_bool("return_lse", return_lse)  # outside the checked-call cache, as in ``attention``
    compiling = _graph_tracing(q)
    key = None if compiling else _varlen_signature(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                    softmax_scale, causal, window_size, softcap, deterministic)
    scalars = _checked(_CHECKED_VARLEN_CALLS, key, lambda: _check_varlen_call(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap,
        deterministic, compiling))
    max_seqlen_q, max_seqlen_k = scalars[0], scalars[1]
    # Under torch.compile, torch.jit.trace and inside a CUDA graph capture, what is launched does not depend on
    # cu_seqlens' values (a capture forbids the host read; a replay must follow the values it finds): the kernels take
    # every row, read the boundaries on the device and write the rows outside the sequences themselves. The values
    # are then the caller's to get right.
    # The launch covers the longest sequence in every one, which the op clamps to q's rows (as given to it).
    tile_names = ("the number of sequences", "nheads")
    if compiling or _capturing(q.device):
        if torch.jit.is_tracing() and not torch.compiler.is_compiling():
            # torch.jit.trace runs this call eagerly, so its values can be checked (the trace keeps none of it: a
            # replay's values are the caller's to get right, as in a CUDA graph)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                _check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        if torch.compiler.is_compiling():
            _check_fwd_tiles_compiling(cu_seqlens_q.numel() - 1, q.shape[1], (max_seqlen_q, q.shape[0]),
                                       k.shape[0], max_seqlen_k, tile_names + ("min(max_seqlen_q, q's rows)",))
        else:  # torch.jit.trace (q.shape[0] is a tensor there), make_fx / AOTAutograd / functionalize, a capture
            _check_fwd_tiles(cu_seqlens_q.numel() - 1, q.shape[1], min(max_seqlen_q, q.shape[0]),
                             tile_names + ("min(max_seqlen_q, q's rows)",), launches=k.shape[0] > 0 and max_seqlen_k > 0)
        # Trusted values reach the kernels only as offsets in [0, rows], non-decreasing: the kernels index q, k, v,
        # the outputs and the backward's workspaces by them, so a bad value (a last entry past the rows, a negative or
        # decreasing entry) leaves rows unwritten instead of reading and writing past the tensors.
        bounded_q = _bounded_offsets(cu_seqlens_q, q.shape[0])
        bounded_k = (bounded_q if cu_seqlens_k is cu_seqlens_q and k.shape[0] == q.shape[0]  # self-attention: once
                     else _bounded_offsets(cu_seqlens_k, k.shape[0]))
        args = (bounded_q, bounded_k, *scalars)
        out, lse = torch.ops.flash_attn_hopper.fwd_varlen.default(q, k, v, *args)
        return (out, lse) if return_lse else out
    # Rows past the last sequence belong to none (a preallocated buffer may hold anything there): the kernels get views
    # without them, since a last partial tile would otherwise load them (masked, but 0 * NaN is NaN).
    last_q, last_k, cu_seqlens_q, cu_seqlens_k = _check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k,
                                                                         max_seqlen_q, max_seqlen_k)
    args = (cu_seqlens_q, cu_seqlens_k, *scalars)  # the values checked, which shape the launch below
    tail_q = q.shape[0] - last_q
    if tail_q or last_k < k.shape[0]:
        q, k, v = q[:last_q], k[:last_k], v[:last_k]
    _check_fwd_tiles(cu_seqlens_q.numel() - 1, q.shape[1], min(max_seqlen_q, last_q),
                     tile_names + ("min(max_seqlen_q, cu_seqlens_q[-1])",), launches=last_k > 0 and max_seqlen_k > 0)
    out, lse = torch.ops.flash_attn_hopper.fwd_varlen.default(q, k, v, *args)
    if tail_q:  # those rows: output 0, LSE -inf (and zero gradients through the padding)
        out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, tail_q))
        lse = torch.nn.functional.pad(lse, (0, tail_q), value=float("-inf"))
    return (out, lse) if return_lse else out
