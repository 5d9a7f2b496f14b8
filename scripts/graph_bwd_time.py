"""Backward TFLOP/s of small problems timed as CUDA graph replays (triton.testing.do_bench_cudagraph), so that the
host's share of a ~0.1 ms call does not hide kernel differences; each setting of an environment variable runs in its
own process (the extension reads its knobs once per process), alternating over rounds.

Prepared for deciding the backward tail split (benchmarks/results/2026-12-03_h200_session33/
bwd_tail_split_NOT_LANDED.patch; apply it and build first): grids smaller than the GPU, where every CTA splits.

usage: python3 scripts/graph_bwd_time.py [--shapes 1x2048x4x128,2x1024x4x128] [--causal] [--rounds 3]
           [--env FAH_BWD_TAIL_SPLIT --values 0,1] [--json PATH]
A shape is batch x seqlen x nheads x head_dim (bf16, MHA, seqlen_q = seqlen_k). Prints one line per round, setting
and shape, then the median TFLOP/s per setting and shape (backward FLOPs = 2.5 x forward, halved when causal).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys


def measure(shapes, causal):
    import torch
    import triton.testing

    import flash_attn_hopper

    out = {}
    for shape in shapes:
        batch, seqlen, nheads, head_dim = shape
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                         for _ in range(4))
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        # autograd runs the backward on the forward's stream, so the forward is captured too (a forward outside the
        # capture sends the backward to the default stream and invalidates it); backward = both minus the forward.
        both = triton.testing.do_bench_cudagraph(
            lambda: torch.autograd.grad(flash_attn_hopper.attention(*leaves, causal=causal), leaves, dout))
        with torch.no_grad():
            fwd = triton.testing.do_bench_cudagraph(lambda: flash_attn_hopper.attention(q, k, v, causal=causal))
        ms = both - fwd
        flops = 2.5 * 4 * batch * nheads * seqlen * seqlen * head_dim / (2 if causal else 1)
        out["x".join(map(str, shape))] = flops / ms / 1e9
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x2048x4x128,2x1024x4x128,1x2048x8x64,1x4096x2x256")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--env", default="FAH_BWD_TAIL_SPLIT")
    ap.add_argument("--values", default="0,1")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.child:
        print(json.dumps(measure(shapes, args.causal)))
        return
    values = args.values.split(",")
    results = {v: {} for v in values}
    for r in range(args.rounds):
        for v in values if r % 2 == 0 else values[::-1]:
            env = dict(os.environ, **{args.env: v})
            cmd = [sys.executable, __file__, "--child", "--shapes", args.shapes] + (["--causal"] if args.causal else [])
            child = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            res = json.loads(child.stdout.splitlines()[-1])
            for shape, tflops in res.items():
                results[v].setdefault(shape, []).append(tflops)
                print(f"round {r + 1} {args.env}={v} {shape}: {tflops:.1f} TFLOP/s", flush=True)
    print(f"median TFLOP/s ({args.rounds} rounds, causal={args.causal}):")
    for shape in results[values[0]]:
        meds = [statistics.median(results[v][shape]) for v in values]
        print(f"  {shape}: " + ", ".join(f"{args.env}={v} {m:.1f}" for v, m in zip(values, meds))
              + f"; last / first {meds[-1] / meds[0]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": args.env, "causal": args.causal, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
