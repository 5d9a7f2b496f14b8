"""Quick backward check on the GPU: kernel grads vs float32 autograd of the reference (max abs error beside the
naive same-dtype reference's). For development iterations; the real tests are tests/test_bwd_gpu.py."""
import sys

import torch

import flash_attn_hopper as fah
from flash_attn_hopper.testing import attention_ref


def grads(fn, q, k, v, dout, **kw):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, **kw)
    out = out[0] if isinstance(out, tuple) else out
    return torch.autograd.grad(out, (q, k, v), dout)


torch.manual_seed(0)
hdims = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [64, 128, 256]
bad = 0
for hd in hdims:
    for dt in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            for sq, sk in ((1, 1), (113, 203), (203, 113), (1024, 1024), (2048, 1024)):
                mk = lambda s: torch.randn(2, s, 3, hd, device="cuda", dtype=dt)
                q, k, v, dout = mk(sq), mk(sk), mk(sk), mk(sq)
                g = grads(fah.attention, q, k, v, dout, causal=causal)
                r = grads(lambda a, b, c, **kw: attention_ref(a.float(), b.float(), c.float(), **kw)[0],
                          q, k, v, dout.float(), causal=causal)
                n = grads(lambda a, b, c, **kw: attention_ref(a, b, c, upcast=False, **kw)[0], q, k, v, dout,
                          causal=causal)
                msg = []
                for name, a, b, c in zip(("dq", "dk", "dv"), g, r, n):
                    e = (a.float() - b).abs().max().item()
                    base = (c.float() - b).abs().max().item()
                    ok = e <= 2 * base + 1e-4 * max(1, b.abs().max().item()) and not torch.isnan(a).any()
                    bad += not ok
                    msg.append(f"{name} {e:.2e}/{base:.2e}{'' if ok else ' FAIL'}")
                print(hd, str(dt)[6:], "causal" if causal else "full", sq, sk, " ".join(msg), flush=True)
print("BAD", bad)
