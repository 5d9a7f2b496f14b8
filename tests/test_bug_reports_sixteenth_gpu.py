"""Sixteenth round of the bug hunt (tests/bug_report_sources.md, "Sixteenth round"), GPU part.

DN: the kernels' fp32 -> fp16 / bf16 conversions (out; P for the P V product; dS; dQ, dK, dV in the postprocess and
the dK/dV stores) must round to nearest: a conversion that rounds one way stays within an ulp, which DESIGN.md §3's
per-element rule accepts, but its errors never cancel (ROCm/aiter#5151, ROCm/flash-attention#78, arXiv 2510.04212).
The statistic of tests/gpu_helpers.rounding_bias, mean(err) and mean(err * sign(ref)) over mean|err| against the
float32 reference, must stay within ROUNDING_BIAS_LIMIT for out, dQ, dK and dV: random causal GQA inputs, a softcap
with a window (bf16 takes the fixed-maximum softmax there, with its rounding-sum normalisation), varlen, and the
construction of arXiv 2510.04212 (low-rank keys: rows whose maximum is reached by many keys at once, P exactly 1 there;
values of one sign per channel). By the code (csrc/flash/common/utils.hpp convert_type / convert_type_into:
cutlass::NumericArrayConverter with its default round-to-nearest; csrc/flash/bwd/prepost_bwd_sm90.hpp: Element(float),
round-to-nearest) no bias is expected; tests/test_bug_reports_sixteenth_cpu.py shows the statistic failing for
conversions toward zero or toward -inf, of the outputs or of P alone, on the same constructions.

DP: transformers' gradient checkpointing around the integration (padded and packed batches, reentrant and not): the
recomputation in the backward reaches the attention again, and the gradients match the model's without checkpointing.

DQ: after an evaluation forward under torch.inference_mode(), the integration's training forwards with the same
position_ids tensor get document ids that are not inference tensors, whose bounds are computed once (fixed in this
round; before, every layer of every later forward recomputed them); their gradients are right by the rule.

DR: attention sinks in fp16: a few keys take ~99 % of every row's weight, so P of every other key, against the sinks'
maximum in the forward's sink block and after the normalisation in the backward (P for dV, dS for dQ and dK), is an
fp16 subnormal; a conversion or exponential that flushes subnormals to zero drops those keys' gradients while the rule
over the whole tensor (its naive error set by the sinks' large dV) passes. The non-sink keys' dK and dV are checked by
the rule on their own (arXiv 2606.06521, pages: P cast to a narrow format underflows to zero next to an attention sink;
class AT covers fp16 subnormal inputs, not subnormal P). By the code (--use_fast_math's flush-to-zero applies to f32
subnormals only; the f32 -> f16 conversion keeps f16 subnormal results) no fault is expected.

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build lacks
the head_dim / dtype (or transformers is not installed)."""

import copy
import types

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper import interface
from flash_attn_hopper.testing import (assert_close_by_rule, attention_ref, attention_ref_grads, attention_varlen_ref,
                                       attention_varlen_ref_grads)
from gpu_helpers import (DTYPES, ROUNDING_BIAS_LIMIT, check_attention, check_attention_varlen, cu_seqlens,
                         poison_allocator, randn, require_built, rounding_bias, run_attention)

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"  # (a CPU dry run of the constructions sets it to "cpu", with CPU stand-ins of the ops)


# ------------------------------------------------------------------------------ DN

DN_CASES = ["causal_gqa", "softcap_window", "low_rank_ties", "varlen"]


def _dn_dense(case, dtype):
    """(q, k, v, dout, opts, head_dim) of a dense DN case."""
    if case == "causal_gqa":
        b, sq, sk, h, hk, d = 2, 1024, 1024, 8, 2, 128
        opts = dict(causal=True)
    elif case == "softcap_window":
        b, sq, sk, h, hk, d = 2, 777, 1024, 4, 4, 64
        opts = dict(softcap=20.0, window_size=(300, 50))
    else:  # low_rank_ties
        b, sq, sk, h, hk, d = 2, 1024, 1024, 8, 8, 64
        opts = dict(causal=True)
    q = randn(b, sq, h, d, dtype=dtype)
    dout = randn(b, sq, h, d, dtype=dtype)
    if case == "low_rank_ties":
        # 8 distinct key vectors per (batch, head), repeated along the sequence: every row's maximum is reached by
        # many keys at once (P exactly 1 there); values of one sign per channel (even channels negative)
        base = torch.randn(b, 8, hk, d, device=DEVICE)
        k = base[:, torch.randint(0, 8, (sk,), device=DEVICE)].to(dtype)
        sign = torch.where(torch.arange(d, device=DEVICE) % 2 == 0, -1.0, 1.0)
        v = (torch.randn(b, sk, hk, d, device=DEVICE).abs() * sign).to(dtype)
    else:
        k = randn(b, sk, hk, d, dtype=dtype)
        v = randn(b, sk, hk, d, dtype=dtype)
    return q, k, v, dout, opts, d


def _assert_no_rounding_bias(name, tensors, refs):
    for what, x, r in zip(("out", "dq", "dk", "dv"), tensors, refs):
        toward_minus_inf, toward_zero = rounding_bias(x, r)
        assert abs(toward_minus_inf) <= ROUNDING_BIAS_LIMIT and abs(toward_zero) <= ROUNDING_BIAS_LIMIT, (
            f"{name} {what}: mean error {toward_minus_inf:+.3f} and mean error toward the reference's sign "
            f"{toward_zero:+.3f} of the mean |error| (limit {ROUNDING_BIAS_LIMIT}): one-sided rounding")


@pytest.mark.parametrize("case", DN_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_conversions_round_to_nearest_without_bias(dtype, case):
    """DN: out, dQ, dK, dV by the rule, and their rounding errors against the float32 reference as often up as down
    (rounding_bias within ROUNDING_BIAS_LIMIT), for each case (see the module docstring)."""
    name = f"{case} {dtype}"
    if case == "varlen":
        require_built(128, dtype)
        lq, lk = [300, 0, 1000, 517], [300, 40, 1000, 600]
        opts = dict(causal=True)
        q = randn(sum(lq), 8, 128, dtype=dtype)
        k, v = (randn(sum(lk), 2, 128, dtype=dtype) for _ in range(2))
        dout = randn(sum(lq), 8, 128, dtype=dtype)
        cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        e = q.element_size()
        poison_allocator(q.numel() * e, k.numel() * e, sum(lq) * 8 * 4)
        out, lse = flash_attn_hopper.attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), return_lse=True,
                                                      **opts)
        poison_allocator(q.numel() * e, k.numel() * e)
        grads = torch.autograd.grad(out, leaves, dout)
        out, lse = out.detach(), lse.detach()
        check_attention_varlen(out, lse, grads, q, k, v, dout, cu_q, cu_k, name, **opts)
        ref_out, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, **opts)
        ref_grads = attention_varlen_ref_grads(q, k, v, dout, cu_q, cu_k, **opts)
    else:
        q, k, v, dout, opts, head_dim = _dn_dense(case, dtype)
        require_built(head_dim, dtype)
        out, lse, grads = run_attention(q, k, v, dout, **opts)
        check_attention(out, lse, grads, q, k, v, dout, name, **opts)
        ref_out, _ = attention_ref(q, k, v, **opts)
        ref_grads = attention_ref_grads(q, k, v, dout, **opts)
    _assert_no_rounding_bias(name, (out, *grads), (ref_out, *ref_grads))


# ------------------------------------------------------------------------------ transformers (DP, DQ)

def _transformers():
    pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
    import flash_attn_hopper.integrations.transformers as fah_tf

    fah_tf.register()
    return fah_tf


def _count_calls(monkeypatch, name):
    calls = []
    real = getattr(interface, name)

    def counted(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(interface, name, counted)
    return calls


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("how", ["padded", "packed"])
def test_gradient_checkpointing_of_an_integrated_model(monkeypatch, how, use_reentrant):
    """DP: a two-layer bf16 Llama (head_dim 64, GQA 4/2) on a padded (varlen) or packed (documents) batch, deterministic
    attention: with gradient checkpointing the attention runs again in the backward (grad mode on), the logits are
    bitwise those without it, and every parameter gradient is within 2^-6 of the plain one in L2 norm (a recomputation
    with other sequences or documents changes the attention's output, and so the gradients, by far more)."""
    _transformers()
    require_built(64, torch.bfloat16)
    from transformers import AutoModelForCausalLM, LlamaConfig

    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, attention_dropout=0.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="flash_attn_hopper",
                                             dtype=torch.bfloat16).to(DEVICE).train()
    ids = torch.randint(0, 512, (2, 200), device=DEVICE)
    labels = ids.clone()
    if how == "padded":
        mask = torch.ones(2, 200, dtype=torch.long, device=DEVICE)
        mask[0, :37] = 0
        mask[1, 150:] = 0
        labels[~mask.bool()] = -100
        inputs, entry = dict(attention_mask=mask), "attention_varlen"
    else:
        pos = torch.tensor([list(range(77)) + list(range(123)), list(range(150)) + list(range(50))], device=DEVICE)
        inputs, entry = dict(position_ids=pos), "attention"
    calls = _count_calls(monkeypatch, entry)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels, use_cache=False, **inputs)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    plain_logits, plain = step()
    assert len(calls) == 2, calls
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    calls.clear()
    logits, grads = step()
    assert len(calls) == 4 and calls[2] and calls[3], f"the attention calls (grad mode) with checkpointing: {calls}"
    assert torch.equal(logits, plain_logits), "checkpointing changed the logits"
    for name, g in plain.items():
        err = (grads[name].double() - g.double()).norm().item()
        assert err <= g.double().norm().item() / 64, f"{name}: checkpointing moved the gradient by {err:.3e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_training_call_after_an_inference_mode_call_with_the_same_position_ids(monkeypatch, dtype):
    """DQ: the integration's attention function for packed position_ids, first under torch.inference_mode() (an
    evaluation), then three times with grad (a training forward's layers) with the same position_ids tensor: one
    document bounds computation in all, of ids that are not inference tensors; out, dQ, dK, dV of the training call by
    the rule against the reference with the same documents."""
    fah_tf = _transformers()
    require_built(64, dtype)
    monkeypatch.setattr(interface, "_DOCUMENT_BOUNDS", interface._ValueNotes())
    bounds_of = []
    real = interface.document_bounds
    monkeypatch.setattr(interface, "document_bounds", lambda ids: bounds_of.append(ids.is_inference()) or real(ids))
    module = types.SimpleNamespace(is_causal=True, layer_idx=0)
    pos = torch.tensor([list(range(100)) + list(range(141)) + list(range(59))], device=DEVICE)
    q = randn(2, 4, 300, 64, dtype=dtype)  # the integration's (batch, heads, seqlen, head_dim)
    k, v = (randn(2, 2, 300, 64, dtype=dtype) for _ in range(2))
    dout = randn(2, 300, 4, 64, dtype=dtype)
    with torch.inference_mode():
        fah_tf.flash_attn_hopper_attention_forward(module, q, k, v, None, position_ids=pos)
    for _ in range(3):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out, _ = fah_tf.flash_attn_hopper_attention_forward(module, *leaves, None, position_ids=pos)
        grads = torch.autograd.grad(out, leaves, dout)
    assert bounds_of == [False], f"document bounds computations (True: of an inference tensor): {bounds_of}"
    ids = torch.tensor([[0] * 100 + [1] * 141 + [2] * 59] * 2, device=DEVICE)
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))  # (batch, seqlen, heads, head_dim), as out
    name = f"documents after inference_mode {dtype}"
    ref, _ = attention_ref(qs, ks, vs, causal=True, document_ids=ids)
    naive, _ = attention_ref(qs, ks, vs, causal=True, document_ids=ids, upcast=False)
    assert_close_by_rule(out.detach(), ref, naive, f"{name} out")
    ref_g = attention_ref_grads(qs, ks, vs, dout, causal=True, document_ids=ids)
    naive_g = attention_ref_grads(qs, ks, vs, dout, causal=True, document_ids=ids, upcast=False)
    for gname, g, r, n in zip(("dq", "dk", "dv"), grads, ref_g, naive_g):
        assert_close_by_rule(g.transpose(1, 2), r, n, f"{name} {gname}")


# ------------------------------------------------------------------------------ DR

FP16_SMALLEST_NORMAL = 2.0**-14


def _sink_inputs(head_dim, dtype, batch=2, seqlen=1024, nheads=4, sinks=4, margin=10.4):
    """q, k, v, dout where every query's scores at the first `sinks` keys lie `margin` nats (softmax_scale 1/sqrt(d))
    above the others: a shared direction (coordinate 0) carries 4 in every q and 2 * margin * sqrt(d) / 4 in the sink
    keys, little in the others. P of a non-sink key is then ~exp(-margin) / sinks (~8e-6 at 10.4) after the
    normalisation and ~3e-5 against the sinks' maximum: below fp16's smallest normal (6.1e-5)."""
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, head_dim, device=DEVICE) for _ in range(4))
    q[..., 0] = 4.0
    k[..., 0] *= 0.25
    k[:, :sinks, :, 0] = margin * head_dim**0.5 / 4.0
    return [t.to(dtype) for t in (q, k, v, dout)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_attention_sinks_put_the_other_keys_in_the_subnormal_range(dtype, head_dim, causal):
    """DR: 4 sink keys take ~99 % of every row's weight; the forward's P of the other keys in the sinks' block (key
    blocks are visited last first, so that block's P is taken against the sinks' maximum) and the backward's P and dS
    of every other key are fp16 subnormals. out, LSE, dQ, dK, dV by the rule, and dK, dV of the non-sink keys by the
    rule on their own (their values are ~1e-3 of the sinks': a rule over the whole tensor, whose naive error comes from
    the sinks' large dV, cannot see them flushed to zero)."""
    require_built(head_dim, dtype)
    q, k, v, dout = _sink_inputs(head_dim, dtype)
    opts = dict(causal=causal)
    out, lse, grads = run_attention(q, k, v, dout, **opts)
    name = f"sinks {dtype} {head_dim} {'causal' if causal else 'full'}"
    # the construction: most P of the non-sink keys (normalised, as the backward recomputes them) below fp16's
    # smallest normal, but not negligible in sum
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * head_dim**-0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool, device=DEVICE).tril(), -torch.inf)
    p = torch.exp(scores[..., 4:] - lse[..., None])
    subnormal = (p > 0) & (p < FP16_SMALLEST_NORMAL)
    assert subnormal.sum() >= 0.4 * (p > 0).sum() and p.sum(-1).mean() > 2e-3, "construction"
    del scores, p, subnormal
    check_attention(out, lse, grads, q, k, v, dout, name, **opts)
    ref_g = attention_ref_grads(q, k, v, dout, **opts)
    naive_g = attention_ref_grads(q, k, v, dout, upcast=False, **opts)
    for gname, g, r, n in zip(("dk", "dv"), grads[1:], ref_g[1:], naive_g[1:]):
        assert_close_by_rule(g[:, 4:], r[:, 4:], n[:, 4:], f"{name} {gname} of the non-sink keys")
