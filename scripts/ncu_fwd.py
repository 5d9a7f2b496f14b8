"""Profile one forward launch under Nsight Compute (run by scripts/ncu_fwd.sh): bf16, batch*seqlen = 16384 tokens,
nheads = 2048 / head_dim, as the benchmark's grid. Usage: ncu_fwd.py HEAD_DIM SEQLEN MODE [causal], MODE one of
dense, softcap (softcap 30, the benchmark's value), window ((1024, 1024), or (1024, 0) when causal)."""
import sys

import torch

import flash_attn_hopper as fah

hd, s, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
causal = len(sys.argv) > 4 and sys.argv[4] == "causal"
b, h = 16384 // s, 2048 // hd
torch.manual_seed(0)
q, k, v = (torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
kw = {"causal": causal}
if mode == "softcap":
    kw["softcap"] = 30.0
elif mode == "window":
    kw["window_size"] = (1024, 0 if causal else 1024)
for _ in range(3):
    fah.attention(q, k, v, **kw)
torch.cuda.synchronize()
torch.cuda.profiler.start()
fah.attention(q, k, v, **kw)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
