"""Where a sliding-window forward spends its time against dense attention of the same useful work (head_dim 128 bf16,
16384 tokens, 16 heads): do_bench time of the whole call, and the CUDA kernels of one call (torch profiler) with their
device times. Cases: window (1024, 1024) at seqlen 16384 vs dense non-causal at 2048; window (1024, 0) at 16384 vs
dense non-causal at 1024. Usage: window_gap.py [softcap]"""
import sys

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

import flash_attn_hopper as fah

softcap = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
hd, h, tokens = 128, 16, 16384
cases = [("window (1024,1024) s16384", 16384, (1024, 1024)), ("dense s2048", 2048, (-1, -1)),
         ("window (1024,0) s16384", 16384, (1024, 0)), ("dense s1024", 1024, (-1, -1))]
for name, s, win in cases:
    b = tokens // s
    q, k, v = (torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    f = lambda: fah.attention(q, k, v, window_size=win, softcap=softcap)
    ms = triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")
    pairs = sum(min(s - 1, i + win[1]) - max(0, i - win[0]) + 1 if win != (-1, -1) else s for i in range(s))
    tflops = 4 * b * h * pairs * hd / ms / 1e9
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            f()
        torch.cuda.synchronize()
    kern = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kern.setdefault(e.name[:60], []).append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
    cpu = [e.cpu_time_total for e in prof.events() if e.name.startswith("flash_attn_hopper") or "fwd" in e.name][:3]
    print(f"{name:28s} do_bench {ms * 1e3:8.1f} us  {tflops:6.0f} TFLOP/s (useful)")
    for kname, ts in kern.items():
        print(f"    {len(ts)} x {kname:60s} mean {sum(ts) / len(ts):8.1f} us")
