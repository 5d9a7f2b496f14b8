"""Why the varlen forward/backward trails the dense one at short causal sequences (development tool).

    python scripts/varlen_gap.py [--head-dim 128] [--seqlen 1024] [--causal yes|no]

The benchmark's varlen point (batch x seqlen = 16384 tokens packed as equal-length sequences) against the dense call
on the same tokens: do_bench time of each, then torch.profiler's GPU time per kernel over 20 calls, forward and
forward+backward. Prints one block per call kind."""
import argparse

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

import flash_attn_hopper as fah


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--causal", choices=("yes", "no"), default="yes")
    a = ap.parse_args()
    causal = a.causal == "yes"
    s, d = a.seqlen, a.head_dim
    b, h = 16384 // s, 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
    flat = [t.reshape(b * s, h, d) for t in (q, k, v)]
    flops = 4 * b * h * s * s * d / (2 if causal else 1)

    def dense_fwd():
        return fah.attention(q, k, v, causal=causal)

    def varlen_fwd():
        return fah.attention_varlen(*flat, cu, cu, s, s, causal=causal)

    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    fg = [t.detach().clone().requires_grad_() for t in flat]

    def dense_bwd():
        out = fah.attention(qg, kg, vg, causal=causal)
        torch.autograd.grad(out, (qg, kg, vg), do)

    def varlen_bwd():
        out = fah.attention_varlen(*fg, cu, cu, s, s, causal=causal)
        torch.autograd.grad(out, fg, do.reshape(b * s, h, d))

    for name, fn, mult in (("dense fwd", dense_fwd, 1.0), ("varlen fwd", varlen_fwd, 1.0),
                           ("dense fwd+bwd", dense_bwd, 3.5), ("varlen fwd+bwd", varlen_bwd, 3.5)):
        ms = triton.testing.do_bench(fn, warmup=25, rep=100)
        print(f"== {name}: {ms * 1e3:.1f} us, {flops * mult / ms / 1e9:.1f} TFLOP/s", flush=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        rows = sorted(
            ((e.key, e.device_time_total / 20, e.count // 20) for e in prof.key_averages() if e.device_time_total > 0),
            key=lambda r: -r[1])
        for key, us, n in rows[:8]:
            print(f"   {us:8.1f} us x{n}  {key[:110]}")


if __name__ == "__main__":
    main()
