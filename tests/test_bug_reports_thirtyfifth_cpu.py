"""Thirty-fifth round of the bug hunt (tests/bug_report_sources.md, "Thirty-fifth round"), CPU part: the premises of
tests/test_bug_reports_thirtyfifth_gpu.py, without a GPU or the extension.

- GK: every round's views start at their buffer's address and fit in it, and consecutive rounds differ in shape or
  strides (the "strides" sequence: the same pointers and shapes, other strides); the Python layer's checked-call key
  (interface._call_signature) differs between two views at one address with other shapes.
- GL: the supports the GPU file computes (gl_visible, gl_supports) are where the float64 reference's gradients may be
  nonzero: outside them its dQ, dK, dV are exactly 0, inside them not all 0, and a backward that drops the mask
  (pytorch/pytorch#27461's fault) is caught by check_support on every masked case; the varlen cases' loss rows lie in
  the sequences they name.
- GM: the fp16 and bf16 views of one int16 buffer share address, shape and strides, and the checked-call key tells
  them apart (a key without the dtype would let the bf16 call skip the dtype checks of the fp16 one)."""

import pytest
import torch

import test_bug_reports_thirtyfifth_gpu as gpu_file
from flash_attn_hopper import interface
from flash_attn_hopper.testing import attention_ref_grads


@pytest.mark.parametrize("sequence", list(gpu_file.GK_SEQUENCES))
def test_gk_rounds_share_addresses_and_differ_in_layout(sequence):
    rounds = gpu_file.GK_SEQUENCES[sequence]
    cap = gpu_file._gk_capacity(rounds)
    bufs = {"q": torch.zeros(cap["q"]), "kv": torch.zeros(cap["kv"])}
    layouts = []
    for b, sq, sk, h, hk, d, spread, _ in rounds:
        q = gpu_file._view(bufs["q"], (b, sq, h, d))
        k = gpu_file._view(bufs["kv"], (b, sk, hk, d), spread)
        assert q.data_ptr() == bufs["q"].data_ptr() and k.data_ptr() == bufs["kv"].data_ptr()
        assert k.stride(-1) == 1 and (k.stride(-2) * k.element_size()) % 16 == 0
        layouts.append((q.shape, q.stride(), k.shape, k.stride()))
    for a, b in zip(layouts, layouts[1:]):
        assert a != b, "two consecutive rounds with the same layout test nothing new about the address"
    if sequence == "strides":
        assert layouts[0][2] == layouts[1][2] and layouts[0][3] != layouts[1][3]


def test_gk_checked_call_key_differs_for_other_shapes_at_one_address():
    buf = torch.zeros(2 * 300 * 4 * 128, dtype=torch.float16)
    a = gpu_file._view(buf, (2, 300, 4, 128))
    b = gpu_file._view(buf, (3, 100, 8, 64))
    assert a.data_ptr() == b.data_ptr()
    sig = [interface._call_signature(t, t, t, None, False, (-1, -1), 0.0, False) for t in (a, b)]
    assert sig[0] is not None and sig[0] != sig[1]


def test_gm_dtype_views_share_layout_and_have_distinct_keys():
    raw = torch.full((2 * 300 * 4 * 64,), -1, dtype=torch.int16)
    views = [gpu_file._view(raw.view(dt), (2, 300, 4, 64)) for dt in (torch.float16, torch.bfloat16)]
    assert len({(t.data_ptr(), tuple(t.shape), t.stride()) for t in views}) == 1
    assert all(torch.isnan(t).all() for t in views), "the raw buffer's -1 must be NaN in both dtypes"
    sig = [interface._call_signature(t, t, t, None, True, (-1, -1), 0.0, False) for t in views]
    assert sig[0] != sig[1]
    for _, b, sq, sk, h, hk, d, d_v, _ in gpu_file.GM_CASES:  # each GM case's four views, as the GPU test takes them
        for shape in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d_v), (b, sq, h, d_v)):
            raw = torch.full((shape[0] * shape[1] * shape[2] * shape[3],), -1, dtype=torch.int16)
            views = [gpu_file._view(raw.view(dt), shape) for dt in (torch.float16, torch.bfloat16)]
            assert len({(t.data_ptr(), tuple(t.shape), t.stride()) for t in views}) == 1
            assert views[0].stride(-1) == 1 and (views[0].stride(-2) * views[0].element_size()) % 16 == 0


# Small analogues of GL_MASKS (same options, float64 on the CPU): (id, batch, seqlen_q, seqlen_k, nheads, nheads_k,
# head_dim_v, opts)
GL_SMALL = [
    ("causal", 2, 37, 37, 4, 2, 8, dict(causal=True)),
    ("causal-q<k", 2, 21, 50, 4, 1, 8, dict(causal=True)),
    ("window", 2, 40, 40, 6, 2, 8, dict(window_size=(5, 2))),
    ("documents", 2, 30, 30, 4, 2, 8, dict(causal=True, documents=True)),
    ("softcap-causal", 2, 33, 33, 4, 2, 8, dict(causal=True, softcap=2.0)),
    ("window-left", 2, 30, 45, 4, 2, 4, dict(window_size=(6, -1))),
]


def _small_inputs(case, g):
    _, b, sq, sk, h, hk, dv, opts = case
    q = torch.randn(b, sq, h, 8, generator=g, dtype=torch.float64)
    k = torch.randn(b, sk, hk, 8, generator=g, dtype=torch.float64)
    v = torch.randn(b, sk, hk, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(b, sq, h, dv, generator=g, dtype=torch.float64)
    opts = dict(opts)
    if opts.pop("documents", False):
        opts["document_ids"] = torch.tensor([[0] * 10 + [1] * 15 + [2] * 5, [0] * 2 + [1] * 28], dtype=torch.int32)
    return q, k, v, dout, opts


def _unmasked(opts):
    return {key: val for key, val in opts.items() if key not in ("causal", "window_size", "document_ids")}


@pytest.mark.parametrize("pattern", gpu_file.GL_PATTERNS + ["one-head"])
@pytest.mark.parametrize("case", GL_SMALL, ids=[c[0] for c in GL_SMALL])
def test_gl_supports_bound_the_float64_reference_gradients(case, pattern):
    g = torch.Generator().manual_seed(35)
    q, k, v, dout, opts = _small_inputs(case, g)
    b, sq, h, _ = q.shape
    do_rows, lse_rows = (t.expand(b, sq, h) for t in gpu_file.gl_rows(pattern, sq, h))
    dout = dout * do_rows.unsqueeze(-1).double()
    dlse = torch.randn(b, h, sq, generator=g, dtype=torch.float64) * lse_rows.transpose(1, 2).double()
    grads = attention_ref_grads(q, k, v, dout, dlse=dlse, **opts)
    supports = gpu_file.gl_supports(gpu_file.gl_visible(b, sq, k.shape[1], opts), do_rows, lse_rows, k.shape[2])
    assert not supports[0].all()
    gpu_file.check_support(grads, supports, case[0])  # the reference is exactly 0 outside the supports
    for gname, grad, sup in zip(("dq", "dk", "dv"), grads, supports):
        assert (grad[sup] != 0).any(), f"{gname}: no nonzero gradient inside the support"
    # a backward without the mask (the cited fault) gives gradient outside the supports wherever the mask narrows
    # them (not for a loss whose rows together see every key, e.g. the last row under causal)
    all_visible = torch.ones(b, sq, k.shape[1], dtype=torch.bool)
    narrowed = any(not torch.equal(a, c) for a, c in
                   zip(gpu_file.gl_supports(all_visible, do_rows, lse_rows, k.shape[2]), supports))
    if pattern in ("middle-row", "span"):
        assert narrowed, "the mask must hide keys from the loss rows"
    leaky = attention_ref_grads(q, k, v, dout, dlse=dlse, **_unmasked(opts))
    if narrowed:
        with pytest.raises(AssertionError, match="is not 0 where the loss does not reach"):
            gpu_file.check_support(leaky, supports, case[0])
    else:
        gpu_file.check_support(leaky, supports, case[0])


def test_gl_varlen_loss_rows_lie_in_the_sequences_named():
    lq, lk = gpu_file.GL_VARLEN_LQ, gpu_file.GL_VARLEN_LK
    starts = [sum(lq[:i]) for i in range(len(lq) + 1)]

    def seq_of(row):
        return max(i for i in range(len(lq)) if starts[i] <= row < starts[i + 1])

    named = {"causal-last-row-of-one": ({2}, set()), "window-span": ({2}, set()), "causal-lse": ({0}, {5})}
    for name, _, do_idx, lse_idx in gpu_file.GL_VARLEN:
        assert {seq_of(r) for r in do_idx} == named[name][0]
        assert {seq_of(r) for r in lse_idx} == named[name][1]
    assert max(i for _, _, d, e in gpu_file.GL_VARLEN for i in d + e) < sum(lq)
    # the last row of sequence 2 is its last query: under causal it sees every key of its sequence
    assert gpu_file.GL_VARLEN[0][2] == [starts[3] - 1]
    visible = torch.block_diag(*[torch.ones(a, b) for a, b in zip(lq, lk)])
    assert visible.shape == (sum(lq), sum(lk))
