"""The CPU part of the ninth round of bug-report tests (classes BL-BP of tests/bug_report_sources.md; the GPU part is
tests/test_bug_reports_ninth_gpu.py): what the Python layer and the C++ autograd node of the ops do under PyTorch
machinery that other attention libraries were reported to break under:

- BL: importing the library (and its transformers integration) must not query or initialise CUDA (a process that has
  made a CUDA context cannot fork workers that use CUDA);
- BM: nn.Module full backward hooks (BackwardHookFunction wraps the module's inputs and outputs in views);
- BN: torch.autograd.graph.allow_mutation_on_saved_tensors, a KV buffer or the saved q / out changed in place between
  the forward and the backward;
- BO: (GPU only: the deterministic backward's semaphores);
- BP: an ExportedProgram holding the ops saved with torch.export.save and loaded back (in this process and in a fresh
  one);
- BQ: no warning from a training step (a test suite or a training script run with warnings as errors).

No GPU is needed: the device checks are replaced by no-ops and the ops get the CPU kernels of tests/cpu_stand_ins.py
(the forwards: the float32 references rounded to the input dtype; the backwards: DESIGN.md §1 with P recomputed from
the SAVED LSE and D from the SAVED out, as the kernels do, so a node handed the wrong saved tensors gives other
gradients). Results are compared bit for bit with the stand-ins run directly on
the values they should have been given."""

import contextlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper import attention, attention_varlen
from attention_modules import Attention, AttentionVarlen
from cpu_stand_ins import CALLS, bwd_stand_in, bwd_varlen_stand_in, fwd_stand_in, fwd_varlen_stand_in, stand_ins
from test_compile_gpu import compiled_cold_then_cached, op_graphs

requires_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install transformers): integration not tested",
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_hopper.__file__)))


@pytest.fixture
def cpu_ops(monkeypatch):
    """The ops run on the CPU (tests/cpu_stand_ins.py), forward and backward through the extension's C++ autograd
    node; device checks pass; no call in the checked-call cache."""
    with stand_ins(monkeypatch):
        yield


def _varlen_maxima():
    """(op, max_seqlen_q, max_seqlen_k) of every varlen stand-in call since CALLS was emptied."""
    return [(op, max_q, max_k) for op, _, max_q, max_k in CALLS if op.endswith("varlen")]


def _randn(*shape):
    return torch.randn(*shape).half()


def _direct(q, k, v, dout, dlse=None, scale=64**-0.5, causal=True, window=(-1, 0)):
    """(out, lse, dq, dk, dv) of the stand-ins called directly on these values."""
    out, lse = fwd_stand_in(q, k, v, scale, causal, *window, 0.0, False)
    return (out, lse, *bwd_stand_in(dout, q, k, v, out, lse, dlse, scale, causal, *window, 0.0, False))


def _assert_bitwise(got, want, names, what):
    for name, g, w in zip(names, got, want):
        if w is None:
            assert g is None, f"{what}: {name} should be None"
            continue
        assert g is not None and g.shape == w.shape and g.dtype == w.dtype, f"{what}: {name} shape/dtype"
        assert torch.equal(g, w), f"{what}: {name} differs (max {(g.float() - w.float()).abs().max():.3e})"


# ---------------------------------------------------------------------------------------- BL: fork-safe import

_IMPORT_SCRIPT = r"""
import sys
import torch
if sys.argv[1] == "transformers":
    import transformers, transformers.masking_utils  # their own import is theirs to answer for: before the trap

def refuse(name):
    def f(*args, **kwargs):
        raise AssertionError(f"CUDA queried while importing flash_attn_hopper: {name}")
    return f

for name in ("_lazy_init", "init", "is_available", "device_count", "current_device", "get_device_capability",
             "get_device_properties", "get_device_name", "synchronize", "current_stream", "set_device",
             "is_current_stream_capturing", "mem_get_info"):
    setattr(torch.cuda, name, refuse("torch.cuda." + name))
for name in ("_cuda_init", "_cuda_getDeviceCount", "_cuda_getDevice", "_cuda_getCurrentStream"):
    if hasattr(torch._C, name):
        setattr(torch._C, name, refuse("torch._C." + name))
import flash_attn_hopper
import flash_attn_hopper.interface
import flash_attn_hopper.testing
if sys.argv[1] == "transformers":
    import flash_attn_hopper.integrations.transformers
assert not torch.cuda.is_initialized(), "torch.cuda initialised by the import"
print("imported", flash_attn_hopper.EXTENSION_LOADED)
"""


@pytest.mark.parametrize("what", ["library", pytest.param("transformers", marks=requires_transformers)])
def test_import_makes_no_cuda_query(what):
    """NVIDIA/TransformerEngine#872 ("import transformer_engine initializes CUDA": custom subprocess launchers then fail
    with "Cannot re-initialize CUDA in forked subprocess"), deepspeedai/DeepSpeed#8078 (import-time
    torch.cuda.is_available() / get_device_properties / get_device_capability each created a context; is_available
    does so without setting torch.cuda.is_initialized(), so checking that flag alone is a false green) and
    Dao-AILab/quack#85 (a device-capability query at module level). In a fresh interpreter, every torch.cuda entry
    point that queries or initialises the driver is replaced by one that raises, then flash_attn_hopper, its interface
    and testing modules (and the transformers integration) are imported: none may be called. (The GPU part runs the
    library in a child forked after the import.)"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _IMPORT_SCRIPT, what], capture_output=True, text=True, timeout=300,
                       env=env, cwd=ROOT)
    assert r.returncode == 0 and "imported" in r.stdout, f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


# ------------------------------------------------------------------------------------ BM: module backward hooks


class _Attention(torch.nn.Module):
    def __init__(self, return_lse=False, varlen=None):
        super().__init__()
        self.return_lse, self.varlen = return_lse, varlen

    def forward(self, q, k, v):
        if self.varlen is not None:
            cu_q, cu_k, max_q, max_k = self.varlen
            return attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
        return attention(q, k, v, causal=True, return_lse=self.return_lse)


@pytest.mark.parametrize("case", ["out", "out_and_lse", "q_frozen", "pre_hook_scales", "varlen"])
def test_module_full_backward_hooks(cpu_ops, case):
    """pytorch/pytorch#139191 (full backward and forward hooks on nn.MultiheadAttention: a wrong branch and wrong
    gradients), pytorch/pytorch#57944 (register_full_backward_hook crashed when the module's first input did not require
    grad) and pooya-mohammadi/yolov5-gradcam#7 (BackwardHookFunction hands the module views of its inputs and
    outputs: "Output 0 of BackwardHookFunctionBackward is a view"). Grad-CAM style tools and optimizers such as SINGD
    hook attention modules so. An nn.Module calling the library, with register_full_backward_hook (and a forward hook),
    GQA 4/2, causal: the leaves' gradients and the hook's grad_input must be the backward of the saved tensors bit for
    bit, grad_output the loss's; returning (out, lse) with a loss through both; q not requiring grad (grad_input[0]
    None); a full backward PRE-hook doubling grad_output (the op must take the doubled dO); attention_varlen."""
    q, k, v = _randn(2, 70, 4, 64), _randn(2, 70, 2, 64), _randn(2, 70, 2, 64)
    dout, dlse = _randn(2, 70, 4, 64), torch.randn(2, 4, 70)
    varlen = None
    if case == "varlen":
        q, k, v, dout = q[0], k[0], v[0], dout[0]
        cu = torch.tensor([0, 25, 70], dtype=torch.int32)
        varlen = (cu, cu, 45, 45)
    module = _Attention(return_lse=case == "out_and_lse", varlen=varlen)
    seen = {}
    module.register_forward_hook(lambda m, args, output: seen.update(forward=True))  # returns None: output kept
    module.register_full_backward_hook(lambda m, grad_in, grad_out: seen.update(grad_in=grad_in, grad_out=grad_out))
    if case == "pre_hook_scales":
        module.register_full_backward_pre_hook(lambda m, grad_out: tuple(2 * g for g in grad_out))
    leaves = [t.detach().clone().requires_grad_(not (case == "q_frozen" and i == 0)) for i, t in enumerate((q, k, v))]
    result = module(*leaves)
    if case == "out_and_lse":
        out, lse = result
        torch.autograd.backward([out, lse], [dout, dlse])
    else:
        torch.autograd.backward([result], [dout])
    assert seen.get("forward"), "the forward hook did not run"
    scale = 2 if case == "pre_hook_scales" else 1
    if case == "varlen":
        out, lse = fwd_varlen_stand_in(q, k, v, cu, cu, 45, 45, 64**-0.5, True, -1, 0, 0.0, False)
        want = bwd_varlen_stand_in(scale * dout, q, k, v, out, lse, None, cu, cu, 45, 45, 64**-0.5, True, -1, 0,
                                    0.0, False)
    else:
        want = _direct(q, k, v, scale * dout, dlse if case == "out_and_lse" else None)[2:]
    if case == "q_frozen":
        want = (None, *want[1:])
    _assert_bitwise([leaf.grad for leaf in leaves], want, ("dq", "dk", "dv"), f"{case}: leaf gradients")
    grad_in = list(seen["grad_in"])
    if case == "q_frozen":
        # PyTorch's own choice for an input that does not require grad (as for q * k + v): None or zeros
        assert grad_in[0] is None or torch.equal(grad_in[0], torch.zeros_like(q)), "q_frozen: grad_input[0]"
        grad_in[0] = None
    _assert_bitwise(grad_in, want, ("dq", "dk", "dv"), f"{case}: the hook's grad_input")
    assert torch.equal(seen["grad_out"][0], scale * dout), f"{case}: the hook's grad_output is not the loss's dO"


# ---------------------------------------------------------------------------- BN: mutation on saved tensors


@pytest.mark.parametrize("case", ["kv_cache", "q_projection", "out"])
def test_allow_mutation_on_saved_tensors(cpu_ops, case):
    """fla-org/flash-linear-attention#73 (a KV cache updated in place between the forward and the backward of an
    attention layer: "one of the variables needed for gradient computation has been modified by an inplace operation")
    and pytorch/pytorch#79056 (torch.autograd.graph.allow_mutation_on_saved_tensors, the context under which such a
    write is allowed: a saved tensor is cloned before it is mutated, so the backward sees the forward's values).
    The op's saved tensors (q, k, v, out, LSE) must take part: in the context, after
    - "kv_cache": k and v views of two cache buffers, both buffers rewritten in place,
    - "q_projection": q a non-leaf (x * 2) changed in place,
    - "out": the returned out scaled in place (its saved copy feeds D = rowsum(dO ∘ O)),
    the gradients are the stand-in backward of the forward's values, bit for bit. Outside the context the same writes
    must raise autograd's version error (class H), never give other gradients."""
    q, k, v, dout = _randn(2, 50, 4, 64), _randn(2, 50, 2, 64), _randn(2, 50, 2, 64), _randn(2, 50, 4, 64)
    for allowed in (True, False):
        x, kl, vl = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        k_cache, v_cache = torch.cat([k, _randn(2, 30, 2, 64)], 1), torch.cat([v, _randn(2, 30, 2, 64)], 1)
        ctx = torch.autograd.graph.allow_mutation_on_saved_tensors() if allowed else contextlib.nullcontext()
        try:
            with ctx:
                if case == "kv_cache":
                    leaves, scale = [x], 1
                    out = attention(x, k_cache[:, :50], v_cache[:, :50], causal=True)
                    k_cache.copy_(torch.flip(k_cache, [1]))
                    v_cache[:, :50].mul_(3)
                elif case == "q_projection":
                    leaves, scale = [x, kl, vl], 1
                    q2 = x * 2
                    out = attention(q2, kl, vl, causal=True)
                    q2.add_(1)
                else:
                    leaves, scale = [x, kl, vl], 0.5
                    out = attention(x, kl, vl, causal=True)
                    out.mul_(0.5)
                grads = torch.autograd.grad(out, leaves, dout)
        except RuntimeError as e:
            assert not allowed and "modified by an inplace operation" in str(e), f"{case} allowed={allowed}: {e}"
            continue
        assert allowed, f"{case}: the in-place write outside the context went unnoticed"
        q_used = q * 2 if case == "q_projection" else q
        want = _direct(q_used, k, v, scale * dout)[2:]
        if case == "q_projection":
            want = (2 * want[0], *want[1:])  # through q = x * 2 (exact in fp16)
        _assert_bitwise(grads, want[:len(grads)], ("dq", "dk", "dv"), case)


# ------------------------------------------------------------------------ BP: saved and loaded ExportedProgram


def _export_cases():
    q, k, v = _randn(2, 100, 4, 64), _randn(2, 120, 2, 64), _randn(2, 120, 2, 64)
    runs = {
        "dense": (Attention(causal=True, return_lse=True), [(q, k, v), (_randn(2, 77, 4, 64), _randn(2, 33, 2, 64), _randn(2, 33, 2, 64))]),
        "documents": (Attention(causal=True, return_lse=True), [
            (q, k[:, :100], v[:, :100], torch.repeat_interleave(torch.arange(3), torch.tensor([30, 50, 20])).expand(2, 100)),
            (q, k[:, :100], v[:, :100], torch.repeat_interleave(torch.arange(2), torch.tensor([70, 30])).expand(2, 100))]),
        "varlen": (AttentionVarlen(100, 100, window_size=(30, 5), return_lse=True), [
            (q[0], k[0, :100], v[0, :100], torch.tensor([0, 40, 100], dtype=torch.int32),
             torch.tensor([0, 60, 100], dtype=torch.int32)),
            (q[0], k[0, :100], v[0, :100], torch.tensor([0, 90, 100], dtype=torch.int32),
             torch.tensor([0, 10, 100], dtype=torch.int32))]),
    }
    return runs


_LOAD_SCRIPT = r"""
import sys
import torch
import flash_attn_hopper  # registers the ops: deserialisation needs them
program = torch.export.load(sys.argv[1])
targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
print("targets", targets)
"""


@pytest.mark.parametrize("case", ["dense", "documents", "varlen"])
def test_exported_program_saved_and_loaded(cpu_ops, case, tmp_path):
    """pytorch/pytorch#152029 (issue 151746: a custom op in an ExportedProgram could not be resolved when the saved
    program was loaded) and Dao-AILab/flash-attention#431 (a scripted module calling flash attention could not be
    saved and loaded). torch.export.save then torch.export.load of a program holding the op (dense with dynamic seqlen_q
    / seqlen_k, packed documents, attention_varlen): the loaded program holds the op once and gives the eager module's
    out and LSE bit for bit, at the export shapes and values and at others (new lengths, new documents, new
    cu_seqlens); a fresh interpreter that imports flash_attn_hopper loads the file and finds the op."""
    from torch.export import Dim, export

    module, runs = _export_cases()[case]
    dynamic = None
    if case == "dense":
        sq, sk = Dim("seqlen_q", min=2, max=4096), Dim("seqlen_k", min=2, max=4096)
        dynamic = ({1: sq}, {1: sk}, {1: sk})
    program = export(module, runs[0], dynamic_shapes=dynamic, strict=False)
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    op = torch.ops.flash_attn_hopper.fwd_varlen.default if case == "varlen" else torch.ops.flash_attn_hopper.fwd.default
    targets = [n.target for n in loaded.graph.nodes if n.op == "call_function"]
    assert targets.count(op) == 1, f"the loaded program does not hold {op} once: {targets}"
    for i, args in enumerate(runs):
        got, want = loaded.module()(*args), module(*args)
        _assert_bitwise(got, want, ("out", "lse"), f"{case} run {i}")
    path = tmp_path / f"{case}.pt2"
    torch.export.save(program, str(path))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, str(path)], capture_output=True, text=True, timeout=300,
                       env=env, cwd=ROOT)
    assert r.returncode == 0 and str(op).split(".default")[0].split("ops.")[-1] in r.stdout, (
        f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


# ------------------------------------------------------------------------------------ BQ: no warnings per step


def test_training_step_emits_no_warning(cpu_ops):
    """pytorch/pytorch#112773 (attention kernels warned on every call until made to warn once: "these logs can get
    pretty spammy") and kijai/ComfyUI-WanVideoWrapper#36 (a per-call UserWarning of an attention wrapper). Test suites
    and training scripts run with warnings as errors (-W error, filterwarnings = error), so a warning in the hot path
    is a failure there. With every warning an error: a dense forward and backward (GQA, causal, loss through out and
    LSE, deterministic, under torch.use_deterministic_algorithms too), packed documents, attention_varlen forward and
    backward with rows past the last sequence, each twice (the cached second call)."""
    q, k, v, dout = _randn(2, 60, 4, 64), _randn(2, 60, 2, 64), _randn(2, 60, 2, 64), _randn(2, 60, 4, 64)
    ids = torch.repeat_interleave(torch.arange(2), torch.tensor([25, 35])).expand(2, 60)
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
            out, lse = attention(*leaves, causal=True, return_lse=True, deterministic=True)
            torch.autograd.backward([out, lse], [dout, torch.randn_like(lse)])
            attention(q, k, v, causal=True, document_ids=ids)
            vleaves = [t[0].detach().clone().requires_grad_(True) for t in (q, k, v)]
            vout = attention_varlen(*vleaves, cu, cu, 30, 30, causal=True)
            vout.backward(dout[0])
            torch.use_deterministic_algorithms(True)
            try:
                attention(*leaves, causal=True).backward(dout)
            finally:
                torch.use_deterministic_algorithms(False)


@requires_transformers
def test_transformers_attention_forward_emits_no_warning(cpu_ops):
    """The transformers integration's attention function (plain causal GQA, packed position_ids, a sliding window and
    softcap) with every warning an error, twice each (pytorch/pytorch#112773, as above)."""
    from flash_attn_hopper.integrations import transformers as fah_transformers

    class Module(torch.nn.Module):
        is_causal, layer_idx = True, 0

    query, key, value = _randn(1, 4, 40, 64), _randn(1, 2, 40, 64), _randn(1, 2, 40, 64)
    pos = torch.cat([torch.arange(15), torch.arange(25)]).unsqueeze(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            fah_transformers.flash_attn_hopper_attention_forward(Module(), query, key, value, None)
            fah_transformers.flash_attn_hopper_attention_forward(Module(), query, key, value, None, position_ids=pos)
            fah_transformers.flash_attn_hopper_attention_forward(Module(), query, key, value, None, sliding_window=16,
                                                                 softcap=30.0)


def test_compiled_varlen_new_max_seqlen_reuses_the_graph(cpu_ops):
    """torch.compile(dynamic=True, fullgraph=True, aot_eager) of attention_varlen with a new max_seqlen on every call
    (mostly the longest sequence of each batch, once a bound past the token total): the varlen ops take max_seqlen_q/k
    as SymInt, so one graph serves every maximum; the forward and backward ops receive this call's maximum, and the
    loss and the gradients (through the C++ autograd node, traced with symbolic maxima) are the eager call's bit for
    bit. With int in the schemas every maximum was a graph of its own."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    def f(q, k, v, cu, longest):
        out, lse = attention_varlen(q, k, v, cu, cu, longest, longest, causal=True, return_lse=True)
        return out.float().sum() + lse.sum()

    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    # maxima out of order (a graph that kept an earlier one is caught either way) and one above the token total
    for lengths, bound in (([5, 7], 7), ([9, 3], 9), ([4, 4, 11], 11), ([20, 1], 20), ([6, 30, 2], 300),
                           ([1, 2, 3, 50], 50), ([2, 6], 6)):
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        base = [_randn(sum(lengths), 2, 64) for _ in range(3)]
        runs = []
        for fn in (compiled, f):
            leaves = [t.clone().requires_grad_(True) for t in base]
            CALLS.clear()
            loss = fn(*leaves, cu, bound)
            loss.backward()
            runs.append((loss, *(t.grad for t in leaves)))
            assert _varlen_maxima() == [("fwd_varlen", bound, bound), ("bwd_varlen", bound, bound)], (
                f"lengths {lengths}: the ops got {_varlen_maxima()}, not max_seqlen {bound}")
        assert all(torch.equal(a, b) for a, b in zip(*runs)), f"lengths {lengths}: compiled != eager"
    assert op_graphs(counter) == 1, f"{op_graphs(counter)} graphs for 7 maxima"


def test_compiled_varlen_reaching_the_rows_reuses_a_cached_graph(cpu_ops, tmp_path, monkeypatch):
    """Inductor, dynamic=True: the first call's max_seqlen is below q's rows, later ones reach them (one sequence) or
    pass them (a loose bound). Compiled twice (torch._dynamo.reset between), the second time from the FX graph cache
    of the first (an empty cache directory of its own): one graph with the op each time. The varlen tile check under
    compile guarded on min(max_seqlen_q, q's rows); torch 2.11's cache hit brought that back as `max_q < q.size()[0]`
    and the call that reached the rows recompiled (session 55, an H100 run of test_compile_gpu.py with a warm cache).
    Found with torch 2.11 (the GPU machines'); torch 2.14 (CI's) did not recompile either way."""
    _needs_compiler("inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def f(q, k, v, cu_q, cu_k, max_q, max_k):
        return attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True, deterministic=True)

    batches = [([77, 130, 5], [10, 200, 60], 130, 200), ([300, 1], [129, 1], 300, 129), ([100], [100], 100, 100),
               ([17, 57], [30, 33], 2048, 4096)]
    for compile_pass, compiled, counter in compiled_cold_then_cached(f):
        for lengths_q, lengths_k, max_q, max_k in batches:
            cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                          for n in (lengths_q, lengths_k))
            base = [torch.randn(sum(n), 3, 64).half() for n in (lengths_q, lengths_k, lengths_k)]
            leaves = [t.clone().requires_grad_(True) for t in base]
            out, lse = compiled(*leaves, cu_q, cu_k, max_q, max_k)
            torch.autograd.grad((out, lse), leaves, (torch.randn_like(out), torch.randn_like(lse)))
        assert op_graphs(counter) == 1, f"{compile_pass}: {op_graphs(counter)} graphs for {len(batches)} maxima"
    torch._dynamo.reset()


def _needs_compiler(backend):
    if backend == "inductor" and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("inductor on the CPU needs a C++ compiler (none on PATH)")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_varlen_max_seqlen_from_data(cpu_ops, backend):
    """A maximum computed inside the compiled code from cu_seqlens (`.item()` under capture_scalar_outputs, as code
    written for eager FlashAttention does) has no value at trace time. Before session 43 the range check of
    max_seqlen and the tile-count check compared it in Python, and fullgraph compilation stopped with "Could not guard
    on data-dependent expression". Now: one graph for every batch, both ops receive this call's maximum, and out, LSE
    and the gradients are the eager call's bit for bit; a maximum out of range is refused at run time by the graph's
    assertion, before any op runs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    _needs_compiler(backend)
    counter = CompileCounterWithBackend(backend)

    def f(q, k, v, cu, offset):
        longest = int(cu.diff().max().item()) + offset
        return attention_varlen(q, k, v, cu, cu, longest, longest, causal=True, return_lse=True)

    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for lengths in ([5, 7], [9, 3], [4, 4, 11], [1, 30]):
            cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
            base = [_randn(sum(lengths), 2, 64) for _ in range(3)]
            dout, dlse = _randn(sum(lengths), 2, 64), torch.randn(2, sum(lengths))
            runs = []
            for fn in (compiled, f):
                leaves = [t.clone().requires_grad_(True) for t in base]
                CALLS.clear()
                out, lse = fn(*leaves, cu, 0)
                grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
                longest = max(lengths)
                assert _varlen_maxima() == [("fwd_varlen", longest, longest), ("bwd_varlen", longest, longest)], (
                    f"lengths {lengths}: the ops got {_varlen_maxima()}")
                runs.append((out, lse, *grads))
            assert all(torch.equal(a, b) for a, b in zip(*runs)), f"lengths {lengths}: compiled != eager"
        assert op_graphs(counter) == 1, f"{op_graphs(counter)} graphs for 4 maxima from data"
        CALLS.clear()
        with pytest.raises(RuntimeError, match=r"u\d+|max_seqlen"):  # the graph's assertion (see the test below)
            compiled(*[_randn(12, 2, 64) for _ in range(3)], torch.tensor([0, 5, 12], dtype=torch.int32), -100)
        assert _varlen_maxima() == [], "a negative maximum reached the op"


@pytest.mark.parametrize("from_data", ["max_seqlen_k", "none"])
def test_compiled_varlen_tile_limit(cpu_ops, from_data):
    """The forward's tile limit (2^31 - 1025: sequences x nheads x query row blocks) under torch.compile(fullgraph),
    65535 sequences (one of one query row and one key, the rest empty: under torch.compile the launch covers the
    smaller of max_seqlen_q and q's rows in every sequence) on 32769 query heads and one K/V head: 2^31 + 33791 tiles.
    With every value known at trace time the trace raises the library's ValueError; with max_seqlen_k computed from
    data (launch or not unknown at trace time) the graph refuses the call when it runs. Either way before any op runs
    (eager raises the ValueError: test_validation_cpu.py). Until the review of session 43 the second form launched."""
    nseq, nheads = 65535, 32769
    cu = torch.tensor([0] + [1] * nseq, dtype=torch.int32)
    q, k, v = _randn(1, nheads, 8), _randn(1, 1, 8), _randn(1, 1, 8)

    def f(q, k, v, cu):
        max_k = int(cu.diff().max().item()) if from_data == "max_seqlen_k" else 1
        return attention_varlen(q, k, v, cu, cu, 1, max_k)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    CALLS.clear()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        if from_data == "none":
            with pytest.raises(Exception, match="forward tiles"):
                compiled(q, k, v, cu)
        else:
            # the graph's assertion: torch 2.11 names the unbacked symbol, 2.14 gives the library's message
            with pytest.raises(RuntimeError, match=r"u\d+|forward tiles"):
                compiled(q, k, v, cu)
    assert _varlen_maxima() == [], "the op ran past the tile limit"
