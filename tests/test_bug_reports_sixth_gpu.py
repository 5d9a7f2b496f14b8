"""A sixth round of GPU tests modelled on bug reports filed against other attention kernels and the PyTorch machinery
around them (FlashAttention 3's ring-attention backward, attention-gym's ring attention, flex attention under selective
activation checkpointing, C++ autograd functions under compiled autograd, make_graphed_callables, cold CUDA graph
captures, tensors handed from one CUDA stream to another, checkpointing with .grad()), for the kinds of fault that the
earlier rounds (tests/test_bug_reports_gpu.py, test_bug_reports_more_gpu.py, test_bug_reports_third_gpu.py,
test_bug_reports_fourth_gpu.py, test_bug_reports_fifth_gpu.py) and the other GPU test files do not yet exercise:

- the backward op driven by the merged out and LSE of a wider key range (ring / context-parallel attention), with rows
  that see no key of their chunk but have a finite merged LSE, and LSEs in the layouts of other FlashAttention versions;
- gradients asked for a subset of the inputs that require grad (autograd.grad / backward(inputs=)), also under
  activation checkpointing;
- compiled autograd running the library's C++ autograd node;
- selective activation checkpointing (SAC) policies that save or recompute the attention op, eager and compiled;
- forward and backward captured in two CUDA graphs from one pool (torch.cuda.make_graphed_callables);
- the very first call of the library in a process made inside a CUDA graph capture (no warm-up of the library);
- the document bounds the library computes and keeps per document_ids tensor, served to a call on another stream.

The report each test comes from is cited by URL in the comment above it (see also tests/bug_report_sources.md); only the
shapes and conditions of the reports are taken over, the code is this project's own.

Every numeric result is checked by the rule of DESIGN.md §3 (``assert_close_by_rule`` against the float32 reference,
the error of the same reference run in the input dtype as the yardstick); where a mechanism must replay the eager
computation (a graph, a compiled backward, a checkpoint), the deterministic backward is used and the results must also
be bit for bit those of the eager call. Skipped, with the reason, without an sm90 GPU and the built extension
(conftest.py), and per test when the build lacks a head_dim / dtype (``require_built`` / ``built_dtype``)."""

import functools
import os
import subprocess
import sys

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_ref_grads
from gpu_helpers import attention_inputs, built_dtype, check_attention, check_attention_varlen
from gpu_helpers import check_grads_where_required, cu_seqlens
from test_bug_reports_gpu import GRAD_NAMES, _leaves, _varlen_inputs

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"
ACCEPTED_ERRORS = (RuntimeError, ValueError, TypeError)
SLEEP_CYCLES = 400_000_000  # torch.cuda._sleep: keeps a stream busy for ~0.2 s on an H200


# ------------------------------------------------------------------------------------------------------- helpers
# (_leaves, _varlen_inputs: tests/test_bug_reports_gpu.py)


def _document_ids(rows):
    """(len(rows), sum(rows[0])) int64 ids on the GPU: row b packs documents of the lengths rows[b]."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]).to(DEVICE)


def _bytes(t):
    """A bytewise copy of t's values (NaN == NaN, -0.0 != 0.0), for torch.equal."""
    return t.detach().contiguous().view(torch.uint8).clone()


def _assert_bitwise(got, want, name):
    """(out, lse, dq, dk, dv) equal to want's bit for bit."""
    for what, g, w in zip(("out", "lse", *GRAD_NAMES), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{name}: {what} shape / dtype differ"
        assert torch.equal(_bytes(g), _bytes(w)), f"{name}: {what} differs from the eager call"


def _eager(q, k, v, dout, dlse, **opts):
    """out, lse and (dq, dk, dv) of a plain eager call on fresh leaves, the loss through out and LSE."""
    leaves = _leaves(q, k, v)
    out, lse = attention(*leaves, return_lse=True, **opts)
    grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
    return out.detach(), lse.detach(), grads


def _without_deterministic(opts):
    """The options the references take: deterministic only changes the order of the kernels' sums."""
    return {key: value for key, value in opts.items() if key != "deterministic"}


# ------------------------------------------------------------------------------ ring / context-parallel backward


# https://github.com/meta-pytorch/attention-gym/pull/200 (ring attention's backward fed the merged LSE to each chunk's
# backward; in the wrong units the chunk gradients came out wrong), https://github.com/Dao-AILab/flash-attention/pull/1936
# (FA3's backward preprocess turned padded / masked LSE rows into NaN and inf gradients "in ring attention backward
# passes") and https://github.com/huggingface/diffusers/issues/14265 (a ring backward that silently used the wrong K/V
# chunk: wrong gradients, no error)
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_ring_attention_backward_from_the_merged_out_and_lse(mask):
    """Ring (context-parallel) attention splits the keys into chunks, runs the forward op on each chunk, merges the
    outputs with the LSEs, and then runs the backward op of each chunk with the MERGED out and LSE, not the chunk's own:
    P = exp(S - LSE_merged) is then the chunk's slice of the whole softmax, its rows sum to less than 1, and
    D = rowsum(dO ∘ O_merged). The sum of the chunks' dQ and the concatenation of their dK, dV must be the gradient of
    attention over all keys. Keys split at 173 (off the tile grid; the second chunk a view at a storage offset), GQA 4/2.
    "causal": self-attention of 300 tokens, the first chunk with window (-1, 127) (query i sees keys j <= i of it), the
    second causal, so that query rows 0-172 see none of the second chunk's keys (chunk LSE -inf, merged LSE finite: the
    rows of FlashAttention PR 1936). Merged out and LSE, then dQ, dK, dV by the rule against the float32 reference."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    seqlen_q, seqlen_k, split = (200, 300, 173) if mask == "full" else (300, 300, 173)
    q, k, v, dout = attention_inputs(2, seqlen_q, seqlen_k, 4, 2, head_dim, dtype)
    scale = head_dim**-0.5
    # The ops' scalar arguments after softmax_scale: (causal, window_left, window_right, softcap, deterministic).
    if mask == "full":
        chunk_opts = [(False, -1, -1, 0.0, False), (False, -1, -1, 0.0, False)]
        ref_opts = {}
    else:
        chunk_opts = [(False, -1, seqlen_q - split, 0.0, False), (True, -1, 0, 0.0, False)]
        ref_opts = dict(causal=True)
    chunks = [(k[:, :split], v[:, :split]), (k[:, split:], v[:, split:])]
    parts = [torch.ops.flash_attn_hopper.fwd(q, kc, vc, scale, *opts) for (kc, vc), opts in zip(chunks, chunk_opts)]
    lse64 = torch.logaddexp(parts[0][1].double(), parts[1][1].double())  # (batch, nheads, seqlen_q)
    merged = sum(torch.exp(l.double() - lse64).transpose(1, 2).unsqueeze(-1) * o.double() for o, l in parts)
    out, lse = merged.to(dtype), lse64.float().contiguous()
    if mask == "causal":
        assert torch.isneginf(parts[1][1]).any() and torch.isfinite(lse).all(), "construction: no blind chunk rows"

    ref, ref_lse = attention_ref(q, k, v, upcast=True, **ref_opts)
    naive, naive_lse = attention_ref(q, k, v, upcast=False, **ref_opts)
    assert_close_by_rule(out, ref, naive, f"{mask} merged out")
    assert_close_by_rule(lse, ref_lse, naive_lse, f"{mask} merged lse")

    chunk_grads = [torch.ops.flash_attn_hopper.bwd(dout, q, kc, vc, out, lse, None, scale, *opts)
                   for (kc, vc), opts in zip(chunks, chunk_opts)]
    dq = (chunk_grads[0][0].float() + chunk_grads[1][0].float()).to(dtype)
    dk = torch.cat([g[1] for g in chunk_grads], dim=1)
    dv = torch.cat([g[2] for g in chunk_grads], dim=1)
    ref_g = attention_ref_grads(q, k, v, dout, upcast=True, **ref_opts)
    naive_g = attention_ref_grads(q, k, v, dout, upcast=False, **ref_opts)
    for gname, g, r, n in zip(GRAD_NAMES, (dq, dk, dv), ref_g, naive_g):
        assert torch.isfinite(g).all(), f"{mask} ring {gname}: not finite"
        assert_close_by_rule(g, r, n, f"{mask} ring {gname}")


# LSE layouts that other FlashAttention versions return, as ring-attention code written for them hands them to the
# backward: https://github.com/zhuzilin/ring-flash-attention/pull/47 ("support new flash_attn lse shape": the LSE's
# layout changed between FlashAttention releases and ring code had to follow) and
# https://github.com/Dao-AILab/flash-attention/pull/1936 (FA3's LSE padded to a multiple of the tile height)
_LSE_LAYOUTS = [("dense", "transposed_view"), ("dense", "padded"), ("dense", "padded_view"), ("dense", "seq_major"),
                ("dense", "float64"), ("varlen", "token_major"), ("varlen", "padded_view")]
_WRONG_SHAPES = {"padded", "seq_major", "token_major"}


@pytest.mark.parametrize("api,layout", _LSE_LAYOUTS, ids=[f"{a}-{b}" for a, b in _LSE_LAYOUTS])
def test_backward_op_given_an_lse_of_another_layout(api, layout):
    """ring-flash-attention PR 47 and FlashAttention PR 1936: the backward op (torch.ops.flash_attn_hopper.bwd /
    bwd_varlen, which ring attention calls directly) given the right LSE values in another layout: a transposed view
    (same shape and values, non-unit last stride), a tile-padded LSE (batch, nheads, 256) or its [..., :seqlen_q] view,
    a sequence-major (batch, seqlen_q, nheads) LSE, a float64 LSE; varlen: token-major (total_q, nheads) and a padded
    view. A kernel that indexes the LSE as if contiguous reads other rows' values and gives wrong gradients without an
    error. Each call must either raise an exception that names lse, or give dQ, dK, dV right by the rule; a wrong shape
    must raise."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    scale = head_dim**-0.5
    opts = (True, -1, -1, 0.0, False)  # causal
    if api == "dense":
        q, k, v, dout = attention_inputs(2, 203, 300, 4, 2, head_dim, dtype)
        out, lse = torch.ops.flash_attn_hopper.fwd(q, k, v, scale, *opts)
        rows = lse.shape[-1]
        lse_other = {
            "transposed_view": lambda: lse.transpose(1, 2).contiguous().transpose(1, 2),
            "padded": lambda: torch.nn.functional.pad(lse, (0, 256 - rows)),
            "padded_view": lambda: torch.nn.functional.pad(lse, (0, 256 - rows))[..., :rows],
            "seq_major": lambda: lse.transpose(1, 2).contiguous(),
            "float64": lambda: lse.double(),
        }[layout]()

        def backward(lse_arg):
            return torch.ops.flash_attn_hopper.bwd(dout, q, k, v, out, lse_arg, None, scale, *opts)

        def reference_grads(upcast):
            return attention_ref_grads(q, k, v, dout, upcast=upcast, causal=True)
    else:
        from flash_attn_hopper.testing import attention_varlen_ref_grads

        lq, lk = [100, 0, 103], [130, 40, 130]
        q, k, v, dout = _varlen_inputs(lq, lk, 4, 2, head_dim, dtype)
        cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
        varlen_args = (cu_q, cu_k, max(lq), max(lk), scale, *opts)
        out, lse = torch.ops.flash_attn_hopper.fwd_varlen(q, k, v, *varlen_args)
        total = lse.shape[-1]
        lse_other = {
            "token_major": lambda: lse.t().contiguous(),
            "padded_view": lambda: torch.nn.functional.pad(lse, (0, 256 - total))[:, :total],
        }[layout]()

        def backward(lse_arg):
            return torch.ops.flash_attn_hopper.bwd_varlen(dout, q, k, v, out, lse_arg, None, *varlen_args)

        def reference_grads(upcast):
            return attention_varlen_ref_grads(q, k, v, dout, cu_q, cu_k, upcast=upcast, causal=True)

    ref_g, naive_g = reference_grads(True), reference_grads(False)
    for gname, g, r, n in zip(GRAD_NAMES, backward(lse), ref_g, naive_g):  # the LSE as the forward gave it
        assert_close_by_rule(g, r, n, f"construction: {api} {gname} with the forward's lse")
    try:
        grads = backward(lse_other)
    except ACCEPTED_ERRORS as e:
        assert "lse" in str(e).lower(), f"{api} {layout}: {type(e).__name__} does not name lse: {e}"
        return
    assert layout not in _WRONG_SHAPES, f"{api} {layout}: an LSE of shape {tuple(lse_other.shape)} was accepted"
    for gname, g, r, n in zip(GRAD_NAMES, grads, ref_g, naive_g):
        assert_close_by_rule(g, r, n, f"{api} {layout} lse accepted: {gname}")


# ------------------------------------------------------------------------------ gradients for a subset of inputs


def _attention_with_lse(q, k, v):
    return attention(q, k, v, causal=True, return_lse=True)


# https://github.com/lucidrains/memory-efficient-attention-pytorch/issues/3 ("Checkpointing is not compatible with
# .grad() or when an inputs parameter is passed to .backward()": an attention whose backward path depended on how the
# gradients were asked for)
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_gradients_asked_for_a_subset_of_the_inputs(checkpointed):
    """memory-efficient-attention-pytorch issue 3: q, k and v all require grad, but the caller asks autograd for some of
    their gradients only, with torch.autograd.grad(..., inputs=[k]) or backward(inputs=[q, v]) (a frozen K/V
    projection for one step, a gradient penalty on q): the autograd node is then asked for fewer outputs than it has
    inputs that require grad (class 26 of tests/bug_report_sources.md covers inputs that do not require grad). Plain,
    and under non-reentrant activation checkpointing, which recomputes the forward in the backward. GQA, causal with
    seqlen_q < seqlen_k, the loss through out and LSE: the gradients asked for right by the rule, the others left
    unset (no .grad written)."""
    from torch.utils.checkpoint import checkpoint

    head_dim = 64
    dtype = built_dtype(head_dim)
    q, k, v, dout = attention_inputs(2, 203, 300, 4, 2, head_dim, dtype)
    dlse = torch.randn(2, 4, 203, device=DEVICE)
    ref = attention_ref_grads(q, k, v, dout, causal=True, dlse=dlse)
    naive = attention_ref_grads(q, k, v, dout, causal=True, dlse=dlse, upcast=False)

    def forward(leaves):
        if checkpointed:
            return checkpoint(_attention_with_lse, *leaves, use_reentrant=False)
        return _attention_with_lse(*leaves)

    name = "checkpointed" if checkpointed else "plain"
    leaves = _leaves(q, k, v)
    out, lse = forward(leaves)
    (dk,) = torch.autograd.grad([out, lse], [leaves[1]], [dout, dlse])
    assert all(t.grad is None for t in leaves), f"{name}: autograd.grad wrote a .grad"
    assert dk.shape == k.shape and dk.dtype == dtype, f"{name}: dk shape / dtype"
    assert_close_by_rule(dk, ref[1], naive[1], f"{name} autograd.grad inputs=[k]: dk")

    leaves = dict(zip("qkv", _leaves(q, k, v)))
    out, lse = forward(list(leaves.values()))
    torch.autograd.backward([out, lse], [dout, dlse], inputs=[leaves["q"], leaves["v"]])
    check_grads_where_required(leaves, "qv", ref, naive, dtype, f"{name} backward(inputs=[q, v])")


# ---------------------------------------------------------------------------------------------- compiled autograd


# https://github.com/pytorch/FBGEMM/pull/3143 (compiled autograd refused "a potentially unsafe C++ autograd function:
# torch::autograd::CppNode<...>" until the function was audited), https://github.com/pytorch/pytorch/pull/120681
# (compiled autograd keys its cache on a C++ function's saved_data and lifts only the tensors saved with
# save_for_backward; others are specialised) and https://github.com/pytorch/pytorch/pull/146229 (non-traceable C++
# autograd functions now run opaquely inside the compiled backward)
def test_compiled_autograd_runs_the_cpp_autograd_node():
    """FBGEMM PR 3143 and PyTorch PRs 120681 / 146229: the library's autograd formulas are C++ autograd functions
    (csrc/api/flash_api.cpp: AttentionAutograd, AttentionVarlenAutograd), which compiled autograd (torch.compile of the
    backward, torchtitan's option) must collect into its cache key (the saved scalars: scale, causal, window, softcap,
    deterministic, max_seqlen; an undefined saved tensor where there are no documents) and call with the saved tensors of
    each backward. Five backwards in one compiled-autograd region, the first three on equal shapes with different
    saved scalars (a cache keyed without them would replay the first case's options), then documents (a defined
    doc_bounds), varlen (cu_seqlens saved), and the first options again on fresh values (saved tensors specialised
    instead of lifted would give the first call's gradients): each deterministic, dQ, dK, dV bit for bit those of the
    eager backward and right by the rule. The test asserts that compiled autograd captured graphs."""
    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import counters

    head_dim = 64
    dtype = built_dtype(head_dim)
    lq, lk = [90, 0, 61], [120, 33, 61]
    cases = [
        ("dense", dict(causal=True)),
        ("dense", dict(softmax_scale=0.3, window_size=(40, 7))),
        ("dense", dict(causal=True, softcap=15.0)),
        ("documents", dict(causal=True, document_ids=_document_ids([[50, 1, 149], [120, 80]]))),
        ("varlen", dict(causal=True, window_size=(64, 0))),
        ("dense", dict(causal=True)),
    ]
    captures_before = counters["compiled_autograd"]["captures"]
    for i, (api, opts) in enumerate(cases):
        opts = dict(opts, deterministic=True)
        name = f"case {i} {api} {_without_deterministic(opts)}"
        if api == "varlen":
            q, k, v, dout = _varlen_inputs(lq, lk, 4, 2, head_dim, dtype)
            dlse = torch.randn(4, sum(lq), device=DEVICE)
            cu = (cu_seqlens(lq), cu_seqlens(lk), max(lq), max(lk))

            def call(leaves, opts=opts, cu=cu):
                return attention_varlen(*leaves, *cu, return_lse=True, **opts)
        else:
            seqlen_q, seqlen_k = (200, 200) if api == "documents" else (150, 200)
            q, k, v, dout = attention_inputs(2, seqlen_q, seqlen_k, 4, 2, head_dim, dtype)
            dlse = torch.randn(2, 4, seqlen_q, device=DEVICE)

            def call(leaves, opts=opts):
                return attention(*leaves, return_lse=True, **opts)

        eager_leaves = _leaves(q, k, v)
        eager_out, eager_lse = call(eager_leaves)
        eager_grads = torch.autograd.grad([eager_out, eager_lse], eager_leaves, [dout, dlse])

        leaves = _leaves(q, k, v)
        out, lse = call(leaves)
        with compiled_autograd._enable(torch.compile(backend="eager")):
            torch.autograd.backward([out, lse], [dout, dlse])
        grads = tuple(t.grad for t in leaves)
        assert all(g is not None for g in grads), f"{name}: a gradient is missing under compiled autograd"
        _assert_bitwise((out, lse, *grads), (eager_out, eager_lse, *eager_grads), f"{name} compiled autograd")
        if api == "varlen":
            check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, dout, cu[0], cu[1], name, dlse=dlse,
                                   **_without_deterministic(opts))
        else:
            check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, name, dlse=dlse,
                            **_without_deterministic(opts))
    assert counters["compiled_autograd"]["captures"] > captures_before, "construction: compiled autograd never ran"


# ------------------------------------------------------------------------------ selective activation checkpointing

_SAC_SEEN = []  # (is_recompute, op name) of the attention ops the policies were asked about


def _attention_op_name(op):
    schema = getattr(op, "_schema", None)  # higher-order operators have none
    name = getattr(schema, "name", "")
    return name if name in ("flash_attn_hopper::fwd", "flash_attn_hopper::fwd_varlen") else None


def _sac_policy(save_attention, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    name = _attention_op_name(op)
    if name is not None:
        _SAC_SEEN.append((ctx.is_recompute, name))
        if save_attention:
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context(save_attention):
    """A module-level partial (Dynamo's checkpoint operator takes no closures)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(functools.partial(_sac_policy, save_attention))


_SAC_SAVE = functools.partial(_sac_context, True)
_SAC_RECOMPUTE = functools.partial(_sac_context, False)


def _sac_dense_block(q, k, v, ids):
    # The clones are cheap ops that SAC recomputes: the attention op then meets recomputed inputs.
    return attention(q.clone(), k.clone(), v, causal=True, deterministic=True, document_ids=ids, return_lse=True)


def _sac_varlen_block(q, k, v, cu_q, cu_k, max_q, max_k):
    return attention_varlen(q.clone(), k.clone(), v, cu_q, cu_k, max_q, max_k, causal=True, window_size=(64, 0),
                            deterministic=True, return_lse=True)


def _sac_dense_step(q, k, v, ids, context_fn):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(_sac_dense_block, q, k, v, ids, use_reentrant=False, context_fn=context_fn)


def _sac_dense_step_saving_attention(q, k, v, ids):
    """The step that test_selective_activation_checkpointing_policies compiles: its context_fn a global."""
    return _sac_dense_step(q, k, v, ids, _SAC_SAVE)


# https://github.com/pytorch/pytorch/issues/147879 ("Flex Attention is incompatible with selective AC": an attention op
# under a SAC policy failed in torchtitan), https://github.com/pytorch/pytorch/pull/164421 (its fix: with the attention
# op not tagged MUST_SAVE the LSE was left unrealized) and https://github.com/hao-ai-lab/FastVideo/pull/1716 (a SAC
# policy that never saw the custom attention op: silently recomputed)
@pytest.mark.parametrize("case", ["dense-save", "dense-recompute", "varlen-save", "compiled-save"])
def test_selective_activation_checkpointing_policies(case):
    """PyTorch issue 147879 and PR 164421, FastVideo PR 1716: selective activation checkpointing (torch.utils.checkpoint
    with create_selective_checkpoint_contexts) asks a policy, op by op, whether to save an op's outputs or recompute
    them in the backward; the library's forward ops must reach the policy (so that a policy can save them), and both
    answers must give the right gradients: MUST_SAVE serves the forward's out and LSE to the recomputed C++ autograd
    node, PREFER_RECOMPUTE runs the op again. Dense packed documents (GQA, causal) and varlen (window), the loss through
    out and LSE, deterministic: dQ, dK, dV bit for bit those of the same call without checkpointing, and by the rule;
    "compiled-save" runs the checkpointed step under torch.compile (aot_eager), where the policy tags the traced op."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    api, policy = case.split("-")
    context_fn = _SAC_SAVE if policy == "save" else _SAC_RECOMPUTE
    _SAC_SEEN.clear()
    if api == "varlen":
        from torch.utils.checkpoint import checkpoint

        lq, lk = [120, 0, 77], [130, 20, 77]
        q, k, v, dout = _varlen_inputs(lq, lk, 4, 2, head_dim, dtype)
        dlse = torch.randn(4, sum(lq), device=DEVICE)
        args = (cu_seqlens(lq), cu_seqlens(lk), max(lq), max(lk))
        eager_leaves = _leaves(q, k, v)
        eager_out, eager_lse = _sac_varlen_block(*eager_leaves, *args)
        leaves = _leaves(q, k, v)
        out, lse = checkpoint(_sac_varlen_block, *leaves, *args, use_reentrant=False, context_fn=context_fn)
        op_name = "flash_attn_hopper::fwd_varlen"
    else:
        ids = _document_ids([[100, 1, 150, 49], [20, 200, 80]])
        q, k, v, dout = attention_inputs(2, 300, 300, 4, 2, head_dim, dtype)
        dlse = torch.randn(2, 4, 300, device=DEVICE)
        eager_leaves = _leaves(q, k, v)
        eager_out, eager_lse = _sac_dense_block(*eager_leaves, ids)
        leaves = _leaves(q, k, v)
        if api == "compiled":
            out, lse = torch.compile(_sac_dense_step_saving_attention, backend="aot_eager")(*leaves, ids)
        else:
            out, lse = _sac_dense_step(*leaves, ids, context_fn)
        op_name = "flash_attn_hopper::fwd"
    eager_grads = torch.autograd.grad([eager_out, eager_lse], eager_leaves, [dout, dlse])
    grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
    assert (False, op_name) in _SAC_SEEN, f"{case}: the policy never saw {op_name} in the forward: {_SAC_SEEN}"
    _assert_bitwise((out, lse, *grads), (eager_out, eager_lse, *eager_grads), f"{case} checkpointed")
    if api == "varlen":
        check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, dout, args[0], args[1], case, dlse=dlse,
                               causal=True, window_size=(64, 0))
    else:
        check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, case, dlse=dlse, causal=True,
                        document_ids=ids)


# --------------------------------------------------------------------------------------------------- CUDA graphs


def _graphed_block(q, k, v, ids):
    return attention(q, k, v, causal=True, deterministic=True, document_ids=ids, return_lse=True)


# https://github.com/pytorch/pytorch/issues/128396 (an op that ran eagerly broke make_graphed_callables' backward
# capture: "operation failed due to a previous error during capture") and https://github.com/pytorch/pytorch/issues/181723
# (make_graphed_callables returns its static buffers: silently corrupted results)
def test_make_graphed_callables_forward_and_backward_graphs():
    """PyTorch issues 128396 and 181723: torch.cuda.make_graphed_callables warms a callable up on a side stream, then
    captures its forward and its backward (torch.autograd.grad on static output gradients) in two separate graphs that
    share one memory pool; each later call copies the new inputs into the static ones, replays the forward graph, and
    the backward replays the backward graph, which reads the tensors the forward graph saved (out, LSE, document
    bounds). Dense packed documents (GQA, causal, deterministic), the loss through out and LSE, three calls with fresh
    values and new documents: out, LSE, dQ, dK, dV bit for bit those of the eager call and by the rule."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    rows = [[[100, 1, 150, 49], [20, 200, 80]], [[300], [1, 298, 1]], [[7] * 42 + [6], [150, 150]]]
    q, k, v, _ = attention_inputs(2, 300, 300, 4, 2, head_dim, dtype)
    graphed = torch.cuda.make_graphed_callables(_graphed_block, (*_leaves(q, k, v), _document_ids(rows[0])))
    for step, documents in enumerate(rows):
        ids = _document_ids(documents)
        q, k, v, dout = attention_inputs(2, 300, 300, 4, 2, head_dim, dtype)
        dlse = torch.randn(2, 4, 300, device=DEVICE)
        leaves = _leaves(q, k, v)
        out, lse = graphed(*leaves, ids)
        grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
        out, lse, grads = out.detach().clone(), lse.detach().clone(), tuple(g.clone() for g in grads)
        name = f"graphed call {step}"
        eager = _eager(q, k, v, dout, dlse, causal=True, deterministic=True, document_ids=ids)
        _assert_bitwise((out, lse, *grads), (eager[0], eager[1], *eager[2]), name)
        check_attention(out, lse, grads, q, k, v, dout, name, dlse=dlse, causal=True, document_ids=ids)


_COLD_CAPTURE_SCRIPT = r"""
import sys
import torch

seed, dtype = int(sys.argv[1]), getattr(torch, sys.argv[2])
torch.manual_seed(seed)
import flash_attn_hopper.interface as interface
from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import assert_close_by_rule, attention_varlen_ref, attention_varlen_ref_grads

assert not interface._CHECKED_CALLS, "construction: the library was called before the capture"
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):  # PyTorch's own warm-up (cuBLAS, autograd's device threads), nothing of the library
    a = torch.randn(128, 128, device="cuda", dtype=dtype, requires_grad=True)
    torch.autograd.grad((a @ a).float().sum(), a)
torch.cuda.synchronize()

lq, lk = [100, 0, 77], [130, 23, 77]
cu_q = torch.tensor([0, 100, 100, 177], dtype=torch.int32, device="cuda")
cu_k = torch.tensor([0, 130, 153, 230], dtype=torch.int32, device="cuda")


def fresh():
    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype)
    return [r(2, 203, 4, 64), r(2, 300, 2, 64), r(2, 300, 2, 64), r(2, 203, 4, 64),
            torch.randn(2, 4, 203, device="cuda"), r(177, 4, 64), r(230, 2, 64), r(230, 2, 64), r(177, 4, 64)]


static = fresh()
dense_leaves = [t.requires_grad_(True) for t in static[0:3]]
var_leaves = [t.requires_grad_(True) for t in static[5:8]]
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph, stream=side):  # the library's first call in this process
    out, lse = attention(*dense_leaves, causal=True, deterministic=True, return_lse=True)
    grads = torch.autograd.grad([out, lse], dense_leaves, [static[3], static[4]])
    var_out, var_lse = attention_varlen(*var_leaves, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)
    var_grads = torch.autograd.grad(var_out, var_leaves, static[8])

for replay in range(2):
    new = fresh()
    with torch.no_grad():
        for dst, src in zip(static, new):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    leaves = [t.detach().clone().requires_grad_(True) for t in new[0:3]]
    e_out, e_lse = attention(*leaves, causal=True, deterministic=True, return_lse=True)
    e_grads = torch.autograd.grad([e_out, e_lse], leaves, [new[3], new[4]])
    for what, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (e_out, e_lse, *e_grads)):
        assert torch.equal(got.detach(), want.detach()), f"replay {replay}: dense {what} differs from the eager call"
    q, k, v, dout = new[5:9]
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    naive, naive_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, causal=True)
    assert_close_by_rule(var_out.detach(), ref, naive, f"replay {replay}: varlen out")
    assert_close_by_rule(var_lse.detach(), ref_lse, naive_lse, f"replay {replay}: varlen lse")
    ref_g = attention_varlen_ref_grads(q, k, v, dout, cu_q, cu_k, causal=True)
    naive_g = attention_varlen_ref_grads(q, k, v, dout, cu_q, cu_k, upcast=False, causal=True)
    for what, g, r, n in zip(("dq", "dk", "dv"), var_grads, ref_g, naive_g):
        assert_close_by_rule(g, r, n, f"replay {replay}: varlen {what}")
print("done")
"""


# https://github.com/tracel-ai/burn/issues/5772 ("a cold capture fails": the first capture of a closure in a process
# failed, while running it eagerly once first made the same capture work),
# https://github.com/flashinfer-ai/flashinfer/pull/3172 (a kernel module loaded on first use inside a global-mode
# capture aborts it) and
# https://github.com/ROCm/TransformerEngine/pull/643 (lazy library handle creation on the capture stream: "operation
# not permitted when stream is capturing", or a hang)
def test_first_call_of_the_process_inside_a_cuda_graph_capture(seed):
    """burn issue 5772, FlashInfer PR 3172 and ROCm TransformerEngine PR 643: a library that initialises something on
    its first call (loads a kernel's module, sets a kernel's shared-memory attribute, queries and caches device
    properties, allocates a persistent workspace, checks a build with a synchronising call) works eagerly but breaks a
    CUDA graph capture when that first call is captured, as a serving or training stack does when it captures its
    model before any eager step of that shape. In a fresh process (a subprocess: nothing of the library has run, the
    script asserts it), after a warm-up of PyTorch alone (a matmul forward and backward on the capture stream), the
    first calls of the library are captured in one graph with the default global capture mode: dense attention forward
    and deterministic backward (GQA, causal, loss through out and LSE) and attention_varlen forward and backward. Two
    replays with fresh values: the dense results bit for bit those of the eager call made after it, varlen by the rule.
    (DESIGN.md §2: the kernels allocate only through PyTorch's caching allocator and do no host synchronisation, so they
    work inside CUDA graphs.)"""
    dtype = built_dtype(64)
    root = os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_hopper.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _COLD_CAPTURE_SCRIPT, str(seed), str(dtype).split(".")[-1]],
                       capture_output=True, text=True, timeout=140, env=env)
    assert r.returncode == 0 and "done" in r.stdout, f"rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


# ------------------------------------------------------------------------------- a cached tensor across streams


# https://github.com/NVIDIA/TensorRT-LLM/pull/15265 (attention-prologue tensors made on one stream and read on another
# without record_stream: the caching allocator recycled them while the consumer still read them) and
# https://github.com/NVIDIA/cudnn-frontend/pull/1168 (offsets generated by an attention wrapper on the ambient stream and
# released while the attention kernel on the execution stream still read them)
@pytest.mark.parametrize("fault", ["ordering", "lifetime"])
def test_document_bounds_served_to_another_stream(fault):
    """TensorRT-LLM PR 15265 and cudnn-frontend PR 1168: attention(..., document_ids=) turns the ids into document
    bounds with device work on the current stream and keeps them per document_ids tensor (interface._DOCUMENT_BOUNDS),
    so that the layers of a step share them. When two calls on two streams pass the same ids tensor (two micro-batches
    overlapped on two streams, the position ids shared), the second stream is served bounds made on the first, which
    the caller cannot order or keep alive: they are the library's. The caller does everything PyTorch asks of it: the
    ids are made on the default stream, which both streams wait for, and are recorded on each stream that used them
    before they are dropped.
    "ordering": stream a is held busy (torch.cuda._sleep) when the first call enqueues the bounds' computation behind
    it, and the call on stream b follows at once: b's kernel must not read the bounds before they are computed.
    "lifetime": bounds made on a and finished; b is held busy, then its call is enqueued; the ids are dropped (their
    cache entry and bounds with them) and a allocates blocks of the bounds' size at once: b's kernel must not read a
    recycled block. The blocks stream a hands out are pre-filled with the bounds of one document per row (valid bounds
    of other documents: a stale read gives plain causal attention instead of an error). Both calls' out and LSE by the
    rule against the reference with the ids' documents. The construction checks (after synchronizing the stream that
    must finish first) that the other is still busy; it assumes that the library does not order one stream after the
    other (a fix that did would need this check changed, not the rule)."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    batch, seqlen = 2, 300
    ids = _document_ids([[100, 1, 150, 49], [20, 200, 80]])
    ids_ref = ids.clone()  # for the reference: a different tensor, not in the library's notes
    runs = [attention_inputs(batch, seqlen, seqlen, 4, 2, head_dim, dtype)[:3] for _ in range(2)]
    one_document = torch.stack([torch.zeros(batch, seqlen, dtype=torch.int32),
                                torch.full((batch, seqlen), seqlen, dtype=torch.int32)], dim=-1).to(DEVICE)
    # Warm-up on the current stream with another ids tensor of the same values: the kernels are loaded and the call's
    # checks noted, so that no first-call host work delays the enqueueing below past the other stream's sleep.
    attention(*runs[0], causal=True, document_ids=ids_ref)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    for s in (a, b):
        s.wait_stream(torch.cuda.current_stream())

    def plant(count=16):
        """Blocks of the bounds' size, filled with one-document bounds, on stream a."""
        with torch.cuda.stream(a):
            return [one_document.clone() for _ in range(count)]

    torch.cuda.synchronize()
    with torch.no_grad():
        if fault == "ordering":
            plant()  # freed at once into a's pool: a's next allocations of that size hold one-document bounds
            torch.cuda.synchronize()
            with torch.cuda.stream(a):
                torch.cuda._sleep(SLEEP_CYCLES)
                out_a, lse_a = attention(*runs[0], causal=True, document_ids=ids, return_lse=True)
            with torch.cuda.stream(b):
                out_b, lse_b = attention(*runs[1], causal=True, document_ids=ids, return_lse=True)
            b.synchronize()  # b's kernel has run: a must still be busy, i.e. before its bounds were computed
            busy = not a.query()
        else:
            with torch.cuda.stream(a):
                out_a, lse_a = attention(*runs[0], causal=True, document_ids=ids, return_lse=True)
            torch.cuda.synchronize()
            with torch.cuda.stream(b):
                torch.cuda._sleep(SLEEP_CYCLES)
                out_b, lse_b = attention(*runs[1], causal=True, document_ids=ids, return_lse=True)
            for s in (a, b):
                ids.record_stream(s)
            del ids
            planted = plant()  # a is idle: written at once, into the block of the freed bounds unless b holds it
            a.synchronize()  # the planted blocks are written: b must still be busy, i.e. its kernel not yet run
            busy = not b.query()
            torch.cuda.synchronize()
            planted.clear()
        torch.cuda.synchronize()
    assert busy, "construction: the busy stream finished before the other one's work was enqueued"
    for name, (q, k, v), out, lse in (("stream a", runs[0], out_a, lse_a), ("stream b", runs[1], out_b, lse_b)):
        ref, ref_lse = attention_ref(q, k, v, causal=True, document_ids=ids_ref)
        naive, naive_lse = attention_ref(q, k, v, causal=True, document_ids=ids_ref, upcast=False)
        assert_close_by_rule(out, ref, naive, f"{fault}: {name} out")
        assert_close_by_rule(lse, ref_lse, naive_lse, f"{fault}: {name} lse")
