"""Forward pass on an sm90 GPU against the float32 reference, by the rule of DESIGN.md §3:
max|out - ref| <= 2 * max|naive - ref| + floor, where ``naive`` is the same reference run in the input dtype.

Every call goes through ``_call``, which first leaves NaN-filled blocks of the output's sizes in the CUDA caching
allocator (``_poison_allocator``), so an output element the kernel never writes shows up as NaN.
Skipped, with the reason, without an sm90 GPU and the built extension (see conftest.py)."""

import math

import pytest
import torch

from flash_attn_hopper import attention
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref
from gpu_helpers import built_dtype as _built_dtype
from gpu_helpers import poison_allocator as _poison_allocator
from gpu_helpers import randn as _randn
from gpu_helpers import require_built as _require_built

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
HEAD_DIMS = [64, 128, 256]
SEQLENS = [(1, 1), (1, 239), (239, 1), (113, 203), (203, 113), (128, 128), (1023, 1024), (4224, 4224)]


def _qkv(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype):
    return (
        _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype),
        _randn(batch, seqlen_k, nheads, head_dim, dtype=dtype),
        _randn(batch, seqlen_k, nheads, head_dim, dtype=dtype),
    )


def _call(q, k, v, **kwargs):
    """attention(..., return_lse=True) with the output and LSE memory poisoned with NaN beforehand."""
    batch, seqlen_q, nheads, head_dim = q.shape
    _poison_allocator(batch * seqlen_q * nheads * head_dim * q.element_size(), batch * nheads * seqlen_q * 4)
    return attention(q, k, v, return_lse=True, **kwargs)


def _check(out, lse, q, k, v, causal=False, softmax_scale=None, name=""):
    """Shapes/dtypes, then O and LSE by the rule against the float32 reference; rows that see no key exactly 0."""
    batch, seqlen_q, nheads, head_dim = q.shape
    assert out.shape == (batch, seqlen_q, nheads, head_dim) and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32 and lse.device == q.device
    ref, ref_lse = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, upcast=True)
    naive, naive_lse = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, upcast=False)
    # The rule is only meaningful with a finite naive error.
    assert torch.isfinite(naive).all() and torch.equal(torch.isinf(naive_lse), torch.isinf(ref_lse))
    assert_close_by_rule(out, ref, naive, f"{name} out")
    assert_close_by_rule(lse, ref_lse, naive_lse, f"{name} lse")
    empty = torch.isneginf(ref_lse)  # (batch, nheads, seqlen_q): rows that see no key
    if empty.any():
        rows = out.permute(0, 2, 1, 3)[empty]
        assert torch.equal(rows, torch.zeros_like(rows)), f"{name}: rows that see no key are not exactly 0"


# ------------------------------------------------------------------------------------------------- main grid


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fwd_matches_reference(dtype, head_dim, causal, seqlen_q, seqlen_k):
    _require_built(head_dim, dtype)
    batch, nheads = (1, 2) if max(seqlen_q, seqlen_k) >= 4096 else (2, 3)
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype)
    out, lse = _call(q, k, v, causal=causal)
    _check(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_epilogue_many_tiles_per_cta(head_dim, causal):
    """The epilogue stores O through shared memory with TMA (csrc/flash/fwd/kernel_fwd_sm90.hpp, fwd_store_o_smem).
    Many more tiles than SMs, so each persistent CTA reuses its O buffer tile after tile (a missing wait for the last
    TMA store's reads would corrupt rows), and seqlen_q 333 is not a multiple of 64, so the last store of every
    (batch, head) is clipped at seqlen_q and must not write into the next batch element's rows."""
    dtype = _built_dtype(head_dim)
    q, k, v = _qkv(24, 333, 200, 6, head_dim, dtype)
    out, lse = _call(q, k, v, causal=causal)
    _check(out, lse, q, k, v, causal=causal, name=f"hdim{head_dim}")


# ------------------------------------------------------------------------------------------------ layouts


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_packed_qkv(dtype, head_dim, causal):
    """q, k, v sliced out of one (batch, seqlen, 3, nheads, head_dim) tensor: non-contiguous views."""
    _require_built(head_dim, dtype)
    batch, seqlen, nheads = 2, 203, 3
    qkv = _randn(batch, seqlen, 3, nheads, head_dim, dtype=dtype)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous() and q.stride() == (seqlen * 3 * nheads * head_dim, 3 * nheads * head_dim, head_dim, 1)
    before = qkv.clone()
    out, lse = _call(q, k, v, causal=causal)
    assert torch.equal(qkv, before)
    _check(out, lse, q, k, v, causal=causal, name="packed")


def test_packed_qkv_is_read_in_place():
    """Packed q/k/v have TMA-legal strides, so no copy is made: peak memory during the call stays below the
    output and LSE plus half of one input, while a copy of any of q, k, v would add a whole input."""
    head_dim = 128
    dtype = _built_dtype(head_dim)
    batch, seqlen, nheads = 1, 4096, 4
    qkv = _randn(batch, seqlen, 3, nheads, head_dim, dtype=dtype)
    q, k, v = qkv.unbind(2)
    one_input = q.numel() * q.element_size()  # 4 MiB
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = attention(q, k, v, return_lse=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    out_lse = out.numel() * out.element_size() + lse.numel() * lse.element_size()
    assert peak < out_lse + one_input // 2, f"peak {peak} bytes for an output of {out_lse}: were q/k/v copied?"
    _check(out, lse, q, k, v, name="packed in place")


def _unaligned(layout, batch, seqlen, nheads, head_dim, dtype):
    """A (batch, seqlen, nheads, head_dim) view whose base or strides are not what TMA reads in place."""
    esize = torch.tensor([], dtype=dtype).element_size()
    if layout == "offset_view":  # base 2 bytes past a 16-byte boundary, non-contiguous
        wide = _randn(batch, seqlen, nheads, head_dim + 8, dtype=dtype)
        t = wide[..., 1 : 1 + head_dim]
        assert t.data_ptr() % 16 != 0 and not t.is_contiguous()
    elif layout == "offset_contiguous":  # base 2 bytes past a 16-byte boundary, contiguous
        flat = _randn(batch * seqlen * nheads * head_dim + 1, dtype=dtype)
        t = flat[1:].view(batch, seqlen, nheads, head_dim)
        assert t.data_ptr() % 16 != 0 and t.is_contiguous()
    elif layout == "odd_head_stride":  # aligned base, head/row/batch strides not multiples of 16 bytes
        wide = _randn(batch, seqlen, nheads, head_dim + 1, dtype=dtype)
        t = wide[..., :head_dim]
        assert t.data_ptr() % 16 == 0 and (t.stride(2) * esize) % 16 != 0
    elif layout == "size1_odd_stride":  # batch 1 and seqlen 1 dims carry strides of 3 elements (never used)
        assert batch == 1 and seqlen == 1
        flat = _randn(nheads * head_dim, dtype=dtype)
        t = flat.as_strided((1, 1, nheads, head_dim), (3, 3, head_dim, 1))
    else:
        raise AssertionError(layout)
    assert t.shape == (batch, seqlen, nheads, head_dim) and t.stride(-1) == 1
    return t


@pytest.mark.parametrize("layout", ["offset_view", "offset_contiguous", "odd_head_stride", "size1_odd_stride"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_unaligned_views(layout, head_dim):
    dtype = _built_dtype(head_dim)
    if layout == "size1_odd_stride":
        batch, seqlen_q, seqlen_k, nheads = 1, 1, 1, 3
    else:
        batch, seqlen_q, seqlen_k, nheads = 2, 203, 113, 3
    q = _unaligned(layout, batch, seqlen_q, nheads, head_dim, dtype)
    k = _unaligned(layout, batch, seqlen_k, nheads, head_dim, dtype)
    v = _unaligned(layout, batch, seqlen_k, nheads, head_dim, dtype)
    before = [t.clone() for t in (q, k, v)]
    for causal in (False, True):
        out, lse = _call(q, k, v, causal=causal)
        _check(out, lse, q, k, v, causal=causal, name=f"{layout} causal={causal}")
    for t, b in zip((q, k, v), before):
        assert torch.equal(t, b)


# ----------------------------------------------------------------------------------------- masks and extremes


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_causal_more_queries_than_keys(dtype):
    """seqlen_q 2048 > seqlen_k 1024, bottom-right causal: query rows 0..1023 see no key."""
    head_dim = 128
    _require_built(head_dim, dtype)
    batch, nheads, seqlen_q, seqlen_k = 2, 3, 2048, 1024
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype)
    out, lse = _call(q, k, v, causal=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    blind = out[:, :1024]
    assert torch.equal(blind, torch.zeros_like(blind)), "rows that see no key must be exactly 0"
    assert torch.isneginf(lse[:, :, :1024]).all(), "rows that see no key must have LSE -inf"
    assert torch.isfinite(out[:, 1024:]).all() and torch.isfinite(lse[:, :, 1024:]).all()
    _check(out, lse, q, k, v, causal=True, name="causal 2048x1024")
    # Row 1024 sees exactly one key (key 0), so its output is that key's value row (the naive answer is exact).
    assert_close_by_rule(out[:, 1024], v[:, 0].float(), v[:, 0], "row 1024")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_large_negative_logits(dtype, head_dim):
    """Every logit about -120 (q all ones, k all -120/sqrt(head_dim)): exp(-120) underflows float32 unless the
    row max is subtracted, so a kernel that starts its running max at 0 gives LSE -inf or NaN. The softmax is
    uniform, so the output is the mean of V over the keys."""
    _require_built(head_dim, dtype)
    batch, seqlen_q, seqlen_k, nheads = 2, 128, 1031, 3
    q = torch.ones(batch, seqlen_q, nheads, head_dim, dtype=dtype, device="cuda")
    k = torch.full((batch, seqlen_k, nheads, head_dim), -120.0 / math.sqrt(head_dim), dtype=dtype, device="cuda")
    v = _randn(batch, seqlen_k, nheads, head_dim, dtype=dtype)
    out, lse = _call(q, k, v)
    assert torch.isfinite(lse).all() and torch.isfinite(out).all()
    ref, ref_lse = attention_ref(q, k, v, upcast=True)
    naive, naive_lse = attention_ref(q, k, v, upcast=False)
    # the construction does what it says: logits near -120, uniform softmax
    assert (ref_lse - math.log(seqlen_k) + 120).abs().max().item() < 1.0
    mean_v = v.float().mean(dim=1, keepdim=True).expand_as(ref)
    torch.testing.assert_close(ref, mean_v)
    assert_close_by_rule(out, mean_v, naive, "out vs mean of V")
    assert_close_by_rule(lse, ref_lse, naive_lse, "lse")


@pytest.mark.parametrize("softcap", [0.0, 50.0], ids=["nocap", "cap50"])
@pytest.mark.parametrize("rising", [True, False], ids=["rising", "falling"])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_running_max_jumps(dtype, head_dim, rising, softcap):
    """The forward keeps a row's running maximum until a key block raises it by more than a factor 2^8 in P
    (conditional rescaling). Logits whose scale grows 20-fold across the key blocks in the order the kernel visits
    them (last block first) make the maximum jump by more than that at almost every block; with the order reversed
    it never moves after the first block. Odd query rows are scaled down 50-fold, so rows that move and rows that
    do not share a warp. Kernel widths >= 128 take the conditional rescale, 64 the unconditional one; the check
    of the first visited block takes the last 128 keys, a superset of every width's first block (kBlockN <= 128)."""
    _require_built(head_dim, dtype)
    batch, seqlen_q, seqlen_k, nheads = 2, 300, 1031, 3
    q = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    q[:, 1::2] *= 0.02
    position = torch.arange(seqlen_k, device="cuda", dtype=torch.float32) / (seqlen_k - 1)
    growth = 1.0 + 19.0 * ((1.0 - position) if rising else position)  # rising: largest at key 0, visited last
    k = (_randn(batch, seqlen_k, nheads, head_dim, dtype=torch.float32) * growth[None, :, None, None]).to(dtype)
    v = _randn(batch, seqlen_k, nheads, head_dim, dtype=dtype)
    _poison_allocator(q.numel() * q.element_size(), batch * nheads * seqlen_q * 4)
    out, lse = attention(q, k, v, softcap=softcap, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, softcap=softcap, upcast=True)
    naive, naive_lse = attention_ref(q, k, v, softcap=softcap, upcast=False)
    if rising:  # the construction does what it says: even rows' maxima move by more than 2^8 after block one
        scores = torch.einsum("bqhd,bkhd->bhqk", q[:, 0::2].float(), k.float()) / math.sqrt(head_dim)
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        first_visited = scores[..., seqlen_k - 128 :]
        assert ((scores.amax(-1) - first_visited.amax(-1)) * math.log2(math.e)).min().item() > 8
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close_by_rule(out, ref, naive, "out")
    assert_close_by_rule(lse, ref_lse, naive_lse, "lse")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(0, 7), (7, 0), (0, 0)])
def test_empty_sequences(seqlen_q, seqlen_k, causal):
    head_dim = 128
    dtype = _built_dtype(head_dim)
    batch, nheads = 2, 3
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype)
    out, lse = _call(q, k, v, causal=causal)
    assert out.shape == (batch, seqlen_q, nheads, head_dim) and out.dtype == dtype and out.device == q.device
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32 and lse.device == q.device
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


# ---------------------------------------------------------------------------------------------------- API


def test_return_lse_false_returns_one_tensor():
    head_dim = 128
    dtype = _built_dtype(head_dim)
    q, k, v = _qkv(2, 113, 203, 3, head_dim, dtype)
    out_only = attention(q, k, v, causal=True)
    assert isinstance(out_only, torch.Tensor)
    assert out_only.shape == q.shape and out_only.dtype == dtype
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out_only, out)
    _check(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_inputs_unchanged(head_dim, causal):
    dtype = _built_dtype(head_dim)
    q, k, v = _qkv(2, 203, 113, 3, head_dim, dtype)
    clones = [t.clone() for t in (q, k, v)]
    out, lse = _call(q, k, v, causal=causal)
    torch.cuda.synchronize()
    for t, c in zip((q, k, v), clones):
        assert torch.equal(t, c)
    assert out.data_ptr() not in (q.data_ptr(), k.data_ptr(), v.data_ptr())


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_default_softmax_scale_is_one_over_sqrt_head_dim(head_dim):
    dtype = _built_dtype(head_dim)
    q, k, v = _qkv(2, 203, 113, 3, head_dim, dtype)
    out_default, lse_default = _call(q, k, v, causal=True)
    out_explicit, lse_explicit = _call(q, k, v, causal=True, softmax_scale=1.0 / math.sqrt(head_dim))
    assert torch.equal(out_default, out_explicit) and torch.equal(lse_default, lse_explicit)
    # the argument is used: another scale gives another answer
    out_other, _ = _call(q, k, v, causal=True, softmax_scale=0.5 / math.sqrt(head_dim))
    assert not torch.equal(out_default, out_other)


@pytest.mark.parametrize("softmax_scale", [0.3, 0.02])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_softmax_scale(head_dim, causal, softmax_scale):
    dtype = _built_dtype(head_dim)
    q, k, v = _qkv(2, 239, 203, 3, head_dim, dtype)
    out, lse = _call(q, k, v, causal=causal, softmax_scale=softmax_scale)
    _check(out, lse, q, k, v, causal=causal, softmax_scale=softmax_scale, name=f"scale {softmax_scale}")


def test_non_default_stream():
    """On a side stream kept busy, the inputs are written and then attention is called: a kernel launched on any
    other stream would run before the writes land and read the stale values."""
    head_dim = 128
    dtype = _built_dtype(head_dim)
    q, k, v = _qkv(2, 1024, 1024, 3, head_dim, dtype)
    expected_out, expected_lse = _call(q, k, v, causal=True)
    stale = [torch.randn_like(t) for t in (q, k, v)]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    assert side != torch.cuda.current_stream()
    with torch.cuda.stream(side):
        # poison first: _poison_allocator synchronizes the device, which must not happen after the sleep
        _poison_allocator(q.numel() * q.element_size(), q.shape[0] * q.shape[2] * q.shape[1] * 4)
        torch.cuda._sleep(100_000_000)  # keeps `side` busy for tens of ms
        for dst, src in zip(stale, (q, k, v)):
            dst.copy_(src)
        out, lse = attention(*stale, causal=True, return_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    for t in stale:
        t.record_stream(side)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    _check(out, lse, q, k, v, causal=True, name="side stream")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_nan_input_row_stays_nan(softcap, dtype):
    """A NaN in one query row makes that row's output and LSE NaN; it must not read as a row that saw no key
    (LSE -inf, output 0), which LSE-based merging would silently drop. Other rows are unaffected. 200 keys: the
    key-block loop runs (softcap 30 in bf16 at head_dim 128: QKᵀ in two halves there)."""
    head_dim = 128
    _require_built(head_dim, dtype)
    q, k, v = _qkv(1, 64, 200, 1, head_dim, dtype)
    q[0, 5, 0, 0] = float("nan")
    out, lse = attention(q, k, v, return_lse=True, softcap=softcap)
    assert torch.isnan(lse[0, 0, 5]) and torch.isnan(out[0, 5, 0]).all()
    others = torch.ones(64, dtype=torch.bool, device=q.device)
    others[5] = False
    assert torch.isfinite(lse[0, 0, others]).all() and torch.isfinite(out[0, others]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_nan_key_reaches_every_row(head_dim, softcap, dtype):
    """Batch b (of 32) holds a NaN in key 8 * (b // 2) + b % 2 of the first key block, which the key-block loop visits
    (150 keys: the last block is visited first, outside the loop): in a WGMMA accumulator that column sits at
    position b of a thread's 32 columns of a row, so every position, both halves of a split QKᵀ included, meets a
    NaN once. Each batch's output rows and LSE are all NaN."""
    _require_built(head_dim, dtype)
    q, k, v = _qkv(32, 40, 150, 1, head_dim, dtype)
    for b in range(32):
        k[b, 8 * (b // 2) + b % 2, 0, 3] = float("nan")
    out, lse = attention(q, k, v, return_lse=True, softcap=softcap)
    assert torch.isnan(lse).all() and torch.isnan(out).all()


# ----------------------------------------------------------------------------------------- persistent scheduling


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,causal,window,softcap",
    [
        (1000, 1100, False, (-1, -1), 0.0),
        (1000, 1100, True, (-1, -1), 0.0),
        (1100, 300, True, (-1, -1), 0.0),  # the first query blocks see no key: empty tiles among the persistent ones
        (1000, 1000, False, (100, 30), 0.0),
        (1000, 100, False, (-1, -1), 0.0),  # one key block per tile: its first block is its last
        (1000, 1100, True, (-1, -1), 20.0),
    ],
    ids=["full", "causal", "causal-empty-rows", "window", "one-key-block", "causal-softcap"],
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_persistent_many_tiles_per_cta(head_dim, seqlen_q, seqlen_k, causal, window, softcap):
    """About 1000 tiles (m_block, head, batch) for the GPU's ~132 persistent CTAs, so each CTA takes several tiles
    from the counter, reloading Q and carrying the K/V pipeline across tiles (with GQA, 33 query heads over 11); also
    tiles of one key block and the softcap."""
    dtype = _built_dtype(head_dim)
    batch, nheads, nheads_k = 4, 33, 11
    q = _randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k = _randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    v = _randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    assert -(-seqlen_q // 128) * nheads * batch > 7 * torch.cuda.get_device_properties(0).multi_processor_count
    _poison_allocator(q.numel() * q.element_size(), batch * nheads * seqlen_q * 4)
    out, lse = attention(q, k, v, causal=causal, window_size=window, softcap=softcap, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window, softcap=softcap, upcast=True)
    naive, naive_lse = attention_ref(q, k, v, causal=causal, window_size=window, softcap=softcap, upcast=False)
    assert_close_by_rule(out, ref, naive, "persistent out")
    assert_close_by_rule(lse, ref_lse, naive_lse, "persistent lse")
    empty = torch.isneginf(ref_lse)
    assert empty.any() == (seqlen_q > seqlen_k and causal)
    if empty.any():
        rows = out.permute(0, 2, 1, 3)[empty]
        assert torch.equal(rows, torch.zeros_like(rows))
