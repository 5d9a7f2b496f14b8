"""Development timing of the softcap at two score scales: forward and backward TFLOP/s with inputs scaled by 1 (every
|softmax_scale * S / softcap| below 0.5 for softcap 30) and by 6 (most above it), beside dense at the same shape.
Written for session 34's polynomial tanh (benchmarks/results/2026-12-03_h200_session34/softcap_poly_NOT_LANDED.patch:
the polynomial below 0.5, tanh.approx.f32 above; apply it and build first to time its two paths); on the tree as it
is both scales run the same code (tanh.approx.f32). bf16, batch * seqlen = 16384 tokens, nheads = 2048 / head_dim;
medians of triton.testing.do_bench (session 34's records were taken before return_mode="median" was set: means).
usage: softcap_paths_time.py HDIMS SEQLENS [softcap] [scales]   e.g. 128 1024,4096,16384 30 1,6"""
import sys

import torch
import triton.testing

import flash_attn_hopper as fah

hdims = [int(x) for x in sys.argv[1].split(",")]
seqlens = [int(x) for x in sys.argv[2].split(",")]
cap = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
scales = [float(x) for x in sys.argv[4].split(",")] if len(sys.argv) > 4 else [1.0, 6.0]
torch.manual_seed(0)
for hd in hdims:
    for causal in (False, True):
        for s in seqlens:
            b, h = max(1, 16384 // s), 2048 // hd
            base = [torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            flops = 4 * b * h * s * s * hd / (2 if causal else 1)
            for label, scale, c in [("dense", 1.0, 0.0)] + [(f"cap{cap:g}x{sc:g}", sc, cap) for sc in scales]:
                q, k = ((t * scale).requires_grad_() for t in base[:2])
                v, do = base[2].requires_grad_(), base[3]
                fwd = triton.testing.do_bench(lambda: fah.attention(q, k, v, causal=causal, softcap=c),
                                              warmup=25, rep=100, return_mode="median")
                out = fah.attention(q, k, v, causal=causal, softcap=c)
                bwd = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                              warmup=25, rep=100, return_mode="median")
                print(f"| {hd} | {'yes' if causal else 'no'} | {s} | {label} | fwd {flops / fwd / 1e9:.1f} | "
                      f"bwd {2.5 * flops / bwd / 1e9:.1f} |", flush=True)
