"""Forward speed of head dims between the old kernel widths (development tool): head_dim 96 and 192 on their own
kernels against the same call padded by hand to 128 / 256 (what ran before the 96 and 192 kernels existed) and
against cuDNN, bf16, the benchmark's grid (batch x seqlen = 16384 tokens, nheads = 2048 / head_dim; 192 also as
DeepSeek's 192 / 128 pair). TFLOP/s count the true head dims.

    python scripts/hdim_pad_cost.py [--seqlens 1024,4096,16384]
"""
import argparse
import math

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_hopper as fah


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="1024,4096,16384")
    a = ap.parse_args()
    print("| head_dim (q/k, v) | causal | seqlen | own kernel | padded by hand | cuDNN | own / padded | own / cuDNN |")
    print("|---|---|---|---|---|---|---|---|")
    for hd, hdv, wide in ((96, 96, 128), (192, 192, 256), (192, 128, 256)):
        for causal in (False, True):
            for s in (int(x) for x in a.seqlens.split(",")):
                b, h = max(1, 16384 // s), 2048 // hd
                g = torch.Generator(device="cuda").manual_seed(s + hd)
                q, k = (torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
                v = torch.randn(b, s, h, hdv, device="cuda", dtype=torch.bfloat16, generator=g)
                scale = 1.0 / math.sqrt(hd)
                # q and k padded by hand, v as it is: the wide kernel zero-fills v's columns on load and stores only
                # head_dim_v columns, exactly the call before the 96 / 192 kernels existed.
                qp, kp = (F.pad(t, (0, wide - t.shape[-1])) for t in (q, k))
                flops = 2 * b * h * s * s * (hd + hdv) / (2 if causal else 1)
                own = triton.testing.do_bench(lambda: fah.attention(q, k, v, causal=causal), warmup=25, rep=100)
                pad = triton.testing.do_bench(
                    lambda: fah.attention(qp, kp, v, causal=causal, softmax_scale=scale), warmup=25, rep=100)
                qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
                try:
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        cud = triton.testing.do_bench(
                            lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), warmup=25, rep=100)
                    cud_tf = f"{flops / cud / 1e9:.1f}"
                    ratio = f"{cud / own:.2f}"
                except RuntimeError:
                    cud_tf, ratio = "n/a", "n/a"
                print(f"| {hd}/{hdv} | {'yes' if causal else 'no'} | {s} | {flops / own / 1e9:.1f} | "
                      f"{flops / pad / 1e9:.1f} | {cud_tf} | {pad / own:.2f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
