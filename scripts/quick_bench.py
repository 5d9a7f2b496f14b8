"""Development timing of forward and backward against SDPA's cuDNN and FA2 backends (bf16, the paper grid point:
batch*seqlen = 16384 tokens, nheads = 2048/head_dim). Usage: quick_bench.py HDIMS SEQLENS [causal]."""
import sys

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_hopper as fah

hdims = [int(x) for x in sys.argv[1].split(",")]
seqlens = [int(x) for x in sys.argv[2].split(",")]
causals = [False, True] if len(sys.argv) > 3 and sys.argv[3] == "both" else [len(sys.argv) > 3 and sys.argv[3] == "yes"]
for hd in hdims:
    for causal in causals:
        for s in seqlens:
            b, h = 16384 // s, 2048 // hd
            q, k, v, do = (torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            flops = 4 * b * h * s * s * hd / (2 if causal else 1)
            row = [hd, causal, s]
            for name in ("ours", "cudnn", "fa2"):
                qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
                if name == "ours":
                    f = lambda: fah.attention(qq, kk, vv, causal=causal)
                    ctx = None
                else:
                    qq, kk, vv = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
                    be = SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                    ctx = be
                try:
                    with sdpa_kernel(ctx) if ctx else torch.enable_grad():
                        tf = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
                        out = f()
                        dd = do if name == "ours" else do.transpose(1, 2).contiguous()
                        tb = triton.testing.do_bench(
                            lambda: torch.autograd.grad(out, (qq, kk, vv), dd, retain_graph=True),
                            warmup=25, rep=100, return_mode="median")
                    row += [f"{flops / tf / 1e9:.0f}", f"{2.5 * flops / tb / 1e9:.0f}"]
                except Exception:  # a peer backend may not support a point
                    row += ["n/a", "n/a"]
            print("hd %d causal %d s %d | fwd ours %s cudnn %s fa2 %s | bwd ours %s cudnn %s fa2 %s" % (
                row[0], row[1], row[2], row[3], row[5], row[7], row[4], row[6], row[8]), flush=True)
