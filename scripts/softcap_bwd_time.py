"""Development timing of the softcap backward at any head_dim (the benchmark's softcap points are head_dim 128 only).
Usage: softcap_bwd_time.py HDIMS SEQLENS [softcap]. bf16, batch * seqlen = 16384 tokens, nheads = 2048 / head_dim,
both masks; prints the backward's TFLOP/s (2.5 x the forward's FLOPs), median of triton.testing.do_bench."""
import sys

import torch
import triton.testing

import flash_attn_hopper as fah

hdims = [int(x) for x in sys.argv[1].split(",")]
seqlens = [int(x) for x in sys.argv[2].split(",")]
cap = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
torch.manual_seed(0)
for hd in hdims:
    for causal in (False, True):
        for s in seqlens:
            b, h = max(1, 16384 // s), 2048 // hd
            q, k, v, do = (torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = fah.attention(q, k, v, causal=causal, softcap=cap)
            ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                         warmup=25, rep=100, return_mode="median")
            flops = 2.5 * 4 * b * h * s * s * hd / (2 if causal else 1)
            print(f"| {hd} | {'yes' if causal else 'no'} | {s} | softcap {cap:g} | bwd {flops / ms / 1e9:.1f} TFLOP/s |")
