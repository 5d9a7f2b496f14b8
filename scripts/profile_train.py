"""Where a training step of examples/train_lm.py spends its time, per attention backend (development tool).

    python scripts/profile_train.py [--steps N] [train_lm options, e.g. --batch-size 8 --seqlen 2048]

For each backend: wall time per step (synchronized), then torch.profiler over N steps: GPU time of the attention
kernels (ours: names containing "flash"; SDPA: "cudnn"/"fmha"/"flash"), all GPU kernels, and the top kernels by GPU
time. Random token windows, same weights for both backends (train_lm's build_model)."""
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_lm  # noqa: E402


def main():
    steps = 5
    argv = sys.argv[1:]
    if "--steps" in argv:
        i = argv.index("--steps")
        steps = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    args = train_lm.parse_args(argv)
    device = torch.device("cuda")
    import flash_attn_hopper.integrations.transformers as fah_tf

    fah_tf.register()
    ids = torch.randint(0, train_lm.VOCAB_SIZE, (args.batch_size, args.seqlen + 1), device=device)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    per_kernel = {}
    for backend in args.backends:
        model = train_lm.build_model(args, backend, device)
        model.train()
        optimizer = train_lm.make_optimizer(model, args, device)

        def step(model=model, optimizer=optimizer):
            with train_lm.autocast_ctx(args, device):
                loss = train_lm.lm_loss(model, inputs, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e3
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_total = sum(e.self_device_time_total for e in events) / steps / 1e3
        attn = [e for e in events if any(s in e.key.lower() for s in ("flash", "cudnn", "fmha", "sm90_kernel"))]
        attn_total = sum(e.self_device_time_total for e in attn) / steps / 1e3
        print(f"\n== {backend}: wall {wall:.2f} ms/step, GPU kernels {gpu_total:.2f} ms/step, "
              f"attention kernels {attn_total:.2f} ms/step")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
            print(f"  {e.self_device_time_total / steps / 1e3:7.3f} ms  x{e.count // steps:<4d} {e.key[:110]}")
        per_kernel[backend] = {e.key: (e.self_device_time_total / steps / 1e3, e.count // steps) for e in events}
        del model, optimizer
        torch.cuda.empty_cache()
    if len(per_kernel) == 2:
        # Kernels whose time per step differs most between the two backends: where the step's difference comes from.
        (a, ka), (b, kb) = per_kernel.items()
        diffs = [(ka.get(k, (0.0, 0))[0] - kb.get(k, (0.0, 0))[0], k) for k in set(ka) | set(kb)]
        print(f"\n== per kernel, {a} minus {b} (ms/step; counts per step)")
        for d, k in sorted(diffs, key=lambda x: -abs(x[0]))[:16]:
            print(f"  {d:+7.3f} ms  x{ka.get(k, (0, 0))[1]:<3d}/x{kb.get(k, (0, 0))[1]:<3d} {k[:100]}")


if __name__ == "__main__":
    main()
