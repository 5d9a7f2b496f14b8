"""Thirty-sixth round of the bug hunt (tests/bug_report_sources.md, "Thirty-sixth round"), GPU part.

GN: the persistent forward's grid at the wave boundaries. A persistent forward launches min(tiles, SMs) CTAs
(csrc/flash/fwd/launch_fwd_sm90.hpp) that take tiles from an atomic counter; a loop bound, a prefetch of the next tile
(head_dim 64's QKᵀ issued ahead) or a decode of the tile index that is off by one shows only when the tile count sits
at a multiple of the CTA count or one step beside it: tile-ai/tilelang-ascend#1616 (a persistent kernel with fewer
tiles than workers: the idle workers had to be guarded, "partial single waves", 87 % of the output wrong),
tile-ai/tilelang#2433 (a persistent loop's tile decode dropped a band of output tiles whenever a count was not a
multiple of its group), tile-ai/tilelang#2674 (a persistent loop right only when its trip count lined up with the
pipeline's phase period). Earlier rounds ran persistent grids at 320-768 tiles (FP, FQ, DA) and sections with a
partial last section (test_sections_gpu.py), never at k x SMs exactly or one step beside it. Here the batch is
chosen at run time from the GPU's SM count so that the tiles are waves x SMs - step, waves x SMs and waves x SMs +
step (step: the tiles of one batch element), one and two waves, five configurations on the forward kernels that run
persistent (head_dim 64, 96 and 128: config.hpp's FwdTileConfig<192> and <256> launch one CTA per tile; causal, window,
softcap, MQA, head_dim_v 64 beside 128, deterministic): out, LSE, dQ, dK, dV by the rule from
NaN-poisoned memory (a tile no CTA runs stays NaN), and the first and last batch elements' out and LSE bitwise the
same element called alone (docs/conventions.md: a row's bits do not depend on the other rows of the call).

GO: a loss on the LSE with only some of q, k, v requiring grad. dS gains P ∘ dLSE (docs/conventions.md); a backward
that drops the LSE's gradient is silently wrong (cudnn-frontend#554's review: the gradient of the stats output
ignored, "dq, dk and dv are then incomplete with no error"; ByteDance-Seed/VeOmni#1021's review: an LSE output whose
gradient the backward discarded, "silently wrong gradients"), and a backward that picks its work from which inputs
require grad (pytorch/pytorch#56500) can take a path that leaves that term out. Classes 21 and DL put losses on the
LSE with every input requiring grad; 26 and AX took subsets with a loss on out only. Here each subset (q, k, v, qk,
kv) with a loss on the LSE alone and on out and LSE, and autograd.grad asked for k alone: the inputs that require
grad get gradients by the rule against the float32 reference with that dLSE, the others none, and with the LSE alone
dV is exactly 0.

GP: the dense batch at exactly its largest accepted value, 65535. Kernels that put the batch on a grid dimension
capped at 65535 fail or skip work past it (flashinfer-ai/flashinfer#3125: batch on gridDim.z, the launch failed with
no Python exception and the results were wrong; pytorch/pytorch#177985 and #176096; SandAI-org/MagiAttention#40),
and a launch that derives a dimension from the batch (batch + 1, a rounded-up count, batch x K/V heads for GQA group
CTAs, the deterministic backward's counters) passes the cap only at the boundary. Class 16 ran batch 28800 and
nheads 65535, class X 65535 varlen sequences; here batch 65535 dense: MQA causal with rows that see no key, GQA with a
window and the deterministic backward, head_dim 256 with softcap; forward and backward by the rule from NaN-poisoned
memory, the last batch element's out and LSE bitwise the element called alone. The backward's dQ accumulator holds
128 rows per (batch, head) at the kernel's width in float32 (16 GiB for the GQA case, ~20 GiB at its peak), so each
case first asks for that much free memory (skipped with the reason otherwise) and gives its memory back, also when it
fails.

Inputs are Gaussian from the per-test seed (tests/conftest.py). Skipped, with the reason, without an sm90 GPU and the
built extension (conftest.py), and per test when the build lacks a head_dim / dtype.
tests/test_bug_reports_thirtysixth_cpu.py checks the premises: GN's batches put the tiles where the names say for
132 and 114 SMs, at either head_dim 64 tile height, on persistent launches; GO's dLSE term moves dQ and dK far past
the rule (a backward without it fails) and leaves dV; GP's batch passes the Python layer's limit checks while 65536
is refused by name."""

import os
import traceback

import pytest
import torch

import flash_attn_hopper
import gpu_helpers
from flash_attn_hopper.interface import kernel_head_dim
from gpu_helpers import (BWD_SEQLEN_Q_ROUNDING, assert_same_bits, check_attention, check_grads_where_required,
                         require_built, run_attention)

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
WHY_ALONE = " (a batch element differs from the same element called alone)"


def num_sms():
    return torch.cuda.get_device_properties(DEVICE).multi_processor_count


def _same_as_alone(out, lse, q, k, v, b, name, **opts):
    """Batch element b's out and LSE bitwise the forward of that element alone (batch 1)."""
    out_b, lse_b = flash_attn_hopper.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], return_lse=True, **opts)
    assert_same_bits(out[b:b + 1], out_b, f"{name} batch element {b} out", WHY_ALONE)
    assert_same_bits(lse[b:b + 1], lse_b, f"{name} batch element {b} lse", WHY_ALONE)


# ------------------------------------------------------------ GN: persistent grids at the wave boundaries

GN_HEIGHTS = (128, 192)  # the forward's tile heights (192 only at head_dim 64: flash/fwd/tile_choice.hpp)
GN_MAX_KEY_BLOCKS = 32  # csrc/flash/config.hpp kFwdPersistentMaxKeyBlocks: persistent up to this many key blocks
GN_MIN_BLOCK_N = 64  # the narrowest key block of the forward (head_dim 200-256)
GN_PERSISTENT_KERNELS = (64, 96, 128)  # forward kernels with kPersistent (config.hpp; 192 and 256: one CTA per tile)

# (id, head_dim, head_dim_v, dtype, seqlen_q, seqlen_k, nheads, nheads_k, opts)
GN_CASES = [
    ("d64-causal", 64, 64, "fp16", 100, 300, 1, 1, dict(causal=True)),
    ("d96-window-mqa", 96, 96, "bf16", 100, 250, 2, 1, dict(window_size=(64, 0))),
    ("d128-full-two-blocks", 128, 128, "fp16", 200, 129, 1, 1, {}),
    ("d128v64-causal-det", 128, 64, "bf16", 90, 200, 1, 1, dict(causal=True, deterministic=True)),
    ("d64-softcap-causal", 64, 64, "bf16", 77, 77, 3, 3, dict(causal=True, softcap=20.0)),
]
GN_WAVES = [1, 2]
GN_OFFSETS = {"one-step-short": -1, "exact": 0, "one-step-over": 1}


def gn_m_blocks(seqlen_q):
    """Query blocks per (batch, head): the same at every tile height for the cases' lengths (asserted), so the tile
    count does not depend on which height the launcher picks."""
    counts = {-(-seqlen_q // h) for h in GN_HEIGHTS}
    if len(counts) != 1:
        raise AssertionError(f"premise: seqlen_q {seqlen_q} gives {counts} query blocks at heights {GN_HEIGHTS}")
    return counts.pop()


def gn_batch(sms, step, waves, offset):
    """The batch whose tiles (batch x step) are waves x sms + offset x step."""
    if sms % step:
        raise ValueError(f"{sms} SMs are not a multiple of {step} tiles per batch element")
    tiles = waves * sms + offset * step
    return tiles // step


def gn_persistent(head_dim, seqlen_k):
    """The launcher's persistence rule with the default knobs (launch_fwd_sm90.hpp): a kernel built persistent, and
    each tile sees at most GN_MAX_KEY_BLOCKS key blocks; a tile sees at most seqlen_k keys."""
    return kernel_head_dim(head_dim) in GN_PERSISTENT_KERNELS and -(-seqlen_k // GN_MIN_BLOCK_N) <= GN_MAX_KEY_BLOCKS


@pytest.mark.parametrize("offset", list(GN_OFFSETS))
@pytest.mark.parametrize("waves", GN_WAVES)
@pytest.mark.parametrize("case", GN_CASES, ids=[c[0] for c in GN_CASES])
def test_persistent_grid_at_multiples_of_its_cta_count(case, waves, offset):
    """Tiles at waves x SMs, one batch element's tiles short of it, or over it: by the rule from NaN-poisoned memory,
    the first and last batch elements bitwise each called alone."""
    name, head_dim, head_dim_v, dtype, seqlen_q, seqlen_k, nheads, nheads_k, opts = case
    dtype = DTYPES[dtype]
    require_built(max(head_dim, head_dim_v), dtype)
    for knob in ("FAH_FWD_PERSISTENT", "FAH_FWD_PERSISTENT_MAX_KEY_BLOCKS", "FAH_FWD_BLOCK_M"):
        if knob in os.environ:
            pytest.skip(f"{knob} is set: these cases assume the default persistent launch")
    if not gn_persistent(max(head_dim, head_dim_v), seqlen_k):
        raise AssertionError(f"premise: {name} is not a persistent launch")
    sms = num_sms()
    step = nheads * gn_m_blocks(seqlen_q)
    if sms % step:
        pytest.skip(f"{sms} SMs are not a multiple of {step} tiles per batch element")
    batch = gn_batch(sms, step, waves, GN_OFFSETS[offset])
    tiles = batch * step
    if tiles != waves * sms + GN_OFFSETS[offset] * step:
        raise AssertionError(f"premise: {tiles} tiles on {sms} SMs")
    q, k, v, dout = gpu_helpers.attention_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype,
                                                 head_dim_v=head_dim_v)
    label = f"{name} {tiles} tiles on {sms} SMs"
    out, lse, grads = run_attention(q, k, v, dout, **opts)
    check_attention(out, lse, grads, q, k, v, dout, label, **opts)
    for b in (0, batch - 1):
        _same_as_alone(out, lse, q, k, v, b, label, **opts)


# ------------------------------------------------------------------ GO: a loss on the LSE, some inputs with grad

GO_WHICH = ["q", "k", "v", "qk", "kv"]
GO_LOSSES = {"lse": "fp16", "out-and-lse": "bf16"}  # loss -> dtype
GO_SHAPE = (2, 141, 203, 6, 2, 128)  # batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim (GQA 3 per K/V head)


def _go_inputs(dtype):
    b, sq, sk, h, hk, d = GO_SHAPE
    require_built(d, dtype)
    q, k, v, dout = gpu_helpers.attention_inputs(b, sq, sk, h, hk, d, dtype)
    dlse = torch.randn(b, h, sq, device=DEVICE)
    return q, k, v, dout, dlse


def _go_refs(q, k, v, dout, dlse, loss):
    from flash_attn_hopper.testing import attention_ref_grads

    dout_ref = dout if loss == "out-and-lse" else torch.zeros_like(dout)
    ref = attention_ref_grads(q, k, v, dout_ref, dlse=dlse, causal=True)
    naive = attention_ref_grads(q, k, v, dout_ref, dlse=dlse, causal=True, upcast=False)
    return ref, naive


@pytest.mark.parametrize("which", GO_WHICH)
@pytest.mark.parametrize("loss", list(GO_LOSSES))
def test_lse_loss_with_some_inputs_requiring_grad(loss, which):
    """Causal GQA 6/2, 141 x 203: a loss on the LSE (and on out), only `which` requiring grad: those get gradients by
    the rule against the reference with that dLSE, the others none; with the LSE alone dV is 0."""
    dtype = DTYPES[GO_LOSSES[loss]]
    q, k, v, dout, dlse = _go_inputs(dtype)
    leaves = {n: t.detach().requires_grad_(n in which) for n, t in zip("qkv", (q, k, v))}
    out, lse = flash_attn_hopper.attention(leaves["q"], leaves["k"], leaves["v"], causal=True, return_lse=True)
    # The LSE does not depend on v: with v alone requiring grad it may come out without a graph (this library's C++
    # node gives it one, with dV = 0); never when q or k requires grad.
    if not lse.requires_grad and ("q" in which or "k" in which):
        raise AssertionError(f"{which}: the LSE does not require grad")
    outputs = [(out, dout)] if loss == "out-and-lse" else []
    if lse.requires_grad:
        outputs.append((lse, dlse))
    gpu_helpers.poison_attention_memory(q, v)
    if outputs:
        torch.autograd.backward([o for o, _ in outputs], [g for _, g in outputs])
    ref, naive = _go_refs(q, k, v, dout, dlse, loss)
    check_grads_where_required(leaves, which, ref, naive, dtype, f"{loss} {which}",
                               may_be_zero="v" if loss == "lse" else "")


def test_lse_loss_gradient_asked_for_k_alone():
    """Every input requires grad; autograd.grad of a loss on out and LSE asked for k alone: dK by the rule with the
    dLSE term (and equal to k's gradient of a full backward, by the rule)."""
    from flash_attn_hopper.testing import assert_close_by_rule

    dtype = DTYPES["bf16"]
    q, k, v, dout, dlse = _go_inputs(dtype)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, lse = flash_attn_hopper.attention(*leaves, causal=True, return_lse=True)
    gpu_helpers.poison_attention_memory(q, v)
    (dk,) = torch.autograd.grad([out, lse], [leaves[1]], [dout, dlse])
    ref, naive = _go_refs(q, k, v, dout, dlse, "out-and-lse")
    if not (dk.shape == k.shape and dk.dtype == dtype):
        raise AssertionError("dk of another shape or dtype")
    assert_close_by_rule(dk, ref[1], naive[1], "dk asked alone")


# ------------------------------------------------------------------ GP: the dense batch at its largest value

GP_BATCH = 65535  # the largest batch attention accepts (docs/conventions.md, Errors)

# (id, head_dim, dtype, seqlen_q, seqlen_k, nheads, nheads_k, opts)
GP_CASES = [
    ("mqa-causal-rows-without-keys", 64, "fp16", 5, 3, 2, 1, dict(causal=True)),
    ("gqa-window-deterministic", 128, "bf16", 7, 9, 4, 2, dict(window_size=(2, 1), deterministic=True)),
    ("mha-softcap-d256", 256, "fp16", 3, 4, 1, 1, dict(softcap=10.0)),
]


def gp_workspace_bytes(head_dim, nheads):
    """The backward's float32 dQ accumulator at batch 65535 (csrc/api/flash_api.cpp launch_bwd): per (batch, head)
    seqlen_q rounded up to BWD_SEQLEN_Q_ROUNDING rows (128 for these lengths) of the kernel's width; one lane (dq_lanes
    2 only at head_dim 256 deterministic)."""
    return GP_BATCH * nheads * BWD_SEQLEN_Q_ROUNDING * kernel_head_dim(head_dim, backward=True) * 4


def _require_free_memory(nbytes):
    torch.cuda.empty_cache()  # blocks cached by earlier tests do not count as free
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes:
        pytest.skip(f"needs {nbytes / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")


def _dense_batch_at_its_largest_accepted_value(case):
    name, head_dim, dtype, seqlen_q, seqlen_k, nheads, nheads_k, opts = case
    dtype = DTYPES[dtype]
    require_built(head_dim, dtype)
    # Peak: the workspace, inputs, outputs and gradients (~3 GiB for the GQA case), then the float32 references (~15
    # GiB for it, measured on an H100, mostly inside the freed workspace).
    _require_free_memory(int(1.25 * gp_workspace_bytes(head_dim, nheads)) + 4 * 2**30)
    q, k, v, dout = gpu_helpers.attention_inputs(GP_BATCH, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype)
    out, lse, grads = run_attention(q, k, v, dout, **opts)
    label = f"batch {GP_BATCH} {name}"
    check_attention(out, lse, grads, q, k, v, dout, label, **opts)
    _same_as_alone(out, lse, q, k, v, GP_BATCH - 1, label, **opts)


@pytest.mark.parametrize("case", GP_CASES, ids=[c[0] for c in GP_CASES])
def test_dense_batch_at_its_largest_accepted_value(case):
    """Batch 65535: out, LSE, dQ, dK, dV by the rule from NaN-poisoned memory, the last batch element's out and LSE
    bitwise the element called alone. Its memory is given back also when it fails (pytest keeps a failed test's
    frames, and with them its tensors, for the rest of the session)."""
    try:
        _dense_batch_at_its_largest_accepted_value(case)
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        torch.cuda.empty_cache()
