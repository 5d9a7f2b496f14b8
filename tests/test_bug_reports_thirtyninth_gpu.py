"""Thirty-ninth round of the bug hunt (tests/bug_report_sources.md, "Thirty-ninth round"), GPU part.

GW: the library under PyTorch's profilers. pytorch/pytorch#150601 and pytorch/torchtitan#1049: with
`torch.profiler.profile(record_shapes=True)` and `torch.use_deterministic_algorithms(True)` together, SDPA's flash
path raised "value cannot be converted to type int64_t without overflow" (neither alone did), so a training run
with profiling and deterministic mode died; pytorch/pytorch#72858: `export_chrome_trace` segfaulted with
record_shapes or with_flops. A profiler records every dispatcher op's arguments (optional tensors, SymInts, floats),
runs CUPTI beside the kernels and, with with_flops / profile_memory / with_stack, calls back into the ops'
metadata. Cases (each in a child process with a time limit, a crash fails by name): record_shapes with CUDA
activity under the strict deterministic mode (the report), profile_memory + with_stack + with_flops, CPU activity
only, emit_nvtx(record_shapes=True), and a scheduled profiler (wait / warmup / active steps) whose traces are
written by on_trace_ready. Workloads: dense GQA causal fp16 head_dim 128 with a loss on out and LSE, packed
documents bf16 head_dim 64, attention_varlen bf16 head_dim 128 with empty sequences, and a forward whose scores
reach the exact pass (a second, programmatically dependent kernel). Required: the results bit for bit those of the
same calls outside the profiler (deterministic backward), right by the rule; the library's ops visible to the
profiler by name (flash_attn_hopper::fwd, ::bwd, ::fwd_varlen, ::bwd_varlen), with q's shape recorded where
record_shapes is on, GPU kernel events where CUDA activity is on; the exported chrome traces valid JSON naming
the ops.

GX: the forward's exact pass is launched as a programmatic dependent launch (csrc/flash/fwd/exact_rows_sm90.hpp:
cudaLaunchAttributeProgrammaticStreamSerialization, griddepcontrol.wait before it reads the forward's flag, LSE and
output). PDL lets the dependent kernel start before the kernel ahead of it has finished and flushed its writes;
a dependent that reads too early sees stale data. Reports: NVIDIA/cutlass#2760 (SM90 grouped GEMMs launched with
PDL without waiting on the previous grid: a rare race, wrong results on an H200), NVIDIA/cccl#9134 (PDL enabled for
kernels whose wait was compiled out: the next kernel ran before the previous kernel's memory barrier),
NVIDIA/cccl#3131 (a race in merge sort from PDL). Under stream capture the launch becomes a programmatic edge of
the graph, and the pass's flag is a zeroed buffer whose reset must be part of the graph. Earlier rounds ran the exact
pass eagerly only (classes AL, DB; GT in a green context). Cases: a CUDA graph holding a producer kernel (q
written right before the call), the forward and consumers of out and LSE (copies right after the pass), captured on
ordinary inputs and replayed with inputs whose scores reach the pass (fp16 scores ~2^31, bf16 ~2^60 with
softmax_scale 1: without the pass a row's P at its maximum is 2^r with r up to hundreds, NaN or 0 rows), ordinary
ones again, a batch mixing both, and again the large ones; dense fp16 and bf16 (head_dim 64), varlen bf16 with a
sequence that has queries and no keys. Large-score inputs are one-hot by construction (scores exact in float32, the
top beating the next by >= 2^20): out must be the top key's V row bit for bit and LSE the top score; ordinary ones
by the rule; every replay bitwise the eager call on the same inputs.

GY: torch.compile's memory-budget partitioner (torch._functorch.config.activation_memory_budget below 1: the
min-cut partitioner may recompute forward ops in the backward instead of saving their outputs). Reports:
pytorch/pytorch#190758 (ops recomputed in the backward under a memory budget drew fresh randomness: silently wrong
gradients at any budget < 1), pytorch/pytorch#147561 (compiler-driven recompute of collectives had to be banned).
A recomputed attention forward must give the saved one's out and LSE (the backward takes P from the LSE), with the
same document bounds / cu_seqlens. Cases: budgets 0 (recompute everything) and 0.5 x dense GQA with a loss on out and
LSE, packed documents, varlen; backends inductor and aot_eager_decomp_partition (the min-cut partitioner without
inductor's kernels): out, LSE, dQ, dK, dV bitwise eager's (deterministic backward; the compiled code around the op
only multiplies by powers of two), eager's by the rule.

GZ: the ops inside `torch.compiler.nested_compile_region` (one invoke_subgraph body traced once and called per layer,
as transformer blocks are compiled to cut compile time). Report: pytorch/pytorch#186807 (a custom op inside a nested
compile region failed under torch.compile). Cases: a region holding one attention call, called twice in a chain
(layer 2's query is layer 1's out) with a loss on the last out and on both LSEs, dense GQA, packed documents and
varlen, with backends aot_eager and inductor, fullgraph: bitwise eager's, eager's by the rule.

Inputs are Gaussian from the per-test seed (tests/conftest.py; the children seed from the case name). Skipped,
with the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build lacks a
head_dim / dtype. tests/test_bug_reports_thirtyninth_cpu.py checks the premises."""

import json
import os

import pytest
import torch

import flash_attn_hopper
import gpu_helpers
from gpu_helpers import GRAD_NAMES, assert_same_bits, cu_seqlens, require_built

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"
CHILD_TIMEOUT = 300  # seconds: a child takes ~30 (import, CUDA and CUPTI initialisation, small problems)
ONE_HOT_GAP = 20.0  # natural units: exp(-20) x 1000 keys is far below half an ulp of any V element


def randn(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def synchronize():
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def document_ids(lengths_per_row):
    rows = [torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)) for lens in lengths_per_row]
    return torch.stack(rows).to(DEVICE)


# ------------------------------------------------------------------ workloads shared by GW, GY and GZ

class Problem:
    """One attention call with its output gradients: q, k, v, dout, dlse, the options and, for varlen,
    (cu_q, cu_k, max_q, max_k). `call(q, k, v)` runs it (out, lse)."""

    def __init__(self, name, q, k, v, opts, varlen=None):
        self.name, self.q, self.k, self.v, self.opts, self.varlen = name, q, k, v, opts, varlen
        self.dout = randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if varlen is None else (q.shape[1], q.shape[0])
        self.dlse = randn(*lse_shape, dtype=torch.float32)

    def call(self, q, k, v):
        if self.varlen is None:
            return flash_attn_hopper.attention(q, k, v, return_lse=True, **self.opts)
        return flash_attn_hopper.attention_varlen(q, k, v, *self.varlen, return_lse=True, **self.opts)

    def built(self):
        return [(self.q.shape[-1], self.q.dtype)]

    def check(self, results):
        """out, LSE, dQ, dK, dV by the rule against the float32 reference."""
        opts = {key: val for key, val in self.opts.items() if key != "deterministic"}
        out, lse, grads = results[0], results[1], results[2:]
        if self.varlen is None:
            gpu_helpers.check_attention(out, lse, grads, self.q, self.k, self.v, self.dout, self.name,
                                        dlse=self.dlse, **opts)
        else:
            gpu_helpers.check_attention_varlen(out, lse, grads, self.q, self.k, self.v, self.dout,
                                               *self.varlen[:2], self.name, dlse=self.dlse, **opts)


def problems():
    """The three workloads, deterministic (bitwise comparable backward)."""
    det = dict(deterministic=True)
    f16, b16 = torch.float16, torch.bfloat16
    lq, lk = (1, 300, 0, 77), (5, 257, 33, 77)
    return [
        Problem("dense-gqa", randn(2, 203, 8, 128, dtype=f16), randn(2, 341, 2, 128, dtype=f16),
                randn(2, 341, 2, 128, dtype=f16), dict(causal=True, **det)),
        Problem("documents", *(randn(2, 300, 4, 64, dtype=b16) for _ in range(3)),
                dict(causal=True, document_ids=document_ids([(100, 150, 50), (7, 293)]), **det)),
        Problem("varlen", randn(sum(lq), 4, 128, dtype=b16), randn(sum(lk), 2, 128, dtype=b16),
                randn(sum(lk), 2, 128, dtype=b16), dict(causal=True, **det),
                (cu_seqlens(lq, DEVICE), cu_seqlens(lk, DEVICE), max(lq), max(lk))),
    ]


def run_problem(p, fn=None):
    """(out, lse, dq, dk, dv) of one forward and backward through fn(q, k, v) -> (out, lse) (default p.call), the
    loss on out and LSE; synchronised, detached."""
    fn = p.call if fn is None else fn
    leaves = [t.detach().clone().requires_grad_(True) for t in (p.q, p.k, p.v)]
    out, lse = fn(*leaves)
    grads = torch.autograd.grad([out, lse], leaves, [p.dout, p.dlse])
    synchronize()
    return (out.detach(), lse.detach(), *grads)


def compare_bits(name, first, second, where):
    for what, a, b in zip(("out", "lse", *GRAD_NAMES), first, second):
        assert_same_bits(b, a, f"{name} {what}", f" ({where}: the same kernels on the same inputs)")


# ------------------------------------------------------------------ GX: inputs that reach the exact pass

def large_keys(n, dtype, gen):
    """n distinct positive values of dtype, permuted: fp16 multiples of 32 in [32768, 65504] (1023 values), bf16
    every value in [2^29, 2^32) (384 values). Products with large_queries are exact in float32."""
    if dtype == torch.float16:
        values = 32768.0 + 32.0 * torch.arange(1023, dtype=torch.float64)
    else:
        values = torch.cat([2.0 ** e * (1 + torch.arange(128, dtype=torch.float64) / 128) for e in (29, 30, 31)])
    if n > len(values):
        raise ValueError(f"at most {len(values)} distinct large {dtype} keys")
    return values[torch.randperm(len(values), generator=gen)[:n]]


def large_queries(shape, dtype, gen):
    """Values of magnitude fp16 [32768, 65504] / bf16 [2^30, 2^31), random signs."""
    if dtype == torch.float16:
        mag = 32768.0 + 32.0 * torch.randint(0, 1023, shape, generator=gen).double()
    else:
        mag = 2.0 ** 30 * (1 + torch.randint(0, 128, shape, generator=gen).double() / 128)
    return mag * (torch.randint(0, 2, shape, generator=gen).double() * 2 - 1)


def large_dense(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype, gen):
    """q, k, v (MHA) whose scores (softmax_scale 1) are q[..., 0] x k[..., 0], exact in float32, of magnitude 2^30 -
    2^32 (fp16) or 2^59 - 2^63 (bf16); every row's top key beats the next by >= 2^20: P one-hot."""
    q = torch.zeros(batch, seqlen_q, nheads, head_dim, dtype=torch.float64)
    k = torch.zeros(batch, seqlen_k, nheads, head_dim, dtype=torch.float64)
    q[..., 0] = large_queries((batch, seqlen_q, nheads), dtype, gen)
    for b in range(batch):
        for h in range(nheads):
            k[b, :, h, 0] = large_keys(seqlen_k, dtype, gen)
    v = torch.randn(batch, seqlen_k, nheads, head_dim, generator=gen, dtype=torch.float64)
    return tuple(t.to(dtype).to(DEVICE) for t in (q, k, v))


def large_varlen(lq, lk, nheads, head_dim, dtype, gen):
    """large_dense's construction over packed sequences (keys distinct over the whole tensor)."""
    q = torch.zeros(sum(lq), nheads, head_dim, dtype=torch.float64)
    k = torch.zeros(sum(lk), nheads, head_dim, dtype=torch.float64)
    q[..., 0] = large_queries((sum(lq), nheads), dtype, gen)
    for h in range(nheads):
        k[:, h, 0] = large_keys(sum(lk), dtype, gen)
    v = torch.randn(sum(lk), nheads, head_dim, generator=gen, dtype=torch.float64)
    return tuple(t.to(dtype).to(DEVICE) for t in (q, k, v))


def check_one_hot(out, lse, q, k, v, name):
    """Dense MHA, softmax_scale 1, P one-hot by construction: out is the top key's V row bit for bit, LSE the top
    score within float32 rounding (2^-16 relative); rows of a batch element without keys: out 0, LSE -inf."""
    if k.shape[1] == 0:
        if not (torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()):
            raise AssertionError(f"{name}: rows without keys are not out 0 / LSE -inf")
        return
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())
    top2 = scores.topk(min(2, k.shape[1]), dim=-1)
    if k.shape[1] > 1 and not (top2.values[..., 0] - top2.values[..., 1] >= ONE_HOT_GAP).all():
        raise AssertionError(f"{name}: premise: a row's top two scores are closer than {ONE_HOT_GAP}")
    top = top2.indices[..., 0]  # (batch, nheads, seqlen_q)
    vv = v.permute(0, 2, 1, 3)
    expected = vv.gather(2, top[..., None].expand(-1, -1, -1, vv.shape[-1])).permute(0, 2, 1, 3)
    assert_same_bits(out, expected, f"{name} out", " (P is one-hot: the top key's V row; a row computed without "
                                                   "the exact pass, or before its flag was set, is off or NaN)")
    best = top2.values[..., 0]
    if not (torch.isfinite(lse).all() and ((lse.double() - best).abs() <= best.abs() * 2.0**-16).all()):
        raise AssertionError(f"{name}: LSE is not the top score (float32 rounding)")


def check_forward(out, lse, q, k, v, name, varlen=None):
    """out and LSE by the rule against the float32 reference (softmax_scale 1)."""
    from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_varlen_ref

    if varlen is None:
        ref, ref_lse = attention_ref(q, k, v, softmax_scale=1.0, upcast=True)
        naive, naive_lse = attention_ref(q, k, v, softmax_scale=1.0, upcast=False)
    else:
        ref, ref_lse = attention_varlen_ref(q, k, v, *varlen, softmax_scale=1.0, upcast=True)
        naive, naive_lse = attention_varlen_ref(q, k, v, *varlen, softmax_scale=1.0, upcast=False)
    assert_close_by_rule(out, ref, naive, f"{name} out")
    assert_close_by_rule(lse, ref_lse, naive_lse, f"{name} lse")


def check_varlen_one_hot(out, lse, q, k, v, cu_q, cu_k, name):
    """check_one_hot per sequence of a packed batch."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        (q0, q1), (k0, k1) = bq[i:i + 2], bk[i:i + 2]
        if q1 > q0:
            check_one_hot(out[None, q0:q1], lse[None, :, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                          f"{name} sequence {i}")


GX_DENSE = dict(batch=2, seqlen_q=203, seqlen_k=341, nheads=2, head_dim=64)
GX_VARLEN_Q, GX_VARLEN_K = (300, 0, 77, 3), (257, 33, 77, 0)  # sequence 1: keys, no queries; 3: queries, no keys
GX_REPLAYS = ("ordinary", "large", "ordinary", "mixed", "large")


def gx_inputs(kind, which, dtype, gen):
    """q, k, v of one replay: "ordinary" (Gaussian), "large" (one-hot, through the exact pass) or "mixed" (batch
    element 0 large, 1 ordinary)."""
    if kind == "varlen":
        if which == "ordinary":
            return tuple(torch.randn(sum(lens), 2, 64, generator=gen).to(dtype).to(DEVICE)
                         for lens in (GX_VARLEN_Q, GX_VARLEN_K, GX_VARLEN_K))
        return large_varlen(GX_VARLEN_Q, GX_VARLEN_K, 2, 64, dtype, gen)
    d = GX_DENSE
    ordinary = tuple(torch.randn(d["batch"], n, d["nheads"], d["head_dim"], generator=gen).to(dtype).to(DEVICE)
                     for n in (d["seqlen_q"], d["seqlen_k"], d["seqlen_k"]))
    if which == "ordinary":
        return ordinary
    large = large_dense(d["batch"], d["seqlen_q"], d["seqlen_k"], d["nheads"], d["head_dim"], dtype, gen)
    if which == "large":
        return large
    return tuple(torch.cat([a[:1], b[1:]]) for a, b in zip(large, ordinary))


def gx_check(kind, which, out, lse, inputs, name, varlen=None):
    q, k, v = inputs
    if which == "ordinary":
        check_forward(out, lse, q, k, v, name, varlen)
    elif kind == "varlen":
        check_varlen_one_hot(out, lse, q, k, v, *varlen, name)
    elif which == "large":
        check_one_hot(out, lse, q, k, v, name)
    else:
        check_one_hot(out[:1], lse[:1], q[:1], k[:1], v[:1], f"{name} (large batch element)")
        check_forward(out[1:], lse[1:], q[1:], k[1:], v[1:], f"{name} (ordinary batch element)")


def gx_replays(kind, dtype, runner, eager, gen):
    """For each replay of GX_REPLAYS: runner(q, k, v) -> (out, lse) (the graph, fed through its static inputs),
    checked by gx_check and bitwise against eager(q, k, v)."""
    varlen = None
    if kind == "varlen":
        varlen = (cu_seqlens(GX_VARLEN_Q, DEVICE), cu_seqlens(GX_VARLEN_K, DEVICE))
    replays = GX_REPLAYS if kind != "varlen" else ("ordinary", "large", "ordinary", "large")
    for i, which in enumerate(replays):
        inputs = gx_inputs(kind, which, dtype, gen)
        out, lse = runner(*inputs)
        name = f"{kind} replay {i} ({which})"
        gx_check(kind, which, out, lse, inputs, name, varlen)
        e_out, e_lse = eager(*inputs)
        assert_same_bits(out, e_out, f"{name} out", " (the graph against the eager call)")
        assert_same_bits(lse, e_lse, f"{name} lse", " (the graph against the eager call)")


class GraphRunner:
    """A CUDA graph holding: a producer (q_in = q * 1, written right before the forward), the forward, and
    consumers (copies of out and LSE right after the exact pass). Captured on `first` inputs."""

    def __init__(self, fn, first):
        self.fn = fn
        self.static = [t.clone() for t in first]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.fn(*self.static)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            q_in = self.static[0] * 1
            out, lse = self.fn(q_in, *self.static[1:])
            self.out, self.lse = out.clone(), lse.clone()
        torch.cuda.synchronize()

    def __call__(self, q, k, v):
        for s, t in zip(self.static, (q, k, v)):
            s.copy_(t)
        self.graph.replay()
        torch.cuda.synchronize()
        return self.out.clone(), self.lse.clone()


GX_CASES = {"dense-fp16": ("dense", torch.float16), "dense-bf16": ("dense", torch.bfloat16),
            "varlen-bf16": ("varlen", torch.bfloat16)}


def gx_call(kind):
    if kind == "varlen":
        cu_q, cu_k = cu_seqlens(GX_VARLEN_Q, DEVICE), cu_seqlens(GX_VARLEN_K, DEVICE)
        return lambda q, k, v: flash_attn_hopper.attention_varlen(  # noqa: E731
            q, k, v, cu_q, cu_k, max(GX_VARLEN_Q), max(GX_VARLEN_K), softmax_scale=1.0, return_lse=True)
    return lambda q, k, v: flash_attn_hopper.attention(q, k, v, softmax_scale=1.0, return_lse=True)  # noqa: E731


@pytest.mark.parametrize("case", list(GX_CASES))
def test_exact_pass_in_a_cuda_graph(case):
    kind, dtype = GX_CASES[case]
    require_built(64, dtype)
    gen = gpu_helpers.seeded_generator(case)
    fn = gx_call(kind)
    runner = GraphRunner(fn, gx_inputs(kind, "ordinary", dtype, gen))

    def eager(q, k, v):
        out, lse = fn(q, k, v)
        synchronize()
        return out, lse

    gx_replays(kind, dtype, runner, eager, gen)


# ------------------------------------------------------------------ GW: the profilers (child side)

GW_CONFIGS = ("record-shapes-deterministic-mode", "memory-stack-flops", "cpu-activity", "emit-nvtx", "scheduled")
GW_OPS = {"dense-gqa": ("fwd", "bwd"), "documents": ("fwd", "bwd"), "varlen": ("fwd_varlen", "bwd_varlen")}


def gw_large():
    """A forward whose scores reach the exact pass (large_dense, fp16, head_dim 64): (q, k, v)."""
    return large_dense(1, 150, 200, 2, 64, torch.float16, torch.Generator().manual_seed(39))


def gw_run_all(ps, large):
    """Every problem's results, then the exact-pass forward's (out, lse)."""
    results = [run_problem(p) for p in ps]
    out, lse = flash_attn_hopper.attention(*large, softmax_scale=1.0, return_lse=True)
    synchronize()
    return results, (out, lse)


def gw_profiler_kwargs(config):
    from torch.profiler import ProfilerActivity

    both = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    if config == "record-shapes-deterministic-mode":
        return dict(activities=both, record_shapes=True)
    if config == "memory-stack-flops":
        return dict(activities=both, record_shapes=True, profile_memory=True, with_stack=True, with_flops=True)
    if config == "cpu-activity":
        return dict(activities=[ProfilerActivity.CPU], record_shapes=True)
    raise ValueError(config)


def check_events(events, ps, record_shapes, cuda_activity, name, prefix="flash_attn_hopper"):
    """The library's ops named among the profiler's events; q's shape recorded for a forward when record_shapes;
    some event on the GPU when CUDA activity is on."""
    names = {e.name for e in events}
    for p in ps:
        for op in GW_OPS[p.name]:
            if f"{prefix}::{op}" not in names:
                raise AssertionError(f"{name}: no profiler event {prefix}::{op} ({p.name}); "
                                     f"events: {sorted(names)[:40]}")
        if record_shapes:
            fwd = f"{prefix}::{GW_OPS[p.name][0]}"
            shapes = [list(e.input_shapes[0]) for e in events if e.name == fwd and e.input_shapes]
            if list(p.q.shape) not in shapes:
                raise AssertionError(f"{name}: {fwd} recorded without q's shape {list(p.q.shape)}: {shapes[:4]}")
    if cuda_activity and not any(e.device_type == torch.autograd.DeviceType.CUDA for e in events):
        raise AssertionError(f"{name}: no GPU kernel event with CUDA activity on")


def check_trace_file(path, name):
    with open(path) as f:
        trace = json.load(f)
    names = {e.get("name", "") for e in trace.get("traceEvents", [])}
    if not any(n.startswith("flash_attn_hopper::") for n in names):
        raise AssertionError(f"{name}: the chrome trace {path} names no flash_attn_hopper op")


def compare_all(ps, base, again, where):
    """gw_run_all's results bit for bit those of the baseline."""
    (results0, large0), (results1, large1) = base, again
    for p, r0, r1 in zip(ps, results0, results1):
        compare_bits(p.name, r0, r1, where)
    compare_bits("exact-pass forward", large0, large1, where)


def gw_child(config, trace_dir):
    """GW in this process: the workloads outside the profiler (checked by the rule), then inside it."""
    if config == "record-shapes-deterministic-mode":
        torch.use_deterministic_algorithms(True)
    ps, large = problems(), gw_large()
    base = gw_run_all(ps, large)
    for p, r in zip(ps, base[0]):
        p.check(r)
    check_one_hot(*base[1], *large, "exact-pass forward")
    where = f"under the profiler ({config})"
    if config == "emit-nvtx":
        with torch.autograd.profiler.emit_nvtx(record_shapes=True):
            again = gw_run_all(ps, large)
        compare_all(ps, base, again, where)
        return
    if config == "scheduled":
        paths = []

        def on_ready(prof):
            paths.append(os.path.join(trace_dir, f"trace_{len(paths)}.json"))
            prof.export_chrome_trace(paths[-1])

        kwargs = gw_profiler_kwargs("record-shapes-deterministic-mode")
        schedule = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1)
        with torch.profiler.profile(schedule=schedule, on_trace_ready=on_ready, **kwargs) as prof:
            for step in range(5):
                compare_all(ps, base, gw_run_all(ps, large), f"{where} step {step}")
                prof.step()
        if not paths:
            raise AssertionError(f"{config}: on_trace_ready never ran")
        for path in paths:
            check_trace_file(path, config)
        return
    kwargs = gw_profiler_kwargs(config)
    with torch.profiler.profile(**kwargs) as prof:
        again = gw_run_all(ps, large)
    compare_all(ps, base, again, where)
    from torch.profiler import ProfilerActivity

    check_events(prof.events(), ps, kwargs.get("record_shapes", False),
                 ProfilerActivity.CUDA in kwargs["activities"], config)
    path = os.path.join(trace_dir, "trace.json")
    prof.export_chrome_trace(path)
    check_trace_file(path, config)


CHILD_SCRIPT = """
import sys, zlib
import torch
import test_bug_reports_thirtyninth_gpu as t
torch.manual_seed(zlib.crc32(" ".join(sys.argv[1:2]).encode()))
getattr(t, "gw_child")(*sys.argv[1:])
print("done")
"""

GW_BUILT = [(128, torch.float16), (64, torch.bfloat16), (128, torch.bfloat16), (64, torch.float16)]


@pytest.mark.parametrize("config", GW_CONFIGS)
def test_library_under_the_profiler(config, tmp_path):
    for head_dim, dtype in GW_BUILT:
        require_built(head_dim, dtype)
    gpu_helpers.run_child(CHILD_SCRIPT, config, str(tmp_path), name=f"profiler {config}", timeout=CHILD_TIMEOUT)


# ------------------------------------------------------------------ GY and GZ: torch.compile's partitioner and regions

def scaled_step(p):
    """fn(q, k, v) -> (out, lse) of p's call on 2 q and 0.5 v: exact in fp16 / bf16 whether compiled or not, so
    compiled and eager results can be compared bit for bit."""
    return lambda q, k, v: p.call(q * 2, k, v * 0.5)  # noqa: E731


def check_scaled(p, results):
    """The scaled step's results by the rule (the reference on 2 q, 0.5 v; dQ carries the factor 2, dV 0.5)."""
    q2, v2 = p.q * 2, p.v * 0.5
    scaled = Problem.__new__(Problem)
    scaled.__dict__.update(p.__dict__)
    scaled.q, scaled.v = q2, v2
    out, lse, dq, dk, dv = results
    scaled.check((out, lse, dq / 2, dk, dv * 2))


GY_BUDGETS = (0.0, 0.5)
GY_BACKENDS = ("inductor", "aot_eager_decomp_partition")
GY_PROBLEMS = ("dense-gqa", "documents", "varlen")


def pick(name):
    return next(p for p in problems() if p.name == name)


def compiled_results(p, fn, backend):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    return run_problem(p, compiled)


@pytest.mark.parametrize("backend", GY_BACKENDS)
@pytest.mark.parametrize("budget", GY_BUDGETS)
@pytest.mark.parametrize("problem", GY_PROBLEMS)
def test_memory_budget_partitioner(problem, budget, backend):
    p = pick(problem)
    for head_dim, dtype in p.built():
        require_built(head_dim, dtype)
    fn = scaled_step(p)
    base = run_problem(p, fn)
    check_scaled(p, base)
    import torch._functorch.config as functorch_config

    with functorch_config.patch(activation_memory_budget=budget):
        results = compiled_results(p, fn, backend)
    compare_bits(p.name, base, results, f"compiled, {backend}, activation_memory_budget {budget}")


GZ_BACKENDS = ("aot_eager", "inductor")


def chained_region(p):
    """fn(q, k, v) -> (out2, lse1, lse2) through one nested compile region called twice: layer 2's query is layer
    1's out. Returns (fn, its eager twin without the region)."""
    def block(q, k, v):
        return p.call(q * 2, k, v * 0.5)

    def chain(region):
        def fn(q, k, v):
            out1, lse1 = region(q, k, v)
            out2, lse2 = region(out1, k, v)
            return out2, lse1, lse2
        return fn

    return chain(torch.compiler.nested_compile_region(block)), chain(block)


def run_chain(p, fn):
    leaves = [t.detach().clone().requires_grad_(True) for t in (p.q, p.k, p.v)]
    out2, lse1, lse2 = fn(*leaves)
    grads = torch.autograd.grad([out2, lse1, lse2], leaves, [p.dout, p.dlse, p.dlse * 0.5])
    synchronize()
    return (out2.detach(), lse1.detach(), *grads), lse2.detach()


@pytest.mark.parametrize("backend", GZ_BACKENDS)
@pytest.mark.parametrize("problem", GY_PROBLEMS)
def test_nested_compile_region(problem, backend):
    p = pick(problem)
    for head_dim, dtype in p.built():
        require_built(head_dim, dtype)
    region_fn, eager_fn = chained_region(p)
    base, base_lse2 = run_chain(p, eager_fn)
    # eager by the rule: the first layer's out and LSE (check_scaled's reference) and every result finite
    check_scaled_forward(p, base[0], base[1], base_lse2)
    torch._dynamo.reset()
    compiled = torch.compile(region_fn, backend=backend, fullgraph=True)
    results, lse2 = run_chain(p, compiled)
    compare_bits(p.name, base, results, f"nested compile region, {backend}")
    assert_same_bits(lse2, base_lse2, f"{p.name} lse2", " (nested compile region against eager)")


def check_scaled_forward(p, out2, lse1, lse2):
    """The chain's first layer's LSE and second layer by the rule: the float32 reference of attention(2 out1, k,
    0.5 v), out1 the library's first-layer out (the eager chain's own, the forward being deterministic)."""
    from flash_attn_hopper.testing import assert_close_by_rule, attention_ref, attention_varlen_ref

    opts = {key: val for key, val in p.opts.items() if key != "deterministic"}

    def ref(q, upcast):
        if p.varlen is None:
            return attention_ref(q * 2, p.k, p.v * 0.5, upcast=upcast, **opts)
        return attention_varlen_ref(q * 2, p.k, p.v * 0.5, *p.varlen[:2], upcast=upcast, **opts)

    out1 = flash_attn_hopper.attention(p.q * 2, p.k, p.v * 0.5, **opts) if p.varlen is None else \
        flash_attn_hopper.attention_varlen(p.q * 2, p.k, p.v * 0.5, *p.varlen, **opts)
    assert_close_by_rule(lse1, ref(p.q, True)[1], ref(p.q, False)[1], f"{p.name} layer 1 lse")
    r_out, r_lse = ref(out1, True)
    n_out, n_lse = ref(out1, False)
    assert_close_by_rule(out2, r_out, n_out, f"{p.name} layer 2 out")
    assert_close_by_rule(lse2, r_lse, n_lse, f"{p.name} layer 2 lse")
