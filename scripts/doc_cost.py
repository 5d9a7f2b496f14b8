"""Cost of document_ids at train_lm's attention shape (batch 8, 12 heads, seqlen 2048, head_dim 64, causal, bf16):
forward and forward+backward times (triton do_bench, ms) with no documents, one document per row (what the
transformers integration passes for unpacked rows) and packed rows (documents of 512 and of 128 tokens); TFLOP/s
counted on the dense causal FLOPs. Usage: python scripts/doc_cost.py [--json PATH]."""

import argparse
import json

import torch
from triton.testing import do_bench

from flash_attn_hopper import attention


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    b, s, h, d = 8, 2048, 12, 64
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    flops = 4 * b * h * s * s * d / 2  # causal
    cases = {
        "none": None,
        "one_document": torch.zeros(b, s, dtype=torch.int32, device="cuda"),
        "documents_512": (torch.arange(s, device="cuda") // 512).expand(b, s).contiguous(),
        "documents_128": (torch.arange(s, device="cuda") // 128).expand(b, s).contiguous(),
    }
    results = {}
    for name, ids in cases.items():
        fwd = do_bench(lambda: attention(q, k, v, causal=True, document_ids=ids), warmup=25, rep=200)

        def step():
            out = attention(q, k, v, causal=True, document_ids=ids)
            torch.autograd.grad(out, (q, k, v), dout)

        both = do_bench(step, warmup=25, rep=200)
        results[name] = dict(fwd_ms=fwd, fwd_bwd_ms=both, fwd_tflops=flops / fwd / 1e9, fwd_bwd_tflops=3.5 * flops / both / 1e9)
        print(f"| {name} | {fwd:.3f} | {both:.3f} | {flops / fwd / 1e9:.1f} | {3.5 * flops / both / 1e9:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
