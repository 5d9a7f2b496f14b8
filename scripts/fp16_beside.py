"""fp16 against bf16 timed beside each other (issue 6: "fp16 within 3 % of bf16"), for ours and, as a yardstick, cuDNN
(torch SDPA's backend). The grid's fp16 and bf16 runs are minutes apart, and under the H200's power limit the SM clock
drifts between them; here each point's fp16 and bf16 calls alternate (flash_attn_hopper.benchmark.time_adjacent:
a discarded bf16 warm-up, then bf16, fp16; fp16, bf16; fp16, bf16; bf16, fp16), so both see the same clock and power
state. Inputs: the benchmark grid's shapes (16384 tokens, nheads = 2048 / head_dim), random bf16 values, the fp16
copy holding the same values.

usage: python3 scripts/fp16_beside.py [--head-dims 64,128,256] [--seqlens 1024,4096,16384] [--rounds 4] [--json PATH]
                                     [--control] [--no-warmup]
--control: the "fp16" side is a second bf16 copy of the same values, so each ratio shows what alternating two calls
of one dtype reads (the noise floor of the fp16 ratios).
Prints one markdown row per (head_dim, causal, seqlen): fp16 / bf16 of the forward and backward TFLOP/s, ours and cuDNN.
"""
import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_hopper as fah
from flash_attn_hopper.benchmark import BWD_FLOPS_FACTOR, make_timer, point_flops, time_adjacent


def ours(q, k, v, causal):
    return fah.attention(q, k, v, causal=causal)


def cudnn(q, k, v, causal):  # SDPA takes (batch, heads, seqlen, head_dim)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def beside(timer, fn, bf16, fp16, causal, direction, rounds, warmup):
    """(fp16 ms, bf16 ms) of fn's forward or backward, timed in turn."""
    if direction == "fwd":
        with torch.no_grad():
            return time_adjacent(timer, lambda: fn(*fp16[:3], causal), lambda: fn(*bf16[:3], causal), rounds, warmup)
    calls = []
    for q, k, v, dout in (fp16, bf16):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves, causal)
        calls.append(lambda out=out, leaves=leaves, dout=dout: torch.autograd.grad(out, leaves, dout, retain_graph=True))
    return time_adjacent(timer, calls[0], calls[1], rounds, warmup)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-warmup", action="store_true", help="no discarded first timing (time_adjacent's warmup)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--control", action="store_true", help="bf16 against a bf16 copy (noise floor)")
    a = ap.parse_args()
    _, timer = make_timer(torch, 25, 100)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    if a.control:
        print("control: the fp16 columns are a second bf16 copy of the same values")
    print("| head_dim | causal | seqlen | fwd ours fp16/bf16 | fwd cuDNN fp16/bf16 | bwd ours fp16/bf16 | "
          "bwd cuDNN fp16/bf16 | fwd ours bf16 | fwd ours fp16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for hd in (int(x) for x in a.head_dims.split(",")):
        for causal in (False, True):
            for s in (int(x) for x in a.seqlens.split(",")):
                b, h = max(1, 16384 // s), 2048 // hd
                bf16 = [torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]
                fp16 = [t.clone() if a.control else t.to(torch.float16) for t in bf16]
                flops = point_flops({"feature": "dense", "head_dim": hd, "causal": causal, "seqlen": s}, b, h)
                row = {"head_dim": hd, "causal": causal, "seqlen": s, "rounds": a.rounds, "control": a.control,
                       "warmup": not a.no_warmup}
                for d in ("fwd", "bwd"):
                    f = flops if d == "fwd" else BWD_FLOPS_FACTOR * flops
                    for name, fn in (("ours", ours), ("cudnn", cudnn)):
                        try:
                            t16, tb = beside(timer, fn, bf16, fp16, causal, d, a.rounds, not a.no_warmup)
                        except Exception as e:  # noqa: BLE001 - recorded; the other cells stand
                            row[f"{d}_{name}"] = {"error": f"{type(e).__name__}: {e}"}
                            continue
                        row[f"{d}_{name}"] = {"fp16_tflops": f / t16 / 1e9, "bf16_tflops": f / tb / 1e9,
                                              "ratio": tb / t16}
                rows.append(row)
                cell = lambda key: f"{row[key]['ratio']:.3f}" if "ratio" in row[key] else "n/a"
                fo = row["fwd_ours"]
                print(f"| {hd} | {'yes' if causal else 'no'} | {s} | {cell('fwd_ours')} | {cell('fwd_cudnn')} | "
                      f"{cell('bwd_ours')} | {cell('bwd_cudnn')} | {fo.get('bf16_tflops', 0):.0f} | "
                      f"{fo.get('fp16_tflops', 0):.0f} |", flush=True)
                del bf16, fp16
                torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"timer": "flash_attn_hopper.benchmark.make_timer(25, 100), time_adjacent", "rows": rows}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
