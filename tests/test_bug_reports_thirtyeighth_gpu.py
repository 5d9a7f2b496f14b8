"""Thirty-eighth round of the bug hunt (tests/bug_report_sources.md, "Thirty-eighth round"), GPU part.

GT: the library's kernels launched in a CUDA context other than the primary one: a green context (an SM partition of
the device, torch.cuda.green_contexts, PyTorch >= 2.9 built with CUDA >= 12.8), entered with set_context (its default
stream) or used through its own stream from the primary context. Launch state that a library keeps per device or per
process (csrc sets the kernels' 228 KiB dynamic shared memory attribute once per (kernel, device),
csrc/flash/common/tma.hpp set_max_dynamic_smem_once; the device attributes num_sms and sm90 are cached per device)
was made in whichever context made the first call; a function attribute that is per context leaves the other
context's launch with the default 48 KiB limit ("invalid argument"). Reports: pytorch/pytorch#159104 and #171116
(PyTorch's green contexts: set_context pushes a new CUcontext and switches to its default stream; Stream() gives
streams of the green context), flashinfer-ai/flashinfer#1190 (a serving library creating green contexts by SM
counts for its kernels), flashinfer-ai/flashinfer#4543 (kernel attributes set once per process, cited in round 6).
Earlier rounds never left the primary context (round 6: "no way to set that up on the test machine"). Cases: the
primary context first, then the green one, and the green one first (the process's first library calls there), each
by set_context and by the green stream, and two green contexts of 8 and 24 SMs in turn with the primary one; the
workloads (dense GQA causal deterministic, window + softcap at head_dim 64, varlen at head_dim 96 with empty
sequences, packed documents, scores past the exact pass's bound) give out and LSE, and the deterministic dQ, dK, dV,
bitwise those of the other context (same kernels, same grid), and by the rule.

GU: non-finite output gradients must reach the input gradients. Dynamic loss scaling (torch.amp.GradScaler,
DeepSpeed's and Megatron's loss scalers) raises the scale until a backward overflows and skips the step only when the
unscaled gradients hold an inf or NaN; a backward that turns a non-finite dO or dLSE, or a dV past fp16's range,
into finite values hides the overflow and the optimizer takes a garbage step. Reports: pytorch/pytorch#71502 (the
masked-softmax backward of nn.MultiheadAttention's fast path returned nan_to_num of its gradient, turning NaN from
the incoming gradient into finite values), deepspeedai/DeepSpeed#931 (the loss scaler skips a step only on detected
overflow), and the round-6 note (tests/bug_report_sources.md: "non-finite dO reaching the gradients for GradScaler's
overflow check: still no attention-kernel report"). Kernel mechanisms: a saturating conversion (cvt .satfinite, or a
clamp like the forward's fp16 output clamp extended to the gradients), a NaN-dropping max / select in the
preprocess (D = rowsum(dO o O)) or in dS. Cases: one inf or NaN element of dO, or one inf element of dLSE, in one
query row of one head (dense GQA causal 203 x 341, varlen with a window); every gradient element that row reaches
(its dQ row, and the dK and, for dO, dV rows of every key it sees) is not finite, and everything the row does not
reach (other batch elements or sequences, the other K/V heads, the other dQ rows; dV for a dLSE) is right by the
rule against the float32 reference of the clean gradients. And a dV whose true value is past fp16's range (a sink
key taking ~93 % of 1024 rows' weight, dO 250 on one column: ~2.3e5) comes back +inf, not 65504, with everything else
by the rule; deterministic and GQA (the fp32 sums) too.

GV: grids that assume their CTAs are co-resident, run on fewer SMs than the device attribute reports: the forward's
persistent grid is min(tiles, num_sms) CTAs and the deterministic backward's CTAs spin on turn counters of other CTAs
(csrc/flash/common/semaphore.hpp: "CTAs that wait only on lower-numbered CTAs of the same grid never deadlock: those
were launched first"); num_sms is the device's 132 (an H100 SXM) whatever partition runs the grid. Under a green
context of 8 or 16 SMs far fewer CTAs fit at once; a CTA that waits on one that is not resident hangs the device.
Reports: sgl-project/sglang#30592 and #36657 (DeepGEMM's MegaMoE launched one CTA per SM with a whole-grid barrier
and hung, "grid sync timeout", when other work kept one SM from admitting its CTA), flashinfer-ai/flashinfer#3155
(a persistent tile scheduler sized from a stale SM count deadlocked at its first call), pytorch/pytorch#195378 (a
green context may get fewer SMs than asked, and nothing in PyTorch says how many), pytorch/pytorch#144974
(persistent kernels sized to all SMs while other kernels hold some). Cases: 8 and 16 SMs x the deterministic dense
causal backward (256 CTAs in turn chains of 16), the deterministic GQA backward with the fp32 dK/dV sums (turns
across query heads, FAH_BWD_GQA_GROUP_CTA=0), the head_dim 256 deterministic backward with two dQ lanes
(FAH_BWD_DQ_LANES=2), a varlen deterministic backward (the offsets' running-maximum kernel), and persistent forwards
with many tiles per CTA; each in a child process with a time limit (a hang fails by name), bitwise the primary
context's results, and by the rule.

Not asserted: that a green context really limits the SMs (no API reports its count, pytorch/pytorch#195378, and a
timed slowdown would put a timing threshold in a test); where it does not, GV's cases still fail on a hang or other
bits, but test less than their names say. Children skip (with the reason) where this torch or
driver has no green contexts. Inputs are Gaussian from the per-test seed (tests/conftest.py; the children seed
from the case name). Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per
test when the build lacks a head_dim / dtype. tests/test_bug_reports_thirtyeighth_cpu.py checks the premises."""

import contextlib
import os
import sys

import pytest
import torch

import flash_attn_hopper
import gpu_helpers
from gpu_helpers import GRAD_NAMES, assert_same_bits, cu_seqlens, require_built

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

DEVICE = "cuda"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CHILD_TIMEOUT = 120  # seconds: a child takes ~10 (import, CUDA initialisation, small problems); a hang fails by name
FP16_MAX = 65504.0
EXACT_PASS_GAP = 20.0  # natural units: exp(-20) * 150 keys is far below half an fp16 ulp of the top key's V
EXACT_PASS_LSE = 2.0**16 / 1.4426950408889634  # natural units: the exact pass's bound (csrc softmax.hpp, log2 units)


def randn(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


@contextlib.contextmanager
def env_vars(env):
    """The environment variables of env set for the block (csrc's development knobs, read at every call), the
    previous values back afterwards."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, val in saved.items():
            if val is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = val


def synchronize():
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def document_ids(lengths_per_row):
    rows = [torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)) for lens in lengths_per_row]
    return torch.stack(rows).to(DEVICE)


def lse_like(q):
    shape = (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0])
    return randn(*shape, dtype=torch.float32)


# ------------------------------------------------------------------ workloads of GT and GV (run in a child)

class Workload:
    """One call: q, k, v, dout, dlse, options (varlen: cu_q, cu_k, max_q, max_k); backward=False: forward only."""

    def __init__(self, name, q, k, v, dout, dlse, opts, varlen=None, backward=True, env=None):
        self.name, self.q, self.k, self.v, self.dout, self.dlse = name, q, k, v, dout, dlse
        self.opts, self.varlen, self.backward, self.env = opts, varlen, backward, env or {}

    def run(self):
        """(out, lse, *grads) of one forward (and backward), synchronised: plain tensors."""
        with env_vars(self.env):  # (csrc reads these at every call)
            leaves = [t.detach().requires_grad_(self.backward) for t in (self.q, self.k, self.v)]
            if self.varlen is None:
                out, lse = flash_attn_hopper.attention(*leaves, return_lse=True, **self.opts)
            else:
                out, lse = flash_attn_hopper.attention_varlen(*leaves, *self.varlen, return_lse=True, **self.opts)
            grads = ()
            if self.backward:
                grads = torch.autograd.grad([out, lse], leaves, [self.dout, self.dlse])
            synchronize()
            return (out.detach(), lse.detach(), *grads)

    def check(self, results):
        """out, LSE (and dQ, dK, dV) by the rule against the float32 reference."""
        opts = {key: val for key, val in self.opts.items() if key != "deterministic"}
        if not self.backward:  # the exact pass's workload: each row's top score beats the next by >= EXACT_PASS_GAP
            scores = torch.einsum("bqhd,bkhd->bhqk", self.q.double(), self.k.double()) * self.q.shape[-1] ** -0.5
            top2 = scores.topk(2, dim=-1)
            if not (top2.values[..., 0] - top2.values[..., 1] >= EXACT_PASS_GAP).all():
                raise AssertionError(f"{self.name}: premise: a row's top two scores closer than {EXACT_PASS_GAP}")
            out, lse = results[0], results[1]
            if not (torch.isfinite(out).all() and (lse >= EXACT_PASS_LSE).all()):
                raise AssertionError(f"{self.name}: out not finite or LSE below the exact pass's bound (premise)")
            # P is one-hot to far below an ulp: out is the top key's V row, bit for bit; LSE its score
            top = top2.indices[..., 0]  # (batch, nheads, seqlen_q)
            v = self.v.permute(0, 2, 1, 3)  # (batch, nheads_k = nheads, seqlen_k, head_dim)
            expected = v.gather(2, top[..., None].expand(-1, -1, -1, v.shape[-1])).permute(0, 2, 1, 3)
            assert_same_bits(out, expected, f"{self.name} out", " (P is one-hot: the top key's V row)")
            if not ((lse.double() - top2.values[..., 0]).abs() <= top2.values[..., 0] * 2.0**-16).all():
                raise AssertionError(f"{self.name}: LSE differs from the top score beyond float32 rounding")
        elif self.varlen is None:
            gpu_helpers.check_attention(results[0], results[1], results[2:], self.q, self.k, self.v, self.dout,
                                        self.name, dlse=self.dlse, **opts)
        else:
            gpu_helpers.check_attention_varlen(results[0], results[1], results[2:], self.q, self.k, self.v,
                                               self.dout, *self.varlen[:2], self.name, dlse=self.dlse, **opts)


def _dense(name, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, opts, head_dim_v=None, env=None):
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k = randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    v = randn(batch, seqlen_k, nheads_k, head_dim_v, dtype=dtype)
    dout = randn(batch, seqlen_q, nheads, head_dim_v, dtype=dtype)
    return Workload(name, q, k, v, dout, lse_like(q), opts, env=env)


def _varlen(name, dtype, lq, lk, nheads, nheads_k, head_dim, opts):
    q = randn(sum(lq), nheads, head_dim, dtype=dtype)
    k, v = (randn(sum(lk), nheads_k, head_dim, dtype=dtype) for _ in range(2))
    dout = randn(sum(lq), nheads, head_dim, dtype=dtype)
    varlen = (cu_seqlens(lq, DEVICE), cu_seqlens(lk, DEVICE), max(lq), max(lk))
    return Workload(name, q, k, v, dout, lse_like(q), opts, varlen)


def gt_workloads():
    """GT: one call of each kernel family, deterministic where there is a backward (bitwise comparable)."""
    det = dict(deterministic=True)
    # q rows a * ones (a in [80, 100]), k rows c * ones (c = 10 + 0.5 j, permuted per batch and head): scaled scores
    # 8 a c, exact in float32, up to ~6.8e4 (past 2^16 in log2 units: the exact pass), the top beating the next by
    # 4 a >= 320 (P one-hot)
    batch, seqlen, nheads, hd = 2, 150, 2, 64
    a = torch.randint(80, 101, (batch, seqlen, nheads, 1)).expand(-1, -1, -1, hd)
    c = torch.stack([torch.stack([torch.randperm(seqlen) for _ in range(nheads)], -1) for _ in range(batch)])
    huge_q = a.to(torch.float16).to(DEVICE)
    huge_k = (10 + 0.5 * c.double())[..., None].expand(-1, -1, -1, hd).to(torch.float16).to(DEVICE)
    return [
        _dense("dense-gqa-causal", torch.float16, 2, 203, 341, 8, 2, 128, dict(causal=True, **det)),
        _dense("window-softcap-64", torch.bfloat16, 2, 300, 300, 4, 4, 64,
               dict(window_size=(100, 0), softcap=30.0, **det)),
        _varlen("varlen-96", torch.bfloat16, (1, 300, 0, 77), (5, 257, 33, 77), 4, 2, 96, dict(causal=True, **det)),
        Workload("documents", *(randn(2, 300, 4, 128, dtype=torch.bfloat16) for _ in range(4)),
                 None, dict(causal=True, document_ids=document_ids([(100, 150, 50), (7, 293)]), **det)),
        Workload("exact-pass", huge_q, huge_k, randn(batch, seqlen, nheads, hd, dtype=torch.float16), None, None,
                 {}, backward=False),
    ]


def _fix_documents_dlse(workloads):
    for w in workloads:
        if w.dlse is None and w.backward:
            w.dlse = lse_like(w.q)
    return workloads


GV_GROUPS = ("bwd-det-dense", "bwd-det-gqa-sums", "bwd-det-two-lanes", "varlen-det", "fwd-persistent")


def gv_workloads(group):
    """GV: grids of many CTAs with cross-CTA turns (deterministic backward) or many tiles per persistent CTA."""
    det = dict(deterministic=True)
    if group == "bwd-det-dense":  # 16 key blocks x 8 heads x 2: 256 CTAs, dQ turns in chains of 16
        return [_dense(group, torch.bfloat16, 2, 2048, 2048, 8, 8, 128, dict(causal=True, **det))]
    if group == "bwd-det-gqa-sums":  # dK / dV added in query-head order through the dkv semaphores
        return [_dense(group, torch.float16, 2, 1536, 1536, 8, 2, 64, dict(det), env={"FAH_BWD_GQA_GROUP_CTA": "0"})]
    if group == "bwd-det-two-lanes":  # head_dim 256, two dQ copies with their own queues
        return [_dense(group, torch.bfloat16, 1, 1024, 1024, 4, 4, 256, dict(det), env={"FAH_BWD_DQ_LANES": "2"})]
    if group == "varlen-det":
        return [_varlen(group, torch.float16, (700, 1, 0, 1500, 129, 300), (900, 0, 33, 1600, 129, 2),
                        8, 2, 128, dict(causal=True, **det))]
    assert group == "fwd-persistent"
    return [
        _dense(f"{group}-window-64", torch.float16, 4, 2048, 2048, 8, 8, 64, dict(window_size=(256, 0), **det)),
        _dense(f"{group}-unmasked-128", torch.bfloat16, 4, 1024, 1024, 16, 4, 128, dict(det)),
    ]


# ------------------------------------------------------------------ the green context (child side)

def green_support():
    """None when this torch and driver make green contexts, else why not."""
    gc_mod = getattr(torch.cuda, "green_contexts", None)
    if gc_mod is None or not getattr(gc_mod, "SUPPORTED", False):
        return f"torch {torch.__version__} has no green context support (torch.cuda.green_contexts)"
    return None


class Green:
    """A green context of `sms` SMs used by `mode`: "set_context" (pushed, its default stream current) or "stream"
    (its own stream made current from the primary context)."""

    def __init__(self, sms, mode):
        self.sms, self.mode = sms, mode
        try:
            self.ctx = torch.cuda.green_contexts.GreenContext.create(sms, torch.cuda.current_device())
        except RuntimeError as e:  # the driver refuses (older than 12.8, MIG, MPS): no green context here
            print(f"SKIP: green context of {sms} SMs not created: {str(e)[:300]}")
            sys.exit(0)

    def run(self, fn):
        synchronize()
        if self.mode == "set_context":
            # The pushed context is current on this thread only: autograd's device thread would run the backward in
            # the primary context (and unordered with the forward), so the backward runs on this thread.
            self.ctx.set_context()
            try:
                with torch.autograd.set_multithreading_enabled(False):
                    result = fn()
                synchronize()
            finally:
                self.ctx.pop_context()
            return result
        stream = self.ctx.Stream()
        if not isinstance(stream, torch.cuda.Stream):
            stream = torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                                       device_type=stream.device_type)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            result = fn()
        stream.synchronize()
        return result


def compare_bits(name, first, second, where):
    for what, a, b in zip(("out", "lse", *GRAD_NAMES), first, second):
        assert_same_bits(b, a, f"{name} {what}", f" ({where}: the same call on the same kernels and grid)")


def gt_child(mode, order, sms):
    """GT in this process: the workloads in the primary context and in green contexts, in the case's order."""
    workloads = _fix_documents_dlse(gt_workloads())
    sizes = [int(s) for s in str(sms).split("+")]
    if order == "green-first":  # the process's first library calls are made in the green context
        greens = [Green(s, mode) for s in sizes]
        in_green = [greens[0].run(w.run) for w in workloads]
        in_primary = [w.run() for w in workloads]
        runs = [(f"green {sizes[0]} SMs first", in_green)]
    else:
        in_primary = [w.run() for w in workloads]
        greens = [Green(s, mode) for s in sizes]
        runs = []
        for green in greens:  # two contexts: green, primary, green again
            runs.append((f"green {green.sms} SMs", [green.run(w.run) for w in workloads]))
            runs.append(("primary again", [w.run() for w in workloads]))
    for w, primary in zip(workloads, in_primary):
        w.check(primary)
    for where, results in runs:
        for w, primary, other in zip(workloads, in_primary, results):
            compare_bits(w.name, primary, other, where)


def gv_child(mode, sms, group):
    """GV in this process: the group's workloads in the primary context, then in a green context of `sms` SMs."""
    green = Green(int(sms), mode)
    for w in gv_workloads(group):
        w.dlse = w.dlse if w.dlse is not None else lse_like(w.q)
        primary = w.run()
        w.check(primary)
        compare_bits(w.name, primary, green.run(w.run), f"green context of {sms} SMs")


CHILD_SCRIPT = """
import sys, zlib
import torch
import test_bug_reports_thirtyeighth_gpu as t
why = t.green_support()
if why is not None:
    print("SKIP: " + why)
    sys.exit(0)
torch.manual_seed(zlib.crc32(" ".join(sys.argv[1:]).encode()))
torch.zeros(1, device="cuda")  # the primary context first (GreenContext.create warns without one)
getattr(t, sys.argv[1])(*sys.argv[2:])
print("done")
"""


def run_child(*args):
    """CHILD_SCRIPT with args (a child function of this module and its arguments): skips when the child says green
    contexts are missing, fails by name on a non-zero exit or past CHILD_TIMEOUT (a hang: a grid waiting on CTAs
    that cannot run?)."""
    gpu_helpers.run_child(CHILD_SCRIPT, *args, name=" ".join(args), timeout=CHILD_TIMEOUT)


def _require(pairs):
    for head_dim, dtype in pairs:
        require_built(head_dim, dtype)


GT_CASES = {  # name: (mode, order, SMs: one context, or two separated by "+")
    "set_context-primary-first": ("set_context", "primary-first", "16"),
    "set_context-green-first": ("set_context", "green-first", "16"),
    "stream-primary-first": ("stream", "primary-first", "16"),
    "stream-green-first": ("stream", "green-first", "16"),
    "stream-two-contexts": ("stream", "primary-first", "8+24"),
}
GT_BUILT = [(128, torch.float16), (64, torch.bfloat16), (96, torch.bfloat16), (128, torch.bfloat16),
            (64, torch.float16)]


@pytest.mark.parametrize("case", list(GT_CASES))
def test_library_in_a_green_context(case):
    _require(GT_BUILT)
    run_child("gt_child", *GT_CASES[case])


GV_SMS = (8, 16)
GV_BUILT = {"bwd-det-dense": [(128, torch.bfloat16)], "bwd-det-gqa-sums": [(64, torch.float16)],
            "bwd-det-two-lanes": [(256, torch.bfloat16)], "varlen-det": [(128, torch.float16)],
            "fwd-persistent": [(64, torch.float16), (128, torch.bfloat16)]}


@pytest.mark.parametrize("group", GV_GROUPS)
@pytest.mark.parametrize("sms", GV_SMS)
def test_co_resident_grids_on_fewer_sms(sms, group):
    _require(GV_BUILT[group])
    run_child("gv_child", "stream" if sms == 8 else "set_context", str(sms), group)


# ------------------------------------------------------------------ GU: non-finite output gradients

GU_ROW, GU_HEAD, GU_COL = 150, 1, 5  # the poisoned dO / dLSE element: (batch 0,) query row, head, dO column
GU_VARLEN_Q, GU_VARLEN_K, GU_VARLEN_SEQ, GU_VARLEN_ROW = (77, 0, 300, 5), (100, 33, 257, 5), 2, 120
GU_WINDOW = (64, 16)
GU_KINDS = ("dout-inf", "dout-nan", "dlse-inf")
GU_CASES = {f"dense-{kind}-{dt}": ("dense", kind, dt) for kind in GU_KINDS for dt in DTYPES}
GU_CASES.update({f"varlen-{kind}": ("varlen", kind, ("fp16", "bf16", "fp16")[i]) for i, kind in enumerate(GU_KINDS)})


class GuProblem:
    """q, k, v, dout, dlse (clean) and the poisoned copies, the options, and the poisoned element's reach: masks of
    the gradient elements that must be non-finite ("reach", per row) and those not compared ("skip")."""

    def __init__(self, workload, kind, dtype):
        self.workload, self.kind, self.dtype = workload, kind, dtype
        if workload == "dense":  # batch 3, GQA 4 / 2, bottom-right causal 203 x 341
            batch, sq, sk, nheads, nheads_k, hd = 3, 203, 341, 4, 2, 128
            self.q, self.dout = randn(batch, sq, nheads, hd, dtype=dtype), randn(batch, sq, nheads, hd, dtype=dtype)
            self.k, self.v = (randn(batch, sk, nheads_k, hd, dtype=dtype) for _ in range(2))
            self.opts, self.varlen = dict(causal=True, deterministic=dtype == torch.bfloat16), None
            self.row = (0, GU_ROW)  # (batch, row) of dO; dQ index (0, GU_ROW, GU_HEAD)
            base, lo_k = GU_ROW + sk - sq, 0
            seen = (0, base + 1)  # bottom-right causal: keys 0 .. base
            self.key_rows = lambda j: (0, j)
        else:
            nheads, nheads_k, hd = 4, 2, 64
            lq, lk = GU_VARLEN_Q, GU_VARLEN_K
            self.q, self.dout = (randn(sum(lq), nheads, hd, dtype=dtype) for _ in range(2))
            self.k, self.v = (randn(sum(lk), nheads_k, hd, dtype=dtype) for _ in range(2))
            self.opts = dict(window_size=GU_WINDOW)
            self.varlen = (cu_seqlens(lq, DEVICE), cu_seqlens(lk, DEVICE), max(lq), max(lk))
            off_q, off_k = sum(lq[:GU_VARLEN_SEQ]), sum(lk[:GU_VARLEN_SEQ])
            sq, sk = lq[GU_VARLEN_SEQ], lk[GU_VARLEN_SEQ]
            self.row = (off_q + GU_VARLEN_ROW,)
            base, lo_k = GU_VARLEN_ROW + sk - sq, off_k
            seen = (max(base - GU_WINDOW[0], 0), min(base + GU_WINDOW[1] + 1, sk))
            self.key_rows = lambda j: (j,)
        self.seen = range(lo_k + seen[0], lo_k + seen[1])
        self.kv_head = GU_HEAD // (nheads // nheads_k)
        self.dlse = lse_like(self.q)
        self.bad_dout, self.bad_dlse = self.dout.clone(), self.dlse.clone()
        value = float("nan") if kind == "dout-nan" else float("inf")
        if kind.startswith("dout"):
            self.bad_dout[(*self.row, GU_HEAD, GU_COL)] = value
        else:
            lse_index = (self.row[0], GU_HEAD, self.row[1]) if self.varlen is None else (GU_HEAD, self.row[0])
            self.bad_dlse[lse_index] = value

    def masks(self):
        """(reach, skip) per gradient name: reach[name] lists index tuples of rows (dQ: (.., row, head); dK / dV:
        (.., key row, kv head)) that must hold a non-finite element; skip[name] is a boolean mask of the elements not
        compared by the rule (the poisoned batch element's or sequence's rows of the reached heads)."""
        dq_row = (*self.row, GU_HEAD)
        key_rows = [(*self.key_rows(j), self.kv_head) for j in self.seen]
        reach = {"dq": [dq_row], "dk": key_rows, "dv": key_rows if self.kind.startswith("dout") else []}
        skip = {name: torch.zeros(t.shape, dtype=torch.bool, device=t.device)
                for name, t in zip(GRAD_NAMES, (self.q, self.k, self.v))}
        skip["dq"][dq_row] = True
        for name in ("dk", "dv") if self.kind.startswith("dout") else ("dk",):
            if self.varlen is None:
                skip[name][0, :, self.kv_head] = True  # keys the row does not see: 0 x NaN in any dense tile
            else:
                lo, hi = (int(x) for x in self.varlen[1][GU_VARLEN_SEQ:GU_VARLEN_SEQ + 2])
                skip[name][lo:hi, self.kv_head] = True
        return reach, skip

    def run(self):
        if self.varlen is None:
            return gpu_helpers.run_attention(self.q, self.k, self.v, self.bad_dout, dlse=self.bad_dlse, **self.opts)
        return gpu_helpers.run_attention_varlen(self.q, self.k, self.v, self.bad_dout, *self.varlen,
                                                dlse=self.bad_dlse, **self.opts)

    def references(self):
        """The float32 and naive references of the CLEAN gradients (what every element the poison does not reach
        must be)."""
        from flash_attn_hopper.testing import attention_ref_grads, attention_varlen_ref_grads

        opts = {key: val for key, val in self.opts.items() if key != "deterministic"}
        if self.varlen is None:
            grads = lambda up: attention_ref_grads(self.q, self.k, self.v, self.dout, upcast=up,  # noqa: E731
                                                   dlse=self.dlse, **opts)
        else:
            grads = lambda up: attention_varlen_ref_grads(self.q, self.k, self.v, self.dout,  # noqa: E731
                                                          *self.varlen[:2], upcast=up, dlse=self.dlse, **opts)
        return grads(True), grads(False)


def check_reach_and_rest(name, grads, reach, skip, ref, naive):
    """Every row in reach holds a non-finite element; every element outside skip is right by the rule."""
    from flash_attn_hopper.testing import assert_close_by_rule

    for gname, g, r, n in zip(GRAD_NAMES, grads, ref, naive):
        finite_rows = [idx for idx in reach[gname] if torch.isfinite(g[idx]).all()]
        if finite_rows:
            raise AssertionError(f"{name} {gname}: {len(finite_rows)} of {len(reach[gname])} rows that the "
                                 f"non-finite output gradient reaches are finite (first {finite_rows[:3]}): an "
                                 "overflow check (GradScaler) would miss it")
        keep = ~skip[gname]
        assert_close_by_rule(g.masked_fill(~keep, 0), r.masked_fill(~keep, 0), n.masked_fill(~keep, 0),
                             f"{name} {gname} (elements the poison does not reach)")


@pytest.mark.parametrize("case", list(GU_CASES))
def test_non_finite_output_gradients_reach_the_input_gradients(case):
    workload, kind, dtype_name = GU_CASES[case]
    dtype = DTYPES[dtype_name]
    require_built(128 if workload == "dense" else 64, dtype)
    p = GuProblem(workload, kind, dtype)
    _, _, grads = p.run()
    reach, skip = p.masks()
    ref, naive = p.references()
    check_reach_and_rest(case, grads, reach, skip, ref, naive)


GU_OVERFLOW_CASES = {  # name: nheads, nheads_k, deterministic, env
    "mha": (2, 2, False, {}),
    "mha-deterministic": (2, 2, True, {}),
    "gqa-sums": (4, 2, False, {"FAH_BWD_GQA_GROUP_CTA": "0"}),
}
GU_SINK, GU_SEQLEN, GU_DOUT = 5, 1024, 250.0


def gu_overflow_problem(nheads, nheads_k):
    """fp16, batch 2, 1024 x 1024, head_dim 64, no mask: every query is (4 + 0.5 noise) along column 0, key GU_SINK
    is 20 along it (its scaled score ~10 above the others': ~93 % of each row's weight), and dO is GU_DOUT on column
    0: dV[GU_SINK, 0] = sum_i P_i,sink x 250 ~ 2.3e5 (4.6e5 with two query heads per K/V head), past fp16's range;
    the other gradients stay inside it (dK up to ~2.7e4 with GQA)."""
    dtype = torch.float16
    q = (randn(2, GU_SEQLEN, nheads, 64, dtype=torch.float32) * 0.5)
    q[..., 0] += 4
    k = randn(2, GU_SEQLEN, nheads_k, 64, dtype=torch.float32)
    k[:, GU_SINK] = 0
    k[:, GU_SINK, :, 0] = 20
    v = randn(2, GU_SEQLEN, nheads_k, 64, dtype=torch.float32)
    dout = randn(2, GU_SEQLEN, nheads, 64, dtype=torch.float32)
    dout[..., 0] = GU_DOUT
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def gu_overflow_split(ref):
    """(overflow, ambiguous): masks of the float32 reference's elements past 2 x fp16's largest value (must come back
    inf of their sign) and of those between 60000 and that (no case may hold any: rounding decides there)."""
    mag = ref.abs()
    return mag > 2 * FP16_MAX, (mag > 60000) & (mag <= 2 * FP16_MAX)


@pytest.mark.parametrize("case", list(GU_OVERFLOW_CASES))
def test_gradients_past_fp16_range_come_back_infinite(case):
    from flash_attn_hopper.testing import assert_close_by_rule, attention_ref_grads

    nheads, nheads_k, deterministic, env = GU_OVERFLOW_CASES[case]
    require_built(64, torch.float16)
    q, k, v, dout = gu_overflow_problem(nheads, nheads_k)
    with env_vars(env):
        _, _, grads = gpu_helpers.run_attention(q, k, v, dout, deterministic=deterministic)
    ref = attention_ref_grads(q, k, v, dout, upcast=True)
    naive = attention_ref_grads(q, k, v, dout, upcast=False)
    overflow_total = 0
    for gname, g, r, n in zip(GRAD_NAMES, grads, ref, naive):
        over, ambiguous = gu_overflow_split(r)
        assert not ambiguous.any(), f"{case} {gname}: premise: reference values within rounding of fp16's range"
        overflow_total += int(over.sum())
        want = torch.where(r > 0, float("inf"), float("-inf"))[over]
        if not torch.equal(g[over].float(), want):
            raise AssertionError(f"{case} {gname}: {int(over.sum())} elements past fp16's range (float32 reference "
                                 f"up to {r.abs().max().item():.3g}) came back {g[over][:4].tolist()}, not +-inf: "
                                 "a saturated gradient hides the overflow from the loss scaler")
        assert_close_by_rule(g.masked_fill(over, 0), r.masked_fill(over, 0), n.masked_fill(over, 0),
                             f"{case} {gname} (the elements inside fp16's range)")
    assert overflow_total >= 2 * nheads_k, f"{case}: premise: dV of the sink key overflows (each batch element, " \
                                           "each K/V head)"
