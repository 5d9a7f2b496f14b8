"""Seventeenth round of the bug hunt (tests/bug_report_sources.md, "Seventeenth round"), GPU part.

DS: under `python -O` (assert statements stripped) the rule of DESIGN.md §3 as the GPU tests apply it
(flash_attn_hopper.testing.assert_close_by_rule through tests/gpu_helpers.check_attention) still accepts the kernels'
right answer and refuses it once corrupted (before the fix both helpers were bare asserts, which -O removes).
DV: softmax_scale and softcap computed from symbolic sizes under torch.compile(dynamic=True) with inductor: the real
ops get them, and the compiled call equals the eager one bit for bit (deterministic backward) for two lengths.
DW: a module calling the ops, scripted, saved and loaded, equals ``attention`` on the GPU.
DX: torch.set_default_dtype(torch.float64) changes no bit or dtype of the dense (packed documents) and varlen (rows
past the last sequence) forward and deterministic backward; results right by the rule.
DZ: an integer numpy max_seqlen under torch.compile(fullgraph=True): the compiled attention_varlen equals eager.

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build lacks
the head_dim / dtype."""

import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

import flash_attn_hopper
from gpu_helpers import ambient_defaults, built_dtype, check_attention_varlen, cu_seqlens, randn

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEAD_DIM = 128


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


# ------------------------------------------------------------------------------------------------------ DS

_OPTIMIZED_SCRIPT = r"""
import sys
import torch
import flash_attn_hopper
from gpu_helpers import check_attention, randn

assert sys.flags.optimize == 1
dtype = getattr(torch, sys.argv[1])
torch.manual_seed(0)
q, k, v, dout = (randn(2, 203, 4, 128, dtype=dtype) for _ in range(4))
leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
out, lse = flash_attn_hopper.attention(*leaves, causal=True, return_lse=True)
grads = torch.autograd.grad(out, leaves, dout)
check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, "right", causal=True)
print("right answer accepted")
bad = out.detach().clone()
bad[1, 100, 2, 5] += 0.25 * bad.abs().max()
try:
    check_attention(bad, lse.detach(), grads, q, k, v, dout, "corrupted", causal=True)
    print("CORRUPTED ACCEPTED")
except AssertionError as e:
    print("corrupted refused", e)
"""


def test_rule_checks_hold_under_python_optimize():
    """DS: python -O, a causal fp16 / bf16 forward and backward on the GPU: check_attention accepts the kernels'
    results and refuses them with one output element moved by a quarter of the largest |out|."""
    dtype = built_dtype(HEAD_DIM)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTHONOPTIMIZE", None)
    r = subprocess.run([sys.executable, "-O", "-c", _OPTIMIZED_SCRIPT, str(dtype).split(".")[-1]], capture_output=True,
                       text=True, env=env, timeout=140, cwd=str(ROOT / "tests"))
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "right answer accepted" in r.stdout and "corrupted refused corrupted out" in r.stdout, r.stdout


# ------------------------------------------------------------------------------------------------------ DV

def test_scale_and_softcap_from_symbolic_sizes_under_dynamic_compile():
    """DV: inductor, dynamic=True, fullgraph: softmax_scale = head_dim ** -0.5 and softcap = head_dim / 4 from q's
    symbolic shape; out and dq bitwise the eager call's (deterministic backward) at seqlen 203 and 1023."""
    dtype = built_dtype(HEAD_DIM)

    def f(q, k, v):
        return flash_attn_hopper.attention(q, k, v, softmax_scale=q.shape[-1] ** -0.5, softcap=q.shape[-1] / 4,
                                           causal=True, deterministic=True)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for seqlen in (203, 1023):
        torch.manual_seed(seqlen)
        q, k, v = randn(2, seqlen, 8, HEAD_DIM, dtype=dtype), *(randn(2, seqlen, 2, HEAD_DIM, dtype=dtype) for _ in range(2))
        dout = randn(2, seqlen, 8, HEAD_DIM, dtype=dtype)
        results = []
        for fn in (f, compiled):
            leaves = _leaves(q, k, v)
            out = fn(*leaves)
            results.append((out.detach(), *torch.autograd.grad(out, leaves, dout)))
        for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
            assert torch.equal(a, b), f"seqlen {seqlen} {name}: compiled != eager"


# ------------------------------------------------------------------------------------------------------ DW

class _ScriptedAttention(torch.nn.Module):
    def forward(self, q, k, v):
        out, lse = torch.ops.flash_attn_hopper.fwd(q, k, v, 0.125, True, -1, 0, 0.0, False, None)
        return out, lse


def test_ops_script_save_and_load(tmp_path):
    """DW: torch.jit.script of a module calling the forward op, saved and loaded: out and LSE bitwise attention's."""
    dtype = built_dtype(HEAD_DIM)
    q, k, v = randn(2, 203, 4, HEAD_DIM, dtype=dtype), randn(2, 300, 2, HEAD_DIM, dtype=dtype), randn(
        2, 300, 2, HEAD_DIM, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (torch.jit.script is deprecated)
        scripted = torch.jit.script(_ScriptedAttention())
        scripted.save(str(tmp_path / "attention.pt"))
        loaded = torch.jit.load(str(tmp_path / "attention.pt"))
    out, lse = loaded(q, k, v)
    ref_out, ref_lse = flash_attn_hopper.attention(q, k, v, softmax_scale=0.125, causal=True, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


# ------------------------------------------------------------------------------------------------------ DX

@pytest.mark.parametrize("api", ["dense_documents", "varlen"])
def test_results_do_not_depend_on_the_default_dtype(api):
    """DX: the same calls under the float32 and the float64 default dtype: out, LSE, dQ, dK, dV bitwise equal with
    their dtypes (q's, float32 LSE), the float32-default results right by the rule."""
    dtype = built_dtype(HEAD_DIM)
    torch.manual_seed(0)
    if api == "dense_documents":
        q, dout = randn(2, 203, 4, HEAD_DIM, dtype=dtype), randn(2, 203, 4, HEAD_DIM, dtype=dtype)
        k, v = randn(2, 203, 2, HEAD_DIM, dtype=dtype), randn(2, 203, 2, HEAD_DIM, dtype=dtype)
        ids = torch.tensor([[0] * 70 + [1] * 133, [5] * 203], device="cuda")
        opts = dict(causal=True, deterministic=True)

        def call(*leaves):
            return flash_attn_hopper.attention(*leaves, return_lse=True, document_ids=ids, **opts)
    else:
        lengths_q, lengths_k = [70, 0, 133], [90, 40, 133]
        q, dout = randn(sum(lengths_q) + 5, 4, HEAD_DIM, dtype=dtype), randn(sum(lengths_q) + 5, 4, HEAD_DIM, dtype=dtype)
        k, v = randn(sum(lengths_k), 2, HEAD_DIM, dtype=dtype), randn(sum(lengths_k), 2, HEAD_DIM, dtype=dtype)
        cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
        opts = dict(causal=True, deterministic=True)

        def call(*leaves):
            return flash_attn_hopper.attention_varlen(*leaves, cu_q, cu_k, 133, 133, return_lse=True, **opts)

    def run():
        leaves = _leaves(q, k, v)
        out, lse = call(*leaves)
        grads = torch.autograd.grad((out, lse), leaves, (dout, torch.zeros_like(lse)))
        return out.detach(), lse.detach(), *grads

    expected = run()
    with ambient_defaults(dtype=torch.float64):
        got = run()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), expected, got):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{api} {name}: {b.dtype}, not bitwise the float32 default's"
    assert got[1].dtype == torch.float32 and got[0].dtype == dtype
    if api == "dense_documents":
        from flash_attn_hopper.testing import assert_close_by_rule, attention_ref
        # the rule per document: each run of ids alone (self-attention within a document is attention over it)
        for b, bounds in ((0, [(0, 70), (70, 203)]), (1, [(0, 203)])):
            for s, e in bounds:
                view = [t[b:b + 1, s:e] for t in (q, k, v)]
                ref, _ = attention_ref(*view, upcast=True, causal=True)
                naive, _ = attention_ref(*view, upcast=False, causal=True)
                assert_close_by_rule(expected[0][b:b + 1, s:e], ref, naive, f"document {b} [{s}, {e})")
    else:
        check_attention_varlen(expected[0], expected[1], expected[2:], q, k, v, dout, cu_q, cu_k, "varlen", **{
            k_: v_ for k_, v_ in opts.items() if k_ != "deterministic"})


# ------------------------------------------------------------------------------------------------------ DZ

def test_integer_numpy_max_seqlen_under_compile():
    """DZ: np.int64 max_seqlen (eager takes it) under torch.compile(fullgraph=True): out bitwise eager's for two
    maxima; eager's out right by the rule."""
    np = pytest.importorskip("numpy")
    dtype = built_dtype(HEAD_DIM)
    lengths = [70, 0, 133, 1]
    q, dout = randn(sum(lengths), 4, HEAD_DIM, dtype=dtype), randn(sum(lengths), 4, HEAD_DIM, dtype=dtype)
    k, v = randn(sum(lengths), 2, HEAD_DIM, dtype=dtype), randn(sum(lengths), 2, HEAD_DIM, dtype=dtype)
    cu = cu_seqlens(lengths)

    def f(q, k, v, cu, max_seqlen):
        return flash_attn_hopper.attention_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True)

    compiled = torch.compile(f, fullgraph=True)
    for max_seqlen in (np.int64(133), np.int32(200)):
        eager = f(q, k, v, cu, max_seqlen)
        assert torch.equal(compiled(q, k, v, cu, max_seqlen), eager), repr(max_seqlen)
    leaves = _leaves(q, k, v)
    out, lse = flash_attn_hopper.attention_varlen(*leaves, cu, cu, np.int64(133), np.int64(133), causal=True,
                                                  return_lse=True)
    grads = torch.autograd.grad(out, leaves, dout)
    check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, dout, cu, cu, "numpy max_seqlen", causal=True)
