"""Compare two builds' forward TFLOP/s from a scripts/device_env_ab.sh run.

usage: python3 scripts/ab_compare.py DIR A B
DIR holds the unpacked env_ab_TAG.tar.gz (A_r1.json, B_r1.json, ...). Prints, per point, each build's rounds sorted
and B's median over A's median.
"""
import collections
import glob
import json
import sys


def load(d, build):
    res = collections.defaultdict(list)
    for f in sorted(glob.glob(f"{d}/{build}_r*.json")):
        for r in json.load(open(f))["results"]:
            res[(r["feature"], r["head_dim"], r["causal"], r["seqlen"])].append(r["fwd"]["tflops"]["ours"])
    return res


def main():
    d, a, b = sys.argv[1:4]
    ra, rb = load(d, a), load(d, b)
    print("feature head_dim causal seqlen |", a, "rounds |", b, "rounds | median ratio", b, "/", a)
    for k, x in ra.items():
        x, y = sorted(x), sorted(rb[k])
        rounds = lambda v: " ".join(f"{t:.0f}" for t in v)
        print(*k, "|", rounds(x), "|", rounds(y), f"| {y[len(y) // 2] / x[len(x) // 2]:.3f}")


if __name__ == "__main__":
    main()
