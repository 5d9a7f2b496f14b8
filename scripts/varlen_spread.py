"""Why the varlen forward at seqlen 1024 sometimes reads 0.7-0.8 of dense in the grid (session 42): the benchmark's
timing (triton do_bench with its L2 clear, median and spread) of dense and varlen at 1024, beside the same calls
replayed from a CUDA graph (no host work in the timed region), and the host time per call of each path on tiny
inputs (a CPU-bound loop). If the graph replays are level and the eager varlen spreads, the varlen call's host work
is exposed in the eager timing.
usage: varlen_spread.py [SEQLEN] [HEAD_DIM]"""
import sys

import torch
import triton.testing

import flash_attn_hopper as fah
import host_overhead  # scripts/, this file's folder

seqlen = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
hd = int(sys.argv[2]) if len(sys.argv) > 2 else 128
batch, nheads = 16384 // seqlen, 2048 // hd
torch.manual_seed(0)


def stats(ms, flops):
    t = torch.tensor(ms)
    q = [float(t.quantile(x)) for x in (0.0, 0.2, 0.5, 0.8, 1.0)]
    return " ".join(f"{flops / m / 1e9:.0f}" for m in reversed(q)) + f" (n {len(ms)})"


def host_us(fn, iters=300):
    return host_overhead.bench(fn, iters)  # a CPU-bound loop's wall time per call


def calls(b, s, h, d, causal):
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
    qv, kv, vv = (t.reshape(b * s, h, d) for t in (q, k, v))

    def dense():
        return fah.attention(q, k, v, causal=causal)

    def varlen():
        return fah.attention_varlen(qv, kv, vv, cu, cu, s, s, causal=causal)

    return dense, varlen


print("TFLOP/s as max p80 median p20 min (from the timings' min p20 median p80 max)")
for causal in (False, True):
    flops = 4 * batch * nheads * seqlen * seqlen * hd / (2 if causal else 1)
    dense, varlen = calls(batch, seqlen, nheads, hd, causal)
    for name, fn in (("dense", dense), ("varlen", varlen)):
        with torch.no_grad():
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="all")
            fn()
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
                with torch.cuda.graph(g, stream=s):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            ms_graph = triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="all")
        print(f"causal {causal} {name:6s} eager {stats(ms, flops)} | graph {stats(ms_graph, flops)}", flush=True)
    tiny_dense, tiny_varlen = calls(1, 128, 2, 64, causal)
    q, k, v = (torch.randn(128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    window = fah.interface._check_window((-1, -1), causal)

    def tiny_op():  # the registered op alone: no Python checks
        return torch.ops.flash_attn_hopper.fwd_varlen.default(q, k, v, cu, cu, 128, 128, 0.125, causal, *window, 0.0,
                                                              False)

    with torch.no_grad():
        print(f"causal {causal} host us per call (tiny inputs): dense {host_us(tiny_dense):.1f} varlen "
              f"{host_us(tiny_varlen):.1f} varlen op alone {host_us(tiny_op):.1f}", flush=True)
