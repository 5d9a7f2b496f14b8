#!/usr/bin/env python3
"""Attention benchmark and nightly regression gate: flash_attn_hopper against torch SDPA's cuDNN and
FlashAttention-2 backends, forward and backward.

    python -m flash_attn_hopper.benchmark                         # whole grid, bf16, fwd and bwd -> JSON + table
    python -m flash_attn_hopper.benchmark --plots bench_out --summary bench_out/summary.md \\
        --compare benchmarks/results/last_good.json --history bench_history      # the nightly job
    python -m flash_attn_hopper.benchmark --input bench_out/attention.json --plots bench_out   # no GPU: re-plot
    python -m flash_attn_hopper.benchmark --smoke                 # one tiny point: checks the script itself

(``python benchmarks/bench_attention.py`` is the same command; it loads this file without importing torch, so its
``--help`` works anywhere.)

Grid of the FlashAttention-3 paper's benchmark: batch * seqlen = 16384 tokens, hidden 2048 so
nheads = 2048 / head_dim, seqlen_q = seqlen_k, MHA ("dense" points). Forward FLOPs = 4 * batch * nheads * seqlen^2 *
head_dim, halved when causal (for seqlen_q == seqlen_k the bottom-right causal mask of flash_attn_hopper equals
SDPA's top-left ``is_causal``); backward FLOPs = 2.5 x forward. Feature points (``--features``): GQA (nheads_kv =
nheads / 4; peers through SDPA ``enable_gqa``), sliding window, softcap and varlen, at head_dim 128; deterministic
backward at every head dim of the run. A feature this
build of flash_attn_hopper lacks is recorded as a skipped point with the reason (so the point appears, measured,
once the feature lands); the peers are not run there.

Timing: ``triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="all")``, from which each backend's median,
p20, p80, min and max (ms) are kept; TFLOP/s come from the median. Forward: the attention call, without autograd.
Backward: the forward runs once with q, k, v requiring grad, then ``torch.autograd.grad(out, (q, k, v), dout,
retain_graph=True)`` is timed. Before timing, each dense point compares our output (gradients) with the peers' and
checks all backends against a float32 reference, so a broken kernel shows in the table (``!``) instead of as a
fast wrong number.

One JSON record per run (``--json``): metadata (GPU, SM clock before and after the run from nvidia-smi, driver,
CUDA, torch, cuDNN, triton versions, git commit) and every point's numbers. ``--compare BASELINE.json`` prints the
per-point ratio to a baseline record and exits 1 when a point of ours is slower than the baseline by more than
``--threshold`` (default 0.05) after re-measuring it (best of REMEASURE_TRIES = 3 tries, buffers at different addresses); points missing on either side are reported, not failed.
``--plots DIR`` writes PNGs (TFLOP/s vs seqlen per head_dim and mask, ours against the peers, fwd and bwd; needs
matplotlib), ``--history DIR`` a plot of ours over a folder of JSON records, ``--summary PATH`` a markdown table.
torch, triton, matplotlib and flash_attn_hopper's extension are imported only when needed, so ``--help`` and the
record-only modes work anywhere.
"""

import argparse
import contextlib
import copy
import datetime
import glob
import json
import math
import numbers
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
_PARENT = os.path.dirname(_HERE)
# The checkout when run from one (setup.py next to the package), else the working directory (an installed copy).
REPO_ROOT = _PARENT if os.path.isfile(os.path.join(_PARENT, "setup.py")) else os.getcwd()
DEFAULT_JSON = os.path.join(REPO_ROOT, "bench_out", "attention.json")
DEFAULT_SMOKE_JSON = os.path.join(REPO_ROOT, "bench_out", "attention_smoke.json")
ALL_HEAD_DIMS = (64, 128, 256)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DEVICE = "cuda"
BACKENDS = ("ours", "cudnn", "fa2")
PEERS = ("cudnn", "fa2")
BACKEND_LABEL = {"ours": "ours", "cudnn": "cuDNN", "fa2": "FA2"}
DIRECTIONS = ("fwd", "bwd")
BWD_FLOPS_FACTOR = 2.5  # backward FLOPs / forward FLOPs
# Forward: query rows (first and last REF_ROWS) and heads of batch element 0 checked against the float32 reference.
# Backward: all rows of the first REF_HEADS heads of batch element 0 (dK and dV need every query row; GQA: every
# query head of K/V head 0). Each point's bound is DESIGN.md §3's: 2 x the naive (input-dtype) reference's error.
REF_ROWS = 128
REF_HEADS = 2
GRAD_NAMES = ("dq", "dk", "dv")
SCHEMA = 2  # 1: the records of benchmarks/bench_attention.py before the nightly (no "feature", no "stats")

# Feature points: measured at these head dims and seqlens (intersected with --head-dims / --seqlens).
FEATURES = ("dense", "gqa", "varlen", "window", "softcap", "deterministic")
FEATURE_HEAD_DIMS = (128,)
# Features measured at every head dim of the run instead: deterministic mode's cost must hold at each (issue 7).
FEATURES_EVERY_HEAD_DIM = ("deterministic",)
FEATURE_SEQLENS = (1024, 4096, 16384)
GQA_GROUP = 4  # nheads / nheads_kv
WINDOW = 1024  # window_size = (WINDOW, WINDOW), or (WINDOW, 0) when causal
SOFTCAP = 30.0


def _int_list(text):
    values = []
    for part in text.replace(" ", ",").split(","):
        if part.strip():
            try:
                values.append(int(part))
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected a comma-separated list of integers")
    return list(dict.fromkeys(values))  # a repeated value would time its points twice


def _choice_list(choices):
    def parse(text):
        values = [p.strip().lower() for p in text.split(",") if p.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(choices)}")
        return list(dict.fromkeys(values))

    return parse


_backend_list = _choice_list(BACKENDS)


def _prog():
    """The command as run: the module form, or the script's path (benchmarks/bench_attention.py loads this file)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    if os.path.basename(main_file) in ("benchmark.py", "__main__.py", ""):
        return "python -m flash_attn_hopper.benchmark"
    try:
        rel = os.path.relpath(main_file)
    except (ValueError, OSError):  # another drive (Windows), or the working directory was removed
        return f"python {main_file}"
    return f"python {main_file if rel.startswith('..') else rel}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog=_prog(),
        description="Attention TFLOP/s, forward and backward: flash_attn_hopper vs torch SDPA cuDNN and FA2 backends "
        "(the FlashAttention-3 paper's grid plus feature points), with a regression gate against a baseline record, "
        "plots and a markdown summary.",
    )
    g = p.add_argument_group("grid")
    g.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="input dtype (default bf16)")
    g.add_argument("--head-dims", type=_int_list, default="64,128,256", help="comma-separated (default 64,128,256)")
    g.add_argument(
        "--seqlens",
        type=_int_list,
        default=",".join(map(str, DEFAULT_SEQLENS)),
        help="comma-separated seqlen_q = seqlen_k values (default %(default)s)",
    )
    g.add_argument("--causal", choices=("both", "no", "yes"), default="both", help="causal masks to run (default both)")
    g.add_argument(
        "--direction",
        choices=("fwd", "bwd", "both"),
        default="both",
        help="forward, backward (timed alone, after one forward) or both (default both)",
    )
    g.add_argument(
        "--features",
        type=_choice_list(FEATURES),
        default=",".join(FEATURES),
        help="point kinds: dense MHA and the features, at head_dim 128 (deterministic: every head dim) and seqlens "
        "1024/4096/16384 (default %(default)s; a feature ours lacks is recorded as skipped with the reason)",
    )
    g.add_argument(
        "--tokens", type=int, default=16384, help="batch * seqlen; batch = max(1, tokens // seqlen) (default 16384)"
    )
    g.add_argument("--hidden", type=int, default=2048, help="nheads * head_dim (default 2048)")
    g.add_argument(
        "--backends", type=_backend_list, default="ours,cudnn,fa2", help="subset of ours,cudnn,fa2 (default all)"
    )
    g.add_argument("--warmup", type=int, default=25, help="do_bench warmup in ms (default 25)")
    g.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms (default 100)")
    g.add_argument(
        "--settle",
        action="store_true",
        help="time each backend once more before the timing kept, and discard it (the clock and power state of the "
        "backend's own steady load, not of the lighter work before it)",
    )
    g.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="times each backend is timed per point and direction, the order reversed in every other round; the kept "
        "median is the median of the rounds' medians, so that one outlying round does not decide a point (two rounds "
        "of one backend at one point differed by up to 32 %% on an H100 in session 73) (default %(default)s)",
    )
    g.add_argument(
        "--no-rotate",
        dest="rotate",
        action="store_false",
        help="time the backends in --backends order at every point (default: the order is rotated by a random step, "
        "seeded, per point and direction)",
    )
    g.add_argument(
        "--no-lead-in",
        dest="lead_in",
        action="store_false",
        help="do not time the point's first backend once before the rounds (default: timed once and discarded, so "
        "that no backend is timed straight after the lighter correctness check)",
    )
    g.add_argument(
        "--preheat",
        type=float,
        default=3.0,
        help="seconds of matrix multiplies before the first point, so that the first points run at the sustained "
        "clock and power state the rest of the grid runs at (default %(default)s; 0: none)",
    )
    g.add_argument("--no-check", action="store_true", help="skip the correctness check before timing")
    g.add_argument("--seed", type=int, default=0, help="random seed of the inputs (default 0)")
    g.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny dense point (seqlen 256, 2 heads) with short timing, to check the script itself",
    )
    g.add_argument("--no-bar", action="store_true", help="no tqdm progress bar (a line per point is printed anyway)")
    g.add_argument(
        "--no-adjacent",
        action="store_true",
        help="skip the dense references timed beside each feature point (the same mask and seqlen; for windows also "
        "the dense seqlens of equal work)",
    )
    o = p.add_argument_group("output and regression gate")
    o.add_argument(
        "--json",
        default=None,
        help=f"output JSON record (default {os.path.relpath(DEFAULT_JSON)}; "
        f"{os.path.relpath(DEFAULT_SMOKE_JSON)} with --smoke)",
    )
    o.add_argument(
        "--input",
        metavar="RECORD.json",
        default=None,
        help="measure nothing: use this record as the current run (for --compare, --plots, --summary, --history; "
        "no re-measuring)",
    )
    o.add_argument(
        "--compare",
        metavar="BASELINE.json",
        default=None,
        help="compare ours with this record; exit 1 when a point is slower by more than --threshold after re-measuring"
        " it (best of 3 tries)",
    )
    o.add_argument(
        "--threshold",
        type=float,
        default=0.05,
        help="allowed slowdown of ours per point, as a fraction of the baseline time (default 0.05)",
    )
    o.add_argument("--plots", metavar="DIR", default=None, help="write TFLOP/s vs seqlen PNGs into DIR (matplotlib)")
    o.add_argument(
        "--history",
        metavar="DIR",
        default=None,
        help="plot ours over the JSON records in DIR (plus this run) into history.png (in --plots DIR, else DIR)",
    )
    o.add_argument("--summary", metavar="PATH", default=None, help="write a markdown summary table to PATH")
    args = p.parse_args(argv)
    # (a comparison with NaN is False: `threshold < 0` let NaN through, and a NaN or infinite threshold makes every
    # point "ok", so that the gate passes whatever it measures)
    if not 0 <= args.threshold < math.inf:
        p.error(f"--threshold must be a finite fraction >= 0 (0.05: 5% slower fails), got {args.threshold}")
    _check_sizes(p, args)
    if args.smoke:
        args.seqlens = [256]
        args.tokens = 512
        args.causal = "no"
        args.features = ["dense"]
        args.warmup, args.rep = 5, 20
        args.preheat = 0.0  # a smoke run checks that the grid runs, not speed
        # One head dim: the one given first, else (None) the first compiled one, chosen once the build is known.
        args.head_dims = args.head_dims[:1] if args.head_dims != list(ALL_HEAD_DIMS) else None
    if args.json is None and args.input is None:
        args.json = DEFAULT_SMOKE_JSON if args.smoke else DEFAULT_JSON
    _check_output_paths(p, args)
    args.directions = list(DIRECTIONS) if args.direction == "both" else [args.direction]
    for hd in args.head_dims or []:
        if hd <= 0 or args.hidden % hd:
            p.error(f"--hidden {args.hidden} must be a positive multiple of every head dim (got {hd})")
    return args


# flash_attn_hopper's head_dim rule (interface.kernel_head_dim is not None), restated here because this module parses
# its arguments without importing torch; tests/test_bug_reports_twentysecond_cpu.py checks that the two agree.
HEAD_DIM_MULTIPLE, MAX_HEAD_DIM = 8, 256


def ours_runs_head_dim(head_dim):
    """Whether flash_attn_hopper has kernels for head_dim (a multiple of 8 from 8 to 256) in a full build."""
    return 0 < head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0


def _check_output_paths(p, args):
    """--json / --summary name files, --plots / --history folders: refused at parse time (exit status 2) where the path
    cannot be one, instead of a traceback after the grid's first point (--json, leaving PATH.tmp) or after the whole
    grid (--summary, --plots, --history's history.png). The path is walked as the OS will walk it (not normalised:
    "afile/../x" fails there)."""
    for flag, path, want_dir in (("--json", args.json, False), ("--summary", args.summary, False),
                                 ("--plots", args.plots, True), ("--history", args.history, True)):
        if not path:
            continue
        if not want_dir and path.endswith((os.sep, "/")):
            p.error(f"{flag} {path} ends with a separator; it needs a file path")
        full = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
        if want_dir and os.path.lexists(full) and not os.path.exists(full):  # (a file's is replaced by the writer)
            p.error(f"{flag} {path} is a broken link")
        if os.path.exists(full) and os.path.isdir(full) != want_dir:
            p.error(f"{flag} {path} is {'not a folder' if want_dir else 'a folder'}; it needs a "
                    f"{'folder' if want_dir else 'file path'}")
        parent = os.path.dirname(full)
        while not os.path.exists(parent) and os.path.dirname(parent) != parent:
            if os.path.lexists(parent):
                p.error(f"{flag} {path}: {parent} is a broken link")
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            p.error(f"{flag} {path}: {parent} is a file, not a folder")


def _check_sizes(p, args):
    """The grid's sizes, refused by name at parse time (p.error: exit status 2) instead of failing mid-run: a seqlen of
    0 divided by zero in run_point after the metadata and the points before it; a negative one, or a --hidden below
    1, made negative shapes, or points of 0 heads and 0 FLOPs whose ours/peer ratio divided 0 by 0 (a --tokens below 1
    was taken as batch 1); head dims flash_attn_hopper has no kernel for were recorded as "not in this build
    (FAH_HDIMS ...)", advice that no build follows."""
    for flag, values in (("--seqlens", args.seqlens), ("--tokens", [args.tokens]), ("--hidden", [args.hidden])):
        bad = [x for x in values if x < 1]
        if bad:
            p.error(f"{flag} must be >= 1, got {bad[0]}")
    if args.warmup < 0 or args.rep < 1:
        p.error(f"--warmup must be >= 0 and --rep >= 1 (milliseconds), got {args.warmup} and {args.rep}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if not 0 <= args.preheat <= 600:
        p.error(f"--preheat must be in [0, 600] seconds, got {args.preheat}")
    if "ours" in args.backends:
        bad = [hd for hd in args.head_dims or [] if not ours_runs_head_dim(hd)]
        if bad:
            p.error(f"--head-dims: flash_attn_hopper runs head dims that are multiples of {HEAD_DIM_MULTIPLE} from "
                    f"{HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM}, got {bad[0]} (time only the peers with --backends "
                    "cudnn,fa2)")


def grid_specs(args):
    """The points of a run, in order: dicts with feature, head_dim, causal, seqlen."""
    causals = {"both": [False, True], "no": [False], "yes": [True]}[args.causal]
    specs = []
    if "dense" in args.features:
        specs += [
            {"feature": "dense", "head_dim": hd, "causal": c, "seqlen": s}
            for hd in args.head_dims
            for c in causals
            for s in args.seqlens
        ]
    hds = [hd for hd in args.head_dims if hd in FEATURE_HEAD_DIMS] or list(args.head_dims[:1])
    sls = [s for s in args.seqlens if s in FEATURE_SEQLENS] or list(args.seqlens)
    for feat in args.features:
        if feat != "dense":
            specs += [
                {"feature": feat, "head_dim": hd, "causal": c, "seqlen": s}
                for hd in (args.head_dims if feat in FEATURES_EVERY_HEAD_DIM else hds)
                for c in causals
                for s in sls
            ]
    return specs


# ----------------------------------------------------------------------------------------------------------------
# Metadata


def _git(*cmd):
    try:
        r = subprocess.run(["git", "-C", REPO_ROOT, *cmd], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _nvidia_smi(fields):
    """{field: value} of the first visible GPU from nvidia-smi, or None (no nvidia-smi, no GPU, a query error)."""
    cmd = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible:
        cmd += ["-i", visible]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        return None
    values = [v.strip() for v in lines[0].split(",")]
    if len(values) != len(fields):
        return None
    out = {}
    for f, v in zip(fields, values):
        try:
            out[f] = float(v) if "." in v else int(v)
        except ValueError:
            out[f] = None if v.startswith("[") else v  # "[N/A]", "[Not Supported]"
    return out


def gpu_clocks():
    """SM clock (MHz) and what moves it, from nvidia-smi; None where nvidia-smi is absent."""
    q = _nvidia_smi(["clocks.sm", "clocks.max.sm", "temperature.gpu", "power.draw"])
    if q is None:
        return None
    return {
        "sm_mhz": q.get("clocks.sm"),
        "max_sm_mhz": q.get("clocks.max.sm"),
        "temperature_c": q.get("temperature.gpu"),
        "power_w": q.get("power.draw"),
    }


def _driver_version():
    q = _nvidia_smi(["driver_version"])
    return None if q is None else str(q["driver_version"])


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
        "schema": SCHEMA,
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


def summarize_times(times_ms):
    """median, p20, p80, min, max and n of a list of times (ms); linear interpolation between order statistics."""
    xs = sorted(float(t) for t in times_ms)
    if not xs:
        raise ValueError("no timings")

    def q(f):
        pos = f * (len(xs) - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"median": q(0.5), "p20": q(0.2), "p80": q(0.8), "min": xs[0], "max": xs[-1], "n": len(xs)}


def make_timer(torch, warmup, rep):
    """Returns (name, fn -> summarize_times dict). triton.testing.do_bench(return_mode="all") when triton imports,
    else CUDA events."""
    try:
        from triton.testing import do_bench
    except Exception as e:  # noqa: BLE001
        print(f"warning: triton unavailable ({e}); timing with CUDA events instead of do_bench", file=sys.stderr)
    else:
        return (
            f"triton.testing.do_bench(warmup={warmup}, rep={rep}, return_mode='all') -> median, p20, p80, min, max",
            lambda fn: summarize_times(do_bench(fn, warmup=warmup, rep=rep, return_mode="all")),
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
        return summarize_times([s.elapsed_time(e) for s, e in times])

    return f"cuda events (warmup={warmup}ms, rep={rep}ms) -> median, p20, p80, min, max", event_bench


# ----------------------------------------------------------------------------------------------------------------
# References


def _ref_rows(torch, seqlen, device):
    head = torch.arange(0, min(REF_ROWS, seqlen), device=device)
    tail = torch.arange(max(seqlen - REF_ROWS, 0), seqlen, device=device)
    return torch.unique(torch.cat([head, tail]))


def _outside_mask(seqlen, causal, window, device, rows=None):
    """True where a key is masked for a query row (the rows `rows`, default all) at seqlen_q = seqlen_k = seqlen:
    the library's window rule (testing.local_mask)."""
    from .testing import local_mask

    outside = ~local_mask(seqlen, seqlen, window_size=window, causal=causal, device=device)
    return outside if rows is None else outside[rows]


def _ref_options(ours_kw):
    """(window, softcap) of a point from the keyword arguments ours runs it with."""
    return tuple(ours_kw.get("window_size", (-1, -1))), float(ours_kw.get("softcap", 0.0))


def reference_slice(torch, q, k, v, causal, rows, window=(-1, -1), softcap=0.0, upcast=True):
    """Attention for batch 0, the first REF_HEADS query heads and query rows `rows`: (R, H, d), with the point's
    window and softcap (scores c·tanh(S / c), then the mask) and GQA's head mapping (query head h reads K/V head
    h // (nheads / nheads_k)). upcast=True: fp16 / bf16 inputs in float32 (the reference; float32 and float64 inputs
    stay as they are); upcast=False: in the input dtype, the naive reference of DESIGN.md §3 whose error sets the
    bound."""
    from .testing import _reference_mode

    heads = min(REF_HEADS, q.shape[2])
    kv = torch.arange(heads, device=q.device) // (q.shape[2] // k.shape[2])
    dt = torch.float32 if upcast and q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    with _reference_mode(q.device.type):
        qs, ks, vs = q[0, rows, :heads].to(dt), k[0][:, kv].to(dt), v[0][:, kv].to(dt)
        scores = torch.einsum("rhd,shd->hrs", qs, ks) * (1.0 / math.sqrt(q.shape[-1]))
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(_outside_mask(k.shape[1], causal, window, q.device, rows)[None], float("-inf"))
        return torch.einsum("hrs,shd->rhd", torch.softmax(scores, dim=-1), vs)


def reference_grads_kv_head(torch, q, k, v, dout, causal, kv_head, window=(-1, -1), softcap=0.0, upcast=True):
    """(dq, dk, dv) of batch element 0 for K/V head `kv_head`: dq (seqlen, group, head_dim) of the query heads that
    read it, dk and dv (seqlen, head_dim) summed over them (GQA), from the equations of the backward (FlashAttention-3
    paper §2.1): dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dO ∘ O)), with a softcap dS ∘= 1 − tanh²(X / c),
    dQ = α dS K, dK = α dSᵀ Q. upcast as reference_slice. seqlen_q == seqlen_k. Holds about five seqlen² matrices of
    the compute dtype per query head (5 GiB in float32 at seqlen 16384)."""
    from .testing import _reference_mode

    group = q.shape[2] // k.shape[2]
    dt = torch.float32 if upcast and q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1])
    with _reference_mode(q.device.type):
        kh, vh = k[0, :, kv_head].to(dt), v[0, :, kv_head].to(dt)
        outside = _outside_mask(k.shape[1], causal, window, q.device)
        dk, dv, dqs = torch.zeros_like(kh), torch.zeros_like(vh), []
        for h in range(kv_head * group, (kv_head + 1) * group):
            qh, doh = q[0, :, h].to(dt), dout[0, :, h].to(dt)
            p = (qh @ kh.T).mul_(scale)
            t = None
            if softcap > 0:
                t = torch.tanh(p / softcap)
                p = t * softcap
            p = torch.softmax(p.masked_fill_(outside, float("-inf")), dim=-1)
            dv += p.T @ doh
            dsum = (doh * (p @ vh)).sum(dim=-1, keepdim=True)  # rowsum(dO ∘ O)
            ds = (doh @ vh.T).sub_(dsum).mul_(p)
            del p
            if t is not None:
                ds.mul_(1 - t * t)
                del t
            dqs.append((ds @ kh).mul_(scale))
            dk += (ds.T @ qh).mul_(scale)
            del ds
        return torch.stack(dqs, dim=1), dk, dv


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
    return {"flops": flops, "ms": {}, "stats": {}, "tflops": {}, "errors": {}, "ratio": {}, "check": {}}


# The rotation of the backends' order: a seeded random step per timed point and direction. A step of one per call
# aliased with the grid (three backends, forward and backward, three seqlens per head_dim: ours first at every
# 1024-key forward; with two backends ours first at every forward).
_ORDER_RANDOM = random.Random(0)


def _combine_rounds(per_round):
    """One stats dict from a backend's rounds: the median of the rounds' medians (the kept figure), the extremes of
    their p20 / p80 / min / max, and each round's median."""
    if len(per_round) == 1:
        return per_round[0]
    medians = [st["median"] for st in per_round]
    return {"median": statistics.median(medians), "p20": min(st.get("p20", st["median"]) for st in per_round),
            "p80": max(st.get("p80", st["median"]) for st in per_round),
            "min": min(st.get("min", st["median"]) for st in per_round),
            "max": max(st.get("max", st["median"]) for st in per_round),
            "n": sum(st.get("n", 0) for st in per_round), "round_medians": medians}


def _time_all(torch, timer, args, part, make_thunk, in_backend):
    """Times make_thunk(name)() for every backend without an error yet; fills ms (median), stats (median, p20, p80,
    min, max in ms), tflops (from the median), ratio, and order (the backends' order in each round).

    Why rounds, rotation and a lead-in: the backend timed first at a point, right after the lighter correctness
    check, read fast (session 40: ours 539 first against 488-495 later, same point), and ours moves with where its
    buffers land. So (CLI defaults) the first backend of the point's order is timed once more before the rounds and
    that timing discarded (args.lead_in), the order is rotated by a seeded random step (args.rotate), each backend is
    timed args.rounds times with the order reversed in every other round, and the kept median is the median of the
    rounds' medians. args.settle: every timing is preceded by a discarded one of the same backend."""
    names = [n for n in args.backends if n not in part["errors"]]
    if not names:
        order = []
    else:
        shift = _ORDER_RANDOM.randrange(len(names)) if getattr(args, "rotate", False) else 0
        order = names[shift:] + names[:shift]
    rounds = max(1, int(getattr(args, "rounds", 1) or 1))
    per_round = {name: [] for name in order}
    part["order"] = []
    if order and getattr(args, "lead_in", False):
        try:
            fn = make_thunk(order[0])
            in_backend(order[0], lambda fn=fn: timer(fn))
        except Exception:  # noqa: BLE001 - its own timing below records the error
            pass
        finally:
            fn = None
    for r in range(rounds):
        seq = order if r % 2 == 0 else order[::-1]
        part["order"].append(list(seq))
        for name in seq:
            if name in part["errors"]:
                continue
            try:
                fn = make_thunk(name)
                if getattr(args, "settle", False):
                    in_backend(name, lambda fn=fn: timer(fn))
                stats = in_backend(name, lambda fn=fn: timer(fn))
            except Exception as e:  # noqa: BLE001
                part["errors"][name] = "timing failed: " + _describe(e)
                continue
            finally:
                fn = None  # drop the graph (backward) before the next backend
            per_round[name].append(stats)
    for name in order:
        if name in part["errors"] or not per_round[name]:
            continue
        stats = _combine_rounds(per_round[name])
        part["ms"][name] = stats["median"]
        part["stats"][name] = stats
        part["tflops"][name] = part["flops"] / (stats["median"] * 1e-3) / 1e12
    for peer in ("cudnn", "fa2"):
        if "ours" in part["tflops"] and peer in part["tflops"]:
            part["ratio"][f"ours/{peer}"] = part["tflops"]["ours"] / part["tflops"][peer]
    for name in args.backends:
        part["tflops"].setdefault(name, None)
        part["ms"].setdefault(name, None)


def _flag(err_ours, err_naive, floor):
    """DESIGN.md §3: ours is flagged when its error against the float32 reference is not finite or exceeds 2 x the
    naive (input-dtype) reference's error + floor; a naive error that is not finite bounds nothing, so it flags too."""
    return not (math.isfinite(err_naive) and err_ours <= 2 * err_naive + floor)  # (a NaN error fails)


def run_fwd(torch, F, fah, timer, args, tensors, causal, flops, skip, in_backend, kw=None):
    """kw: {"ours": extra keyword arguments of fah.attention (a window or softcap also shapes the references), "peer":
    of SDPA}."""
    q, k, v, qt, kt, vt = tensors
    kw = kw or {}
    ours_kw, peer_kw = kw.get("ours", {}), kw.get("peer", {})
    part = _new_part(flops)
    part["errors"].update(skip)

    def make_fn(name):
        if name == "ours":
            return lambda: _ours_call(fah, q, k, v, causal, ours_kw)
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **peer_kw)

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
    if not args.no_check and outs:
        chk = part["check"]
        rows = _ref_rows(torch, q.shape[1], q.device)
        window, softcap = _ref_options(ours_kw)
        ref = reference_slice(torch, q, k, v, causal, rows, window, softcap)
        heads = ref.shape[1]
        chk["ref_rows"] = int(rows.numel())
        chk["ref_heads"] = heads
        chk["ref_err"] = {n: _max_abs(torch, o[0, rows, :heads], ref) for n, o in outs.items()}
        chk["naive_err"] = _max_abs(torch, reference_slice(torch, q, k, v, causal, rows, window, softcap, False), ref)
        errs = chk["ref_err"]
        if "ours" in errs:
            bad = _flag(errs["ours"], chk["naive_err"], 1e-3)
            md = chk.get("maxdiff_vs_cudnn", chk.get("maxdiff_vs_fa2"))
            chk["flag"] = bool(bad or (md is not None and not math.isfinite(md)))
        del ref
    outs.clear()

    with torch.no_grad():
        _time_all(torch, timer, args, part, make_fn, in_backend)
    return part


def run_bwd(torch, F, fah, timer, args, tensors, dout, causal, flops, skip, in_backend, kw=None):
    q, k, v, qt, kt, vt = tensors
    kw = kw or {}
    ours_kw, peer_kw = kw.get("ours", {}), kw.get("peer", {})
    part = _new_part(flops)
    part["errors"].update(skip)

    def forward(name):
        """One forward with grad: (out, leaves, dout in the layout of out)."""
        if name == "ours":
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            return _ours_call(fah, *leaves, causal, ours_kw), leaves, dout
        leaves = [t.detach().requires_grad_(True) for t in (qt, kt, vt)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal, **peer_kw)
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
    if not args.no_check and grads:
        chk = part["check"]
        group = q.shape[2] // k.shape[2]
        kv_heads = max(1, min(REF_HEADS // group, k.shape[2]))  # GQA: every query head of a K/V head, for dK and dV
        window, softcap = _ref_options(ours_kw)
        errs = {n: {g: 0.0 for g in GRAD_NAMES} for n in list(grads) + ["naive"]}
        ref_max = {g: 0.0 for g in GRAD_NAMES}

        def worst(acc, e):  # a NaN (or inf) of any head sticks
            return acc if not math.isfinite(acc) else e if not math.isfinite(e) else max(acc, e)

        for h in range(kv_heads):
            ref = reference_grads_kv_head(torch, q, k, v, dout, causal, h, window, softcap)
            naive = reference_grads_kv_head(torch, q, k, v, dout, causal, h, window, softcap, upcast=False)
            qh = slice(h * group, (h + 1) * group)
            for gi, gname in enumerate(GRAD_NAMES):
                ref_max[gname] = max(ref_max[gname], ref[gi].abs().max().item())
                errs["naive"][gname] = worst(errs["naive"][gname], _max_abs(torch, naive[gi], ref[gi]))
                for n, g in grads.items():
                    mine = g[gi][0, :, qh] if gi == 0 else g[gi][0, :, h]
                    errs[n][gname] = worst(errs[n][gname], _max_abs(torch, mine, ref[gi]))
            del ref, naive
        chk["ref_rows"] = int(q.shape[1])
        chk["ref_heads"] = kv_heads * group
        chk["naive_err"] = errs.pop("naive")
        chk["ref_err"] = errs
        if "ours" in errs:
            bad = any(_flag(errs["ours"][g], chk["naive_err"][g], 1e-3 * max(1.0, ref_max[g])) for g in GRAD_NAMES)
            md = chk.get("maxdiff_vs_cudnn", chk.get("maxdiff_vs_fa2"))
            chk["flag"] = bool(bad or (md is not None and not math.isfinite(md)))
    grads.clear()

    _time_all(torch, timer, args, part, make_thunk, in_backend)
    return part


# ----------------------------------------------------------------------------------------------------------------
# Features and one grid point


def window_pairs(seqlen, left, right):
    """Number of (query, key) pairs with key - query in [-left, right] for seqlen_q = seqlen_k = seqlen."""
    return sum(min(seqlen - 1, i + right) - max(0, i - left) + 1 for i in range(seqlen))


def point_flops(spec, batch, nheads):
    """Forward FLOPs of a point: 4 * batch * nheads * head_dim * (attended (query, key) pairs)."""
    s, hd = spec["seqlen"], spec["head_dim"]
    if spec["feature"] == "window":
        pairs = window_pairs(s, WINDOW, 0 if spec["causal"] else WINDOW)
        return 4 * batch * nheads * hd * pairs
    flops = 4 * batch * nheads * s * s * hd
    return flops // 2 if spec["causal"] else flops


def feature_support(fah, feature):
    """None when this flash_attn_hopper can run `feature` (as far as its API tells), else the reason."""
    if feature == "dense":
        return None
    if fah is None:
        return "flash_attn_hopper unavailable"
    try:
        import inspect

        params = inspect.signature(fah.attention).parameters
    except (TypeError, ValueError, AttributeError):
        params = {}
    if feature == "gqa":
        check = getattr(getattr(fah, "interface", None), "_check_tensor_args", None)
        if check is None:
            return None  # no probe: let the run decide (an error is recorded per backend)
        import torch

        q = torch.empty((1, 8, 8, 64), dtype=torch.bfloat16, device="meta")
        kv = torch.empty((1, 8, 8 // GQA_GROUP, 64), dtype=torch.bfloat16, device="meta")
        try:
            check(q, kv, kv)
        except NotImplementedError as e:
            return f"not in flash_attn_hopper yet ({_describe(e)})"
        except Exception:  # noqa: BLE001 - the probe itself failed: let the run decide
            return None
        return None
    if feature == "window":
        return None if "window_size" in params else "not in flash_attn_hopper yet (attention() has no window_size)"
    if feature == "softcap":
        return None if "softcap" in params else "not in flash_attn_hopper yet (attention() has no softcap)"
    if feature == "deterministic":
        if "deterministic" in params:
            return None
        return "not in flash_attn_hopper yet (attention() has no deterministic)"
    if feature == "varlen":
        if not hasattr(fah, "attention_varlen"):
            return "not in flash_attn_hopper yet (no attention_varlen entry point)"
        return None
    return f"unknown feature {feature!r}"


def feature_kwargs(spec):
    """(ours kwargs, peer kwargs, peer skip reason or None). Every point is checked against the float32 reference of
    its own problem (window, softcap and GQA included; varlen's equal lengths and deterministic mode are dense)."""
    f, causal = spec["feature"], spec["causal"]
    if f == "gqa":
        return {}, {"enable_gqa": True}, None
    if f == "window":
        return {"window_size": (WINDOW, 0 if causal else WINDOW)}, {}, "torch SDPA has no sliding-window kernel"
    if f == "softcap":
        return {"softcap": SOFTCAP}, {}, "torch SDPA has no softcap kernel"
    if f == "varlen":
        return {"varlen": True}, {}, "torch SDPA has no variable-length kernel"
    if f == "deterministic":
        return {"deterministic": True}, {}, "peers not run at the deterministic points (compare with dense)"
    return {}, {}, None


EQUAL_WORK_TOLERANCE = 0.05  # how far a dense point's keys per row may sit from a window point's average


def window_keys_per_row(seqlen, causal):
    """Average keys a query row sees at a window point (window (W, W), or (W, 0) causal) of seqlen_q = seqlen_k."""
    return window_pairs(seqlen, WINDOW, 0 if causal else WINDOW) / seqlen


ADJACENT_ROUNDS = 2  # time_adjacent: a discarded warm-up, then reference, feature, feature, reference
ADJACENT_SEQLEN_STEP = 128  # a window's equal-work references: the multiple of this nearest the target seqlen


def _nearest_multiple(target, step):
    return max(step, step * round(target / step))


def feature_reference_specs(spec, step=None):
    """The dense points of ours that a feature point is timed beside (add_adjacent_references): [(kind, causal,
    seqlen)]. "same": dense at the same head_dim, mask and seqlen (GQA, varlen, softcap, deterministic). Windows:
    "equal_work", dense non-causal at the multiple of `step` (default ADJACENT_SEQLEN_STEP) nearest the window rows'
    average keys, and for a causal window also "equal_work_causal", dense causal at the multiple nearest the seqlen
    whose rows see as many keys on average ((seqlen + 1) / 2). With the tokens of the point kept (batch = tokens //
    seqlen), the same keys per row means about the same attended pairs: the issue's "dense kernel at the same useful
    FLOPs", once with the mask's causal flag kept; TFLOP/s on both sides count each side's own pairs exactly."""
    step = step or ADJACENT_SEQLEN_STEP
    feature, causal, seqlen = spec["feature"], bool(spec["causal"]), spec["seqlen"]
    if feature == "dense":
        return []
    if feature != "window":
        return [("same", causal, seqlen)]
    keys = window_keys_per_row(seqlen, causal)
    out = [("equal_work", False, _nearest_multiple(keys, step))]
    if causal:
        out.append(("equal_work_causal", True, _nearest_multiple(2 * keys - 1, step)))
    return out


def time_adjacent(timer, feature_fn, reference_fn, rounds=ADJACENT_ROUNDS, warmup=True):
    """Median times (ms) of a feature call and its dense reference, timed in turn so that both see the same clock and
    power state (on a GPU at its power limit the SM clock drifts over a run of minutes, which moves ratios between
    points measured far apart). With `warmup`, one timing of the reference is made first and discarded: the first
    timed call of a point otherwise runs on a card cooled by the previous point's lighter work, before the power
    limit lowers the clock, and the side timed first reads fast (H200, session 40: a bf16 call beside a copy of
    itself read 0.91-0.95 of it at head_dim 128, forward). Then `rounds` rounds in the Thue-Morse order (reference,
    feature; feature, reference; feature, reference; reference, feature; ...): an even count cancels a steady drift,
    a count of four or eight also its curvature. Returns (feature ms, reference ms), each the mean of its rounds'
    medians."""
    if warmup:
        timer(reference_fn)
    tf, tr = [], []
    for i in range(rounds):
        reference_first = bin(i).count("1") % 2 == 0
        order = ((reference_fn, tr), (feature_fn, tf)) if reference_first else ((feature_fn, tf), (reference_fn, tr))
        for fn, acc in order:
            acc.append(timer(fn)["median"])
    return sum(tf) / len(tf), sum(tr) / len(tr)


def feature_ratios(results):
    """Ours at each measured feature point against dense points of the same record: {"key": point_key,
    "direction": d, "ours": TFLOP/s, "vs_dense": ours / dense at the same head_dim, mask and seqlen, "vs_equal_work",
    "equal_work_seqlen": for windows, ours / dense non-causal (same head_dim) at the seqlen nearest the window's
    average keys per row, when that is within EQUAL_WORK_TOLERANCE of it (same tokens, same keys per row: the same
    pairs to compute, the issue's "dense kernel at the same useful FLOPs"); else None, "adjacent": {kind: the
    record's part["adjacent"] entry} (dense references timed beside the point, feature_reference_specs)}. A missing
    dense point gives None."""
    rows = measured(results)
    dense = {(r["head_dim"], bool(r["causal"]), r["seqlen"]): r for r in rows if r.get("feature", "dense") == "dense"}

    def ours(rec, d):
        return (rec.get(d) or {}).get("tflops", {}).get("ours") if rec else None

    def ratio(a, b):
        return a / b if a is not None and b else None

    out = []
    for r in rows:
        feature = r.get("feature", "dense")
        if feature == "dense":
            continue
        equal_seqlen = None
        if feature == "window":
            keys = window_keys_per_row(r["seqlen"], bool(r["causal"]))
            near = [s for (hd, c, s) in dense if hd == r["head_dim"] and not c
                    and abs(s - keys) <= EQUAL_WORK_TOLERANCE * keys]
            equal_seqlen = min(near, key=lambda s: abs(s - keys)) if near else None
        for d in DIRECTIONS:
            t = ours(r, d)
            if t is None:
                continue
            same = dense.get((r["head_dim"], bool(r["causal"]), r["seqlen"]))
            equal = None
            if equal_seqlen is not None:
                equal = ratio(t, ours(dense.get((r["head_dim"], False, equal_seqlen)), d))
            adjacent = {x["kind"]: x for x in (r.get(d) or {}).get("adjacent", []) if x.get("ratio") is not None}
            out.append({"key": point_key(r), "direction": d, "ours": t, "vs_dense": ratio(t, ours(same, d)),
                        "vs_equal_work": equal, "equal_work_seqlen": equal_seqlen, "adjacent": adjacent})
    return out


def format_feature_ratios(results):
    """Markdown lines of feature_ratios (empty without feature points)."""
    ratios = feature_ratios(results)
    if not ratios:
        return []
    by_point = {}
    for x in ratios:
        by_point.setdefault(x["key"], {})[x["direction"]] = x
    dirs = [d for d in DIRECTIONS if any(d in v for v in by_point.values())]
    header = ["feature", "head_dim", "causal", "seqlen"]
    for d in dirs:
        header += [f"{d} ours", f"{d} / dense"]
    header += ["equal-work dense seqlen"] + [f"{d} / equal-work dense" for d in dirs]
    header += [f"{d} / dense timed beside" for d in dirs]
    lines = ["Features against dense points of this run: at the same head_dim, mask and seqlen; windows also against "
             "dense non-causal at the same keys per row (the measured seqlen nearest a window row's average keys, "
             f"within {EQUAL_WORK_TOLERANCE:.0%}; n/a where none is). \"Timed beside\": ours against dense "
             f"references of ours timed in turn with the feature point (after a discarded warm-up, {ADJACENT_ROUNDS} "
             "rounds each in the Thue-Morse order), free of the "
             "clock drift between points measured minutes apart: same = the dense point of the same mask and seqlen; "
             "equal work = dense non-causal with the window's average keys per row; causal equal work = dense causal "
             f"with as many keys per row on average (seqlens rounded to a multiple of {ADJACENT_SEQLEN_STEP}, "
             "batch = the point's tokens // seqlen).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, per_dir in by_point.items():
        feature, _, hd, causal, seqlen = key
        cells = [feature, str(hd), "yes" if causal else "no", str(seqlen)]
        for d in dirs:
            x = per_dir.get(d)
            cells += ["n/a", "n/a"] if x is None else [f"{x['ours']:.0f}", _fmt(x["vs_dense"], ".2f")]
        any_x = next(iter(per_dir.values()))
        if feature != "window":
            cells += ["—"] + ["—"] * len(dirs)
        else:
            cells += [_fmt(any_x["equal_work_seqlen"], "d")]
            cells += [_fmt(per_dir[d]["vs_equal_work"], ".2f") if d in per_dir else "n/a" for d in dirs]
        cells += [_adjacent_cell(per_dir.get(d)) for d in dirs]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


ADJACENT_LABEL = {"same": "same", "equal_work": "equal work", "equal_work_causal": "causal equal work"}


def _adjacent_cell(x):
    if x is None or not x.get("adjacent"):
        return "n/a"
    return "; ".join(f"{a['ratio']:.2f} ({ADJACENT_LABEL.get(kind, kind)} {a['seqlen']})"
                     for kind, a in x["adjacent"].items())


def _ours_call(fah, q, k, v, causal, ours_kw):
    """fah.attention, or for the varlen point fah.attention_varlen on the same tokens packed as equal-length
    sequences (cu_seqlens built once per shape and reused, as a training step reuses them across layers)."""
    if not ours_kw.get("varlen"):
        return fah.attention(q, k, v, causal=causal, **ours_kw)
    import torch

    batch, seqlen, nheads, head_dim = q.shape
    key = (batch, seqlen, q.device)
    cu = _VARLEN_CU.get(key)
    if cu is None:
        cu = _VARLEN_CU[key] = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=q.device)
    out = fah.attention_varlen(
        q.reshape(batch * seqlen, nheads, head_dim), k.reshape(batch * seqlen, k.shape[2], head_dim),
        v.reshape(batch * seqlen, v.shape[2], head_dim), cu, cu, seqlen, seqlen, causal=causal,
    )
    return out.view(batch, seqlen, nheads, head_dim)


_VARLEN_CU = {}


def point_key(rec, direction=None):
    """Identity of a point across records: (feature, dtype, head_dim, causal, seqlen[, direction])."""
    key = (rec.get("feature", "dense"), rec.get("dtype", "bf16"), rec["head_dim"], bool(rec["causal"]), rec["seqlen"])
    return key if direction is None else key + (direction,)


def key_text(key):
    feature, dtype, hd, causal, seqlen = key[:5]
    text = f"head_dim={hd} causal={'yes' if causal else 'no'} seqlen={seqlen}"
    if feature != "dense":
        text = f"{feature} " + text
    if len(key) > 5:
        text += f" {key[5]}"
    return text


class GpuRunner:
    """Measures points on the GPU. The seam of the CLI: main() takes any object with this interface (tests pass
    a fake), so the compare/re-measure flow runs without a GPU.

    meta() -> dict; support(feature) -> None or reason; run(spec, args) -> point record; clocks() -> dict or None.
    """

    def __init__(self, args):
        import torch
        import torch.nn.functional as F

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible; this benchmark needs an sm90 GPU")
        self.torch, self.F = torch, F
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
        self.fah, self.fah_reason, self.built = None, None, None
        if "ours" in args.backends:
            try:
                self.fah = _import_fah()
            except Exception as e:  # noqa: BLE001
                self.fah_reason = f"import failed: {type(e).__name__}: {e}"
            else:
                if not self.fah.EXTENSION_LOADED:
                    try:
                        self.fah._ops.require_extension()
                    except RuntimeError as e:
                        self.fah_reason = str(e)
                else:
                    self.built = self.fah.build_config()
            if self.fah_reason:
                print(f"warning: ours unavailable: {self.fah_reason}", file=sys.stderr)
        if args.smoke:  # one tiny point: 2 sequences of 256 tokens, 2 heads
            if args.head_dims is None:  # the first compiled head dim, 128 preferred
                choices = (self.built["head_dims"] or list(ALL_HEAD_DIMS)) if self.built else list(ALL_HEAD_DIMS)
                args.head_dims = [128 if 128 in choices else choices[0]]
            args.hidden = 2 * args.head_dims[0]
        self.timer_name, self.timer = make_timer(torch, args.warmup, args.rep)
        self.args = args

    def clocks(self):
        return gpu_clocks()

    def preheat(self, seconds):
        """bf16 8192 x 8192 matrix multiplies for about `seconds` (the host checks the time every ten)."""
        torch = self.torch
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn_like(a)
        end = time.time() + seconds
        while time.time() < end:
            for _ in range(10):
                torch.mm(a, b)
            torch.cuda.synchronize()

    def meta(self):
        meta = collect_meta(self.torch, self.fah, self.timer_name, self.args)
        if self.built is not None:
            meta["flash_attn_hopper_build"] = {
                "head_dims": self.built["head_dims"],
                "dtypes": [str(d).replace("torch.", "") for d in self.built["dtypes"]],
            }
        meta["ours_unavailable"] = self.fah_reason
        return meta

    def ours_reason(self, head_dim):
        if self.fah_reason:
            return self.fah_reason
        if self.built is not None:
            # Head dims between the compiled sizes run on the next size up (e.g. 72: forward on 96, backward on 128;
            # --head-dims 96,192 --hidden 1536); older packages without kernel_head_dim had the compiled sizes only.
            rounding = getattr(getattr(self.fah, "interface", None), "kernel_head_dim", None)
            kernels = {head_dim} if rounding is None else {rounding(head_dim)}
            if rounding is not None and hasattr(self.fah.interface, "BACKWARD_HEAD_DIMS"):
                kernels.add(rounding(head_dim, backward=True))  # forward and backward widths differ since 96 / 192
            if not kernels <= set(self.built["head_dims"]):
                return f"head_dim {head_dim} not in this build (FAH_HDIMS: {self.built['head_dims']})"
            if self.dtype not in self.built["dtypes"]:
                return f"dtype {self.args.dtype} not in this build"
        return None

    def support(self, feature):
        if self.fah is None:  # dense points still time the peers; feature points would time nothing useful
            return None if feature == "dense" else f"ours unavailable ({self.fah_reason})"
        return feature_support(self.fah, feature)

    def run(self, spec, args):
        torch = self.torch
        rec = run_point(torch, self.F, self.fah, self.timer, args, spec, self.dtype, self.ours_reason)
        torch.cuda.empty_cache()
        return rec

    @contextlib.contextmanager
    def spacer(self, attempt):
        """Holds a device allocation of attempt x 37 MiB, so the next point's buffers land elsewhere."""
        block = self.torch.empty(attempt * 37 << 20, dtype=self.torch.uint8, device=DEVICE) if attempt else None
        try:
            yield
        finally:
            del block


def run_point(torch, F, fah, timer, args, spec, dtype, ours_reason):
    head_dim, causal, seqlen = spec["head_dim"], spec["causal"], spec["seqlen"]
    batch = max(1, args.tokens // seqlen)
    nheads = args.hidden // head_dim
    nheads_kv = max(1, nheads // GQA_GROUP) if spec["feature"] == "gqa" else nheads
    fwd_flops = point_flops(spec, batch, nheads)
    ours_kw, peer_kw, peer_reason = feature_kwargs(spec)
    kw = {"ours": ours_kw, "peer": peer_kw}
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed + 7919 * head_dim + 31 * seqlen + int(causal))
    shape = (batch, seqlen, nheads, head_dim)
    shape_kv = (batch, seqlen, nheads_kv, head_dim)
    q = torch.randn(shape, dtype=dtype, device=DEVICE, generator=gen)
    k, v = (torch.randn(shape_kv, dtype=dtype, device=DEVICE, generator=gen) for _ in range(2))
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
    if peer_reason:
        skip.update({p: peer_reason for p in PEERS if p in args.backends})

    rec = {
        "feature": spec["feature"],
        "head_dim": head_dim,
        "causal": causal,
        "seqlen": seqlen,
        "batch": batch,
        "nheads": nheads,
        "nheads_kv": nheads_kv,
        "dtype": args.dtype,
    }
    if "fwd" in args.directions:
        rec["fwd"] = run_fwd(torch, F, fah, timer, args, tensors, causal, fwd_flops, skip, in_backend, kw)
        torch.cuda.empty_cache()
    dout = None
    if "bwd" in args.directions:
        dout = torch.randn(shape, dtype=dtype, device=DEVICE, generator=gen)
        bwd_flops = int(BWD_FLOPS_FACTOR * fwd_flops)
        rec["bwd"] = run_bwd(torch, F, fah, timer, args, tensors, dout, causal, bwd_flops, skip, in_backend, kw)
        torch.cuda.empty_cache()
    if not getattr(args, "no_adjacent", False) and "ours" not in skip and "ours" in args.backends:
        add_adjacent_references(torch, fah, timer, args, spec, rec, (q, k, v, dout), ours_kw, dtype, gen)
    return rec


def add_adjacent_references(torch, fah, timer, args, spec, rec, qkv_dout, ours_kw, dtype, gen):
    """For a feature point: each dense reference of feature_reference_specs timed with the feature call
    (time_adjacent), per direction whose ours was measured; appended to rec[direction]["adjacent"] as {kind, causal,
    seqlen, batch, rounds, ours_tflops, reference_tflops, ratio}, or with error and ratio None when it failed. The
    reference has the point's tokens (batch = tokens // seqlen) and heads; "same" references of MHA points reuse the
    point's own q, k, v and dO (the same buffers: a point of ours moves with where its buffers land)."""
    q, k, v, dout = qkv_dout
    head_dim, causal = spec["head_dim"], spec["causal"]
    tokens, nheads = q.shape[0] * q.shape[1], q.shape[2]
    for kind, ref_causal, ref_seqlen in feature_reference_specs(spec):
        ref_batch = max(1, tokens // ref_seqlen)
        ref_fwd_flops = point_flops({"feature": "dense", "head_dim": head_dim, "causal": ref_causal,
                                     "seqlen": ref_seqlen}, ref_batch, nheads)
        shape = (ref_batch, ref_seqlen, nheads, head_dim)
        reuse = kind == "same" and k.shape[2] == nheads and tuple(q.shape[:2]) == shape[:2]
        refs = {}

        def ref_tensor(name):
            if name not in refs:
                src = {"q": q, "k": k, "v": v, "dout": dout}[name]
                refs[name] = src if reuse else torch.randn(shape, dtype=dtype, device=DEVICE, generator=gen)
            return refs[name]

        for d in args.directions:
            part = rec.get(d)
            if not part or part["tflops"].get("ours") is None:
                continue
            entry = {"kind": kind, "causal": ref_causal, "seqlen": ref_seqlen, "batch": ref_batch,
                     "rounds": ADJACENT_ROUNDS}
            try:
                qr, kr, vr = ref_tensor("q"), ref_tensor("k"), ref_tensor("v")
                ref_dout = ref_tensor("dout") if d == "bwd" else None
                t_feat, t_ref = _time_beside(
                    torch, timer, d, lambda *t: _ours_call(fah, *t, causal, ours_kw), (q, k, v, dout),
                    lambda *t: fah.attention(*t, causal=ref_causal), (qr, kr, vr, ref_dout))
            except Exception as e:  # noqa: BLE001 - recorded; the point's own numbers stand
                entry["error"] = _describe(e)
                entry["ratio"] = None
            else:
                flops_ref = ref_fwd_flops if d == "fwd" else int(BWD_FLOPS_FACTOR * ref_fwd_flops)
                entry["ours_tflops"] = part["flops"] / (t_feat * 1e-3) / 1e12
                entry["reference_tflops"] = flops_ref / (t_ref * 1e-3) / 1e12
                entry["ratio"] = entry["ours_tflops"] / entry["reference_tflops"]
            part.setdefault("adjacent", []).append(entry)
        refs.clear()
        torch.cuda.empty_cache()


def _time_beside(torch, timer, direction, feature, feature_args, reference, reference_args):
    """time_adjacent of feature(q, k, v) against reference(q, k, v) (forward without autograd), or of their
    backwards (torch.autograd.grad of one forward each, with the dO given as the fourth argument)."""
    if direction == "fwd":
        with torch.no_grad():
            return time_adjacent(timer, lambda: feature(*feature_args[:3]), lambda: reference(*reference_args[:3]))
    graphs = []
    for fn, (q, k, v, dout) in ((feature, feature_args), (reference, reference_args)):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        graphs.append((fn(*leaves), leaves, dout))
    (out, leaves, dout), (ref_out, ref_leaves, ref_dout) = graphs
    return time_adjacent(timer, lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
                         lambda: torch.autograd.grad(ref_out, ref_leaves, ref_dout, retain_graph=True))


def skipped_record(spec, args, reason):
    return dict(spec, dtype=args.dtype, skipped=reason)


# ----------------------------------------------------------------------------------------------------------------
# Tables and the record


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


def measured(results):
    """The point records that were run (not skipped)."""
    return [r for r in results if not r.get("skipped")]


def format_table(results, directions=DIRECTIONS):
    """Markdown: one row per measured point, a group of columns (ours, cuDNN, FA2, ratios, maxdiff) per direction;
    a leading feature column when feature points were measured."""
    rows = measured(results)
    with_feature = any(r.get("feature", "dense") != "dense" for r in rows)
    header = (["feature"] if with_feature else []) + ["head_dim", "causal", "seqlen"]
    for d in directions:
        header += [f"{d} ours", f"{d} cuDNN", f"{d} FA2", f"{d} ours/cuDNN", f"{d} ours/FA2", f"{d} maxdiff"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r.get("feature", "dense")] if with_feature else []
        cells += [str(r["head_dim"]), "yes" if r["causal"] else "no", str(r["seqlen"])]
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
                _fmt(part.get("ratio", {}).get("ours/cudnn"), ".2f"),
                _fmt(part.get("ratio", {}).get("ours/fa2"), ".2f"),
                _maxdiff_cell(part.get("check", {})),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def skipped_notes(results):
    """One line per (feature, reason) of the skipped points."""
    groups = {}
    for r in results:
        if r.get("skipped"):
            groups.setdefault((r.get("feature", "dense"), r["skipped"]), []).append(r)
    return [f"{feat} skipped ({len(rs)} points): {reason}" for (feat, reason), rs in groups.items()]


def make_config(args):
    cfg = {
        k: getattr(args, k, None)
        for k in (
            "dtype",
            "head_dims",
            "seqlens",
            "causal",
            "direction",
            "features",
            "tokens",
            "hidden",
            "backends",
            "warmup",
            "rep",
            "settle",
            "rounds",
            "rotate",
            "lead_in",
            "preheat",
            "smoke",
            "no_adjacent",
        )
    }
    cfg["adjacent_rounds"] = ADJACENT_ROUNDS
    # Records before session 40 timed reference, feature, feature, reference with no warm-up (the first side favoured).
    cfg["adjacent_order"] = "warm-up, Thue-Morse"
    cfg["check"] = not args.no_check
    cfg["units"] = {
        "tflops": "TFLOP/s (from the median)",
        "ms": "milliseconds (median)",
        "stats": "milliseconds: median, p20, p80, min, max of do_bench's samples, and their count n",
        "flops": {"fwd": "4*b*h*s^2*d, /2 if causal (window: attended pairs)", "bwd": f"{BWD_FLOPS_FACTOR} x fwd"},
        "bwd timing": "torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) after one forward",
    }
    cfg["feature_params"] = {"gqa_group": GQA_GROUP, "window": WINDOW, "softcap": SOFTCAP}
    # What the numbers were measured on: the inputs' distribution moves a kernel with a lazy rescale (the forward
    # rescales O only when a row's maximum grows past a threshold), and the peers are torch's own builds.
    cfg["inputs"] = "q, k, v, dO: standard normal (torch.randn), seeded per point (--seed)"
    cfg["peer_implementations"] = {
        "cudnn": "torch SDPA backend CUDNN_ATTENTION (the cuDNN of meta.cudnn)",
        "fa2": "torch SDPA backend FLASH_ATTENTION (the FlashAttention-2 kernels built into meta.torch)",
    }
    return cfg


def make_doc(meta, args, results, elapsed):
    return {"meta": meta, "config": make_config(args), "elapsed_s": round(elapsed, 1), "results": results}


# Non-finite numbers in a record (a check's error or maxdiff is NaN when an output is not finite: the points a record
# exists to show) are written as these strings: JSON has no NaN or Infinity, and json.dump's default wrote the bare
# tokens, which JSON.parse, strict parsers and most dashboards refuse (Python's json.load took them). load_record
# turns the strings back into floats.
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _json_safe(x):
    """x with every non-finite float (numpy's float64 included) replaced by its _NON_FINITE string."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(float(x))  # "nan", "inf", "-inf"
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _from_json(x):
    if isinstance(x, str):
        return _NON_FINITE.get(x, x)
    if isinstance(x, dict):
        return {k: _from_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_from_json(v) for v in x]
    return x


def write_json(path, doc):
    """Writes doc as standard JSON (RFC 8259: no NaN or Infinity tokens; non-finite numbers as "nan", "inf", "-inf")."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_json_safe(doc), f, indent=1, default=str, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def _is_number(x):
    """A real number the tables can format and divide (a float; not a bool, not an int past float's range)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


MAX_RECORD_SEQLEN = 1 << 22  # a point's seqlen in a record: the summary's window arithmetic loops over it


def _check_record(doc, path):
    """ValueError naming the first field of a loaded record that the tables, comparison and plots cannot read (a
    corrupted or hand-edited baseline must read as unreadable input, exit status 2, never as a regression, exit 1, or
    a traceback); then the readers themselves run once on it (_dry_run_readers), for what the fields' checks miss."""
    def bad(where, what):
        raise ValueError(f"{path} is not a benchmark record ({where}: {what})")

    def number_map(where, m, required=False):
        if m is None and not required:
            return
        if not isinstance(m, dict):
            bad(where, f"an object expected, got {type(m).__name__}")
        for name, x in m.items():
            if x is not None and not _is_number(x):
                bad(f"{where}.{name}", f"a number or null expected, got {x!r}")

    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        bad("top level", "no 'results' list")
    for key in ("meta", "config"):
        if key in doc and not isinstance(doc[key], dict):
            bad(key, f"an object expected, got {type(doc[key]).__name__}")
    meta = doc.get("meta", {})
    if meta.get("git_commit") is not None and not isinstance(meta["git_commit"], str):
        bad("meta.git_commit", f"a string expected, got {meta['git_commit']!r}")
    for key in ("sm_clock_before", "sm_clock_after"):
        number_map(f"meta.{key}", meta.get(key))
    for i, rec in enumerate(doc["results"]):
        where = f"results[{i}]"
        if not isinstance(rec, dict):
            bad(where, f"an object expected, got {type(rec).__name__}")
        for key, hi in (("head_dim", 1 << 12), ("seqlen", MAX_RECORD_SEQLEN)):
            x = rec.get(key)
            if not isinstance(x, int) or isinstance(x, bool) or not 1 <= x <= hi:
                bad(f"{where}.{key}", f"an integer in [1, {hi}] expected, got {x!r}")
        if not isinstance(rec.get("causal"), (bool, int)):
            bad(f"{where}.causal", f"a boolean expected, got {rec.get('causal')!r}")
        for key in ("feature", "dtype"):
            if key in rec and not isinstance(rec[key], str):
                bad(f"{where}.{key}", f"a string expected, got {rec[key]!r}")
        if rec.get("skipped") is not None and not isinstance(rec["skipped"], str):
            bad(f"{where}.skipped", f"a string or null expected, got {rec['skipped']!r}")
        for d in DIRECTIONS:
            if d not in rec:
                continue
            part, pw = rec[d], f"{where}.{d}"
            if not isinstance(part, dict):
                bad(pw, f"an object expected, got {type(part).__name__}")
            if not _is_number(part.get("flops")) or not part["flops"] > 0:
                bad(f"{pw}.flops", f"a positive number expected, got {part.get('flops')!r}")
            number_map(f"{pw}.tflops", part.get("tflops"), required=True)
            for key in ("ratio", "ms"):
                number_map(f"{pw}.{key}", part.get(key))
            for key in ("stats", "errors", "check"):
                if key in part and not isinstance(part[key], dict):
                    bad(f"{pw}.{key}", f"an object expected, got {type(part[key]).__name__}")
            for name, st in part.get("stats", {}).items():
                if not st:
                    continue
                if not isinstance(st, dict):
                    bad(f"{pw}.stats.{name}", f"an object expected, got {type(st).__name__}")
                rounds = st.get("round_medians")  # records from session 73 on (--rounds above 1)
                if rounds is not None and (not isinstance(rounds, list) or not rounds
                                           or not all(_is_number(x) and x > 0 for x in rounds)):
                    bad(f"{pw}.stats.{name}.round_medians", f"a list of positive numbers expected, got {rounds!r}")
                number_map(f"{pw}.stats.{name}", {q: x for q, x in st.items() if q != "round_medians"})
                if not all(_is_number(st.get(q)) and st[q] > 0 for q in ("median", "p20", "p80")):
                    bad(f"{pw}.stats.{name}", f"positive median, p20 and p80 expected, got {st!r}")
            for key, x in part.get("check", {}).items():
                if key.startswith("maxdiff_vs_") and x is not None and not _is_number(x):
                    bad(f"{pw}.check.{key}", f"a number or null expected, got {x!r}")
            adjacent = part.get("adjacent", [])
            if not isinstance(adjacent, list):
                bad(f"{pw}.adjacent", f"a list expected, got {type(adjacent).__name__}")
            for j, a in enumerate(adjacent):
                ok = (isinstance(a, dict) and isinstance(a.get("kind"), str) and isinstance(a.get("seqlen"), int)
                      and (a.get("ratio") is None or _is_number(a["ratio"])))
                if not ok:
                    bad(f"{pw}.adjacent[{j}]", f"an object of kind (a string), seqlen (an int), ratio expected: {a!r}")
    _dry_run_readers(doc, path)


def _dry_run_readers(doc, path):
    """Runs the tables, the summary and a comparison of the record with itself (output discarded): whatever a field
    the checks above do not name makes them raise becomes the ValueError of an unreadable record."""
    try:
        format_table(doc["results"], [d for d in DIRECTIONS if any(d in r for r in doc["results"])])
        skipped_notes(doc["results"])
        format_summary(doc)
        format_comparison(compare_records(doc, doc, 0.05))
    except Exception as e:  # noqa: BLE001 (any reader's failure is the record's)
        raise ValueError(f"{path} is not a benchmark record (its tables fail: {type(e).__name__}: {e})") from None


def load_record(path):
    """The benchmark record (JSON) at path; ValueError where it is not one (see _check_record), OSError where it cannot
    be read."""
    with open(path) as f:
        try:
            doc = _from_json(json.load(f))
        except (json.JSONDecodeError, RecursionError) as e:  # (nested past the parser's limit: RecursionError)
            raise ValueError(f"{path} is not JSON that a benchmark record can be: {type(e).__name__}: {e}") from None
    _check_record(doc, path)
    return doc


def _progress_line(i, n, rec):
    head = f"[{i}/{n}] "
    if rec.get("feature", "dense") != "dense":
        head += f"{rec['feature']} "
    head += f"hdim={rec['head_dim']} causal={'yes' if rec['causal'] else 'no'} seqlen={rec['seqlen']}"
    if rec.get("skipped"):
        return head + f": skipped: {rec['skipped']}"
    parts = []
    for d in DIRECTIONS:
        part = rec.get(d)
        if part is None:
            continue
        t = part["tflops"]
        errs = part.get("check", {}).get("ref_err", {})
        err_text = ", ".join(
            f"{BACKEND_LABEL[n]} {max(e.values()) if isinstance(e, dict) else e:.1e}" for n, e in errs.items()
        )
        naive = part.get("check", {}).get("naive_err")
        naive = max(naive.values()) if isinstance(naive, dict) else naive
        naive_text = "" if naive is None else f" (naive {naive:.1e})"
        beside = "; ".join(f"{a['ratio']:.2f} x dense {ADJACENT_LABEL.get(a['kind'], a['kind'])} {a['seqlen']}"
                           for a in part.get("adjacent", []) if a.get("ratio") is not None)
        parts.append(
            f"{d}: ours {_fmt(t.get('ours'), '.1f')}, cuDNN {_fmt(t.get('cudnn'), '.1f')}, "
            f"FA2 {_fmt(t.get('fa2'), '.1f')} TFLOP/s, fp32-ref err {err_text or 'n/a'}{naive_text}"
            f"{' FLAGGED' if part.get('check', {}).get('flag') else ''}"
            f"{f' (timed beside: {beside})' if beside else ''}"
        )
    return head + f" batch={rec.get('batch')} nheads={rec.get('nheads')}: " + "; ".join(parts)


class Progress:
    """tqdm bar on stderr when tqdm imports (and not disabled), else nothing; write() prints a line either way."""

    def __init__(self, total, enabled=True):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except Exception:  # noqa: BLE001 - tqdm is optional
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, unit="point", file=sys.stderr, dynamic_ncols=True, mininterval=1.0)

    def write(self, line):
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def update(self, desc=None):
        if self.bar is not None:
            if desc:
                self.bar.set_postfix_str(desc, refresh=False)
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------------------------------------------
# Comparison with a baseline record


def _index(doc):
    """{key with direction: (record, part or None)}; a skipped point maps every direction to (record, None)."""
    out = {}
    for rec in doc["results"]:
        for d in DIRECTIONS:
            if rec.get("skipped"):
                out[point_key(rec, d)] = (rec, None)
            elif d in rec:
                out[point_key(rec, d)] = (rec, rec[d])
    return out


def _ours(entry):
    """(TFLOP/s of ours or None, why None)."""
    if entry is None:
        return None, "not in the record"
    rec, part = entry
    if part is None:
        return None, f"skipped: {rec.get('skipped')}"
    t = part.get("tflops", {}).get("ours")
    if t is None:
        return None, f"ours n/a: {part.get('errors', {}).get('ours', 'not measured')}"
    # A number the gate cannot compare (NaN made every comparison False: the point passed; 0 divided by zero; a
    # string or bool from a hand-edited record): reported with the points missing on that side, not compared.
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
        return None, f"ours TFLOP/s {t!r} is not a positive finite number"
    return t, None


def slowdown(base_tflops, now_tflops):
    """How much longer ours takes now than in the baseline (0.1 = 10% slower; negative when faster)."""
    return base_tflops / now_tflops - 1.0


def _shape_text(rec):
    """A point's problem size beyond its key ("batch 4 x nheads 16 / nheads_kv 16"), or None when not recorded."""
    if not all(isinstance(rec.get(f), int) for f in ("batch", "nheads")):
        return None
    return f"batch {rec['batch']} x nheads {rec['nheads']} / nheads_kv {rec.get('nheads_kv', rec['nheads'])}"


def compare_records(current, baseline, threshold=0.05, remeasure=None):
    """Compares ours per point (key and direction) between two records.

    A point is slower when slowdown(baseline, current) > threshold. Slower points are re-measured once through
    remeasure(keys) -> {key: TFLOP/s or None} when given; a point still slower then (or not re-measured) is a
    regression. Points with a number of ours on one side only are reported in missing_now / missing_base (so is a
    point whose TFLOP/s is not a positive finite number: NaN, 0); points measured at another batch or head count
    (another --tokens / --hidden) in other_shape, not compared. threshold: a finite fraction >= 0 (ValueError).
    Returns a dict: threshold, rows (one per point with numbers on both sides), regressions, noise (slower at
    first, fine on re-measure), missing_now, missing_base, other_shape (lists of (key, reason)), remeasured (bool),
    notes.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0 <= threshold < math.inf:
        raise ValueError(f"threshold must be a finite fraction >= 0, got {threshold!r}")
    cur, base = _index(current), _index(baseline)
    keys = list(cur) + [k for k in base if k not in cur]
    rows, missing_now, missing_base, other_shape = [], [], [], []
    for key in keys:
        now, why_now = _ours(cur.get(key))
        was, why_base = _ours(base.get(key))
        if now is None and was is None:
            continue  # unmeasured on both sides (e.g. a feature not built yet): nothing to compare
        if now is None:
            missing_now.append((key, why_now))
            continue
        if was is None:
            missing_base.append((key, why_base))
            continue
        shape_now, shape_base = _shape_text(cur[key][0]), _shape_text(base[key][0])
        if shape_now and shape_base and shape_now != shape_base:  # (records without the fields: compared)
            other_shape.append((key, f"{shape_now} here, {shape_base} in the baseline"))
            continue
        peers = {}
        for p in PEERS:
            pn = cur[key][1].get("tflops", {}).get(p)
            pb = base[key][1].get("tflops", {}).get(p)
            peers[p] = pn / pb if pn and pb else None
        sd = slowdown(was, now)
        rows.append(
            {
                "key": key,
                "base": was,
                "now": now,
                "ratio": now / was,
                "slowdown": sd,
                "peers": peers,
                "status": "slower" if sd > threshold else "ok",
                "remeasured": None,
            }
        )
    slower = [r for r in rows if r["status"] == "slower"]
    remeasured = False
    if slower and remeasure is not None:
        again = remeasure([r["key"] for r in slower]) or {}
        remeasured = True
        for r in slower:
            t = again.get(r["key"])
            r["remeasured"] = t
            if t is not None and 0 < t < math.inf and slowdown(r["base"], t) <= threshold:
                r["status"] = "noise"
    for r in slower:
        if r["status"] == "slower":
            r["status"] = "regression"
    notes = []
    g_now, g_base = current.get("meta", {}).get("gpu"), baseline.get("meta", {}).get("gpu")
    if g_now and g_base and g_now != g_base:
        notes.append(f"the baseline ran on {g_base}, this run on {g_now}: the ratios compare different GPUs")
    return {
        "threshold": threshold,
        "rows": rows,
        "regressions": [r for r in rows if r["status"] == "regression"],
        "noise": [r for r in rows if r["status"] == "noise"],
        "missing_now": missing_now,
        "missing_base": missing_base,
        "other_shape": other_shape,
        "remeasured": remeasured,
        "notes": notes,
    }


def _regression_text(r):
    text = f"{key_text(r['key'])} ({r['base']:.1f} -> {r['now']:.1f} TFLOP/s, {r['slowdown']:+.1%} time"
    if r["remeasured"] is not None:
        text += f"; re-measured {r['remeasured']:.1f}, {slowdown(r['base'], r['remeasured']):+.1%}"
    elif r.get("remeasure_note"):
        text += f"; {r['remeasure_note']}"
    return text + ")"


def format_comparison(cmp, baseline_name="baseline"):
    """The per-point ratio table and the verdict lines (the last one starts with 'compare: PASS' or 'compare: FAIL')."""
    thr = cmp["threshold"]
    lines = [
        f"## ours against {baseline_name} (threshold {thr:.0%}: slower = baseline TFLOP/s / now > {1 + thr:.2f})",
        "",
        "| point | dir | ours base | ours now | now/base | cuDNN now/base | FA2 now/base | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    verdict = {"ok": "ok", "noise": "ok on re-measure", "regression": "SLOWER"}
    for r in cmp["rows"]:
        v = verdict[r["status"]]
        if r["remeasured"] is not None:
            v += f" (re-measured {r['remeasured']:.1f})"
        lines.append(
            f"| {key_text(r['key'][:5])} | {r['key'][5]} | {r['base']:.1f} | {r['now']:.1f} | {r['ratio']:.3f} | "
            f"{_fmt(r['peers'].get('cudnn'), '.3f')} | {_fmt(r['peers'].get('fa2'), '.3f')} | {v} |"
        )
    lines.append("")
    for n in cmp["notes"]:
        lines.append(f"note: {n}")
    if cmp["missing_now"]:
        lines.append(f"missing in this run ({len(cmp['missing_now'])} points, reported, not failed):")
        lines += [f"  {key_text(k)}: {why}" for k, why in cmp["missing_now"]]
    if cmp["missing_base"]:
        lines.append(f"missing in the baseline ({len(cmp['missing_base'])} points, reported, not failed):")
        lines += [f"  {key_text(k)}: {why}" for k, why in cmp["missing_base"]]
    if cmp.get("other_shape"):
        lines.append(f"measured at another shape ({len(cmp['other_shape'])} points, reported, not compared):")
        lines += [f"  {key_text(k)}: {why}" for k, why in cmp["other_shape"]]
    if cmp["noise"]:
        lines.append(
            f"{len(cmp['noise'])} points were slower at first and within the threshold on re-measure: "
            + "; ".join(_regression_text(r) for r in cmp["noise"])
        )
    if cmp["regressions"]:
        how = "after re-measuring, best of 3 tries" if cmp["remeasured"] else "not re-measured"
        lines.append(
            f"compare: FAIL: ours (implementation=ours) is slower than {baseline_name} by more than {thr:.0%} at "
            f"{len(cmp['regressions'])} of {len(cmp['rows'])} points ({how}): "
            + "; ".join(_regression_text(r) for r in cmp["regressions"])
        )
    elif not cmp["rows"]:
        lines.append(f"compare: PASS (nothing compared: no point has numbers of ours here and in {baseline_name})")
    else:
        lines.append(
            f"compare: PASS: {len(cmp['rows'])} points of ours within {thr:.0%} of {baseline_name}"
            + (f" ({len(cmp['noise'])} only after re-measuring)" if cmp["noise"] else "")
        )
    return "\n".join(lines)


def comparison_summary(cmp, baseline_path):
    """The comparison as stored in the JSON record."""
    return {
        "baseline": baseline_path,
        "threshold": cmp["threshold"],
        "points": len(cmp["rows"]),
        "passed": not cmp["regressions"],
        "regressions": [
            {"point": key_text(r["key"]), "base": r["base"], "now": r["now"], "remeasured": r["remeasured"]}
            for r in cmp["regressions"]
        ],
        "noise": [key_text(r["key"]) for r in cmp["noise"]],
        "missing_now": [f"{key_text(k)}: {why}" for k, why in cmp["missing_now"]],
        "missing_base": [f"{key_text(k)}: {why}" for k, why in cmp["missing_base"]],
        "other_shape": [f"{key_text(k)}: {why}" for k, why in cmp.get("other_shape", [])],
        "notes": cmp["notes"],
    }


REMEASURE_TRIES = 3


def make_remeasure(runner, args, doc, tries=REMEASURE_TRIES):
    """remeasure(keys) for compare_records: runs each point again for ours only (no correctness check), ``tries``
    times with the inputs at different device addresses (a spacer allocation of a different size before each try),
    and returns the best of the tries, {key: TFLOP/s or None}; the numbers go into doc's record under
    part["remeasure"]["ours"] (with all tries).

    Why best of several: on the H200 a point of ours can move by up to ~10 % between processes, and between two
    measurements in one process, with the placement of its buffers (seen 2026-11-29: head_dim 128, seqlen 4096
    forward at 641, 596, 648 and 586 TFLOP/s in four measurements, cuDNN steady within 1 %). A real regression is
    slow in every try; a baseline or first number caught at the fast end is not a regression."""

    def remeasure(keys):
        by_point = {}
        for key in keys:
            by_point.setdefault(key[:5], []).append(key[5])
        recs = {point_key(r): r for r in doc["results"]}
        out = {}
        for pk, dirs in by_point.items():
            feature, _, hd, causal, seqlen = pk
            spec = {"feature": feature, "head_dim": hd, "causal": causal, "seqlen": seqlen}
            sub = copy.copy(args)
            sub.backends, sub.no_check, sub.no_adjacent = ["ours"], True, True
            sub.directions = [d for d in DIRECTIONS if d in dirs]
            print(f"re-measuring {key_text(pk)} {'/'.join(sub.directions)} ({tries} tries)", file=sys.stderr,
                  flush=True)
            tries_by_dir = {d: [] for d in sub.directions}
            for attempt in range(tries):
                try:
                    with runner.spacer(attempt):
                        rec = runner.run(spec, sub)
                except Exception as e:  # noqa: BLE001 - a failed re-measure leaves the first number standing
                    print(f"  re-measure failed: {_describe(e)}", file=sys.stderr, flush=True)
                    continue
                for d in sub.directions:
                    part = rec.get(d) or {}
                    t = part.get("tflops", {}).get("ours")
                    if t is not None:
                        tries_by_dir[d].append((t, part.get("stats", {}).get("ours")))
            for d, got in tries_by_dir.items():
                best = max(got, key=lambda x: x[0]) if got else (None, None)
                out[pk + (d,)] = best[0]
                target = recs.get(pk, {}).get(d)
                if target is not None:
                    target["remeasure"] = {
                        "ours": {"tflops": best[0], "stats": best[1], "tries": [t for t, _ in got]}
                    }
        return out

    return remeasure


# ----------------------------------------------------------------------------------------------------------------
# Summary, plots, history


def _spread_pct(part, name):
    st = part.get("stats", {}).get(name)
    if not st or not st.get("median"):
        return None
    return 100.0 * (st["p80"] - st["p20"]) / (2 * st["median"])


def _title(doc):
    m = doc.get("meta", {})
    commit = (m.get("git_commit") or "n/a")[:10] + (" (dirty)" if m.get("git_dirty") else "")
    return f"{m.get('gpu', '?')}, {doc.get('config', {}).get('dtype', '?')}, commit {commit}, {m.get('date', '?')}"


def format_summary(doc, comparison=None):
    """Markdown for the performance tables (docs/performance.md): metadata, a TFLOP/s table (ours with its p20-p80
    half-spread), the features against dense (format_feature_ratios), skipped features and the comparison verdict."""
    m = doc.get("meta", {})
    clk = []
    for when in ("before", "after"):
        c = m.get(f"sm_clock_{when}") or {}
        if c.get("sm_mhz") is not None:
            clk.append(f"{when} {c['sm_mhz']} MHz")
    lines = [
        f"# Attention benchmark: {_title(doc)}",
        "",
        f"driver {m.get('driver', 'n/a')}, CUDA {m.get('cuda', 'n/a')}, torch {m.get('torch', 'n/a')}, cuDNN "
        f"{m.get('cudnn', 'n/a')}, triton {m.get('triton', 'n/a')}; SM clock {', '.join(clk) or 'n/a'}; "
        f"{len(measured(doc['results']))} points in {doc.get('elapsed_s', 'n/a')} s. TFLOP/s from the median of "
        f"do_bench; ± = half the p20-p80 spread of ours; backward FLOPs = {BWD_FLOPS_FACTOR} x forward.",
        "",
    ]
    rows = measured(doc["results"])
    dirs = [d for d in DIRECTIONS if any(d in r for r in rows)]
    with_feature = any(r.get("feature", "dense") != "dense" for r in rows)
    header = (["feature"] if with_feature else []) + ["head_dim", "causal", "seqlen"]
    for d in dirs:
        header += [f"{d} ours", f"{d} cuDNN", f"{d} FA2", f"{d} ours/cuDNN"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r.get("feature", "dense")] if with_feature else []
        cells += [str(r["head_dim"]), "yes" if r["causal"] else "no", str(r["seqlen"])]
        for d in dirs:
            part = r.get(d)
            if part is None:
                cells += ["n/a"] * 4
                continue
            t = part["tflops"]
            ours = _fmt(t.get("ours"), ".0f")
            sp = _spread_pct(part, "ours")
            if t.get("ours") is not None and sp is not None:
                ours += f" ±{sp:.1f}%"
            if part.get("check", {}).get("flag"):
                ours += " !"
            cells += [ours, _fmt(t.get("cudnn"), ".0f"), _fmt(t.get("fa2"), ".0f"),
                      _fmt(part.get("ratio", {}).get("ours/cudnn"), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    feature_lines = format_feature_ratios(doc["results"])
    if feature_lines:
        lines += [""] + feature_lines
    notes = skipped_notes(doc["results"])
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    if comparison is not None:
        lines += ["", format_comparison(comparison).splitlines()[-1]]
    return "\n".join(lines) + "\n"


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("plots need matplotlib (pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PLOT_STYLE = {"ours": dict(color="C3", lw=2.2, marker="o"), "cudnn": dict(color="C0", marker="s"),
              "fa2": dict(color="C2", marker="^")}


def plot_record(doc, out_dir):
    """PNGs of TFLOP/s vs seqlen: one per (feature, direction), a panel per (mask, head_dim), a line per backend
    (ours with its p20-p80 band). Returns the paths written."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    rows = measured(doc["results"])
    paths = []
    features = [f for f in FEATURES if any(r.get("feature", "dense") == f for r in rows)]
    for feat in features:
        frs = [r for r in rows if r.get("feature", "dense") == feat]
        for d in DIRECTIONS:
            drs = [r for r in frs if d in r]
            if not drs:
                continue
            hds = sorted({r["head_dim"] for r in drs})
            masks = sorted({bool(r["causal"]) for r in drs})
            fig, axes = plt.subplots(len(masks), len(hds), figsize=(4.2 * len(hds), 3.4 * len(masks)),
                                     squeeze=False, sharex=True)
            for i, causal in enumerate(masks):
                for j, hd in enumerate(hds):
                    ax = axes[i][j]
                    pts = sorted((r for r in drs if r["head_dim"] == hd and bool(r["causal"]) == causal),
                                 key=lambda r: r["seqlen"])
                    for name in BACKENDS:
                        xs = [r["seqlen"] for r in pts if r[d]["tflops"].get(name) is not None]
                        ys = [r[d]["tflops"][name] for r in pts if r[d]["tflops"].get(name) is not None]
                        if not xs:
                            continue
                        ax.plot(xs, ys, label=BACKEND_LABEL[name], **PLOT_STYLE[name])
                        band = [(r["seqlen"], r[d]["flops"], r[d].get("stats", {}).get(name)) for r in pts]
                        band = [(x, f, s) for x, f, s in band if s and f]
                        if name == "ours" and band:
                            ax.fill_between([x for x, _, _ in band],
                                            [f / (s["p80"] * 1e-3) / 1e12 for _, f, s in band],
                                            [f / (s["p20"] * 1e-3) / 1e12 for _, f, s in band],
                                            color="C3", alpha=0.2, lw=0)
                    ax.set_xscale("log", base=2)
                    ax.set_title(f"head_dim {hd}, {'causal' if causal else 'no mask'}", fontsize=10)
                    ax.grid(True, alpha=0.3)
                    ax.set_ylim(bottom=0)
                    if i == len(masks) - 1:
                        ax.set_xlabel("seqlen")
                    if j == 0:
                        ax.set_ylabel(f"{d} TFLOP/s")
                    if i == 0 and j == 0:
                        ax.legend(fontsize=8)
            name = f"{feat} " if feat != "dense" else ""
            fig.suptitle(f"attention {name}{d}: {_title(doc)}", fontsize=10)
            fig.tight_layout()
            path = os.path.join(out_dir, f"tflops_{feat + '_' if feat != 'dense' else ''}{d}.png")
            fig.savefig(path, dpi=90, bbox_inches="tight")  # keeps a title wider than one panel
            plt.close(fig)
            paths.append(path)
    return paths


def load_history(folder, extra=None):
    """Benchmark records in folder (*.json, unreadable ones ignored) plus `extra` (the current run, unless a record
    of the same date and commit is already there), oldest first."""
    docs = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            docs.append(load_record(path))
        except (OSError, ValueError):
            print(f"history: ignoring {path} (not a benchmark record)", file=sys.stderr)
    if extra is not None:
        ident = lambda d: (d.get("meta", {}).get("date"), d.get("meta", {}).get("git_commit"))  # noqa: E731
        if all(ident(d) != ident(extra) for d in docs):
            docs.append(extra)
    docs.sort(key=lambda d: str(d.get("meta", {}).get("date", "")))
    return docs


def plot_history(docs, path):
    """ours' TFLOP/s over the records, per (head_dim, mask) at each record's largest dense seqlen, fwd and bwd."""
    plt = _pyplot()
    if not docs:
        raise ValueError("no records to plot")
    series = {}  # (direction, head_dim, causal) -> {index: tflops}
    for i, doc in enumerate(docs):
        dense = [r for r in measured(doc["results"]) if r.get("feature", "dense") == "dense"]
        if not dense:
            continue
        top = max(r["seqlen"] for r in dense)
        for r in dense:
            if r["seqlen"] != top:
                continue
            for d in DIRECTIONS:
                t = (r.get(d) or {}).get("tflops", {}).get("ours")
                if t is not None:
                    series.setdefault((d, r["head_dim"], bool(r["causal"])), {})[i] = t
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), squeeze=False)
    labels = []
    for doc in docs:
        m = doc.get("meta", {})
        labels.append(f"{str(m.get('date', '?'))[:10]}\n{(m.get('git_commit') or 'n/a')[:7]}")
    hd_color = {hd: f"C{i}" for i, hd in enumerate(sorted({k[1] for k in series}))}
    for j, d in enumerate(DIRECTIONS):
        ax = axes[0][j]
        for (dd, hd, causal), pts in sorted(series.items()):
            if dd != d:
                continue
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", ls="--" if causal else "-", color=hd_color[hd],
                    label=f"hd {hd}{' causal' if causal else ''}")
        ax.set_title(f"ours {d}, largest seqlen of each record", fontsize=10)
        ax.set_ylabel("TFLOP/s")
        ax.set_xticks(range(len(docs)))
        ax.set_xticklabels(labels, fontsize=7, rotation=45, ha="right")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(f"flash_attn_hopper history ({len(docs)} records, {docs[-1].get('meta', {}).get('gpu', '?')})",
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------------------


def _import_fah():
    """flash_attn_hopper from wherever Python finds it (an install), else from this checkout."""
    try:
        import flash_attn_hopper
    except ImportError:
        sys.path.insert(0, REPO_ROOT)
        import flash_attn_hopper
    return flash_attn_hopper


def measure(args, runner):
    """Runs the grid with `runner` and returns the record (written to args.json after every point)."""
    meta = runner.meta()
    meta["sm_clock_before"] = runner.clocks()
    specs = grid_specs(args)
    clk = (meta["sm_clock_before"] or {}).get("sm_mhz")
    print(
        f"# attention TFLOP/s ({' and '.join(args.directions)}; bwd FLOPs = {BWD_FLOPS_FACTOR} x fwd), {args.dtype}, "
        f"{meta.get('gpu')} ({meta.get('gpu_sm_count')} SMs, SM clock {clk if clk is not None else 'n/a'} MHz), "
        f"torch {meta.get('torch')}, CUDA {meta.get('cuda')}, cuDNN {meta.get('cudnn')}, triton {meta.get('triton')}, "
        f"commit {meta.get('git_commit') or 'n/a'}{' (dirty)' if meta.get('git_dirty') else ''}",
        flush=True,
    )
    print(f"# {len(specs)} points, tokens={args.tokens}, hidden={args.hidden}, timer: {meta.get('timer')}; "
          f"{getattr(args, 'rounds', 1)} round(s) per backend, order rotating: {getattr(args, 'rotate', False)}, "
          f"lead-in: {getattr(args, 'lead_in', False)}", flush=True)
    if getattr(args, "preheat", 0) and hasattr(runner, "preheat"):
        runner.preheat(args.preheat)
        meta["sm_clock_after_preheat"] = runner.clocks()
    results = []
    t_start = time.time()
    progress = Progress(len(specs), enabled=not args.no_bar)
    try:
        for i, spec in enumerate(specs, 1):
            t0 = time.time()
            reason = runner.support(spec["feature"])
            rec = skipped_record(spec, args, reason) if reason else runner.run(spec, args)
            results.append(rec)
            progress.write(f"{_progress_line(i, len(specs), rec)} ({time.time() - t0:.1f}s)")
            for d in args.directions:
                for name, err in (rec.get(d) or {}).get("errors", {}).items():
                    progress.write(f"    {BACKEND_LABEL[name]} {d} n/a: {err}")
            progress.update(key_text(point_key(dict(rec, dtype=args.dtype))))
            write_json(args.json, make_doc(meta, args, results, time.time() - t_start))
    finally:
        progress.close()
    meta["sm_clock_after"] = runner.clocks()
    doc = make_doc(meta, args, results, time.time() - t_start)
    write_json(args.json, doc)

    print(format_table(results, args.directions))
    notes = []
    flagged = [
        (d, r) for r in measured(results) for d in args.directions if (r.get(d) or {}).get("check", {}).get("flag")
    ]
    if flagged:
        notes.append(
            "! = ours disagrees with the float32 reference by more than 2x the error of the same reference run in "
            "the input dtype + 1e-3 (relative to the largest reference gradient for bwd), or is not finite, at: "
            + ", ".join(f"{d} {key_text(point_key(r))}" for d, r in flagged)
        )
    unavailable = {}  # (backend, reason) -> directions
    for r in measured(results):
        for d in args.directions:
            for name, err in (r.get(d) or {}).get("errors", {}).items():
                dirs = unavailable.setdefault((name, err), [])
                if d not in dirs:
                    dirs.append(d)
    for (name, err), dirs in sorted(unavailable.items()):
        notes.append(f"{BACKEND_LABEL[name]} n/a ({'/'.join(dirs)}): {err}")
    notes += skipped_notes(results)
    print()
    print(
        "TFLOP/s (median of do_bench); bwd = torch.autograd.grad after one forward, FLOPs 2.5 x fwd; maxdiff = max "
        "|ours - cuDNN| over the whole output or all three gradients (FA2 where cuDNN is n/a)."
    )
    for n in notes:
        print(n)
    before, after = meta.get("sm_clock_before") or {}, meta.get("sm_clock_after") or {}
    print(f"SM clock before/after: {before.get('sm_mhz', 'n/a')}/{after.get('sm_mhz', 'n/a')} MHz "
          f"(max {before.get('max_sm_mhz', 'n/a')})")
    print(f"JSON: {os.path.relpath(args.json)} ({time.time() - t_start:.0f}s)")
    return doc


def main(argv=None, runner_factory=GpuRunner):
    """Exit status: 0 ok; 1 a regression against --compare; 2 no GPU / unreadable input / plots impossible.
    An unreadable --compare record and plots without matplotlib are found before any point is measured."""
    args = parse_args(argv)
    runner = None
    baseline = None
    if args.compare:
        try:
            baseline = load_record(args.compare)
        except (OSError, ValueError) as e:
            print(f"benchmark: cannot read --compare {args.compare}: {e}", file=sys.stderr)
            return 2
    if args.plots or args.history:
        try:
            _pyplot()
        except RuntimeError as e:
            print(f"benchmark: {e}", file=sys.stderr)
            return 2
    if args.input:
        try:
            doc = load_record(args.input)
        except (OSError, ValueError) as e:
            print(f"benchmark: cannot read --input {args.input}: {e}", file=sys.stderr)
            return 2
        print(f"# record {args.input}: {_title(doc)}")
        print(format_table(doc["results"], [d for d in DIRECTIONS if any(d in r for r in doc["results"])]))
        for n in skipped_notes(doc["results"]):
            print(n)
    else:
        try:
            runner = runner_factory(args)
        except RuntimeError as e:
            print(f"benchmark: {e}", file=sys.stderr)
            return 2
        doc = measure(args, runner)

    rc = 0
    cmp = None
    if args.compare:
        remeasure = make_remeasure(runner, args, doc) if runner is not None else None
        cmp = compare_records(doc, baseline, args.threshold, remeasure)
        if remeasure is None:
            for r in cmp["regressions"]:
                r["remeasure_note"] = "not re-measured: --input"
        print()
        print(format_comparison(cmp, os.path.basename(args.compare)))
        doc["compare"] = comparison_summary(cmp, args.compare)
        if args.json:
            write_json(args.json, doc)
        if cmp["regressions"]:
            rc = 1

    try:
        if args.plots:
            for p in plot_record(doc, args.plots):
                print(f"plot: {p}")
        if args.history:
            docs = load_history(args.history, extra=doc)
            out = os.path.join(args.plots or args.history, "history.png")
            print(f"plot: {plot_history(docs, out)} ({len(docs)} records)")
    except RuntimeError as e:
        print(f"benchmark: {e}", file=sys.stderr)
        rc = rc or 2
    if args.summary:
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)) or ".", exist_ok=True)
        with open(args.summary, "w") as f:
            f.write(format_summary(doc, cmp))
        print(f"summary: {args.summary}")
    return rc  # a flagged point is reported in the table, not as a failure: the GPU tests check correctness


if __name__ == "__main__":
    sys.exit(main())
