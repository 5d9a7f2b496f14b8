"""Host (CPU) cost per attention call, forward + backward, on inputs so small that the GPU work is negligible: the
loop is CPU-bound, so wall time per iteration is what each path costs the Python/C++ side (issue 4: eager training
loops of small models are CPU-bound, and any per-call overhead shows up in tokens/s).

    python scripts/host_overhead.py [--iters 300] [--profile]

--profile adds, for SDPA and the registered op (fwd+bwd), the host time per call of each runtime call and operator
under torch.profiler (self CPU time, top 15): where the C++ side spends it (allocations, memsets, launches, the
autograd node, TMA descriptor encoding inside the launch).

Paths: SDPA (transformers' layout, cuDNN/flash backends as torch picks), flash_attn_hopper.attention (argument checks,
then the registered op, whose autograd formula is in C++), and the registered op called directly (no Python checks)."""

import argparse
import time

import torch
import torch.nn.functional as F

import flash_attn_hopper


def bench(fn, iters):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--profile", action="store_true", help="per-call host time by runtime call / operator")
    args = p.parse_args()
    dtype = torch.bfloat16
    q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 128, 2, 64, device="cuda", dtype=dtype)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))

    def sdpa():
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        torch.autograd.grad(out, (qt, kt, vt), dout.transpose(1, 2))

    def ours():
        out = flash_attn_hopper.attention(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)

    def registered_op():
        out, _ = torch.ops.flash_attn_hopper.fwd(q, k, v, 0.125, True, -1, 0, 0.0, False)
        torch.autograd.grad(out, (q, k, v), dout)

    def ours_fwd_only():
        with torch.no_grad():
            flash_attn_hopper.attention(q, k, v, causal=True)

    def registered_op_fwd_only():
        with torch.no_grad():
            torch.ops.flash_attn_hopper.fwd(q, k, v, 0.125, True, -1, 0, 0.0, False)

    def sdpa_fwd_only():
        with torch.no_grad():
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    print(f"host cost per call, microseconds (mean of {args.iters}, CPU-bound tiny inputs):")
    for name, fn in (("sdpa fwd+bwd", sdpa), ("flash_attn_hopper.attention fwd+bwd", ours),
                     ("registered op fwd+bwd (no Python checks)", registered_op),
                     ("sdpa fwd, no grad", sdpa_fwd_only), ("flash_attn_hopper.attention fwd, no grad", ours_fwd_only),
                     ("registered op fwd, no grad", registered_op_fwd_only)):
        print(f"  {name:55s} {bench(fn, args.iters):8.1f}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (("sdpa fwd+bwd", sdpa), ("registered op fwd+bwd", registered_op)):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            calls = 50
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
            rows = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
            print(f"\n{name}: self CPU time per call, microseconds (count per call)")
            for e in sorted(rows, key=lambda e: -e.self_cpu_time_total)[:15]:
                print(f"  {e.self_cpu_time_total / calls:8.1f}  x{e.count / calls:<5.1f} {e.key[:90]}")


if __name__ == "__main__":
    main()
