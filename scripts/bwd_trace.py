"""Where the deterministic backward's dQ writer waits for its turn (needs a build with the trace probe,
benchmarks/results/2026-12-06_session57/bwd_trace_probe_UNRUN.patch, whose launcher reads FAH_BWD_TRACE). One warm-up
call, then one traced backward with deterministic=True; prints the share of the CTAs' time their writer spent waiting,
by key block (tenths of the grid's key blocks; under a causal mask the longest CTAs are the first), by when the CTA
started, and by the tile's place in its CTA's walk, and how long after key block n + 1 key block n started. Shares
are in SM cycles (clock64 on both sides); times in ns (globaltimer).
bf16, dense, 16 heads, batch * seqlen = 16384 tokens.
usage: bwd_trace.py [HEAD_DIM] [SEQLEN] [causal|full]          (--selftest: the analysis on made-up data, no GPU)"""
import os
import struct
import sys
import tempfile

import numpy as np


def analyze(raw, label):
    """raw: the launcher's file (int64 grid x, y, z, tile slots; per CTA 6 words (globaltimer start, end, SM, tiles,
    clock64 start, end) then 2 per tile slot (globaltimer when ready, cycles waited))."""
    gx, gy, gz, slots = struct.unpack("<4q", raw[:32])
    words = np.frombuffer(raw[32:], dtype=np.uint64).reshape(gx * gy * gz, 6 + 2 * slots).astype(np.int64)
    start, end, tiles = words[:, 0], words[:, 1], words[:, 3]
    ran = tiles > 0
    t0 = start[ran].min()
    waited = words[:, 7::2]
    mask = np.arange(slots)[None, :] < tiles[:, None]
    busy = (words[:, 5] - words[:, 4]).astype(np.float64)  # cycles
    share = 100 * waited[ran].sum() / busy[ran].sum()
    lines = [f"{label}: grid {gx} x {gy} x {gz}, {int(ran.sum())} CTAs ran; kernel span "
             f"{(end[ran].max() - t0) / 1e3:.1f} us; writers waited {share:.1f} % of their CTAs' cycles"]
    n_block = gx - 1 - (np.arange(gx * gy * gz) % gx)  # deterministic mode launches the last key block first

    def table(name, key, buckets):
        lines.append(f"by {name}: bucket | CTAs | tiles | tiles that waited > 2000 cycles | share of CTA time waited")
        for lo, hi in buckets:
            sel = ran & (key >= lo) & (key < hi)
            if sel.any():
                w = waited[sel][mask[sel]]
                lines.append(f"  [{lo}, {hi}) | {int(sel.sum())} | {w.size} | {100 * (w > 2000).mean():.1f} % | "
                             f"{100 * w.sum() / busy[sel].sum():.1f} %")

    tenth = max(1, gx // 10)
    table("key block", n_block, [(i, i + tenth) for i in range(0, gx, tenth)])
    span = max(1, int(end[ran].max() - t0))
    table("start time (tenths of the kernel)", 10 * (start - t0) // span, [(i, i + 1) for i in range(10)])
    place = np.broadcast_to(np.arange(slots)[None, :], waited.shape)
    lines.append("by the tile's place in its CTA's walk: place | tiles | waited > 2000 cycles | mean cycles waited")
    for lo, hi in [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 128), (128, 1 << 30)]:
        sel = mask & (place >= lo) & (place < hi) & ran[:, None]
        if sel.any():
            w = waited[sel]
            lines.append(f"  [{lo}, {hi}) | {int(sel.sum())} | {100 * (w > 2000).mean():.1f} % | {w.mean():.0f}")
    # CTA x of a pair runs key block gx - 1 - x, so CTA x + 1 runs the key block below CTA x's.
    both = (ran.reshape(-1, gx)[:, :-1] & ran.reshape(-1, gx)[:, 1:]).ravel()
    lead = (start.reshape(-1, gx)[:, 1:] - start.reshape(-1, gx)[:, :-1]).ravel()[both]
    if lead.size:
        lines.append(f"key block n started after n + 1 by (us): p10 {np.percentile(lead, 10) / 1e3:.2f}, median "
                     f"{np.median(lead) / 1e3:.2f}, p90 {np.percentile(lead, 90) / 1e3:.2f}; tile time (us, a CTA's "
                     f"time over its tiles) median {np.median((end - start)[ran] / tiles[ran]) / 1e3:.2f}")
    return "\n".join(lines)


def selftest():
    """Two pairs of 4 key blocks (causal: key block n walks 4 - n tiles, 2000 ns and 4000 cycles each); key block 0
    waits its whole time, 4000 cycles per tile."""
    gx, gy, gz, slots = 4, 2, 1, 4
    rows = []
    for _ in range(gy * gz):
        for x in range(gx):
            n = gx - 1 - x
            row = [1000 * x, 1000 * x + 2000 * (gx - n), 7, gx - n, 50_000, 50_000 + 4000 * (gx - n)]
            row += [0] * (2 * slots)
            for i in range(gx - n):
                row[6 + 2 * i], row[7 + 2 * i] = 1000 * x + 2000 * i, 4000 if n == 0 else 0
            rows.append(row)
    raw = struct.pack("<4q", gx, gy, gz, slots) + np.array(rows, dtype=np.uint64).tobytes()
    text = analyze(raw, "selftest")
    print(text)
    # Key block 0 (the fourth CTA of each pair, 4 tiles): 16000 of its 16000 cycles; all CTAs: 2 x 16000 cycles waited
    # over 2 x (4000 + 8000 + 12000 + 16000) = 40 %.
    assert "waited 40.0 %" in text, text
    assert "  [0, 1) | 2 | 8 | 100.0 % | 100.0 %" in text, text
    assert "median 1.00" in text, text


def main():
    if "--selftest" in sys.argv:
        selftest()
        return
    import torch

    import flash_attn_hopper as fah

    hd = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    s = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    causal = (sys.argv[3] if len(sys.argv) > 3 else "causal") == "causal"
    b, h = max(1, 16384 // s), 16
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16)
    out = fah.attention(q, k, v, causal=causal, deterministic=True)
    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # warm-up, untraced
    path = os.path.join(tempfile.mkdtemp(), "trace.bin")
    os.environ["FAH_BWD_TRACE"] = path  # read by the launcher at each call
    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    torch.cuda.synchronize()
    del os.environ["FAH_BWD_TRACE"]
    with open(path, "rb") as f:
        raw = f.read()
    print(analyze(raw, f"head_dim {hd} seqlen {s} {'causal' if causal else 'full'}"))


if __name__ == "__main__":
    main()
