"""Graphs compiled for attention_varlen under torch.compile as max_seqlen changes per call (session 43).

Usage: python scripts/varlen_compile_graphs.py   (GPU; prints the graph count for dynamic=None and dynamic=True)
"""
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import flash_attn_hopper


def count(dynamic):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def f(q, k, v, cu, longest):
        return flash_attn_hopper.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)

    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=dynamic)
    for lengths in ([77, 130, 5], [300, 2], [64, 513, 9, 2], [1000, 3], [17, 257], [33, 44, 55]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(sum(lengths), 3, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        assert torch.equal(compiled(q, k, v, cu, max(lengths)), f(q, k, v, cu, max(lengths)))
    return counter.frame_count


for dynamic in (None, True):
    print(f"dynamic={dynamic}: {count(dynamic)} graph(s) for 6 maxima")
