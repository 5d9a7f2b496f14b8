"""A list-scheduling model of the forward's causal tile order (session 31): tiles are handed to the first free of
132 SMs in launch order (the persistent counter, or the hardware's CTA dispatch), a tile costing its key blocks plus a
fixed X (2.8 key blocks: session 5's fit of the per-tile cost). Prints each order's makespan against the ideal (total
work / SMs): head-major (the submitted kernels: each (head, batch)'s query blocks, last first), sections of S (head,
batch) pairs with query blocks longest first across a section (fwd_sectioned_tile_order_UNTESTED.patch), and a global
longest-first order. Shapes of the benchmark grid (16384 tokens, nheads = 2048 / head_dim). --bwd: the same for the
backward's CTAs (bwd_main)."""
import heapq


def makespan(costs, sms):
    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def in_sections(cost, num_blocks, pairs, s):
    """Costs in launch order: sections of s pairs, each taking block m (num_blocks - 1 first) across its pairs."""
    return [cost(m) for s0 in range(0, pairs, s) for m in reversed(range(num_blocks))
            for _ in range(s0, min(pairs, s0 + s))]


def orders(num_m_blocks, blocks_of, head_batches, x):
    cost = lambda m: blocks_of(m) + x
    yield "head-major", [cost(m) for _ in range(head_batches) for m in reversed(range(num_m_blocks))]
    for s in (8, 16, 32, 64):
        yield f"sections of {s}", in_sections(cost, num_m_blocks, head_batches, s)
    yield "global longest first", sorted((cost(m) for _ in range(head_batches) for m in range(num_m_blocks)),
                                         reverse=True)


def section_heads(pairs, kv_mib, budget_mib=24):
    """The launcher's choice (launch_fwd_sm90.hpp with fwd_sectioned_tile_order_UNTESTED.patch): the pairs whose K/V
    fit the budget, lowered to a divisor of the pair count unless that is under half of it."""
    fit = max(1, min(int(min(budget_mib / kv_mib, 1024)), pairs, 1024))
    s = fit
    while s > fit // 2 and pairs % s:
        s -= 1
    return s if pairs % s == 0 else fit


def main(sms=132, x=2.8):
    cases = [  # name, query blocks, key blocks of query block m (causal, seqlen_q = seqlen_k), (head, batch) pairs,
        # K/V MiB per pair
        ("head_dim 256 causal 1024", 8, lambda m: 2 * (m + 1), 128, 1.0),
        ("head_dim 256 causal 2048", 16, lambda m: 2 * (m + 1), 64, 2.0),
        ("head_dim 128 causal 512", 4, lambda m: m + 1, 512, 0.25),
        ("head_dim 128 causal 1024", 8, lambda m: m + 1, 256, 0.5),
        ("head_dim 128 causal 4096", 32, lambda m: m + 1, 64, 2.0),
        ("head_dim 64 causal 512 (128-row tiles)", 4, lambda m: m + 1, 1024, 0.125),
        ("head_dim 64 causal 1024 (128-row tiles)", 8, lambda m: m + 1, 512, 0.25),
    ]
    for name, num_m_blocks, blocks_of, head_batches, kv_mib in cases:
        runs = list(orders(num_m_blocks, blocks_of, head_batches, x))
        ideal = sum(runs[0][1]) / sms
        s = section_heads(head_batches, kv_mib)
        chosen = [blocks_of(m) + x for s0 in range(0, head_batches, s) for m in reversed(range(num_m_blocks))
                  for _ in range(s0, min(head_batches, s0 + s))]
        print(name + ": " + ", ".join(f"{k} {ideal / makespan(c, sms):.3f}" for k, c in runs)
              + f"; the launcher's {s}: {ideal / makespan(chosen, sms):.3f}")


def bwd_main(sms=132, x=2.0):
    """The backward (bwd_cta_coords, launch_bwd_sm90.hpp): a CTA per key block of a (head, batch) pair, costing the
    query blocks it visits (causal: key block n of N sees N - n of them in units of kBlockN rows) plus X; the grid's
    order takes each pair's key blocks in turn, the longest first. Bytes per pair: Q, dO (bf16) and dQ (fp32) rows."""
    for head_dim, block_m, block_n in ((64, 128, 128), (128, 64, 128), (256, 64, 64)):
        for seqlen in (512, 1024, 2048, 4096, 8192):
            num_n_blocks, pairs = seqlen // block_n, (2048 // head_dim) * (16384 // seqlen)
            blocks_of = lambda m: (m + 1) * block_n / block_m  # m = num_n_blocks - 1 - n: the longest last
            runs = list(orders(num_n_blocks, blocks_of, pairs, x))
            ideal = sum(runs[0][1]) / sms
            s = section_heads(pairs, seqlen * head_dim * 8 / 2**20)
            chosen = in_sections(lambda m: blocks_of(m) + x, num_n_blocks, pairs, s)
            line = ", ".join(f"{k} {ideal / makespan(c, sms):.3f}" for k, c in runs)
            print(f"backward head_dim {head_dim} causal {seqlen}: " + line.replace("head-major", "grid order")
                  + f"; the launcher's {s}: {ideal / makespan(chosen, sms):.3f}")


def live_pairs(pair_costs, sms, samples=400):
    """Makespan and the time-averaged number of distinct pairs among the running CTAs, for CTAs (pair, cost) handed
    out in list order: a proxy for the Q, dO and dQ rows that must stay in L2 at once."""
    free = [(0.0, i) for i in range(sms)]
    heapq.heapify(free)
    spans = []
    for pair, c in pair_costs:
        t, i = heapq.heappop(free)
        spans.append((t, t + c, pair))
        heapq.heappush(free, (t + c, i))
    end = max(e for _, e, _ in spans)
    points = [end * (j + 0.5) / samples for j in range(samples)]
    return end, sum(len({p for s, e, p in spans if s <= t < e}) for t in points) / samples


def bwd_gqa_main(sms=132, x=2.0):
    """--bwd-gqa (sessions 36 and 52): the backward's GQA group CTAs (heads_per_cta = 16 / K/V heads; each costs the
    group's query blocks), 16 query heads, 16k tokens, causal: the L2 sections (bytes per pair: the group's Q, dO and
    dQ rows), one section for all pairs (key block n of every pair first), and sections of one wave (the launcher's
    wave_section_pairs since session 52), each with its makespan against the ideal and its live pairs."""
    for head_dim, block_m, block_n in ((64, 128, 128), (128, 64, 128), (256, 64, 64)):
        for seqlen in (1024, 2048, 4096, 8192, 16384):
            for kv_heads in (8, 4, 2):
                group, num_n_blocks = 16 // kv_heads, seqlen // block_n
                pairs = kv_heads * max(1, 16384 // seqlen)
                cost = lambda m: group * (m + 1) * block_n / block_m + x  # m = num_n_blocks - 1 - n
                ordered = lambda s: [(p, cost(m)) for s0 in range(0, pairs, s) for m in reversed(range(num_n_blocks))
                                     for p in range(s0, min(pairs, s0 + s))]
                l2 = section_heads(pairs, seqlen * group * head_dim * 8 / 2**20)
                fit = max(1, min(sms // num_n_blocks, pairs))
                wave = fit
                while wave > fit // 2 and pairs % wave:
                    wave -= 1
                wave = wave if pairs % wave == 0 else fit
                ideal = sum(c for _, c in ordered(pairs)) / sms
                cells = []
                for name, s in (("L2 sections", l2), ("one section", pairs), ("one wave", wave)):
                    end, live = live_pairs(ordered(s), sms)
                    cells.append(f"{name} ({s}) {ideal / end:.3f}, {live:.1f} live")
                print(f"backward GQA head_dim {head_dim} causal {seqlen} 16/{kv_heads}: " + "; ".join(cells))


if __name__ == "__main__":
    import sys

    if "--bwd-gqa" in sys.argv[1:]:
        bwd_gqa_main()
    elif "--bwd" in sys.argv[1:]:
        bwd_main()
    else:
        main()
