"""Forward TFLOP/s of ours at chosen points, for A/B runs of builds on features the benchmark grid measures only at
head_dim 128 (e.g. softcap at head_dim 64). Paper grid shapes: batch * seqlen = 16384 tokens, nheads = 2048 / head_dim,
bf16 (or --dtype fp16), random inputs (scaled by 2 with a softcap, so that it caps). Timing: triton.testing.do_bench
(median). Usage: fwd_points.py HDIMS SEQLENS [--causal no|yes|both] [--softcap C] [--dtype bf16|fp16]"""
import argparse

import torch
import triton.testing

import flash_attn_hopper as fah

ap = argparse.ArgumentParser()
ap.add_argument("hdims")
ap.add_argument("seqlens")
ap.add_argument("--causal", default="both", choices=["no", "yes", "both"])
ap.add_argument("--softcap", type=float, default=0.0)
ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
a = ap.parse_args()
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
causals = {"no": [False], "yes": [True], "both": [False, True]}[a.causal]
print("| head_dim | causal | seqlen | softcap | fwd ours |")
for hd in (int(x) for x in a.hdims.split(",")):
    for causal in causals:
        for s in (int(x) for x in a.seqlens.split(",")):
            b, h = max(1, 16384 // s), 2048 // hd
            scale = 2.0 if a.softcap > 0 else 1.0
            q, k, v = (scale * torch.randn(b, s, h, hd, device="cuda", dtype=dtype) for _ in range(3))
            flops = 4 * b * h * s * s * hd / (2 if causal else 1)
            ms = triton.testing.do_bench(lambda: fah.attention(q, k, v, causal=causal, softcap=a.softcap),
                                         warmup=25, rep=100, return_mode="median")
            print(f"| {hd} | {'yes' if causal else 'no'} | {s} | {a.softcap:g} | {flops / ms / 1e9:.1f} |", flush=True)
