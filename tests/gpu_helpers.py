"""Helpers shared by the GPU test modules: what this build compiles, random CUDA
inputs, and a NaN-poisoned caching allocator so that memory a kernel never writes shows up as NaN.

The checks raise AssertionError explicitly instead of using `assert`: pytest rewrites the asserts of test modules
only, so under `python -O` / PYTHONOPTIMIZE the asserts of a helper module vanish and every test built on them passes
whatever the kernels return (tests/bug_report_sources.md, class DS)."""

import contextlib
import os
import zlib

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper.interface import kernel_head_dim

# What a child Python process runs first, so that it imports the package this process tests (installed, or the built
# source tree) ahead of anything else.
CHILD_PRELUDE = (f"import sys; sys.path.insert(0, "
                 f"{os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_hopper.__file__)))!r})\n")
TESTS = os.path.dirname(os.path.abspath(__file__))


def run_child(script, *args, name, timeout, env=None):
    """Runs `script` (Python source; CHILD_PRELUDE and this folder on sys.path first, so it can import the test
    modules) with `args` in a fresh interpreter, in the repository root, with `env` (default: this process's). A
    child that exits 0 after printing a line "SKIP: why" skips the test with that reason; past `timeout` seconds (a
    hang), a non-zero exit or no "done" in its output fails it, named `name`. Returns the child's stdout."""
    import subprocess
    import sys

    source = CHILD_PRELUDE + f"sys.path.insert(0, {TESTS!r})\n" + script
    try:
        r = subprocess.run([sys.executable, "-c", source, *args], capture_output=True, text=True, timeout=timeout,
                           env=env, cwd=os.path.dirname(TESTS))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{name}: the child ran past {timeout} s (a hang)\n{e.stdout}\n{e.stderr}")
    for line in r.stdout.splitlines() if r.returncode == 0 else ():
        if line.startswith("SKIP: "):
            pytest.skip(line[len("SKIP: "):])
    if not (r.returncode == 0 and "done" in r.stdout):
        raise AssertionError(f"{name}: rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return r.stdout

DTYPES = [torch.float16, torch.bfloat16]


def _kernels_built(head_dim, cfg):
    return all(kernel_head_dim(head_dim, backward=b) in cfg["head_dims"] for b in (False, True))


def require_built(head_dim, dtype):
    """Skip unless this build compiles (head_dim, dtype); a head_dim between the kernel sizes needs the forward and
    backward kernels that run it (interface.kernel_head_dim)."""
    cfg = flash_attn_hopper.build_config()
    if not _kernels_built(head_dim, cfg) or dtype not in cfg["dtypes"]:
        pytest.skip(f"head_dim {head_dim} / {dtype} not in this build (FAH_HDIMS/FAH_DTYPES)")


def built_dtype(head_dim):
    """A dtype this build compiles for head_dim (fp16 preferred), else skip."""
    cfg = flash_attn_hopper.build_config()
    for dtype in DTYPES:
        if _kernels_built(head_dim, cfg) and dtype in cfg["dtypes"]:
            return dtype
    pytest.skip(f"head_dim {head_dim} not in this build (FAH_HDIMS/FAH_DTYPES)")


def poison_allocator(*nbytes):
    """Fill the CUDA caching allocator with NaN: allocate blocks of these sizes on the current stream, fill them
    with 0xFF bytes (NaN in fp16, bf16 and fp32) and free them, so the next allocations of these sizes on this
    stream (a kernel's fresh outputs and workspaces) reuse NaN-filled memory. Synchronizes the device (empty_cache)."""
    torch.cuda.empty_cache()  # drop other cached blocks, so the poisoned ones are the best fit
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda") for n in nbytes if n > 0]
    del blocks


def randn(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, device="cuda")


# ------------------------------------------------------------------ attention runs checked by the rule (head-dim tests)

BWD_SEQLEN_Q_ROUNDING = 128  # csrc/flash/config.hpp kBwdSeqlenQRounding
GRAD_NAMES = ("dq", "dk", "dv")


@contextlib.contextmanager
def ambient_defaults(device=None, dtype=None):
    """torch.set_default_device(device) and torch.set_default_dtype(dtype) for the block (None: that one left as it
    is), restored after it."""
    old_dtype, old_device = torch.get_default_dtype(), torch.get_default_device()
    if device is not None:
        torch.set_default_device(device)
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        if device is not None:
            # (cpu: the unset state, not a device mode pushed for every factory call)
            torch.set_default_device(None if old_device.type == "cpu" else old_device)
        torch.set_default_dtype(old_dtype)


def attention_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, head_dim_v=None):
    """Random q, k (head_dim) and v, dout (head_dim_v, default head_dim) on the GPU."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k = randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    v = randn(batch, seqlen_k, nheads_k, head_dim_v, dtype=dtype)
    dout = randn(batch, seqlen_q, nheads, head_dim_v, dtype=dtype)
    return q, k, v, dout


def poison_attention_memory(q, v, cu_seqlens_q=None):
    """NaN into the caching allocator at the sizes the forward and backward allocate: out / dout-like (v's head dim),
    dQ, dK, dV, LSE and the backward's workspaces (the dQ accumulator at the kernel's padded width, LSE / D rows). A
    packed varlen q (total_q, nheads, head_dim) takes its cu_seqlens_q: the workspaces then hold, per head, the rows
    up to cu_seqlens_q[-1] plus a whole tile per sequence (the op's layout, csrc/api/flash_api.cpp)."""
    e = q.element_size()
    if q.dim() == 4:
        batch, seqlen_q, nheads, head_dim = q.shape
        tokens = batch * seqlen_q
        rows = batch * nheads * (-(-seqlen_q // BWD_SEQLEN_Q_ROUNDING) * BWD_SEQLEN_Q_ROUNDING)
    else:
        tokens, nheads, head_dim = q.shape
        nseq, seen = (1, tokens) if cu_seqlens_q is None else (len(cu_seqlens_q) - 1, int(cu_seqlens_q[-1]))
        per_head = seen + nseq * BWD_SEQLEN_Q_ROUNDING
        rows = nheads * (-(-per_head // BWD_SEQLEN_Q_ROUNDING) * BWD_SEQLEN_Q_ROUNDING)
    dk_bytes = v.numel() // v.shape[-1] * head_dim * e  # k's size: head_dim may differ from head_dim_v
    poison_allocator(q.numel() * e, tokens * nheads * v.shape[-1] * e, v.numel() * e, dk_bytes, tokens * nheads * 4,
                     rows * kernel_head_dim(max(head_dim, v.shape[-1]), backward=True) * 4, rows * 4)


def run_attention(q, k, v, dout, dlse=None, **opts):
    """(out, lse, (dq, dk, dv)) of attention on leaves that require grad, memory poisoned before each pass; the loss
    also uses lse when dlse is given."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    poison_attention_memory(q, v)
    out, lse = flash_attn_hopper.attention(*leaves, return_lse=True, **opts)
    poison_attention_memory(q, v)
    outputs, grads_out = ([out, lse], [dout, dlse]) if dlse is not None else ([out], [dout])
    grads = torch.autograd.grad(outputs, leaves, grads_out)
    return out.detach(), lse.detach(), grads


def run_attention_varlen(q, k, v, dout, cu_q, cu_k, max_q, max_k, dlse=None, **opts):
    """run_attention's varlen twin: (out, lse, (dq, dk, dv)) of attention_varlen, memory poisoned before each pass."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    poison_attention_memory(q, v, cu_q)
    out, lse = flash_attn_hopper.attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, return_lse=True, **opts)
    poison_attention_memory(q, v, cu_q)
    outputs, grads_out = ([out, lse], [dout, dlse]) if dlse is not None else ([out], [dout])
    grads = torch.autograd.grad(outputs, leaves, grads_out)
    return out.detach(), lse.detach(), grads


def _reference_opts(opts):
    """The call's options the references take (deterministic changes the kernels' summation order, not the math)."""
    return {key: val for key, val in opts.items() if key != "deterministic"}


def check_attention(out, lse, grads, q, k, v, dout, name, dlse=None, **opts):
    """O, LSE, dQ, dK, dV by the rule against the float32 reference; shapes, dtypes and finiteness."""
    from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_ref_grads

    if not (out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype):
        raise AssertionError(name)
    opts = _reference_opts(opts)
    ref, ref_lse = attention_ref(q, k, v, upcast=True, **opts)
    naive, naive_lse = attention_ref(q, k, v, upcast=False, **opts)
    assert_close_by_rule(out, ref, naive, f"{name} out")
    assert_close_by_rule(lse, ref_lse, naive_lse, f"{name} lse")
    ref_g = attention_ref_grads(q, k, v, dout, upcast=True, dlse=dlse, **opts)
    naive_g = attention_ref_grads(q, k, v, dout, upcast=False, dlse=dlse, **opts)
    for gname, g, t, r, n in zip(GRAD_NAMES, grads, (q, k, v), ref_g, naive_g):
        if not (g.shape == t.shape and g.dtype == t.dtype):
            raise AssertionError(f"{name} {gname}")
        if not torch.isfinite(n).all():
            raise AssertionError(f"{name} {gname}: the naive reference is not finite")
        assert_close_by_rule(g, r, n, f"{name} {gname}")


def check_deterministic(q, k, v, dout, name):
    """Causal attention with deterministic=True: three backward passes give bitwise-equal dQ, dK, dV, and the right
    answer by the rule."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, lse = flash_attn_hopper.attention(*leaves, causal=True, deterministic=True, return_lse=True)
    runs = [torch.autograd.grad(out, leaves, dout, retain_graph=True) for _ in range(3)]
    for r in runs[1:]:
        for gname, a, b in zip(GRAD_NAMES, runs[0], r):
            if not torch.equal(a, b):
                raise AssertionError(f"{name}: {gname} differs between deterministic runs")
    check_attention(out.detach(), lse, runs[0], q, k, v, dout, name, causal=True)


def check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, name, dlse=None, **opts):
    """attention_varlen's out, LSE, dQ, dK, dV by the rule against the float32 reference run per sequence, with their
    shapes and dtypes; rows that see no key: output and dQ exactly 0 (LSE -inf by the rule, whose infinities must
    match)."""
    from flash_attn_hopper.testing import assert_close_by_rule, attention_varlen_ref, attention_varlen_ref_grads

    if not (out.shape == (q.shape[0], q.shape[1], v.shape[-1]) and out.dtype == q.dtype):
        raise AssertionError(name)
    if not (lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32):
        raise AssertionError(name)
    opts = _reference_opts(opts)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=True, **opts)
    naive, naive_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, **opts)
    assert_close_by_rule(out, ref, naive, f"{name} out")
    assert_close_by_rule(lse, ref_lse, naive_lse, f"{name} lse")
    empty = torch.isneginf(lse).transpose(0, 1)  # (total_q, nheads)
    if empty.any():
        for what, t in (("out", out), ("dq", grads[0])):
            rows = t[empty]
            if not torch.equal(rows, torch.zeros_like(rows)):
                raise AssertionError(f"{name}: {what} rows that see no key are not exactly 0")
    ref_g = attention_varlen_ref_grads(q, k, v, dout, cu_q, cu_k, upcast=True, dlse=dlse, **opts)
    naive_g = attention_varlen_ref_grads(q, k, v, dout, cu_q, cu_k, upcast=False, dlse=dlse, **opts)
    for gname, g, t, r, n in zip(GRAD_NAMES, grads, (q, k, v), ref_g, naive_g):
        if not (g.shape == t.shape and g.dtype == t.dtype):
            raise AssertionError(f"{name} {gname}")
        if not torch.isfinite(n).all():
            raise AssertionError(f"{name} {gname}: the naive reference is not finite")
        assert_close_by_rule(g, r, n, f"{name} {gname}")


def check_grads_where_required(leaves, which, ref, naive, dtype, name, may_be_zero=""):
    """After a backward through leaves {"q", "k", "v"} of which only those named in `which` require grad: those get
    gradients of their shape and dtype, right by the rule against ref / naive (dQ, dK, dV); the others none. A leaf
    named in may_be_zero, which the loss does not depend on (v under a loss on the LSE alone), may instead get none
    or an exact 0."""
    from flash_attn_hopper.testing import assert_close_by_rule

    for i, leaf in enumerate("qkv"):
        grad = leaves[leaf].grad
        if leaf in which and leaf in may_be_zero:
            if grad is not None and not torch.equal(grad, torch.zeros_like(grad)):
                raise AssertionError(f"{name}: d{leaf} is not 0, though the loss does not depend on {leaf}")
        elif leaf in which:
            if not (grad is not None and grad.shape == leaves[leaf].shape and grad.dtype == dtype):
                raise AssertionError(f"{name}: d{leaf}")
            assert_close_by_rule(grad, ref[i], naive[i], f"{name}: d{leaf}")
        else:
            if grad is not None:
                raise AssertionError(f"{name}: {leaf} does not require grad but got a gradient")


def check_varlen(head_dim, head_dim_v, nheads_k, dtype, name, **opts):
    """attention_varlen forward and backward over five sequences of awkward lengths (empty ones on either side), 4
    query heads, memory poisoned before each pass; out, LSE, dQ, dK, dV and their shapes by the rule against the
    float32 reference, and rows that see no key (check_attention_varlen)."""
    lq, lk = [1, 300, 129, 0, 64], [5, 257, 129, 33, 0]
    total_q, total_k, nheads = sum(lq), sum(lk), 4
    q = randn(total_q, nheads, head_dim, dtype=dtype)
    k = randn(total_k, nheads_k, head_dim, dtype=dtype)
    v = randn(total_k, nheads_k, head_dim_v, dtype=dtype)
    dout = randn(total_q, nheads, head_dim_v, dtype=dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    e = q.element_size()
    sizes = (q.numel() * e, k.numel() * e, v.numel() * e, dout.numel() * e)
    poison_allocator(*sizes, total_q * nheads * 4)
    out, lse = flash_attn_hopper.attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), return_lse=True, **opts)
    poison_allocator(*sizes)
    grads = torch.autograd.grad(out, leaves, dout)
    check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, dout, cu_q, cu_k, f"{name} varlen", **opts)


def seeded_generator(name):
    """A CPU torch.Generator seeded from name (stable across runs and processes, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def bits(t):
    """A bitwise copy (NaN == NaN) of t's memory, to compare with torch.equal."""
    return t.detach().contiguous().view(torch.int16).clone()


def cu_seqlens(lengths, device="cuda"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def assert_same_bits(a, b, name, why=""):
    """a and b hold the same shape, dtype and bits (NaN == NaN); AssertionError naming `name` and how many elements
    differ otherwise, with `why` (what a difference would mean) appended."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{name}: {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}{why}")
    if not torch.equal(bits(a), bits(b)):
        raise AssertionError(f"{name}: {int((bits(a) != bits(b)).sum())} elements differ{why}")


def in_canary_buffer(t, before, after):
    """(buffer, view): a copy of t living in a NaN-filled flat buffer, `before` elements (a multiple of 8: 16-byte
    alignment) ahead of it and `after` elements behind it."""
    buf = torch.full((before + t.numel() + after,), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[before : before + t.numel()].view(t.shape)
    view.copy_(t)
    return buf, view


def memcheck_script(cases, lse_in_loss):
    """Python source for run_memcheck: for each (head_dim, head_dim_v, nheads_k, dtype name) a causal forward and
    backward of a (2, 131) x (2, 77) batch in both deterministic modes (the loss also uses lse when lse_in_loss), then
    the same tensors' first rows as a two-sequence varlen batch."""
    loss = ("out, lse = attention(q, k, v, causal=True, deterministic=deterministic, return_lse=True)\n"
            "        ((out * torch.randn_like(out)).sum() + lse.sum()).backward()" if lse_in_loss else
            "out = attention(q, k, v, causal=True, deterministic=deterministic)\n"
            "        out.backward(torch.randn_like(out))")
    return f"""
import torch
from flash_attn_hopper import attention, attention_varlen
torch.manual_seed(0)
for head_dim, head_dim_v, nheads_k, dtype in {tuple(cases)!r}:
    dtype = getattr(torch, dtype)
    q = torch.randn(2, 131, 4, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, 77, nheads_k, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 77, nheads_k, head_dim_v, device="cuda", dtype=dtype, requires_grad=True)
    for deterministic in (False, True):
        {loss}
    cu = torch.tensor([0, 100, 131], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 50, 77], dtype=torch.int32, device="cuda")
    qv, kv, vv = (t.detach()[0].clone().requires_grad_(True) for t in (q, k, v))
    out = attention_varlen(qv, kv, vv, cu, cu_k, 100, 50)
    out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print("done")
"""


def in_canary_buffers(q, k, v, dout):
    """q, k, v, dout copied into NaN-filled buffers (0, 8, 64 and 256 elements ahead, 4096 behind): (views, check),
    where check(out, lse, grads) asserts that no buffer element changed and that no NaN (a read past a tensor)
    reached the results."""
    placed = [in_canary_buffer(t, before, after=4096) for t, before in zip((q, k, v, dout), (0, 8, 64, 256))]
    buffers = [b for b, _ in placed]
    saved = [bits(b) for b in buffers]

    def check(out, lse, grads):
        torch.cuda.synchronize()
        for b, s in zip(buffers, saved):
            if not torch.equal(bits(b), s):
                raise AssertionError("a canary buffer changed")
        if not (torch.isfinite(out).all() and not torch.isnan(lse).any()):
            raise AssertionError("NaN: something past a tensor was read")
        for g in grads:
            if not torch.isfinite(g).all():
                raise AssertionError("NaN: something past a tensor was read")

    return [view for _, view in placed], check


def run_memcheck(script):
    """Runs `script` (Python source) under compute-sanitizer memcheck with the caching allocator off (every tensor its
    own allocation, so an access past one is reported); asserts it finished with 0 errors. Skips without the tool."""
    run_sanitizer(script, "memcheck")


# What each tool prints when it found nothing (racecheck counts hazards, the other tools errors).
_SANITIZER_CLEAN = {
    "memcheck": "ERROR SUMMARY: 0 errors",
    "synccheck": "ERROR SUMMARY: 0 errors",
    "racecheck": "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)",
}


def run_sanitizer(script, tool, env=None, timeout=140):
    """Runs `script` (Python source) under compute-sanitizer's `tool` (memcheck, racecheck or synccheck) with the
    caching allocator off and `env` (a dict) added to the environment; asserts the script finished and the tool
    reported nothing (racecheck: no hazard, errors and warnings counted). Skips without compute-sanitizer. The time
    limit (seconds; a hang raises subprocess.TimeoutExpired) stays under the GPU check's 150 s per-test guard."""
    import os
    import shutil
    import subprocess
    import sys

    exe = shutil.which("compute-sanitizer") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin",
                                                            "compute-sanitizer")
    if not os.path.exists(exe):
        pytest.skip("compute-sanitizer not found (CUDA toolkit bin/ not on PATH and not under CUDA_HOME)")
    args = {"racecheck": ["--racecheck-report", "all"]}.get(tool, [])
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", **(env or {}))
    r = subprocess.run(
        [exe, "--tool", tool, *args, "--error-exitcode", "99", sys.executable, "-c", script],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    text = r.stdout + r.stderr
    if not (r.returncode == 0 and "done" in r.stdout):
        raise AssertionError(f"{tool}: rc {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    if _SANITIZER_CLEAN[tool] not in text:
        raise AssertionError(f"{tool}:\n{text[-4000:]}")


# ------------------------------------------------------------------ one-sided rounding (sixteenth round, class DN)

# The largest |bias| / mean|error| accepted by rounding_bias's callers. Round-to-nearest conversions give a few
# hundredths (CPU dry run, tests/test_bug_reports_sixteenth_cpu.py: <= 0.03 for the float32 reference rounded to
# fp16 / bf16, also with P rounded for the P V product, and for the naive reference); a conversion that rounds toward
# zero or toward -inf gives about 1, and one of P alone (out rounded to nearest) about 0.65.
ROUNDING_BIAS_LIMIT = 0.1


def rounding_bias(x, ref):
    """(mean(err), mean(err * sign(ref))) / mean(|err|), err = x - ref in float64: near 0 when x's rounding errors
    (fp32 -> fp16 / bf16 conversions) are as often up as down, near -1 when every conversion rounds toward -inf
    (first) or toward zero (second), whatever their size. A per-element tolerance (DESIGN.md §3's rule) accepts such
    one-sided rounding: it is within an ulp."""
    err = x.double() - ref.double()
    scale = err.abs().mean().item()
    if scale == 0:
        return 0.0, 0.0
    return err.mean().item() / scale, (err * torch.sign(ref.double())).mean().item() / scale
