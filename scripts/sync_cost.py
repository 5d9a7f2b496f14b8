"""Issue 4 experiment (development): what transformers' packed-sequence check costs the eager training loop.

transformers' mask builder calls ``masking_utils.find_packed_sequence_indices(position_ids)`` at the start of every
forward when there is no attention_mask and no cache; it ends in ``(mask[:, -1] == 0).all()``, a host read of a device
value, so the host waits for the previous step's kernels and the GPU then waits while the host issues the next ones.

    PYTHONPATH=. python scripts/sync_cost.py [--no-packed-check] [train_lm.py arguments ...]

runs examples/train_lm.py unchanged, or (--no-packed-check) with that function replaced by one that returns None
without reading the device, for every backend. Only valid because train_lm never packs sequences (its position ids
always count up by one); the difference in tokens/s is what the host synchronisation costs each backend."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import train_lm  # noqa: E402
from transformers import masking_utils  # noqa: E402


def _no_check(position_ids, *args, **kwargs):
    return None


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--no-packed-check" in argv:
        argv.remove("--no-packed-check")
        masking_utils.find_packed_sequence_indices = _no_check
        print("find_packed_sequence_indices replaced: no host synchronisation per forward", flush=True)
    train_lm.main(argv)
