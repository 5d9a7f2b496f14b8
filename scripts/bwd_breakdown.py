"""Share of each backward kernel in the backward's GPU time (issue 7: preprocess and postprocess should be
memory-bound and near copy bandwidth), from torch.profiler.

    python scripts/bwd_breakdown.py [HEAD_DIMS] [SEQLENS]      e.g. 64,128,256 1024,4096,16384

Paper grid (bf16, batch * seqlen = 16384 tokens, nheads = 2048 / head_dim, non-causal and causal). For each point:
GPU time per backward of the zeroing of the dQ accumulator, the preprocess, the main kernel, the postprocess and
anything else, with each one's share, and the bytes/s of the pre/postprocess against the bytes they must move.
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import flash_attn_hopper as fah


def classify(name):
    if "preprocess" in name:
        return "preprocess"
    if "postprocess" in name:
        return "postprocess"
    if "flash_bwd_sm90_kernel" in name:
        return "main"
    if "fill" in name.lower() or "zero" in name.lower() or "memset" in name.lower():
        return "zero dQ accum"
    return "other"


def main():
    hdims = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "64,128,256").split(",")]
    seqlens = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1024,4096,16384").split(",")]
    reps = 10
    print("| head_dim | causal | seqlen | total ms | zero dQ accum | preprocess | main | postprocess | other | "
          "pre GB/s | post GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for hd in hdims:
        for causal in (False, True):
            for s in seqlens:
                b, h = 16384 // s, 2048 // hd
                q, k, v = (torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                dout = torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16)
                out = fah.attention(q, k, v, causal=causal)
                for _ in range(3):
                    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(reps):
                        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                    torch.cuda.synchronize()
                times = {}
                for e in prof.key_averages():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        key = classify(e.key)
                        times[key] = times.get(key, 0.0) + e.self_device_time_total / reps / 1e3  # ms
                total = sum(times.values())
                elem = b * s * h * hd
                # preprocess reads O and dO (bf16) and writes two fp32 vectors; postprocess reads the fp32
                # accumulator and writes dQ (bf16).
                pre_bytes = 2 * elem * 2 + 2 * b * h * s * 4
                post_bytes = elem * 4 + elem * 2

                def share(key):
                    t = times.get(key, 0.0)
                    return f"{t:.3f} ({100 * t / total:.0f} %)" if total else "n/a"

                def rate(key, nbytes):
                    t = times.get(key, 0.0)
                    return f"{nbytes / (t * 1e-3) / 1e9:.0f}" if t else "n/a"

                print(f"| {hd} | {'yes' if causal else 'no'} | {s} | {total:.3f} | {share('zero dQ accum')} | "
                      f"{share('preprocess')} | {share('main')} | {share('postprocess')} | {share('other')} | "
                      f"{rate('preprocess', pre_bytes)} | {rate('postprocess', post_bytes)} |", flush=True)
                del q, k, v, dout, out
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
