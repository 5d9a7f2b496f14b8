"""An eighth round of GPU tests modelled on bug reports filed against other attention kernels and the PyTorch machinery
around them, for the kinds of fault that the earlier rounds (tests/test_bug_reports_gpu.py ... _seventh_gpu.py) and
the other GPU test files do not yet exercise:

- BJ: torch.jit.trace of attention_varlen and of attention with document_ids, replayed on new boundaries and new
  documents, and the library's very first call of the process made inside a trace (FlashAttention issue 701, xformers
  issue 406, PyTorch issue 115262). The Python layer used to read cu_seqlens on the host and keep per-tensor results,
  which a trace turns into constants; its CPU part (what the Python layer hands the op, with a CPU stand-in) is
  tests/test_bug_reports_eighth_cpu.py;
- BK: tensors made under torch.inference_mode (a KV cache, cu_seqlens, document_ids) reaching a training call (unsloth
  issue 2434): autograd's own refusal naming inference tensors, or the right answer, never a crash or a wrong one.

The report each test comes from is cited by URL in the comment above it (see also tests/bug_report_sources.md); only the
shapes and conditions of the reports are taken over, the code is this project's own. Every numeric result is checked
by the rule of DESIGN.md §3 (the gpu_helpers check_* functions: float32 reference, the same reference in the input
dtype as the yardstick). Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per
test when the build lacks a head_dim / dtype (``built_dtype``)."""

import pytest
import torch

from flash_attn_hopper import _ops, attention, attention_varlen, interface
from gpu_helpers import attention_inputs, built_dtype, check_attention, check_attention_varlen, cu_seqlens, randn

pytestmark = [
    pytest.mark.requires_sm90,
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore:.*torch.jit.trace.*deprecated"),
]


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _document_ids(batch_rows):
    """(len(batch_rows), sum(row)) int64 ids on the GPU: row b packs documents of the lengths batch_rows[b]."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in batch_rows]).cuda()


# ---------------------------------------------------------------------------------------------- BJ: torch.jit.trace


# https://github.com/Dao-AILab/flash-attention/issues/701 (max_seqlen converted to a Python scalar: "an incorrect trace
# in torch.jit.trace"), https://github.com/facebookresearch/xformers/issues/406 (torch.jit.trace broke on an attention
# op's "unsupported output type: int") and https://github.com/pytorch/pytorch/issues/115262 (SDPA effectively untraceable
# once a flag is computed from a shape)
@pytest.mark.parametrize("case", ["varlen", "documents", "first_call"])
def test_jit_trace_replays_with_new_lengths_and_documents(case, monkeypatch):
    """A function traced by torch.jit.trace on one batch and replayed on another, forward and backward:

    - "varlen": attention_varlen, causal, GQA 4/2, traced with sequences of 113 and 90 rows in buffers of 331 query
      and 290 key rows (the rest belongs to no sequence), replayed with sequences of 170 / 161 and 140 / 150 rows that
      reach the buffers' ends (max_seqlen 331 / 290: upper bounds, which the trace keeps). Before the fix the trace
      kept the trace-time cut at cu_seqlens[-1] and handed the kernels 203 query rows for sequences that name 331;
    - "documents": attention with document_ids, causal, after an eager warm-up on the trace's ids (which cached their
      document bounds), replayed with other documents; before the fix the trace kept the cached bounds as a constant;
    - "first_call": the library's build query not yet run in the process (its cache emptied): tracing used to fail
      with "unsupported output type: str, from operator: flash_attn_hopper::build_config".

    out, LSE, dQ, dK, dV of the replay by the rule against the reference of the replay's inputs."""
    head_dim = 128
    dtype = built_dtype(head_dim)
    monkeypatch.setattr(interface, "_CHECKED_CALLS", {})
    if case == "varlen":
        total_q, total_k, nheads, nheads_k = 331, 290, 4, 2
        q, k, v = randn(total_q, nheads, head_dim, dtype=dtype), randn(total_k, nheads_k, head_dim, dtype=dtype), \
            randn(total_k, nheads_k, head_dim, dtype=dtype)
        dout = randn(total_q, nheads, head_dim, dtype=dtype)

        def f(q, k, v, cu_q, cu_k):
            return attention_varlen(q, k, v, cu_q, cu_k, total_q, total_k, causal=True, return_lse=True)

        traced = torch.jit.trace(f, (*_leaves(q, k, v), cu_seqlens([113, 90]), cu_seqlens([100, 100])),
                                 check_trace=False)
        cu_q, cu_k = cu_seqlens([170, 161]), cu_seqlens([140, 150])
        leaves = _leaves(q, k, v)
        out, lse = traced(*leaves, cu_q, cu_k)
        grads = torch.autograd.grad(out, leaves, dout)
        check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, dout, cu_q, cu_k, "jit.trace varlen",
                               causal=True)
        return
    q, k, v, dout = attention_inputs(2, 300, 300, 4, 2, head_dim, dtype)
    if case == "documents":
        ids_trace = _document_ids([[120, 180], [300]])
        ids = _document_ids([[40, 200, 60], [150, 150]])
        attention(q, k, v, causal=True, document_ids=ids_trace)  # warm-up: the bounds of ids_trace are cached
        opts = dict(causal=True, document_ids=ids)
        traced = torch.jit.trace(lambda q, k, v, ids: attention(q, k, v, causal=True, return_lse=True, document_ids=ids),
                                 (*_leaves(q, k, v), ids_trace), check_trace=False)
        args = (ids,)
    else:
        _ops._compiled.cache_clear()
        opts = dict(causal=True)
        traced = torch.jit.trace(lambda q, k, v: attention(q, k, v, causal=True, return_lse=True), tuple(_leaves(q, k, v)),
                                 check_trace=False)
        q, k, v, dout = attention_inputs(2, 300, 300, 4, 2, head_dim, dtype)  # the replay's own values
        args = ()
    leaves = _leaves(q, k, v)
    out, lse = traced(*leaves, *args)
    grads = torch.autograd.grad(out, leaves, dout)
    check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, f"jit.trace {case}", **opts)


# ------------------------------------------------------------------------ BK: inference tensors in a training call


def _refused_as_inference_tensor(error):
    # autograd's own refusal ("Inference tensors cannot be saved for backward. ..."), not any error that names
    # inference tensors (an in-place update or a version-counter read by the library would be a fault of its own)
    return "inference tensors cannot be saved for backward" in str(error).lower()


# https://github.com/unslothai/unsloth/issues/2434 (GRPO: a tensor made under inference_mode reached a training step's
# attention: "Inference tensors cannot be saved for backward. To work around you can make a clone ...")
@pytest.mark.parametrize("made_in_inference", ["k_v", "cu_seqlens", "document_ids"])
def test_tensors_made_in_inference_mode_reaching_a_training_call(made_in_inference):
    """A KV cache (k, v), cu_seqlens or document_ids made under torch.inference_mode (rollouts, a cached collate), then
    used outside it in a call whose q (and k, v where they are not the inference tensors) require grad. Accepted:
    autograd's refusal naming inference tensors (a RuntimeError, raised by the call or by its backward), or out, LSE
    and the gradients right by the rule. Then the documented workaround, a clone, must give the right answer."""
    head_dim = 64
    dtype = built_dtype(head_dim)
    if made_in_inference == "cu_seqlens":
        lengths_q, lengths_k = [70, 1, 130], [90, 33, 129]
        q, k, v = (randn(sum(lengths_q), 4, head_dim, dtype=dtype), randn(sum(lengths_k), 2, head_dim, dtype=dtype),
                   randn(sum(lengths_k), 2, head_dim, dtype=dtype))
        dout = randn(sum(lengths_q), 4, head_dim, dtype=dtype)
        with torch.inference_mode():
            cu_q_inf, cu_k_inf = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
        assert cu_q_inf.is_inference(), "construction: not an inference tensor"

        def run(cu_q, cu_k):
            leaves = _leaves(q, k, v)
            out, lse = attention_varlen(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                        return_lse=True)
            grads = torch.autograd.grad(out, leaves, dout)
            check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, dout, cu_q, cu_k,
                                   "inference-mode cu_seqlens", causal=True)

        try:
            run(cu_q_inf, cu_k_inf)
        except RuntimeError as e:
            assert _refused_as_inference_tensor(e), f"not autograd's inference-tensor refusal: {e}"
        run(cu_q_inf.clone(), cu_k_inf.clone())
        return

    q, k, v, dout = attention_inputs(2, 203, 203, 4, 2, head_dim, dtype)
    opts = dict(causal=True)
    if made_in_inference == "document_ids":
        with torch.inference_mode():
            ids_inf = _document_ids([[77, 126], [1, 202]])
        assert ids_inf.is_inference(), "construction: not an inference tensor"
        try:
            leaves = _leaves(q, k, v)
            out, lse = attention(*leaves, causal=True, return_lse=True, document_ids=ids_inf)
            grads = torch.autograd.grad(out, leaves, dout)
            check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, "inference-mode document_ids",
                            causal=True, document_ids=ids_inf.clone())
        except RuntimeError as e:
            assert _refused_as_inference_tensor(e), f"not autograd's inference-tensor refusal: {e}"
        opts["document_ids"] = ids_inf.clone()
    else:
        with torch.inference_mode():
            k_inf, v_inf = k.clone(), v.clone()  # a KV cache filled during generation
        assert k_inf.is_inference(), "construction: not an inference tensor"
        q_leaf = q.detach().clone().requires_grad_(True)
        try:
            out, lse = attention(q_leaf, k_inf, v_inf, causal=True, return_lse=True)
            (dq,) = torch.autograd.grad(out, [q_leaf], dout)
        except RuntimeError as e:
            assert _refused_as_inference_tensor(e), f"not autograd's inference-tensor refusal: {e}"
        else:
            from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_ref_grads

            ref, ref_lse = attention_ref(q, k, v, upcast=True, causal=True)
            naive, naive_lse = attention_ref(q, k, v, upcast=False, causal=True)
            assert_close_by_rule(out.detach(), ref, naive, "inference-mode k, v: out")
            assert_close_by_rule(lse.detach(), ref_lse, naive_lse, "inference-mode k, v: lse")
            assert_close_by_rule(dq, attention_ref_grads(q, k, v, dout, upcast=True, causal=True)[0],
                                 attention_ref_grads(q, k, v, dout, upcast=False, causal=True)[0],
                                 "inference-mode k, v: dq")
        k, v = k_inf.clone(), v_inf.clone()
    # the workaround: clones (normal tensors), every input requiring grad
    leaves = _leaves(q, k, v)
    out, lse = attention(*leaves, return_lse=True, **opts)
    grads = torch.autograd.grad(out, leaves, dout)
    check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, f"{made_in_inference} cloned", **opts)
