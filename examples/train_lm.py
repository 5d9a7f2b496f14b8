"""Train a small Llama-style causal language model from scratch with flash_attn_hopper and with SDPA, side by side.

The model is Hugging Face transformers' ``LlamaForCausalLM`` from random initialisation (default: 6 layers, hidden
768, 12 heads of head_dim 64, SwiGLU 2048, about 43 M parameters), trained on byte-level tokens of real text that
needs no download: the ``*.py`` files of the Python standard library on this machine (``sysconfig`` ``stdlib``
path; site-packages excluded). Files are sorted by path; about 1 in 20, chosen by a CRC32 of the path, is held out
for validation. Tokens are bytes 0-255 plus 256, a separator put between files; the vocabulary is padded to 320.

Every backend (``--backends``, default ``flash_attn_hopper,sdpa``) starts from the same initial weights and sees the
same batches in the same order (random windows of seqlen + 1 bytes of the training stream, drawn once from
``--seed``). The attention implementation is the only difference. Training: AdamW (betas 0.9/0.95, weight decay 0.1
on matrices, fused on CUDA), learning rate ``--lr`` with linear warmup over ``--warmup`` steps and cosine decay to a
tenth, gradient clipping at 1.0; bf16 autocast over float32 weights (``--precision autocast``, the default) or
bf16 weights (``--precision bf16``).

Prints a progress line every ``--log-every`` steps (step, loss, learning rate, tokens/s over the interval) and ends
with a markdown table per backend: the loss of step 1, the final train loss (mean of the last 20 steps, or of all
when --steps is fewer), the validation loss (``--eval-batches`` fixed windows of the held-out files), tokens/s
(training steps only, the first ``--timing-skip`` steps left out as warm-up), and peak GPU memory. ``--repeats N``
trains each backend N times, the order reversed every other round, and reports the mean tokens/s (min-max beside
it): a single run's tokens/s moves by a few percent with the GPU's state, and on the H200 the backend that ran first
was faster in either order. ``--json PATH`` writes all of it, every step's loss included, with the versions and settings.

Run from the repository root with flash_attn_hopper installed; with an in-place build (``python setup.py build_ext
--inplace``, as scripts/gpu_check.sh does) put the checkout on the path: ``PYTHONPATH=. python examples/train_lm.py``.
Needs transformers (tested with 5.17.0); ``--help`` and ``--smoke --device cpu --backends sdpa`` need no GPU.

Examples:
    python examples/train_lm.py                                   # both backends, defaults (H200: about 1-2 min)
    python examples/train_lm.py --compile --json bench_out/train_lm.json
    python examples/train_lm.py --smoke --device cpu --backends sdpa   # 3 steps of a tiny model: checks the script

``--compile`` (= ``--compile layers``) compiles each decoder layer with ``torch.compile(fullgraph=True)``.
``--compile model`` compiles the whole model (fullgraph); note that transformers then builds a dense causal mask for
SDPA (its packed-sequence check cannot run while tracing), so SDPA runs with an explicit mask, not ``is_causal``.
"""

import argparse
import contextlib
import gc
import json
import math
import os
import pathlib
import platform
import sysconfig
import time
import zlib

import torch
import torch.nn.functional as F

SEPARATOR = 256  # between files
VOCAB_SIZE = 320  # 257 symbols, padded to a multiple of 64
FINAL_WINDOW = 20  # steps averaged for the final train loss


# ------------------------------------------------------------------------------------------------------------ data


def stdlib_files(root=None):
    """Sorted paths (relative to the stdlib folder) of the standard library's *.py files, site-packages excluded."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if {"site-packages", "dist-packages", "__pycache__"} & set(rel.parts):
            continue
        if path.is_file():
            files.append(rel)
    return root, sorted(files, key=lambda p: p.as_posix())


def is_validation(rel_path):
    """About 1 file in 20 is held out, chosen by a CRC32 of its path: the same files on every machine."""
    return zlib.crc32(rel_path.as_posix().encode()) % 20 == 0


def load_corpus(max_bytes=None):
    """(train tokens, validation tokens, stats): uint8-valued int16 streams of file bytes, SEPARATOR between files.

    max_bytes caps each stream (used by --smoke to stay fast)."""
    root, files = stdlib_files()
    if not files:
        raise SystemExit(f"no *.py files under {root}: cannot build the corpus")
    parts = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    counts = {"train": 0, "val": 0}
    for rel in files:
        split = "val" if is_validation(rel) else "train"
        if max_bytes is not None and sizes[split] >= max_bytes:
            continue
        data = (root / rel).read_bytes()
        parts[split].append(data)
        sizes[split] += len(data) + 1
        counts[split] += 1
    streams = {}
    for split, chunks in parts.items():
        buf = bytearray()
        for data in chunks:
            buf += data
            buf.append(0)  # placeholder for the separator, set below
        t = torch.frombuffer(buf, dtype=torch.uint8).to(torch.int16)
        ends = torch.tensor([len(d) for d in chunks], dtype=torch.long).add_(1).cumsum_(0) - 1
        t[ends] = SEPARATOR
        streams[split] = t
    stats = {
        "stdlib": str(root),
        "files_train": counts["train"],
        "files_val": counts["val"],
        "tokens_train": int(streams["train"].numel()),
        "tokens_val": int(streams["val"].numel()),
    }
    return streams["train"], streams["val"], stats


def window_offsets(n_tokens, seqlen, count, generator=None):
    """Start offsets of windows of seqlen + 1 tokens: random (with generator) or evenly spaced."""
    span = n_tokens - (seqlen + 1)
    if span < 0:
        raise SystemExit(f"a stream of {n_tokens} tokens is shorter than one window of {seqlen + 1}")
    if generator is not None:
        return torch.randint(0, span + 1, (count,), generator=generator)
    return torch.linspace(0, span, count).round().long()


def gather(stream, offsets, seqlen):
    """(inputs, targets), each (len(offsets), seqlen) int64."""
    idx = offsets[:, None] + torch.arange(seqlen + 1, device=offsets.device)
    w = stream[idx].long()
    return w[:, :-1], w[:, 1:]


# ----------------------------------------------------------------------------------------------------------- model


def make_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,  # multi-head attention, as the published comparison tables use
        max_position_embeddings=args.seqlen,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=SEPARATOR,
        pad_token_id=None,
    )


def build_model(args, backend, device):
    from transformers import AutoModelForCausalLM

    weights_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    torch.manual_seed(args.seed)  # same initial weights for every backend
    # A fresh config per model: from_config writes attn_implementation into the config object it gets.
    model = AutoModelForCausalLM.from_config(make_config(args), attn_implementation=backend, dtype=weights_dtype)
    if model.config._attn_implementation != backend:
        raise SystemExit(
            f"transformers picked attn_implementation {model.config._attn_implementation!r}, not {backend!r}"
        )
    return model.to(device)


def make_optimizer(model, args, device):
    decay, no_decay = [], []
    for p in model.parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def lr_at(step, args):
    """Linear warmup over args.warmup steps, then cosine decay towards a tenth of args.lr (step is 0-based)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def autocast_ctx(args, device):
    if args.precision == "autocast":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_loss(model, inputs, targets):
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -------------------------------------------------------------------------------------------------------- training


def run_backend(backend, args, device, train, val, train_offsets, val_offsets):
    """Trains one model from the shared initial weights on the shared batches; returns its results."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(args, backend, device)
    n_params = sum(p.numel() for p in model.parameters())
    model.train()
    if args.compile == "layers":
        for layer in model.model.layers:
            layer.compile(fullgraph=True)
    elif args.compile == "model":
        model.compile(fullgraph=True)
    optimizer = make_optimizer(model, args, device)
    tokens_per_step = args.batch_size * args.seqlen
    print(f"\n== {backend}: {n_params / 1e6:.1f} M parameters, {args.steps} steps of {args.batch_size} x "
          f"{args.seqlen} tokens{', compile=' + args.compile if args.compile else ''}", flush=True)

    losses = []
    t_start = time.perf_counter()
    t_timed = None
    t_log, step_log = t_start, 0
    for step in range(args.steps):
        if step == args.timing_skip:
            sync(device)
            t_timed = time.perf_counter()
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = gather(train, train_offsets[step], args.seqlen)
        with autocast_ctx(args, device):
            loss = lm_loss(model, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps or step == 0:
            value = loss.item()  # synchronizes
            now = time.perf_counter()
            rate = (step + 1 - step_log) * tokens_per_step / (now - t_log)
            print(f"[{backend}] step {step + 1:5d}/{args.steps}  loss {value:.4f}  lr {lr:.2e}  {rate:,.0f} tok/s",
                  flush=True)
            t_log, step_log = now, step + 1
            if not math.isfinite(value):
                raise SystemExit(f"[{backend}] loss is {value} at step {step + 1}")
    sync(device)
    t_end = time.perf_counter()
    timed_steps = args.steps - args.timing_skip
    tokens_per_s = None
    if t_timed is not None and timed_steps > 0:
        tokens_per_s = timed_steps * tokens_per_step / (t_end - t_timed)

    model.eval()
    val_losses = []
    with torch.no_grad(), autocast_ctx(args, device):
        for i in range(0, len(val_offsets), args.batch_size):
            inputs, targets = gather(val, val_offsets[i : i + args.batch_size], args.seqlen)
            val_losses.append(lm_loss(model, inputs, targets))
    val_loss = torch.stack(val_losses).mean().item()
    step_losses = torch.stack(losses).float().tolist()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    result = {
        "backend": backend,
        "parameters": n_params,
        "first_loss": step_losses[0],
        "final_train_loss": sum(step_losses[-FINAL_WINDOW:]) / len(step_losses[-FINAL_WINDOW:]),
        "final_window": len(step_losses[-FINAL_WINDOW:]),
        "val_loss": val_loss,
        "tokens_per_s": tokens_per_s,
        "peak_memory_gib": peak,
        "train_seconds": t_end - t_start,
        "losses": step_losses,
    }
    print(f"[{backend}] done in {t_end - t_start:.1f} s: val loss {val_loss:.4f}", flush=True)
    del model, optimizer
    return result


def combine_runs(runs):
    """One backend's result over its repeats: the first run's losses (the repeats start from the same weights and
    batches; only the order of dQ's atomic adds may differ), tokens/s as the mean with min and max, the largest peak
    memory, and every run's tokens/s and val loss."""
    result = dict(runs[0])
    rates = [r["tokens_per_s"] for r in runs if r["tokens_per_s"] is not None]
    if rates:
        result["tokens_per_s"] = sum(rates) / len(rates)
        result["tokens_per_s_min"], result["tokens_per_s_max"] = min(rates), max(rates)
    peaks = [r["peak_memory_gib"] for r in runs if r["peak_memory_gib"] is not None]
    result["peak_memory_gib"] = max(peaks) if peaks else None
    result["repeats"] = [{"tokens_per_s": r["tokens_per_s"], "val_loss": r["val_loss"]} for r in runs]
    return result


def markdown_table(results):
    fmt = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731
    window = min((r.get("final_window", FINAL_WINDOW) for r in results), default=FINAL_WINDOW)  # --steps < 20
    lines = [
        f"| backend | loss at step 1 | final train loss (mean of last {window} steps) | val loss | tokens/s "
        "| peak memory GiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        rate = fmt(r["tokens_per_s"], ",.0f")
        if len(r.get("repeats", ())) > 1 and "tokens_per_s_min" in r:
            rate += f" ({len(r['repeats'])} runs: {r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f})"
        lines.append(
            f"| {r['backend']} | {r['first_loss']:.4f} | {r['final_train_loss']:.4f} | {r['val_loss']:.4f} "
            f"| {rate} | {fmt(r['peak_memory_gib'], '.2f')} |"
        )
    return "\n".join(lines)


def environment(device):
    env = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


# ------------------------------------------------------------------------------------------------------------ main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train a small Llama-style byte-level LM on the Python standard library's sources with "
        "flash_attn_hopper and with SDPA (same weights, same batches) and compare loss, speed and memory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--backends", default="flash_attn_hopper,sdpa",
                   help="comma-separated attn_implementation names, run in this order (flash_attn_hopper, sdpa, "
                   "eager, ...)")
    p.add_argument("--repeats", type=int, default=1,
                   help="train each backend this many times, the order reversed every other round (A B, B A, A B, "
                   "...), so that a drift of the GPU's speed over the run (clocks, temperature) falls on both alike; "
                   "tokens/s is the mean over the repeats, min-max beside it")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12, help="attention heads (head_dim = hidden / heads: a multiple of 8 up to 256)")
    p.add_argument("--intermediate", type=int, default=2048, help="SwiGLU width")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=30, help="linear warmup steps")
    p.add_argument("--precision", choices=("autocast", "bf16"), default="autocast",
                   help="autocast: float32 weights under bf16 autocast; bf16: bf16 weights, no autocast")
    p.add_argument("--compile", nargs="?", const="layers", choices=("layers", "model"), default=None,
                   help="torch.compile(fullgraph=True) each decoder layer ('layers', the default of a bare --compile) "
                   "or the whole model ('model': transformers then gives SDPA a dense causal mask)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches of --batch-size windows")
    p.add_argument("--log-every", type=int, default=25, help="progress line every N steps")
    p.add_argument("--timing-skip", type=int, default=10, help="first steps left out of tokens/s (warm-up, compile)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", metavar="PATH", help="write settings, environment and results here")
    p.add_argument("--smoke", action="store_true",
                   help="3 steps of a tiny model (2 layers, hidden 128, 2 heads, seqlen 128, batch 2): checks the "
                   "script; runs on CPU with --device cpu --backends sdpa")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.batch_size, args.seqlen = 3, 2, 128
        args.layers, args.hidden, args.heads, args.intermediate = 2, 128, 2, 256
        args.warmup, args.eval_batches, args.log_every, args.timing_skip = 1, 1, 1, 1
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not args.backends:
        p.error("--backends is empty")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.steps < 1 or args.batch_size < 1 or args.seqlen < 2 or args.eval_batches < 1 or args.repeats < 1:
        p.error("--steps, --batch-size, --eval-batches, --repeats must be >= 1 and --seqlen >= 2")
    args.timing_skip = min(args.timing_skip, args.steps - 1)
    args.warmup = max(1, args.warmup)
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA GPU is visible (use --device cpu --backends sdpa for a CPU check)")
    if "flash_attn_hopper" in args.backends:
        if device.type != "cuda":
            raise SystemExit("the flash_attn_hopper backend needs an sm90 CUDA GPU; on CPU use --backends sdpa")
        import flash_attn_hopper.integrations.transformers as fah_tf

        fah_tf.register()

    t0 = time.perf_counter()
    train, val, stats = load_corpus(max_bytes=2_000_000 if args.smoke else None)
    print(f"corpus: {stats['files_train']} train files ({stats['tokens_train'] / 1e6:.1f} M tokens), "
          f"{stats['files_val']} validation files ({stats['tokens_val'] / 1e6:.2f} M tokens) from {stats['stdlib']} "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    train_offsets = window_offsets(len(train), args.seqlen, args.steps * args.batch_size, gen)
    train_offsets = train_offsets.view(args.steps, args.batch_size).to(device)
    val_offsets = window_offsets(len(val), args.seqlen, args.eval_batches * args.batch_size).to(device)
    train, val = train.to(device), val.to(device)
    tokens_total = args.steps * args.batch_size * args.seqlen
    print(f"training {args.steps} steps x {args.batch_size} x {args.seqlen} = {tokens_total / 1e6:.1f} M tokens per "
          f"backend; validation {len(val_offsets)} windows; backends {', '.join(args.backends)}", flush=True)

    runs = {b: [] for b in args.backends}
    for r in range(args.repeats):
        for b in (args.backends if r % 2 == 0 else args.backends[::-1]):
            if args.repeats > 1:
                print(f"\n-- round {r + 1}/{args.repeats}", flush=True)
            runs[b].append(run_backend(b, args, device, train, val, train_offsets, val_offsets))
    results = [combine_runs(runs[b]) for b in args.backends]

    table = markdown_table(results)
    print("\n" + table)
    if len(results) >= 2:
        a, b = results[0], results[1]
        line = f"\nval loss {a['backend']} - {b['backend']}: {a['val_loss'] - b['val_loss']:+.4f}"
        if a["tokens_per_s"] and b["tokens_per_s"]:
            line += f"; tokens/s {a['backend']} / {b['backend']}: {a['tokens_per_s'] / b['tokens_per_s']:.3f}x"
        print(line)
    if args.json:
        out = {
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "vocab_size": VOCAB_SIZE,
            "environment": environment(device),
            "corpus": stats,
            "results": results,
            "table": table,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
