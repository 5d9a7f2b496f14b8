"""Summarise an Nsight Compute SASS source page (scripts/ncu_fwd.sh's *_sass.csv): stall reasons, executed instructions
by opcode, and the forward consumer's key-block loop split into phases (turn wait, GEMM issue, wait for QKᵀ, softmax
before and after the wait for P V), as shares of the loop's stall samples, i.e. of a consumer warp's time.
Usage: ncu_phases.py FILE_sass.csv [LOOP_EXEC_COUNT] (default: the largest execution count of a HGMMA)."""
import collections
import csv
import sys

rows = list(csv.reader(open(sys.argv[1])))
hdr, data = rows[1], [r for r in rows[2:] if len(r) >= len(rows[1])]
ix = {h: i for i, h in enumerate(hdr)}
stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
recs = []
for r in data:
    src = r[ix["Source"]].strip()
    op = src.split()[1] if src.startswith("@") else src.split()[0]
    recs.append((int(r[ix["Instructions Executed"]] or 0), op, src,
                 int(r[ix["Warp Stall Sampling (All Samples)"]] or 0), {h: int(r[ix[h]] or 0) for h in stalls}))
total = sum(x[3] for x in recs)
print(f"stall samples: {total}")
st = collections.Counter()
for x in recs:
    st.update(x[4])
for h, c in st.most_common(8):
    print(f"  {h[6:]:20s} {100 * c / total:5.1f} %")
ops = collections.Counter()
for x in recs:
    ops[x[1].split(".")[0]] += x[0]
print("executed warp instructions by opcode (top 10):")
for o, c in ops.most_common(10):
    print(f"  {o:10s} {c:12d}")
# The consumer is instantiated per Q buffer (but at head_dim 64), so the loop can exist in two copies with different counts: take every
# HGMMA execution count of at least a tenth of the largest (or the one given).
counts = collections.Counter(x[0] for x in recs if x[1].startswith("HGMMA") and x[0] > 0)
loop_ns = [int(sys.argv[2])] if len(sys.argv) > 2 else sorted(n for n in counts if n >= max(counts) / 10)
acc, order, ls = collections.Counter(), [], 0
for loop_n in loop_ns:
    loop = [x for x in recs if x[0] == loop_n]
    ls += sum(x[3] for x in loop)
    phase = "loop head (K/V waits)"
    for n, op, src, s, _ in loop:
        if op.startswith("BAR.SYNC"):
            phase = "turn wait"
        elif op.startswith("WARPGROUP.ARRIVE") and phase == "turn wait":
            phase = "GEMM issue"
        elif op.startswith("WARPGROUP.DEPBAR") and "0x1" in src:
            phase = "wait for QK^T"
        elif phase == "wait for QK^T" and not op.startswith("WARPGROUP"):
            phase = "softmax before the P V wait"
        elif op.startswith("WARPGROUP.DEPBAR") and "0x0" in src:
            phase = "wait for P V"
        elif phase == "wait for P V":
            phase = "softmax after the P V wait"
        if phase not in acc:
            order.append(phase)
        acc[phase] += s
print(f"key-block loop (instructions executed {loop_ns} times): {100 * ls / total:.1f} % of samples")
for p in order:
    print(f"  {p:30s} {100 * acc[p] / ls:5.1f} %")
