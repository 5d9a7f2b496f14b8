"""Twelfth round of the bug hunt (tests/bug_report_sources.md, "Twelfth round"): CPU tests.

CF: bidirectional (encoder) sliding-window attention through the transformers integration. ModernBERT's local layers
(and other encoders built on transformers' ``create_bidirectional_sliding_window_mask``) ask the mask function for the
pattern ``|i - j| <= H`` and pass ``sliding_window = H + 1`` to the attention function (transformers' flash-attention
convention, a band of W - 1 keys per side). The integration's attention function computes such windows, but its mask
function refused the pattern with a ValueError ("sliding windows are fine"), so these models did not run at all. Other
backends lost the window silently (vllm-project/semantic-router#3406, sglang#33600, flashinfer#4893). A layer whose
sliding_window does not match the mask it was built with (W - 1 != H: eager follows the mask) must raise, not run
another window.

CW (the adversarial review): where no band mask was recognised for the module's config, its ``config.sliding_window``
is the band eager uses; DiffusionGemma's decoder (a plain bidirectional mask, W = config.sliding_window) and T5Gemma's
encoder (W = H) ran (W - 1, W - 1) silently before.

The kernels are replaced by the float32 references of the same contract (flash_attn_hopper.testing), as in
tests/test_transformers_cpu.py; the models are compared against transformers' eager attention in float32.
"""

import copy
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper import interface
from flash_attn_hopper.testing import attention_ref, attention_varlen_ref

from optional_deps import requires_transformers

NAME = "flash_attn_hopper"
HALF_WIDTH = 4  # ModernBERT's config.sliding_window = local_attention // 2


@pytest.fixture
def fah_tf():
    import flash_attn_hopper.integrations.transformers as module

    module.register()
    return module


@pytest.fixture
def reference_kernels(monkeypatch):
    """The kernel entry points replaced by the differentiable float32 references; records each call's options."""
    calls = []
    monkeypatch.setattr(interface, "SUPPORTED_DTYPES", interface.SUPPORTED_DTYPES + (torch.float32,))

    def ref_attention(q, k, v, softmax_scale=None, causal=False, return_lse=False, *, window_size=(-1, -1),
                      softcap=0.0, document_ids=None, deterministic=False):
        calls.append(("dense", causal, tuple(window_size)))
        out, _ = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                               softcap=softcap, document_ids=document_ids)
        return out.to(q.dtype)

    def ref_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, return_lse=False, deterministic=False):
        calls.append(("varlen", causal, tuple(window_size)))
        assert max(cu_q.diff().tolist(), default=0) <= max_q and max(cu_k.diff().tolist(), default=0) <= max_k
        out, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, softmax_scale=softmax_scale, causal=causal,
                                      window_size=window_size, softcap=softcap)
        return out.to(q.dtype)

    monkeypatch.setattr(interface, "attention", ref_attention)
    monkeypatch.setattr(interface, "attention_varlen", ref_attention_varlen)
    return calls


def _modernbert_config(**overrides):
    from transformers import ModernBertConfig

    # ids inside the tiny vocabulary (the defaults are ModernBERT's 50k-token ones)
    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2, vocab_size=97,
                  max_position_embeddings=128, local_attention=2 * HALF_WIDTH, global_attn_every_n_layers=3,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    kwargs.update(overrides)
    return ModernBertConfig(**kwargs)


def _modernbert(config, attn_implementation, seed=0):
    from transformers import ModernBertModel

    torch.manual_seed(seed)
    model = ModernBertModel._from_config(copy.deepcopy(config), attn_implementation=attn_implementation,
                                         dtype=torch.float32)
    assert model.config._attn_implementation == attn_implementation
    return model


def _padding_mask(kind, batch, seqlen):
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    if kind == "right":
        mask[1, seqlen - 9:] = 0
    elif kind == "left":
        mask[0, :6] = 0
    return None if kind == "none" else mask


def _compare_with_eager(ours, eager, ids, mask):
    """Both models' last hidden states at the kept positions, and every parameter gradient of a loss on them, must
    agree; returns (kept, eager's hidden states)."""
    kept = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    results = []
    for model in (ours, eager):
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        hidden[kept].square().sum().backward()
        results.append((hidden.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (out_a, grads_a), (out_b, grads_b) = results
    torch.testing.assert_close(out_a[kept], out_b[kept], rtol=1e-4, atol=1e-5)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    return kept, out_b


@requires_transformers
@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_modernbert_local_layers_match_eager(fah_tf, reference_kernels, padding):
    """A tiny ModernBERT (one global, two local layers, half-width 4) over 30 tokens: the outputs at kept positions and
    every parameter gradient equal eager attention's; the local layers reach the kernel with window (4, 4), not
    causal. Before the fix the mask function raised ValueError for the local layers' pattern."""
    config = _modernbert_config()
    ours = _modernbert(config, NAME)
    eager = _modernbert(config, "eager", seed=1)
    eager.load_state_dict(ours.state_dict())
    torch.manual_seed(2)
    ids = torch.randint(3, 97, (2, 30))
    mask = _padding_mask(padding, 2, 30)
    kept, out_b = _compare_with_eager(ours, eager, ids, mask)
    assert {call[1:] for call in reference_kernels} == {(False, (-1, -1)), (False, (HALF_WIDTH, HALF_WIDTH))}
    assert {call[0] for call in reference_kernels} == {"dense" if mask is None else "varlen"}
    # the window matters here: the same weights with every layer global give other outputs
    everywhere = _modernbert(_modernbert_config(global_attn_every_n_layers=1), "eager", seed=1)
    everywhere.load_state_dict(ours.state_dict())
    with torch.no_grad():
        full = everywhere(input_ids=ids, attention_mask=mask).last_hidden_state
    assert not torch.allclose(full[kept], out_b[kept], atol=1e-3)


@requires_transformers
def test_layer_window_unlike_its_mask_raises(fah_tf, reference_kernels):
    """A layer that passes the mask's half-width H itself as sliding_window (as 5.17's MuseGlimmer assistant does):
    the kernel would run H - 1 keys per side while eager's mask allows H, a silent difference; it raises, naming
    sliding_window, before any kernel runs."""
    model = _modernbert(_modernbert_config(), NAME)
    for layer in model.layers:
        if layer.attn.sliding_window is not None:
            layer.attn.sliding_window = HALF_WIDTH
    with pytest.raises(NotImplementedError, match=f"sliding_window={HALF_WIDTH + 1}"):
        model(input_ids=torch.randint(3, 97, (2, 30)))
    assert not [call for call in reference_kernels if call[2] != (-1, -1)]


@requires_transformers
def test_mask_function_recognises_the_bidirectional_sliding_window(fah_tf):
    """The mask function accepts transformers' bidirectional sliding-window pattern for its local_size (returns None
    without padding, the padding mask with it), refuses it for another local_size, and refuses queries that are not
    the last key positions (the kernel aligns windows bottom-right)."""
    from transformers.masking_utils import sliding_window_bidirectional_mask_function

    common = dict(batch_size=2, allow_is_bidirectional_skip=True, dtype=torch.float32)
    pattern = sliding_window_bidirectional_mask_function(5)
    assert fah_tf.flash_attn_hopper_mask(q_length=16, kv_length=16, mask_function=pattern, local_size=5,
                                         **common) is None
    padding = torch.ones(2, 16, dtype=torch.bool)
    padding[1, 12:] = False
    got = fah_tf.flash_attn_hopper_mask(q_length=16, kv_length=16, mask_function=pattern, local_size=5,
                                        attention_mask=padding, **common)
    assert torch.equal(got, padding)
    for local_size in (4, 7):
        with pytest.raises(ValueError, match="mask pattern"):
            fah_tf.flash_attn_hopper_mask(q_length=16, kv_length=16, mask_function=pattern, local_size=local_size,
                                          **common)
    # local_size H + 1 is a sliding-window causal mask's window widened to the band |i - j| < H + 1 (Gemma 3's
    # bidirectional overlay): the same band, recognised with its half-width H
    assert fah_tf._bidirectional_half_width(pattern, 6) == 5 and fah_tf._bidirectional_half_width(pattern, 7) is None
    with pytest.raises(ValueError, match="last key positions"):
        fah_tf.flash_attn_hopper_mask(q_length=4, kv_length=16, q_offset=0, kv_offset=0, mask_function=pattern,
                                      local_size=5, **common)
    # queries that are the last key positions (a cache before them) pass
    assert fah_tf.flash_attn_hopper_mask(q_length=4, kv_length=16, q_offset=12, kv_offset=0, mask_function=pattern,
                                         local_size=5, **common) is None


@requires_transformers
def test_bidirectional_pattern_recognised_under_a_fake_tensor_mode(fah_tf):
    """As the causal pattern check (test_transformers_cpu): its index tensors are its own, not fake ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.masking_utils import sliding_window_bidirectional_mask_function

    with FakeTensorMode():
        assert fah_tf._is_sliding_bidirectional(sliding_window_bidirectional_mask_function(8), 8)
        assert not fah_tf._is_sliding_bidirectional(sliding_window_bidirectional_mask_function(9), 8)
        assert not fah_tf._is_sliding_bidirectional(sliding_window_bidirectional_mask_function(0), 1)
    assert fah_tf._is_sliding_bidirectional(sliding_window_bidirectional_mask_function(0), 0)


# CW (the adversarial review): a non-causal window against the config when no band mask was recognised


def _qkv(seqlen=12):
    return tuple(torch.randn(2, 2, seqlen, 32, dtype=torch.bfloat16) for _ in range(3))


@requires_transformers
@pytest.mark.parametrize("config_window", [4, None])
def test_non_causal_window_that_disagrees_with_the_config_is_refused(fah_tf, monkeypatch, config_window):
    """DiffusionGemma's decoder attention (transformers 5.17) is non-causal and passes sliding_window =
    config.sliding_window to the attention function while its model builds a plain bidirectional mask (eager attends to
    every key); T5Gemma's encoder passes the same W with the band |i - j| <= W. The kernel would run (W - 1, W - 1): not
    eager's mask in either model. Before the fix the call reached the kernel with that window; now NotImplementedError
    names both values. A config whose band is W - 1 (ModernBERT's +1 convention), or no config (a direct call), runs."""
    calls = []
    monkeypatch.setattr(interface, "attention", lambda q, k, v, **kw: calls.append(kw) or torch.zeros_like(q))
    q, k, v = _qkv()
    module = types.SimpleNamespace(is_causal=False, layer_idx=3,
                                   config=types.SimpleNamespace(sliding_window=config_window))
    if config_window is not None:
        refusal = r"sliding_window=4 .* band \|i - j\| <= 3 .* \|i - j\| <= 4 .*sliding_window=5"
        with pytest.raises(NotImplementedError, match=refusal):
            fah_tf.flash_attn_hopper_attention_forward(module, q, k, v, None, sliding_window=4)
        assert not calls
        module.config.sliding_window = 3
    fah_tf.flash_attn_hopper_attention_forward(module, q, k, v, None, sliding_window=4)
    fah_tf.flash_attn_hopper_attention_forward(types.SimpleNamespace(is_causal=False), q, k, v, None, sliding_window=4)
    assert [c["window_size"] for c in calls] == [(3, 3), (3, 3)]
    # causal modules keep their window whatever the config says (Mistral: W = config.sliding_window, (W - 1, 0))
    module.is_causal, module.config.sliding_window = True, 4
    fah_tf.flash_attn_hopper_attention_forward(module, q, k, v, None, sliding_window=4)
    assert calls[-1]["window_size"] == (3, 0)


# CF, Gemma 3 with use_bidirectional_attention (EmbeddingGemma): its full layers' mask is a causal mask or'ed with
# True, its sliding layers' a sliding-window causal mask of window W or'ed with the band |i - j| < W (the config turns
# a given sliding_window 9 into W = 9 // 2 + 1 = 5); the layers pass sliding_window = W, i.e. the band
# |i - j| <= W - 1 of that mask.


def _gemma3_bidirectional(attn_implementation, seed=0, layer_types=("sliding_attention", "full_attention")):
    from transformers import Gemma3TextConfig, Gemma3TextModel

    config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=32, vocab_size=97, max_position_embeddings=128,
                              sliding_window=9, layer_types=list(layer_types),
                              use_bidirectional_attention=True, pad_token_id=0)
    torch.manual_seed(seed)
    model = Gemma3TextModel._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    assert model.config._attn_implementation == attn_implementation
    return model


@requires_transformers
@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_gemma3_bidirectional_matches_eager(fah_tf, reference_kernels, padding):
    """Gemma 3 with use_bidirectional_attention (EmbeddingGemma's attention) over 30 tokens: the outputs at kept
    positions and every parameter gradient equal eager attention's; the sliding layer reaches the kernel with window
    (4, 4) (W = 5: keys within 4 positions on either side), the full layer with none; the window matters (the same
    weights with two full layers give other outputs). Before, the mask
    function refused both layers' masks (overlays of the causal ones) as custom patterns."""
    ours = _gemma3_bidirectional(NAME)
    assert ours.config.sliding_window == 5
    eager = _gemma3_bidirectional("eager", seed=1)
    eager.load_state_dict(ours.state_dict())
    torch.manual_seed(3)
    ids = torch.randint(3, 97, (2, 30))
    mask = _padding_mask(padding, 2, 30)
    kept, out_b = _compare_with_eager(ours, eager, ids, mask)
    assert {call[1:] for call in reference_kernels} == {(False, (-1, -1)), (False, (4, 4))}
    everywhere = _gemma3_bidirectional("eager", seed=1, layer_types=("full_attention", "full_attention"))
    everywhere.load_state_dict(ours.state_dict())
    with torch.no_grad():
        full = everywhere(input_ids=ids, attention_mask=mask).last_hidden_state
    assert not torch.allclose(full[kept], out_b[kept], atol=1e-3)


@requires_transformers
def test_mask_that_reads_tensors_is_refused_without_being_evaluated(fah_tf):
    """CG's review: the probe for masks that are True everywhere (and the window probes) evaluated any mask function on
    batch row 0 at sample indices up to 70001. A data-dependent overlay, PaliGemma's prefix / Gemma 3's image blocks
    (transformers' blockwise_overlay over per-row block ids, or'ed with a causal mask), is True at every sample pair
    when row 0 is one block, though row 1 has a causal suffix: it was taken as bidirectional (row 1's suffix would
    attend ahead). And on a 300-token batch the probes indexed the block ids at positions past the sequence (refused
    here only by the IndexError; on a CUDA device a device-side assert, which no exception handler undoes). Now a mask
    that reads tensors is refused by the mask pattern ValueError without being evaluated."""
    from transformers.masking_utils import (blockwise_overlay, causal_mask_function, or_masks,
                                            sliding_window_causal_mask_function)

    n = 70002
    ids = torch.zeros(2, n, dtype=torch.long)
    ids[1, n // 2:] = -1  # row 1: a prefix, then a causal suffix
    with pytest.raises(ValueError, match="reads tensors"):
        fah_tf.flash_attn_hopper_mask(batch_size=2, q_length=n, kv_length=n,
                                      mask_function=or_masks(causal_mask_function, blockwise_overlay(ids)))
    evaluated = []
    short_ids = torch.zeros(2, 300, dtype=torch.long)
    short_ids[:, 200:] = -1

    def blocks(batch_idx, head_idx, q_idx, kv_idx):
        evaluated.append((int(q_idx.max()), int(kv_idx.max())))
        return blockwise_overlay(short_ids)(batch_idx, head_idx, q_idx, kv_idx)

    for pattern, local_size in ((causal_mask_function, None), (sliding_window_causal_mask_function(64), 64)):
        with pytest.raises(ValueError, match="mask pattern"):
            fah_tf.flash_attn_hopper_mask(batch_size=2, q_length=300, kv_length=300,
                                          mask_function=or_masks(pattern, blocks), local_size=local_size)
    assert not evaluated, f"evaluated at (query, key) indices up to {evaluated} for 300 positions"


@requires_transformers
def test_gemma3_bidirectional_under_torch_compile_says_why_it_is_refused(fah_tf, reference_kernels):
    """The mask function recognises no pattern while torch.compile traces it, so a compiled Gemma 3 with
    use_bidirectional_attention whose first forward is compiled finds no band for its config and takes
    config.sliding_window = 5 as eager's band: refused (its layers pass W = 5, the band |i - j| <= 4), and the message
    claimed "the model's own mask (eager, sdpa) is the band |i - j| <= 5", which is false (it is <= 4), with the advice
    to pass sliding_window=6. Now the message says no mask was recognised, why, and what to do; after one forward
    outside torch.compile the compiled model runs and equals eager."""
    ours, eager = _gemma3_bidirectional(NAME), _gemma3_bidirectional("eager", seed=1)
    eager.load_state_dict(ours.state_dict())
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(5))
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            with pytest.raises(NotImplementedError, match="no bidirectional sliding-window mask was recognised") as info:
                torch.compile(ours, backend="eager")(input_ids=ids)
            assert "torch.compile" in str(info.value) and "is the band |i - j| <= 5" not in str(info.value)
            assert not [call for call in reference_kernels if call[2] != (-1, -1)]
            ours(input_ids=ids)  # one forward outside torch.compile: its masks are recognised
            torch._dynamo.reset()
            got = torch.compile(ours, backend="eager")(input_ids=ids).last_hidden_state
            want = eager(input_ids=ids).last_hidden_state
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# CY (the adversarial review): a padding mask under torch.inference_mode() (pipelines, evaluation) was unpadded, with a
# host read, by every layer of a forward, since an inference tensor has no version counter and is never kept.


def _tiny_llama(attn_implementation, layers=3, seed=0):
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=97, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaModel._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32).eval()


@requires_transformers
def test_padding_mask_unpadded_once_per_forward_under_inference_mode(fah_tf, reference_kernels, monkeypatch):
    """Three layers, a padded batch, inside torch.inference_mode(): one unpadding (the one host read) per forward,
    not one per layer; the outputs equal eager's; and a mask refilled in place between two forwards (the same
    tensor, no version counter in inference mode) is read again, not served from the first forward."""
    counted = []
    unpadding_of = fah_tf._unpadding_of
    monkeypatch.setattr(fah_tf, "_unpadding_of", lambda *a: counted.append(1) or unpadding_of(*a))
    ours, eager = _tiny_llama(NAME), _tiny_llama("eager", seed=1)
    eager.load_state_dict(ours.state_dict())
    ids = torch.randint(3, 97, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        mask = torch.ones(2, 20, dtype=torch.long)
        mask[0, :5] = 0  # left padding
        for step in range(2):
            kept = mask.bool().clone()
            got = ours(input_ids=ids, attention_mask=mask).last_hidden_state
            want = eager(input_ids=ids, attention_mask=mask).last_hidden_state
            torch.testing.assert_close(got[kept], want[kept], rtol=1e-4, atol=1e-5)
            assert len(counted) == step + 1, f"forward {step}: {len(counted)} unpaddings in all, expected {step + 1}"
            mask[0, :5] = 1  # refilled in place: no padding in row 0, more in row 1
            mask[1, :7] = 0
    assert {call[0] for call in reference_kernels} == {"varlen"}


@requires_transformers
def test_per_forward_mask_view_refilled_in_place_outside_inference_mode_is_read_again(fah_tf, reference_kernels):
    """CY's review: the view that the mask function returns is kept per call (also without a version counter, in
    inference mode), but the per-call entry dropped the version check for views that have one: the same view, its
    mask refilled in place outside inference mode (a caller that keeps the mask mapping across forwards), was served
    the first unpadding, as if nothing had changed. The version counter is still checked where there is one."""
    base = torch.ones(2, 12, dtype=torch.bool)
    base[0, :3] = False
    view = fah_tf.flash_attn_hopper_mask(batch_size=2, q_length=12, kv_length=12, attention_mask=base)
    assert view is not None and view is not base
    q, k, v = (torch.randn(2, 2, 12, 32) for _ in range(3))
    module = types.SimpleNamespace(is_causal=True)
    with torch.no_grad():
        fah_tf.flash_attn_hopper_attention_forward(module, q, k, v, view)
        base[0, :3] = True  # refilled in place: row 0 has no padding any more, row 1 some
        base[1, :5] = False
        got = fah_tf.flash_attn_hopper_attention_forward(module, q, k, v, view)[0]
        want = fah_tf.flash_attn_hopper_attention_forward(module, q, k, v, base.clone())[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# CZ: an extension built against another torch. torch.ops.load_library's OSError says only "Could not load this
# library"; the loader's reason (an undefined symbol of libtorch: the most common install fault of compiled attention
# libraries) was dropped from the message, which said "built against another torch?" without the versions to compare.


_UNDEFINED_SYMBOL_LIBRARY = ("void fah_symbol_of_another_torch(void);\n"
                             "void fah_probe(void) { fah_symbol_of_another_torch(); }\n")


def test_extension_of_another_torch_is_named_with_the_loader_reason(tmp_path):
    """A copy of the package whose _C.abi3.so needs a symbol this process lacks (as a build against another torch
    does): importing it leaves EXTENSION_LOADED False, and the error names the undefined symbol, this torch's version
    and the rebuild command."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler on PATH to build the stand-in library")
    package = os.path.dirname(os.path.abspath(flash_attn_hopper.__file__))
    shutil.copytree(package, tmp_path / "fah_other_torch", ignore=shutil.ignore_patterns("__pycache__", "_C*.so"))
    source = tmp_path / "probe.c"
    source.write_text(_UNDEFINED_SYMBOL_LIBRARY)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(tmp_path / "fah_other_torch" / "_C.abi3.so"), str(source)],
                   check=True, capture_output=True)
    script = ("import fah_other_torch, torch\n"
              "assert not fah_other_torch._ops.EXTENSION_LOADED\n"
              "print(fah_other_torch._ops._load_error)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ,
                                PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])),
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    message = r.stdout
    for part in ("undefined symbol: fah_symbol_of_another_torch", f"torch {torch.__version__}",
                 "pip install --no-build-isolation ."):
        assert part in message, (part, message)
