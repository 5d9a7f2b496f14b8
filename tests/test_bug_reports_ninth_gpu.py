"""A ninth round of GPU tests modelled on bug reports filed against other attention kernels and the PyTorch machinery
around them, for kinds of fault the earlier rounds (tests/test_bug_reports_gpu.py ... _eighth_gpu.py) do not exercise:

- BL: the import creates no CUDA context, so a child forked after it can run the kernels (TransformerEngine issue 872,
  DeepSpeed PR 8078, quack PR 85);
- BM: nn.Module full backward hooks around the attention call (PyTorch issues 139191 and 57944, yolov5-gradcam 7);
- BN: torch.autograd.graph.allow_mutation_on_saved_tensors with the KV buffers or the returned out written in place
  before the backward (flash-linear-attention issue 73, PyTorch PR 79056);
- BO: the deterministic backward when whole key blocks are seen by no query (a left window far from them, a varlen
  sequence with keys and no queries): its semaphore chains must neither wait for blocks that never run nor leave the
  dK/dV of those keys unwritten (FBGEMM PR 4982, FlashAttention PR 1839, ROCm flash-attention PR 179);
- BP: an ExportedProgram holding the ops saved and loaded back (PyTorch PR 152029, FlashAttention issue 431);
- BQ: no warning in a training step (PyTorch PR 112773).

The CPU part (the same classes with the ops replaced by CPU stand-ins, bit for bit) is
tests/test_bug_reports_ninth_cpu.py. Every numeric result is checked by the rule of DESIGN.md §3 (float32 reference,
the same reference in the input dtype as the yardstick). Skipped, with the reason, without an sm90 GPU and the built
extension (conftest.py), and per test when the build lacks a head_dim / dtype (``built_dtype``)."""

import contextlib
import io
import os
import subprocess
import sys
import warnings

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref_grads
from attention_modules import Attention, AttentionVarlen
from gpu_helpers import attention_inputs, bits, built_dtype, check_attention, check_attention_varlen
from gpu_helpers import check_grads_where_required, cu_seqlens, randn

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_hopper.__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
GRAD_NAMES = ("dq", "dk", "dv")


def _leaves(*tensors, requires_grad=(True, True, True)):
    return [t.detach().clone().requires_grad_(r) for t, r in zip(tensors, requires_grad)]


def _run_script(script, *args, timeout):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
    try:
        r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                           env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the script ran past {timeout} s (a hang)\n{(e.stdout or b'')[-2000:]}\n{(e.stderr or b'')[-4000:]}")
    assert r.returncode == 0 and "done" in r.stdout, f"rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r.stdout


# ------------------------------------------------------------------------------------- BL: fork after the import

_FORK_SCRIPT = r"""
import os, sys, traceback
import torch
import flash_attn_hopper
import flash_attn_hopper.interface
from flash_attn_hopper import attention
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_ref_grads

assert not torch.cuda.is_initialized(), "torch.cuda was initialised by importing flash_attn_hopper"
dtype = getattr(torch, sys.argv[1])


def run(tag):
    g = torch.Generator(device="cpu").manual_seed(1)
    q, dout = (torch.randn(2, 203, 4, 64, generator=g).to("cuda", dtype) for _ in range(2))
    k, v = (torch.randn(2, 257, 2, 64, generator=g).to("cuda", dtype) for _ in range(2))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = attention(*leaves, causal=True, return_lse=True)
    grads = torch.autograd.grad(out, leaves, dout)
    ref, ref_lse = attention_ref(q, k, v, causal=True)
    naive, naive_lse = attention_ref(q, k, v, causal=True, upcast=False)
    assert_close_by_rule(out, ref, naive, tag + " out")
    assert_close_by_rule(lse, ref_lse, naive_lse, tag + " lse")
    ref_g = attention_ref_grads(q, k, v, dout, causal=True)
    naive_g = attention_ref_grads(q, k, v, dout, causal=True, upcast=False)
    for name, a, r, n in zip(("dq", "dk", "dv"), grads, ref_g, naive_g):
        assert_close_by_rule(a, r, n, tag + " " + name)


pid = os.fork()
if pid == 0:
    code = 0
    try:
        run("forked child")
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, f"the child forked after the import failed (status {status})"
run("parent")
print("done")
"""


def test_import_leaves_cuda_uninitialised_and_a_forked_child_runs():
    """NVIDIA/TransformerEngine#872 ("import transformer_engine initializes CUDA": launchers that fork then fail with
    "Cannot re-initialize CUDA in forked subprocess"), deepspeedai/DeepSpeed#8078 (a context made at import, some of it
    by torch.cuda.is_available(), which creates one without setting torch.cuda.is_initialized(): the flag alone is a
    false green) and Dao-AILab/quack#85 (a module-level device-capability query). In a fresh interpreter: import the
    library (loading its extension), assert torch.cuda is not initialised, fork; the child runs a causal GQA forward and
    backward (which it cannot if the parent's import had made a driver context: CUDA in a child forked after cuInit
    fails), out, LSE, dQ, dK, dV by the rule; then the parent does the same."""
    dtype = built_dtype(64)
    _run_script(_FORK_SCRIPT, str(dtype).split(".")[-1], timeout=100)


# ------------------------------------------------------------------------------- BM: module full backward hooks


class _Attention(torch.nn.Module):
    def __init__(self, return_lse=False, varlen=None):
        super().__init__()
        self.return_lse, self.varlen = return_lse, varlen

    def forward(self, q, k, v):
        if self.varlen is not None:
            return attention_varlen(q, k, v, *self.varlen, causal=True, return_lse=self.return_lse)
        return attention(q, k, v, causal=True, return_lse=self.return_lse)


@pytest.mark.parametrize("case", ["out_and_lse", "q_frozen", "pre_hook_scales", "varlen"])
def test_module_full_backward_hooks(case):
    """pytorch/pytorch#139191 (register_full_backward_hook and register_forward_hook on nn.MultiheadAttention: wrong
    gradients), pytorch/pytorch#57944 (a full backward hook crashed when the module's first input did not require
    grad) and pooya-mohammadi/yolov5-gradcam#7 (the hook's BackwardHookFunction hands the module views of its inputs and
    outputs). An nn.Module around the library, GQA 4/2, causal, with a forward hook and a full backward hook:
    - "out_and_lse": the module returns (out, lse), the loss uses both;
    - "q_frozen": q does not require grad (its grad_input entry None or zeros, as PyTorch gives for q * k + v);
    - "pre_hook_scales": a full backward pre-hook doubles grad_output (the kernels must take the doubled dO);
    - "varlen": attention_varlen (sequences of 0, 113 and 90 rows).
    out, LSE and the leaves' gradients by the rule; the hook's grad_input bitwise the leaves' gradients."""
    dtype = built_dtype(128)
    q, k, v, dout = attention_inputs(2, 203, 203, 4, 2, 128, dtype)
    dlse = randn(2, 4, 203, dtype=torch.float32) if case == "out_and_lse" else None
    varlen = None
    if case == "varlen":
        q, k, v, dout = q[0], k[0], v[0], dout[0]
        cu = cu_seqlens([0, 113, 90])
        varlen = (cu, cu, 113, 113)
    module = _Attention(return_lse=True, varlen=varlen)
    seen = {}
    module.register_forward_hook(lambda m, args, output: seen.update(forward=True))  # returns None: output kept
    module.register_full_backward_hook(lambda m, grad_in, grad_out: seen.update(grad_in=grad_in, grad_out=grad_out))
    scale = 1
    if case == "pre_hook_scales":
        scale = 2
        module.register_full_backward_pre_hook(lambda m, grad_out: tuple(None if g is None else 2 * g for g in grad_out))
    which = "kv" if case == "q_frozen" else "qkv"
    leaves = _leaves(q, k, v, requires_grad=[name in which for name in "qkv"])
    out, lse = module(*leaves)
    torch.autograd.backward([out, lse] if dlse is not None else [out], [dout, dlse] if dlse is not None else [dout])
    assert seen.get("forward"), "the forward hook did not run"
    grads = [leaf.grad for leaf in leaves]
    if case == "varlen":
        check_attention_varlen(out.detach(), lse.detach(), grads, q, k, v, scale * dout, cu, cu, case, causal=True)
    elif case == "q_frozen":
        ref = attention_ref_grads(q, k, v, dout, causal=True)
        naive = attention_ref_grads(q, k, v, dout, causal=True, upcast=False)
        check_grads_where_required(dict(zip("qkv", leaves)), which, ref, naive, dtype, case)
    else:
        check_attention(out.detach(), lse.detach(), grads, q, k, v, scale * dout, case, dlse=dlse, causal=True)
    grad_in = list(seen["grad_in"])
    if case == "q_frozen":
        assert grad_in[0] is None or torch.equal(grad_in[0], torch.zeros_like(q)), f"{case}: grad_input[0]"
        grad_in[0] = None
    for name, g, leaf_grad in zip(GRAD_NAMES, grad_in, grads):
        assert (g is None) == (leaf_grad is None), f"{case}: the hook's {name}"
        assert g is None or torch.equal(bits(g), bits(leaf_grad)), f"{case}: the hook's {name} is not the leaf's"
    assert torch.equal(bits(seen["grad_out"][0]), bits(scale * dout)), f"{case}: the hook's grad_output"


# ------------------------------------------------------------------------------ BN: mutation on saved tensors


@pytest.mark.parametrize("case", ["kv_cache", "out"])
def test_allow_mutation_on_saved_tensors(case):
    """fla-org/flash-linear-attention#73 (a KV cache written in place between an attention layer's forward and its
    backward: "one of the variables needed for gradient computation has been modified by an inplace operation") and
    pytorch/pytorch#79056 (torch.autograd.graph.allow_mutation_on_saved_tensors: saved tensors cloned before they are
    mutated, so the backward sees the forward's values). Inside the context, GQA 4/2 causal:
    - "kv_cache": k and v are views of two cache buffers of 300 rows; after the forward both buffers are rewritten;
    - "out": the returned out is scaled by 0.5 in place (the kernels' D = rowsum(dO ∘ O) must use the saved,
      unscaled out);
    dQ (and dK, dV) by the rule against the reference of the forward's values. Outside the context the same writes
    raise autograd's version error (class H)."""
    dtype = built_dtype(128)
    q, k, v, dout = attention_inputs(2, 203, 257, 4, 2, 128, dtype)
    for allowed in (True, False):
        x, kl, vl = _leaves(q, k, v)
        k_cache, v_cache = (torch.cat([t, randn(2, 43, 2, 128, dtype=dtype)], 1) for t in (k, v))
        ctx = torch.autograd.graph.allow_mutation_on_saved_tensors() if allowed else contextlib.nullcontext()
        try:
            with ctx:
                if case == "kv_cache":
                    leaves, scale = [x], 1.0
                    out = attention(x, k_cache[:, :257], v_cache[:, :257], causal=True)
                    k_cache.copy_(torch.flip(k_cache, [1]))
                    v_cache[:, :257].mul_(3)
                else:
                    leaves, scale = [x, kl, vl], 0.5
                    out = attention(x, kl, vl, causal=True)
                    out.mul_(0.5)
                grads = torch.autograd.grad(out, leaves, dout)
        except RuntimeError as e:
            assert not allowed and "modified by an inplace operation" in str(e), f"{case} allowed={allowed}: {e}"
            continue
        assert allowed, f"{case}: the in-place write outside the context went unnoticed"
        ref = attention_ref_grads(q, k, v, scale * dout, causal=True)
        naive = attention_ref_grads(q, k, v, scale * dout, causal=True, upcast=False)
        for name, g, r, n in zip(GRAD_NAMES, grads, ref, naive):
            assert_close_by_rule(g, r, n, f"{case} {name}")


# --------------------------------------------------- BO: deterministic backward, key blocks that no query sees

_DETERMINISTIC_SCRIPT = r"""
import sys
import torch
from flash_attn_hopper import attention, attention_varlen
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref_grads, attention_varlen_ref_grads
from gpu_helpers import poison_allocator

dtype = getattr(torch, sys.argv[1])
g = torch.Generator(device="cpu").manual_seed(2)


def randn(*shape):
    return torch.randn(*shape, generator=g).to("cuda", dtype)


def grads_twice(call, q, k, v, dout):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = call(*leaves)
    runs = []
    for _ in range(2):
        poison_allocator(q.numel() * 2, k.numel() * 2, v.numel() * 2, q.numel() * 8, k.numel() * 8)  # NaN bytes
        runs.append(torch.autograd.grad(out, leaves, dout, retain_graph=True))
        torch.cuda.synchronize()
    for name, a, b in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), f"{name} differs between two deterministic backward passes"
    return runs[0]


def check(tag, grads, ref, naive, unseen_keys):
    for name, a, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
        assert_close_by_rule(a, r, n, f"{tag} {name}")
    for name, a in zip(("dk", "dv"), grads[1:]):
        rows = a[unseen_keys]
        assert torch.equal(rows, torch.zeros_like(rows)), f"{tag}: {name} of keys no query sees is not exactly 0"


# dense: keys 0 .. 1000 - 130 - 40 - 1 = 829 are seen by no query (key blocks 0-5 wholly), MHA / GQA / MQA
for nheads_k in (4, 2, 1):
    q, dout = randn(2, 130, 4, 128), randn(2, 130, 4, 128)
    k, v = randn(2, 1000, nheads_k, 128), randn(2, 1000, nheads_k, 128)
    opts = dict(causal=True, window_size=(40, 0))
    grads = grads_twice(lambda q, k, v: attention(q, k, v, deterministic=True, **opts), q, k, v, dout)
    unseen = (slice(None), slice(0, 1000 - 130 - 40))
    check(f"dense nheads_k {nheads_k}", grads, attention_ref_grads(q, k, v, dout, **opts),
          attention_ref_grads(q, k, v, dout, upcast=False, **opts), unseen)

# dense, a two-sided window: keys 0 .. 700 - 10 - 1 = 689 unseen; GQA
q, dout = randn(1, 200, 4, 128), randn(1, 200, 4, 128)
k, v = randn(1, 900, 2, 128), randn(1, 900, 2, 128)
opts = dict(window_size=(10, 60))
grads = grads_twice(lambda q, k, v: attention(q, k, v, deterministic=True, **opts), q, k, v, dout)
check("dense window (10, 60)", grads, attention_ref_grads(q, k, v, dout, **opts),
      attention_ref_grads(q, k, v, dout, upcast=False, **opts), (slice(None), slice(0, 900 - 200 - 10)))

# varlen, GQA: 5 queries against 900 keys, no queries against 600 keys, 130 queries against 700 keys
lq, lk = [5, 0, 130], [900, 600, 700]
cu_q = torch.tensor([0, 5, 5, 135], dtype=torch.int32, device="cuda")
cu_k = torch.tensor([0, 900, 1500, 2200], dtype=torch.int32, device="cuda")
q, dout = randn(135, 4, 128), randn(135, 4, 128)
k, v = randn(2200, 2, 128), randn(2200, 2, 128)
opts = dict(causal=True, window_size=(30, 0))
grads = grads_twice(lambda q, k, v: attention_varlen(q, k, v, cu_q, cu_k, 130, 900, deterministic=True, **opts),
                    q, k, v, dout)
unseen = torch.zeros(2200, dtype=torch.bool, device="cuda")
unseen[:900 - 5 - 30] = True
unseen[900:1500] = True
unseen[1500:1500 + 700 - 130 - 30] = True
check("varlen", grads, attention_varlen_ref_grads(q, k, v, dout, cu_q, cu_k, **opts),
      attention_varlen_ref_grads(q, k, v, dout, cu_q, cu_k, upcast=False, **opts), unseen)
print("done")
"""


def test_deterministic_backward_with_key_blocks_no_query_sees():
    """pytorch/FBGEMM#4982 (deterministic backward with a left window: a key block outside every query's window never
    took its turn, and the blocks after it waited for it forever), Dao-AILab/flash-attention#1839 (deterministic GQA
    backward deadlocked on dK/dV semaphores) and ROCm/flash-attention#179 (dK/dV of key blocks whose query loop is
    empty written from uninitialised accumulators: NaN). Here the deterministic backward orders dQ sums by key block and
    GQA dK/dV sums by head with semaphores (csrc/flash/common/semaphore.hpp). Key blocks that no query sees: seqlen_q 130
    against seqlen_k 1000, causal with window (40, 0), MHA / GQA / MQA (key blocks 0-5 unseen); a two-sided window (10,
    60), 200 x 900; attention_varlen with a sequence of 5 queries against 900 keys, one of 0 queries against 600 keys,
    one of 130 against 700, causal window (30, 0). In a subprocess with a time limit (a deadlock fails instead of hanging
    the session): two backward passes (NaN-poisoned allocator before each) bitwise equal, dQ, dK, dV by the rule, and
    the dK, dV rows of the unseen keys exactly 0."""
    dtype = built_dtype(128)
    _run_script(_DETERMINISTIC_SCRIPT, str(dtype).split(".")[-1], timeout=100)


# ------------------------------------------------------------------------ BP: saved and loaded ExportedProgram


@pytest.mark.parametrize("case", ["dense", "documents", "varlen"])
def test_exported_program_saved_and_loaded(case):
    """pytorch/pytorch#152029 (issue 151746: a custom op in a saved ExportedProgram could not be resolved at load) and
    Dao-AILab/flash-attention#431 (a module calling flash attention could not be saved and loaded). torch.export (non
    strict), torch.export.save to a buffer, torch.export.load: the loaded program holds the op once and gives the
    eager module's out and LSE bit for bit at the export inputs and at others: dense causal softcap with dynamic
    seqlen_q / seqlen_k (300 x 400, then 77 x 1025), packed documents (new ids), attention_varlen with a window (new
    cu_seqlens of the same shape)."""
    from torch.export import Dim, export

    dtype = built_dtype(64)
    dynamic = None
    if case == "dense":
        module, op = Attention(causal=True, softcap=20.0, return_lse=True), torch.ops.flash_attn_hopper.fwd.default
        sq, sk = Dim("seqlen_q", min=2, max=4096), Dim("seqlen_k", min=2, max=4096)
        dynamic = ({1: sq}, {1: sk}, {1: sk})
        runs = [attention_inputs(2, sq_, sk_, 4, 2, 64, dtype)[:3] for sq_, sk_ in ((300, 400), (77, 1025))]
    elif case == "documents":
        module, op = Attention(causal=True, return_lse=True), torch.ops.flash_attn_hopper.fwd.default
        q, k, v, _ = attention_inputs(2, 500, 500, 4, 2, 64, dtype)
        runs = [(q, k, v, torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)).expand(2, 500).cuda())
                for n in ([100, 1, 250, 149], [400, 100])]
    else:
        module, op = AttentionVarlen(301, 301, window_size=(64, 16), return_lse=True), torch.ops.flash_attn_hopper.fwd_varlen.default
        q, k, v, _ = attention_inputs(1, 458, 458, 4, 2, 64, dtype)
        runs = [(q[0], k[0], v[0], cu_seqlens(lq), cu_seqlens(lk))
                for lq, lk in (([100, 0, 301, 57], [130, 40, 285, 3]), ([300, 58, 50, 50], [1, 300, 155, 2]))]
    program = export(module, runs[0], dynamic_shapes=dynamic, strict=False)
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    targets = [n.target for n in loaded.graph.nodes if n.op == "call_function"]
    assert targets.count(op) == 1, f"the loaded program does not hold {op} once: {targets}"
    for i, args in enumerate(runs):
        (got_out, got_lse), (out, lse) = loaded.module()(*args), module(*args)
        assert torch.equal(bits(got_out), bits(out)), f"{case} run {i}: out differs from eager"
        assert torch.equal(bits(got_lse), bits(lse)), f"{case} run {i}: LSE differs from eager"


# ------------------------------------------------------------------------------------ BQ: no warnings per step


def test_training_step_emits_no_warning():
    """pytorch/pytorch#112773 (attention kernels warned on every call, "these logs can get pretty spammy", until made to
    warn once) and kijai/ComfyUI-WanVideoWrapper#36 (a per-call UserWarning from an attention wrapper): test suites and
    training scripts run with warnings as errors. With every warning an error, twice each (the second call takes the
    cached checks): a dense GQA causal forward and backward with a loss through out and LSE, deterministic; the same
    under torch.use_deterministic_algorithms; packed documents; attention_varlen forward and backward with rows past the
    last sequence. Results by the rule (the last pass)."""
    dtype = built_dtype(64)
    q, k, v, dout = attention_inputs(2, 150, 150, 4, 2, 64, dtype)
    dlse = randn(2, 4, 150, dtype=torch.float32)
    ids = torch.repeat_interleave(torch.arange(2), torch.tensor([60, 90])).expand(2, 150).cuda()
    cu = cu_seqlens([70, 50])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            leaves = _leaves(q, k, v)
            out, lse = attention(*leaves, causal=True, return_lse=True, deterministic=True)
            grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
            doc_out = attention(q, k, v, causal=True, document_ids=ids)
            vleaves = _leaves(q[0], k[0], v[0])
            vout, vlse = attention_varlen(*vleaves, cu, cu, 70, 70, causal=True, return_lse=True)
            vgrads = torch.autograd.grad(vout, vleaves, dout[0])
            torch.use_deterministic_algorithms(True)
            try:
                mode_grads = torch.autograd.grad(attention(*leaves, causal=True), leaves, dout)
            finally:
                torch.use_deterministic_algorithms(False)
            torch.cuda.synchronize()
    check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, "dense", dlse=dlse, causal=True)
    ref = attention_ref_grads(q, k, v, dout, causal=True)
    naive = attention_ref_grads(q, k, v, dout, causal=True, upcast=False)
    for name, g, r, n in zip(GRAD_NAMES, mode_grads, ref, naive):
        assert_close_by_rule(g, r, n, f"deterministic mode {name}")
    from flash_attn_hopper.testing import attention_ref

    doc_ref, _ = attention_ref(q, k, v, causal=True, document_ids=ids)
    doc_naive, _ = attention_ref(q, k, v, causal=True, document_ids=ids, upcast=False)
    assert_close_by_rule(doc_out, doc_ref, doc_naive, "documents out")
    check_attention_varlen(vout.detach(), vlse.detach(), vgrads, q[0], k[0], v[0], dout[0], cu, cu, "varlen",
                           causal=True)
