"""Sixteenth round of the bug hunt (tests/bug_report_sources.md, "Sixteenth round"): CPU tests.

DN: fp32 -> fp16 / bf16 conversions that round one way (toward zero, toward -inf) instead of to nearest: out, the P
of the P V product, dQ, dK, dV. Each error is within an ulp, so DESIGN.md §3's per-element rule accepts it, but the
errors never cancel (ROCm/aiter#5151: a truncating bf16 store shrank a residual stream by 9 % over 72 calls; ROCm's
flash-attention switched its bf16 rounding to round-to-nearest, ROCm/flash-attention#78; arXiv 2510.04212 traces a
low-precision flash-attention training collapse to biased rounding errors). Here: the statistic of
tests/gpu_helpers.rounding_bias, which the GPU test applies to the kernels, on the GPU test's constructions with
float32 stand-ins: round-to-nearest (also with P rounded before P V, as the kernels do) passes, every one-sided
variant fails.

DO: sliding-window layers of transformers (5.17) keep only the last W - 1 keys in their DynamicCache
(DynamicSlidingWindowLayer) while the padding mask covers every position; the mask must reach the attention function
cut to the kept keys (flash-linear-attention#431: a cache bounded by the window against the full mask failed;
huggingface/transformers#34097: the sliding-window cache could not be used with flash attention). A left-padded batch,
prefill shorter or longer than the window, a chunk crossing it, decoding past it: the logits of the kept positions
equal SDPA's (Mistral) and eager's (Gemma 2: sliding and full layers, softcap).

DP: transformers' gradient checkpointing (``model.gradient_checkpointing_enable``, reentrant and not) around the
integration: the recomputation in the backward must run the forward's attention again with the notes the forward
kept (the per-forward mask view's unpadding, document ids from position_ids, the flash-attention keyword arguments);
huggingface/trl#3243 (gradient checkpointing with padding-free flash-attention batches failed). Padded, packed
(position_ids) and flash-keyword batches: logits, loss and every gradient equal the plain call's bit for bit and SDPA's
(with the same documents as a 4D mask) to float32 rounding.

DQ (a site of class CE that its fix did not reach; fixed in flash_attn_hopper/integrations/transformers.py): the
integration's document ids from position_ids (``_documents``) were computed in the caller's mode and kept per
position_ids tensor, so an evaluation forward under torch.inference_mode() kept inference tensors, which the training
forwards that followed with the same position_ids were served; flash_attn_hopper.attention keeps no bounds for an
inference tensor (class CE), so every layer of every such forward recomputed them: the docstring's "computed once per
forward (shared by the layers)" did not hold.

The ops run through the CPU stand-ins of tests/cpu_stand_ins.py where the library's own attention is called (DQ); DO
and DP replace the kernel entry points by the float32 references (as tests/test_transformers_cpu.py does).
"""

import copy

import pytest
import torch

from flash_attn_hopper import interface
from flash_attn_hopper.testing import _scores, attention_ref, attention_ref_grads, attention_varlen_ref, repeat_kv

from cpu_stand_ins import stand_ins
from gpu_helpers import ROUNDING_BIAS_LIMIT, rounding_bias
from optional_deps import requires_transformers

NAME = "flash_attn_hopper"


# ------------------------------------------------------------------------------ DN: one-sided rounding

def _toward_zero(x, dtype):
    y = x.to(dtype)
    return torch.where(y.float().abs() > x.abs(), torch.nextafter(y, torch.zeros_like(y)), y)


def _toward_minus_inf(x, dtype):
    y = x.to(dtype)
    return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, float("-inf"))), y)


def _dn_problem(dtype, seed=0):
    """A smaller form of the GPU test's causal GQA case (4 query heads on 2 K/V heads)."""
    g = torch.Generator().manual_seed(seed)
    b, n, h, hk, d = 2, 320, 4, 2, 64
    q, dout = (torch.randn(b, n, h, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, n, hk, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, dout


def _p_rounded_out(q, k, v, round_p):
    """The kernels' forward arithmetic in float32: unnormalised P = exp(S - rowmax), rounded to the input dtype by
    round_p for the P V product, normalised by the unrounded row sum; out in float32 (to be rounded)."""
    s = _scores(q.float(), repeat_kv(k.float(), q.shape[2]), q.shape[-1] ** -0.5, True, (-1, -1), 0.0)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return torch.einsum("bhqk,bkhd->bqhd", round_p(p) / p.sum(-1, keepdim=True), repeat_kv(v.float(), q.shape[2]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_rounding_bias_statistic_tells_nearest_from_one_sided(dtype):
    """DN: on the GPU test's construction (here smaller), out, dQ, dK, dV rounded to nearest from a float32 value that
    carries a little unbiased noise (a kernel's float32 result), and out from P rounded to nearest before P V, stay
    within ROUNDING_BIAS_LIMIT, as the naive reference does; rounding toward zero (the second statistic) or toward -inf
    (the first), of the outputs or of P alone, lies far outside it."""
    q, k, v, dout = _dn_problem(dtype)
    ref, _ = attention_ref(q, k, v, causal=True)
    naive, _ = attention_ref(q, k, v, causal=True, upcast=False)
    grads = attention_ref_grads(q, k, v, dout, causal=True)
    naive_grads = attention_ref_grads(q, k, v, dout, causal=True, upcast=False)
    g = torch.Generator().manual_seed(1)
    for name, r, n in zip(("out", "dq", "dk", "dv"), (ref, *grads), (naive, *naive_grads)):
        fp32 = r * (1 + 2.0**-20 * torch.randn(r.shape, generator=g))
        for label, x in (("nearest", fp32.to(dtype)), ("naive reference", n)):
            assert max(map(abs, rounding_bias(x, r))) <= ROUNDING_BIAS_LIMIT, f"{name} {label}: {rounding_bias(x, r)}"
        assert rounding_bias(_toward_zero(fp32, dtype), r)[1] < -5 * ROUNDING_BIAS_LIMIT, f"{name} toward zero"
        assert rounding_bias(_toward_minus_inf(fp32, dtype), r)[0] < -5 * ROUNDING_BIAS_LIMIT, f"{name} toward -inf"
    nearest_p = _p_rounded_out(q, k, v, lambda p: p.to(dtype).float()).to(dtype)
    assert max(map(abs, rounding_bias(nearest_p, ref))) <= ROUNDING_BIAS_LIMIT, rounding_bias(nearest_p, ref)
    truncated_p = _p_rounded_out(q, k, v, lambda p: _toward_zero(p, dtype).float()).to(dtype)
    assert rounding_bias(truncated_p, ref)[1] < -4 * ROUNDING_BIAS_LIMIT, rounding_bias(truncated_p, ref)


# ------------------------------------------------------------------------------ transformers helpers (DO, DP, DQ)

@pytest.fixture
def fah_tf():
    import flash_attn_hopper.integrations.transformers as module

    module.register()
    return module


@pytest.fixture
def reference_kernel(monkeypatch):
    """The kernel entry points replaced by the float32 references of the same contract (float32 models allowed);
    every call recorded (which entry point, whether grad mode was on, and the sequence boundaries or documents)."""
    calls = []

    def ref_attention(q, k, v, softmax_scale=None, causal=False, return_lse=False, *, window_size=(-1, -1),
                      softcap=0.0, document_ids=None, deterministic=False):
        calls.append(("dense", torch.is_grad_enabled(), None if document_ids is None else document_ids.tolist()))
        out, _ = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                               softcap=softcap, document_ids=document_ids)
        return out.to(q.dtype)

    def ref_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, return_lse=False, deterministic=False):
        assert max(cu_q.diff().tolist(), default=0) <= max_q and max(cu_k.diff().tolist(), default=0) <= max_k
        calls.append(("varlen", torch.is_grad_enabled(), (cu_q.tolist(), cu_k.tolist())))
        out, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, softmax_scale=softmax_scale, causal=causal,
                                      window_size=window_size, softcap=softcap)
        return out.to(q.dtype)

    monkeypatch.setattr(interface, "SUPPORTED_DTYPES", interface.SUPPORTED_DTYPES + (torch.float32,))
    monkeypatch.setattr(interface, "attention", ref_attention)
    monkeypatch.setattr(interface, "attention_varlen", ref_attention_varlen)
    return calls


def _model(config, attn_implementation, seed=0, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn_implementation,
                                             dtype=dtype)
    assert model.config._attn_implementation == attn_implementation
    return model


def _same_weights(config, other):
    ours = _model(config, NAME)
    theirs = _model(config, other, seed=1)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=97, max_position_embeddings=128)


def _sliding_config(model_type):
    from transformers import Gemma2Config, MistralConfig

    if model_type == "mistral":
        return MistralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, sliding_window=8)
    return Gemma2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=64, vocab_size=97, max_position_embeddings=128,
                        sliding_window=8, query_pre_attn_scalar=64, attn_logit_softcapping=2.0,
                        final_logit_softcapping=None)


# ------------------------------------------------------------------------------ DO: sliding-window caches, padding

@requires_transformers
@pytest.mark.parametrize("prefill,chunk", [(5, 6), (12, 1), (3, 13)], ids=["short_prefill_chunk_crosses",
                                                                          "long_prefill_decode", "chunk_over_padding"])
@pytest.mark.parametrize("model_type", ["mistral", "gemma2"])
def test_sliding_window_cache_with_a_padded_batch(fah_tf, reference_kernel, model_type, prefill, chunk):
    """DO: a batch with rows left-padded by 0, 4 and 9 tokens, a sliding window of 8 (the DynamicCache keeps the last
    7 keys of the sliding layers), prefill, one chunk, then one-token steps to 30 tokens: the logits of the kept
    positions equal those of the same steps in SDPA (Mistral) or eager (Gemma 2) attention. The cache is asserted to be
    the trimmed kind, and the steps past the window asserted to reach the attention function with fewer keys than
    positions."""
    from transformers import DynamicCache

    config = _sliding_config(model_type)
    ours, theirs = _same_weights(config, "sdpa" if model_type == "mistral" else "eager")
    ids = torch.randint(0, 97, (3, 30))
    mask = torch.ones(3, 30, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :9] = 0
    logits = {}
    with torch.no_grad():
        for name, model in (("ours", ours.eval()), ("theirs", theirs.eval())):
            cache = DynamicCache(config=model.config)
            steps = [(0, prefill), (prefill, prefill + chunk)] + [(t, t + 1) for t in range(prefill + chunk, 30)]
            pieces = [model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache,
                            use_cache=True).logits for a, b in steps]
            logits[name] = torch.cat(pieces, dim=1)
            assert type(cache.layers[0]).__name__ == "DynamicSlidingWindowLayer"
            assert cache.layers[0].keys.shape[2] == config.sliding_window - 1
    keep = mask.bool()
    torch.testing.assert_close(logits["ours"][keep], logits["theirs"][keep], rtol=1e-4, atol=1e-5)
    assert reference_kernel, "the attention function was not reached"


# ------------------------------------------------------------------------------ DP: gradient checkpointing

def _dp_batch(how):
    """(input_ids, our model's extra inputs, SDPA's extra inputs with the same attention as a mask, labels)."""
    ids = torch.randint(0, 97, (2, 20))
    labels = ids.clone()
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    if how == "padded":
        mask = torch.ones(2, 20, dtype=torch.long)
        mask[0, :5] = 0
        mask[1, 15:] = 0
        labels[~mask.bool()] = -100
        return ids, dict(attention_mask=mask), dict(attention_mask=mask), labels
    if how == "packed":
        pos = torch.tensor([list(range(7)) + list(range(13)), list(range(12)) + list(range(8))])
        docs = torch.tensor([[0] * 7 + [1] * 13, [0] * 12 + [1] * 8])
        blocks = (docs[:, :, None] == docs[:, None, :]) & causal
        return ids, dict(position_ids=pos), dict(position_ids=pos, attention_mask=blocks[:, None]), labels
    ids, labels = ids[:1], labels[:1]
    pos = torch.tensor([list(range(7)) + list(range(13))])
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    docs = torch.tensor([[0] * 7 + [1] * 13])
    blocks = (docs[:, :, None] == docs[:, None, :]) & causal
    flash_kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=13, max_length_k=13)
    return ids, dict(position_ids=pos, **flash_kwargs), dict(position_ids=pos, attention_mask=blocks[:, None]), labels


def _training_step(model, ids, labels, inputs):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, use_cache=False, **inputs)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@requires_transformers
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("how", ["padded", "packed", "flash_kwargs"])
def test_gradient_checkpointing_of_an_integrated_model(fah_tf, reference_kernel, how, use_reentrant):
    """DP: a two-layer Llama with gradient checkpointing: logits, loss and every gradient bitwise those of the same
    model without it, and equal to SDPA's (documents as a 4D mask); the attention function ran twice per layer (the
    forward and the recomputation in the backward), with grad mode on in the recomputation."""
    ids, ours_inputs, sdpa_inputs, labels = _dp_batch(how)
    ours, sdpa = _same_weights(_llama_config(), "sdpa")
    plain = _training_step(ours, ids, labels, ours_inputs)
    reference_kernel.clear()
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    checkpointed = _training_step(ours, ids, labels, ours_inputs)
    assert len(reference_kernel) == 4 and reference_kernel[2][1] and reference_kernel[3][1], reference_kernel
    assert reference_kernel[0][2] == reference_kernel[2][2], "the recomputation saw other boundaries or documents"
    theirs = _training_step(sdpa, ids, labels, sdpa_inputs)
    assert torch.equal(checkpointed[0], plain[0]) and torch.equal(checkpointed[1], plain[1])
    for name, grad in plain[2].items():
        assert torch.equal(checkpointed[2][name], grad), f"{name}: checkpointing changed the gradient"
    keep = ours_inputs.get("attention_mask", torch.ones(ids.shape)).bool()
    torch.testing.assert_close(checkpointed[0][keep], theirs[0][keep], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(checkpointed[1], theirs[1], rtol=1e-5, atol=1e-6)
    for name, grad in theirs[2].items():
        torch.testing.assert_close(checkpointed[2][name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------ DQ: document ids of inference_mode

def _count_bounds(monkeypatch):
    counted = []
    real = interface.document_bounds

    def counting(document_ids):
        counted.append(document_ids.is_inference())
        return real(document_ids)

    monkeypatch.setattr(interface, "document_bounds", counting)
    return counted


@requires_transformers
def test_document_ids_kept_from_an_inference_mode_forward_are_not_inference_tensors(fah_tf, monkeypatch):
    """DQ: _documents called under torch.inference_mode() for a normal position_ids tensor, then outside it (the next
    training forward, same tensor): the ids served are not inference tensors, and the document bounds of four layers
    are computed once (before the fix: inference ids, bounds computed in each of the four layers)."""
    monkeypatch.setattr(interface, "_DOCUMENT_BOUNDS", interface._ValueNotes())
    counted = _count_bounds(monkeypatch)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
    with torch.inference_mode():
        evaluation = fah_tf._documents(pos, q, k)
    training = fah_tf._documents(pos, q, k)
    assert training.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]] * 2 and torch.equal(evaluation, training)
    assert not training.is_inference(), "an inference tensor kept from an inference_mode forward"
    for _ in range(4):  # the layers of one training forward
        interface._document_bounds(training, False)
    assert counted == [False], f"document bounds computed {len(counted)} times for 4 layers"


@requires_transformers
def test_training_forward_after_an_inference_mode_forward_with_the_same_position_ids(fah_tf, monkeypatch):
    """DQ through a bf16 two-layer Llama and the library's attention (CPU stand-ins of the ops): an evaluation forward
    under torch.inference_mode() with packed position_ids, then two training steps with the same position_ids tensor:
    the document bounds are computed once in all (by the evaluation's first layer, of ids that are not an inference
    tensor, and kept for the other layers and forwards; before the fix: once per layer of every forward, of inference
    ids), and each training step's logits, loss and gradients are bitwise those of a model that never ran the
    evaluation."""
    with stand_ins(monkeypatch):
        counted = _count_bounds(monkeypatch)
        config = _llama_config()
        ours = _model(config, NAME, dtype=torch.bfloat16)
        fresh = _model(config, NAME, dtype=torch.bfloat16)
        ids = torch.randint(0, 97, (1, 20))
        pos = torch.tensor([list(range(7)) + list(range(13))])
        with torch.inference_mode():
            ours.eval()(input_ids=ids, position_ids=pos, use_cache=False)
        assert counted == [False], f"bounds computations in the evaluation's two layers: {counted}"
        steps = [_training_step(ours, ids, ids, dict(position_ids=pos)) for _ in range(2)]
        assert counted == [False], f"bounds computations over the forwards (True: of an inference tensor): {counted}"
        expected = _training_step(fresh, ids, ids, dict(position_ids=pos.clone()))
        for logits, loss, grads in steps:
            assert torch.equal(logits, expected[0]) and torch.equal(loss, expected[1])
            for name, grad in expected[2].items():
                assert torch.equal(grads[name], grad), name


@requires_transformers
def test_documents_under_inference_mode_for_an_inference_position_ids_tensor(fah_tf):
    """DQ's edge: position_ids made under torch.inference_mode() (an evaluation loop's own tensor) are not kept (they
    have no version counter); the ids are still computed and right, inside and outside inference mode."""
    with torch.inference_mode():
        pos = torch.tensor([[0, 1, 0, 1, 2]])
        q = torch.randn(1, 2, 5, 8)
        inside = fah_tf._documents(pos, q, q)
    outside = fah_tf._documents(pos, q, q)
    assert inside.tolist() == outside.tolist() == [[0, 0, 1, 1, 1]]
    assert fah_tf._DOCUMENTS.get(pos, q.device) is interface._ValueNotes.MISSING

