"""Reference attention (forward, and backward by autograd and from its equations) and the comparison rule of
DESIGN.md §3, used by the tests and the benchmark.

Every reference runs in its own numeric mode, whatever the caller's: autocast off and float32 matrix products in full
float32 (_reference_mode), so that the float32 reference stays one and the naive one stays in the input dtype; the
gradient references also run under torch.inference_mode() and with inference tensors (_grad_leaf).

The references refuse what ``attention`` / ``attention_varlen`` refuse (shapes, mixed dtypes, document_ids and
cu_seqlens, softmax_scale / causal / window_size / softcap values), with its exceptions, so that no reference is
computed for a rule the kernels do not have; they also take float32 and float64 inputs."""

import contextlib
import functools
import math
import numbers
import threading

import torch

from .interface import (_check_bool, _check_causal, _check_document_ids_dtype, _check_document_ids_shape,
                        _check_same_dtype, _check_scale, _check_shapes_agree, _check_softcap, _check_window)

# The dtypes the references compute in: attention's fp16 / bf16, and float32 / float64 for references of higher
# precision (and for the comparisons' own tests).
_REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The matmul backends whose float32 precision torch.set_float32_matmul_precision("high" / "medium") lowers: cuBLAS
# (TF32) and oneDNN on CPUs with bf16 / AMX units (TF32 or bf16).
_MATMUL_BACKENDS = ("cuda", "mkldnn")


# Threads inside _reference_mode and the matmul settings the first of them found (round 42's HH: the settings are
# process-wide, so a thread leaving put the caller's "high" back while another was still computing its float32
# reference, in TF32 on a GPU, and the last to leave restored "highest" for good).
_MODE_LOCK = threading.Lock()
_MODE_USERS = 0
_MODE_SAVED = None


@contextlib.contextmanager
def _reference_mode(device_type):
    """Autocast off for `device_type` (it ran the products in fp16 / bf16 and the softmax in fp32, so the float32
    reference was no longer float32 and the naive one no longer in the input dtype) and full float32 matmuls (TF32
    left a float32 reference with a 10-bit mantissa). torch.set_float32_matmul_precision("highest") sets the legacy
    setting and every backend's together (setting one backend alone left the legacy one disagreeing, which PyTorch
    refuses to read: "mix of the legacy and new APIs"); once the last thread inside this mode leaves, both are put
    back as the first found them (the legacy one first, as it rewrites the backends'), so a change another thread
    made meanwhile is undone. Process-wide settings: a matmul on another thread meanwhile also runs in full
    float32."""
    global _MODE_USERS, _MODE_SAVED
    # (a device type without autocast, e.g. meta, has none to turn off: torch.autocast refuses it)
    no_autocast = (torch.autocast(device_type, enabled=False) if torch.amp.is_autocast_available(device_type)
                   else contextlib.nullcontext())
    with _MODE_LOCK:
        if _MODE_USERS == 0:
            backends = [getattr(torch.backends, name).matmul for name in _MATMUL_BACKENDS]
            try:
                legacy = torch.get_float32_matmul_precision()
            except RuntimeError:  # the caller mixed the two APIs: only the backends' settings can be read back
                legacy = None
            _MODE_SAVED = (legacy, backends, [b.fp32_precision for b in backends])
        # every entry, not only the first: another thread may have lowered it since (a training loop turning TF32 on)
        torch.set_float32_matmul_precision("highest")
        _MODE_USERS += 1
    try:
        with no_autocast:
            yield
    finally:
        with _MODE_LOCK:
            _MODE_USERS -= 1
            if _MODE_USERS == 0:
                legacy, backends, saved = _MODE_SAVED
                if legacy is not None:
                    torch.set_float32_matmul_precision(legacy)
                for b, old in zip(backends, saved):
                    b.fp32_precision = old


_in_mode = threading.local()


def _in_reference_mode(fn):
    """Runs fn (first argument q) in _reference_mode for q's device type; a reference called by another (the gradient
    references, the varlen one per sequence) runs in the caller's mode instead of entering it again.
    Known limitation (round 43's HJ): the mode covers the call, not a backward that the caller later takes through
    the outputs with torch.autograd.grad / .backward(), which runs in the caller's autocast and matmul precision.
    Take reference gradients with attention_ref_grads / attention_varlen_ref_grads (inside the mode), or wrap the
    caller's grad call in _reference_mode. (Making the call one autograd node whose backward enters the mode was
    tried and reverted: it dropped double-backward terms silently, broke retain_graph, torch.func and forward AD.)"""
    @functools.wraps(fn)
    def wrapper(q, *args, **kwargs):
        if getattr(_in_mode, "active", False) or not isinstance(q, torch.Tensor):  # (fn refuses a q not a tensor)
            return fn(q, *args, **kwargs)
        _in_mode.active = True
        try:
            with _reference_mode(q.device.type):
                return fn(q, *args, **kwargs)
        finally:
            _in_mode.active = False
    return wrapper


def _grad_leaf(t, dtype):
    """A leaf copy of t in dtype that requires grad: an inference tensor (made under torch.inference_mode(), e.g. a KV
    cache) cannot take requires_grad outside that mode, so it is cloned into a normal one."""
    leaf = t.detach().to(dtype)
    if leaf.is_inference():
        leaf = leaf.clone()
    return leaf.requires_grad_(True)


def causal_mask(seqlen_q, seqlen_k, device=None):
    """Boolean (seqlen_q, seqlen_k), True where query i may see key j: j <= i + seqlen_k - seqlen_q (bottom-right)."""
    return local_mask(seqlen_q, seqlen_k, causal=True, device=device)


def local_mask(seqlen_q, seqlen_k, window_size=(-1, -1), causal=False, device=None):
    """Boolean (seqlen_q, seqlen_k), True where query i may see key j under DESIGN.md §2's window rule:
    ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``, -1 leaving a side unbounded;
    causal sets right = 0. Raises as ``attention`` does (interface._check_window: TypeError for a side that is not an
    int, ValueError for one below -1 or causal with a right side above 0; TypeError for a causal that is not a bool),
    so that a reference is never computed under a rule the kernels do not have; TypeError / ValueError for a seqlen
    that is not an int >= 0 (torch's own errors named neither)."""
    for name, n in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, (numbers.Integral, torch.SymInt)):  # (SymInt: a traced shape)
            raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"{name} must be >= 0, got {n}")
    left, right = _check_window(window_size, _check_causal(causal))
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    diag = i + (seqlen_k - seqlen_q)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    return visible


def document_mask(document_ids):
    """Boolean (batch, seqlen, seqlen), True where positions i and j lie in one run of equal consecutive ids (one
    document of ``flash_attn_hopper.attention``'s document_ids). Raises as ``attention`` does: TypeError for a
    document_ids that is not a tensor of an integer dtype (float ids were truncated: 0.2 and 0.7 one document),
    ValueError for one that is not (batch, seqlen)."""
    if not isinstance(document_ids, torch.Tensor):
        raise TypeError(f"document_ids must be a torch.Tensor, got {type(document_ids).__name__}")
    _check_document_ids_dtype(document_ids)
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must have shape (batch, seqlen), got {tuple(document_ids.shape)}")
    ids = document_ids.long()
    run = torch.cat([torch.zeros_like(ids[:, :1]), (ids[:, 1:] != ids[:, :-1]).long()], dim=1).cumsum(1)
    return run.unsqueeze(2) == run.unsqueeze(1)


def _scores(q, k, scale, causal, window_size, softcap, document_ids=None):
    """Masked scores (batch, nheads, seqlen_q, seqlen_k): scale * Q Kᵀ, soft-capped, -inf outside the mask."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    # Checked whatever the values: (-1.0, -1.0), an array or a tensor compare equal to (-1, -1), and attention
    # refuses them.
    if causal or _check_window(window_size, causal) != (-1, -1):
        mask = local_mask(q.shape[1], k.shape[1], window_size, causal, device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    if document_ids is not None:
        scores = scores.masked_fill(~document_mask(document_ids.to(q.device)).unsqueeze(1), float("-inf"))
    return scores


def repeat_kv(k, nheads):
    """GQA/MQA: (batch, seqlen, nheads_k, head_dim) -> (batch, seqlen, nheads, head_dim), query head h reading
    K/V head h // (nheads // nheads_k). The identity when nheads_k == nheads. Raises ValueError unless nheads_k
    divides nheads (a repeat by nheads // nheads_k would give another number of heads)."""
    nheads_k = k.shape[2]
    if nheads_k == nheads:
        return k
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"k has {nheads_k} heads, which does not divide nheads {nheads}")
    return k.repeat_interleave(nheads // nheads_k, dim=2)


def _check_shapes(q, k, v, dout=None, dlse=None, document_ids=None, varlen=False):
    """The shape rules of ``attention`` (``attention_varlen`` with varlen=True) for the references, ValueError naming
    the argument: einsum, the masks and the elementwise products broadcast size-1 dimensions, so a k or v of batch 1,
    a k with one key or a head_dim of 1, a dout or dlse of batch 1, or document_ids of shape (1, seqlen) were taken
    silently, computing a reference under a rule the kernels refuse (and a check against it that cannot fail)."""
    rank = 3 if varlen else 4
    layout = "(total_tokens, nheads, head_dim)" if varlen else "(batch, seqlen, nheads, head_dim)"
    optional = (("dout", dout), ("dlse", dlse), ("document_ids", document_ids))
    for name, t in (("q", q), ("k", k), ("v", v), *((n, t) for n, t in optional if t is not None)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    # The dtypes as ``attention`` takes them (one dtype for q, k and v; integer document_ids), float32 and float64 added:
    # mixed q, k, v were upcast together into a float32 reference of a call the kernels refuse (the gradient
    # references cast k and v to q's dtype, also bf16 into fp16), or failed inside einsum naming no argument; float
    # document_ids were truncated to integers (0.2 and 0.7 one document).
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _REFERENCE_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; the references take torch.float16, torch.bfloat16 (what "
                            "attention takes), torch.float32 or torch.float64")
    _check_same_dtype(q, k, v)
    if document_ids is not None:
        _check_document_ids_dtype(document_ids)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(t.shape)}")
    # attention_varlen checks its rank-3 tensors as one batch element too
    _check_shapes_agree(*((t.unsqueeze(0) for t in (q, k, v)) if varlen else (q, k, v)), varlen=varlen)
    nheads = q.shape[-2]
    if dout is not None and tuple(dout.shape) != (*q.shape[:-1], v.shape[-1]):
        raise ValueError(f"dout must have out's shape {(*q.shape[:-1], v.shape[-1])}, got {tuple(dout.shape)}")
    lse_shape = (nheads, q.shape[0]) if varlen else (q.shape[0], nheads, q.shape[1])
    if dlse is not None and tuple(dlse.shape) != lse_shape:
        raise ValueError(f"dlse must have the LSE's shape {lse_shape}, got {tuple(dlse.shape)}")
    if document_ids is not None:
        _check_document_ids_shape(document_ids, q, k)


def _check_options(q, softmax_scale, causal, softcap):
    """softmax_scale, causal and softcap as ``attention`` checks them (TypeError / ValueError naming the argument);
    returns (softmax_scale with its default resolved, causal, softcap). The references took any value: a scale of 0
    (a uniform softmax) or below, a negative or NaN softcap (ignored: ``softcap > 0`` is False), an infinite one (NaN
    everywhere), True as 1.0, a causal of any truthy value; each a reference for a rule the kernels do not have, which
    a kernel's test would then be compared with."""
    softmax_scale = _check_scale(softmax_scale, q.shape[-1])
    return softmax_scale, _check_causal(causal), _check_softcap(softcap, softmax_scale)


def _check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k):
    """cu_seqlens as ``attention_varlen`` takes them (1-D, equal lengths, from >= 0, non-decreasing, within the rows);
    returns both as lists. Slicing clips offsets past the rows and the loop ignored extra entries of cu_seqlens_k, so
    such values gave a reference for other sequences than the ones named."""
    values = []
    for name, cu, rows in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor of length batch + 1, got {cu.dtype} "
                             f"{tuple(cu.shape)}")
        c = cu.tolist()
        if c[0] < 0 or any(b < a for a, b in zip(c, c[1:])) or c[-1] > rows:
            raise ValueError(f"{name} must be non-decreasing offsets in [0, {rows}] (the rows of {name[-1]}), "
                             f"got {c}")
        values.append(c)
    if len(values[0]) != len(values[1]):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{len(values[0])} and {len(values[1])}")
    return values


@_in_reference_mode
def attention_ref(q, k, v, softmax_scale=None, causal=False, upcast=True, window_size=(-1, -1), softcap=0.0,
                  document_ids=None):
    """Plain attention in the layout of flash_attn_hopper.attention.

    q: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads_k, head_dim), nheads_k dividing
    nheads (GQA/MQA: K/V heads repeated, so autograd sums dK/dV over each group); v's head_dim may differ (out has
    v's).
    upcast=True computes in float32 (float64 inputs stay float64); upcast=False computes in the input dtype,
    the naive same-precision reference whose error sets the tolerance.
    window_size, softcap and document_ids as ``flash_attn_hopper.attention`` (scores ``softcap * tanh(S / softcap)``,
    then the mask).
    Returns (out in the compute dtype, lse float32 (batch, nheads, seqlen_q)). A row that sees no key gets
    output 0 and LSE -inf. Raises ValueError, naming the argument, for shapes ``attention`` refuses (batch, seqlen_k,
    heads or head_dim that differ, document_ids not (batch, seqlen)): broadcasting them gave a reference for another
    problem. The gradient references check dout (out's shape) and dlse (the LSE's) the same way. Raises TypeError /
    ValueError, as ``attention`` does, for q, k, v of different dtypes, document_ids of a floating dtype, and
    softmax_scale, causal or softcap values that ``attention`` refuses (float32 and float64 inputs are taken).
    """
    upcast = _check_bool("upcast", upcast)
    _check_shapes(q, k, v, document_ids=document_ids)
    scale, causal, softcap = _check_options(q, softmax_scale, causal, softcap)
    if upcast and q.dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    scores = _scores(q, k, scale, causal, window_size, softcap, document_ids)
    fscores = scores if scores.dtype == torch.float64 else scores.float()
    empty = torch.isneginf(fscores).all(dim=-1)
    # logsumexp of an all -inf row is -inf with a NaN gradient; such rows get LSE -inf and no gradient through it.
    lse = torch.logsumexp(fscores.masked_fill(empty.unsqueeze(-1), 0.0), dim=-1).masked_fill(empty, float("-inf"))
    empty = torch.isneginf(lse)
    # softmax of an all -inf row is NaN; such a row attends to nothing and its output is 0.
    attn = torch.softmax(scores, dim=-1).masked_fill(empty.unsqueeze(-1), 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", attn.to(v.dtype), v)
    return out, lse.float()


def max_abs_err(a, b):
    """Max |a - b| over finite-or-not elements (equal infinities differ by 0); NaN if either holds a NaN, also at a
    position where the other holds one (a NaN never counts as agreement). a and b must have one shape (ValueError
    otherwise: broadcasting compared, e.g., a reference of batch 1 with every batch element)."""
    if a.shape != b.shape:
        raise ValueError(f"max_abs_err compares tensors of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    a = a.double()
    b = b.double()
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    diff = (a - b).abs().masked_fill(both_inf, 0.0)
    if torch.isnan(diff).any():
        return float("nan")
    return diff.max().item() if diff.numel() else 0.0


def assert_close_by_rule(out, ref, ref_naive, name, floor=None):
    """DESIGN.md §3: max|out - ref| <= 2 * max|ref_naive - ref| + floor, with NaN never passing.

    The default floor is 1e-5 (float32 outputs) or 1e-4 (others) times max(1, max|ref|).

    ref is the float32 reference; ref_naive the same math run in the input dtype, of ref's shape (ValueError
    otherwise: a broadcast naive error bounds nothing). Infinities must match exactly. A floor given must be a finite
    real number >= 0 (TypeError / ValueError otherwise: an infinite floor, e.g. one computed from a reference that
    holds an infinite LSE, passed every output, NaN included in its error bound's place).
    """
    if floor is not None:
        if isinstance(floor, bool) or not isinstance(floor, numbers.Real):
            raise TypeError(f"{name}: floor must be a real number (float or int) or None, got {type(floor).__name__}")
        if not 0 <= floor < math.inf:  # (a NaN fails both)
            raise ValueError(f"{name}: floor must be finite and >= 0 (None: the default), got {floor}; an infinite "
                             "floor bounds nothing (one computed from a reference holding an infinite LSE?)")
        floor = float(floor)
    if ref_naive.shape != ref.shape:
        raise ValueError(f"{name}: ref_naive has shape {tuple(ref_naive.shape)} but ref has {tuple(ref.shape)}; the "
                         "naive reference must be the same computation as ref, in the input dtype")
    if floor is None:
        # Rounding noise of the output format, relative to the values' magnitude (an fp32 LSE near -115 has an
        # ulp of 7.6e-6): about 80 float32 ulps, or a fraction of one fp16/bf16 ulp.
        scale = max(1.0, ref.double().abs().masked_fill(torch.isinf(ref), 0).max().item() if ref.numel() else 1.0)
        floor = (1e-5 if out.dtype == torch.float32 else 1e-4) * scale
    # Explicit raises, not `assert`: Python drops assert statements under -O / PYTHONOPTIMIZE, and pytest rewrites
    # only test modules, so this check (and every test built on it) passed whatever `out` held.
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    if torch.isnan(out).any():
        raise AssertionError(f"{name}: holds NaN")
    inf_mismatch = (torch.isinf(out) | torch.isinf(ref)) & (out.double() != ref.double())
    if inf_mismatch.any():
        raise AssertionError(f"{name}: infinities differ from the reference at {inf_mismatch.nonzero()[:5].tolist()}")
    err = max_abs_err(out, ref)
    base = max_abs_err(ref_naive, ref)
    # An infinite or NaN naive error would make the bound vacuous.
    if not math.isfinite(base):
        raise AssertionError(f"{name}: the naive reference differs from the reference by {base}; no usable bound")
    tol = 2 * base + floor
    if not err <= tol:  # (a NaN error fails)
        raise AssertionError(f"{name}: max abs error {err:.3e} > 2 x naive error {base:.3e} + {floor:.0e}")
    return err, base


@_in_reference_mode
def attention_ref_grads(
    q, k, v, dout, softmax_scale=None, causal=False, upcast=True, window_size=(-1, -1), softcap=0.0, dlse=None,
    document_ids=None,
):
    """(dq, dk, dv) of ``attention_ref`` by torch autograd, for the output gradient ``dout``.

    upcast=True differentiates the float32 reference (fp16/bf16 inputs and dout are upcast; float64 stays float64);
    upcast=False differentiates the naive reference in the input dtype, whose error sets the tolerance of
    ``assert_close_by_rule``. The inputs are not modified and need not require grad. A row that sees no key gets a
    dq row of 0 and adds nothing to dk, dv (the masked_fill of ``attention_ref`` cuts the softmax's NaN gradient).
    dlse: optional gradient of the loss with respect to the LSE (batch, nheads, seqlen_q), added to the graph's
    output gradients (rows with LSE -inf take none: they have no scores to pass it to).
    """
    upcast = _check_bool("upcast", upcast)
    _check_shapes(q, k, v, dout, dlse, document_ids)
    compute = torch.float32 if upcast and q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    # (under torch.inference_mode() enable_grad alone records nothing: "element 0 of tensors does not require grad")
    with torch.inference_mode(False), torch.enable_grad():
        leaves = [_grad_leaf(t, compute) for t in (q, k, v)]
        out, lse = attention_ref(
            *leaves, softmax_scale=softmax_scale, causal=causal, upcast=upcast, window_size=window_size, softcap=softcap,
            document_ids=document_ids,
        )
        outputs, grads = [out], [dout.to(out.dtype)]
        if dlse is not None:
            outputs.append(lse)
            grads.append(dlse.to(lse.dtype))
        dq, dk, dv = torch.autograd.grad(outputs, leaves, grads)
    return dq, dk, dv


@_in_reference_mode
def attention_bwd_ref(
    q, k, v, dout, softmax_scale=None, causal=False, upcast=True, window_size=(-1, -1), softcap=0.0, dlse=None
):
    """The backward pass written from its equations, without autograd: FlashAttention-3 paper (Shah et al., 2024),
    §2.1, and DESIGN.md §1. Per batch element and head, with α = softmax_scale:

        S = α Q Kᵀ (bottom-right causal mask: -inf where j > i + seqlen_k - seqlen_q)
        P = exp(S - LSE)            (recomputed from the row log-sum-exp, as the kernels do)
        O = P V
        dV = Pᵀ dO
        dP = dO Vᵀ
        D = rowsum(dO ∘ O)          (equals rowsum(P ∘ dP))
        dS = P ∘ (dP - D + dLSE)    (dLSE: the loss's gradient with respect to the LSE, when it uses it)
        dQ = α dS K
        dK = α dSᵀ Q

    With a softcap c the scores are c·tanh(X / c), X = α Q Kᵀ, and dS is multiplied by 1 − tanh²(X / c) before the
    two last lines. Windows mask like ``local_mask``.

    A row that sees no key has LSE -inf and P = 0 (not exp(-inf + inf) = NaN), so its dQ row is 0 and it adds
    nothing to dK and dV. Layouts as ``attention_ref``: q (batch, seqlen_q, nheads, head_dim), k and v
    (batch, seqlen_k, nheads_k, head_dim) (GQA/MQA: dK and dV summed over the query heads of each group; v may have
    its own head_dim), dout like the output. upcast=True computes in float32 (float64 stays float64);
    upcast=False in the input dtype. Returns (dq, dk, dv) in the compute dtype. Refuses, as ``attention_ref``, shapes,
    dtypes and option values ``attention`` refuses.
    """
    upcast = _check_bool("upcast", upcast)
    _check_shapes(q, k, v, dout, dlse)
    alpha, causal, softcap = _check_options(q, softmax_scale, causal, softcap)
    if upcast and q.dtype in (torch.float16, torch.bfloat16):
        q, k, v, dout = q.float(), k.float(), v.float(), dout.float()
    dout = dout.to(q.dtype)
    batch, seqlen_k, nheads_k, head_dim = k.shape
    head_dim_v = v.shape[-1]  # may differ from head_dim: dv, dout and o have it
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    s = _scores(q, k, alpha, causal, window_size, softcap)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)  # (b, h, q, 1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - lse.masked_fill(empty, 0.0)).masked_fill(empty, 0.0)
    o = torch.einsum("bhqk,bkhd->bqhd", p, v)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, v)
    d = (dout * o).sum(dim=-1).transpose(1, 2).unsqueeze(-1)  # (b, h, q, 1)
    if dlse is not None:
        d = d - dlse.to(d.dtype).unsqueeze(-1)
    ds = p * (dp - d)
    if softcap > 0:
        t = torch.tanh(torch.einsum("bqhd,bkhd->bhqk", q, k) * alpha / softcap)
        ds = ds * (1 - t * t)
    dq = alpha * torch.einsum("bhqk,bkhd->bqhd", ds, k)
    dk = alpha * torch.einsum("bhqk,bqhd->bkhd", ds, q)
    group = q.shape[2] // max(nheads_k, 1)
    dk = dk.reshape(batch, seqlen_k, nheads_k, group, head_dim).sum(dim=3)
    dv = dv.reshape(batch, seqlen_k, nheads_k, group, head_dim_v).sum(dim=3)
    return dq, dk, dv


@_in_reference_mode
def attention_varlen_ref(
    q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, upcast=True, window_size=(-1, -1),
    softcap=0.0,
):
    """``attention_ref`` per sequence of a packed variable-length batch (layout of
    ``flash_attn_hopper.attention_varlen``): q (total_q, nheads, head_dim), k/v (total_k, nheads_k, head_dim), cu_seqlens
    int32 (batch + 1). Returns (out (total_q, nheads, head_dim) in the compute dtype, lse float32 (nheads, total_q));
    rows that no sequence covers get output 0 and LSE -inf. Differentiable (autograd flows per sequence). Raises
    ValueError, naming the argument, for shapes and cu_seqlens ``attention_varlen`` refuses (cu_seqlens of different
    lengths, negative, decreasing or past the rows; any integer dtype is taken), and, as ``attention_ref``, TypeError /
    ValueError for mixed dtypes and option values ``attention_varlen`` refuses (also with no sequence)."""
    upcast = _check_bool("upcast", upcast)
    _check_shapes(q, k, v, varlen=True)
    _check_options(q, softmax_scale, causal, softcap)  # (also where no sequence would reach attention_ref's check)
    _check_window(window_size, causal)
    cq, ck = _check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k)
    compute = torch.float32 if upcast and q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    total_q, nheads, head_dim = q.shape
    outs, lses = [], []
    covered = 0
    for b in range(len(cq) - 1):
        (q0, q1), (k0, k1) = (cq[b], cq[b + 1]), (ck[b], ck[b + 1])
        # rows between sequences (a first offset > 0) belong to none
        outs.append(torch.zeros(q0 - covered, nheads, v.shape[-1], dtype=compute, device=q.device))
        lses.append(torch.full((nheads, q0 - covered), float("-inf"), dtype=torch.float32, device=q.device))
        o, lse = attention_ref(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale=softmax_scale, causal=causal, upcast=upcast,
            window_size=window_size, softcap=softcap,
        )
        outs.append(o[0].to(compute))
        lses.append(lse[0])
        covered = q1
    outs.append(torch.zeros(total_q - covered, nheads, v.shape[-1], dtype=compute, device=q.device))
    lses.append(torch.full((nheads, total_q - covered), float("-inf"), dtype=torch.float32, device=q.device))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


@_in_reference_mode
def attention_varlen_ref_grads(q, k, v, dout, cu_seqlens_q, cu_seqlens_k, upcast=True, dlse=None, **kwargs):
    """(dq, dk, dv) of ``attention_varlen_ref`` by autograd for output gradient dout (and LSE gradient dlse, as in
    ``attention_ref_grads``); kwargs as ``attention_varlen_ref``."""
    upcast = _check_bool("upcast", upcast)
    _check_shapes(q, k, v, dout, dlse, varlen=True)
    compute = torch.float32 if upcast and q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    with torch.inference_mode(False), torch.enable_grad():  # (as attention_ref_grads)
        leaves = [_grad_leaf(t, compute) for t in (q, k, v)]
        out, lse = attention_varlen_ref(*leaves, cu_seqlens_q, cu_seqlens_k, upcast=upcast, **kwargs)
        outputs, grads = [out], [dout.to(out.dtype)]
        if dlse is not None:
            outputs.append(lse)
            grads.append(dlse.to(lse.dtype))
        return tuple(torch.autograd.grad(outputs, leaves, grads, allow_unused=False))
