"""Compare two cases' TFLOP/s from a scripts/device_env_ab.sh run.

usage: python3 scripts/ab_compare.py DIR A B [fwd|bwd]
DIR is the folder unpacked from env_ab_TAG.tar.gz (env_ab_TAG/, holding A_r1.json, B_r1.json, ...); A and B are case
names as the JSON files are named (the build, then its environment settings with ' ' and '=' as '_'). Prints, per
point, each case's rounds sorted and B's median over A's median; n/a where a case has no reading.
"""
import collections
import glob
import json
import statistics
import sys


def load(d, case, direction):
    res = collections.defaultdict(list)
    for f in sorted(glob.glob(f"{d}/{case}_r*.json")):
        for r in json.load(open(f))["results"]:
            v = r.get(direction, {}).get("tflops", {}).get("ours")
            if v is not None:
                res[(r["feature"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"])].append(v)
    return res


def main():
    d, a, b = sys.argv[1:4]
    direction = sys.argv[4] if len(sys.argv) > 4 else "fwd"
    ra, rb = load(d, a, direction), load(d, b, direction)
    print(f"{direction}: feature dtype head_dim causal seqlen |", a, "rounds |", b, "rounds | median", b, "/", a)
    for k in list(ra) + [k for k in rb if k not in ra]:
        x, y = sorted(ra.get(k, [])), sorted(rb.get(k, []))
        rounds = lambda v: " ".join(f"{t:.0f}" for t in v) or "n/a"
        ratio = f"{statistics.median(y) / statistics.median(x):.3f}" if x and y else "n/a"
        print(*k, "|", rounds(x), "|", rounds(y), "|", ratio)


if __name__ == "__main__":
    main()
