"""Thirty-first round of the bug hunt (tests/bug_report_sources.md, "Thirty-first round"), CPU part.

- The premises of every GPU case of tests/test_bug_reports_thirtyfirst_gpu.py, computed in Python: the designed
  scores are values of their dtype; the forward's key blocks (csrc/flash/config.hpp: 64, 112, 128 keys; visited last
  first) and the lazy rescale's start (kernel_fwd_sm90.hpp: head_dim >= 128) are what the designs assume ("spread":
  every block starts at a key scoring the row maximum 0; "stale": the runner-up alone in the block visited first, the
  dominant key in the one visited last, the rise between them below kRescaleThresholdLog2); the kernel's P of the key
  a design is about, exp2(fmaf(s, scale_log2, -m * scale_log2)) with scale_log2 formed as flash::score_scales forms
  it, lies where the design puts it between its fp16 / bf16 neighbours, with a margin far above ex2.approx's error;
  the bias that follows (sum(rnd(P)) / sum(P)) carries 65504 past fp16's range (FW) or c one ulp away (FX); the naive
  reference's own rounding (P normalised, then rounded) cancels, with margins against the GPU softmax's last bits,
  and the library's references return the exact output on the CPU for every GPU case's inputs.
- The GPU bodies on the CPU, with a model of the forward kernel's softmax in their place (key blocks of the kernel's
  width visited last first, the row maximum moved at every block below head_dim 128 and lazily from 128, P =
  exp2(fma(s, scale_log2, -m)) rounded to the dtype for P V, O accumulated in float32): with O divided by the sum of
  the unrounded P, as softmax.hpp's finalize does on the online-maximum path, every FW case fails (inf) and every FX
  case fails (one ulp), except the stale-maximum controls at head_dim 64 / 96, which pass; with O divided by the sum
  of the rounded P, and with the float32 reference rounded to the dtype (tests/cpu_stand_ins.py's forward), they all
  pass. So the GPU checks can fail, and fail for this fault.
- Three bodies through the library's own Python layer, op schemas and autograd node with the stand-ins (skipped,
  with the reason, where the extension is not built): the model of the kernel as the forward op fails them, the
  stand-ins' forward passes.

Everything but the stand-in bodies needs only the source tree and torch."""

import math
import pathlib
import re
import types

import pytest
import torch

import cpu_stand_ins
import test_bug_reports_thirtyfirst_gpu as gpu_file
from flash_attn_hopper.interface import kernel_head_dim
from flash_attn_hopper.testing import attention_ref, attention_varlen_ref

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "flash"
FP16, BF16 = torch.float16, torch.bfloat16
LOG2E = math.log2(math.e)
# the forward's key block by kernel width, and the configurations of csrc/flash/config.hpp that have one
FWD_BLOCK_N = {64: 128, 96: 128, 128: 128, 192: 112, 256: 64}
FWD_CONFIGS = {"FwdTileConfig<64>": 64, "FwdTileConfig64Narrow": 64, "FwdTileConfig<96>": 96,
               "FwdTileConfig<128>": 128, "FwdTileConfig<192>": 192, "FwdTileConfig<256>": 256}
ALL_CASES = ([("FW", FP16, d, lay) for d in gpu_file.HEAD_DIMS for lay in ("gqa", "decode_mqa", "varlen", "stale_max")]
             + [("FX", *case) for case in gpu_file.FX_CASES])


def case_id(case):
    cls, dtype, head_dim, layout = case
    return f"{cls}-{str(dtype)[6:]}-{head_dim}-{layout}"


def shape_of(layout):
    return gpu_file.DENSE_LAYOUTS[layout][4] if layout in gpu_file.DENSE_LAYOUTS else "spread"


def lazy(head_dim):
    """Whether the forward kernel of this head_dim keeps a row's maximum until it rises past 2^8 in P."""
    return kernel_head_dim(head_dim) >= gpu_file.LAZY_RESCALE_FROM


def expected_to_fail(case):
    """By the code: every case but the stale maximum at the widths without the lazy rescale (the control)."""
    return not (case[3] == "stale_max" and not lazy(case[2]))


# ------------------------------------------------ number helpers (float64, exact for these magnitudes)

def ulp(x, dtype):
    """The spacing of dtype's values in [2^e, 2^(e+1)) holding x > 0 (normal range)."""
    return 2.0 ** math.floor(math.log2(x)) * torch.finfo(dtype).eps


def place(x, dtype):
    """Where x > 0 lies between its two neighbouring dtype values, as a fraction of their distance."""
    u = ulp(x, dtype)
    return x / u - math.floor(x / u)


def rounded(x, dtype):
    return torch.tensor(x, dtype=torch.float64).to(dtype).item()


def f32(x):
    return torch.tensor(x, dtype=torch.float64).float().item()


def scale_log2(softmax_scale):
    """flash::score_scales (csrc/flash/common/softmax.hpp): float(double(scale) * M_LOG2E), the scale a float32."""
    return f32(f32(softmax_scale) * LOG2E)


def kernel_p(s, m):
    """The kernel's unnormalised P of a key scoring s in a row whose (running) maximum is m: exp2(fmaf(s, scale_log2,
    -float32(m * scale_log2))), one rounding of the FFMA (ex2.approx's relative error, about 2^-22, is what the
    margins below are against)."""
    sl2 = scale_log2(gpu_file.SOFTMAX_SCALE)
    return 2.0 ** f32(s * sl2 - f32(m * sl2))


def row_weights(design):
    """[(count, score)] of the keys of a row that sees every key, and the kernel's running maximum when the P V of
    the keys that matter is formed (spread: 0, in every block; stale: the runner-up -a under the lazy rescale)."""
    cls, dtype, shape = design
    seqlen_k, score = gpu_file.designed_score(cls, dtype, shape)
    if shape == "spread":
        zeros = -(-seqlen_k // gpu_file.ZERO_KEY_EVERY)
        return [(zeros, 0.0), (seqlen_k - zeros, score)], 0.0
    return [(1, 0.0), (1, score), (seqlen_k - 2, gpu_file.STALE_OTHERS)], score


def kernel_factor(design):
    """sum(rnd(P)) / sum(P) over a row (the lazy kernels' maximum): what O divided by the unrounded sum multiplies
    v by."""
    keys, m = row_weights(design)
    dtype = design[1]
    p = [(n, kernel_p(s, m)) for n, s in keys]
    return sum(n * rounded(x, dtype) for n, x in p) / sum(n * x for n, x in p)


def designed_p(design):
    """The kernel's P of the key whose rounding the design is about (spread: a designed key; stale: the dominant
    one)."""
    keys, m = row_weights(design)
    return kernel_p(keys[1][1] if design[2] == "spread" else 0.0, m)


def naive_weights(design):
    """The naive reference's normalised weights (float64) of the keys that carry weight, and the sum of the rounded
    weights over the row."""
    keys, _ = row_weights(design)
    dtype = design[1]
    l = sum(n * math.exp(s * gpu_file.SOFTMAX_SCALE) for n, s in keys)
    weights = [(n, math.exp(s * gpu_file.SOFTMAX_SCALE) / l) for n, s in keys]
    heavy = [w for n, w in weights if w > 1e-20]
    return heavy, sum(n * rounded(w, dtype) for n, w in weights)


DESIGN_KEYS = list(gpu_file.DESIGNS)
DESIGN_IDS = [f"{c}-{str(d)[6:]}-{shape}" for c, d, shape in DESIGN_KEYS]


# ------------------------------------------------ the premises

def test_key_blocks_of_every_forward_configuration():
    """FWD_BLOCK_N is config.hpp's kBlockN for every forward configuration, and the lazy rescale starts at kernel
    width 128 (kernel_fwd_sm90.hpp). spread: every block start (multiples of kBlockN up to the last, partial block,
    which the forward visits first) is a key scoring 0, so each block a row sees holds the row maximum. stale: the
    last key is alone in the last block of every width (visited first: the runner-up -a sets the maximum), key 0 (0,
    the dominant) is in the first (visited last), every other key is below -a."""
    text = (CSRC / "config.hpp").read_text()
    for name, width in FWD_CONFIGS.items():
        m = re.search(r"struct " + re.escape(name) + r"\s*\{\s*static constexpr int kBlockM = \d+, kBlockN = (\d+),",
                      text)
        assert m, f"{name} not found in config.hpp"
        assert int(m.group(1)) == FWD_BLOCK_N[width], (name, m.group(1))
    kernel = (CSRC / "fwd" / "kernel_fwd_sm90.hpp").read_text()
    assert f"static constexpr bool kLazyRescale = kHeadDim_ >= {gpu_file.LAZY_RESCALE_FROM};" in kernel
    for head_dim in gpu_file.HEAD_DIMS:
        assert kernel_head_dim(head_dim) == head_dim
    for cls, dtype, shape in DESIGN_KEYS:
        seqlen_k, score = gpu_file.designed_score(cls, dtype, shape)
        column = gpu_file.key_scores(cls, dtype, shape)
        assert column.numel() == seqlen_k and column.max().item() == 0.0
        for block_n in set(FWD_BLOCK_N.values()):
            last = (seqlen_k - 1) // block_n * block_n  # the block visited first
            if shape == "spread":
                assert all(column[s].item() == 0.0 for s in range(0, seqlen_k, block_n)), (cls, block_n)
                assert seqlen_k % block_n != 0, "the first block visited is a partial one"
            else:
                assert last == seqlen_k - 1 and column[last].item() == score, (cls, block_n)
                assert column[0].item() == 0.0 and block_n > 1 and (column[1:-1] < score).all()


@pytest.mark.parametrize("design", DESIGN_KEYS, ids=DESIGN_IDS)
def test_designed_scores_and_the_kernels_p(design):
    """The designed score is a value of the dtype (the scores are exact: one nonzero product each). The kernel's P
    of the key the design is about lies at the designed place between its dtype neighbours: FW just above a rounding
    midpoint (rounds up by >= 0.4 ulp), FX just below (rounds down by >= 0.4 ulp), at least 0.03 ulp from the
    midpoint: over 100 times ex2.approx's relative error (about 2^-22) and the float32 rounding of the exponent.
    spread: P in (0.5, 0.7); stale: the dominant key's P against the runner-up's maximum, in (32, 256) (the maximum
    stays: a rise of less than 2^8 in P under kRescaleThresholdLog2 = 8, csrc/flash/common/softmax.hpp)."""
    cls, dtype, shape = design
    _, score = gpu_file.designed_score(cls, dtype, shape)
    assert rounded(score, dtype) == score
    p = designed_p(design)
    if shape == "spread":
        assert -0.7 < score < -0.5 and 0.5 < p < 0.7
    else:
        assert -5.5 < score < -3 and 32 < p < 256
        softmax = (CSRC / "common" / "softmax.hpp").read_text()
        assert "constexpr float kRescaleThresholdLog2 = 8.f;" in softmax
        assert -score * scale_log2(gpu_file.SOFTMAX_SCALE) < 8
    where = place(p, dtype)
    if cls == "FW":
        assert 0.53 <= where <= 0.6, where
    else:
        assert 0.4 <= where <= 0.47, where
    margin = abs(where - 0.5) * ulp(p, dtype) / p  # relative distance to the midpoint
    assert margin > 100 * 2.0 ** -22, margin


@pytest.mark.parametrize("design", DESIGN_KEYS, ids=DESIGN_IDS)
def test_the_bias_crosses_the_line(design):
    """FW: 65504 times the kernel's factor is past 65520 (where fp16 rounds to inf) with room for float32's summation
    (< 4e-5 relative). FX: the factor moves c = 1 and at least a quarter of the values drawn one ulp down, and each
    such error is above the rule's floor (1e-4 x max |c| <= 2e-4)."""
    cls, dtype, _ = design
    factor = kernel_factor(design)
    if cls == "FW":
        assert factor - 1 > 3.5e-4 and gpu_file.FP16_MAX * factor * (1 - 4e-5) > 65520, factor
        assert rounded(gpu_file.FP16_MAX * factor, FP16) == math.inf
        return
    below_one = torch.finfo(dtype).eps / 2  # the spacing of dtype's values just below 1
    assert 1 - factor >= 1.1 * below_one / 2, factor  # past the midpoint below 1 by a tenth of it, at least
    assert rounded(factor, dtype) == 1 - below_one  # c = 1 comes back one ulp low
    g = gpu_file.gpu_helpers.seeded_generator("values")
    values = gpu_file.value_table(cls, dtype, (4, 256), g).double()
    moved = torch.tensor([rounded(c * factor, dtype) != c for c in values.flatten().tolist()])
    assert moved.float().mean().item() > 0.25
    assert min(ulp(abs(c), dtype) for c in values.flatten().tolist()) > 1e-4 * values.abs().max().item()


@pytest.mark.parametrize("design", DESIGN_KEYS, ids=DESIGN_IDS)
def test_naive_reference_rounding_cancels(design):
    """The naive reference's weights of the keys that carry weight (float32 on the GPU, a few ulps off these) lie at
    least 0.1 ulp of the dtype from a rounding midpoint, so the GPU rounds them as here, and the rounded weights sum
    to 1 within 6e-5 (fp16) / 5e-4 (bf16) (the others' weights, 1e-25 or less, round to 0 or nearly): the naive
    output is c exactly (FW: 65504, not inf) for every value drawn."""
    cls, dtype, _ = design
    heavy, total = naive_weights(design)
    for weight in heavy:
        assert abs(place(weight, dtype) - 0.5) >= 0.1, (weight, place(weight, dtype))
    assert abs(total - 1) <= (6e-5 if dtype == FP16 else 5e-4), total
    values = gpu_file.value_table(cls, dtype, (4, 256), gpu_file.gpu_helpers.seeded_generator("values")).flatten().tolist()
    assert all(rounded(c * total, dtype) == c for c in values)


@pytest.mark.parametrize("case", ALL_CASES, ids=[case_id(c) for c in ALL_CASES])
def test_references_meet_the_construction(monkeypatch, case):
    """Every GPU case's inputs on the CPU: q's first column 1 (its others not all 0) and k zero but for its first
    column, the designed column in every sequence and head, so each score is one product, exact; v constant along the
    keys of each sequence, the exact output those constants (0 for a sequence without keys); the library's float32
    reference gives the exact output up to its float32 sums and the naive one gives it bit for bit (what
    check_constant_rows asserts on the GPU)."""
    monkeypatch.setattr(gpu_file, "DEVICE", "cpu")
    cls, dtype, head_dim, layout = case
    name = f"premise {case_id(case)}"
    column = gpu_file.key_scores(cls, dtype, shape_of(layout)).to(dtype)
    if layout == "varlen":
        q, k, v, cu_q, cu_k, _, _, exact = gpu_file.varlen_inputs(cls, dtype, head_dim, name)
        ref = attention_varlen_ref(q, k, v, cu_q, cu_k, softmax_scale=gpu_file.SOFTMAX_SCALE)
        naive = attention_varlen_ref(q, k, v, cu_q, cu_k, softmax_scale=gpu_file.SOFTMAX_SCALE, upcast=False)
        spans = [(a, b) for a, b in zip(cu_k[:-1].tolist(), cu_k[1:].tolist())]
        assert [b - a for a, b in spans] == [column.numel() if has else 0 for has in gpu_file.VARLEN_KEYS]
        for a, b in (span for span in spans if span[1] > span[0]):
            assert torch.equal(k[a:b, :, 0], column.view(-1, 1).expand(b - a, k.shape[1]))
            assert torch.equal(v[a:b], v[a:a + 1].expand_as(v[a:b]))
    else:
        q, k, v, exact = gpu_file.dense_inputs(cls, dtype, head_dim, layout, name)
        ref = attention_ref(q, k, v, softmax_scale=gpu_file.SOFTMAX_SCALE)
        naive = attention_ref(q, k, v, softmax_scale=gpu_file.SOFTMAX_SCALE, upcast=False)
        assert torch.equal(k[..., 0], column.view(1, -1, 1).expand_as(k[..., 0]))
        assert torch.equal(v, v[:, :1].expand_as(v))
        assert exact.abs().min().item() >= 1.0
    assert (q[..., 0] == 1).all() and (k[..., 1:] == 0).all() and (q[..., 1:] != 0).any()
    assert exact.shape == ref[0].shape and exact.abs().max().item() > 0
    with gpu_file.naive_with_float32_accumulation():  # (the GPU path's flags exist and restore on the CPU too)
        pass
    assert torch.equal(naive[0].float(), exact), (naive[0].float() - exact).abs().max().item()
    assert (ref[0].double() - exact.double()).abs().max().item() <= 1e-5 * exact.abs().max().item()


# ------------------------------------------------ a model of the forward kernel's softmax

def kernel_model(q, k, v, softmax_scale, rounded_sum):
    """The forward kernel's arithmetic for one dense call without masks (q (b, sq, h, d), k and v (b, sk, hk, d)):
    scores in float32; key blocks of the kernel's width (FWD_BLOCK_N by q's head_dim) visited last first; the row
    maximum moved to each new one (head_dim below 128) or, with the lazy rescale (from 128), only past a factor 2^8
    (kRescaleThresholdLog2) or from -inf, O and the sum rescaled by exp2((m_old - m_new) * scale_log2); P =
    exp2(fma(s, scale_log2, -m * scale_log2)) in float32, rounded to the dtype for P V; O summed in float32 and divided
    by the sum of the unrounded P (softmax.hpp finalize on the online-maximum path) or, with rounded_sum, of the P that
    P V used. Returns (out in q's dtype, LSE = m * scale + log(sum of the unrounded P))."""
    dtype, block_n = q.dtype, FWD_BLOCK_N[kernel_head_dim(q.shape[-1])]
    group = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kr.double()).float()
    sl2 = scale_log2(softmax_scale)
    m = torch.full(s.shape[:3], -math.inf)
    total, total_rounded = torch.zeros(s.shape[:3]), torch.zeros(s.shape[:3])
    acc = torch.zeros(*s.shape[:3], v.shape[-1])
    values = vr.double().permute(0, 2, 1, 3)
    keep_stale = lazy(q.shape[-1])
    for start in reversed(range(0, s.shape[-1], block_n)):
        block = s[..., start:start + block_n]
        new = torch.maximum(m, block.max(-1).values)
        move = torch.isneginf(m) | ((new - m) * sl2 > 8) if keep_stale else torch.ones_like(m, dtype=torch.bool)
        factor = torch.where(move & ~torch.isneginf(m), torch.exp2((m - new) * sl2), torch.ones_like(m))
        m = torch.where(move, new, m)
        m_scaled = torch.where(torch.isneginf(m), torch.zeros_like(m), m * sl2)
        p = (block.double() * sl2 - m_scaled.double().unsqueeze(-1)).float().exp2()  # one rounding, as the FFMA
        p_used = p.to(dtype)
        total = total * factor + p.sum(-1)
        total_rounded = total_rounded * factor + p_used.float().sum(-1)
        pv = torch.einsum("bhqk,bhkd->bhqd", p_used.double(), values[:, :, start:start + block_n]).float()
        acc = acc * factor.unsqueeze(-1) + pv
    divisor = total_rounded if rounded_sum else total
    out = (acc * (1.0 / divisor).unsqueeze(-1)).to(dtype).permute(0, 2, 1, 3)
    lse = torch.where(total > 0, m * softmax_scale + torch.log(total), torch.full_like(m, -math.inf))
    return out, lse


def kernel_model_varlen(q, k, v, cu_q, cu_k, softmax_scale, rounded_sum):
    """kernel_model per sequence of a packed batch: out (total_q, h, d_v), LSE (h, total_q); rows of a sequence
    without keys 0 and -inf."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        (q0, q1), (k0, k1) = (cq[b], cq[b + 1]), (ck[b], ck[b + 1])
        if q1 > q0 and k1 > k0:
            o, l = kernel_model(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale, rounded_sum)
            out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def reference_forward(q, k, v, softmax_scale):
    """The stand-ins' forward: the float32 reference rounded to the dtype."""
    out, lse = attention_ref(q, k, v, softmax_scale=softmax_scale)
    return out.to(q.dtype), lse


def reference_forward_varlen(q, k, v, cu_q, cu_k, softmax_scale):
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, softmax_scale=softmax_scale)
    return out.to(q.dtype), lse


def library_on_cpu(kind):
    """A stand-in for the flash_attn_hopper module of the GPU file: attention and attention_varlen computed by the
    kernel model ("unrounded_sum": the code as it is; "rounded_sum": the fix) or the reference ("reference")."""
    def attention(q, k, v, softmax_scale=None, return_lse=False):
        assert return_lse and softmax_scale == gpu_file.SOFTMAX_SCALE
        if kind == "reference":
            return reference_forward(q, k, v, softmax_scale)
        return kernel_model(q, k, v, softmax_scale, kind == "rounded_sum")

    def attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, return_lse=False):
        assert return_lse and softmax_scale == gpu_file.SOFTMAX_SCALE
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
        if kind == "reference":
            return reference_forward_varlen(q, k, v, cu_q, cu_k, softmax_scale)
        return kernel_model_varlen(q, k, v, cu_q, cu_k, softmax_scale, kind == "rounded_sum")

    return types.SimpleNamespace(attention=attention, attention_varlen=attention_varlen)


@pytest.fixture
def cpu_bodies(monkeypatch):
    """The GPU bodies on the CPU: DEVICE "cpu", no CUDA allocator to poison, every head_dim and dtype."""
    monkeypatch.setattr(gpu_file, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_file, "poison", lambda *args, **kwargs: None)
    monkeypatch.setattr(gpu_file, "require_built", lambda *args, **kwargs: None)
    yield monkeypatch


def run_gpu_body(case):
    cls, dtype, head_dim, layout = case
    if cls == "FW":
        gpu_file.test_fp16_output_at_the_top_of_the_range(head_dim, layout)
    else:
        gpu_file.test_values_equal_along_the_keys_come_back_exactly(dtype, head_dim, layout)


# What the GPU checks raise for a wrong output (FW's infinity check, the rule), not the construction's asserts.
_WRONG_RESULT = r"infinite where the exact output|max abs error"


@pytest.mark.parametrize("case", ALL_CASES, ids=[case_id(c) for c in ALL_CASES])
def test_gpu_check_fails_for_the_unrounded_sum(cpu_bodies, case):
    """The kernel model with O divided by the sum of the unrounded P (the code of softmax.hpp's finalize on this
    path; the model leaves out the fp16 epilogue's clamp, session 64's fix of FW) fails every GPU case, FW with an
    infinite out, FX by the rule (one ulp against a naive error of about 0 and a floor below an ulp), except the
    controls: the stale maximum at head_dim 64 and 96, where the maximum moves and the dominant key's P is 1, passes."""
    cpu_bodies.setattr(gpu_file, "flash_attn_hopper", library_on_cpu("unrounded_sum"))
    if not expected_to_fail(case):
        run_gpu_body(case)
        return
    # KnownFault: the wrong out that FX's expected-failure marks accept and unmarked FW fails on (not the construction,
    # not the LSE)
    with pytest.raises(gpu_file.KnownFault, match=_WRONG_RESULT) as failure:
        run_gpu_body(case)
    if case[0] == "FW":
        assert "infinite" in str(failure.value)


@pytest.mark.parametrize("case", ALL_CASES, ids=[case_id(c) for c in ALL_CASES])
def test_gpu_check_passes_for_the_rounded_sum(cpu_bodies, case):
    """The same bodies pass for the kernel model with O divided by the sum of the P it used (the fix of the reports;
    the LSE still from the unrounded sum): the checks ask for nothing a right kernel with these blocks cannot give."""
    cpu_bodies.setattr(gpu_file, "flash_attn_hopper", library_on_cpu("rounded_sum"))
    run_gpu_body(case)


REFERENCE_CASES = [("FW", FP16, 64, "gqa"), ("FW", FP16, 192, "varlen"), ("FW", FP16, 128, "stale_max"),
                   ("FX", FP16, 256, "gqa"), ("FX", BF16, 96, "gqa"), ("FX", BF16, 192, "stale_max")]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=[case_id(c) for c in REFERENCE_CASES])
def test_gpu_check_passes_for_the_reference_forward(cpu_bodies, case):
    """And for the float32 reference rounded to the dtype (tests/cpu_stand_ins.py's forward)."""
    cpu_bodies.setattr(gpu_file, "flash_attn_hopper", library_on_cpu("reference"))
    run_gpu_body(case)


# ------------------------------------------------ through the library's Python layer and op schemas

def _model_fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic, doc_bounds=None):
    assert not causal and (window_left, window_right) == (-1, -1) and softcap == 0 and doc_bounds is None
    return kernel_model(q, k, v, softmax_scale, rounded_sum=False)


def _model_fwd_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_left, window_right, softcap,
                      deterministic):
    assert not causal and (window_left, window_right) == (-1, -1) and softcap == 0
    return kernel_model_varlen(q, k, v, cu_q, cu_k, softmax_scale, rounded_sum=False)


LIBRARY_CASES = [("FW", FP16, 256, "decode_mqa"), ("FX", BF16, 128, "varlen"), ("FX", FP16, 128, "stale_max")]


@pytest.mark.parametrize("case", LIBRARY_CASES, ids=[case_id(c) for c in LIBRARY_CASES])
def test_gpu_body_through_the_library_with_stand_ins(cpu_bodies, case):
    """flash_attn_hopper.attention / attention_varlen themselves (argument checks, the ops through the dispatcher, the
    C++ autograd node) with CPU kernels: the stand-ins' forward passes the body, the kernel model's fails it."""
    with cpu_stand_ins.stand_ins(cpu_bodies, "round 31's test bodies"):
        run_gpu_body(case)
    assert [c[0] for c in cpu_stand_ins.CALLS] == ["fwd_varlen" if case[3] == "varlen" else "fwd"]
    cpu_bodies.setattr(cpu_stand_ins, "STAND_INS", dict(cpu_stand_ins.STAND_INS, fwd=_model_fwd,
                                                       fwd_varlen=_model_fwd_varlen))
    with cpu_stand_ins.stand_ins(cpu_bodies, "round 31's test bodies"), pytest.raises(gpu_file.KnownFault,
                                                                                    match=_WRONG_RESULT):
        run_gpu_body(case)


# ------------------------------------------------ FW in the forward's exact pass

def test_exact_pass_case_premises():
    """The GPU file's exact-pass case: its scaled scores pass the main kernel's bound (the rows are flagged: |m| *
    scale_log2 >= kExactRowsLimitLog2) and the exact pass's (|LSE| in log2 units >= half of it), and the pass's float32
    sum of O over the keys one at a time (fmaf(1, 65504, o)) divided by the key count passes 65520, which fp16 rounds to
    inf: without a clamp the case fails, with one it asks for +-65504 exactly."""
    softmax = (CSRC / "common" / "softmax.hpp").read_text()
    m = re.search(r"constexpr float kExactRowsLimitLog2 = ([0-9.]+)f;", softmax)
    assert m, "kExactRowsLimitLog2 not found in softmax.hpp"
    limit = float(m.group(1))
    score = gpu_file.EXACT_PASS_VALUE ** 2 * 64
    assert score * math.log2(math.e) >= limit
    assert (score + math.log(gpu_file.EXACT_PASS_SEQLEN_K)) * math.log2(math.e) >= limit / 2
    o = torch.zeros((), dtype=torch.float32)
    v = torch.tensor(gpu_file.FP16_MAX, dtype=torch.float32)
    for _ in range(gpu_file.EXACT_PASS_SEQLEN_K):
        o = o + v
    mean = o / gpu_file.EXACT_PASS_SEQLEN_K
    assert mean.item() >= 65520.0 and torch.isinf(mean.half())
