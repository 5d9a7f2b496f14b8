"""torch.compile and torch.library checks of the forward and backward ops (GPU)."""

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref

pytestmark = [pytest.mark.gpu, pytest.mark.requires_sm90]


def _inputs(batch, seqlen_q, seqlen_k, nheads, head_dim, dtype, requires_grad=False):
    def make(seqlen):
        return torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=dtype, requires_grad=requires_grad)

    return make(seqlen_q), make(seqlen_k), make(seqlen_k)


def _built_head_dim():
    cfg = flash_attn_hopper.build_config()
    for hd in (64, 128, 256):
        if hd in cfg["head_dims"]:
            return hd, cfg["dtypes"][0]
    pytest.skip("no head dim in this build")


# (causal, window_left, window_right, softcap, deterministic) as the ops take them
OPTIONS = [(False, -1, -1, 0.0, False), (True, -1, 0, 0.0, False), (False, 17, 3, 0.0, True),
           (True, 64, 0, 15.0, True)]
OPTION_IDS = ["full", "causal", "window-deterministic", "causal-window-softcap-deterministic"]


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("seqlens", [(1, 1), (113, 203), (256, 128)])
def test_opcheck_fwd(seqlens, options):
    head_dim, dtype = _built_head_dim()
    q, k, v = _inputs(2, *seqlens, 3, head_dim, dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.flash_attn_hopper.fwd.default, (q, k, v, head_dim**-0.5, *options))


@pytest.mark.parametrize("with_dlse", [False, True], ids=["no-dlse", "dlse"])
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_opcheck_bwd(options, with_dlse):
    head_dim, dtype = _built_head_dim()
    q, k, v = _inputs(2, 77, 140, 3, head_dim, dtype)
    out, lse = torch.ops.flash_attn_hopper.fwd(q, k, v, head_dim**-0.5, *options)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    torch.library.opcheck(
        torch.ops.flash_attn_hopper.bwd.default, (dout, q, k, v, out, lse, dlse, head_dim**-0.5, *options)
    )


class _Block(torch.nn.Module):
    """A projection, attention and an output projection: enough graph around the op to catch breaks."""

    def __init__(self, hidden, nheads, dtype):
        super().__init__()
        self.nheads = nheads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, device="cuda", dtype=dtype)
        self.proj = torch.nn.Linear(hidden, hidden, device="cuda", dtype=dtype)

    def forward(self, x, attn):
        batch, seqlen, hidden = x.shape
        qkv = self.qkv(x).view(batch, seqlen, 3, self.nheads, hidden // self.nheads)
        out = attn(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
        return self.proj(out.reshape(batch, seqlen, hidden))


def _reference_attn(q, k, v, causal):
    return attention_ref(q, k, v, causal=causal)[0].to(q.dtype)


def test_compile_fullgraph_forward_and_backward():
    head_dim, dtype = _built_head_dim()
    nheads = 2
    block = _Block(nheads * head_dim, nheads, dtype)
    x = torch.randn(2, 300, nheads * head_dim, device="cuda", dtype=dtype)

    def run(fn, attn):
        block.zero_grad(set_to_none=True)
        xx = x.detach().clone().requires_grad_(True)
        y = fn(xx, attn)
        (y.float() * torch.linspace(-1, 1, y.shape[-1], device="cuda")).sum().backward()
        return y.detach(), xx.grad, block.qkv.weight.grad

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)  # a graph break raises here
    y_c, dx_c, dw_c = run(compiled, flash_attn_hopper.attention)
    y_e, dx_e, dw_e = run(block, flash_attn_hopper.attention)
    # The same kernels run in both, so compiled and eager agree to within what the surrounding ops' fusion changes.
    y_ref, dx_ref, dw_ref = run(lambda xx, _: block.float()(xx.float(), _reference_attn), None)
    block.to(dtype)
    y_naive, dx_naive, dw_naive = run(block, _reference_attn)
    for name, got in (("compiled", (y_c, dx_c, dw_c)), ("eager", (y_e, dx_e, dw_e))):
        for part, a, r, n in zip(("out", "dx", "dW_qkv"), got, (y_ref, dx_ref, dw_ref), (y_naive, dx_naive, dw_naive)):
            assert_close_by_rule(a.float(), r.float(), n.float(), f"{name} {part}")


def test_compile_counts_one_graph():
    head_dim, dtype = _built_head_dim()
    q, k, v = _inputs(1, 128, 128, 2, head_dim, dtype)
    explanation = torch._dynamo.explain(lambda a, b, c: flash_attn_hopper.attention(a, b, c, causal=True) * 2)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_opcheck_varlen(options):
    """fwd_varlen and bwd_varlen: schemas, fake kernels and autograd registration (lengths 0, 77, 130)."""
    head_dim, dtype = _built_head_dim()
    lengths_q, lengths_k = [0, 77, 130], [10, 77, 60]
    cu_q = torch.tensor([0, 0, 77, 207], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 10, 87, 147], dtype=torch.int32, device="cuda")
    assert cu_q.diff().tolist() == lengths_q and cu_k.diff().tolist() == lengths_k
    q = torch.randn(207, 4, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(147, 2, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(147, 2, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    args = (cu_q, cu_k, 130, 77, head_dim**-0.5, *options)
    torch.library.opcheck(torch.ops.flash_attn_hopper.fwd_varlen.default, (q, k, v, *args))
    out, lse = torch.ops.flash_attn_hopper.fwd_varlen(q.detach(), k.detach(), v.detach(), *args)
    dout = torch.randn_like(out)
    torch.library.opcheck(
        torch.ops.flash_attn_hopper.bwd_varlen.default,
        (dout, q.detach(), k.detach(), v.detach(), out, lse, torch.randn_like(lse), *args),
    )


def test_compile_varlen_fullgraph():
    """attention_varlen under torch.compile(fullgraph=True): no graph break, the eager result."""
    head_dim, dtype = _built_head_dim()
    cu = torch.tensor([0, 100, 100, 250], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(250, 2, head_dim, device="cuda", dtype=dtype) for _ in range(3))

    def f(q, k, v):
        return flash_attn_hopper.attention_varlen(q, k, v, cu, cu, 150, 150, causal=True) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(q, k, v), f(q, k, v))


def compiled_cold_then_cached(f):
    """Yields ("cold" | "cached", compiled f, its CompileCounterWithBackend) twice: torch.compile(f) with inductor
    (fullgraph, dynamic shapes) after torch._dynamo.reset(), inside an FX graph cache (point TORCHINDUCTOR_CACHE_DIR
    at an empty directory first), so that the second pass compiles from the cache the first filled. Callers run
    their calls inside each pass and count the graphs with op_graphs."""
    import torch._inductor.config
    from torch._dynamo.testing import CompileCounterWithBackend

    for compile_pass in ("cold", "cached"):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
        with torch._inductor.config.patch(fx_graph_cache=True):
            yield compile_pass, compiled, counter


def op_graphs(counter):
    """Graphs handed to the backend that call a flash_attn_hopper op (torch 2.14 also compiles an empty graph beside a
    function's graph; a recompile is a second graph with the op)."""
    return sum("flash_attn_hopper" in g.code for g in counter.graphs)


def test_compile_varlen_new_max_seqlen_one_graph(tmp_path, monkeypatch):
    """torch.compile(dynamic=True, fullgraph=True) with inductor, a new max_seqlen_q/k on every call (the longest
    sequence of each batch, as a collator passes it, one reaching q's rows, and once bounds past the token totals):
    one graph for every maximum (the varlen ops take them as SymInt), and out, LSE, dQ, dK, dV are the eager call's
    bit for bit (deterministic=True, so dQ's order is fixed). Compiled twice, in an FX graph cache directory of its
    own: cold, then (after torch._dynamo.reset) from the cache the first filled. With torch 2.11, a guard on
    min(max_seqlen_q, q's rows) came back from the cache as `max_q < q.size()[0]` and the call reaching the rows
    recompiled (session 55, an H100 with a warm cache; tests/test_bug_reports_ninth_cpu.py has the CPU case)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    head_dim, dtype = _built_head_dim()

    def f(q, k, v, cu_q, cu_k, max_q, max_k):
        return flash_attn_hopper.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True,
                                                  deterministic=True)

    # (lengths_q, lengths_k, max_seqlen_q, max_seqlen_k): the longest sequences, once bounds past the token totals
    batches = [([77, 130, 5], [10, 200, 60], 130, 200), ([300, 1], [129, 1], 300, 129),
               ([0, 513, 64, 2], [700, 513, 0, 3], 513, 700), ([1000], [1000], 1000, 1000),
               ([17, 257], [300, 33], 2048, 4096)]
    try:
        for compile_pass, compiled, counter in compiled_cold_then_cached(f):
            for lengths_q, lengths_k, max_q, max_k in batches:
                cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32,
                                           device="cuda") for n in (lengths_q, lengths_k))
                # 3 heads: no size of the first call equal to another (dynamo would tie them and recompile when
                # they part)
                base = [torch.randn(sum(n), 3, head_dim, device="cuda", dtype=dtype)
                        for n in (lengths_q, lengths_k, lengths_k)]
                dout = torch.randn_like(base[0])
                dlse = torch.randn(3, sum(lengths_q), device="cuda")
                runs = []
                for fn in (compiled, f):
                    leaves = [t.clone().requires_grad_(True) for t in base]
                    out, lse = fn(*leaves, cu_q, cu_k, max_q, max_k)
                    grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
                    runs.append((out, lse, *grads))
                for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *runs):
                    assert torch.equal(a, b), (f"{compile_pass}: lengths {lengths_q}/{lengths_k}: compiled "
                                               f"{name} != eager")
            assert op_graphs(counter) == 1, f"{compile_pass}: {op_graphs(counter)} graphs for {len(batches)} maxima"
    finally:
        torch._dynamo.reset()


# The exponent's scale times log2(e) reaches the kernels as a float32 that must be normal and positive: the ops
# themselves reject a softmax_scale that rounds to 0 or a softcap that overflows there (the Python API stops both
# earlier, with a ValueError), for the forward and the backward alike, before any launch.
@pytest.mark.parametrize(
    "scale, softcap, name",
    [(1e-50, 0.0, "softmax_scale"), (10.0, 2.5e38, "softcap")],
    ids=["scale-rounds-to-zero", "softcap-overflows"],
)
def test_ops_reject_an_exponent_scale_float32_cannot_hold(scale, softcap, name):
    head_dim, dtype = _built_head_dim()
    q, k, v = _inputs(1, 64, 64, 2, head_dim, dtype)
    options = (False, -1, -1, softcap, False)
    # softmax_scale's own check (class CX) says "softmax_scale must be a positive normal float32 value, also times
    # log2(e)"; the exponent-scale check "<name> times log2(e) must be a positive normal float32 value"
    pattern = name + r"( times log2\(e\))? must be a positive normal float32 value(, also times log2\(e\))?"
    with pytest.raises(RuntimeError, match=pattern):
        torch.ops.flash_attn_hopper.fwd(q, k, v, scale, *options)
    out = torch.randn_like(q)
    lse = torch.randn(1, 2, 64, device="cuda", dtype=torch.float32)
    with pytest.raises(RuntimeError, match=pattern):
        torch.ops.flash_attn_hopper.bwd(torch.randn_like(q), q, k, v, out, lse, None, scale, *options)
