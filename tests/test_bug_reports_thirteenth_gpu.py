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
