"""The forward's per-tile fixed cost (head_dim 128 bf16, 16 heads): time against key blocks per tile at a fixed
tile count (seqlen_q fixed, seqlen_k varied), a least-squares line t = a + b * n per tile per SM, and a in units of b
(key blocks). Also dense points at given seqlens. Usage: tile_cost.py [seqlen_q] [batch] [--dense s1,s2,... [--causal]]"""
import sys

import torch
import triton.testing

import flash_attn_hopper as fah

args = [a for a in sys.argv[1:] if not a.startswith("--") and "," not in a]
sq = int(args[0]) if args else 1024
batch = int(args[1]) if len(args) > 1 else 16
h, hd = 16, 128
sms = torch.cuda.get_device_properties(0).multi_processor_count
torch.manual_seed(0)


def bench(b, sq, sk, causal=False, window=(-1, -1)):
    q = torch.randn(b, sq, h, hd, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    f = lambda: fah.attention(q, k, v, causal=causal, window_size=window)
    return triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")


if "--dense" in sys.argv:
    causal = "--causal" in sys.argv
    for s in (int(x) for x in sys.argv[sys.argv.index("--dense") + 1].split(",")):
        b = max(1, 16384 // s)
        ms = bench(b, s, s, causal=causal)
        flops = 4 * b * h * s * s * hd / (2 if causal else 1)
        print(f"dense{' causal' if causal else ''} s={s:6d} b={b:3d}: {ms * 1e3:9.1f} us {flops / ms / 1e9:6.0f} TFLOP/s")
    sys.exit(0)

tiles = batch * h * ((sq + 127) // 128)
per_sm = tiles / sms
xs, ys = [], []
for sk in (128, 256, 512, 1024, 2048, 4096, 8192):
    ms = bench(batch, sq, sk)
    n = sk // 128
    t = ms * 1e3 / per_sm  # us per tile on one SM
    xs.append(n)
    ys.append(t)
    print(f"sq={sq} sk={sk:5d} n={n:3d}: {ms * 1e3:9.1f} us, {t:7.2f} us/tile, "
          f"{4 * batch * h * sq * sk * hd / ms / 1e9:6.0f} TFLOP/s")
m = len(xs)
mx, my = sum(xs) / m, sum(ys) / m
b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
a = my - b * mx
print(f"fit: {a:.2f} us per tile + {b:.3f} us per key block -> fixed cost {a / b:.2f} key blocks "
      f"({tiles} tiles, {per_sm:.1f} per SM)")
for x, y in zip(xs, ys):
    print(f"  n={x:3d} residual {y - (a + b * x):+.2f} us")
