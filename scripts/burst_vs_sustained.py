"""One attention call timed from an idle GPU (a burst) and after seconds of back-to-back calls (sustained), with the SM
clock nvidia-smi reports at each: is the gap between Nsight Compute's kernel durations (short replays) and the
benchmark's sustained numbers the SM clock alone, or does the power limit slow the card beyond what clocks.sm shows?

Per case (head_dim, direction; non-causal, batch x seqlen = 16384 tokens, nheads = 2048 / head_dim, bf16, ours): after
--idle seconds without work, three calls timed one by one with CUDA events (the burst); then --seconds of back-to-back
calls; then three more calls timed one by one (sustained). Prints ms, TFLOP/s, and clocks.sm and power read once just
after each phase's three calls (the clock is a fair reading of the phase; the power is already falling back towards
idle).

Usage (on the GPU machine): PYTHONPATH=. python scripts/burst_vs_sustained.py [--cases 128:bwd,128:fwd]
"""
import argparse
import time

import torch

import flash_attn_hopper as fah
from flash_attn_hopper.benchmark import _nvidia_smi


def clock_and_power():
    q = _nvidia_smi(["clocks.sm", "power.draw.instant"]) or {}
    return f"{q.get('clocks.sm')} MHz, {q.get('power.draw.instant')} W"


def timed(fn, n=3):
    out = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="128:bwd,128:fwd")
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--idle", type=float, default=6.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    for case in args.cases.split(","):
        hd, direction = case.split(":")
        hd = int(hd)
        batch, nheads = max(1, 16384 // args.seqlen), 2048 // hd
        gen = torch.Generator(device="cuda").manual_seed(hd)
        q, k, v, dout = (torch.randn(batch, args.seqlen, nheads, hd, dtype=torch.bfloat16, device="cuda",
                                     generator=gen).requires_grad_(direction == "bwd") for _ in range(4))
        flops = 4 * batch * nheads * args.seqlen ** 2 * hd * (2.5 if direction == "bwd" else 1.0)
        if direction == "bwd":
            out = fah.attention(q, k, v)
            fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
        else:
            def fn():
                with torch.no_grad():
                    return fah.attention(q, k, v)
        timed(fn, 2)  # first-call costs
        time.sleep(args.idle)
        burst = timed(fn)
        clk0 = clock_and_power()  # just after the burst
        t0 = time.time()
        while time.time() - t0 < args.seconds:
            fn()
            torch.cuda.synchronize()
        sustained = timed(fn)
        clk1 = clock_and_power()
        fmt = lambda ms: " ".join(f"{x:.3f} ms ({flops / x / 1e9:.0f})" for x in ms)  # noqa: E731
        print(f"head_dim {hd} {direction}: burst [after: {clk0}] {fmt(burst)} | "
              f"sustained [after: {clk1}] {fmt(sustained)}", flush=True)


if __name__ == "__main__":
    main()
