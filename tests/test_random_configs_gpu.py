"""Seeded random configurations across the feature space, forward and backward, each checked by DESIGN.md §3's rule.

The hand-written GPU tests cross features a few at a time; bug reports against attention kernels keep coming from
combinations nobody wrote down (a window with GQA and a softcap in a varlen batch with an empty sequence, at a head
dim between the kernel sizes). Each case draws, from its own seed (the test id names it, so a failure reruns alone):
dtype; head_dim and head_dim_v (multiples of 8 up to 256, equal or not); MHA / GQA / MQA; a dense batch or a varlen
batch with empty and one-token sequences and max_seqlen above the true maximum; lengths on and off the tile grid;
documents packed into the rows of a dense batch (one-token documents, ids that repeat non-adjacently); causal, a
sliding window (sides from 0 to wider than the sequences, -1 for unbounded) or neither; a softcap (with
inputs scaled up so it bites); a softmax_scale; a loss that also uses the LSE; the deterministic backward; q, k, v
contiguous, transposed views, or slices of one fused projection (NaN in the columns between them). Out, LSE,
dQ, dK and dV are checked by the rule against the float32 reference, with memory poisoned with NaN before each pass
(gpu_helpers.run_attention; the varlen run likewise), and rows that see no key must be exactly 0 (varlen).

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per case when the build lacks
the head dims / dtype drawn."""

import random

import pytest
import torch

import flash_attn_hopper
from gpu_helpers import (DTYPES, check_attention, check_attention_varlen, cu_seqlens, poison_allocator, randn,
                         require_built, run_attention)

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"  # (a CPU dry run of the cases sets it to "cpu", with CPU stand-ins of the ops)

N_CASES = 64
HEAD_DIMS = [8, 16, 24, 40, 56, 64, 72, 80, 96, 104, 120, 128, 136, 160, 192, 200, 224, 248, 256]
LENGTHS = [1, 2, 17, 63, 64, 65, 127, 128, 129, 191, 200, 255, 257, 300, 383, 513, 700]


def _document_runs(rng, seqlen):
    """Document ids of one row: runs of random lengths (one-token runs included), ids that repeat non-adjacently
    (distinct documents all the same) and an int dtype's values."""
    ids, doc = [], 0
    while len(ids) < seqlen:
        ids += [doc] * min(seqlen - len(ids), rng.choice([1, 5, 64, 100, 129, 300]))
        doc = (doc + 1) % 3
    return ids


def draw(seed):
    """One configuration (a dict) from its seed; the same seed always gives the same case."""
    rng = random.Random(seed)
    c = {"dtype": rng.choice(DTYPES)}
    c["head_dim"] = rng.choice(HEAD_DIMS)
    c["head_dim_v"] = c["head_dim"] if rng.random() < 0.7 else rng.choice(HEAD_DIMS)
    c["nheads_k"] = rng.choice([1, 2, 3])
    c["nheads"] = c["nheads_k"] * rng.choice([1, 1, 2, 3, 4])
    c["varlen"] = rng.random() < 0.35
    if c["varlen"]:
        n = rng.randint(1, 6)
        c["lengths_q"] = [rng.choice([0] + LENGTHS) for _ in range(n)]
        c["lengths_k"] = [rng.choice([0] + LENGTHS) for _ in range(n)]
        c["extra_max"] = rng.choice([0, 0, 1, 100])  # max_seqlen larger than the true maximum is allowed
    else:
        c["batch"] = rng.randint(1, 3)
        c["seqlen_q"], c["seqlen_k"] = rng.choice(LENGTHS), rng.choice(LENGTHS)
        if rng.random() < 0.2:  # documents packed into each row (self-attention: one length)
            c["seqlen_k"] = c["seqlen_q"]
            c["documents"] = [_document_runs(rng, c["seqlen_q"]) for _ in range(c["batch"])]
    opts = {}
    mask = rng.random()
    if mask < 0.35:
        opts["causal"] = True
    elif mask < 0.65:
        opts["window_size"] = (rng.choice([-1, 0, 1, 17, 64, 128, 300, 5000]), rng.choice([-1, 0, 3, 40, 129, 5000]))
    if rng.random() < 0.25:
        opts["softcap"] = rng.choice([5.0, 15.0, 30.0])
        c["input_scale"] = 2.0
    if rng.random() < 0.2:
        opts["softmax_scale"] = rng.choice([0.05, 0.1, 0.3])
    c["opts"] = opts
    c["dlse"] = rng.random() < 0.3
    c["deterministic"] = rng.random() < 0.2
    # q, k, v as the caller's views: heads-major storage transposed, or slices of one fused projection (which needs
    # q's tokens to be k's: self-attention)
    c["layout"] = rng.choice(["contiguous", "contiguous", "transposed", "fused"])
    if c["layout"] == "fused":
        if c["varlen"]:
            c["lengths_k"] = list(c["lengths_q"])
        else:
            c["seqlen_k"] = c["seqlen_q"]
    return c


def _layout(tensors, layout, head_axis):
    """q, k, v (contiguous) as views of the drawn layout with the same values: "transposed" keeps each in storage with
    the heads before the tokens; "fused" puts them in one tensor along the heads (d padded to the widest with NaN,
    never to be read) and slices them out: all three where q has k's tokens, else k and v (q stays as it is)."""
    if layout == "transposed":
        return [t.transpose(head_axis - 1, head_axis).contiguous().transpose(head_axis - 1, head_axis) for t in tensors]
    if layout == "fused" and tensors[0].shape[:head_axis] != tensors[1].shape[:head_axis]:
        return [tensors[0], *_layout(tensors[1:], layout, head_axis)]
    if layout == "fused":
        width = max(t.shape[-1] for t in tensors)
        padded = [torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=float("nan")) for t in tensors]
        fused = torch.cat(padded, dim=head_axis)
        out, start = [], 0
        for t in tensors:
            part = fused.narrow(head_axis, start, t.shape[head_axis])[..., : t.shape[-1]]
            assert torch.equal(part, t)
            out.append(part)
            start += t.shape[head_axis]
        return out
    return list(tensors)


def _describe(c):
    shape = (f"varlen q{c['lengths_q']} k{c['lengths_k']}+{c['extra_max']}" if c["varlen"]
             else f"b{c['batch']} {c['seqlen_q']}x{c['seqlen_k']}")
    if "documents" in c:
        shape += f" documents {[len(set(_runs(r))) for r in c['documents']]}"
    return (f"{str(c['dtype']).split('.')[-1]} d{c['head_dim']}/{c['head_dim_v']} h{c['nheads']}/{c['nheads_k']} "
            f"{shape} {c['opts']} dlse={c['dlse']} det={c['deterministic']} {c['layout']}")


def _runs(row):
    """The run index of each position of a row of document ids."""
    out, run = [], 0
    for i, x in enumerate(row):
        run += i > 0 and x != row[i - 1]
        out.append(run)
    return out


@pytest.mark.parametrize("seed", range(N_CASES))
def test_random_configuration(seed):
    """One drawn configuration (see the module docstring) forward and backward, by the rule."""
    c = draw(seed)
    name = f"seed {seed}: {_describe(c)}"
    require_built(max(c["head_dim"], c["head_dim_v"]), c["dtype"])  # the kernels of the larger run both
    torch.manual_seed(seed)
    dtype, d, dv, h, hk, opts = c["dtype"], c["head_dim"], c["head_dim_v"], c["nheads"], c["nheads_k"], c["opts"]
    scale = c.get("input_scale", 1.0)
    if c["varlen"]:
        lq, lk = c["lengths_q"], c["lengths_k"]
        q = (randn(sum(lq), h, d, dtype=dtype) * scale).to(dtype)
        k = (randn(sum(lk), hk, d, dtype=dtype) * scale).to(dtype)
        v = randn(sum(lk), hk, dv, dtype=dtype)
        dout = randn(sum(lq), h, dv, dtype=dtype)
        dlse = torch.randn(h, sum(lq), device=DEVICE) if c["dlse"] else None
        cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
        q, k, v = _layout((q, k, v), c["layout"], head_axis=1)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        e = q.element_size()
        poison_allocator(q.numel() * e, k.numel() * e, v.numel() * e, sum(lq) * h * 4)
        out, lse = flash_attn_hopper.attention_varlen(
            *leaves, cu_q, cu_k, max(lq) + c["extra_max"], max(lk) + c["extra_max"], return_lse=True,
            deterministic=c["deterministic"], **opts)
        poison_allocator(q.numel() * e, k.numel() * e, v.numel() * e)
        outputs, grads_out = ([out, lse], [dout, dlse]) if dlse is not None else ([out], [dout])
        grads = torch.autograd.grad(outputs, leaves, grads_out, retain_graph=c["deterministic"])
        if c["deterministic"]:
            _assert_repeats(grads, torch.autograd.grad(outputs, leaves, grads_out), name)
        check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, dout, cu_q, cu_k, name, dlse=dlse, **opts)
    else:
        b, sq, sk = c["batch"], c["seqlen_q"], c["seqlen_k"]
        q = (randn(b, sq, h, d, dtype=dtype) * scale).to(dtype)
        k = (randn(b, sk, hk, d, dtype=dtype) * scale).to(dtype)
        v = randn(b, sk, hk, dv, dtype=dtype)
        dout = randn(b, sq, h, dv, dtype=dtype)
        dlse = torch.randn(b, h, sq, device=DEVICE) if c["dlse"] else None
        q, k, v = _layout((q, k, v), c["layout"], head_axis=2)
        if "documents" in c:
            opts = dict(opts, document_ids=torch.tensor(c["documents"], dtype=torch.int32, device=DEVICE))
        out, lse, grads = run_attention(q, k, v, dout, dlse=dlse, deterministic=c["deterministic"], **opts)
        if c["deterministic"]:
            _assert_repeats(grads, run_attention(q, k, v, dout, dlse=dlse, deterministic=True, **opts)[2], name)
        check_attention(out, lse, grads, q, k, v, dout, name, dlse=dlse, **opts)


def _assert_repeats(grads, again, name):
    """The deterministic backward: a second pass gives bitwise the same dQ, dK, dV."""
    for gname, a, b in zip(("dq", "dk", "dv"), grads, again):
        assert torch.equal(a, b), f"{name}: {gname} differs between two deterministic backward passes"
