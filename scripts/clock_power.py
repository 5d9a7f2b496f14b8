"""SM clock and board power while each implementation runs one attention call back to back (ours, torch SDPA's cuDNN and
FA2 backends), to tell whether the benchmark's ratios are ratios of work per clock or of clocks: the H200 runs near
its power limit in the sustained grid, so an implementation that draws more power per FLOP runs at a lower clock.

For each case (head_dim, causal, direction; --dtype bf16 or fp16) and backend, in alternating order over --rounds
rounds: the call repeats for --seconds while `nvidia-smi -lms 50` samples clocks.sm and power (instant where the
driver has it); the first --settle seconds are neither timed nor kept (their share of the samples is dropped). Prints
one line per measurement: TFLOP/s (CUDA events over the loop), median SM clock (MHz), median power (W), TFLOP/s per
GHz of SM clock and TFLOP per kJ. Grid of the benchmark: batch x seqlen = 16384 tokens, nheads = 2048 / head_dim.

Usage (on the GPU machine):
  PYTHONPATH=. python scripts/clock_power.py [--cases 128:no:fwd,128:no:bwd] [--seqlen 16384]
"""
import argparse
import json
import os
import subprocess
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_hopper as fah
from flash_attn_hopper.benchmark import _nvidia_smi

POWER_FIELDS = ("power.draw.instant", "power.draw")


def smi_fields():
    """The nvidia-smi fields to sample: the SM clock and the power field this driver answers (instant power on recent
    drivers)."""
    for power in POWER_FIELDS:
        q = _nvidia_smi(["clocks.sm", power])
        if q is not None and q[power] is not None:
            return f"clocks.sm,{power}"
    raise RuntimeError("nvidia-smi answers neither power.draw.instant nor power.draw")


def smi_gpu_args():
    """nvidia-smi's -i for the GPU this process uses (the first of CUDA_VISIBLE_DEVICES), as benchmark._nvidia_smi."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return ["-i", visible] if visible else []


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def measure(fn, flops, seconds, settle, fields):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", "50",
                            *smi_gpu_args()], stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    while time.time() - t0 < settle:  # sampled, then dropped with its samples: not timed either
        fn()
        torch.cuda.synchronize()
    calls = 0
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(4):
            fn()
        calls += 4
        torch.cuda.synchronize()  # keeps the host's clock and the GPU's work together
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    out, _ = smi.communicate()
    samples = []
    for line in out.strip().splitlines():
        try:
            clock, power = (float(x) for x in line.split(","))
            samples.append((clock, power))
        except ValueError:
            continue
    samples = samples[int(len(samples) * settle / seconds):]
    ms = start.elapsed_time(end) / calls
    tflops = flops / ms / 1e9
    clock, power = median([s[0] for s in samples]), median([s[1] for s in samples])
    return {"tflops": tflops, "ms": ms, "sm_mhz": clock, "power_w": power, "samples": len(samples),
            "tflops_per_ghz": tflops / (clock / 1000), "tflop_per_kj": tflops / power * 1000}


def make_fn(backend, direction, q, k, v, dout, causal):
    """A thunk running one forward, or one backward from a saved forward graph."""
    if backend == "ours":
        leaves = [t.detach().requires_grad_(direction == "bwd") for t in (q, k, v)]
        call = lambda: fah.attention(*leaves, causal=causal)  # noqa: E731
        d = dout
    else:
        leaves = [t.transpose(1, 2).contiguous().requires_grad_(direction == "bwd") for t in (q, k, v)]
        kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[backend]

        def call():
            with sdpa_kernel(kind):
                return F.scaled_dot_product_attention(*leaves, is_causal=causal)
        d = None
    if direction == "fwd":
        def fwd():
            with torch.no_grad():
                return call()
        return fwd
    out = call()
    if d is None:
        d = torch.empty_like(out)
        d.copy_(dout.transpose(1, 2))
    return lambda: torch.autograd.grad(out, leaves, d, retain_graph=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="128:no:fwd,128:no:bwd,64:no:fwd,64:no:bwd,256:no:fwd,256:no:bwd")
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--backends", default="ours,cudnn,fa2")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    fields = smi_fields()
    print(f"nvidia-smi fields: {fields}; {args.dtype}, seqlen {args.seqlen}")
    backends = args.backends.split(",")
    records = []
    print("| head_dim | causal | dir | backend | round | TFLOP/s | SM MHz | W | TFLOP/s per GHz | TFLOP per kJ |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        hd, causal, direction = case.split(":")
        hd, causal = int(hd), causal == "yes"
        batch, nheads = max(1, 16384 // args.seqlen), 2048 // hd
        gen = torch.Generator(device="cuda").manual_seed(hd)
        q, k, v, dout = (torch.randn(batch, args.seqlen, nheads, hd, dtype=dtype, device="cuda",
                                     generator=gen) for _ in range(4))
        flops = 4 * batch * nheads * args.seqlen ** 2 * hd * (0.5 if causal else 1.0)
        flops *= 2.5 if direction == "bwd" else 1.0
        for r in range(args.rounds):
            order = backends if r % 2 == 0 else backends[::-1]
            for b in order:
                fn = make_fn(b, direction, q, k, v, dout, causal)
                m = measure(fn, flops, args.seconds, args.settle, fields)
                m.update({"head_dim": hd, "causal": causal, "direction": direction, "backend": b, "round": r})
                records.append(m)
                print(f"| {hd} | {'yes' if causal else 'no'} | {direction} | {b} | {r} | {m['tflops']:.0f} | "
                      f"{m['sm_mhz']:.0f} | {m['power_w']:.0f} | {m['tflops_per_ghz']:.0f} | {m['tflop_per_kj']:.0f} |",
                      flush=True)
                del fn
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
