"""Thirty-seventh round of the bug hunt (tests/bug_report_sources.md, "Thirty-seventh round"), CPU part: the premises of
tests/test_bug_reports_thirtyseventh_gpu.py, without a GPU or the extension.

- GQ: every case's q, k, v, dout are multiples of 2 MiB and at least 10 MiB (the caching allocator then gives each a
  segment of exactly its size, so the caps fall where the GPU file says); the backward op allocates dQ, dK and dV
  before its fp32 dQ workspace (csrc/api/flash_api.cpp), and that workspace is larger than the "workspace" cap's
  slack, so that cap fails inside the op, after allocations; a backward that changed its saved LSE before failing
  (to log2) gives gradients that the retry's rule check refuses.
- GR: each restoration hands back the values with other strides or a 2- / 4- / 8-byte (never 16-byte) aligned
  address, NaN or INT_MAX around them; a reader that takes the forward's strides reads other values (or NaN).
- GS: the child script compiles and runs the two checks of the module; each configuration names an allocator option
  PyTorch parses."""

import os

import pytest
import torch

import test_bug_reports_thirtyseventh_gpu as gpu_file
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_ref_grads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20


def _meta_problem(kind, dtype):
    """The GQ problem's tensors as meta tensors (shapes and sizes only)."""
    old = gpu_file.randn, gpu_file.cu_seqlens, gpu_file.DEVICE
    gpu_file.randn = lambda *s, dtype: torch.empty(*s, dtype=dtype, device="meta")
    gpu_file.cu_seqlens = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                                                       dtype=torch.int32)
    gpu_file.DEVICE = "cpu"
    try:
        return gpu_file.gq_problem(kind, dtype)
    finally:
        gpu_file.randn, gpu_file.cu_seqlens, gpu_file.DEVICE = old


@pytest.mark.parametrize("case", list(gpu_file.GQ_CASES))
def test_gq_inputs_take_segments_of_exactly_their_size(case):
    kind, dtype_name, _, _ = gpu_file.GQ_CASES[case]
    p = _meta_problem(kind, gpu_file.DTYPES[dtype_name])
    assert gpu_file.gq_segments_exact(p)
    # the backward's fp32 dQ workspace (rows rounded up to 128 per (batch, head), or per head with a tile per
    # sequence when varlen, at the kernel width 128) is far larger than the slack
    if p.varlen is None:
        rows = p.q.shape[0] * p.q.shape[2] * -(-p.q.shape[1] // 128) * 128
    else:
        rows = p.q.shape[1] * -(-(p.q.shape[0] + 128 * (len(p.varlen[0]) - 1)) // 128) * 128
    assert rows * 128 * 4 >= 8 * gpu_file.GQ_SLACK


def test_gq_backward_allocates_gradients_before_its_workspace():
    text = open(os.path.join(ROOT, "csrc", "api", "flash_api.cpp")).read()
    bwd = text[text.index("std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd("):]
    bwd = bwd[:bwd.index("\n}\n")]
    assert bwd.index("at::Tensor dv = at::empty") < bwd.index("launch_bwd(")
    varlen = text[text.index("std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_varlen("):]
    varlen = varlen[:varlen.index("\n}\n")]
    assert varlen.index("at::Tensor dv = at::empty") < varlen.index("launch_bwd(")
    launch = text[text.index("void launch_bwd("):]
    launch = launch[:launch.index("\n}\n")]
    first_alloc = min(launch.index(s) for s in ("zeroed(", "at::empty(") if s in launch)
    # (tma_ready copies only inputs whose strides or address TMA cannot take: none of GQ's)
    assert launch.index("dq_accum = zeroed(") + len("dq_accum = ") == first_alloc, "the dQ workspace comes first"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gq_retry_check_refuses_a_backward_that_changed_its_saved_lse(dtype):
    torch.manual_seed(3)
    q, k, v, dout = (torch.randn(2, 77, 4, 64, dtype=dtype) for _ in range(4))
    dlse = torch.randn(2, 4, 77)
    ref = attention_ref_grads(q, k, v, dout, causal=True, dlse=dlse)
    naive = attention_ref_grads(q, k, v, dout, causal=True, dlse=dlse, upcast=False)
    for r, n in zip(ref, naive):
        assert_close_by_rule(r.to(dtype), r, n, "the float32 reference rounded passes")
    # P = exp(S - LSE) with the LSE scaled by log2(e) in place: every row's P scaled by exp(-0.44 LSE)
    _, lse = attention_ref(q, k, v, causal=True)
    factor = torch.exp(lse - lse * 1.4426950408889634).transpose(1, 2).unsqueeze(-1)
    wrong = attention_ref_grads(q, k, v, dout.float() * factor, causal=True, dlse=dlse * factor[..., 0].transpose(1, 2))
    with pytest.raises(AssertionError):
        for w, r, n in zip(wrong, ref, naive):
            assert_close_by_rule(w.to(dtype), r, n, "saved LSE changed")


@pytest.mark.parametrize("kind", gpu_file.GR_KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int64])
def test_gr_restorations_keep_values_and_change_layout(kind, dtype):
    shape = (2, 30, 4, 64) if dtype.is_floating_point else (5,)
    host = torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.arange(5, dtype=dtype) * 7
    t = gpu_file.gr_relayout(kind, host, "cpu")
    assert t.shape == host.shape and t.dtype == host.dtype and torch.equal(t, host)
    half = dtype in (torch.float16, torch.bfloat16)
    if kind == "offset_arena":
        assert t.data_ptr() % 16 != 0 and t.is_contiguous()
        base = t.untyped_storage()
        before = torch.tensor([], dtype=dtype).set_(base, 0, (gpu_file.GR_OFFSET,))
        after = torch.tensor([], dtype=dtype).set_(base, gpu_file.GR_OFFSET + t.numel(), (8,))
        for canary in (before, after):
            assert (torch.isnan(canary).all() if dtype.is_floating_point
                    else (canary == torch.iinfo(dtype).max).all())
    elif kind in ("padded_rows", "head_major") and half:
        assert t.stride() != host.stride() and t.stride(-1) == 1
        assert all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]), "TMA-ready strides"
        forward_view = t.as_strided(t.shape, host.stride())  # a reader with the forward's strides
        assert not torch.equal(forward_view, host)
    else:
        assert t.is_contiguous() and t.stride() == host.stride()


def test_gr_host_contiguous_restores_strided_views_contiguous():
    torch.manual_seed(5)
    for workload, (dtype_name, head_dim) in gpu_file.GR_WORKLOADS.items():
        old = gpu_file.randn, gpu_file.cu_seqlens, gpu_file.DEVICE
        gpu_file.randn = lambda *s, dtype: torch.randn(*s, dtype=dtype)
        gpu_file.cu_seqlens = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                                                           dtype=torch.int32)
        gpu_file.DEVICE = "cpu"
        try:
            p = gpu_file.gr_problem(workload, gpu_file.DTYPES[dtype_name], head_dim, strided=True)
        finally:
            gpu_file.randn, gpu_file.cu_seqlens, gpu_file.DEVICE = old
        for name, t in (("q", p.q), ("k", p.k), ("v", p.v)):
            assert not t.is_contiguous(), f"{workload} {name}: the forward must see a strided view"
            restored = gpu_file.gr_relayout("host_contiguous", t.contiguous(), "cpu")
            assert restored.stride() != t.stride() and torch.equal(restored, t)


def test_gr_premise_check_refuses_unchanged_layouts():
    same = [((2, 3), (3, 1), 4096)] * 5
    with pytest.raises(AssertionError, match="other strides"):
        gpu_file.gr_check_premise("padded_rows", {"packed": same, "restored": same}, "x")
    with pytest.raises(AssertionError, match="16-byte aligned"):
        gpu_file.gr_check_premise("offset_arena", {"packed": same, "restored": same}, "x")
    with pytest.raises(AssertionError, match="packed"):
        gpu_file.gr_check_premise("padded_rows", {"packed": same[:4], "restored": same[:4]}, "x")


@pytest.mark.parametrize("config", list(gpu_file.GS_CONFIGS))
def test_gs_child_script_and_configurations(config):
    compile(gpu_file.GS_SCRIPT, "gs_child", "exec")
    assert "gs_check_allocator(config)" in gpu_file.GS_SCRIPT and "gs_workload(group)" in gpu_file.GS_SCRIPT
    option, value = gpu_file.GS_CONFIGS[config].split(":")
    assert option in ("expandable_segments", "backend") and value in ("True", "cudaMallocAsync")
    assert set(gpu_file.GS_GROUPS) == {"dense_streams", "varlen_documents"} and callable(gpu_file.gs_workload)
