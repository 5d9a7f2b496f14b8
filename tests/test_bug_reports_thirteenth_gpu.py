"""Thirteenth round of the bug hunt (tests/bug_report_sources.md, "Thirteenth round"), GPU part.

DE: torch.compile(fullgraph=True) of ``attention`` over rows picked by a boolean mask inside the compiled code (the
number of rows is an unbacked size, pytorch/pytorch#147672). Before the fix the library's Python checks stopped the
trace ("Could not guard on data-dependent expression"); tests/test_bug_reports_thirteenth_cpu.py checks that on the CPU
stand-ins. Here the real kernels run in the compiled graph (aot_eager and inductor): out and LSE by the rule against
the float32 reference of the picked rows, and out, LSE, dQ, dK, dV bitwise equal to the eager call (deterministic
backward), for two masks through one graph.

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build lacks
the head_dim / dtype (``built_dtype``)."""

import pytest
import torch

import flash_attn_hopper
from gpu_helpers import attention_inputs, built_dtype

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]


def _picked(q, k, v, keep):
    return flash_attn_hopper.attention(q[:, keep], k[:, keep], v[:, keep], causal=True, return_lse=True,
                                       deterministic=True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_attention_on_rows_picked_by_a_mask(backend):
    from flash_attn_hopper.testing import assert_close_by_rule, attention_ref

    head_dim = 128
    dtype = built_dtype(head_dim)
    q, k, v, dout = attention_inputs(2, 333, 333, 4, 2, head_dim, dtype)
    compiled = torch.compile(_picked, backend=backend, fullgraph=True)
    torch.manual_seed(3)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        for kept in (201, 90):
            keep = torch.zeros(333, dtype=torch.bool, device="cuda")
            keep[torch.randperm(333, device="cuda")[:kept]] = True
            runs = []
            for fn in (_picked, compiled):
                leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
                out, lse = fn(*leaves, keep)
                grads = torch.autograd.grad(out, leaves, dout[:, keep])
                runs.append((out.detach(), lse.detach(), *grads))
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *runs):
                assert torch.equal(a, b), f"{backend}, {kept} rows: compiled {name} differs from eager"
            out, lse = runs[1][:2]
            picked = [t[:, keep] for t in (q, k, v)]
            ref, ref_lse = attention_ref(*picked, causal=True, upcast=True)
            naive, naive_lse = attention_ref(*picked, causal=True, upcast=False)
            assert_close_by_rule(out, ref, naive, f"{backend}, {kept} rows: out")
            assert_close_by_rule(lse, ref_lse, naive_lse, f"{backend}, {kept} rows: lse")


# ------------------------------------------------------------------------------- DF: offsets that go back, op level
_OFFSETS_SCRIPT = """
import torch
import flash_attn_hopper  # noqa: F401 (loads the ops)
torch.manual_seed(0)
ops = torch.ops.flash_attn_hopper
for head_dim in {head_dims!r}:
    q, k, v = (torch.randn(1000, 4, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    lists = [[0, 1000, 0, 1000], [13, 511, -36, 45], [0, 600, 300, 1000], [700, 200, 900, 100, 1000]]
    if head_dim == {head_dims!r}[0]:
        # back past the scan's first 1024-entry chunk (the scan does not depend on head_dim: one head_dim, to keep the
        # run short under memcheck): a carry lost between chunks would restart the running maximum at 0 there and put
        # two 1000-row sequences on the same workspace rows (a hang)
        lists.append([0] * 1023 + [1000, 0, 1000])
    for offsets in lists:
        cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
        for deterministic in (True, False):
            args = (cu, cu, 1000, 1000, head_dim ** -0.5, False, -1, -1, 0.0, deterministic)
            out, lse = ops.fwd_varlen(q, k, v, *args)
            ops.bwd_varlen(dout, q, k, v, out, lse, None, *args)
            torch.cuda.synchronize()
print("done")
"""


def test_op_offsets_that_go_back_neither_hang_nor_leave_the_tensors():
    """DF (the review of session 46's diff): a direct torch.ops caller's cu_seqlens that go back (the Python functions
    check or enforce the order; the ops read the offsets on the device only). The deterministic backward finds each
    sequence's dQ turn counters from its workspace rows, so two sequences over the same rows shared counters and a
    turn never came: a hang. The kernels clamp offsets to the tensors (SeqlenInfo) and the deterministic backward
    takes their running maximum. Here every call must finish (memcheck's time limit) without an access past a tensor
    or workspace (memcheck, caching allocator off); the values are garbage in, garbage out. The last offset list
    steps back after the scan's first chunk of 1024 entries (the 1500-sequence test below passes ordered offsets, which
    the scan returns unchanged with or without its carry)."""
    head_dims = [d for d in (64, 128, 256) if d in flash_attn_hopper.build_config()["head_dims"]]
    if not head_dims or torch.bfloat16 not in flash_attn_hopper.build_config()["dtypes"]:
        pytest.skip("no bf16 head_dim 64/128/256 kernels in this build (FAH_HDIMS/FAH_DTYPES)")
    from gpu_helpers import run_sanitizer

    run_sanitizer(_OFFSETS_SCRIPT.format(head_dims=head_dims), "memcheck")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_deterministic_varlen_over_more_sequences_than_one_ordering_chunk(head_dim):
    """DF's running maximum works in chunks of 1024 offsets: 1500 sequences (lengths 0-3 on either side, empty ones
    included) through attention_varlen with deterministic=True are right by the rule, and two backward passes are
    bitwise equal: an offset moved by the scan past its first chunk would put sequences on wrong rows. (Ordered
    offsets come back unchanged with or without the carry between chunks; the memcheck test above covers the carry.)"""
    from gpu_helpers import check_attention_varlen, cu_seqlens, randn, require_built

    dtype = torch.bfloat16
    require_built(head_dim, dtype)
    g = torch.Generator().manual_seed(head_dim)
    lq = torch.randint(0, 4, (1500,), generator=g).tolist()
    lk = torch.randint(0, 4, (1500,), generator=g).tolist()
    q, dout = (randn(sum(lq), 4, head_dim, dtype=dtype) for _ in range(2))
    k, v = (randn(sum(lk), 2, head_dim, dtype=dtype) for _ in range(2))
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, lse = flash_attn_hopper.attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), deterministic=True,
                                                  return_lse=True)
    runs = [torch.autograd.grad(out, leaves, dout, retain_graph=True) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b), "deterministic varlen backward differs between runs"
    check_attention_varlen(out.detach(), lse.detach(), runs[0], q, k, v, dout, cu_q, cu_k, "1500 sequences")
