"""Profile one forward launch under Nsight Compute (run by scripts/ncu_fwd.sh): bf16, batch*seqlen = 16384 tokens,
nheads = 2048 / head_dim, as the benchmark's grid. Usage: ncu_fwd.py HEAD_DIM SEQLEN MODE [causal] [bwd], MODE one of
dense, softcap (softcap 30, the benchmark's value), window ((1024, 1024), or (1024, 0) when causal), deterministic
(the backward's deterministic mode); with bwd the profiled range holds one backward instead (ncu_fwd.sh's KERNEL picks
the kernel)."""
import sys

import torch

import flash_attn_hopper as fah

hd, s, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
causal = "causal" in sys.argv[4:]
bwd = "bwd" in sys.argv[4:]
b, h = 16384 // s, 2048 // hd
torch.manual_seed(0)
q, k, v = (torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16, requires_grad=bwd) for _ in range(3))
do = torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16)
kw = {"causal": causal}
if mode == "softcap":
    kw["softcap"] = 30.0
elif mode == "window":
    kw["window_size"] = (1024, 0 if causal else 1024)
elif mode == "deterministic":
    kw["deterministic"] = True
elif mode != "dense":
    sys.exit(f"unknown MODE {mode!r}")


def step(profiled):
    out = fah.attention(q, k, v, **kw)
    if bwd:
        torch.cuda.synchronize()
        if profiled:  # the backward kernels run inside the profiled range only
            torch.cuda.profiler.start()
        out.backward(do)
        torch.cuda.synchronize()
        if profiled:
            torch.cuda.profiler.stop()


for _ in range(3):
    step(False)
torch.cuda.synchronize()
if bwd:
    step(True)
    sys.exit(0)
torch.cuda.profiler.start()
fah.attention(q, k, v, **kw)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
