"""Session 72/73 measurement (development): what torch.ops.flash_attn_hopper.doc_bounds_partition costs on CUDA
tensors (csrc/api/varlen_rows.cu: since session 73 a parallel copy of the rows that already are their own partition,
as bounds from ids are, and the one-block-per-row scan over 1024-position chunks for the others) against the ATen ops
it replaced (written out below as the C++ CPU path's same ops, run on the GPU) and the deterministic backward it
serves. "scanned" times the same bounds with one value changed per row (no row is its own partition).

    PYTHONPATH=. python scripts/doc_partition_time.py

Bounds come from document ids of random lengths (interface.document_bounds), seed 0. Prints microseconds
(triton.testing.do_bench medians) and checks the two give equal results."""

import torch
from triton.testing import do_bench

import flash_attn_hopper
from flash_attn_hopper.interface import document_bounds


def aten_partition(b):
    batch, seqlen, _ = b.shape
    starts = torch.ones(batch, seqlen, dtype=torch.bool, device=b.device)
    if seqlen > 1:
        starts[:, 1:] = (b[:, 1:] != b[:, :-1]).any(-1)
    pos = torch.arange(seqlen, dtype=b.dtype, device=b.device).expand(batch, seqlen)
    doc_start = torch.where(starts, pos, 0).cummax(1).values
    after = torch.cat([torch.where(starts, pos, seqlen)[:, 1:], torch.full((batch, 1), seqlen, dtype=b.dtype,
                                                                           device=b.device)], 1)
    doc_end = after.flip(1).cummin(1).values.flip(1)
    return torch.stack([doc_start, doc_end], -1)


def ids_of(batch, seqlen, mean_len, gen):
    rows = []
    for _ in range(batch):
        lens = []
        while sum(lens) < seqlen:
            lens.append(int(torch.randint(1, 2 * mean_len, (1,), generator=gen)))
        rows.append(torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[:seqlen])
    return torch.stack(rows).cuda()


def main():
    gen = torch.Generator().manual_seed(0)
    print("| batch | seqlen | docs (mean len) | kernel us | scanned us | ATen ops us | det. bwd ms (16 heads, "
          "hdim 128) |")
    print("|---|---|---|---|---|---|---|")
    for batch, seqlen, mean_len in [(1, 131072, 2048), (8, 4096, 512), (1, 131072, 4), (64, 2048, 256)]:
        ids = ids_of(batch, seqlen, mean_len, gen)
        b = document_bounds(ids)
        got = torch.ops.flash_attn_hopper.doc_bounds_partition(b)
        assert torch.equal(got, aten_partition(b)), (batch, seqlen)
        t_k = do_bench(lambda: torch.ops.flash_attn_hopper.doc_bounds_partition(b), return_mode="median") * 1e3
        t_a = do_bench(lambda: aten_partition(b), return_mode="median") * 1e3
        bad = b.clone()
        bad[:, -1, 1] += 1  # the last end one too far: every row is scanned
        assert torch.equal(torch.ops.flash_attn_hopper.doc_bounds_partition(bad), aten_partition(bad))
        t_s = do_bench(lambda: torch.ops.flash_attn_hopper.doc_bounds_partition(bad), return_mode="median") * 1e3
        q, k, v = (torch.randn(batch, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        out = flash_attn_hopper.attention(q, k, v, document_ids=ids, deterministic=True)
        g = torch.randn_like(out)
        t_b = do_bench(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True), return_mode="median")
        print(f"| {batch} | {seqlen} | {seqlen // mean_len} ({mean_len}) | {t_k:.1f} | {t_s:.1f} | {t_a:.1f} | "
              f"{t_b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
