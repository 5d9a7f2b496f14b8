#!/usr/bin/env python3
"""Attention benchmark, forward and backward: flash_attn_hopper against torch SDPA's cuDNN and FlashAttention-2
backends.

Grid of ../shared/baselines.md (the FlashAttention-3 paper's): batch * seqlen = 16384 tokens, hidden 2048 so
nheads = 2048 / head_dim, seqlen_q = seqlen_k, MHA. Forward FLOPs = 4 * batch * nheads * seqlen^2 * head_dim, halved
when causal (for seqlen_q == seqlen_k the bottom-right causal mask of flash_attn_hopper equals SDPA's top-left
``is_causal``); backward FLOPs = 2.5 x forward (the five GEMMs of the backward against the two of the forward).
Every backend is timed in the same run with ``triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")``
on random normal inputs:

- forward: the attention call, without autograd;
- backward: the forward runs once with q, k, v requiring grad, then ``torch.autograd.grad(out, (q, k, v), dout,
  retain_graph=True)`` is timed (the backward kernels and autograd's own overhead, no forward). The peers get dO in
  the layout of their own output.

Before timing, each point compares our output (gradients) with the peers' (max abs difference) and checks all
backends against a float32 reference (forward: a slice of query rows; backward: every row of the first heads of
batch element 0, from the gradient equations), so a broken kernel shows in the table instead of as a fast wrong
number.

    python benchmarks/bench_attention.py                      # full grid, bf16, forward and backward
    python benchmarks/bench_attention.py --head-dims 128 --seqlens 4096,16384 --causal no --direction bwd
    python benchmarks/bench_attention.py --smoke              # one tiny point: checks the script itself

Prints a markdown table (TFLOP/s) and writes every number plus metadata to JSON (--json, default
bench_out/attention.json in the repository root). torch, triton and flash_attn_hopper are imported only when a
benchmark runs, so ``--help`` works anywhere.
"""

import argparse
import datetime
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
import warnings

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(REPO_ROOT, "bench_out", "attention.json")
DEFAULT_SMOKE_JSON = os.path.join(REPO_ROOT, "bench_out", "attention_smoke.json")
ALL_HEAD_DIMS = (64, 128, 256)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DEVICE = "cuda"
BACKENDS = ("ours", "cudnn", "fa2")
BACKEND_LABEL = {"ours": "ours", "cudnn": "cuDNN", "fa2": "FA2"}
DIRECTIONS = ("fwd", "bwd")
BWD_FLOPS_FACTOR = 2.5  # backward FLOPs / forward FLOPs
# Forward: query rows (first and last REF_ROWS) and heads of batch element 0 checked against the float32 reference.
# Backward: all rows of the first REF_HEADS heads of batch element 0 (dK and dV need every query row).
REF_ROWS = 128
REF_HEADS = 2
GRAD_NAMES = ("dq", "dk", "dv")


def _int_list(text):
    values = []
    for part in text.replace(" ", ",").split(","):
        if part.strip():
            values.append(int(part))
    if not values:
        raise argparse.ArgumentTypeError("expected a comma-separated list of integers")
    return values


def _backend_list(text):
    values = [p.strip().lower() for p in text.split(",") if p.strip()]
    bad = [v for v in values if v not in BACKENDS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"backends must be a comma-separated subset of {','.join(BACKENDS)}")
    return values


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Attention TFLOP/s, forward and backward: flash_attn_hopper vs torch SDPA cuDNN and FA2 backends "
        "(grid of shared/baselines.md).",
    )
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="input dtype (default bf16)")
    p.add_argument("--head-dims", type=_int_list, default="64,128,256", help="comma-separated (default 64,128,256)")
    p.add_argument(
        "--seqlens",
        type=_int_list,
        default=",".join(map(str, DEFAULT_SEQLENS)),
        help="comma-separated seqlen_q = seqlen_k values (default %(default)s)",
    )
    p.add_argument("--causal", choices=("both", "no", "yes"), default="both", help="causal masks to run (default both)")
    p.add_argument(
        "--direction",
        choices=("fwd", "bwd", "both"),
        default="both",
        help="forward, backward (timed alone, after one forward) or both (default both)",
    )
    p.add_argument(
        "--tokens", type=int, default=16384, help="batch * seqlen; batch = max(1, tokens // seqlen) (default 16384)"
    )
    p.add_argument("--hidden", type=int, default=2048, help="nheads * head_dim (default 2048)")
    p.add_argument(
        "--backends", type=_backend_list, default="ours,cudnn,fa2", help="subset of ours,cudnn,fa2 (default all)"
    )
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup in ms (default 25)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms (default 100)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check before timing")
    p.add_argument(
        "--json",
        default=None,
        help=f"output JSON path (default {os.path.relpath(DEFAULT_JSON)}; "
        f"{os.path.relpath(DEFAULT_SMOKE_JSON)} with --smoke)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny point (seqlen 256, 2 heads) with short timing, to check the script itself",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of the inputs (default 0)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seqlens = [256]
        args.tokens = 512
        args.causal = "no"
        args.warmup, args.rep = 5, 20
        # One head dim: the one given first, else (None) the first compiled one, chosen once the build is known.
        args.head_dims = args.head_dims[:1] if args.head_dims != list(ALL_HEAD_DIMS) else None
    if args.json is None:
        args.json = DEFAULT_SMOKE_JSON if args.smoke else DEFAULT_JSON
    args.directions = list(DIRECTIONS) if args.direction == "both" else [args.direction]
    for hd in args.head_dims or []:
        if hd <= 0 or args.hidden % hd:
            p.error(f"--hidden {args.hidden} must be a positive multiple of every head dim (got {hd})")
    return args


# ----------------------------------------------------------------------------------------------------------------
# Metadata


def _git(*cmd):
    try:
        r = subprocess.run(["git", "-C", REPO_ROOT, *cmd], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _driver_version():
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None


def _safe(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - metadata is best effort
        return None


def collect_meta(torch, fah, timer_name, args):
    props = torch.cuda.get_device_properties(0)
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        triton_version = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "gpu": torch.cuda.get_device_name(0),
        "gpu_sm_count": props.multi_processor_count,
        "gpu_capability": list(torch.cuda.get_device_capability(0)),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "driver": _driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": _safe(torch.backends.cudnn.version),
        "triton": triton_version,
        "python": platform.python_version(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": (bool(status) if status is not None else None),
        "flash_attn_hopper_version": getattr(fah, "__version__", None) if fah else None,
        "flash_attn_hopper_file": getattr(fah, "__file__", None) if fah else None,
        "timer": timer_name,
        "argv": sys.argv,
    }
    return meta


# ----------------------------------------------------------------------------------------------------------------
# Timing


def make_timer(torch, warmup, rep):
    """Returns (name, fn -> median ms). triton.testing.do_bench when triton imports, else CUDA events."""
    try:
        from triton.testing import do_bench
    except Exception as e:  # noqa: BLE001
        print(f"warning: triton unavailable ({e}); timing with CUDA events instead of do_bench", file=sys.stderr)
    else:
        return (
            f"triton.testing.do_bench(warmup={warmup}, rep={rep}, return_mode='median')",
            lambda fn: float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median")),
        )

    def event_bench(fn):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        est = max(start.elapsed_time(end) / 5, 1e-3)
        for _ in range(max(1, int(warmup / est))):
            fn()
        times = []
        for _ in range(max(1, int(rep / est))):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            times.append((s, e))
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in times)
        return ms[len(ms) // 2]

    return f"cuda events (warmup={warmup}ms, rep={rep}ms, median)", event_bench


# ----------------------------------------------------------------------------------------------------------------
# References


def _ref_rows(torch, seqlen, device):
    head = torch.arange(0, min(REF_ROWS, seqlen), device=device)
    tail = torch.arange(max(seqlen - REF_ROWS, 0), seqlen, device=device)
    return torch.unique(torch.cat([head, tail]))


def reference_slice(torch, q, k, v, causal, rows):
    """float32 attention for batch 0, the first REF_HEADS heads and query rows `rows`: (R, H, d)."""
    heads = min(REF_HEADS, q.shape[2])
    qs = q[0, rows, :heads].float()
    ks = k[0, :, :heads].float()
    vs = v[0, :, :heads].float()
    scores = torch.einsum("rhd,shd->hrs", qs, ks) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:  # seqlen_q == seqlen_k: bottom-right and top-left alignment coincide
        cols = torch.arange(k.shape[1], device=q.device)
        scores = scores.masked_fill(cols[None, None, :] > rows[None, :, None], float("-inf"))
    return torch.einsum("hrs,shd->rhd", torch.softmax(scores, dim=-1), vs)


def reference_grads_head(torch, q, k, v, dout, causal, head):
    """float32 (dq, dk, dv), each (seqlen, head_dim), of batch element 0 and one head, from the equations of the
    backward (FlashAttention-3 paper §2.1): dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dO ∘ O)), dQ = α dS K,
    dK = α dSᵀ Q. seqlen_q == seqlen_k. Holds about four seqlen² float32 matrices (4 GiB at seqlen 16384)."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # real float32, no TF32
    try:
        qh, kh, vh, doh = (t[0, :, head].float() for t in (q, k, v, dout))
        scale = 1.0 / math.sqrt(q.shape[-1])
        p = (qh @ kh.T).mul_(scale)
        if causal:
            n = p.shape[0]
            p.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=p.device).triu_(1), float("-inf"))
        p = torch.softmax(p, dim=-1)
        dv = p.T @ doh
        dsum = (doh * (p @ vh)).sum(dim=-1, keepdim=True)  # rowsum(dO ∘ O)
        ds = (doh @ vh.T).sub_(dsum).mul_(p)
        del p
        dq = (ds @ kh).mul_(scale)
        dk = (ds.T @ qh).mul_(scale)
        return dq, dk, dv
    finally:
        torch.set_float32_matmul_precision(old)


# ----------------------------------------------------------------------------------------------------------------
# One grid point


def _describe(e):
    """One line naming an exception: its type and the first line of its message."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def _max_abs(torch, a, b):
    d = (a.float() - b.float()).abs()
    if not torch.isfinite(d).all():
        return float("nan")
    return d.max().item()


def _new_part(flops):
    return {"flops": flops, "ms": {}, "tflops": {}, "errors": {}, "ratio": {}, "check": {}}


def _time_all(torch, timer, args, part, make_thunk, in_backend):
    """Times make_thunk(name)() for every backend without an error yet; fills ms, tflops, ratio."""
    for name in args.backends:
        if name in part["errors"]:
            continue
        try:
            fn = make_thunk(name)
            ms = in_backend(name, lambda fn=fn: timer(fn))
        except Exception as e:  # noqa: BLE001
            part["errors"][name] = "timing failed: " + _describe(e)
            continue
        finally:
            fn = None  # drop the graph (backward) before the next backend
        part["ms"][name] = ms
        part["tflops"][name] = part["flops"] / (ms * 1e-3) / 1e12
    for peer in ("cudnn", "fa2"):
        if "ours" in part["tflops"] and peer in part["tflops"]:
            part["ratio"][f"ours/{peer}"] = part["tflops"]["ours"] / part["tflops"][peer]
    for name in args.backends:
        part["tflops"].setdefault(name, None)
        part["ms"].setdefault(name, None)


def _flag(errs_ours, errs_peers, floor):
    """DESIGN.md §3 spirit, with the peers standing in for the same-precision reference: ours is flagged when its
    error is not finite or exceeds 2 x the largest finite peer error + floor."""
    peer = [e for e in errs_peers if math.isfinite(e)]
    return not math.isfinite(errs_ours) or (bool(peer) and errs_ours > 2 * max(peer) + floor)


def run_fwd(torch, F, fah, timer, args, tensors, causal, flops, skip, in_backend):
    q, k, v, qt, kt, vt = tensors
    part = _new_part(flops)
    part["errors"].update(skip)

    def make_fn(name):
        if name == "ours":
            return lambda: fah.attention(q, k, v, causal=causal)
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    outs = {}
    for name in args.backends:
        if name in part["errors"]:
            continue
        try:
            with torch.no_grad():
                out = in_backend(name, make_fn(name))
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - an unsupported peer (or a broken build) is recorded, not fatal
            part["errors"][name] = _describe(e)
            continue
        if not args.no_check:
            outs[name] = out if name == "ours" else out.transpose(1, 2)
        del out

    if not args.no_check and outs:
        chk = part["check"]
        if "ours" in outs:
            for peer in ("cudnn", "fa2"):
                if peer in outs:
                    chk[f"maxdiff_vs_{peer}"] = _max_abs(torch, outs["ours"], outs[peer])
        rows = _ref_rows(torch, q.shape[1], q.device)
        ref = reference_slice(torch, q, k, v, causal, rows)
        heads = ref.shape[1]
        chk["ref_rows"] = int(rows.numel())
        chk["ref_heads"] = heads
        chk["ref_err"] = {n: _max_abs(torch, o[0, rows, :heads], ref) for n, o in outs.items()}
        errs = chk["ref_err"]
        if "ours" in errs:
            bad = _flag(errs["ours"], [e for n, e in errs.items() if n != "ours"], 1e-3)
            md = chk.get("maxdiff_vs_cudnn", chk.get("maxdiff_vs_fa2"))
            chk["flag"] = bool(bad or (md is not None and not math.isfinite(md)))
        del ref
    outs.clear()

    with torch.no_grad():
        _time_all(torch, timer, args, part, make_fn, in_backend)
    return part


def run_bwd(torch, F, fah, timer, args, tensors, dout, causal, flops, skip, in_backend):
    q, k, v, qt, kt, vt = tensors
    part = _new_part(flops)
    part["errors"].update(skip)

    def forward(name):
        """One forward with grad: (out, leaves, dout in the layout of out)."""
        if name == "ours":
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            return fah.attention(*leaves, causal=causal), leaves, dout
        leaves = [t.detach().requires_grad_(True) for t in (qt, kt, vt)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        d = torch.empty_like(out)  # out's strides (FA2 returns a transposed view, cuDNN a contiguous tensor)
        d.copy_(dout.transpose(1, 2))
        return out, leaves, d

    def make_thunk(name):
        out, leaves, d = in_backend(name, lambda: forward(name))
        return lambda: torch.autograd.grad(out, leaves, d, retain_graph=True)

    grads = {}
    for name in args.backends:
        if name in part["errors"]:
            continue
        try:
            g = make_thunk(name)()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - an unsupported peer (or a broken build) is recorded, not fatal
            part["errors"][name] = _describe(e)
            continue
        if not args.no_check:
            grads[name] = g if name == "ours" else tuple(t.transpose(1, 2) for t in g)
        del g

    if not args.no_check and grads:
        chk = part["check"]
        if "ours" in grads:
            for peer in ("cudnn", "fa2"):
                if peer in grads:
                    chk[f"maxdiff_vs_{peer}"] = max(
                        _max_abs(torch, a, b) for a, b in zip(grads["ours"], grads[peer])
                    )
        heads = min(REF_HEADS, q.shape[2])
        errs = {n: {g: 0.0 for g in GRAD_NAMES} for n in grads}
        ref_max = {g: 0.0 for g in GRAD_NAMES}
        for h in range(heads):
            ref = reference_grads_head(torch, q, k, v, dout, causal, h)
            for gi, gname in enumerate(GRAD_NAMES):
                ref_max[gname] = max(ref_max[gname], ref[gi].abs().max().item())
                for n, g in grads.items():
                    e = _max_abs(torch, g[gi][0, :, h], ref[gi])
                    errs[n][gname] = e if not math.isfinite(e) else max(errs[n][gname], e)
            del ref
        chk["ref_rows"] = int(q.shape[1])
        chk["ref_heads"] = heads
        chk["ref_err"] = errs
        if "ours" in errs:
            bad = any(
                _flag(
                    errs["ours"][g],
                    [e[g] for n, e in errs.items() if n != "ours"],
                    1e-3 * max(1.0, ref_max[g]),
                )
                for g in GRAD_NAMES
            )
            md = chk.get("maxdiff_vs_cudnn", chk.get("maxdiff_vs_fa2"))
            chk["flag"] = bool(bad or (md is not None and not math.isfinite(md)))
    grads.clear()

    _time_all(torch, timer, args, part, make_thunk, in_backend)
    return part


def run_point(torch, F, fah, timer, args, head_dim, causal, seqlen, dtype, ours_reason):
    batch = max(1, args.tokens // seqlen)
    nheads = args.hidden // head_dim
    fwd_flops = 4 * batch * nheads * seqlen * seqlen * head_dim
    if causal:
        fwd_flops //= 2
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed + 7919 * head_dim + 31 * seqlen + int(causal))
    shape = (batch, seqlen, nheads, head_dim)
    q, k, v = (torch.randn(shape, dtype=dtype, device=DEVICE, generator=gen) for _ in range(3))
    # SDPA layout (batch, nheads, seqlen, head_dim), made contiguous once, outside the timed region.
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    tensors = (q, k, v, qt, kt, vt)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa_backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}

    def in_backend(name, thunk):
        if name == "ours":
            return thunk()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with sdpa_kernel(sdpa_backend[name]):
                return thunk()

    skip = {}
    if "ours" in args.backends and ours_reason(head_dim):
        skip["ours"] = ours_reason(head_dim)

    rec = {
        "head_dim": head_dim,
        "causal": causal,
        "seqlen": seqlen,
        "batch": batch,
        "nheads": nheads,
        "dtype": args.dtype,
    }
    if "fwd" in args.directions:
        rec["fwd"] = run_fwd(torch, F, fah, timer, args, tensors, causal, fwd_flops, skip, in_backend)
        torch.cuda.empty_cache()
    if "bwd" in args.directions:
        dout = torch.randn(shape, dtype=dtype, device=DEVICE, generator=gen)
        bwd_flops = int(BWD_FLOPS_FACTOR * fwd_flops)
        rec["bwd"] = run_bwd(torch, F, fah, timer, args, tensors, dout, causal, bwd_flops, skip, in_backend)
        torch.cuda.empty_cache()
    return rec


# ----------------------------------------------------------------------------------------------------------------
# Output


def _fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def _maxdiff_cell(chk):
    if "maxdiff_vs_cudnn" in chk:
        md = _fmt(chk["maxdiff_vs_cudnn"], ".1e")
    elif "maxdiff_vs_fa2" in chk:
        md = _fmt(chk["maxdiff_vs_fa2"], ".1e") + " (FA2)"
    else:
        md = "n/a"
    return md + (" !" if chk.get("flag") else "")


def format_table(results, directions=DIRECTIONS):
    """Markdown: one row per point, a group of columns (ours, cuDNN, FA2, ratios, maxdiff) per direction."""
    header = ["head_dim", "causal", "seqlen"]
    for d in directions:
        header += [f"{d} ours", f"{d} cuDNN", f"{d} FA2", f"{d} ours/cuDNN", f"{d} ours/FA2", f"{d} maxdiff"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        cells = [str(r["head_dim"]), "yes" if r["causal"] else "no", str(r["seqlen"])]
        for d in directions:
            part = r.get(d)
            if part is None:
                cells += ["n/a"] * 6
                continue
            t = part["tflops"]
            cells += [
                _fmt(t.get("ours"), ".1f"),
                _fmt(t.get("cudnn"), ".1f"),
                _fmt(t.get("fa2"), ".1f"),
                _fmt(part["ratio"].get("ours/cudnn"), ".2f"),
                _fmt(part["ratio"].get("ours/fa2"), ".2f"),
                _maxdiff_cell(part["check"]),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path, meta, args, results, elapsed):
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    cfg = {
        k: getattr(args, k)
        for k in (
            "dtype",
            "head_dims",
            "seqlens",
            "causal",
            "direction",
            "tokens",
            "hidden",
            "backends",
            "warmup",
            "rep",
            "smoke",
        )
    }
    cfg["check"] = not args.no_check
    cfg["units"] = {
        "tflops": "TFLOP/s",
        "ms": "milliseconds (median)",
        "flops": {"fwd": "4*b*h*s^2*d, /2 if causal", "bwd": f"{BWD_FLOPS_FACTOR} x fwd"},
        "bwd timing": "torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) after one forward",
    }
    doc = {"meta": meta, "config": cfg, "elapsed_s": round(elapsed, 1), "results": results}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def _progress_line(i, n, rec):
    parts = []
    for d in DIRECTIONS:
        part = rec.get(d)
        if part is None:
            continue
        t = part["tflops"]
        errs = part["check"].get("ref_err", {})
        err_text = ", ".join(
            f"{BACKEND_LABEL[n]} {max(e.values()) if isinstance(e, dict) else e:.1e}" for n, e in errs.items()
        )
        parts.append(
            f"{d}: ours {_fmt(t.get('ours'), '.1f')}, cuDNN {_fmt(t.get('cudnn'), '.1f')}, "
            f"FA2 {_fmt(t.get('fa2'), '.1f')} TFLOP/s, fp32-ref err {err_text or 'n/a'}"
            f"{' FLAGGED' if part['check'].get('flag') else ''}"
        )
    return (
        f"[{i}/{n}] hdim={rec['head_dim']} causal={'yes' if rec['causal'] else 'no'} seqlen={rec['seqlen']} "
        f"batch={rec['batch']} nheads={rec['nheads']}: " + "; ".join(parts)
    )


# ----------------------------------------------------------------------------------------------------------------


def _import_fah():
    """flash_attn_hopper from wherever Python finds it (an install), else from this checkout."""
    try:
        import flash_attn_hopper
    except ImportError:
        sys.path.insert(0, REPO_ROOT)
        import flash_attn_hopper
    return flash_attn_hopper


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device visible; this benchmark needs an sm90 GPU", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]

    fah, fah_reason, built = None, None, None
    if "ours" in args.backends:
        try:
            fah = _import_fah()
        except Exception as e:  # noqa: BLE001
            fah_reason = f"import failed: {type(e).__name__}: {e}"
        else:
            if not fah.EXTENSION_LOADED:
                try:
                    fah._ops.require_extension()
                except RuntimeError as e:
                    fah_reason = str(e)
            else:
                built = fah.build_config()
        if fah_reason:
            print(f"warning: ours unavailable: {fah_reason}", file=sys.stderr)

    if args.smoke:  # one tiny point: 2 sequences of 256 tokens, 2 heads
        if args.head_dims is None:  # the first compiled head dim, 128 preferred
            choices = (built["head_dims"] or list(ALL_HEAD_DIMS)) if built else list(ALL_HEAD_DIMS)
            args.head_dims = [128 if 128 in choices else choices[0]]
        args.hidden = 2 * args.head_dims[0]

    def ours_reason(head_dim):
        if fah_reason:
            return fah_reason
        if built is not None:
            if head_dim not in built["head_dims"]:
                return f"head_dim {head_dim} not in this build (FAH_HDIMS: {built['head_dims']})"
            if dtype not in built["dtypes"]:
                return f"dtype {args.dtype} not in this build"
        return None

    timer_name, timer = make_timer(torch, args.warmup, args.rep)
    meta = collect_meta(torch, fah, timer_name, args)
    if built is not None:
        meta["flash_attn_hopper_build"] = {
            "head_dims": built["head_dims"],
            "dtypes": [str(d).replace("torch.", "") for d in built["dtypes"]],
        }
    meta["ours_unavailable"] = fah_reason

    causals = {"both": [False, True], "no": [False], "yes": [True]}[args.causal]
    points = [(hd, c, s) for hd in args.head_dims for c in causals for s in args.seqlens]
    print(
        f"# attention TFLOP/s ({' and '.join(args.directions)}; bwd FLOPs = {BWD_FLOPS_FACTOR} x fwd), {args.dtype}, "
        f"{meta['gpu']} ({meta['gpu_sm_count']} SMs), torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN "
        f"{meta['cudnn']}, triton {meta['triton']}, commit {meta['git_commit'] or 'n/a'}"
        f"{' (dirty)' if meta['git_dirty'] else ''}",
        flush=True,
    )
    print(f"# {len(points)} points, tokens={args.tokens}, hidden={args.hidden}, timer: {timer_name}", flush=True)

    results = []
    t_start = time.time()
    for i, (hd, causal, seqlen) in enumerate(points, 1):
        t0 = time.time()
        rec = run_point(torch, F, fah, timer, args, hd, causal, seqlen, dtype, ours_reason)
        results.append(rec)
        torch.cuda.empty_cache()
        print(f"{_progress_line(i, len(points), rec)} ({time.time() - t0:.1f}s)", file=sys.stderr, flush=True)
        for d in args.directions:
            for name, err in rec[d]["errors"].items():
                print(f"    {BACKEND_LABEL[name]} {d} n/a: {err}", file=sys.stderr, flush=True)
        write_json(args.json, meta, args, results, time.time() - t_start)

    print(format_table(results, args.directions))
    notes = []
    flagged = [(d, r) for r in results for d in args.directions if r[d]["check"].get("flag")]
    if flagged:
        notes.append(
            "! = ours disagrees with the float32 reference by more than 2x the peers' error + 1e-3 (relative to the "
            "largest reference gradient for bwd), or is not finite, at: "
            + ", ".join(f"{d} hdim {r['head_dim']} causal {r['causal']} seqlen {r['seqlen']}" for d, r in flagged)
        )
    unavailable = {}  # (backend, reason) -> directions
    for r in results:
        for d in args.directions:
            for name, err in r[d]["errors"].items():
                dirs = unavailable.setdefault((name, err), [])
                if d not in dirs:
                    dirs.append(d)
    for (name, err), dirs in sorted(unavailable.items()):
        notes.append(f"{BACKEND_LABEL[name]} n/a ({'/'.join(dirs)}): {err}")
    print()
    print(
        "TFLOP/s (median of do_bench); bwd = torch.autograd.grad after one forward, FLOPs 2.5 x fwd; maxdiff = max "
        "|ours - cuDNN| over the whole output or all three gradients (FA2 where cuDNN is n/a)."
    )
    for n in notes:
        print(n)
    print(f"JSON: {os.path.relpath(args.json)} ({time.time() - t_start:.0f}s)")
    return 0  # a flagged point is reported in the table, not as a failure: this is a benchmark, not a test


if __name__ == "__main__":
    sys.exit(main())
