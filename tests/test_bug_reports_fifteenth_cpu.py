"""Fifteenth round of the bug hunt (tests/bug_report_sources.md, "Fifteenth round"): CPU tests.

DJ: output gradients that are PyTorch's efficient zero tensors (``torch._efficientzerotensor``: a shape and a dtype,
no storage). They reach a backward as a grad_output (pytorch/pytorch#64837 added them, with a dispatcher fallback that
materialises them for operators that do not handle them; pytorch/functorch#406 replaced them by empty tensors where a
backward kernel had no implementation for them). A kernel that reads memory must get dO and dLSE materialised, with
every gradient bitwise that of real zeros.

DK: gradients kept on non-leaf tensors around the call (``retain_grad``): q, k, v as views of one fused projection
(the usual ``qkv.unbind``), and the returned out and LSE, also when attention_varlen pads its output past the last
sequence. pytorch/pytorch#8874 (retained gradients of views of interior nodes that depend on how the graph was built)
and #14707 (a custom Function's view outputs): the retained gradients must be what ``torch.autograd.grad`` gives for
the same tensors.

DL: losses of the LSE alone, and LSE gradients of other dtypes and layouts (a float64 loss, a strided slice, the
padding of attention_varlen), plain and inside torch.utils.checkpoint (reentrant and not): the backward op must get a
float32 dLSE of the LSE's shape (and zeros for dO), and the gradients must be those of the call without checkpointing
(wenet-e2e/wenet#2191 saw gradient checkpointing with use_reentrant=True fail around a flash self-attention;
lucidrains/memory-efficient-attention-pytorch#3: checkpointing of an attention that took the wrong branch for some
backward calls).

DM: copies of a transformers model built with ``attn_implementation="flash_attn_hopper"``, made after forwards that
filled the integration's per-tensor notes (padding, packed documents): ``copy.deepcopy``, ``pickle`` and ``torch.save``
/ ``torch.load`` must work (facebookresearch/xformers#307: a model with an xformers attention could not be pickled;
deepspeedai/Megatron-DeepSpeed#380: deepcopy of a module raised a PickleError), and each copy must give the original's
logits bit for bit through the library.

The ops run through the CPU stand-ins of tests/cpu_stand_ins.py (the extension's op schemas and C++ autograd node;
float32 references for the kernels).
"""

import copy
import io
import pickle

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import attention_ref_grads, attention_varlen_ref_grads

from cpu_stand_ins import CALLS, STAND_INS, ops_on_cpu, stand_ins

from optional_deps import requires_transformers

DTYPE = torch.float16


def _dense(batch=2, seqlen_q=9, seqlen_k=13, nheads=4, nheads_k=2, head_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, generator=g).to(DTYPE)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, generator=g).to(DTYPE)
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim, generator=g).to(DTYPE)
    return q, k, v


def _varlen(seed=0):
    """Three sequences (one without queries) and 3 query rows past the last sequence (attention_varlen pads them)."""
    g = torch.Generator().manual_seed(seed)
    lq, lk = [5, 0, 7], [6, 4, 9]
    q = torch.randn(sum(lq) + 3, 4, 16, generator=g).to(DTYPE)
    k = torch.randn(sum(lk), 2, 16, generator=g).to(DTYPE)
    v = torch.randn(sum(lk), 2, 16, generator=g).to(DTYPE)
    cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 10, 19], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def _call(api, leaves, extra, opts):
    if api.startswith("varlen"):
        cu_q, cu_k = extra
        return attention_varlen(*leaves, cu_q, cu_k, 7, 9, return_lse=True, **opts)
    return attention(*leaves, return_lse=True, **opts)


def _inputs(api):
    if api.startswith("varlen"):
        q, k, v, cu_q, cu_k = _varlen()
        if api == "varlen_exact":  # no rows past the last sequence: the op's outputs are returned as they are
            q = q[:12]
        return (q, k, v), (cu_q, cu_k)
    if api == "documents":
        q, k, v = _dense(seqlen_q=13)
        ids = torch.tensor([[0] * 4 + [1] * 6 + [2] * 3, [5] * 13])
        return (q, k, v), ids
    return _dense(), None


def _opts(api, extra):
    opts = dict(causal=True, softcap=5.0)
    if api == "documents":
        opts["document_ids"] = extra
    return opts


def _leaves(tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


# ------------------------------------------------------------------------------ DJ: efficient zero output gradients

def _no_zero_tensors(name, fn):
    """A stand-in that refuses efficient zero tensors (no storage: a kernel would read a null pointer)."""
    def checked(*args):
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                assert not a._is_zerotensor(), f"{name}: argument {i} reached the op as an efficient zero tensor"
                assert a.numel() == 0 or a.data_ptr() != 0, f"{name}: argument {i} has no memory"
        return fn(*args)
    return checked


@pytest.mark.parametrize("zero", ["dout", "dlse"])
@pytest.mark.parametrize("api", ["dense", "documents", "varlen", "varlen_exact"])
def test_efficient_zero_output_gradients_reach_the_op_materialised(monkeypatch, api, zero):
    """DJ: dO (with a loss on the LSE) or dLSE (with a loss on out) given as torch._efficientzerotensor: the backward
    op gets real tensors, and dQ, dK, dV are bitwise those of the same call with torch.zeros."""
    impls = {name: _no_zero_tensors(name, fn) for name, fn in STAND_INS.items()}
    with ops_on_cpu(monkeypatch, impls, "the C++ autograd node"):
        tensors, extra = _inputs(api)
        opts = _opts(api, extra)
        results = []
        for make in (torch._efficientzerotensor, torch.zeros):
            leaves = _leaves(tensors)
            out, lse = _call(api, leaves, extra, opts)
            g = torch.Generator().manual_seed(1)
            dout = torch.randn(out.shape, generator=g).to(out.dtype)
            dlse = torch.randn(lse.shape, generator=g)
            if zero == "dout":
                dout = make(out.shape, dtype=out.dtype)
            else:
                dlse = make(lse.shape, dtype=lse.dtype)
            assert (dout if zero == "dout" else dlse)._is_zerotensor() == (make is torch._efficientzerotensor)
            results.append(torch.autograd.grad((out, lse), leaves, (dout, dlse)))
        for name, a, b in zip(("dq", "dk", "dv"), *results):
            assert torch.equal(a, b), f"{api} {zero}: {name} differs between an efficient zero tensor and zeros"
        assert any(r.abs().sum() > 0 for r in results[0]), "the other output's gradient must reach q, k, v"


# ------------------------------------------------------------------------------ DK: retained gradients of non-leaves

@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_retained_gradients_of_fused_views_and_outputs(api):
    """DK: q, k, v unbound from one fused projection (views of a non-leaf), and out and LSE, with retain_grad(): their
    .grad are the gradients torch.autograd.grad gives for the same loss, and the fused projection's gradient is the
    three of them in its layout."""
    with pytest.MonkeyPatch.context() as monkeypatch, stand_ins(monkeypatch):
        g = torch.Generator().manual_seed(3)
        rows = 15 if api == "varlen" else 11
        shape = (rows, 4, 16) if api == "varlen" else (2, rows, 4, 16)
        x = torch.randn(*shape[:-2], 64, generator=g).to(DTYPE).requires_grad_(True)
        w = torch.randn(64, 3 * 4 * 16, generator=g).to(DTYPE).requires_grad_(True)

        def forward():
            fused = (x @ w).view(*shape[:-2], 3, 4, 16)
            q, k, v = fused.unbind(-3)
            if api == "varlen":
                cu = torch.tensor([0, 5, 12], dtype=torch.int32)  # 3 rows past the last sequence
                out, lse = attention_varlen(q, k, v, cu, cu, 7, 7, causal=True, return_lse=True)
            else:
                out, lse = attention(q, k, v, causal=True, return_lse=True)
            return fused, (q, k, v), out, lse

        def loss_of(out, lse):
            g2 = torch.Generator().manual_seed(4)
            dout = torch.randn(out.shape, generator=g2)
            dlse = torch.randn(lse.shape, generator=g2)
            finite = torch.isfinite(lse)
            return (out.float() * dout).sum() + torch.where(finite, lse * dlse, 0).sum()

        fused, qkv, out, lse = forward()
        expected = torch.autograd.grad(loss_of(out, lse), (*qkv, out, lse, fused))

        fused, qkv, out, lse = forward()
        for t in (*qkv, out, lse, fused):
            assert not t.is_leaf
            t.retain_grad()
        loss_of(out, lse).backward()
        for name, t, e in zip(("q", "k", "v", "out", "lse", "fused"), (*qkv, out, lse, fused), expected):
            assert t.grad is not None, f"{api}: {name}.grad was not retained"
            assert t.grad.shape == t.shape and t.grad.dtype == t.dtype, f"{api}: {name}.grad"
            assert torch.equal(t.grad, e), f"{api}: {name}.grad differs from torch.autograd.grad"
        assert torch.equal(fused.grad, torch.stack([t.grad for t in qkv], dim=-3))
        assert x.grad is not None and w.grad is not None and torch.isfinite(w.grad.float()).all()


# ------------------------------------------------------------------------------ DL: LSE-only losses under checkpoint

_LSE_LOSSES = {
    # the LSE alone (dO absent: the C++ node hands the op zeros), rows that see no key left out
    "lse_sum": lambda out, lse: torch.where(torch.isfinite(lse), lse, 0).sum(),
    # a float64 loss: autograd casts dLSE back to float32
    "lse_float64": lambda out, lse: torch.where(torch.isfinite(lse), lse, 0).double().pow(2).sum(),
    # every other row of the LSE: a strided gradient with zeros between
    "lse_strided": lambda out, lse: torch.where(torch.isfinite(lse), lse, 0)[..., ::2].sum(),
    # out and the LSE
    "out_and_lse": lambda out, lse: out.float().square().sum() + torch.where(torch.isfinite(lse), lse, 0).sum(),
}


def _recorded_bwd(recorded):
    def bwd(*args):
        recorded.append(args[6])  # dlse
        return STAND_INS["bwd"](*args)

    def bwd_varlen(*args):
        recorded.append(args[6])
        return STAND_INS["bwd_varlen"](*args)
    return {**STAND_INS, "bwd": bwd, "bwd_varlen": bwd_varlen}


@pytest.mark.parametrize("mode", ["plain", "reentrant", "non_reentrant"])
@pytest.mark.parametrize("loss", list(_LSE_LOSSES))
@pytest.mark.parametrize("api", ["dense", "varlen"])
def test_lse_losses_with_and_without_checkpointing(monkeypatch, api, loss, mode):
    """DL: the gradients of LSE-only (and out + LSE) losses are those of the reference (by autograd on the float32
    math: the stand-ins compute it) and, under checkpoint, bitwise those of the plain call; the backward op gets a
    float32 dLSE of the LSE's shape."""
    recorded = []
    with ops_on_cpu(monkeypatch, _recorded_bwd(recorded), "the C++ autograd node"):
        tensors, extra = _inputs(api)
        opts = dict(causal=True)
        loss_fn = _LSE_LOSSES[loss]

        def run(how):
            leaves = _leaves(tensors)
            block = lambda *qkv: _call(api, qkv, extra, opts)  # noqa: E731
            if how == "plain":
                out, lse = block(*leaves)
            else:
                out, lse = checkpoint(block, *leaves, use_reentrant=how == "reentrant")
            loss_fn(out, lse).backward()
            return [t.grad for t in leaves], out.detach(), lse.detach()

        grads, out, lse = run(mode)
        assert recorded, "the backward op was not called"
        for dlse in recorded:
            op_lse_shape = (lse.shape[0], lse.shape[1] - 3) if api == "varlen" else lse.shape
            assert dlse is not None and dlse.dtype == torch.float32 and tuple(dlse.shape) == tuple(op_lse_shape), (
                f"dlse reached the op as {None if dlse is None else (dlse.dtype, tuple(dlse.shape))}")
        if mode != "plain":
            plain, _, _ = run("plain")
            for name, a, b in zip(("dq", "dk", "dv"), grads, plain):
                assert torch.equal(a, b), f"{api} {loss} {mode}: {name} differs from the call without checkpoint"
        # the reference: the same loss's gradients with respect to out and LSE, through the float32 math
        out_r = out.float().requires_grad_(True)
        lse_r = lse.clone().requires_grad_(True)
        dout, dlse = torch.autograd.grad(loss_fn(out_r, lse_r), (out_r, lse_r), allow_unused=True,
                                         materialize_grads=True)
        if api == "varlen":
            ref = attention_varlen_ref_grads(*tensors, dout.to(DTYPE), *extra, dlse=dlse, **opts)
        else:
            ref = attention_ref_grads(*tensors, dout.to(DTYPE), dlse=dlse, **opts)
        for name, a, r in zip(("dq", "dk", "dv"), grads, ref):
            assert a.dtype == DTYPE and torch.isfinite(a.float()).all(), f"{api} {loss} {mode}: {name}"
            # the stand-ins are the float32 math rounded once to fp16 (an absolute floor for values near 0)
            torch.testing.assert_close(a.float(), r, rtol=2e-3, atol=2e-3, msg=f"{api} {loss} {mode}: {name}")


# ------------------------------------------------------------------------------ DM: copies of an integrated model

def _llama(attn_implementation):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, attention_dropout=0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                            dtype=torch.bfloat16).eval()


def _batches():
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(5))
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :4] = 0  # left padding
    packed = torch.tensor([list(range(5)) + list(range(7))])  # two documents in one row
    return [dict(input_ids=ids), dict(input_ids=ids, attention_mask=padding),
            dict(input_ids=ids[:1], position_ids=packed)]


@requires_transformers
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch_save"])
def test_copies_of_an_integrated_model_after_forwards(monkeypatch, how):
    """DM: a Llama model on flash_attn_hopper, after forwards with padding and packed documents (the integration's
    notes filled), deep-copied, pickled or saved with torch.save: the copy keeps the implementation and gives the
    original's logits bit for bit for the three batches, through the library's ops (not a fallback)."""
    import flash_attn_hopper.integrations.transformers as fah_tf

    fah_tf.register()
    with stand_ins(monkeypatch):
        model = _llama(fah_tf.ATTN_IMPLEMENTATION)
        with torch.no_grad():
            before = [model(**b).logits for b in _batches()]
        if how == "deepcopy":
            clone = copy.deepcopy(model)
        elif how == "pickle":
            clone = pickle.loads(pickle.dumps(model))
        else:
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            clone = torch.load(buffer, weights_only=False)
        assert clone.config._attn_implementation == fah_tf.ATTN_IMPLEMENTATION
        CALLS.clear()
        with torch.no_grad():
            after = [clone(**b).logits for b in _batches()]
            again = [model(**b).logits for b in _batches()]
        ops = [c[0] for c in CALLS]
        assert ops.count("fwd") == 2 * 2 * 2 and ops.count("fwd_varlen") == 2 * 2, ops  # 2 layers, 2 models
        for i, (a, b, c) in enumerate(zip(before, after, again)):
            assert torch.equal(a, b), f"{how}: batch {i}: the copy's logits differ from the original's"
            assert torch.equal(a, c), f"{how}: batch {i}: the original changed after being copied"
