"""Fortieth round of the bug hunt (tests/bug_report_sources.md, "Fortieth round"), GPU part.

HA: the kernels alternately on two GPUs of one process. Dao-AILab/flash-attention#1793 (the CuTe forward returned
wrong values for tensors on any GPU but cuda:0: it launched on the current device, not the tensors') and
flashinfer-ai/flashinfer#452 (a decode kernel hit an illegal memory access once its tensors were on cuda:1). csrc
keeps launch state per device: each kernel's 228 KiB dynamic shared-memory attribute is set once per (kernel, device)
(`set_max_dynamic_smem_once`, a bit per device), the SM count and the sm90 check are cached per device, and
interface.py caches the sm90 answer and the cu_seqlens / document-bounds notes per device and stream. Class 27 ran one
dense head_dim 128 call on cuda:1; rounds 6, 11 and 24 listed "the same kernels alternately on two GPUs" as found but
not tested. Cases (each in a fresh process, so that every first call of a kernel is a first call; 2 sm90 GPUs or
skip): the process's first calls on cuda:1 while cuda:0 is current, then cuda:0, then cuda:1 again; and the devices
interleaved per workload, starting on cuda:0. Workloads: dense GQA causal with dLSE (fp16 head_dim 128), window +
softcap (bf16 head_dim 64), head_dim 256 (bf16), varlen with empty sequences (bf16 head_dim 96), packed documents
(bf16 head_dim 128), all deterministic, and a forward that reaches the exact pass (one-hot scores, fp16 head_dim 64).
Required: results on cuda:1 bitwise those on cuda:0 (where both GPUs are the same model with the same SM count), by
the rule, every output on its inputs' device (the other device current covers the forward's launch: autograd runs the
backward on its worker thread for the tensors' device, which makes that device current); both devices' calls issued
before either is synchronised give the same bits; a CUDA graph captured on cuda:1 (torch.cuda.graph makes it current
for the capture) replays, cuda:0 current, to the eager bits; cu_seqlens or document_ids on the other GPU refused by
name (ValueError) before any launch.

HB: the options of one torch.compile'd function changing between calls. pytorch/pytorch#197889: a Python float that
changes between calls (SDPA's `scale` among others) kept an earlier value in the cached graph under the default
torch.compile, silently, because the symbolic float was specialised by a guard and AOTAutogradCache served the first
artifact; pytorch/pytorch#149405 (a float argument recompiles the function per value); pytorch/pytorch#141725 (a
symbolic scale cast to float inside flash attention: NaN). Class DV covered a scale computed from symbolic sizes (a
constant per shape); EN / Q covered changing shapes. Cases: dense and varlen, backends inductor and aot_eager, dense
also with dynamic=True; softmax_scale, softcap and the window's left side passed as arguments of the compiled
function and changed at every call of a schedule that comes back to earlier values. Required: every call bitwise the
eager call with the same values (out, LSE, dQ, dK, dV; deterministic backward), eager by the rule at each distinct
value, and consecutive schedule entries giving different results (so a stale value cannot pass).

HC: saved inputs whose storage is freed after the forward and restored at another address before the backward, as
FSDP2's reshard_after_forward does with parameters (`untyped_storage().resize_(0)`, then `resize_` and the
all-gathered values copied in under `torch.autograd._unsafe_preserve_version_counter`, so autograd's version check
passes). pytorch/pytorch#173794: tensors that escaped the forward (k/v caching in attention) were read in the backward
after FSDP2 had freed their storage; pytorch/pytorch#118017 (FSDP2's reshard_after_forward). Queries and keys are
parameters when they are learned (Perceiver / Q-Former latent queries, prefix or memory tokens), so the op's saved q,
k, v may be such views. A backward that uses anything of the forward's but the saved tensors themselves (a pointer, a
TMA descriptor built in the forward) reads the freed range, which holds NaN (set before the free; blockers take it).
Cases: q, k, v as views of one flat buffer (FSDP2's all-gather output), as three separate parameters, and the varlen
form. Required: the restored storage apart from the freed range (premise; else a skip naming it), gradients bitwise a
run without the reshard (deterministic) and by the rule.

Inputs are Gaussian from the per-test seed (tests/conftest.py; the children seed from the case name). Skipped, with
the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build lacks a head_dim /
dtype. tests/test_bug_reports_fortieth_cpu.py checks the premises."""

import pytest
import torch

import flash_attn_hopper
import gpu_helpers
from gpu_helpers import GRAD_NAMES, assert_same_bits, cu_seqlens, require_built

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"
CHILD_TIMEOUT = 180  # seconds, below the device check's 200 s per test (its output is kept): a child imports,
# initialises two GPUs and runs five small workloads and the one-hot forward on each


def randn(*shape, dtype, device=None):
    return torch.randn(*shape, dtype=dtype, device=DEVICE if device is None else device)


def synchronize(device=None):
    if torch.device(DEVICE if device is None else device).type == "cuda":
        torch.cuda.synchronize(device)


def document_ids(lengths_per_row, device=None):
    rows = [torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)) for lens in lengths_per_row]
    return torch.stack(rows).to(DEVICE if device is None else device)


# ------------------------------------------------------------------ HA: two GPUs in turn

class Workload:
    """One attention call's inputs, made on the CPU (so that both devices get the same values), and its options;
    `varlen` (lengths_q, lengths_k) for attention_varlen; `one_hot` for a forward-only call through the exact pass."""

    def __init__(self, name, head_dim, dtype, q, k, v, opts, varlen=None, one_hot=False):
        self.name, self.head_dim, self.dtype = name, head_dim, dtype
        self.q, self.k, self.v, self.opts, self.varlen, self.one_hot = q, k, v, opts, varlen, one_hot
        gen = torch.Generator().manual_seed(len(name) * 7919 + head_dim)
        self.dout = torch.randn(*q.shape[:-1], v.shape[-1], generator=gen).to(dtype)
        lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if varlen is None else (q.shape[1], q.shape[0])
        self.dlse = torch.randn(*lse_shape, generator=gen)

    def to(self, device):
        """The inputs and output gradients on `device`; (cu_q, cu_k, max_q, max_k) for varlen; options with
        document_ids moved there."""
        moved = [t.to(device) for t in (self.q, self.k, self.v, self.dout, self.dlse)]
        opts = dict(self.opts)
        if "document_ids" in opts:
            opts["document_ids"] = opts["document_ids"].to(device)
        extra = None
        if self.varlen is not None:
            lq, lk = self.varlen
            extra = (cu_seqlens(lq, device), cu_seqlens(lk, device), max(lq), max(lk))
        return moved, opts, extra


def ha_workloads(device="cpu"):
    """The five workloads of HA (inputs on `device`, normally the CPU); the one-hot forward is apart."""
    gen = torch.Generator().manual_seed(40)
    f16, b16 = torch.float16, torch.bfloat16

    def r(*shape, dtype):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    det = dict(deterministic=True)
    lq, lk = (1, 300, 0, 77, 130), (5, 257, 33, 0, 129)
    ids = torch.stack([torch.repeat_interleave(torch.arange(3), torch.tensor(lens)) for lens in
                       ((100, 150, 50), (7, 200, 93))]).to(device)
    work = [
        Workload("dense-gqa", 128, f16, r(2, 203, 8, 128, dtype=f16), r(2, 341, 2, 128, dtype=f16),
                 r(2, 341, 2, 128, dtype=f16), dict(causal=True, **det)),
        Workload("window-softcap", 64, b16, r(2, 257, 4, 64, dtype=b16), r(2, 300, 4, 64, dtype=b16),
                 r(2, 300, 4, 64, dtype=b16), dict(window_size=(100, 0), softcap=30.0, **det)),
        Workload("hd256", 256, b16, r(1, 190, 4, 256, dtype=b16), r(1, 211, 2, 256, dtype=b16),
                 r(1, 211, 2, 256, dtype=b16), dict(**det)),
        Workload("varlen", 96, b16, r(sum(lq), 4, 96, dtype=b16), r(sum(lk), 2, 96, dtype=b16),
                 r(sum(lk), 2, 96, dtype=b16), dict(causal=True, **det), varlen=(lq, lk)),
        Workload("documents", 128, b16, r(2, 300, 4, 128, dtype=b16), r(2, 300, 4, 128, dtype=b16),
                 r(2, 300, 4, 128, dtype=b16), dict(causal=True, document_ids=ids, **det)),
    ]
    return work


def ha_one_hot(device):
    """The exact-pass workload: class GX's one-hot large-score inputs (fp16 head_dim 64, softmax_scale 1)."""
    import test_bug_reports_thirtyninth_gpu as gx

    d = gx.GX_DENSE
    q, k, v = (t.to(device) for t in gx.large_dense(d["batch"], d["seqlen_q"], d["seqlen_k"], d["nheads"],
                                                    d["head_dim"], torch.float16, torch.Generator().manual_seed(40)))
    return q, k, v


def ha_call(w, device):
    """(out, lse, dq, dk, dv) of workload w with its inputs on `device`, unsynchronised (the current device as the
    caller set it)."""
    (q, k, v, dout, dlse), opts, extra = w.to(device)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    if extra is None:
        out, lse = flash_attn_hopper.attention(*leaves, return_lse=True, **opts)
    else:
        out, lse = flash_attn_hopper.attention_varlen(*leaves, *extra, return_lse=True, **opts)
    grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
    return (out.detach(), lse.detach(), *grads)


def ha_run(w, device, other):
    """(out, lse, dq, dk, dv) of workload w on `device` while `other` is the current device, on the CPU; each output
    asserted to be on `device`."""
    device = torch.device(device)
    with torch.cuda.device(other):
        results = ha_call(w, device)
        for what, t in zip(("out", "lse", *GRAD_NAMES), results):
            if t.device != device:
                raise AssertionError(f"{w.name}: {what} on {t.device}, its inputs on {device}")
        torch.cuda.synchronize(device)
        return tuple(t.cpu() for t in results)


def ha_check_rule(w, results, device):
    """results (on the CPU) by the rule against the float32 reference computed on `device`."""
    (q, k, v, dout, dlse), opts, extra = w.to(device)
    opts = {key: val for key, val in opts.items() if key != "deterministic"}
    out, lse, *grads = (t.to(device) for t in results)
    with torch.cuda.device(device):
        if extra is None:
            gpu_helpers.check_attention(out, lse, grads, q, k, v, dout, w.name, dlse=dlse, **opts)
        else:
            gpu_helpers.check_attention_varlen(out, lse, grads, q, k, v, dout, extra[0], extra[1], w.name,
                                               dlse=dlse, **opts)


def ha_compare(name, first, second, where):
    """Every output of the two runs bitwise equal (NaN == NaN); names what differs."""
    for what, a, b in zip(("out", "lse", *GRAD_NAMES), first, second):
        assert_same_bits(b, a, f"{name} {what}", f" ({where})")


def ha_built(head_dim, dtype):
    cfg = flash_attn_hopper.build_config()
    return gpu_helpers._kernels_built(head_dim, cfg) and dtype in cfg["dtypes"]


def ha_same_model():
    """Whether cuda:0 and cuda:1 are the same GPU model with the same SM count (then the same launches run and the
    results must agree bit for bit)."""
    p0, p1 = (torch.cuda.get_device_properties(i) for i in (0, 1))
    return p0.name == p1.name and p0.multi_processor_count == p1.multi_processor_count


def ha_child(order):
    """One HA case in a fresh process (see the module docstring). order: "cuda1-first" or "interleaved"."""
    if torch.cuda.device_count() < 2:
        print("SKIP: needs two CUDA GPUs (class HA runs the kernels on both in turn)")
        return
    for i in (0, 1):
        if torch.cuda.get_device_capability(i) != (9, 0):
            print(f"SKIP: cuda:{i} is not an sm90 GPU")
            return
    work = [w for w in ha_workloads() if ha_built(w.head_dim, w.dtype)]
    if not work:
        print("SKIP: this build has none of HA's head_dim / dtype pairs")
        return
    bitwise = ha_same_model()
    results = {0: {}, 1: {}}
    if order == "cuda1-first":  # every kernel's first launch of the process on cuda:1, cuda:0 current
        plan = [(w, 1) for w in work] + [(w, 0) for w in work] + [(w, 1) for w in work]
    elif order == "interleaved":
        plan = [(w, d) for w in work for d in (0, 1, 0)]
    else:
        raise ValueError(order)
    for w, d in plan:
        r = ha_run(w, d, other=1 - d)
        if w.name in results[d]:
            ha_compare(w.name, results[d][w.name], r, f"cuda:{d} again: the same call gives other bits")
        else:
            results[d][w.name] = r
    for w in work:
        if bitwise:
            ha_compare(w.name, results[0][w.name], results[1][w.name],
                       "cuda:1 against cuda:0, the same GPU model: launch state of one device used on the other?")
        for d in (0, 1):
            ha_check_rule(w, results[d][w.name], torch.device("cuda", d))
    # both devices' calls issued before either is synchronised
    w = work[0]
    pending = []
    for d in (1, 0):
        with torch.cuda.device(1 - d):
            pending.append((d, ha_call(w, torch.device("cuda", d))))
    for d, r in pending:
        ha_compare(w.name, results[d][w.name], tuple(t.cpu() for t in r), f"cuda:{d}, both devices busy at once")
    ha_graph_on_cuda1(work)
    ha_exact_pass(bitwise)
    ha_refusals()


def ha_graph_on_cuda1(work):
    """A forward captured in a CUDA graph on cuda:1 (current only for the capture, as torch.cuda.graph needs), replayed
    with new inputs while cuda:0 is current: the eager bits."""
    w = next((w for w in work if w.varlen is None and "document_ids" not in w.opts), None)
    if w is None:
        return
    dev = torch.device("cuda", 1)
    (q, k, v, _, _), opts, _ = w.to(dev)
    with torch.cuda.device(0):
        static = [t.clone() for t in (q, k, v)]
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the capture
                flash_attn_hopper.attention(*static, return_lse=True, **opts)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(dev), torch.cuda.graph(graph):
            g_out, g_lse = flash_attn_hopper.attention(*static, return_lse=True, **opts)
        for seed in (1, 2):
            gen = torch.Generator().manual_seed(seed)
            fresh = [torch.randn(t.shape, generator=gen).to(t.dtype).to(dev) for t in static]
            for s, f in zip(static, fresh):
                s.copy_(f)
            graph.replay()
            e_out, e_lse = flash_attn_hopper.attention(*fresh, return_lse=True, **opts)
            torch.cuda.synchronize(dev)
            assert_same_bits(g_out, e_out, f"graph on cuda:1 replay {seed} out", " (eager on the same inputs)")
            assert_same_bits(g_lse, e_lse, f"graph on cuda:1 replay {seed} lse", " (eager on the same inputs)")


def ha_exact_pass(bitwise):
    """The exact pass (a programmatically dependent launch) on cuda:1 then cuda:0: the one-hot answer on both."""
    import test_bug_reports_thirtyninth_gpu as gx

    if not ha_built(64, torch.float16):
        return
    outs = {}
    for d in (1, 0):
        dev = torch.device("cuda", d)
        q, k, v = ha_one_hot(dev)
        with torch.cuda.device(1 - d):
            out, lse = flash_attn_hopper.attention(q, k, v, softmax_scale=1.0, return_lse=True)
            torch.cuda.synchronize(dev)
        gx.check_one_hot(out, lse, q, k, v, f"exact pass on cuda:{d}")
        outs[d] = (out.cpu(), lse.cpu())
    if bitwise:
        assert_same_bits(outs[1][0], outs[0][0], "exact pass out", " (cuda:1 against cuda:0)")
        assert_same_bits(outs[1][1], outs[0][1], "exact pass lse", " (cuda:1 against cuda:0)")


def ha_refusals():
    """cu_seqlens or document_ids on the other GPU: ValueError naming the argument, nothing launched."""
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    q = randn(77, 2, 64, dtype=torch.bfloat16, device=d1)
    cu = torch.tensor([0, 77], dtype=torch.int32)
    for name, cu_q, cu_k in (("cu_seqlens_q", cu.to(d0), cu.to(d1)), ("cu_seqlens_k", cu.to(d1), cu.to(d0))):
        try:
            flash_attn_hopper.attention_varlen(q, q, q, cu_q, cu_k, 77, 77)
        except ValueError as e:
            if name not in str(e):
                raise AssertionError(f"the refusal does not name {name}: {e}") from e
        else:
            raise AssertionError(f"{name} on cuda:0 with q on cuda:1 was taken")
    qd = randn(1, 77, 2, 64, dtype=torch.bfloat16, device=d1)
    try:
        flash_attn_hopper.attention(qd, qd, qd, document_ids=torch.zeros(1, 77, dtype=torch.int32, device=d0))
    except ValueError as e:
        if "document_ids" not in str(e):
            raise AssertionError(f"the refusal does not name document_ids: {e}") from e
    else:
        raise AssertionError("document_ids on cuda:0 with q on cuda:1 was taken")


HA_CHILD_SCRIPT = """
import sys, zlib
import torch
import test_bug_reports_fortieth_gpu as t
torch.manual_seed(zlib.crc32(" ".join(sys.argv[1:2]).encode()))
t.ha_child(*sys.argv[1:])
print("done")
"""


@pytest.mark.parametrize("order", ["cuda1-first", "interleaved"])
def test_kernels_alternately_on_two_gpus(order):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two sm90 GPUs (class HA; e.g. an nvidia-h100-x2 machine)")
    gpu_helpers.run_child(HA_CHILD_SCRIPT, order, name=f"two GPUs {order}", timeout=CHILD_TIMEOUT)


# ------------------------------------------------------------------ HB: options changing between compiled calls

# (softmax_scale, softcap, window left side); the schedule comes back to earlier values, and every entry differs
# from the one before it
HB_SCHEDULE = [(0.125, 0.0, -1), (0.0883883476, 0.0, -1), (0.2, 30.0, 64), (0.3, 20.0, 100), (0.125, 0.0, -1),
               (0.2, 30.0, 64), (0.21, 30.0, 64), (0.21, 25.0, 64), (0.21, 25.0, 63)]
HB_CASES = [("dense", "inductor", None), ("dense", "inductor", True), ("dense", "aot_eager", None),
            ("dense", "aot_eager", True), ("varlen", "inductor", None), ("varlen", "aot_eager", None)]
HB_LENGTHS_Q, HB_LENGTHS_K = (130, 0, 77, 1), (257, 33, 77, 5)


def hb_problem(kind, device=None):
    """(q, k, v, dout, dlse, varlen args or None): bf16 head_dim 64, GQA 4/2, seqlen_q != seqlen_k."""
    dt = torch.bfloat16
    if kind == "dense":
        q = randn(2, 203, 4, 64, dtype=dt, device=device)
        k, v = (randn(2, 341, 2, 64, dtype=dt, device=device) for _ in range(2))
        dlse = randn(2, 4, 203, dtype=torch.float32, device=device)
        extra = None
    else:
        lq, lk = HB_LENGTHS_Q, HB_LENGTHS_K
        q = randn(sum(lq), 4, 64, dtype=dt, device=device)
        k, v = (randn(sum(lk), 2, 64, dtype=dt, device=device) for _ in range(2))
        dlse = randn(4, sum(lq), dtype=torch.float32, device=device)
        dev = DEVICE if device is None else device
        extra = (cu_seqlens(lq, dev), cu_seqlens(lk, dev), max(lq), max(lk))
    dout = randn(*q.shape, dtype=dt, device=device)
    return q, k, v, dout, dlse, extra


def hb_function(extra):
    """The function a model would compile: the options are its arguments."""
    def f(q, k, v, scale, cap, left):
        opts = dict(softmax_scale=scale, softcap=cap, window_size=(left, 0), return_lse=True, deterministic=True)
        if extra is None:
            return flash_attn_hopper.attention(q, k, v, **opts)
        return flash_attn_hopper.attention_varlen(q, k, v, *extra, **opts)
    return f


def hb_step(fn, q, k, v, dout, dlse, scale, cap, left):
    """(out, lse, dq, dk, dv) of fn at these option values, the loss on out and LSE; detached."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = fn(*leaves, scale, cap, left)
    grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
    synchronize()
    return (out.detach(), lse.detach(), *grads)


def hb_check_changes(results, schedule, name):
    """Premise: consecutive schedule entries give different out (a call that kept the previous entry's values would
    otherwise pass the bitwise comparison with eager)."""
    for i in range(1, len(schedule)):
        if torch.equal(results[i][0], results[i - 1][0]):
            raise AssertionError(f"{name}: premise: entries {i - 1} and {i} of the schedule give the same out")


def hb_check_rule(kind, q, k, v, dout, dlse, extra, values, results):
    """The eager results at one schedule entry by the rule."""
    scale, cap, left = values
    opts = dict(softmax_scale=scale, softcap=cap, window_size=(left, 0))
    out, lse, *grads = results
    name = f"eager {kind} {values}"
    if extra is None:
        gpu_helpers.check_attention(out, lse, grads, q, k, v, dout, name, dlse=dlse, **opts)
    else:
        gpu_helpers.check_attention_varlen(out, lse, grads, q, k, v, dout, extra[0], extra[1], name, dlse=dlse,
                                           **opts)


@pytest.mark.parametrize("kind,backend,dynamic", HB_CASES,
                         ids=[f"{k}-{b}-{'dynamic' if d else 'auto'}" for k, b, d in HB_CASES])
def test_compiled_options_changing_between_calls(kind, backend, dynamic):
    require_built(64, torch.bfloat16)
    torch._dynamo.reset()
    q, k, v, dout, dlse, extra = hb_problem(kind)
    f = hb_function(extra)
    compiled = torch.compile(f, backend=backend, dynamic=dynamic, fullgraph=True)
    eager = {}
    for values in dict.fromkeys(HB_SCHEDULE):
        eager[values] = hb_step(f, q, k, v, dout, dlse, *values)
        hb_check_rule(kind, q, k, v, dout, dlse, extra, values, eager[values])
    hb_check_changes([eager[values] for values in HB_SCHEDULE], HB_SCHEDULE, f"{kind} eager")
    try:
        with torch._dynamo.config.patch(recompile_limit=64):
            for i, values in enumerate(HB_SCHEDULE):
                got = hb_step(compiled, q, k, v, dout, dlse, *values)
                for what, a, b in zip(("out", "lse", *GRAD_NAMES), eager[values], got):
                    assert_same_bits(b, a, f"{kind} {backend} call {i} {values} {what}",
                                     " (eager at the same values; a compiled graph holding an earlier call's value?)")
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------ HC: saved inputs resharded by FSDP2

HC_ATTEMPTS = 8  # frees and restores until the restored storage lies outside the freed range


def hc_reshard(flat, poison=True):
    """FSDP2's reshard_after_forward and the unshard before the backward on `flat` (a tensor owning its storage): the
    values set to NaN (without a version bump) and the storage freed, its block taken by NaN blockers of the same size
    where the allocator places one there (best effort: a freed block merged with a free neighbour starts elsewhere),
    the storage reallocated and the saved values copied back without a version bump. Repeated, the blockers kept,
    until the restored storage does not overlap the freed range (at most HC_ATTEMPTS times): that range then holds
    NaN or a blocker's NaN, whichever allocation covers it. Returns (old data pointer, new data pointer, whether the
    ranges are apart, the blockers), the blockers to be kept alive until the backward has run."""
    saved = flat.detach().clone()
    old = flat.data_ptr()
    nbytes = flat.untyped_storage().nbytes()
    blockers = []
    for _ in range(HC_ATTEMPTS):
        if poison:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(flat):
                flat.fill_(float("nan"))
        flat.untyped_storage().resize_(0)
        for _ in range(16 if poison else 0):
            blockers.append(torch.full((nbytes // flat.element_size(),), float("nan"), dtype=flat.dtype,
                                       device=flat.device))
            if blockers[-1].data_ptr() == old:
                break
        flat.untyped_storage().resize_(nbytes)
        new = flat.data_ptr()
        apart = new >= old + nbytes or new + nbytes <= old
        if apart or not poison:
            break
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(flat):
        flat.copy_(saved)
    synchronize(flat.device)
    return old, flat.data_ptr(), apart, blockers


def hc_inputs(case, device=None):
    """(leaves q, k, v that require grad, the tensors whose storage FSDP2 would free, dout, dlse, varlen args)."""
    dt = torch.float16
    if case == "varlen":
        lq, lk = HB_LENGTHS_Q, HB_LENGTHS_K
        shapes = [(sum(lq), 8, 128), (sum(lk), 2, 128), (sum(lk), 2, 128)]
        dev = DEVICE if device is None else device
        extra = (cu_seqlens(lq, dev), cu_seqlens(lk, dev), max(lq), max(lk))
        lse_shape = (8, sum(lq))
    else:
        shapes = [(1, 203, 8, 128), (1, 341, 2, 128), (1, 341, 2, 128)]
        extra = None
        lse_shape = (1, 8, 203)
    values = [randn(*s, dtype=dt, device=device) for s in shapes]
    if case == "flat-views":
        # one all-gather output holding the three parameters (8-element gaps keep each view 16-byte aligned)
        sizes = [t.numel() for t in values]
        flat = torch.empty(sum(sizes) + 8 * len(sizes), dtype=dt, device=values[0].device)
        leaves, start = [], 0
        for t, n in zip(values, sizes):
            view = flat[start:start + n].view(t.shape)
            with torch.no_grad():
                view.copy_(t)
            leaves.append(view.requires_grad_(True))
            start += n + 8
        owners = [flat]
    else:
        leaves = [torch.nn.Parameter(t.clone()) for t in values]
        owners = leaves
    dout = randn(*shapes[0], dtype=dt, device=device)
    dlse = randn(*lse_shape, dtype=torch.float32, device=device)
    return leaves, values, owners, dout, dlse, extra


def hc_forward(leaves, extra):
    opts = dict(causal=True, return_lse=True, deterministic=True)
    if extra is None:
        return flash_attn_hopper.attention(*leaves, **opts)
    return flash_attn_hopper.attention_varlen(*leaves, *extra, **opts)


def hc_run(case, reshard, device=None):
    """((out, lse, dq, dk, dv), the input values, dout, dlse, varlen args, pointers) of case's forward, then
    (reshard: FSDP2's free and restore of every owner) the backward; pointers lists (old, new, apart) per owner."""
    leaves, values, owners, dout, dlse, extra = hc_inputs(case, device)
    out, lse = hc_forward(leaves, extra)
    moved = [hc_reshard(o) for o in owners] if reshard else []
    grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
    synchronize(device)
    pointers = [m[:3] for m in moved]
    del moved  # (the blockers lived through the backward)
    return (out.detach(), lse.detach(), *grads), values, dout, dlse, extra, pointers


@pytest.mark.parametrize("case", ["flat-views", "parameters", "varlen"])
def test_saved_inputs_resharded_between_forward_and_backward(case, seed):
    require_built(128, torch.float16)
    torch.manual_seed(seed)
    plain, values, dout, dlse, extra, _ = hc_run(case, reshard=False)
    torch.manual_seed(seed)
    got, values2, _, _, _, pointers = hc_run(case, reshard=True)
    for a, b in zip(values, values2):
        if not torch.equal(a, b):
            raise AssertionError("premise: the two runs draw the same inputs")
    for old, new, apart in pointers:
        if not apart:  # the allocator's choice, not the library's: no result of the library is judged here
            pytest.skip(f"{case}: premise not arranged: the restored storage overlapped the freed range in "
                        f"{HC_ATTEMPTS} frees and restores (old {old:#x}, new {new:#x})")
    for what, a, b in zip(("out", "lse", *GRAD_NAMES), plain, got):
        assert_same_bits(b, a, f"{case} {what}", " (without the reshard; a backward reading the freed block gets "
                                                 "NaN or another tensor's values)")
    q, k, v = values
    out, lse, *grads = got
    if extra is None:
        gpu_helpers.check_attention(out, lse, grads, q, k, v, dout, case, dlse=dlse, causal=True)
    else:
        gpu_helpers.check_attention_varlen(out, lse, grads, q, k, v, dout, extra[0], extra[1], case, dlse=dlse,
                                           causal=True)

