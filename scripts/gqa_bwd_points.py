"""GQA backward TFLOP/s (head_dim 128 unless given) over group sizes and seqlens, beside dense MHA of the same shape, for A/Bs
of the launcher's GQA choices by environment (FAH_BWD_GQA_GROUP_CTA, FAH_BWD_SECTION_MIB; set by the caller). GQA_CAUSAL=yes or no: one mask only.
GQA_WINDOW=LEFT,RIGHT: that window_size on every point (FLOPs still counted as dense or causal: for windows that hide
no key). GQA_DETERMINISTIC=1: the deterministic backward.
bf16, batch * seqlen = 16384 tokens, 16 query heads; medians of triton.testing.do_bench.
usage: gqa_bwd_points.py [SEQLENS] [NHEADS_K] [HEAD_DIM]     e.g. 2048,4096,8192 16,8,4,2 128"""
import os
import sys

import torch
import triton.testing

import flash_attn_hopper as fah

seqlens = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "2048,4096,8192").split(",")]
kv_heads = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "16,8,4,2").split(",")]
hd, h = (int(sys.argv[3]) if len(sys.argv) > 3 else 128), 16
window = tuple(int(x) for x in os.environ["GQA_WINDOW"].split(",")) if os.environ.get("GQA_WINDOW") else (-1, -1)
torch.manual_seed(0)
for causal in {"no": (False,), "yes": (True,)}.get(os.environ.get("GQA_CAUSAL", ""), (False, True)):
    for s in seqlens:
        b = max(1, 16384 // s)
        for hk in kv_heads:
            q = torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(b, s, hk, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            do = torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16)
            out = fah.attention(q, k, v, causal=causal, window_size=window,
                                deterministic=os.environ.get("GQA_DETERMINISTIC", "0") == "1")
            ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                         warmup=25, rep=100, return_mode="median")
            flops = 2.5 * 4 * b * h * s * s * hd / (2 if causal else 1)
            print(f"| {hd} | {'yes' if causal else 'no'} | {s} | {h}/{hk} | bwd {flops / ms / 1e9:.1f} |", flush=True)
