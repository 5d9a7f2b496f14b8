"""Where a train_lm step's wall time goes beyond its GPU kernels, per attention backend (issue 4, development tool).

    python scripts/step_times.py [--rounds 2] [--steps 60] [train_lm options]

For each backend (order alternating per round), after 15 warm-up steps:
  async   --steps steps issued back to back as train_lm issues them (no host sync): wall ms/step, and the GPU time
          between CUDA events at the step boundaries (includes idle gaps inside the step);
  issue   one step issued right after a sync: host time until the step's last call returns, including any wait at a
          host synchronisation inside the step (transformers' packed-sequence check at the start of each forward);
  calls   one step under torch.profiler, inside a record_function range (so the script's and the profiler's own
          synchronisations are not counted): host synchronisations, memcpys, cudaMalloc / cudaFree, memsets and
          kernel launches, then device time of kernels, memcpys and memsets and the device idle time between them.
Random token windows (no corpus), same weights for both backends (train_lm's build_model)."""
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_lm  # noqa: E402

RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
                 "cudaMalloc", "cudaFree", "cudaMemsetAsync", "cudaLaunchKernel", "cuLaunchKernelEx",
                 "cudaLaunchKernelExC", "aten::_local_scalar_dense")


def pop_int(argv, name, default):
    if name in argv:
        i = argv.index(name)
        value = int(argv[i + 1])
        del argv[i:i + 2]
        return value
    return default


def main():
    argv = sys.argv[1:]
    rounds, steps = pop_int(argv, "--rounds", 2), pop_int(argv, "--steps", 60)
    args = train_lm.parse_args(argv)
    device = torch.device("cuda")
    import flash_attn_hopper.integrations.transformers as fah_tf

    fah_tf.register()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, train_lm.VOCAB_SIZE, (steps, args.batch_size, args.seqlen + 1), generator=gen).to(device)
    rows = []
    for r in range(rounds):
        for backend in (args.backends if r % 2 == 0 else args.backends[::-1]):
            model = train_lm.build_model(args, backend, device)
            model.train()
            optimizer = train_lm.make_optimizer(model, args, device)

            def step(i, model=model, optimizer=optimizer):
                inputs, targets = ids[i % steps, :, :-1], ids[i % steps, :, 1:]
                with train_lm.autocast_ctx(args, device):
                    loss = train_lm.lm_loss(model, inputs, targets)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            for i in range(15):
                step(i)
            torch.cuda.synchronize()
            events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
            t0 = time.perf_counter()
            events[0].record()
            for i in range(steps):
                step(i)
                events[i + 1].record()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / steps * 1e3
            gpu = [events[i].elapsed_time(events[i + 1]) for i in range(steps)]
            issue = []
            for i in range(5):
                torch.cuda.synchronize()
                t = time.perf_counter()
                step(i)
                issue.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                with record_function("train_step"):
                    step(0)
                torch.cuda.synchronize()
            events_all = prof.events()
            window = [e.time_range for e in events_all if e.name == "train_step"][0]
            counts = {name: 0 for name in RUNTIME_CALLS}
            kernels = []
            for e in events_all:
                if e.name in counts and window.start <= e.time_range.start and e.time_range.end <= window.end:
                    counts[e.name] += 1
                if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
                    kernels.append((e.time_range.start, e.time_range.end))
            kernels.sort()
            busy, idle, end = 0.0, 0.0, None
            for s, t in kernels:
                if end is not None and s > end:
                    idle += s - end
                busy += max(0.0, t - max(s, end if end is not None else s))
                end = t if end is None else max(end, t)
            launches = counts["cudaLaunchKernel"] + counts["cuLaunchKernelEx"] + counts["cudaLaunchKernelExC"]
            rows.append((r, backend, wall, statistics.mean(gpu), statistics.median(issue), busy / 1e3, idle / 1e3,
                         counts, launches))
            print(f"[{backend}] round {r}: wall {wall:.2f} ms/step, GPU events {statistics.mean(gpu):.2f}, issue "
                  f"{statistics.median(issue):.2f} (min {min(issue):.2f}), profiled step: device busy {busy / 1e3:.2f} "
                  f"ms, idle between them {idle / 1e3:.2f} ms, launches {launches}, "
                  + ", ".join(f"{k} {v}" for k, v in counts.items() if v), flush=True)
            del model, optimizer, prof, step, events_all  # step's defaults hold the model
            torch.cuda.empty_cache()
    print("\n| round | backend | wall ms/step | GPU (events) ms/step | issue ms/step | device busy ms | idle ms | "
          "syncs | memcpys | malloc/free | memsets | launches |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r, b, wall, gpu, issue, busy, idle, c, launches in rows:
        syncs = c["cudaStreamSynchronize"] + c["cudaDeviceSynchronize"] + c["cudaEventSynchronize"]
        print(f"| {r} | {b} | {wall:.2f} | {gpu:.2f} | {issue:.2f} | {busy:.2f} | {idle:.2f} | {syncs} | "
              f"{c['cudaMemcpyAsync']} | {c['cudaMalloc']}/{c['cudaFree']} | {c['cudaMemsetAsync']} | {launches} |")


if __name__ == "__main__":
    main()
